"""`mogrpo doctor env`: this machine's no-GPU report, and the GPU report on stubbed devices."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from mogrpo.cli import doctor, main
from mogrpo.cli.doctor import collect, report

GIB = 2**30


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in doctor.WATCHED_ENV:
        monkeypatch.delenv(name, raising=False)


def test_no_gpu_report_says_so_and_shows_cpu_and_ram(no_gpu):
    info = collect()
    json.dumps(info)  # JSON-safe, for --json and bug reports
    text = report(info)
    assert "CUDA: not available — no GPU visible to torch; training runs on the CPU" in text
    assert f"{os.cpu_count()} logical cores" in text
    assert f"  torch         {torch.__version__}" in text
    assert "bf16                  no   no GPU (runs on the CPU use float32)" in text
    assert "bitsandbytes (4-bit)  " in text  # yes or no: see the test below
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        total_kb = int(meminfo.read_text().split("MemTotal:")[1].split()[0])
        assert f"RAM: {total_kb * 1024 / GIB:.2f} GiB total" in text
    assert info["cuda"]["gpus"] == [] and "warning" not in text
    assert "CPU products: training on " in text and "; decode on " in text


@pytest.mark.parametrize(("intel", "onednn", "training"), [
    (True, False, "training on MKL (an Intel CPU: MKL runs its own AVX-512 code)"),
    (False, False, "training on MKL (no AVX-512: oneDNN's gain over MKL's AVX2 code)"),
    (False, True, "training on oneDNN;")])
def test_the_report_names_the_kernels_of_this_cpu(no_gpu, monkeypatch, intel, onednn, training):
    from mogrpo.kernels.cpu import linear as cpu_linear

    if not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: onednn)
    monkeypatch.setattr(cpu_linear, "mkl_native", lambda cpuinfo=None: intel)
    monkeypatch.setattr(cpu_linear, "decode_on_onednn", lambda: False)
    monkeypatch.setattr(cpu_linear, "decode_on_mkl", lambda: intel)
    text = report(collect())
    assert training in text
    if intel:
        assert "decode on MKL on packed weights" in text
    else:
        assert "decode on oneDNN from 256 inputs and 2^17 weights, MKL below" in text


def test_the_report_says_which_decode_step_runs(no_gpu, monkeypatch, tmp_path):
    from mogrpo.kernels.cpu import decode_step as cpu_kernel

    monkeypatch.setenv("MOGRPO_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert "CPU decode step: Python (no C++ compiler 'no-such-compiler' to build the compiled " \
        "step: install g++ or set CXX)" in report(collect())
    monkeypatch.setenv("CXX", "sh")  # any program found on PATH
    assert "CPU decode step: compiled (built at the first CPU decode, ~30 s, once)" in \
        report(collect())
    built = cpu_kernel.cache_directory() / cpu_kernel.build_name()
    built.mkdir(parents=True)
    (built / f"{cpu_kernel.build_name()}.so").touch()
    assert "CPU decode step: compiled (built for this mogrpo, torch and CPU)" in report(collect())
    (built / cpu_kernel.FAILED).write_text("the build failed: decode_step.cpp:3: error: x\n")
    assert "CPU decode step: Python (the build failed: decode_step.cpp:3: error: x; delete " \
        f"{built} to build it again)" in report(collect())
    monkeypatch.setenv("MOGRPO_DECODE_KERNEL", "0")
    text = report(collect())
    assert "CPU decode step: Python (MOGRPO_DECODE_KERNEL=0)" in text
    assert "MOGRPO_DECODE_KERNEL=0" in text.split("environment")[-1]


def test_the_report_says_when_the_cuda_decode_graphs_are_off(two_gpus, monkeypatch):
    monkeypatch.setenv("MOGRPO_DECODE_GRAPH", "0")
    text = report(collect())
    assert "  native decode step: eager (MOGRPO_DECODE_GRAPH=0)" in text
    assert "MOGRPO_DECODE_GRAPH=0" in text.split("environment")[-1]


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch):
    """An A100 40GB nearly filled by another process, and an idle RTX 4090."""
    props = [SimpleNamespace(name="NVIDIA A100-SXM4-40GB", major=8, minor=0,
                             total_memory=42_505_273_344),
             SimpleNamespace(name="NVIDIA GeForce RTX 4090", major=8, minor=9,
                             total_memory=25_386_352_640)]
    free = [2 * GIB, 23 * GIB]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (free[i], props[i].total_memory))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda i: [int(1.5 * GIB), 0][i])
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i: [2 * GIB, 0][i])
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 90100)
    for name in doctor.WATCHED_ENV:
        monkeypatch.delenv(name, raising=False)


def test_gpu_report_shows_each_gpu_and_its_memory(two_gpus):
    info = collect()
    a100, rtx = info["cuda"]["gpus"]
    # other processes = total - free - reserved by this process
    assert a100["other_processes"] == 42_505_273_344 - 2 * GIB - 2 * GIB
    text = report(info)
    assert "CUDA: available (torch built for CUDA 12.4, cuDNN 90100), 2 GPU(s)" in text
    assert ("GPU 0: NVIDIA A100-SXM4-40GB, compute 8.0, 39.59 GiB total, 2.00 GiB free "
            "(95% in use); this process: allocated 1.50 GiB, reserved 2.00 GiB; other "
            "processes 35.59 GiB") in text
    assert "GPU 1: NVIDIA GeForce RTX 4090, compute 8.9, 23.64 GiB total, 23.00 GiB free (3% in use)" in text
    assert "warning: GPU 0 is 95% full (35.59 GiB held by other processes)" in text
    assert "GPU 1 is" not in text
    assert "  native decode step: CUDA graphs, one per bucket of rows" in text
    assert "bf16                  yes  supported by the GPU" in text
    # flash_attn and bitsandbytes are not installed here: reported, not crashed on
    assert "flash_attention_2     no   not installed" in text


def test_pre_ampere_gpu_has_no_bf16_nor_flash_attention(two_gpus, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name="Tesla T4", major=7, minor=5, total_memory=16 * GIB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(doctor, "_importable", lambda module: (True, "importable"))
    features = collect()["features"]
    assert features["bf16"][0] is False and "float16" in features["bf16"][1]
    assert features["flash_attention_2"] == [False, "needs a GPU of compute capability 8.0+"]
    assert features["bitsandbytes (4-bit)"] == [True, "importable with CUDA"]


@pytest.mark.parametrize(("importable", "version", "status"), [
    ((False, "not installed"), None, [False, "not installed"]),
    ((True, "importable"), "0.45.5", [False, "0.45.5 has CUDA kernels only; on the CPU it needs "
                                            ">= 0.46.1"]),
    ((True, "importable"), "0.46.1", [True, "importable, 0.46.1 runs 4-/8-bit weights on the "
                                           "CPU (8-bit optimizers from 0.50.0)"]),
    ((True, "importable"), "0.50.0", [True, "importable, 0.50.0 runs 4-/8-bit weights and 8-bit "
                                           "optimizers on the CPU"]),
])
def test_without_a_gpu_4bit_weights_need_bitsandbytes_0_46_1_and_optimizers_0_50(no_gpu, monkeypatch, importable,
                                                            version, status):
    from mogrpo.config import hardware

    real = doctor._importable
    monkeypatch.setattr(doctor, "_importable", lambda module: importable
                        if module == "bitsandbytes" else real(module))
    monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: version)
    assert collect()["features"]["bitsandbytes (4-bit)"] == status


def test_leftover_wandb_variables_are_warned_about(no_gpu, monkeypatch):
    monkeypatch.setenv("WANDB_RUN_ID", "abc123")
    text = report(collect())
    assert "  WANDB_RUN_ID=abc123" in text
    assert "warning: WANDB_RUN_ID is set: the next run attaches to that W&B run" in text


def test_main_prints_json(no_gpu, capsys):
    assert main(["doctor", "env", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cuda"]["available"] is False and data["packages"]["torch"] == torch.__version__

"""`mogrpo doctor`: a checkpoint (`mogrpo.checkpoint.doctor` writes that report), or what this
machine offers a run (`doctor env`) — versions, GPUs and their memory, kernels.

`collect()` gathers plain data (JSON-safe, testable with stubbed `torch.cuda` functions);
`report()` turns it into the text a user pastes into a bug report.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

from mogrpo.cli.args import add_overrides

GIB = 2**30
PACKAGES = ("mogrpo", "torch", "transformers", "peft", "accelerate", "datasets", "bitsandbytes",
            "flash_attn", "triton")
FULL_GPU = 0.9
"""A GPU whose memory is more than this fraction in use is reported as (nearly) full."""
# Variables that silently change a run: leftovers from an earlier run attach to the wrong
# W&B run (USERS.md #8), the others pick devices, caches and allocator behaviour.
WATCHED_ENV = ("CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF", "HF_HOME", "HF_HUB_OFFLINE",
               "TRANSFORMERS_OFFLINE", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_MODE", "OMP_NUM_THREADS",
               "MOGRPO_DECODE_KERNEL", "MOGRPO_KERNEL_CACHE", "MOGRPO_DECODE_GRAPH")
STALE_ENV = {"WANDB_RUN_ID": "the next run attaches to that W&B run",
             "WANDB_RESUME": "the next run resumes a W&B run instead of starting one"}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name.replace("_", "-"))
    except importlib.metadata.PackageNotFoundError:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None


def _importable(module: str) -> tuple[bool, str]:
    """Whether `module` imports; the first line of the error when it does not."""
    if importlib.util.find_spec(module) is None:
        return False, "not installed"
    try:
        importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - a broken CUDA extension raises anything
        first = (str(err).splitlines() or [type(err).__name__])[0]
        return False, f"installed but fails to import: {first}"
    return True, "importable"


def _cpu() -> dict[str, Any]:
    """CPU model, logical and usable cores, which library computes its float32 products, RAM
    total and available (Linux /proc, else sysconf)."""
    info: dict[str, Any] = {"model": platform.processor() or platform.machine(),
                            "logical_cores": os.cpu_count()}
    if hasattr(os, "sched_getaffinity"):  # cores this process may use (containers, taskset)
        info["usable_cores"] = len(os.sched_getaffinity(0))
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
    from mogrpo import kernels

    # which library computes the float32 products; the native engine's CPU decode step
    # (compiled or Python) and its CUDA one (graphed or eager)
    info.update(kernels.describe())
    meminfo = Path("/proc/meminfo")
    if meminfo.is_file():
        fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
        info["ram_total"] = int(fields["MemTotal"].split()[0]) * 1024
        if "MemAvailable" in fields:
            info["ram_available"] = int(fields["MemAvailable"].split()[0]) * 1024
    elif hasattr(os, "sysconf"):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        info["ram_total"] = pages * size
    return info


def _gpus(torch: Any) -> list[dict[str, Any]]:
    gpus = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        reserved = torch.cuda.memory_reserved(i)
        gpus.append({
            "index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
            "total": int(props.total_memory), "free": int(free),
            "allocated": int(torch.cuda.memory_allocated(i)), "reserved": int(reserved),
            # what neither this process's allocator holds nor is free: other processes, contexts
            "other_processes": max(0, int(total) - int(free) - int(reserved)),
        })
    return gpus


def _features(torch: Any, cuda: bool, gpus: list[dict[str, Any]]) -> dict[str, tuple[bool, str]]:
    features: dict[str, tuple[bool, str]] = {}
    if cuda:
        bf16 = bool(torch.cuda.is_bf16_supported())
        features["bf16"] = (bf16, "supported by the GPU" if bf16 else
                            "not supported (pre-Ampere GPU): model.precision auto trains "
                            "fp16-mixed (float16 compute, dynamic loss scale)")
    else:
        features["bf16"] = (False, "no GPU (runs on the CPU use float32)")
    ok, why = _importable("flash_attn")
    ampere = all(float(g["capability"]) >= 8.0 for g in gpus) and bool(gpus)
    features["flash_attention_2"] = (ok and ampere, why if not ok else "importable, GPU sm80+"
                                     if ampere else "needs a GPU of compute capability 8.0+")
    features["bitsandbytes (4-bit)"] = _bitsandbytes_status(cuda)
    features["torch.compile"] = _compile_status(torch, cuda)
    return features


def _bitsandbytes_status(cuda: bool) -> tuple[bool, str]:
    """Whether 4-bit (and 8-bit) weights load here: bitsandbytes importable, and without a GPU
    recent enough to have CPU kernels (`BNB_CPU_MIN`); and whether its 8-bit optimizers step
    CPU tensors (`BNB_CPU_OPTIM_MIN`)."""
    from packaging.version import Version

    from mogrpo.config.hardware import BNB_CPU_MIN, BNB_CPU_OPTIM_MIN, bitsandbytes_version

    ok, why = _importable("bitsandbytes")
    if not ok:
        return False, why
    if cuda:
        return True, "importable with CUDA"
    version = bitsandbytes_version()
    if version and Version(version) >= Version(BNB_CPU_OPTIM_MIN):
        return True, f"importable, {version} runs 4-/8-bit weights and 8-bit optimizers on the CPU"
    if version and Version(version) >= Version(BNB_CPU_MIN):
        return True, (f"importable, {version} runs 4-/8-bit weights on the CPU (8-bit optimizers "
                      f"from {BNB_CPU_OPTIM_MIN})")
    return False, f"{version} has CUDA kernels only; on the CPU it needs >= {BNB_CPU_MIN}"


def _compile_status(torch: Any, cuda: bool) -> tuple[bool, str]:
    """Heuristic: inductor needs triton on GPU and a C++ compiler on CPU (nothing is compiled)."""
    if not hasattr(torch, "compile"):
        return False, "torch < 2.0"
    if sys.platform == "win32":
        return False, "inductor is not supported on Windows"
    if cuda:
        found = importlib.util.find_spec("triton") is not None
        return found, "triton found" if found else "triton missing: `pip install triton`"
    compiler = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    return bool(compiler), f"CPU inductor via {compiler}" if compiler else "no C++ compiler on PATH"


def collect() -> dict[str, Any]:
    """Everything `report` prints, as JSON-safe data."""
    import torch

    cuda = bool(torch.cuda.is_available())
    gpus = _gpus(torch) if cuda else []
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "platform": platform.platform()},
        "packages": {name: _version(name) for name in PACKAGES},
        "cuda": {"available": cuda, "torch_cuda": torch.version.cuda,
                 "cudnn": torch.backends.cudnn.version() if cuda else None, "gpus": gpus},
        "cpu": _cpu(),
        "features": {k: list(v) for k, v in _features(torch, cuda, gpus).items()},
        "env": {name: os.environ[name] for name in WATCHED_ENV if name in os.environ},
    }


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.2f} GiB"


def report(info: dict[str, Any]) -> str:
    """The environment as readable text, with a warning line for each problem found."""
    py, cuda, cpu = info["python"], info["cuda"], info["cpu"]
    lines = [f"Python {py['version']} ({py['executable']}) on {py['platform']}", "", "packages:"]
    lines += [f"  {name:<13} {version or 'not installed'}"
              for name, version in info["packages"].items()]
    warnings: list[str] = []
    lines.append("")
    if cuda["available"]:
        lines.append(f"CUDA: available (torch built for CUDA {cuda['torch_cuda']}, cuDNN "
                     f"{cuda['cudnn']}), {len(cuda['gpus'])} GPU(s)")
        for g in cuda["gpus"]:
            used = 1 - g["free"] / g["total"] if g["total"] else 0.0
            lines.append(
                f"  GPU {g['index']}: {g['name']}, compute {g['capability']}, {_gib(g['total'])} "
                f"total, {_gib(g['free'])} free ({used:.0%} in use); this process: allocated "
                f"{_gib(g['allocated'])}, reserved {_gib(g['reserved'])}; other processes "
                f"{_gib(g['other_processes'])}")
            if used > FULL_GPU:
                warnings.append(
                    f"GPU {g['index']} is {used:.0%} full ({_gib(g['other_processes'])} held by "
                    "other processes): `nvidia-smi` shows which; stop them or pick another GPU "
                    "with CUDA_VISIBLE_DEVICES")
        if "decode_graph" in cpu:
            lines.append(f"  native decode step: {cpu['decode_graph']}")
    else:
        lines.append("CUDA: not available — no GPU visible to torch; training runs on the CPU "
                     "(slow; fine for the tiny demo)")
        if cuda.get("torch_cuda") is None:
            lines.append("  this torch build has no CUDA support (a CPU wheel)")
    lines.append(f"CPU: {cpu.get('model')}, {cpu.get('logical_cores')} logical cores"
                 + (f" ({cpu['usable_cores']} usable)" if "usable_cores" in cpu else ""))
    if "kernels" in cpu:
        lines.append(f"CPU products: training on {cpu['kernels']['training']}; decode on "
                     f"{cpu['kernels']['decode']}")
    if "decode_step" in cpu:
        lines.append(f"CPU decode step: {cpu['decode_step']}")
    if "ram_total" in cpu:
        available = f", {_gib(cpu['ram_available'])} available" if "ram_available" in cpu else ""
        lines.append(f"RAM: {_gib(cpu['ram_total'])} total{available}")
    lines += ["", "features:"]
    lines += [f"  {name:<21} {'yes' if ok else 'no ':<4} {why}"
              for name, (ok, why) in info["features"].items()]
    if info["env"]:
        lines += ["", "environment:"] + [f"  {k}={v}" for k, v in info["env"].items()]
        warnings += [f"{k} is set: {why}; unset it unless you mean to"
                     for k, why in STALE_ENV.items() if k in info["env"]]
    if warnings:
        lines += ["", *(f"warning: {w}" for w in warnings)]
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `doctor CHECKPOINT [--config CONFIG] [--set K=V ...]` and `doctor env [--json]`."""
    parser = subparsers.add_parser(
        "doctor", help="diagnose a checkpoint (or the environment: `mogrpo doctor env`)",
        description="`mogrpo doctor CHECKPOINT [--config CONFIG]`: integrity per file, step, "
        "config summary and hash, package versions then and now, controller states, and — "
        "with --config — whether resuming with that config would be allowed, with the diff. "
        "`mogrpo doctor env [--json]`: Python and library versions, each GPU's name, compute "
        "capability and memory (total, free, allocated and reserved by this process, held by "
        "others), whether bf16, flash-attention, bitsandbytes and torch.compile are usable, CPU "
        "and RAM, and environment variables that change a run.",
    )
    parser.add_argument("target", help="`env`, or a checkpoint directory (RUN/checkpoints/step-N)")
    parser.add_argument("--config", type=Path, help="a config to check a resume against")
    parser.add_argument("--json", action="store_true", help="`doctor env`: print JSON")
    add_overrides(parser)
    parser.set_defaults(handler=cmd_doctor)
    return parser


def cmd_doctor(args: argparse.Namespace) -> int:
    if args.target == "env":
        info = collect()
        print(json.dumps(info, indent=2) if args.json else report(info))
        return 0
    from mogrpo.config import load_config
    from mogrpo.errors import ExitCode, MogrpoError

    path = Path(args.target)
    if not path.is_dir():
        raise MogrpoError(f"{path} is not a checkpoint directory (RUN/checkpoints/step-N)")
    if args.overrides and not args.config:
        raise MogrpoError("--set changes the config a resume is checked against: pass it with "
                          "--config")
    config = load_config(args.config, args.overrides)[0] if args.config else None
    if (path / "checkpoints").is_dir() and not (path / "manifest.json").is_file():
        raise MogrpoError(f"{path} is a run directory, not a checkpoint: list its checkpoints "
                          f"with `mogrpo checkpoints {path}` and pass one (RUN/checkpoints/step-N)")
    # a step directory without its manifest is an incomplete checkpoint; any other directory
    # without one (empty, checkpoints/ itself) is not a checkpoint at all
    if not (path.name.startswith("step-") or (path / "manifest.json").is_file()):
        raise MogrpoError(f"{path} is not a checkpoint directory (RUN/checkpoints/step-N)")
    from mogrpo.checkpoint.doctor import doctor_report  # imports torch: after the config

    problems: list[str] = []
    print(doctor_report(path, config, problems))
    for problem in problems:
        print(f"problem: {problem}")
    return ExitCode.FOUND_PROBLEM if problems else 0

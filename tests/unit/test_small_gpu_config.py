"""The small-GPU settings at config validation, before any model loads: `train.optimizer`,
`model.load_in_4bit` / `load_in_8bit` and `distributed.cpu_offload`, with bitsandbytes (of a
given version) and a CUDA GPU simulated present or absent."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from mogrpo.config import hardware, load_config
from mogrpo.config.processes import check_processes
from mogrpo.errors import ConfigError

BASE = {
    "model": {"name_or_path": "some/model"},
    "tasks": {"t": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}},
    "rollout": {"num_generations": 4},
    "train": {"micro_batch_size": 8, "gradient_accumulation_steps": 1},
}
INSTALL = "(`pip install 'mogrpo[gpu]'`)"


@pytest.fixture
def machine(monkeypatch):
    """`machine(bnb=..., cuda=...)`: what this machine has, as validation sees it (`bnb` a
    version string, True for a recent one)."""
    real = importlib.util.find_spec

    def set_(bnb: bool | str, cuda: bool) -> None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
            (object() if bnb else None) if name == "bitsandbytes" else real(name, *a)))
        monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: (
            "0.50.2" if bnb is True else bnb or None))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)

    return set_


def validate(*overrides: str, machine: bool = True):
    return load_config(None, list(overrides), environ={}, base=BASE, machine=machine)[0]


def error(*overrides: str, machine: bool = True) -> str:
    with pytest.raises(ConfigError) as err:
        validate(*overrides, machine=machine)
    return str(err.value)


@pytest.mark.parametrize("optimizer", ["adamw", "adafactor"])
def test_optimizers_without_bitsandbytes_validate_anywhere(machine, optimizer):
    machine(bnb=False, cuda=False)
    assert validate(f"train.optimizer={optimizer}").train.optimizer == optimizer
    assert validate().train.optimizer == "adamw"  # the default


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit"])
def test_8bit_optimizers_name_the_install_and_on_a_cpu_0_50(machine, optimizer):
    machine(bnb=False, cuda=True)
    text = error(f"train.optimizer={optimizer}")
    assert (f"train.optimizer = {optimizer} needs bitsandbytes {INSTALL}, but bitsandbytes is "
            "not installed; or on this machine use train.optimizer: adamw") in text
    machine(bnb="0.49.2", cuda=False)  # CUDA kernels only
    assert ("but on a CPU it needs bitsandbytes >= 0.50.0 (older ones step CUDA tensors only) "
            "and 0.49.2 is installed; upgrade it (`pip install -U 'bitsandbytes>=0.50.0'`)"
            ) in error(f"train.optimizer={optimizer}")
    machine(bnb="0.49.2", cuda=True)
    assert validate(f"train.optimizer={optimizer}").train.optimizer == optimizer  # on the GPU
    assert "on a CPU it needs bitsandbytes >= 0.50.0" in error(
        f"train.optimizer={optimizer}", "device=cpu")
    for cuda in (False, True):
        machine(bnb="0.50.0", cuda=cuda)
        for device in ("auto", "cpu"):
            assert validate(f"train.optimizer={optimizer}", f"device={device}")
    machine(bnb=False, cuda=False)
    assert validate(f"train.optimizer={optimizer}", "device=cpu", machine=False)  # elsewhere


def test_an_unknown_optimizer_lists_the_names():
    assert "'adamw', 'adamw_8bit', 'paged_adamw_8bit' or 'adafactor'" in error(
        "train.optimizer=sgd")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantised_weights_need_bitsandbytes_lora_and_on_a_cpu_0_46_1(machine, bits):
    field = f"model.load_in_{bits}bit"
    lora = (f"{field}=true", "lora.enabled=true")
    machine(bnb=False, cuda=False)
    assert (f"{field} = true needs bitsandbytes {INSTALL}, but bitsandbytes is not installed; "
            f"install it, or on this machine set {field}: false") in error(*lora)
    machine(bnb="0.45.5", cuda=False)  # CUDA kernels only
    assert (f"{field} = true on a CPU needs bitsandbytes >= 0.46.1 (older ones have CUDA kernels "
            f"only), but 0.45.5 is installed; upgrade it (`pip install -U "
            f"'bitsandbytes>=0.46.1'`), or set {field}: false") in error(*lora)
    machine(bnb="0.45.5", cuda=True)
    assert getattr(validate(*lora).model, f"load_in_{bits}bit")  # on the GPU
    assert "on a CPU needs bitsandbytes >= 0.46.1" in error(*lora, "device=cpu")
    for cuda in (False, True):
        machine(bnb="0.46.1", cuda=cuda)
        for device in ("auto", "cpu"):
            assert getattr(validate(*lora, f"device={device}").model, f"load_in_{bits}bit")
    machine(bnb=False, cuda=False)
    assert validate(*lora, "device=cpu", machine=False)  # `mogrpo memory`, for another machine
    assert (f"{field} trains nothing without LoRA (quantised weights are frozen); set "
            "lora.enabled: true") in error(f"{field}=true")
    assert f"set {field}: false or use engine: auto" in error(
        f"{field}=true", "lora.enabled=true", "rollout.engine=vllm",
        "rollout.vllm.server_url=http://gpu:8000")


def test_4bit_embeddings_need_a_4bit_base(machine):
    machine(bnb=True, cuda=False)
    for base in ("model.load_in_8bit=true", "model.load_in_4bit=false"):
        assert ("model.embeddings_in_4bit stores the embedding and head in NF4 beside a 4-bit "
                "base; set model.load_in_4bit: true as well, or embeddings_in_4bit: false") in error(
            "model.embeddings_in_4bit=true", base, "lora.enabled=true")
    assert validate("model.embeddings_in_4bit=true", "model.load_in_4bit=true",
                    "lora.enabled=true").model.embeddings_in_4bit


def test_4bit_and_8bit_exclude_each_other_and_every_problem_is_listed(machine):
    machine(bnb=False, cuda=False)
    text = error("model.load_in_4bit=true", "model.load_in_8bit=true",
                 "train.optimizer=adamw_8bit")
    assert "model.load_in_4bit and model.load_in_8bit are both set" in text
    assert "trains nothing without LoRA" in text
    assert "model.load_in_4bit = true needs bitsandbytes" in text
    assert "train.optimizer = adamw_8bit needs bitsandbytes" in text


def test_cpu_offload_is_fsdp2s_and_needs_a_gpu(machine):
    machine(bnb=False, cuda=True)
    for strategy in ("auto", "ddp", "none"):
        assert (f"distributed.cpu_offload moves FSDP2's shards to host memory, but "
                f"distributed.strategy is {strategy}; set it to fsdp") in error(
            "distributed.cpu_offload=true", f"distributed.strategy={strategy}")
    offload = ("distributed.cpu_offload=true", "distributed.strategy=fsdp")
    config = validate(*offload)
    assert check_processes(config, 2) == "fsdp"
    with pytest.raises(ConfigError, match="one process shards nothing; run several"):
        check_processes(config, 1)
    machine(bnb=False, cuda=False)
    assert "distributed.cpu_offload frees GPU memory, but this run has no CUDA GPU" in error(
        *offload)
    assert "has no CUDA GPU" in error(*offload, "device=cpu", machine=False)


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "paged_adamw_8bit", "adafactor"])
def test_fsdp_steps_only_adamw(machine, optimizer):
    machine(bnb=True, cuda=True)
    config = validate(f"train.optimizer={optimizer}", "distributed.strategy=fsdp")
    with pytest.raises(ConfigError, match=f"train.optimizer = {optimizer} cannot step FSDP2's "
                       r"sharded parameters \(DTensors\): only adamw can; use adamw or "
                       "distributed.strategy: ddp"):
        check_processes(config, 2)
    ddp = validate(f"train.optimizer={optimizer}", "distributed.strategy=ddp")
    assert check_processes(ddp, 2) == "ddp"


def test_fsdp_refuses_8bit_weights_as_it_does_4bit(machine):
    machine(bnb=True, cuda=True)
    config = validate("model.load_in_8bit=true", "lora.enabled=true",
                      "distributed.strategy=fsdp")
    with pytest.raises(ConfigError, match=r"cannot shard quantised weights "
                       r"\(model.load_in_8bit\); use distributed.strategy: ddp"):
        check_processes(config, 2)

"""What a run asks of this machine is checked before any data or model loads (`mogrpo train`,
the Python API), not by the commands that read a config meant for another machine: a CUDA GPU
for `device: cuda`, bfloat16, bitsandbytes for 4-bit weights."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

from mogrpo.config import load_config
from mogrpo.config import machine as machine_checks
from mogrpo.errors import ConfigError

TASKS = {"t": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}}


@pytest.fixture
def small(tmp_path) -> Path:
    LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, vocab_size=300,
                max_position_embeddings=128).save_pretrained(tmp_path / "m")
    (tmp_path / "m" / "tokenizer_config.json").write_text("{}")  # a run needs tokenizer files
    return tmp_path / "m"


def load(model: Path, *overrides: str, machine: bool = False):
    return load_config(None, list(overrides), environ={}, machine=machine,
                       base={"model": {"name_or_path": str(model)}, "tasks": TASKS})


def test_4bit_weights_need_lora_and_bitsandbytes_and_flash_attention_its_package(small, monkeypatch):
    with pytest.raises(ConfigError) as err:
        load(small, "model.load_in_4bit=true")  # whatever the machine
    assert str(err.value) == ("invalid config:\n  model.load_in_4bit trains nothing without LoRA "
                              "(quantised weights are frozen); set lora.enabled: true")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in (
        "bitsandbytes", "flash_attn") else find_spec(name, *a))
    lora_4bit = {"model": {"name_or_path": str(small), "load_in_4bit": True},
                 "lora": {"enabled": True}, "tasks": TASKS}
    with pytest.raises(ConfigError) as err:
        load_config(None, [], environ={}, base=lora_4bit)
    assert str(err.value) == (
        "invalid config:\n  model.load_in_4bit = true needs bitsandbytes (`pip install "
        "'mogrpo[gpu]'`), but bitsandbytes is not installed; install it, or on this machine set "
        "model.load_in_4bit: false")
    load_config(None, [], environ={}, base=lora_4bit, machine=False)  # `mogrpo memory`
    with pytest.raises(ConfigError) as err:
        load(small, "model.attn_implementation=flash_attention_2", machine=True)
    assert str(err.value) == (
        "invalid config:\n  model.attn_implementation = 'flash_attention_2' needs a CUDA GPU and "
        "the `flash_attn` package; install it or use attn_implementation 'sdpa' (the default) or "
        "'eager'")


def test_dtype_support_is_checked_on_this_machine(small, monkeypatch):
    monkeypatch.setattr(machine_checks, "cuda_visible", lambda: False)
    with pytest.raises(ConfigError) as err:
        load(small, "device=cuda", machine=True)
    assert str(err.value) == f"invalid config:\n  {machine_checks.NO_CUDA}"
    monkeypatch.setattr(machine_checks, "cuda_visible", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100-SXM2-16GB")
    with pytest.raises(ConfigError) as err:
        load(small, "model.dtype=bfloat16", machine=True)
    assert str(err.value) == (
        "invalid config:\n  model.precision = bf16-mixed: this GPU (Tesla V100-SXM2-16GB) has "
        "no bfloat16; use fp16-mixed (float32 weights, float16 compute with loss scaling) or "
        "fp32")
    assert load(small, machine=True)[0].model.precision == "auto"  # auto: fp16-mixed there
    assert load(small, "model.dtype=bfloat16", "device=cpu", machine=True)  # CPUs have bf16
    assert load(small, "model.dtype=float16", "device=cpu", machine=True)  # fp16 autocast too

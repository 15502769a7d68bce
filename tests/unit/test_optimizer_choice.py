"""`train.optimizer`: the class each name builds and its settings (bitsandbytes replaced by a
fake module that records what it is given); Adafactor, and bitsandbytes' real 8-bit AdamW on
the CPU where it is installed (>= 0.50), training a tiny causal LM and resuming from a
checkpoint to the same bits."""

from __future__ import annotations

import importlib.util
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.optimization import Adafactor

from mogrpo.checkpoint.store import load_checkpoint, load_weights, save_checkpoint
from mogrpo.config import hardware
from mogrpo.config.sections import TrainConfig
from mogrpo.errors import ConfigError
from mogrpo.trainer.optim import build_optimizer, train_optimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 20))
    model[0].weight.requires_grad_(False)  # frozen: the optimizer must not hold it
    return model


class _Recorded:
    """What a fake bitsandbytes optimizer class was built with."""

    def __init__(self, params, **kwargs) -> None:
        self.params, self.kwargs = list(params), kwargs


@pytest.fixture
def fake_bitsandbytes(monkeypatch):
    """bitsandbytes 0.50.2 with `optim.AdamW8bit` and `optim.PagedAdamW8bit`, on a machine with
    CUDA."""
    module = types.ModuleType("bitsandbytes")
    module.optim = types.SimpleNamespace(AdamW8bit=type("AdamW8bit", (_Recorded,), {}),
                                         PagedAdamW8bit=type("PagedAdamW8bit", (_Recorded,), {}))
    monkeypatch.setitem(sys.modules, "bitsandbytes", module)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
        object() if name == "bitsandbytes" else real(name, *a)))
    monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: "0.50.2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return module


def test_adamw_is_the_default_and_fused():
    optimizer = train_optimizer(_model(), TrainConfig(learning_rate=3e-4, weight_decay=0.1,
                                                      adam_betas=(0.8, 0.9)))
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"], group["betas"], group["fused"]) == (
        3e-4, 0.1, (0.8, 0.9), True)
    assert len(group["params"]) == 2  # the head's weight and bias, not the frozen embedding


def test_adafactor_takes_the_learning_rate_as_given():
    optimizer = train_optimizer(_model(), TrainConfig(optimizer="adafactor", learning_rate=3e-4,
                                                      weight_decay=0.1))
    assert type(optimizer) is Adafactor
    group = optimizer.param_groups[0]
    assert (group["lr"], group["weight_decay"]) == (3e-4, 0.1)
    # no relative step size and no scaling by each weight's RMS: lr is the step, as for AdamW
    assert not group["scale_parameter"] and not group["relative_step"]
    assert not group["warmup_init"] and group["beta1"] is None  # no first moment: small state


@pytest.mark.parametrize(("kind", "cls"), [("adamw_8bit", "AdamW8bit"),
                                           ("paged_adamw_8bit", "PagedAdamW8bit")])
def test_8bit_optimizers_come_from_bitsandbytes(fake_bitsandbytes, kind, cls):
    model = _model().to("meta")  # off the CPU: the paged one pages GPU memory
    optimizer = build_optimizer(model, 3e-4, 0.1, (0.8, 0.9), kind)
    assert type(optimizer) is getattr(fake_bitsandbytes.optim, cls)
    assert optimizer.kwargs == {"lr": 3e-4, "betas": (0.8, 0.9), "weight_decay": 0.1}
    assert optimizer.params == [model[1].weight, model[1].bias]


def test_on_a_cpu_the_paged_8bit_optimizer_is_the_plain_one(fake_bitsandbytes):
    """Nothing to page on a CPU (bitsandbytes itself falls back, warning at every state)."""
    optimizer = build_optimizer(_model(), 3e-4, 0.0, (0.9, 0.999), "paged_adamw_8bit")
    assert type(optimizer) is fake_bitsandbytes.optim.AdamW8bit


def test_8bit_optimizers_without_bitsandbytes_or_on_an_old_one_say_how_to_get_them(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(ConfigError, match=r"train.optimizer = adamw_8bit needs bitsandbytes "
                       r"\(`pip install 'mogrpo\[gpu\]'`\), but bitsandbytes is not installed"):
        build_optimizer(_model(), 1e-3, 0.0, (0.9, 0.999), "adamw_8bit")
    monkeypatch.setattr(hardware, "bitsandbytes_version", lambda: "0.49.2")
    for cuda in (False, True):  # the weights are on the CPU either way
        monkeypatch.setattr(torch.cuda, "is_available", lambda cuda=cuda: cuda)
        with pytest.raises(ConfigError) as err:
            build_optimizer(_model(), 1e-3, 0.0, (0.9, 0.999), "paged_adamw_8bit")
        assert ("train.optimizer = paged_adamw_8bit needs bitsandbytes (`pip install "
                "'mogrpo[gpu]'`), but on a CPU it needs bitsandbytes >= 0.50.0 (older ones step "
                "CUDA tensors only) and 0.49.2 is installed; upgrade it (`pip install -U "
                "'bitsandbytes>=0.50.0'`)") == str(err.value)


def _steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list) -> list[float]:
    losses = []
    for ids in batches:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _trains_and_resumes(model_dir: Path, checkpoints: Path, kind: str,
                        check: Callable[[torch.nn.Module, torch.optim.Optimizer], None]) -> None:
    """`kind` trains a tiny LM (4 steps over 2 batches twice: the loss falls), `check` looks at
    its model and state, and 2 more steps from a checkpoint of it equal 2 more steps of it to
    the bit."""
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(3, 100, (4, 12), generator=generator) for _ in range(2)] * 3

    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        return model, build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), kind)

    model, optimizer = fresh()
    losses = _steps(model, optimizer, batches[:4])
    assert losses[3] < losses[1] < losses[0]  # the same two batches again: learned
    check(model, optimizer)
    path = save_checkpoint(checkpoints, 4, model=model, optimizer=optimizer, state={},
                           config_yaml="")
    whole = _steps(model, optimizer, batches[4:])
    resumed, optimizer = fresh()
    loaded = load_checkpoint(path)
    load_weights(resumed, loaded.weights)
    optimizer.load_state_dict(loaded.optimizer)
    assert _steps(resumed, optimizer, batches[4:]) == whole
    for a, b in zip(model.parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b)


def test_adafactor_trains_a_tiny_lm_and_resumes_to_the_same_bits(tiny_model_dir, tmp_path: Path):
    def factored(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        state = optimizer.state_dict()["state"]
        matrix = next(s for s in state.values() if "exp_avg_sq_row" in s)
        assert {"step", "exp_avg_sq_row", "exp_avg_sq_col", "RMS"} == set(matrix)

    _trains_and_resumes(tiny_model_dir, tmp_path, "adafactor", factored)


@pytest.mark.parametrize("saved_kind", ["adafactor", "adamw"])
def test_a_resume_that_changed_the_optimizer_starts_its_state_afresh(monkeypatch, caplog,
                                                                     saved_kind):
    """With --allow-config-change a checkpoint of another optimizer loads its weights only:
    AdamW's m and v cannot be an Adafactor's row and column means."""
    from types import SimpleNamespace

    from mogrpo.checkpoint import store
    from mogrpo.config import RunConfig, to_yaml
    from mogrpo.trainer.state import RunState

    def trained(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        model = _model()
        optimizer = build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), kind)
        model(torch.tensor([1, 2]))[:, 0].sum().backward()
        optimizer.step()
        return model, optimizer

    def config(kind: str) -> RunConfig:
        return RunConfig.model_validate({"train": {"optimizer": kind}})

    saved_model, saved_optimizer = trained(saved_kind)
    rng, rng_json = store.rng_state()
    loaded = store.Loaded(None, {"rng": rng_json}, store.trainable_weights(saved_model),
                          saved_optimizer.state_dict(), rng, to_yaml(config(saved_kind)))
    model = _model()
    optimizer = build_optimizer(model, 1e-2, 0.0, (0.9, 0.999), "adafactor")
    state = RunState(config("adafactor"), SimpleNamespace(policy=model),
                     SimpleNamespace(optimizer=optimizer), *[None] * 7)
    monkeypatch.setattr(RunState, "load_state_dict", lambda self, state: None)
    state.restore(loaded)
    assert torch.equal(model[1].weight, saved_model[1].weight)  # the weights, either way
    if saved_kind == "adafactor":
        assert optimizer.state_dict()["state"][0]["step"] == 1
    else:
        assert optimizer.state_dict()["state"] == {}
        assert "train.optimizer changed from adamw to adafactor: its state starts empty" \
            in caplog.text


def _cpu_8bit_optimizers() -> bool:
    version = hardware.bitsandbytes_version()
    from packaging.version import Version

    return version is not None and Version(version) >= Version(hardware.BNB_CPU_OPTIM_MIN)


@pytest.mark.skipif(not _cpu_8bit_optimizers(),
                    reason=f"bitsandbytes >= {hardware.BNB_CPU_OPTIM_MIN} is not installed")
def test_8bit_adamw_trains_a_tiny_lm_on_a_cpu_as_planned_and_resumes_to_the_same_bits(
        tiny_model_dir, tmp_path: Path):
    from mogrpo.memory.optimizer import Trained, state_bytes

    def as_planned(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        # uint8 m and v for every tensor of 4,096 values or more; the planner's figure to the
        # byte (the 256-value quantisation maps are one tensor shared by every state)
        params = [p for p in model.parameters() if p.requires_grad]
        states = [optimizer.state[p] for p in params]
        for p, state in zip(params, states, strict=True):
            assert state["state1"].dtype == (torch.uint8 if p.numel() >= 4096 else torch.float32)
        held = sum(t.numel() * t.element_size() for s in states for key, t in s.items()
                   if key in ("state1", "state2", "absmax1", "absmax2"))
        trained = Trained(tuple((p.numel(), 1) for p in params if p.dim() > 1),
                          sum(p.numel() for p in params if p.dim() == 1))
        assert held == state_bytes("adamw_8bit", trained, 4)

    _trains_and_resumes(tiny_model_dir, tmp_path, "adamw_8bit", as_planned)

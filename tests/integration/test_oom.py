"""`memory.on_oom: adapt`: an out-of-memory error, injected once in generation, the log-prob
pass or the update's backward, halves the size and redoes the step; the run ends with the
weights (bit for bit) of a run configured with the smaller size from the start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from kept_logging import logging_kept
from mogrpo.cli import main
from mogrpo.demo import demo_base
from mogrpo.errors import ExitCode
from mogrpo.trainer import grpo, update
from mogrpo.trainer.parallel import ParallelPolicy

STEPS = 2


def write_config(tmp_path: Path, model: Path, name: str, **sections) -> Path:
    config = demo_base()
    config["model"]["name_or_path"] = str(model)
    config["output"] = {"dir": str(tmp_path / name), "save_every": 1, "keep_last": 0,
                        "save_merged": False}
    # LoRA dropout draws from the RNG in every forward of the update: a redo must draw the same
    config["lora"] = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1}
    for task in config["tasks"].values():
        task["data"] += "?size=40"
        task["eval_size"] = 4
    # an objective that differs between any two completions' texts, whatever the tiny model
    # samples (a length one can give all K completions the same score): non-zero gradients
    rewards = tmp_path / "varied_reward.py"
    rewards.write_text("import zlib\n\n\ndef varied(prompts, completions, **kwargs):\n"
                       "    return [zlib.crc32(str(c).encode()) % 97 / 96 for c in completions]\n")
    config["tasks"]["fairness"]["rewards"].append({"fn": f"{rewards}:varied", "weight": 0.5})
    config["train"].update(max_steps=STEPS, micro_batch_size=4, gradient_accumulation_steps=2,
                           learning_rate=1e-2, warmup_steps=0)
    config["rollout"].update(num_generations=4, max_seq_length=48)
    config["sft"] = {"enabled": False}
    config["eval"] = {"at_start": False, "max_samples": 2}
    config["logging"] = {"progress_bar": False}
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def adapter(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "final" / "adapter" / "adapter_model.safetensors")


def oom_events(run: Path) -> list[dict]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [m for m in lines if m.get("event") == "oom"]


def fail_on_call(target: object, name: str, monkeypatch: pytest.MonkeyPatch,
                 calls: set[int], after: bool = False) -> None:
    """Make `target.name` raise torch.OutOfMemoryError on the given calls (1-based); `after`:
    once the call has run (its RNG draws and allocations made)."""
    original = getattr(target, name)
    count = [0]

    def failing(*args, **kwargs):
        count[0] += 1
        if count[0] in calls and not after:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        out = original(*args, **kwargs)
        if count[0] in calls:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return out

    monkeypatch.setattr(target, name, failing)


@pytest.fixture(scope="module")
def micro_2(tiny_model, tmp_path_factory) -> Path:
    """The run configured with micro-batches of 4 (and the same 8 completions a step)."""
    tmp = tmp_path_factory.mktemp("micro2")
    config = write_config(tmp, tiny_model, "run",
                          train={"micro_batch_size": 2, "gradient_accumulation_steps": 4})
    with logging_kept():  # outside any one test's own restore
        assert main(["train", str(config)]) == 0
    return tmp / "run"


@pytest.mark.slow  # two runs, ~40 s on 2 shared cores (more with the first decode compile)
def test_oom_in_generation_halves_the_generation_batch(tiny_model, tmp_path, monkeypatch, capsys):
    reference = write_config(tmp_path, tiny_model, "small", rollout={"generation_batch_size": 2})
    assert main(["train", str(reference)]) == 0
    # after the first generation call has sampled (drawn from the RNG), it fails
    fail_on_call(grpo, "generate_rollout", monkeypatch, {1}, after=True)
    config = write_config(tmp_path, tiny_model, "run", rollout={"generation_batch_size": 4})
    assert main(["train", str(config)]) == 0
    err = capsys.readouterr().err
    assert "[OOM@step 1] generation: generation_batch_size 4 → 2 (memory.on_oom: adapt)" in err
    assert [(e["step"], e["key"], e["from"], e["to"]) for e in oom_events(tmp_path / "run")] \
        == [(1, "rollout.generation_batch_size", 4, 2)]
    small, adapted = adapter(tmp_path / "small"), adapter(tmp_path / "run")
    assert all(torch.equal(small[k], adapted[k]) for k in small)


@pytest.mark.parametrize(("phase", "target", "name", "call"), [
    # the reference pass's second micro-batch (calls 1-2: reference pass; 3-4: the update)
    ("log-prob pass", update, "completion_logprobs", 2),
    # the update's second backward, the first micro-batch's gradients already accumulated
    ("update", ParallelPolicy, "backward", 2),
])
def test_oom_in_a_log_prob_pass_or_the_update_halves_the_micro_batch(
        tiny_model, tmp_path, monkeypatch, capsys, micro_2, phase, target, name, call):
    fail_on_call(target, name, monkeypatch, {call}, after=name == "backward")
    config = write_config(tmp_path, tiny_model, "run")
    assert main(["train", str(config)]) == 0
    err = capsys.readouterr().err
    assert f"[OOM@step 1] {phase}: micro_batch_size 4 → 2 (memory.on_oom: adapt)" in err
    run = tmp_path / "run"
    assert len(oom_events(run)) == 1
    expected, adapted = adapter(micro_2), adapter(run)
    assert any(bool(v.abs().sum()) for k, v in expected.items() if "lora_B" in k)  # it learned
    assert all(torch.equal(expected[k], adapted[k]) for k in expected)  # bit for bit
    # the smaller size is in the checkpoint, and the config's own size is unchanged
    state = json.loads((run / "checkpoints" / "step-0000001" / "trainer_state.json").read_text())
    assert state["trainer"]["oom"]["sizes"]["train.micro_batch_size"] == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["micro_batch_size"] == 4


@pytest.mark.slow  # two runs, ~20 s
def test_a_resume_keeps_the_adapted_micro_batch(tiny_model, tmp_path, monkeypatch, capsys,
                                                micro_2):
    fail_on_call(ParallelPolicy, "backward", monkeypatch, {1})
    config = write_config(tmp_path, tiny_model, "run", train={"max_steps": 1})
    assert main(["train", str(config)]) == 0
    config = write_config(tmp_path, tiny_model, "run")  # max_steps 2: one more step
    capsys.readouterr()
    assert main(["train", str(config), "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "train.micro_batch_size: 2, as an out-of-memory error adapted it" in err
    expected, adapted = adapter(micro_2), adapter(tmp_path / "run")
    assert all(torch.equal(expected[k], adapted[k]) for k in expected)


def test_on_oom_fail_stops_with_the_error(tiny_model, tmp_path, monkeypatch, capsys):
    fail_on_call(ParallelPolicy, "backward", monkeypatch, {1})
    config = write_config(tmp_path, tiny_model, "run", memory={"on_oom": "fail"})
    assert main(["train", str(config)]) == ExitCode.FOUND_PROBLEM
    err = capsys.readouterr().err
    assert "out of memory in the update of step 1 (train.micro_batch_size 4)" in err
    assert "memory.on_oom is fail" in err


def test_an_oom_at_micro_batch_1_stops_the_run(tiny_model, tmp_path, monkeypatch, capsys):
    fail_on_call(ParallelPolicy, "backward", monkeypatch, set(range(1, 100)))
    config = write_config(tmp_path, tiny_model, "run",
                          train={"micro_batch_size": 2, "gradient_accumulation_steps": 4})
    assert main(["train", str(config)]) == ExitCode.FOUND_PROBLEM
    err = capsys.readouterr().err
    assert "(train.micro_batch_size 1)" in err and "nothing is left to halve" in err


def test_an_oom_in_the_optimizer_step_is_not_redone(tiny_model, tmp_path, monkeypatch, capsys):
    """AdamW makes its states at the first step and steps tensor after tensor: an error inside
    may leave part of the update applied, which a redo would apply again. A smaller batch would
    not shrink the states either: the run stops and says what would."""
    fail_on_call(torch.optim.AdamW, "step", monkeypatch, {1}, after=True)
    config = write_config(tmp_path, tiny_model, "run")
    assert main(["train", str(config)]) == ExitCode.FOUND_PROBLEM
    err = capsys.readouterr().err
    assert "out of memory in the update of step 1 (train.micro_batch_size 4)" in err
    assert "the optimizer's own step ran out of memory" in err and "adamw_8bit" in err
    assert oom_events(tmp_path / "run") == []


def test_fp16_loss_scaling_survives_a_redone_step(tiny_model, tmp_path, monkeypatch, capsys):
    """fp16-mixed unscales the gradients once a step, before clipping; an error between that
    and the scaler's update (in clipping) once left the scaler refusing the redo's unscale
    ("unscale_() has already been called on this optimizer since the last update()")."""
    fail_on_call(ParallelPolicy, "clip_grad_norm", monkeypatch, {1})
    config = write_config(tmp_path, tiny_model, "run")
    data = yaml.safe_load(config.read_text())
    data["model"]["precision"] = "fp16-mixed"
    config.write_text(yaml.safe_dump(data))
    assert main(["train", str(config)]) == 0
    err = capsys.readouterr().err
    assert "[OOM@step 1] update: micro_batch_size 4 → 2 (memory.on_oom: adapt)" in err
    steps = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
             .splitlines() if '"loss"' in x]
    assert [m["step"] for m in steps] == [1, 2]
    assert all(m["policy/loss_scale"] > 0 for m in steps)

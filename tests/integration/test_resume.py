"""Checkpoints and resume: exactness after SIGKILL, integrity, fallback, drift, diagnosis."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mogrpo.checkpoint import find_resume, list_checkpoints, save_checkpoint, verify
from mogrpo.cli import main
from mogrpo.demo import demo_base
from mogrpo.errors import MogrpoError

USER_REWARDS = Path(__file__).with_name("user_rewards.py")
TIMING = ("time/", "throughput/", "memory/")  # measurements, not math
SECRET = "sk-test-DO-NOT-LEAK-4f1c9a"




def write_config(path: Path, model: Path, run_dir: Path, steps: int, **sections) -> Path:
    config = demo_base()
    config["model"]["name_or_path"] = str(model)
    config["output"] = {"dir": str(run_dir), "save_every": 2, "keep_last": 0}
    config["lora"] = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.1}
    for task in config["tasks"].values():
        task["data"] += "?size=120"
        task["eval_size"] = 8
        task["rewards"].append({"fn": f"{USER_REWARDS}:distinct_chars", "name": "distinct"})
    config["tasks"]["hallucination"]["rewards"].append({"fn": f"{USER_REWARDS}:kill_on_call"})
    config["tasks"]["fairness"]["kl"] = {"kind": "band", "low": 0.0, "high": 1e-6}
    config["train"].update(max_steps=steps, micro_batch_size=4, gradient_accumulation_steps=2,
                           learning_rate=5e-3, warmup_steps=1, lr_scheduler="cosine")
    config["rollout"].update(num_generations=4)
    config["sft"].update(steps=3, batch_size=4)
    config["eval"].update(max_samples=4)
    config["logging"] = {"progress_bar": False}
    for key, value in sections.items():
        config.setdefault(key, {}).update(value)
    path.write_text(yaml.safe_dump(config))
    return path


def metric_lines(run_dir: Path) -> list[dict]:
    """Per-step records without timing fields (health events excluded)."""
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)}
            for m in lines if "event" not in m]


def train_in_subprocess(config: Path, **env) -> int:
    done = subprocess.run(
        [sys.executable, "-m", "mogrpo.cli", "train", str(config)],
        env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )
    if done.returncode not in (0, -9):
        print(done.stderr[-3000:])
    return done.returncode


EVERY_STEP_EVAL = {"eval": {"every_steps": 1}}


def killed_and_resumed_equals_whole(tmp_path: Path, config, weights: str | None = None) -> None:
    """`config(name)` writes the same 4-step run to tmp_path/name: run whole; run, kill in
    step 4 (after step 2's checkpoint), resume; the metrics (and the final `weights` file,
    when named) are equal."""
    assert train_in_subprocess(config("whole")) == 0
    cut = config("cut")
    assert train_in_subprocess(cut, KILL_ON_REWARD_CALL="4") == -9
    assert [m["step"] for m in metric_lines(tmp_path / "cut")] == [1, 2, 3]
    assert main(["train", str(cut), "--resume", "auto"]) == 0
    assert metric_lines(tmp_path / "cut") == metric_lines(tmp_path / "whole")
    if weights is not None:
        a = load_file(tmp_path / "whole" / "final" / weights)
        b = load_file(tmp_path / "cut" / "final" / weights)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def eval_lines(run_dir: Path) -> list[str]:
    return (run_dir / "eval.jsonl").read_text().splitlines()


def beta_report_line(run_dir: Path) -> str:
    return next(line for line in (run_dir / "report.md").read_text().splitlines()
                if "β change(s)" in line)


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory, tiny_model) -> Path:
    """An uninterrupted 4-step run (eval every step) that the resumed runs must equal."""
    tmp = tmp_path_factory.mktemp("whole")
    config = write_config(tmp / "whole.yaml", tiny_model, tmp / "run", 4, **EVERY_STEP_EVAL)
    # in its own process: `main` reconfigures logging, which a module fixture would leak
    assert train_in_subprocess(config) == 0
    return tmp / "run"


def test_sigkill_mid_step_then_resume_is_bit_identical(tmp_path, tiny_model, whole_run):
    cut = write_config(tmp_path / "cut.yaml", tiny_model, tmp_path / "cut", 4, **EVERY_STEP_EVAL)
    # One kill_on_call per step: call 4 happens in step 4, after its rollout. The last
    # checkpoint is step 2's; step 3 and its eval were logged after it.
    assert train_in_subprocess(cut, KILL_ON_REWARD_CALL="4") == -9
    assert [m["step"] for m in metric_lines(tmp_path / "cut")] == [1, 2, 3]
    assert [json.loads(x)["tag"] for x in eval_lines(tmp_path / "cut")] == ["start", "1", "2", "3"]
    assert main(["train", str(cut), "--resume", "auto"]) == 0

    assert metric_lines(tmp_path / "cut") == metric_lines(whole_run)
    a = load_file(whole_run / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "cut" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().sum() > 0 for k, v in a.items() if "lora_B" in k)  # it did train

    # the logs the report reads: the evals and every β change, those before the kill too
    assert eval_lines(tmp_path / "cut") == eval_lines(whole_run)
    whole = json.loads((whole_run / "summary.json").read_text())
    resumed = json.loads((tmp_path / "cut" / "summary.json").read_text())
    # fairness KL stays above its band, so β rises, from before the checkpoint at step 2 on
    steps = [int(line.split("]")[0].removeprefix("[KL@")) for line in whole["beta_changes"]]
    assert min(steps) <= 2 and max(steps) == 4
    assert resumed["beta_changes"] == whole["beta_changes"]
    assert resumed["evals"] == whole["evals"]
    assert beta_report_line(tmp_path / "cut") == beta_report_line(whole_run)


def test_the_same_seed_on_the_same_machine_and_commit_repeats_the_run(tmp_path, tiny_model,
                                                                     whole_run):
    """What "repeatable" means in the README and docs/demo.md: the same config and seed, run again on this
    machine at this commit, give the same metrics, evals and weights, bit for bit. (Across
    CPUs it is not promised: their kernels round products differently.)"""
    again = write_config(tmp_path / "again.yaml", tiny_model, tmp_path / "again", 4,
                         **EVERY_STEP_EVAL)
    assert train_in_subprocess(again) == 0
    assert metric_lines(tmp_path / "again") == metric_lines(whole_run)
    assert eval_lines(tmp_path / "again") == eval_lines(whole_run)
    a = load_file(whole_run / "final" / "adapter" / "adapter_model.safetensors")
    b = load_file(tmp_path / "again" / "final" / "adapter" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_sigkill_during_the_final_save_writes_the_end_eval_once(tmp_path, tiny_model, whole_run):
    cut = write_config(tmp_path / "cut.yaml", tiny_model, tmp_path / "cut", 4, **EVERY_STEP_EVAL)
    # the process kills itself when it starts saving the final model, after the `end` eval
    kill_in_final_save = (
        "import os, signal, sys; import mogrpo.trainer.run as run; "
        "run.save_model = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
        "from mogrpo.cli import main; sys.exit(main(['train', sys.argv[1]]))")
    done = subprocess.run([sys.executable, "-c", kill_in_final_save, str(cut)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, done.stderr[-3000:]
    assert [json.loads(x)["tag"] for x in eval_lines(tmp_path / "cut")][-1] == "end"
    assert not (tmp_path / "cut" / "summary.json").exists()

    assert main(["train", str(cut), "--resume", "auto"]) == 0
    assert eval_lines(tmp_path / "cut") == eval_lines(whole_run)  # one `end`, not two
    assert metric_lines(tmp_path / "cut") == metric_lines(whole_run)
    whole = json.loads((whole_run / "summary.json").read_text())
    resumed = json.loads((tmp_path / "cut" / "summary.json").read_text())
    assert resumed["beta_changes"] == whole["beta_changes"]


def test_corrupt_and_truncated_checkpoints_fall_back(tmp_path, tiny_model, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 3,
                          output={"save_every": 1}, sft={"enabled": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    steps = [s.step for s in list_checkpoints(run)]
    assert steps == [3, 2, 1]

    weights = run / "checkpoints" / "step-0000003" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped
    weights.write_bytes(bytes(data))
    status = verify(weights.parent)
    assert status.status == "corrupt"
    assert status.problems == ["weights.safetensors does not match its SHA-256 in the manifest (corrupted)"]

    optimizer = run / "checkpoints" / "step-0000002" / "optimizer.pt"
    optimizer.write_bytes(optimizer.read_bytes()[:-100])
    status = verify(optimizer.parent)
    assert status.status == "corrupt"
    assert "optimizer.pt has" in status.problems[0] and "(truncated?)" in status.problems[0]

    assert find_resume(run, "auto").name == "step-0000001"
    capsys.readouterr()
    assert main(["checkpoints", str(run)]) == 3  # listed, and the damage is the exit status
    listing = capsys.readouterr().out
    assert "step-0000003  step      3  corrupt" in listing
    assert "step-0000001  step      1  ok" in listing

    assert main(["train", str(config), "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert "skipping checkpoint step-0000003 (corrupt): weights.safetensors" in err
    assert "skipping checkpoint step-0000002 (corrupt): optimizer.pt" in err
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3]  # none missing, none twice


def test_crash_during_save_leaves_nothing_auto_would_pick(tmp_path, tiny_model, monkeypatch):
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2,
                          output={"save_every": 1}, sft={"enabled": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)  # dies after the weights file was written
    with pytest.raises(OSError):
        save_checkpoint(run, 3, model=model, optimizer=optimizer, state={}, config_yaml="")
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    assert not (run / "checkpoints" / "step-0000003").exists()
    assert find_resume(run, "auto").name == "step-0000002"


def test_a_resume_from_an_older_checkpoint_keeps_the_ones_it_writes(tmp_path, tiny_model):
    """`output.keep_last` counts the newest by step: resumed from step 1 while step 3 of the
    first run was still there, the run pruned its own step 2 right after writing it."""
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 3,
                          output={"save_every": 1}, sft={"enabled": False},
                          eval={"every_steps": 0, "at_start": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    assert main(["train", str(config), "--resume", str(run / "checkpoints" / "step-0000001"),
                 "--set", "train.max_steps=2", "--set", "output.keep_last=1"]) == 0
    assert [m["step"] for m in metric_lines(run)] == [1, 2]
    assert verify(run / "checkpoints" / "step-0000002").ok


def test_a_resume_from_an_older_step_sets_the_newer_line_aside(tmp_path, tiny_model, capsys):
    """Resumed from step 1 with another learning rate, step 3 of the first run stayed in
    checkpoints/, and the next `--resume auto` went back to it: the line the user had left."""
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 3,
                          output={"save_every": 1}, sft={"enabled": False},
                          eval={"every_steps": 0, "at_start": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    first_three = load_file(run / "checkpoints" / "step-0000003" / "weights.safetensors")
    capsys.readouterr()
    assert main(["train", str(config), "--resume", str(run / "checkpoints" / "step-0000001"),
                 "--allow-config-change", "--set", "train.learning_rate=1e-3",
                 "--set", "train.max_steps=2"]) == 0
    err = capsys.readouterr().err
    assert "step-0000002, step-0000003 moved to" in err and "checkpoints_set_aside" in err
    assert sorted(p.name for p in (run / "checkpoints_set_aside").iterdir()) == [
        "step-0000002", "step-0000003"]
    assert find_resume(run, "auto").name == "step-0000002"  # this line's, not the old one
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    set_aside = load_file(run / "checkpoints_set_aside" / "step-0000003" / "weights.safetensors")
    assert all(torch.equal(first_three[k], set_aside[k]) for k in first_three)  # kept intact

    assert main(["train", str(config), "--resume", "auto", "--allow-config-change",
                 "--set", "train.learning_rate=1e-3"]) == 0
    assert "resuming from" in (err := capsys.readouterr().err) and "(step 2)" in err
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3]
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == [
        "step-0000001", "step-0000002", "step-0000003"]


def test_config_drift_allowed_refused_and_forced(tmp_path, tiny_model, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2,
                          sft={"enabled": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    temperature = yaml.safe_load(config.read_text())["rollout"]["temperature"]  # the demo's

    # Allowed: more steps, another log interval, malloc's defaults — listed, the run continues.
    assert main(["train", str(config), "--resume", "auto", "--set", "train.max_steps=3",
                 "--set", "logging.log_every=5", "--set", "train.host_memory=release"]) == 0
    err = capsys.readouterr().err
    assert "config change on resume (allowed): train.max_steps: 2 -> 3" in err
    assert '(allowed): train.host_memory: "auto" -> "release"' in err
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3]

    # Refused: a sampling setting changes the math; the diff names the field.
    assert main(["train", str(config), "--resume", "auto", "--set", "train.max_steps=4",
                 "--set", "rollout.temperature=0.5"]) == 2
    err = capsys.readouterr().err
    assert "error: the config differs from the one checkpoint" in err
    assert f"rollout.temperature: {temperature} -> 0.5" in err
    assert "--allow-config-change" in err
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3]

    # Forced: recorded in the run.
    assert main(["train", str(config), "--resume", "auto", "--allow-config-change",
                 "--set", "train.max_steps=4", "--set", "rollout.temperature=0.5"]) == 0
    record = json.loads((run / "config_changes.jsonl").read_text().splitlines()[-1])
    forced = [c for c in record["changes"] if not c["allowed"]]
    assert forced == [{"key": "rollout.temperature", "old": temperature, "new": 0.5,
                       "allowed": False}]
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3, 4]


def test_a_step_split_into_smaller_passes_is_not_drift(tmp_path, tiny_model, capsys):
    """What docs/memory.md says to do after an out-of-memory error a run cannot redo (several
    processes, μ > 1): lower the sizes and resume. The resume once refused those sizes."""
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2,
                          sft={"enabled": False})
    assert main(["train", str(config)]) == 0
    run = tmp_path / "run"
    # fewer completions a step: that is another step, refused
    assert main(["train", str(config), "--resume", "auto", "--set", "train.max_steps=3",
                 "--set", "train.micro_batch_size=2"]) == 2
    assert "train.micro_batch_size: 4 -> 2" in capsys.readouterr().err
    assert main(["train", str(config), "--resume", "auto", "--set", "train.max_steps=3",
                 "--set", "train.micro_batch_size=2",
                 "--set", "train.gradient_accumulation_steps=4",
                 "--set", "rollout.generation_batch_size=4"]) == 0
    err = capsys.readouterr().err
    assert "config change on resume (allowed): train.micro_batch_size: 4 -> 2" in err
    assert "(allowed): train.gradient_accumulation_steps: 2 -> 4" in err
    assert "(allowed): rollout.generation_batch_size: null -> 4" in err
    assert [m["step"] for m in metric_lines(run)] == [1, 2, 3]


def test_doctor_reports_integrity_versions_and_resume_verdict(tmp_path, tiny_model, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2,
                          sft={"enabled": False})
    assert main(["train", str(config)]) == 0
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000002"
    capsys.readouterr()
    assert main(["doctor", str(checkpoint), "--config", str(config),  # 3: a refused resume
                 "--set", "rollout.num_generations=8", "--set", "train.micro_batch_size=8"]) == 3
    out = capsys.readouterr().out
    assert "status   ok  (step 2)" in out
    assert "weights.safetensors" in out and "  ok" in out
    assert "KL controller fairness: {'kind': 'band', 'beta': " in out
    assert "torch" in out and "versions (then -> now)" in out
    assert "resume with the given config: refused" in out
    assert "REFUSED  rollout.num_generations: 4 -> 8" in out
    assert out.rstrip().endswith("problem: a resume with the given config would be refused")
    assert main(["doctor", str(tmp_path / "nope")]) == 2


def test_api_key_in_environment_never_reaches_the_run_directory(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET)
    monkeypatch.setenv("MOGRPO_JUDGE_KEY", SECRET)
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2)
    assert main(["train", str(config)]) == 0
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert len(files) > 10
    assert not [p for p in files if SECRET.encode() in p.read_bytes()]


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path, tiny_model, capsys):
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 2)
    assert main(["train", str(config), "--resume", "auto"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    with pytest.raises(MogrpoError, match="found no intact checkpoint"):
        find_resume(tmp_path / "run", "auto")


def test_a_run_killed_before_its_first_checkpoint_says_how_to_start_again(
        tmp_path, tiny_model, whole_run, capsys):
    """Neither command may send the user to the other: `--resume auto` and a plain start
    both name `output.overwrite`, and the seeded restart repeats the whole run."""
    cut = write_config(tmp_path / "cut.yaml", tiny_model, tmp_path / "cut", 4, **EVERY_STEP_EVAL)
    # the first reward call of the hallucination task is in step 1; the first checkpoint is
    # step 2's
    assert train_in_subprocess(cut, KILL_ON_REWARD_CALL="1") == -9
    assert not list((tmp_path / "cut").glob("checkpoints/step-*"))
    assert main(["train", str(cut), "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert "holds a run that stopped before its first checkpoint" in err
    assert "--set output.overwrite=true" in err and "without --resume" in err
    assert main(["train", str(cut)]) == 2
    err = capsys.readouterr().err
    assert "stopped before its first checkpoint" in err and "--resume auto" not in err
    assert main(["train", str(cut), "--set", "output.overwrite=true"]) == 0
    assert metric_lines(tmp_path / "cut") == metric_lines(whole_run)


def test_trackers_continue_the_same_runs_after_a_kill(tmp_path, tiny_model, monkeypatch):
    from mlflow.tracking import MlflowClient
    from wandb_reader import history

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_RUN_ID", "stale-run-from-before")  # must not be attached to
    config = write_config(tmp_path / "c.yaml", tiny_model, tmp_path / "run", 4,
                          sft={"enabled": False},
                          logging={"trackers": ["wandb", "mlflow", "tensorboard"]})
    # Checkpoint at step 2; killed in step 4, after step 3 reached the trackers.
    assert train_in_subprocess(config, KILL_ON_REWARD_CALL="4") == -9
    assert main(["train", str(config), "--resume", "auto"]) == 0
    run = tmp_path / "run"
    steps = [m["step"] for m in metric_lines(run)]
    assert steps == [1, 2, 3, 4]
    expected = {m["step"]: m["loss"] for m in metric_lines(run)}

    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len({f.name for f in files}) == 1  # re-attached at each checkpoint: one run id
    assert "stale-run-from-before" not in files[0].name
    logged = [(row["_step"], row["loss"]) for f in files for row in history(f) if "loss" in row]
    assert sorted(step for step, _ in logged) == [1, 2, 3, 4]
    assert all(loss == pytest.approx(expected[step]) for step, loss in logged)

    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 1
    values = client.get_metric_history(runs[0].info.run_id, "loss")
    assert sorted(m.step for m in values) == [1, 2, 3, 4]
    assert (run / "tensorboard").is_dir()


def test_a_curriculum_stage_survives_a_kill(tmp_path, tiny_model):
    stages = {"stages": [
        {"name": "fairness-first", "task_weights": {"hallucination": 0}, "until": {"steps": 2}},
        {"name": "both"}]}
    whole = write_config(tmp_path / "whole.yaml", tiny_model, tmp_path / "whole", 4,
                         curriculum=stages)
    assert main(["train", str(whole)]) == 0
    lines = metric_lines(tmp_path / "whole")
    assert [m["curriculum/stage"] for m in lines] == [0, 0, 1, 1]
    # the first stage draws no hallucination prompt, the second does
    assert ["task/hallucination/kl" in m for m in lines] == [False, False, True, True]
    summary = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert summary["curriculum_changes"] == [
        "[Curriculum@2] stage fairness-first -> both: 2 steps; task weights fairness 1, "
        "hallucination 1"]

    cut = write_config(tmp_path / "cut.yaml", tiny_model, tmp_path / "cut", 4, curriculum=stages)
    # the first hallucination reward call is in step 3, the first step of stage "both"
    assert train_in_subprocess(cut, KILL_ON_REWARD_CALL="1") == -9
    assert [m["step"] for m in metric_lines(tmp_path / "cut")] == [1, 2]
    assert main(["train", str(cut), "--resume", "auto"]) == 0
    assert metric_lines(tmp_path / "cut") == lines


@pytest.mark.slow
def test_bf16_mixed_full_finetune_resumes_bit_identically(tmp_path, tiny_model):
    """A checkpoint holds the float32 master weights and AdamW states; the bfloat16 reference
    is copied again from the weights GRPO started from: the resumed run equals the whole one."""
    def bf16_mixed(name: str) -> Path:
        path = write_config(tmp_path / f"{name}.yaml", tiny_model, tmp_path / name, 4,
                            lora={"enabled": False})
        data = yaml.safe_load(path.read_text())
        data["model"]["precision"] = "bf16-mixed"
        path.write_text(yaml.safe_dump(data))
        return path

    killed_and_resumed_equals_whole(tmp_path, bf16_mixed, "model/model.safetensors")


@pytest.mark.slow
def test_adafactor_run_resumes_bit_identically(tmp_path, tiny_model):
    """`train.optimizer: adafactor` end to end (SFT warm-up and GRPO): its factored state is
    in the checkpoint, so the resumed run equals the whole one (~45 s a run on 2 busy cores)."""
    def adafactor(name: str) -> Path:
        return write_config(tmp_path / f"{name}.yaml", tiny_model, tmp_path / name, 4,
                            train={"optimizer": "adafactor"})

    killed_and_resumed_equals_whole(tmp_path, adafactor)
    assert {m["policy/update_norm"] > 0 for m in metric_lines(tmp_path / "whole")} == {True}
    state = torch.load(next((tmp_path / "cut" / "checkpoints").glob("step-*")) / "optimizer.pt",
                       weights_only=True)["state"]
    assert any("exp_avg_sq_row" in s for s in state.values())  # Adafactor's, factored


@pytest.mark.slow  # three runs, ~45 s
def test_lora_on_a_4bit_base_with_the_sft_warm_up_resumes(tmp_path, tiny_model):
    """Over a quantised base the warm-up adapter is not merged (no `sft/merged`: GRPO goes on
    training it); a resume once looked for that model and stopped with "does not exist"."""
    pytest.importorskip("bitsandbytes")
    from packaging.version import Version

    from mogrpo.config.hardware import BNB_CPU_MIN, bitsandbytes_version
    if Version(bitsandbytes_version() or "0") < Version(BNB_CPU_MIN):
        pytest.skip(f"bitsandbytes {bitsandbytes_version()} has no CPU kernels")

    def qlora(name: str) -> Path:
        path = write_config(tmp_path / f"{name}.yaml", tiny_model, tmp_path / name, 4)
        data = yaml.safe_load(path.read_text())
        data["model"]["load_in_4bit"] = True
        path.write_text(yaml.safe_dump(data))
        return path

    killed_and_resumed_equals_whole(tmp_path, qlora, "adapter/adapter_model.safetensors")
    assert not (tmp_path / "whole" / "sft" / "merged").exists()

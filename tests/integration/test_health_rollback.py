"""`health.eval_regression.action: rollback`: an eval below the start sends the run back to the
best checkpoint with a lower learning rate and it goes on; the rollback is in metrics.jsonl, the
summary and the report, and a resumed run keeps the lowered rate."""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from safetensors.torch import load_file

from mogrpo.cli import main
from mogrpo.demo import demo_base

USER_REWARDS = Path(__file__).with_name("user_rewards.py")
# Scores 1.0 on its first call in the process (the eval before GRPO), 0.0 ever after: every
# later eval reads as a regression from the start. Written per test: a fresh module, a fresh count.
EVAL_REWARD = '''
calls = 0


def right_only_first(prompts, completions, **columns):
    global calls
    calls += 1
    return [1.0 if calls == 1 else 0.0] * len(completions)
'''


def write_config(tmp_path: Path, tiny_model: Path) -> Path:
    reward = tmp_path / "eval_reward.py"
    reward.write_text(EVAL_REWARD)
    config = demo_base()
    config["model"]["name_or_path"] = str(tiny_model)
    config["output"] = {"dir": str(tmp_path / "run"), "save_every": 0, "keep_last": 0}
    config["tasks"] = {"t": {
        "data": "builtin:bias_probe?size=40", "eval_size": 4, "beta": 0.04,
        "rewards": [{"fn": f"{USER_REWARDS}:distinct_chars"},  # the training signal
                    {"fn": f"{reward}:right_only_first", "weight": 0.0}]}}
    config["train"].update(max_steps=4, micro_batch_size=8, warmup_steps=0, learning_rate=1e-3)
    config["rollout"].update(num_generations=4)
    config["sft"]["enabled"] = False
    config["eval"].update(max_samples=4, every_steps=1, reward="right_only_first")
    config["logging"] = {"progress_bar": False}
    config["health"] = {"eval_regression": {"action": "rollback", "max_rollbacks": 1}}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_rollback_restores_the_best_checkpoint_lowers_lr_and_resumes(tmp_path, tiny_model,
                                                                      capsys):
    path = write_config(tmp_path, tiny_model)
    # step 1: eval 0.0 < start 1.0 → back to step 0, lr × 0.1; step 2: again, and the one
    # rollback allowed is spent → the run stops (exit status 3)
    assert main(["train", str(path)]) == 3
    err = capsys.readouterr().err
    assert "[health] eval_regression at step 2: task t: eval score 0.000 at step 2 is below " \
           "the start 1.000 (step 0)" in err
    run = tmp_path / "run"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    (rollback,) = [e for e in lines if e.get("event") == "health_rollback"]
    assert rollback["step"] == 1 and rollback["restored_step"] == 0
    assert rollback["lr_before"] == 1e-3 and abs(rollback["lr_after"] - 1e-4) < 1e-12
    lr = {m["step"]: m["lr"] for m in lines if "loss" in m}
    assert lr[1] == 1e-3 and abs(lr[2] - 1e-4) < 1e-12
    # the checkpoint saved right after the rollback holds step 0's weights exactly
    ckpt = run / "checkpoints"
    before, after = (load_file(ckpt / f"step-000000{s}" / "weights.safetensors") for s in (0, 1))
    assert before.keys() == after.keys() and all((before[k] == after[k]).all() for k in before)
    events = [(e["check"], e["step"], e["action"]) for e in lines if e.get("event") == "health_alert"]
    assert events == [("eval_regression", 1, "rollback"), ("eval_regression", 2, "stop")]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_checkpoint"].startswith("step 0 (before GRPO): ")
    assert [r["restored_step"] for r in summary["rollbacks"]] == [0]
    assert main(["report", str(run)]) == 0
    report = capsys.readouterr().out
    assert "- **step 1: rolled back** to step 0" in report and "learning rate 0.001 → 0.0001" in report
    assert "- **step 2, eval_regression** (stop)" in report

    # resumed after the stop, the run keeps the lowered learning rate
    assert main(["train", str(path), "--resume", "auto"]) == 0
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    lr = {m["step"]: m["lr"] for m in lines if "loss" in m}
    assert abs(lr[3] - 1e-4) < 1e-12 and abs(lr[4] - 1e-4) < 1e-12
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["rollbacks"]) == 1

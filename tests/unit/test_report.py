"""`mogrpo report`: the Markdown page built from a run directory's files."""

from __future__ import annotations

import json

import pytest
import yaml

from mogrpo.cli import main
from mogrpo.eval.report import build_report

CONFIG = {
    "model": {"name_or_path": "org/model-1b"}, "lora": {"enabled": True, "r": 16},
    "train": {"max_steps": 6, "micro_batch_size": 8, "gradient_accumulation_steps": 2,
              "learning_rate": 1e-5},
    "rollout": {"num_generations": 4},
    "tasks": {"exam": {"data": "exam.tsv", "beta": 0.04,
                       "kl": {"kind": "band", "low": 0.02, "high": 0.06},
                       "rewards": [{"fn": "mc_correct", "weight": 1.0},
                                   {"fn": "format", "weight": 0.1}]}},
}


def step(n: int, reward: float, kl: float) -> dict:
    return {"step": n, "task/exam/reward/mean": reward, "task/exam/kl": kl,
            "task/exam/beta": 0.04, "task/exam/zero_var_frac": 0.5,
            "task/exam/reward/mc_correct/mean": reward, "rollout/completion_length": 40.0,
            "rollout/truncated_frac": 0.25 if n == 2 else 0.0, "time/step_s": 2.0,
            "time/rollout_s": 1.5, "time/reward_s": 0.1, "time/update_s": 0.4,
            "throughput/completion_tokens_per_s": 300.0, "memory/peak_gib": 9.5 + n / 10}


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "exam-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    lines = [step(n, 0.1 * n, 0.01 * n) for n in range(1, 5)]
    lines.insert(2, {"event": "health_alert", "check": "truncation", "step": 2,
                     "message": "[health] truncation at step 2: 25% of completions ..."})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n{\"step\": 5")
    (run / "eval.jsonl").write_text(
        json.dumps({"step": 0, "tag": "start", "exam": {"score": 0.25}}) + "\n"
        + json.dumps({"step": 4, "tag": "4", "exam": {"score": 0.5}}) + "\n")
    (run / "pareto.json").write_text(json.dumps({"front": [{"step": 4}]}))
    return run


def test_a_run_still_going_is_reported_from_its_files(run_dir):
    text = build_report(run_dir, window=2)
    assert text.startswith("# Run report: exam-run\n\nnot finished: metrics up to step 4 of 6")
    assert "- model `org/model-1b`, LoRA r 16, lr 1e-05, K 4, 16 completions per step" in text
    assert ("- task **exam** (`exam.tsv`): rewards mc_correct ×1.0, format ×0.1; β 0.04 "
            "(band 0.02–0.06)") in text
    assert "| start | 0 | 0.250 |\n| 4 | 4 | 0.500 |" in text
    assert "Pareto front (no evaluated step beats these on every task): steps 4." in text
    # first two steps vs last two: rewards 0.1, 0.2 -> 0.3, 0.4
    assert "| exam | 0.150 → 0.350 | 0.015 → 0.035 | 0.0400 → 0.0400 | 0.50 → 0.50 |" in text
    assert "| exam/reward/mc_correct | 0.150 → 0.350 |" in text
    assert "truncated 6.2 % on average, at most 25.0 % in a step" in text
    assert "- [health] truncation at step 2: 25% of completions ..." in text
    assert "2.00 s per step (rollout 75 %, reward 5 %, update 20 %); 300 completion tokens/s" in text
    assert "Peak memory 9.90 GiB." in text


def test_a_finished_run_and_the_cli(run_dir, capsys, tmp_path):
    (run_dir / "summary.json").write_text(json.dumps({
        "memory_estimate_gib": 11.0, "saved": {"adapter": "final/adapter"},
        "beta_changes": ["[KL@2] exam KL 0.010 < 0.020: beta 0.0400 -> 0.0340"],
        "curriculum_changes": ["[Curriculum@3] stage a -> b: 3 steps; task weights exam 1"]}))
    out = tmp_path / "report.md"
    assert main(["report", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert out.read_text() == printed
    assert "finished: 4 of 6 steps" in printed
    assert "1 β change(s); the last: `[KL@2] exam KL 0.010 < 0.020: beta 0.0400 -> 0.0340`" in printed
    assert "- `[Curriculum@3] stage a -> b: 3 steps; task weights exam 1`" in printed
    assert "Peak memory 9.90 GiB (the planner estimated 11.00 GiB)." in printed


def test_a_run_stopped_by_a_health_check(run_dir):
    (run_dir / "summary.json").write_text(json.dumps({"health": [{"check": "non_finite"}]}))
    assert "stopped by the health monitor at step 4 of 6" in build_report(run_dir)


def test_not_a_run_directory(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "has no metrics.jsonl; give a run directory" in capsys.readouterr().err


def test_each_alert_shows_its_step_evidence_causes_and_fix(run_dir):
    alert = {"event": "health_alert", "check": "reward_regression", "step": 17, "action": "warn",
             "message": "[health] reward_regression at step 17: …",
             "evidence": "task exam, objective mc_correct: mean reward 0.398 over steps 10–17",
             "causes": ["the learning rate 0.0001 is too high → set train.learning_rate: 1e-05",
                        "β 0.04 is too small → set tasks.exam.beta: 0.1"],
             "fix": "set train.learning_rate: 1e-05"}
    rollback = {"event": "health_rollback", "step": 20, "restored_step": 0,
                "checkpoint": "run/checkpoints/step-0000000", "lr_before": 1e-4, "lr_after": 1e-5}
    (run_dir / "summary.json").write_text(json.dumps({
        "health": [alert], "rollbacks": [rollback], "saved": {},
        "best_checkpoint": "step 0 (before GRPO): run/checkpoints/step-0000000"}))
    report = build_report(run_dir)
    assert ("- **step 17, reward_regression** (warn)\n"
            "  - evidence: task exam, objective mc_correct: mean reward 0.398 over steps 10–17\n"
            "  - likely (1): the learning rate 0.0001 is too high → set train.learning_rate: 1e-05\n"
            "  - likely (2): β 0.04 is too small → set tasks.exam.beta: 0.1\n"
            "  - fix: set train.learning_rate: 1e-05\n"
            "- **step 20: rolled back** to step 0 (`run/checkpoints/step-0000000`), learning rate "
            "0.0001 → 1e-05\n"
            "- best checkpoint on the Pareto front: step 0 (before GRPO): "
            "run/checkpoints/step-0000000") in report
    # a run still going: the alerts of metrics.jsonl (an old one without parts, as it was)
    (run_dir / "summary.json").unlink()
    assert "- [health] truncation at step 2: 25% of completions ..." in build_report(run_dir)


def test_health_checks_off_are_not_reported_as_healthy(run_dir):
    (run_dir / "config.yaml").write_text(yaml.safe_dump({**CONFIG, "health": {"enabled": False}}))
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(step(n, 0.1, 0.01))
                                                     for n in (1, 2)) + "\n")
    text = build_report(run_dir)
    assert "Health checks were off (`health.enabled: false`): no step was watched." in text
    assert "No health alert." not in text

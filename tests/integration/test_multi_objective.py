"""Multi-objective control end to end: β per task, QuickEval, Pareto, dynamic sampling."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
import yaml

from mogrpo.cli import main
from mogrpo.demo import demo_base

USER_REWARDS = Path(__file__).with_name("user_rewards.py")




def run(tmp_path: Path, model: Path, steps: int, edit) -> Path:
    config = demo_base()
    config["model"]["name_or_path"] = str(model)
    config["output"]["dir"] = str(tmp_path / "run")
    for task in config["tasks"].values():
        task["data"] += "?size=120"
        task["eval_size"] = 8
        # Distinct characters vary between any two completions: every group has a signal.
        task["rewards"].append({"fn": f"{USER_REWARDS}:distinct_chars", "name": "distinct"})
    config["train"].update(max_steps=steps, micro_batch_size=8, gradient_accumulation_steps=1,
                           learning_rate=5e-3, warmup_steps=0)
    config["rollout"].update(num_generations=4)
    config["sft"]["enabled"] = False
    config["eval"].update(max_samples=8, every_steps=2)
    config["logging"] = {"progress_bar": False}
    edit(config)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["train", str(path)]) == 0
    return tmp_path / "run"


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log, without health-alert events."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in records if "event" not in r]


def test_two_tasks_with_different_bands_move_beta_apart(tmp_path, tiny_model, capsys):
    def edit(config):
        # Any KL > 0 is above fairness's band and below hallucination's.
        config["tasks"]["fairness"]["beta"], config["tasks"]["hallucination"]["beta"] = 0.02, 0.05
        config["tasks"]["fairness"]["kl"] = {"kind": "band", "low": 0.0, "high": 1e-9,
                                             "rate": 0.2, "every_steps": 1}
        config["tasks"]["hallucination"]["kl"] = {"kind": "band", "low": 100.0, "high": 200.0,
                                                  "rate": 0.2, "every_steps": 1}

    rundir = run(tmp_path, tiny_model, 5, edit)
    log_lines = capsys.readouterr().err.splitlines()
    metrics = read_jsonl(rundir / "metrics.jsonl")
    fair = [m["task/fairness/beta"] for m in metrics]
    hall = [m["task/hallucination/beta"] for m in metrics]
    # β used at step s is the one set after step s-1; step 1 uses the configured β.
    assert fair[0] == pytest.approx(0.02) and hall[0] == pytest.approx(0.05)
    kls = [m["task/fairness/kl"] for m in metrics]
    for s in range(1, len(metrics)):
        if kls[s - 1] > 1e-9:
            assert fair[s] == pytest.approx(fair[s - 1] * 1.2)
        assert hall[s] == pytest.approx(hall[s - 1] * 0.8)
    assert fair[-1] > fair[0] and hall[-1] < hall[0]
    lines = [line for line in log_lines if line.startswith("[KL@")]
    assert any(re.fullmatch(r"\[KL@\d+\] hallucination KL \S+ < 100\.000: beta 0\.0500 -> 0\.0400", line)
               for line in lines), lines
    summary = json.loads((rundir / "summary.json").read_text())
    assert summary["beta_changes"] == lines


def test_quick_eval_lines_match_the_metrics_and_pareto_file(tmp_path, tiny_model, capsys):
    rundir = run(tmp_path, tiny_model, 5, lambda config: None)
    err = capsys.readouterr().err.splitlines()
    tables = ["\n".join(err[i:i + 3]) for i, line in enumerate(err) if line.startswith("[QuickEval@")]
    # At the start, every 2 steps (2, 4) and at the end (5).
    assert [t.split("]")[0] for t in tables] == ["[QuickEval@start", "[QuickEval@2",
                                                  "[QuickEval@4", "[QuickEval@end"]
    metrics = {m["step"]: m for m in read_jsonl(rundir / "metrics.jsonl")}
    for table, step in zip(tables[1:3], (2, 4), strict=True):
        m = metrics[step]
        first, second, third = table.splitlines()
        assert f"fairness {m['eval/fairness/score']:.3f}" in first
        assert f"hallucination {m['eval/hallucination/score']:.3f}" in first
        assert f"F {m['eval/fairness/truncated_frac']:.1%}" in second
        assert f"H {m['eval/hallucination/mean_length']:.1f}" in second
        assert f"F {m['task/fairness/kl']:.3f}" in third
        assert f"H {m['task/hallucination/beta']:.4f}" in third
    assert "eval/fairness/score" not in metrics[1] and "eval/fairness/score" not in metrics[3]
    pareto = json.loads((rundir / "pareto.json").read_text())
    evals = read_jsonl(rundir / "eval.jsonl")
    assert [e["tag"] for e in evals] == ["start", "2", "4", "end"]
    scores = {e["step"]: (e["fairness"]["score"], e["hallucination"]["score"]) for e in evals}
    for point in pareto["front"]:
        mine = scores[point["step"]]
        assert (point["scores"]["fairness"], point["scores"]["hallucination"]) == mine
        assert not any(o[0] >= mine[0] and o[1] >= mine[1] and o != mine for o in scores.values())
    # the run's report.md shows the same evals
    report = (rundir / "report.md").read_text()
    assert report.startswith("# Run report: run\n\nfinished: 5 of 5 steps")
    for e in evals:
        row = (f"| {e['tag']} | {e['step']} | {e['fairness']['score']:.3f} | "
               f"{e['hallucination']['score']:.3f} |")
        assert row in report
    if importlib.util.find_spec("matplotlib"):  # the `charts` extra: drawn at the end of the run
        assert "](charts/pareto.png)" in report and (rundir / "charts" / "pareto.png").is_file()


def test_dynamic_sampling_drops_constant_reward_groups(tmp_path, tiny_model):
    def edit(config):
        # Fairness is scored by a reward that is the same for every completion: no signal.
        config["tasks"]["fairness"]["rewards"] = [{"fn": f"{USER_REWARDS}:constant"}]
        config["algorithm"] = {"dynamic_sampling": True, "max_refill_rounds": 2}
        config["eval"]["every_steps"] = 0

    rundir = run(tmp_path, tiny_model, 3, edit)
    for m in read_jsonl(rundir / "metrics.jsonl"):
        # 2 prompts per step; every step's fairness group is dropped and each refill round
        # draws a missing prompt, of which fairness ones are dropped again.
        assert m["rollout/dynamic_sampling/dropped"] >= 1
        assert m["rollout/dynamic_sampling/rounds"] <= 2
        assert "task/fairness/reward/mean" not in m or m["task/fairness/zero_var_frac"] == 0.0
        assert m["rollout/groups"] == 2 - m["rollout/dynamic_sampling/missing"]

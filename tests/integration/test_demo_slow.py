"""The built-in demo, run exactly as the README's first command runs it, for the README table's
three seeds (about 2.5 minutes each on 2 CPU cores, hence `slow`: `pytest -m slow`).

What a user of the demo relies on: it learns both tasks, and a healthy run raises no health
alert (no false alarms: every alert line in a demo would teach people to ignore them). When
fairness starts to improve varies by seed (seed 0 can sit at the warm-up's 0.5 until step ~200),
so its gain is asserted on the mean over the seeds, as the README reports it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)


def run_demo(tmp_path, seed: int) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "mogrpo.cli", "demo", "--seed", str(seed), "--out", str(tmp_path),
         "--set", "logging.progress_bar=false"],
        capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / f"run-seed{seed}"
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"event"' in line]
    assert [e["message"] for e in events if e["event"] == "health_alert"] == [], seed
    assert summary["health"] == [], seed
    assert "health: no alerts in 250 steps" in done.stdout + done.stderr
    return summary["evals"]


def test_demo_learns_both_tasks_without_a_health_alert(tmp_path):
    evals = {seed: run_demo(tmp_path, seed) for seed in SEEDS}
    for seed, e in evals.items():
        start, end = e["start"], e["end"]
        # after the warm-up the model declines everything: right on half of the prompts
        assert 0.45 <= start["fairness"] <= 0.55 and 0.45 <= start["hallucination"] <= 0.55
        assert end["hallucination"] >= 0.9, (seed, e)
        assert end["fairness"] >= start["fairness"], (seed, e)
    gain = statistics.fmean(e["end"]["fairness"] - e["start"]["fairness"] for e in evals.values())
    assert gain >= 0.1, evals

"""The built-in demo, run exactly as the README's first command runs it, for seeds 0, 1 and 2
(about 1.5 minutes each on 2 CPU cores, hence `slow`: `pytest -m slow`).

What a user of the demo relies on: it learns both tasks on every seed, holds each task's KL in
its band (the `dual` controllers), and a healthy run raises no health alert (no false alarms:
every alert line in a demo would teach people to ignore them). The README's table (docs/demo.md in
full) is the same measurement over seeds 0-9 (`benchmarks/demo_seeds.py`)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.slow

SEEDS = (0, 1, 2)


def in_band(run) -> dict[str, float]:
    """Per task: the share of the second half's controller windows (means of `every_steps`
    steps) whose KL lies inside the task's band."""
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and "step" in r]
    out = {}
    for task, spec in config["tasks"].items():
        kl, last = spec["kl"], steps[-1]["step"]
        half = [r[f"task/{task}/kl"] for r in steps if r["step"] > last / 2]
        every = kl["every_steps"]
        windows = [statistics.fmean(half[i:i + every]) for i in range(0, len(half), every)]
        out[task] = sum(kl["low"] <= w <= kl["high"] for w in windows) / len(windows)
    return out


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
    assert "health: no alerts in 300 steps" in done.stdout + done.stderr
    return {**summary["evals"], "in_band": in_band(run)}


def test_demo_learns_both_tasks_in_their_kl_bands_without_a_health_alert(tmp_path):
    for seed in SEEDS:
        e = run_demo(tmp_path, seed)
        start, end = e["start"], e["end"]
        # after the warm-up the model declines everything: right on half of the prompts
        assert 0.45 <= start["fairness"] <= 0.55 and 0.45 <= start["hallucination"] <= 0.55
        assert end["hallucination"] >= 0.9, (seed, e)
        assert end["fairness"] >= start["fairness"] + 0.15, (seed, e)
        assert min(e["in_band"].values()) >= 0.8, (seed, e)

"""The built-in demo, run exactly as the README's first command runs it (about 4–5 minutes on
2 CPU cores, hence `slow`: `pytest -m slow`).

What a user of the demo relies on: it learns both tasks, and a healthy run raises no health
alert (no false alarms: every alert line in a demo would teach people to ignore them)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_demo_learns_both_tasks_without_a_health_alert(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mogrpo.cli", "demo", "--seed", "0", "--out", str(tmp_path),
         "--set", "logging.progress_bar=false"],
        capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run-seed0"
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))

    events = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
              if '"event"' in line]
    assert [e["message"] for e in events if e["event"] == "health_alert"] == []
    assert summary["health"] == []
    assert "health: no alerts in 250 steps" in done.stdout + done.stderr

    start, end = summary["evals"]["start"], summary["evals"]["end"]
    # after the warm-up the model declines everything: right on half of the prompts
    assert 0.45 <= start["fairness"] <= 0.55 and 0.45 <= start["hallucination"] <= 0.55
    assert end["hallucination"] >= 0.9, summary["evals"]
    assert end["fairness"] >= start["fairness"] + 0.1, summary["evals"]

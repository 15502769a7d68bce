"""examples/agent_calculator.py end to end, shortened: it builds the tiny model, warms it up on
the worked examples, runs GRPO with the calculator and prints the before/after table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_calculator_example_runs_and_reports_its_evals(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "agent_calculator.py"), "--out", str(tmp_path),
         "--set", "sft.steps=2", "--set", "train.max_steps=1", "--set", "eval.max_samples=4",
         "--set", "rollout.num_generations=2", "--set", "train.micro_batch_size=4",
         "--set", "logging.progress_bar=false"],
        capture_output=True, text=True, timeout=300, check=True).stdout
    assert "correct answer" in out and "called the tool" in out
    evals = [json.loads(line) for line in
             (tmp_path / "run-seed0" / "eval.jsonl").read_text().splitlines()]
    assert [e["tag"] for e in evals] == ["start", "end"]
    assert all(0.0 <= e["calc"]["tool_call_frac"] <= 1.0 for e in evals)
    tokenizer = json.loads((tmp_path / "tiny-model-seed0" / "tokenizer.json").read_text())
    assert "Digits" in json.dumps(tokenizer["pre_tokenizer"])  # one token per digit

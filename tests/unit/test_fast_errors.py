"""Config errors come before any heavy import: each command that reads a config validates it
before torch or transformers load, so a typo costs about a second, not the ~15 s of importing
them (the test runs each command in a fresh interpreter and looks at sys.modules)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mogrpo

SRC = str(Path(mogrpo.__file__).resolve().parents[1])
PROBE = """
import json, sys, time
start = time.perf_counter()
from mogrpo.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "seconds": time.perf_counter() - start,
                  "heavy": sorted(m for m in ("torch", "transformers", "peft") if m in sys.modules)}))
"""
TYPO = """model: {name_or_path: some/model}
tasks:
  fair: {data: builtin:bias_probe, rewards: [mc_correct]}
rollout: {temprature: 0.9}
"""


@pytest.mark.parametrize("argv", [
    ["train", "run.yaml"],
    ["train", "run.yaml", "--resume", "auto"],
    ["train", "run.yaml", "--nproc", "2"],
    ["config", "show", "run.yaml"],
    ["memory", "run.yaml", "--gpu-memory", "24GiB"],
    ["predict", "some/model", "test.tsv", "--config", "run.yaml"],
    ["doctor", ".", "--config", "run.yaml"],
    ["data", "check", "run.yaml"],
    ["demo", "--out", "demo", "--set", "rollout.temprature=0.9"],
], ids=" ".join)
def test_a_config_typo_is_reported_before_torch_is_imported(argv, tmp_path):
    (tmp_path / "run.yaml").write_text(TYPO, encoding="utf-8")
    (tmp_path / "test.tsv").write_text("question\toption_A\toption_B\nq\ta\tb\n", "utf-8")
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=tmp_path, text=True,
                          capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": SRC})
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 2, done.stderr
    assert "did you mean `rollout.temperature`?" in done.stderr
    assert result["heavy"] == [], f"imported before the config error: {result['heavy']}"
    assert not (tmp_path / "demo").exists()  # the demo builds no model for a bad config

"""`mogrpo train CONFIG --nproc 2` on CPU (gloo): the shortcut starts torchrun, and the run
is one run of two processes — what test_torchrun_train.py checks when torchrun is typed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_torchrun_train import lines, write_config

import mogrpo

SRC = str(Path(mogrpo.__file__).resolve().parents[1])


def test_nproc_2_trains_one_model_in_two_processes(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, "short", 2)
    done = subprocess.run([sys.executable, "-m", "mogrpo.cli", "train", str(config), "--nproc",
                           "2", "--set", "eval.max_samples=2"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": SRC})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "launching 2 processes:" in done.stderr and "--nproc-per-node 2" in done.stderr
    run = tmp_path / "short"
    main, other = lines(run / "metrics.jsonl"), lines(run / ".rank-1" / "metrics.jsonl")
    assert [m["step"] for m in main] == [1, 2]
    assert other == main  # both processes logged the same combined step
    assert {m["rollout/groups"] for m in main} == {2}  # 2 prompts per step, one per process
    # the --set after --nproc reached every process
    assert "max_samples: 2" in (run / "config.yaml").read_text()
    assert (run / "final").is_dir() and not (run / ".rank-1" / "final").exists()

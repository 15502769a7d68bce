"""`mogrpo train --resume auto` at another number of processes: a sharded checkpoint
(`distributed.strategy: fsdp`, one process too) is re-sharded by PyTorch's distributed
checkpoint, 2 -> 1 and 1 -> 2, to the same weights; a DDP checkpoint refuses, naming both
numbers. Torchrun runs on CPU (gloo): slow."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from test_torchrun_train import final_weights_of, full_finetune, lines, train

pytestmark = pytest.mark.slow  # a torchrun run and a one-process run each (~1 min on 2 cores)


def one_process(config: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mogrpo.cli", "train", str(config), *args],
                          capture_output=True, text=True, timeout=600)


def same_weights(a: Path, b: Path) -> bool:
    x, y = final_weights_of(a), final_weights_of(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_two_processes_resumed_by_one(tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "run", 2, "fsdp")
    train(config)
    shutil.copytree(tmp_path / "run" / "final" / "model", tmp_path / "saved")
    # no step left to train: the final model is the checkpoint's weights, gathered by one process
    done = one_process(config, "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "saved by 2 process(es), this run has 1" in done.stderr
    assert same_weights(tmp_path / "saved", tmp_path / "run" / "final" / "model")
    done = one_process(config, "--resume", "auto", "--set", "train.max_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_one_process_resumed_by_two(tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "run", 2, "fsdp")
    done = one_process(config)
    assert done.returncode == 0, done.stderr[-3000:]
    shutil.copytree(tmp_path / "run" / "final" / "model", tmp_path / "saved")
    # the checkpoint read into two shards and gathered again: the same weights
    done = train(config, "--resume", "auto")
    assert "saved by 1 process(es), this run has 2" in done.stderr
    assert same_weights(tmp_path / "saved", tmp_path / "run" / "final" / "model")
    train(config, "--resume", "auto", "--set", "train.max_steps=3")
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2, 3]


def test_a_ddp_checkpoint_at_another_number_is_refused_with_both(tmp_path, tiny_model):
    config = full_finetune(tmp_path, tiny_model, "run", 1, "auto")
    data = yaml.safe_load(config.read_text())
    data["output"]["save_every"] = 1
    config.write_text(yaml.safe_dump(data))
    assert one_process(config).returncode == 0
    done = train(config, "--resume", "auto", "--set", "train.max_steps=2", check=False)
    assert done.returncode != 0
    assert "saved by 1 process(es), this run has 2" in done.stderr
    assert "distributed.strategy: fsdp" in done.stderr


def test_a_two_process_ddp_checkpoint_is_refused_by_one(tmp_path, tiny_model):
    """Once accepted with a warning: process 1's sampling RNG was dropped and the run went on."""
    config = full_finetune(tmp_path, tiny_model, "run", 1, "ddp")
    train(config)
    done = one_process(config, "--resume", "auto", "--set", "train.max_steps=2")
    assert done.returncode != 0
    assert "saved by 2 process(es), this run has 1" in done.stderr
    assert "distributed.strategy: fsdp" in done.stderr and "resume this one with 2" in done.stderr
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1]

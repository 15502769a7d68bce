"""Sharded checkpoints (torch.distributed.checkpoint) in one process: layout, manifest over
every file, verification, exact resume, refusals, the CLI views and the final HF folder.
The same code with two processes (FSDP2 over gloo) is tested in
tests/integration/test_sharded_checkpoint.py."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from mogrpo.checkpoint import sharded, store
from mogrpo.checkpoint.doctor import doctor_report
from mogrpo.checkpoint.store import CheckpointError
from mogrpo.cli.app import main

CONFIG = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One AdamW step on a batch drawn from the torch, NumPy and Python RNGs."""
    ids = torch.randint(0, 64, (2, random.randint(5, 8)))
    ids = (ids + int(np.random.randint(0, 64))) % 64
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def save(run, n, model, optimizer, **state):
    return sharded.save_sharded(run, n, model=model, optimizer=optimizer, state=state,
                                config_yaml="seed: 0\n", strategy="none")


@pytest.fixture()
def run_with_two(tmp_path):
    """A run with sharded checkpoints at steps 1 and 2; (run dir, model, optimizer)."""
    model, optimizer = make()
    for n in (1, 2):
        step(model, optimizer)
        save(tmp_path / "run", n, model, optimizer, note=f"at {n}")
    return tmp_path / "run", model, optimizer


def test_layout_and_a_manifest_over_every_file(run_with_two):
    run, _, _ = run_with_two
    path = run / "checkpoints" / "step-0000002"
    files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert files == ["config.yaml", "dcp/.metadata", "dcp/__0_0.distcp", "manifest.json",
                     "rng/rank-00000.safetensors", "trainer_state.json", "versions.json"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["world_size"], manifest["strategy"]) == ("dcp", 1, "none")
    assert sorted(manifest["files"]) == [f for f in files if f != "manifest.json"]
    assert json.loads((path / "trainer_state.json").read_text()) == {"note": "at 2", "step": 2}
    assert store.verify(path).ok
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    assert sharded.is_sharded(path)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resume_is_bit_identical(run_with_two, tmp_path):
    run, model, optimizer = run_with_two
    for _ in range(2):
        step(model, optimizer)
    # a fresh model, other RNG states: everything must come from the checkpoint
    fresh, fresh_opt = make(seed=7)
    random.seed(9)
    np.random.seed(9)
    loaded = sharded.open_sharded(sharded.pick_resume(run, "auto"))  # before the model exists
    assert loaded.state["step"] == 2 and loaded.world_size == 1 and loaded.strategy == "none"
    assert loaded.state["note"] == "at 2" and loaded.config_yaml == "seed: 0\n"
    loaded.load_into(fresh, fresh_opt)
    assert loaded.restore_rng()
    for _ in range(2):
        step(fresh, fresh_opt)
    for (name, a), b in zip(model.named_parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters(), strict=True):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], fresh_opt.state[q][key])


def test_without_the_rng_the_resumed_run_differs(run_with_two):
    # the check above can fail: the batches come from the RNGs the checkpoint restores
    run, model, optimizer = run_with_two
    step(model, optimizer)
    fresh, fresh_opt = make(seed=7)
    sharded.load_sharded(run / "checkpoints" / "step-0000002", model=fresh, optimizer=fresh_opt)
    step(fresh, fresh_opt)
    assert not torch.equal(model.lm_head.weight, fresh.lm_head.weight)


def test_a_damaged_shard_is_reported_and_skipped(run_with_two, capsys):
    run, model, optimizer = run_with_two
    shard = run / "checkpoints" / "step-0000002" / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    status = store.verify(shard.parent.parent)
    assert status.status == "corrupt"
    assert status.problems == ["dcp/__0_0.distcp does not match its SHA-256 in the manifest "
                               "(corrupted)"]
    assert sharded.pick_resume(run, "auto").name == "step-0000001"
    with pytest.raises(CheckpointError, match="step-0000002 is corrupt: dcp/__0_0.distcp"):
        sharded.load_sharded(shard.parent.parent, model=model, optimizer=optimizer)

    capsys.readouterr()
    assert main(["checkpoints", str(run)]) == 3
    listing = capsys.readouterr().out
    assert "step-0000002  step      2  corrupt" in listing and "[1 processes, none]" in listing
    assert "step-0000001  step      1  ok" in listing
    report = doctor_report(shard.parent.parent)
    assert "format   sharded (torch.distributed.checkpoint): 1 processes, strategy none" in report
    assert ("  dcp/__0_0.distcp           dcp/__0_0.distcp does not match its SHA-256"
            in report)
    assert "rng/rank-00000.safetensors ok" in report


def test_every_process_rng_file_is_required(run_with_two):
    run, _, _ = run_with_two
    path = run / "checkpoints" / "step-0000002"
    (path / "rng" / "rank-00000.safetensors").unlink()
    assert store.verify(path).problems == ["rng/rank-00000.safetensors is missing"]
    # a manifest of two processes must list the second one's files too
    manifest = json.loads((path / "manifest.json").read_text()) | {"world_size": 2}
    (path / "manifest.json").write_text(json.dumps(manifest))
    assert "rng/rank-00001.safetensors is not listed in the manifest" in store.verify(path).problems
    assert store.verify(path).status == "incomplete"


def test_a_model_that_does_not_fit_is_refused(run_with_two):
    run, _, _ = run_with_two
    other = LlamaForCausalLM(LlamaConfig(**CONFIG.to_dict() | {"num_hidden_layers": 3}))
    with pytest.raises(CheckpointError, match=r"does not fit the model: it lacks \['model.layers.2"):
        sharded.load_sharded(run / "checkpoints" / "step-0000002", model=other,
                             optimizer=torch.optim.AdamW(other.parameters()))


def test_a_single_process_checkpoint_is_not_loaded_as_sharded(tmp_path):
    model, optimizer = make()
    path = store.save_checkpoint(tmp_path, 1, model=model, optimizer=optimizer, state={},
                                 config_yaml="")
    assert not sharded.is_sharded(path)
    with pytest.raises(CheckpointError, match="is a single-process checkpoint; resume it with "
                                              "one process"):
        sharded.load_sharded(path, model=model, optimizer=optimizer)


def test_a_failed_save_leaves_nothing_resume_would_pick(run_with_two, monkeypatch):
    run, model, optimizer = run_with_two

    def disk_full(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sharded, "save_file", disk_full)  # after the shards were written
    with pytest.raises(CheckpointError, match="process 0 could not write its RNG state: disk full"):
        save(run, 3, model, optimizer)
    assert not (run / "checkpoints" / "step-0000003").exists()
    assert (run / "checkpoints" / "latest").read_text() == "step-0000002"
    assert sharded.pick_resume(run, "auto").name == "step-0000002"

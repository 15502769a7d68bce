"""Checkpoints of processes r > 0: state and RNG only, weights and optimizer from process 0."""

from __future__ import annotations

import pytest
import torch

from mogrpo.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, verify


def test_a_shared_checkpoint_reads_process_0s_weights(tmp_path):
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    main = save_checkpoint(tmp_path / "run", 4, model=model, optimizer=optimizer,
                           state={"who": 0}, config_yaml="seed: 0\n")
    own = save_checkpoint(tmp_path / "run" / ".rank-1", 4, model=None, optimizer=None,
                          state={"who": 1}, config_yaml="seed: 0\n")
    assert verify(own).ok
    assert sorted(p.name for p in own.iterdir()) == [
        "config.yaml", "manifest.json", "rng.safetensors", "trainer_state.json", "versions.json"]

    with pytest.raises(CheckpointError, match="shares weights.safetensors, optimizer.pt with "
                                              "process 0's checkpoint None"):
        load_checkpoint(own)
    loaded = load_checkpoint(own, shared_from=main)
    assert loaded.state["who"] == 1  # its own state and RNG
    assert torch.equal(loaded.weights["weight"], model.weight.detach())
    assert loaded.optimizer["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]

    (main / "weights.safetensors").write_bytes(b"broken")
    with pytest.raises(CheckpointError, match="missing or not intact; resume from an earlier"):
        load_checkpoint(own, shared_from=main)

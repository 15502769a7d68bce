"""Sharded checkpoints with two processes (FSDP2 `fully_shard` over gloo, started by torchrun):
exact resume, re-sharding to another world size, a manifest over every process's files, a
damaged shard skipped, a process killed during the save. (The final model a sharded run writes
is tested with the run: test_torchrun_train.py.)

The processes are sharded_worker.py (its docstring says what each mode does). The default run
starts two launches (about 20-35 s on a busy 2-core machine); the re-sharding and kill tests
are marked slow (one or two launches each; all eight tests take about 2.5 minutes)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mogrpo.checkpoint import sharded, store
from multiproc import torchrun

WORKER = Path(__file__).with_name("sharded_worker.py")


def launch(mode: str, model: Path, run: Path, out: Path, nproc: int = 2,
           strategy: str = "fsdp", check: bool = True) -> subprocess.CompletedProcess:
    out.mkdir(parents=True, exist_ok=True)
    return torchrun(str(WORKER), mode, str(model), str(run), str(out), strategy, nproc=nproc,
                    check=check)


def only_step_2(run: Path, tmp: Path) -> Path:
    """A copy of the run holding only its step-2 checkpoint (so `auto` resumes from it)."""
    copy = tmp / "resume-run"
    (copy / "checkpoints").mkdir(parents=True)
    shutil.copytree(run / "checkpoints" / "step-0000002", copy / "checkpoints" / "step-0000002")
    return copy


def assert_same(a: Path, b: Path) -> None:
    """Full weights and AdamW state (gathered to process 0) equal bit for bit."""
    want, got = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert set(got["weights"]) == set(want["weights"])
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), name
    assert set(got["optimizer"]["state"]) == set(want["optimizer"]["state"])
    for name, moments in want["optimizer"]["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optimizer"]["state"][name][key], moments[key]), (name, key)
    assert got["optimizer"]["param_groups"][0]["lr"] == want["optimizer"]["param_groups"][0]["lr"]


@pytest.fixture(scope="module")
def fsdp_run(tiny_model, tmp_path_factory) -> tuple[Path, Path]:
    """Two FSDP2 processes: 4 AdamW steps, sharded checkpoints at 2 and 4; (run, out)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    launch("train", tiny_model, tmp / "run", tmp / "out")
    return tmp / "run", tmp / "out"


def test_the_manifest_covers_every_process_files(fsdp_run):
    run, _ = fsdp_run
    path = run / "checkpoints" / "step-0000004"
    manifest = json.loads((path / "manifest.json").read_text())
    assert (manifest["format"], manifest["world_size"], manifest["strategy"]) == ("dcp", 2, "fsdp")
    on_disk = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert sorted(manifest["files"]) == [f for f in on_disk if f != "manifest.json"]
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp",
            "rng/rank-00000.safetensors", "rng/rank-00001.safetensors"} <= set(manifest["files"])
    assert store.verify(path).ok
    assert [s.step for s in store.list_checkpoints(run)] == [4, 2]


def test_a_damaged_shard_of_process_1_is_reported_and_skipped(fsdp_run, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fsdp_run[0], run)
    shard = run / "checkpoints" / "step-0000004" / "dcp" / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:-64])  # truncated
    status = store.verify(shard.parent.parent)
    assert status.status == "corrupt"
    assert status.problems[0].startswith("dcp/__1_0.distcp has ")
    assert sharded.pick_resume(run, "auto").name == "step-0000002"


def test_two_process_resume_is_bit_identical(fsdp_run, tiny_model, tmp_path):
    run, out = fsdp_run
    resumed = tmp_path / "out"
    launch("resume", tiny_model, only_step_2(run, tmp_path), resumed)
    assert_same(out / "full-2.pt", resumed / "loaded.pt")
    assert_same(out / "full-4.pt", resumed / "full-4.pt")  # steps 3-4 again: the same weights
    # each process got its own RNGs back, not process 0's
    saved = [load_file(run / "checkpoints" / "step-0000002" / "rng" / f"rank-0000{r}.safetensors")
             for r in (0, 1)]
    restored = [torch.load(resumed / f"rng-{r}.pt", weights_only=True) for r in (0, 1)]
    assert all(torch.equal(restored[r], saved[r]["torch"]) for r in (0, 1))
    assert not torch.equal(restored[0], restored[1])


def test_two_processes_resharded_into_one(fsdp_run, tiny_model, tmp_path):
    run, out = fsdp_run
    launch("resume", tiny_model, only_step_2(run, tmp_path), tmp_path / "out", nproc=1,
           strategy="none")
    assert_same(out / "full-2.pt", tmp_path / "out" / "loaded.pt")


@pytest.mark.slow
@pytest.mark.parametrize(("nproc", "strategy"), [(1, "none"), (2, "ddp")])
def test_one_process_or_ddp_resharded_into_fsdp(tiny_model, tmp_path, nproc, strategy):
    launch("train", tiny_model, tmp_path / "run", tmp_path / "first", nproc=nproc,
           strategy=strategy)
    launch("resume", tiny_model, only_step_2(tmp_path / "run", tmp_path), tmp_path / "out")
    assert_same(tmp_path / "first" / "full-2.pt", tmp_path / "out" / "loaded.pt")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["kill-shard", "kill-rename"])
def test_a_process_killed_during_the_save_leaves_nothing_resume_picks(fsdp_run, tiny_model,
                                                                     tmp_path, mode):
    run = tmp_path / "run"
    done = launch(mode, tiny_model, run, tmp_path / "out", check=False)
    assert done.returncode != 0
    assert "exitcode  : -9" in done.stderr  # SIGKILL
    root = run / "checkpoints"
    assert (root / ".tmp-step-0000004").is_dir()  # the partial save is there ...
    assert not (root / "step-0000004").exists()
    assert [s.step for s in store.list_checkpoints(run)] == [2]  # ... and never listed
    assert (root / "latest").read_text() == "step-0000002"
    assert sharded.pick_resume(run, "auto").name == "step-0000002"
    # a restart of both processes continues to the weights of the run that was not killed
    launch("resume", tiny_model, run, tmp_path / "resumed")
    assert_same(fsdp_run[1] / "full-4.pt", tmp_path / "resumed" / "full-4.pt")

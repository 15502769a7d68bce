"""Which checkpoints are kept: the newest N, plus protected steps (best per task, Pareto)."""

from __future__ import annotations

from mogrpo.checkpoint import CHECKPOINTS, prune


def make(run, steps):
    for step in steps:
        (run / CHECKPOINTS / f"step-{step:07d}").mkdir(parents=True)


def kept(run):
    return sorted(int(p.name.split("-")[1]) for p in (run / CHECKPOINTS).iterdir())


def test_keeps_the_newest_and_the_protected(tmp_path):
    make(tmp_path, [10, 20, 30, 40, 50])
    removed = prune(tmp_path, keep_last=2, protected={20})
    assert kept(tmp_path) == [20, 40, 50]
    assert sorted(p.name for p in removed) == ["step-0000010", "step-0000030"]


def test_keep_last_zero_keeps_everything(tmp_path):
    make(tmp_path, [1, 2, 3])
    assert prune(tmp_path, keep_last=0, protected=set()) == []
    assert kept(tmp_path) == [1, 2, 3]


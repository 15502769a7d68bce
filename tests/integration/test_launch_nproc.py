"""`mogrpo train CONFIG --nproc 2` on CPU (gloo): the shortcut starts torchrun, and the run
is one run of two processes — what test_torchrun_train.py checks when torchrun is typed."""

from __future__ import annotations

from test_torchrun_train import lines, write_config

from multiproc import run


def test_nproc_2_trains_one_model_in_two_processes(tmp_path, tiny_model):
    config = write_config(tmp_path, tiny_model, "short", 2)
    # batch-wide advantage scaling: each step's std is all-gathered over both processes
    done = run(["-m", "mogrpo.cli", "train", str(config), "--nproc", "2", "--set",
                "eval.max_samples=2", "--set", "algorithm.advantage_scaling=batch"], timeout=600)
    assert "launching 2 processes:" in done.stderr and "--nproc-per-node 2" in done.stderr
    out = tmp_path / "short"
    main, other = lines(out / "metrics.jsonl"), lines(out / ".rank-1" / "metrics.jsonl")
    assert [m["step"] for m in main] == [1, 2]
    assert other == main  # both processes logged the same combined step
    assert {m["rollout/groups"] for m in main} == {2}  # 2 prompts per step, one per process
    # the --set after --nproc reached every process
    assert "max_samples: 2" in (out / "config.yaml").read_text()
    assert "advantage_scaling: batch" in (out / "config.yaml").read_text()
    assert (out / "final").is_dir() and not (out / ".rank-1" / "final").exists()

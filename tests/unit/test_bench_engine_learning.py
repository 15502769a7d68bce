"""The engine-learning benchmark's pure parts: its exact paired tests against hand-computed
values, its data split and its runs' config."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def bench():
    """benchmarks/engine_learning.py (it puts benchmarks/vs_trl/ on the path to import its
    workload; taken off again here)."""
    before = list(sys.path)
    spec = importlib.util.spec_from_file_location("engine_learning", BENCH / "engine_learning.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["engine_learning"] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path[:] = before
        sys.modules.pop("engine_learning", None)


def test_sign_flips_count_every_pattern(bench):
    # ±1 ±2 ±3 takes -6, -4, -2, 0, 0, 2, 4, 6
    assert bench.sign_flip_p([1, 2, 3], 6, larger=True) == 1 / 8
    assert bench.sign_flip_p([1, -2, 3], 0, larger=False) == 5 / 8
    assert bench.sign_flip_p([1, 2, 3], 2, larger=True) == 3 / 8


def test_wilcoxon_signed_rank_is_exact_with_ties_and_zeros(bench):
    diffs = [0.02, -0.01, 0.03, 0.005, -0.02, 0.015, 0.0, -0.005]  # hf = 0, native = diffs
    # the zero dropped; |d| ranks 1.5, 1.5, 3, 4, 5.5, 5.5, 7: W+ = 18, sum of signed ranks 8
    assert sorted(bench.signed_ranks(diffs)) == [-5.5, -3, -1.5, 1.5, 4, 5.5, 7]
    tests = bench.paired_tests([0.0] * len(diffs), diffs, margin=0.02)
    assert tests["wilcoxon_w"] == 8
    # P(W+ <= 18) and the two-sided p over the 2^7 sign patterns (scipy.stats.wilcoxon agrees)
    assert tests["wilcoxon_p_worse"] == 98 / 128
    assert tests["wilcoxon_p_two_sided"] == 74 / 128
    assert tests["native_better_seeds"] == 4 and tests["native_worse_seeds"] == 3


def test_non_inferiority_and_the_lower_bound(bench):
    same = bench.paired_tests([0.5] * 6, [0.5] * 6, margin=0.02)
    # every difference 0: shifted by the margin all six are positive, 1 pattern in 64
    assert same["non_inferiority_p"] == 1 / 64 and same["wilcoxon_p_worse"] == 1.0
    assert bench.lower_bound([0.01] * 6) == pytest.approx(0.01, abs=1e-9)
    worse = bench.paired_tests([0.5] * 6, [0.45] * 6, margin=0.02)
    assert worse["non_inferiority_p"] == 1.0 and worse["wilcoxon_p_worse"] == 1 / 64


def test_held_out_additions_never_appear_in_training(bench):
    train, heldout = bench.split_rows(512)
    assert len(heldout) == 512 and len(train) + len(heldout) == 90 * 90
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in heldout}
    assert all(r["answer"] == sum(int(n) for n in r["prompt"][8:-9].split(" + "))
               for r in heldout)


def test_a_runs_config_differs_only_in_its_engine(bench, tmp_path):
    from mogrpo.config import load_config

    plan = bench.Plan(tmp_path, 100, 2e-5, 450, 1e-3, 512, 20)
    bench.workload.write_prompts(tmp_path / "train.jsonl", bench.split_rows(512)[0][:8])
    bench.workload.write_prompts(tmp_path / "heldout.jsonl", bench.split_rows(512)[1])
    raws = {e: bench.base_config(plan, "some/model", 3, 100, tmp_path / e, e)
            for e in bench.ENGINES}
    config, _ = load_config(bench.workload.write_mogrpo_config(tmp_path / "c.yaml", raws["hf"]),
                            [])
    assert config.rollout.engine == "hf" and config.seed == 3 and not config.lora.enabled
    assert config.train.learning_rate == 2e-5 and config.eval.max_samples == 512
    for raw in raws.values():
        raw["rollout"].pop("engine")
        raw["output"].pop("dir")
    assert raws["hf"] == raws["native"]

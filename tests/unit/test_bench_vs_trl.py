"""The TRL side-by-side benchmark's pure parts: rewards, settings of both tools, figures."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "vs_trl"


def bench_module(name: str):
    """A module of benchmarks/vs_trl/ (which imports its neighbours by name)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(BENCH))
    try:
        yield {name: importlib.import_module(name)
               for name in ("arith_rewards", "workload", "summary")}
    finally:
        sys.path.remove(str(BENCH))


def test_rewards_score_the_first_number_and_the_format(bench):
    rewards = bench["arith_rewards"]
    completions = [" 68", " 68 and 12", " 6 8", "it is 68", " -3", "xyz"]
    answers = [68] * 6
    assert rewards.correct(["p"] * 6, completions, answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0]
    assert rewards.starts_with_number(["p"] * 6, completions) == [1.0, 1.0, 1.0, 0.0, 1.0, 0.0]


def test_reward_log_gives_the_weighted_curve_and_the_prompts(bench, tmp_path, monkeypatch):
    rewards, summary = bench["arith_rewards"], bench["summary"]
    log = tmp_path / "rewards.jsonl"
    monkeypatch.setenv(rewards.LOG_ENV, str(log))
    prompts = ["What is 1 + 2?", "What is 1 + 2?", "What is 3 + 4?", "What is 3 + 4?"]
    completions = [" 3", " x", " 7", " 9"]
    rewards.correct(prompts, completions, [3, 3, 7, 7])
    rewards.starts_with_number(prompts, completions)
    curve, seen = summary.read_reward_log(log, rewards.WEIGHTS)
    # correct: 2 of 4 right (0.5); format: 3 of 4 (0.75) with weight 0.2
    assert curve == [pytest.approx(0.5 + 0.2 * 0.75)]
    assert seen == [["What is 1 + 2?", "What is 3 + 4?"]]


def test_run_figures_leave_out_the_warmup(bench):
    record = {"step_s": [9.0, 9.0, 0.2, 0.4, 0.3], "cpu_s": [5.0, 5.0, 0.1, 0.3, 0.2],
              "generation_s": [5.0, 5.0, 0.1, 0.2, 0.15],
              "completion_tokens": [1, 1, 100, 200, 150], "peak_rss_mib": 500.0,
              "rewards": [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6]}
    s = bench["summary"].summarize_run(record, warmup=2)
    assert s["step_ms"] == pytest.approx(300.0) and s["cpu_ms"] == pytest.approx(200.0)
    assert s["generation_share"] == pytest.approx(0.45 / 0.9)
    assert s["completion_tokens_per_s"] == pytest.approx(450 / 0.45)
    assert s["final_reward"] == pytest.approx(0.4)  # mean of the last 5 steps
    assert s["timed_steps"] == 3
    assert s["rest_ms"] == pytest.approx(150.0)  # median of 0.1, 0.2, 0.15 s without generation


def test_ratio_is_trl_time_over_mogrpo_time_per_pair(bench):
    def side(ms: float, cpu_ms: float = 100.0) -> dict:
        return {"summary": {"step_ms": ms, "cpu_ms": cpu_ms, "generation_share": 0.5, "completion_tokens_per_s": 1.0,
                            "peak_rss_mib": 1.0, "final_reward": 0.0, "rest_ms": ms / 2}}

    pairs = [{"trl": side(300, 120), "mogrpo": side(100), "prompts_match": True},
             {"trl": side(200), "mogrpo": side(200), "prompts_match": True},
             {"trl": side(330), "mogrpo": side(150), "prompts_match": False}]
    s = bench["summary"].summarize_pairs(pairs)
    assert s["ratios"] == pytest.approx([3.0, 1.0, 2.2])
    assert (s["ratio"], s["ratio_min"], s["ratio_max"]) == pytest.approx((2.2, 1.0, 3.0))
    assert s["trl"]["step_ms"] == 300 and s["mogrpo"]["step_ms"] == 150
    assert s["cpu_ratios"] == pytest.approx([1.2, 1.0, 1.0]) and s["cpu_ratio"] == 1.0
    assert s["prompts_match"] is False
    assert (s["rest_ratio"], s["rest_ratio_min"], s["rest_ratio_max"]) == pytest.approx((2.2, 1.0, 3.0))
    table = bench["summary"].markdown_table(
        {"entries": [{"size": "small", "mode": "full", "params": 1e6, "steps": 5, "summary": s}]})
    assert "| 150 / 75 ms (2.20×, 1.00–3.00) |" in table


def test_mogrpo_config_is_valid_and_matches_the_shared_settings(bench, tmp_path):
    from mogrpo.config import load_config

    workload = bench["workload"]
    settings = workload.Settings()
    data = workload.write_prompts(tmp_path / "pool.jsonl", workload.prompt_rows(0, 8))
    raw = workload.mogrpo_config("some/model", data, tmp_path / "run", 7, True, settings)
    config, _ = load_config(workload.write_mogrpo_config(tmp_path / "c.yaml", raw), [])
    assert config.prompts_per_step == settings.prompts_per_step
    assert config.rollout.num_generations == 4 and config.rollout.max_completion_length == 32
    assert config.algorithm.loss_aggregation == "token_mean"
    assert config.tasks["add"].beta == 0.04 and config.train.learning_rate == 1e-4
    assert config.lora.enabled and config.lora.r == 8 and not config.sft.enabled
    assert "engine" not in raw["rollout"]
    with_engine = workload.mogrpo_config("m", data, tmp_path / "run", 7, False, settings, "hf")
    assert with_engine["rollout"]["engine"] == "hf"
    assert raw["device"] == "cpu"
    on_gpu = workload.mogrpo_config("m", data, tmp_path / "run", 7, False, settings,
                                    device="cuda")
    assert on_gpu["device"] == "cuda" and on_gpu["model"]["dtype"] == "float32"
    # bf16-mixed: float32 weights under bfloat16 autocast, as TRL's bf16=True trains
    from mogrpo.config import RunConfig

    mixed = workload.mogrpo_config("m", data, tmp_path / "run", 7, False, settings,
                                   device="cuda", precision="bf16-mixed")
    model = RunConfig.model_validate(mixed).model
    assert (model.precision, model.dtype) == ("bf16-mixed", "bfloat16")


def test_trl_config_matches_the_shared_settings(bench, tmp_path):
    pytest.importorskip("trl")
    worker = bench_module("trl_worker")
    config = worker.grpo_config(bench["workload"].Settings(), 7, str(tmp_path))
    assert (config.loss_type, config.beta, config.num_generations) == ("dapo", 0.04, 4)
    assert config.per_device_train_batch_size == 16 and config.steps_per_generation == 1
    assert config.max_completion_length == 32 and config.learning_rate == 1e-4
    assert not (config.bf16 or config.gradient_checkpointing or config.shuffle_dataset)
    assert config.lr_scheduler_type == "constant" and config.save_strategy == "no"
    assert config.reward_weights == [1.0, 0.2]
    assert config.use_cpu
    assert not worker.grpo_config(bench["workload"].Settings(), 7, str(tmp_path), "cuda").use_cpu
    mixed = worker.grpo_config(bench["workload"].Settings(), 7, str(tmp_path), "cpu",
                               "bf16-mixed")
    assert mixed.bf16 and not mixed.fp16


def test_the_operation_count_leaves_out_views_and_paused_phases(bench):
    import torch

    op_count = bench_module("op_count")
    counter = op_count.OpCounter()
    x = torch.ones(4, 4)
    with counter:
        y = (x @ x).t().unsqueeze(0)  # mm; t and unsqueeze, views, make no kernel
        with counter.pause():
            y.add(1)  # a "rollout": not counted
        y.sum()
    step = counter.take()
    assert step["kernels"] == 2 and step["ops"]["mm"] == 1 and step["ops"]["sum"] == 1
    assert step["views"] == step["ops"]["t"] + step["ops"]["unsqueeze"] == 2
    assert "add" not in step["ops"] and counter.take()["kernels"] == 0
    mine = op_count.summarize([step])
    table = op_count.compare(mine, {"kernels": 1, "views": 0, "ops": {"mm": 1}}, ("a", "b"))
    assert "kernels a step (median)                 2        1" in table
    assert "  sum                                   1        0" in table


def test_the_gpu_options_refuse_a_machine_without_one(bench, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = bench_module("run")
    assert run.parse_args([]).sizes == ["small", "medium", "large"]  # xl only when asked
    with pytest.raises(SystemExit):
        run.parse_args(["--device", "cuda"])
    assert "--device cuda: torch sees no CUDA GPU here" in capsys.readouterr().err


def test_runs_use_every_core_unless_told(bench, monkeypatch):
    """The benchmark times what a user runs: torch on every core the process may use."""
    run = bench_module("run")
    monkeypatch.setattr(run.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert run.parse_args([]).threads == 3
    assert run.parse_args(["--threads", "1"]).threads == 1


def test_prompt_order_is_mogrpo_draw_order(bench):
    workload = bench["workload"]
    rows = workload.prompt_rows(0, 10)
    order = workload.mogrpo_order(rows, 3, workload.Settings())
    assert len(order) == 12  # 3 steps x 4 prompts; the 10-row pool wraps into a second pass
    assert sorted(json.dumps(r) for r in order[:10]) == sorted(json.dumps(r) for r in rows)
    assert order == workload.mogrpo_order(rows, 3, workload.Settings())

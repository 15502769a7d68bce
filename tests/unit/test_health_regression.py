"""Health checks that notice a run getting worse (issue 18), on recorded metric sequences:
issue 18's collapse must alert by step 20, with the likely causes in order and KL in the same
alert; the healthy runs (the demo's three seeds, a lr 1e-5 run) must raise nothing."""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest

from mogrpo.health import HealthConfig, HealthMonitor, StepContext
from mogrpo.health.stats import StepNoise, mann_whitney_greater, score_error

FIXTURES = Path(__file__).parent / "fixtures" / "health"
FULL = StepContext(temperature=1.0, full_finetune=True)
# the demo's two tasks have dual KL controllers (configs/demo.yaml): their budgets and bands
DEMO = StepContext(temperature=1.0, full_finetune=True,
                   kl_budgets={"fairness": 0.35, "hallucination": 0.8}, max_completion_length=16,
                   kl_bands={"fairness": (0.05, 0.35), "hallucination": (0.08, 0.8)})


def eval_metrics(record: dict[str, Any]) -> dict[str, Any]:
    """An eval.jsonl record as the `eval/TASK/...` metrics the trainer merges into a step."""
    return {f"eval/{task}/{k}": v for task, e in record.items() if isinstance(e, dict)
            for k, v in e.items()}


def replay(name: str, ctx: StepContext, monitor: HealthMonitor | None = None,
           until: int | None = None) -> tuple[HealthMonitor, dict[str, Any]]:
    """Feed a fixture to a monitor as a run would: the start eval, every step (evals merged in
    at eval steps), the end eval. Returns the monitor and the fixture's header."""
    monitor = monitor or HealthMonitor()
    lines = [json.loads(line) for line in (FIXTURES / name).read_text().splitlines()]
    # the eval before GRPO first, as the trainer runs it (a fixture lists its evals last)
    rows = sorted(lines[1:], key=lambda r: r["kind"] != "eval" or r["tag"] != "start")
    for row in rows:
        if until is not None and row["step"] > until:
            break
        if row["kind"] == "step":
            monitor.observe(row["step"], {k: v for k, v in row.items() if k != "kind"}, ctx)
        elif row["tag"] in ("start", "end"):
            monitor.observe_eval(row["step"], eval_metrics(row), final=row["tag"] == "end")
    return monitor, lines[0]["header"]


# ----------------------------------------------------------------------------- the collapse


def test_issue_18_collapse_alerts_by_step_20_with_causes_in_order():
    monitor, header = replay("collapse_lr1e-4.jsonl", FULL)
    assert header["source"].startswith("SYNTHETIC")  # says so; see make_fixtures.py
    reward = [a for a in monitor.alerts if a.check == "reward_regression"]
    assert len(reward) == 1 and reward[0].step <= 20, monitor.summary()
    (alert,) = reward
    assert alert.evidence.startswith("task addition, objective correct: mean reward ")
    assert "down from 0.85" in alert.evidence and "Mann–Whitney p = " in alert.evidence
    # the KL signal of a fixed-β task is in the same alert, not a second one
    assert "while KL rose from 0.11" in alert.evidence
    assert not [a for a in monitor.alerts if a.check == "kl_explosion"]
    # causes, most likely first: a learning rate too high for full fine-tuning (with the rate
    # to use), then β too small for the task; no other objective rose, so no hacking
    assert len(alert.causes) == 2
    assert alert.causes[0].startswith("the learning rate 0.0001 is too high for full fine-tuning")
    assert alert.fix == "set train.learning_rate: 1e-05 (÷10)"
    assert alert.causes[1].startswith("β 0.04 is too small for task addition (its KL grew) → "
                                      "set tasks.addition.beta: 0.1")


def test_issue_18_collapse_eval_regression_names_the_start_as_best():
    monitor, _ = replay("collapse_lr1e-4.jsonl", FULL)
    (alert,) = [a for a in monitor.alerts if a.check == "eval_regression"]
    assert alert.step == 20 and alert.best_step == 0 and alert.action == "warn"
    assert alert.evidence.startswith("task addition: eval score 0.230 at step 20 is below the "
                                     "start 0.840 (step 0) by 0.610")
    assert "best on the Pareto front: step 0 (the model GRPO started from)" in alert.evidence
    # the end eval (0.31) is the same regression still going: no second alert
    assert monitor.summary().startswith("health: 2 alert(s) in 40 steps")


@pytest.mark.parametrize("seed", range(20))
def test_collapse_alerts_by_step_20_whatever_the_noise(seed):
    """The same collapse with other draws of its 16-sample noise (make_fixtures.py)."""
    spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monitor = HealthMonitor()
    for row in module.collapse_run(1e-4, seed)[1:]:
        if row["kind"] == "step" and row["step"] <= 20:
            monitor.observe(row["step"], {k: v for k, v in row.items() if k != "kind"}, FULL)
    assert [a.check for a in monitor.alerts if a.step <= 20].count("reward_regression") == 1


# ----------------------------------------------------------------------------- healthy runs


def test_healthy_lr_1e5_run_raises_nothing():
    monitor, header = replay("healthy_lr1e-5.jsonl", FULL)
    assert header["lr"] == 1e-5
    assert monitor.alerts == [], monitor.summary()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_demo_seeds_raise_nothing(seed):
    """The demo's three seeds, recorded from real runs (`mogrpo demo --seed N`)."""
    monitor, header = replay(f"demo_seed{seed}.jsonl", DEMO)
    assert header["source"].startswith("recorded from a real run")
    assert monitor.alerts == [], monitor.summary()


def test_flat_noisy_runs_do_not_alert():
    """250 steps of a reward that does not move, 32 samples a step: the best of ~30 windows is
    high by noise alone, which `best_effect` must absorb."""
    for seed in range(10):
        rng, monitor = random.Random(seed), HealthMonitor()
        for step in range(1, 251):
            value = sum(rng.random() < 0.5 for _ in range(32)) / 32
            monitor.observe(step, {"task/t/reward/r/mean": value, "task/t/kl": 0.05}, FULL)
        assert monitor.alerts == [], monitor.summary()


def test_kl_growth_while_reward_falls_is_one_alert_not_two():
    """KL growing ×1.15 a step (fixed β) is a kl_explosion on its own; while the reward falls,
    the reward alert carries it and kl_explosion stays quiet."""
    def run(reward_falls: bool) -> list:
        rng, monitor = random.Random(5), HealthMonitor()
        for step in range(1, 41):
            p = 0.9 - (0.5 * min(1.0, max(0, step - 8) / 10) if reward_falls else 0.0)
            kl = 0.005 * 1.15**step
            monitor.observe(step, {"task/t/reward/r/mean": sum(rng.random() < p
                                                               for _ in range(16)) / 16,
                                   "task/t/kl": kl, "kl": kl, "task/t/beta": 0.04}, FULL)
        return monitor.alerts

    assert [a.check for a in run(reward_falls=False)] == ["kl_explosion"] * 2  # task/t/kl, kl
    (alert,) = run(reward_falls=True)
    assert alert.check == "reward_regression" and ", while KL rose from " in alert.evidence


def test_min_drop_is_in_the_task_reward_so_a_small_bonus_dipping_is_no_regression():
    """demo seed 1: the 0.1-weight format bonus dips 0.27 → 0.14 early on (p = 0.001, 2.2 ×
    its noise) while the task learns; the task's reward moves by 0.013 < min_drop."""
    def run(weight: float) -> list:
        rng, monitor = random.Random(1), HealthMonitor()
        for step in range(1, 41):
            p = 0.9 - (0.5 if step > 16 else 0.0)
            monitor.observe(step, {"task/t/reward/bonus/mean": sum(rng.random() < p
                                                                   for _ in range(16)) / 16,
                                   "task/t/reward/bonus/weight": weight}, FULL)
        return monitor.alerts

    assert run(weight=0.05) == []  # 0.05 × 0.5 = 0.025 < 0.05
    assert [a.check for a in run(weight=1.0)] == ["reward_regression"]


# ----------------------------------------------------------------------------- causes


def two_objectives(step: int, rng: random.Random, correct: float, fmt: float,
                   kl: float) -> dict[str, float]:
    def mean(p: float) -> float:
        return sum(rng.random() < p for _ in range(32)) / 32

    return {"task/qa/reward/correct/mean": mean(correct), "task/qa/reward/format/mean": mean(fmt),
            "task/qa/kl": kl, "task/qa/beta": 0.04, "lr": 1e-6}


def falling(monitor: HealthMonitor, ctx: StepContext, fmt_rises: bool, kl_grows: bool) -> list:
    rng = random.Random(3)
    for step in range(1, 41):
        late = max(0, step - 12) / 28
        m = two_objectives(step, rng, 0.9 - 0.6 * late, 0.3 + (0.6 * late if fmt_rises else 0),
                           0.02 + (0.3 * late if kl_grows else 0))
        monitor.observe(step, m, ctx)
    return [a for a in monitor.alerts if a.check == "reward_regression"]


def test_an_objective_that_rose_meanwhile_is_named_first_as_reward_hacking():
    (alert,) = falling(HealthMonitor(), FULL, fmt_rises=True, kl_grows=False)
    assert alert.evidence.startswith("task qa, objective correct")
    assert alert.causes[0].startswith("reward hacking: format 0.")
    assert "the policy trades correct for it" in alert.causes[0]
    assert alert.causes[1].startswith("the learning rate 1e-06 is perhaps too high")


def test_kl_growth_under_a_low_lr_puts_beta_first():
    (alert,) = falling(HealthMonitor(), StepContext(full_finetune=False), fmt_rises=False,
                       kl_grows=True)
    assert "while KL rose" in alert.evidence
    assert alert.causes[0].startswith("β 0.04 is too small for task qa (its KL grew)")
    assert alert.causes[1].startswith("the learning rate 1e-06 is perhaps too high for LoRA")


def test_a_task_with_a_kl_controller_gets_no_kl_signal_and_a_budget_fix():
    ctx = StepContext(full_finetune=True, kl_budgets={"qa": 0.06})
    (alert,) = falling(HealthMonitor(), ctx, fmt_rises=False, kl_grows=True)
    assert "KL rose" not in alert.evidence
    assert alert.causes[1] == ("the KL budget of task qa lets the policy drift too far → lower "
                               "tasks.qa.kl.high (or kl.target)")


# ----------------------------------------------------------------------------- eval regression


def evals(monitor: HealthMonitor, scores: list[float], n: int = 200,
          start: float = 0.84) -> list:
    monitor.observe_eval(0, {"eval/t/score": start, "eval/t/num_samples": n})
    for i, score in enumerate(scores, 1):
        monitor.observe(20 * i, {"eval/t/score": score, "eval/t/num_samples": n}, FULL)
    return [a for a in monitor.alerts if a.check == "eval_regression"]


def test_eval_below_start_only_beyond_its_sampling_error():
    # n = 200: 2.33 × √(.84·.16/200 + .78·.22/200) = 0.092, so 0.84 → 0.78 is noise ...
    assert evals(HealthMonitor(), [0.78]) == []
    # ... and 0.84 → 0.70 is not: 2.33 × √(.84·.16/200 + .70·.30/200) = 0.097 < 0.14
    (alert,) = evals(HealthMonitor(), [0.70])
    assert "by 0.140, more than its sampling error allows (2.33 × SE = 0.097, n = 200)" \
        in alert.evidence
    # with 1000 prompts the same 0.06 drop is beyond the sampling error (margin 0.041)
    assert len(evals(HealthMonitor(), [0.78], n=1000)) == 1


def test_eval_below_the_best_by_the_margin():
    (alert,) = evals(HealthMonitor(), [0.95, 0.83], start=0.5)
    assert alert.step == 40 and alert.best_step == 20
    assert "below the best so far 0.950 (step 20) by 0.120" in alert.evidence
    assert evals(HealthMonitor(), [0.95, 0.87], start=0.5) == []


def test_best_checkpoint_is_the_front_point_with_the_best_mean():
    monitor = HealthMonitor()
    def scores(a: float, b: float) -> dict[str, float]:
        return {"eval/a/score": a, "eval/b/score": b, "eval/a/num_samples": 100,
                "eval/b/num_samples": 100}

    monitor.observe_eval(0, scores(0.5, 0.5))
    monitor.observe(10, scores(0.9, 0.45), FULL)
    monitor.observe(20, scores(0.6, 0.7), FULL)
    monitor.observe(30, scores(0.2, 0.2), FULL)
    alerts = [a for a in monitor.alerts if a.check == "eval_regression"]
    # task a at step 20 is 0.3 below its best (still so at 30: the same alert); task b falls
    # at 30. The front is steps 10 and 20 (0 is dominated by 20): 10 has the best mean (0.675
    # against 0.65)
    assert [(a.step, a.evidence[:6]) for a in alerts] == [(20, "task a"), (30, "task b")]
    assert {a.best_step for a in alerts} == {10}


def test_stop_and_rollback_actions():
    monitor = HealthMonitor(HealthConfig(eval_regression={"action": "stop"}))
    evals(monitor, [0.3])
    assert monitor.should_stop and monitor.alerts[-1].best_step == 0

    cfg = HealthConfig(eval_regression={"action": "rollback", "max_rollbacks": 1})
    monitor = HealthMonitor(cfg)
    (first,) = evals(monitor, [0.3])
    assert monitor.rollback_alert is first and not monitor.should_stop
    monitor.note_rollback(20, 0)
    assert monitor.rollback_alert is None
    # the next eval regresses again: the one rollback allowed is spent, so it stops
    monitor.observe(40, {"eval/t/score": 0.3, "eval/t/num_samples": 200}, FULL)
    last = monitor.alerts[-1]
    assert last.step == 40 and last.action == "stop" and monitor.should_stop
    assert last.causes[-1] == ("1 rollback(s) did not help (health.eval_regression."
                               "max_rollbacks) → the run stops")
    # step 20's checkpoint holds the restored weights now: never a target again
    assert monitor.eval_regression.best_on_front() == 0
    assert 20 not in [monitor.eval_regression.best_on_front(s) for s in (20, 40)]


def test_the_final_eval_only_warns():
    monitor = HealthMonitor(HealthConfig(eval_regression={"action": "stop"}))
    monitor.observe_eval(0, {"eval/t/score": 0.8, "eval/t/num_samples": 100})
    (alert,) = monitor.observe_eval(50, {"eval/t/score": 0.2, "eval/t/num_samples": 100},
                                    final=True)
    assert alert.action == "warn" and not monitor.should_stop


# ----------------------------------------------------------------------------- state, stats


def test_state_round_trip_mid_collapse_gives_the_same_alerts():
    straight, _ = replay("collapse_lr1e-4.jsonl", FULL)
    first, _ = replay("collapse_lr1e-4.jsonl", FULL, until=13)
    resumed = HealthMonitor()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    lines = [json.loads(line) for line in (FIXTURES / "collapse_lr1e-4.jsonl").read_text()
             .splitlines()][1:]
    for row in lines:
        if row["step"] > 13 and row["kind"] == "step":
            resumed.observe(row["step"], {k: v for k, v in row.items() if k != "kind"}, FULL)
        elif row["step"] > 13 and row["tag"] == "end":
            resumed.observe_eval(row["step"], eval_metrics(row), final=True)
    assert [a.message for a in resumed.alerts] == [a.message for a in straight.alerts]


def test_state_of_a_monitor_from_before_the_regression_checks_loads():
    old = HealthMonitor().state_dict()
    for key in ("rollbacks", "reward_regression", "eval_regression"):
        del old[key]
    monitor = HealthMonitor()
    monitor.load_state_dict(old)
    assert monitor.rollbacks == 0 and monitor.reward_regression.rows == {}


def test_mann_whitney_by_hand_and_against_scipy():
    # U = 9 of 9, var = 3·3/12·7 = 5.25: z = (9 - 4.5 - 0.5)/√5.25 = 1.7457, p = 0.04043
    assert mann_whitney_greater([3, 4, 5], [0, 1, 2]) == pytest.approx(0.04043, abs=1e-5)
    assert mann_whitney_greater([1, 1], [1, 1]) == 1.0  # all tied: no evidence
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        x = [round(rng.random(), 1) for _ in range(8)]
        y = [round(rng.random() - 0.2, 1) for _ in range(8)]
        expected = stats.mannwhitneyu(x, y, alternative="greater", method="asymptotic").pvalue
        assert mann_whitney_greater(x, y) == pytest.approx(expected, rel=1e-9)


def test_step_noise_and_score_error():
    noise = StepNoise()
    for value in (0.0, 1.0, 0.0, 1.0):
        noise.add(value)
    assert noise.sigma == pytest.approx(math.sqrt(3 / 6))  # √(Σd² / 2n), d = 1, n = 3
    rising = StepNoise()
    for step in range(100):
        rising.add(0.01 * step)  # a trend without noise is (almost) no noise
    assert rising.sigma == pytest.approx(0.01 / math.sqrt(2))
    assert score_error(0.84, 200) == pytest.approx(math.sqrt(0.84 * 0.16 / 200))
    assert score_error(0.5, 100, std=0.2) == pytest.approx(0.02)

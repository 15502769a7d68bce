"""The per-task health checks: a task whose eval does not move while another's rises
(`task_stalled`), and a task whose KL sits far outside its band (`kl_out_of_band`): each fires
once, at the step it should, with cause and fix; healthy runs raise neither."""

from __future__ import annotations

import json
import random

from mogrpo.health import HealthConfig, HealthMonitor, StepContext

BANDS = {"fairness": (0.01, 0.05), "hallucination": (0.3, 0.6)}
CTX = StepContext(kl_bands=BANDS)
ONLY = {"task_stalled", "kl_out_of_band"}


def monitor() -> HealthMonitor:
    """Only the two checks under test run."""
    from mogrpo.health.monitor import CHECKS
    return HealthMonitor(HealthConfig(**{c: {"enabled": False} for c in CHECKS if c not in ONLY}))


def evals(m: HealthMonitor, series: dict[str, list[float]], every: int = 50
          ) -> dict[int, list[str]]:
    """Quick-evals at steps 0 (before GRPO), every, 2 every, ...: {step: messages fired}."""
    fired = {}
    for i in range(len(next(iter(series.values())))):
        metrics = {f"eval/{t}/score": s[i] for t, s in series.items()}
        metrics.update({f"eval/{t}/num_samples": 200 for t in series})
        alerts = (m.observe_eval(0, metrics) if i == 0 else
                  m.observe(i * every, {**metrics, "task/fairness/kl": 0.24}, CTX))
        if alerts:
            fired[i * every] = [a.message for a in alerts]
    return fired


def test_a_task_that_does_not_move_while_another_learns_is_one_alert():
    # the seed 0: fairness 0.495 at every eval, hallucination 0.495 -> 1.000
    fired = evals(monitor(), {"fairness": [0.495] * 6,
                              "hallucination": [0.495, 0.6, 0.9, 1.0, 1.0, 1.0]})
    assert list(fired) == [200]  # start, 50, ..., 200: 4 evals after the start, once
    (message,) = fired[200]
    assert message.startswith(
        "[health] task_stalled at step 200: task fairness: eval score 0.495 has not moved by "
        "more than 0.03 over the last 5 evals while hallucination rose by 0.505 (its KL 0.240)")
    assert "Try: widen its KL band or lower its β" in message


def test_no_stall_alert_when_the_other_task_rose_only_at_the_last_eval():
    # demo seeds 5 and 7: hallucination learned between steps 150 and 200, fairness 50 steps
    # later; at step 200 fairness had been flat, but the other task only just ahead
    assert evals(monitor(), {"fairness": [0.52, 0.52, 0.52, 0.52, 0.54, 0.74, 0.77],
                             "hallucination": [0.52, 0.52, 0.52, 0.52, 0.78, 1.0, 1.0]}) == {}


def test_no_stall_alert_while_both_learn_or_both_have_converged():
    assert evals(monitor(), {"fairness": [0.5, 0.5, 0.52, 0.6, 0.7, 0.72],
                             "hallucination": [0.5, 0.7, 1.0, 1.0, 1.0, 1.0]}) == {}
    # both flat: nothing learns, which other checks see; this one compares tasks
    assert evals(monitor(), {"fairness": [0.7] * 6, "hallucination": [1.0] * 6}) == {}


def test_a_task_that_learned_and_levelled_off_has_not_stalled():
    fired = evals(monitor(), {"fairness": [0.5] * 5 + [0.7] * 6,
                              "hallucination": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0,
                                                1.0]})
    assert list(fired) == [200]  # stalled at the start; after it learned, no alert again


def test_a_stall_fires_again_after_the_task_dropped_back():
    fired = evals(monitor(), {"fairness": [0.5] * 5 + [0.4] + [0.5] * 5,
                              "hallucination": [0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.0, 1.0,
                                                1.0]})
    assert list(fired) == [200, 500]  # moved (down) at 250: five flat evals again by 500


def kl_steps(m: HealthMonitor, kl: dict[str, callable], n: int, seed: int = 0
             ) -> dict[int, list[str]]:
    rng = random.Random(seed)
    fired = {}
    for step in range(1, n + 1):
        metrics = {f"task/{t}/kl": f(step, rng) for t, f in kl.items()}
        metrics.update({f"task/{t}/beta": 0.05 for t in kl})
        alerts = m.observe(step, metrics, CTX)
        if alerts:
            fired[step] = [a.message for a in alerts]
    return fired


def test_kl_far_above_its_band_for_most_of_a_window_is_one_alert():
    # the fairness: KL ~0.24 against its band 0.01-0.05, from the start
    fired = kl_steps(monitor(), {"fairness": lambda s, r: 0.24 * r.uniform(0.7, 1.3),
                                 "hallucination": lambda s, r: 0.45 * r.uniform(0.7, 1.3)}, 250)
    assert list(fired) == [50]  # the first full window; once
    (message,) = fired[50]
    assert message.startswith("[health] kl_out_of_band at step 50: task fairness: KL above 2 × "
                              "its high 0.05 in 50 of the last 50 steps (median ")
    assert "band 0.01–0.05, β 0.05)" in message and "Try: kind `dual`" in message


def test_kl_that_enters_its_band_after_a_transient_raises_nothing():
    def settling(step, rng):  # far above for 30 steps, then inside with noise
        return (0.3 if step <= 30 else 0.03) * rng.uniform(0.6, 1.4)
    assert kl_steps(monitor(), {"fairness": settling}, 250) == {}


def test_kl_far_below_is_named_as_below():
    fired = kl_steps(monitor(), {"hallucination": lambda s, r: 0.05}, 60)
    (message,) = fired[50]
    assert "task hallucination: KL below its low 0.3 / 2 in 50 of the last 50 steps" in message


def test_tasks_without_a_band_are_not_judged():
    fired = kl_steps(monitor(), {"other": lambda s, r: 5.0}, 100)
    assert fired == {}


def test_state_round_trips_mid_stall():
    a = monitor()
    series = {"fairness": [0.495] * 6, "hallucination": [0.495, 0.6, 0.9, 1.0, 1.0, 1.0]}
    first = {k: v[:4] for k, v in series.items()}
    assert evals(a, first) == {}
    b = monitor()
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    rest = {f"eval/{t}/score": s[4] for t, s in series.items()}
    (alert,) = b.observe(200, rest, CTX)
    assert alert.check == "task_stalled" and alert.step == 200

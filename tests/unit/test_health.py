"""The health monitor: each check fires exactly at its patience on an injected failure, with its
message; a healthy stream raises nothing; state survives a JSON round trip."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from pydantic import BaseModel, ValidationError

from mogrpo.health import (
    Alert,
    HealthConfig,
    HealthMonitor,
    HealthStop,
    StepContext,
)
from mogrpo.health.monitor import CHECKS

TASKS = ("fairness", "hallucination")
CTX = StepContext(temperature=0.9, max_completion_length=96)


def healthy(step: int, rng: random.Random) -> dict[str, float]:
    """One step of a run going well, in USERS.md's ranges: KL 0.02–0.3, lengths 4–60,
    entropy 0.5–2, rewards slowly rising, a few zero-variance groups, nothing truncated."""
    m = {
        "step": step, "lr": 1e-5, "loss": rng.uniform(-0.05, 0.05),
        "policy/grad_norm": rng.uniform(0.5, 2.0), "policy/entropy": rng.uniform(0.5, 2.0),
        "policy/skipped_updates": 0, "rollout/completion_length": rng.uniform(20, 60),
        "rollout/truncated_frac": rng.choice([0.0, 0.0, 0.0625]),
        "rollout/identical_group_frac": rng.uniform(0.0, 0.25),
    }
    for task, kl in zip(TASKS, (0.04, 0.12), strict=True):
        m[f"task/{task}/kl"] = kl * rng.uniform(0.5, 2.0)
        m[f"task/{task}/reward/mean"] = 0.4 + 0.3 * step / 300 + rng.uniform(-0.03, 0.03)
        m[f"task/{task}/zero_var_frac"] = rng.uniform(0.0, 0.5)
    m["kl"] = (m["task/fairness/kl"] + m["task/hallucination/kl"]) / 2
    return m


def stream(monitor: HealthMonitor, n: int, inject=None, start: int = 1, seed: int = 0,
           ctx: StepContext = CTX) -> dict[int, list[Alert]]:
    """Feed `n` healthy steps, each passed through `inject(step, metrics)` when given;
    returns {step: alerts} for the steps that raised any."""
    rng = random.Random(seed)
    fired = {}
    for step in range(start, start + n):
        metrics = healthy(step, rng)
        if inject:
            inject(step, metrics)
        alerts = monitor.observe(step, metrics, ctx)
        if alerts:
            fired[step] = alerts
    return fired


def fires_at(monitor: HealthMonitor, inject, warmup: int = 30, failing: int = 40,
             ctx: StepContext = CTX) -> dict[int, list[Alert]]:
    """Healthy warm-up, then `failing` steps with the failure injected."""
    assert stream(monitor, warmup, ctx=ctx) == {}
    return stream(monitor, failing, inject, start=warmup + 1, ctx=ctx)


def only(fired: dict[int, list[Alert]]) -> tuple[int, Alert]:
    assert len(fired) == 1 and len(next(iter(fired.values()))) == 1, fired
    step, (alert,) = next(iter(fired.items()))
    return step, alert


def test_healthy_run_raises_no_alert():
    monitor = HealthMonitor()
    assert stream(monitor, 250) == {}
    assert not monitor.should_stop
    assert monitor.summary() == "health: no alerts in 250 steps"


def test_not_learning_frozen_parameters():
    monitor = HealthMonitor()

    def frozen(step, m):  # nothing requires grad: no gradient, policy == reference
        m.update({"kl": 0.0, "policy/grad_norm": 0.0, "task/fairness/kl": 0.0,
                  "task/hallucination/kl": 0.0})

    step, alert = only(fires_at(monitor, frozen))
    assert step == 30 + 10  # patience 10
    assert alert.action == "stop" and monitor.should_stop
    assert alert.message.startswith("[health] not_learning at step 40: KL 0.0 and grad norm "
                                    "0.0 have stayed at 0 for 10 steps while lr = 1e-05")
    assert "gradients overwritten instead of accumulated" in alert.message


def test_not_learning_optimizer_that_never_steps():
    monitor = HealthMonitor()

    def no_step(step, m):  # gradients exist, but parameters never change
        m.update({"kl": 0.0, "policy/update_norm": 0.0, "task/fairness/kl": 0.0,
                  "task/hallucination/kl": 0.0})

    step, alert = only(fires_at(monitor, no_step))
    assert step == 40 and "update norm 0.0 have stayed at 0 for 10 steps" in alert.message


@pytest.mark.parametrize("change", [
    {"lr": 0.0},  # end of a linear decay: standing still is expected
    {"task/fairness/zero_var_frac": 1.0, "task/hallucination/zero_var_frac": 1.0},  # no signal
    {"policy/update_norm": 0.01},  # parameters move: KL 0 is a coincidence of rounding
])
def test_not_learning_needs_lr_signal_and_no_update(change):
    cfg = HealthConfig(no_signal={"enabled": False})
    fired = fires_at(HealthMonitor(cfg), lambda s, m: m.update(
        {"kl": 0.0, "policy/grad_norm": 0.0, **change}))
    assert not any(a.check == "not_learning" for alerts in fired.values() for a in alerts)


def test_not_learning_without_kl_term_uses_the_gradient():
    ctx = StepContext(temperature=0.9, kl_measured=False)  # every β is 0: kl is always 0
    assert fires_at(HealthMonitor(), lambda s, m: m.update({"kl": 0.0}), ctx=ctx) == {}
    fired = fires_at(HealthMonitor(), lambda s, m: m.update({"kl": 0.0, "policy/grad_norm": 0.0}),
                     ctx=ctx)
    assert only(fired)[0] == 40


def raw_kl() -> HealthMonitor:
    """KL judged step by step (smooth 1), so the patience counts from the first bad step."""
    return HealthMonitor(HealthConfig(kl_explosion={"smooth": 1}))


def test_kl_explosion_by_growth():
    monitor = raw_kl()

    def explode(step, m):  # USERS.md #2: 0.318 where 0.02–0.06 was normal
        m["task/fairness/kl"] = 0.318

    step, alert = only(fires_at(monitor, explode))
    assert step == 33  # patience 3
    assert alert.action == "warn" and not monitor.should_stop
    assert "kl_explosion at step 33: task fairness KL 0.318 is" in alert.message
    assert "× its earlier median 0.0" in alert.message and "for 3 steps" in alert.message
    assert "raise this task's beta" in alert.message


def test_kl_explosion_above_the_ceiling():
    fired = fires_at(raw_kl(), lambda s, m: m.update({"kl": 1.7}), warmup=2)
    step, alert = only(fired)
    assert step == 5 and "KL 1.700 is above the ceiling 1 for 3 steps" in alert.message


def test_kl_explosion_judges_the_median_of_recent_steps_by_default():
    # one step's KL comes from a few hundred sampled tokens: noisy. Isolated spikes are
    # not an explosion ...
    spikes = {31: 1.4, 33: 1.6, 36: 1.5, 37: 1.3, 41: 2.0}
    assert stream(HealthMonitor(), 60, lambda s, m: m.update(
        {"task/fairness/kl": spikes.get(s, m["task/fairness/kl"])})) == {}

    # ... but a KL that stays high with an occasional low step is: judged step by step, each
    # low step would restart the patience and the check would never fire
    def noisy_rise(step, m):
        m["task/fairness/kl"] = 0.05 if step % 3 == 0 else 1.5

    assert fires_at(raw_kl(), noisy_rise) == {}
    step, alert = only(fires_at(HealthMonitor(), noisy_rise))
    assert step == 36  # medians high from step 34 (3 of the 5 steps 30-34 at 1.5)
    assert "task fairness KL 1.500 (median of the last 5 steps) is above the ceiling 1 for 3 " \
        "steps" in alert.message


BUDGETS = StepContext(temperature=0.9, max_completion_length=96,
                      kl_budgets={"fairness": 0.05, "hallucination": 0.6})


def test_kl_under_a_controller_is_judged_by_the_ceiling_only():
    # demo seed 1: the hallucination task (band 0.3-0.6) flips its answers around step 25
    # and KL rises from ~0.2 to ~1.1: 5x, but the band controller is steering it
    def rise(step, m):
        m["task/hallucination/kl"] = 1.1

    assert fires_at(raw_kl(), rise, ctx=BUDGETS) == {}
    # the same rise in a task with a fixed beta is an explosion
    step, alert = only(fires_at(raw_kl(), rise))
    assert step == 33 and "task hallucination KL 1.100 is above the ceiling 1" in alert.message
    step, alert = only(fires_at(raw_kl(), lambda s, m: m.update(
        {"task/hallucination/kl": 0.9})))
    assert "task hallucination KL 0.900 is" in alert.message and "× its earlier median" \
        in alert.message


def test_a_task_budget_lifts_its_ceiling():
    def high(step, m):
        m["task/hallucination/kl"] = 1.5  # above 1, under 3 x 0.6

    assert fires_at(raw_kl(), high, ctx=BUDGETS, warmup=2) == {}
    step, alert = only(fires_at(raw_kl(), lambda s, m: m.update(
        {"task/hallucination/kl": 1.9}), ctx=BUDGETS, warmup=2))
    assert step == 5 and "KL 1.900 is above the ceiling 1.8 for 3 steps" in alert.message
    # the fairness task (budget 0.05) keeps the default ceiling of 1
    step, alert = only(fires_at(raw_kl(), lambda s, m: m.update(
        {"task/fairness/kl": 1.2}), ctx=BUDGETS, warmup=2))
    assert "task fairness KL 1.200 is above the ceiling 1 " in alert.message


def test_length_collapse_to_one_token():
    fired = fires_at(HealthMonitor(), lambda s, m: m.update({"rollout/completion_length": 1.0}))
    step, alert = only(fired)
    assert step == 33
    assert "length_collapse at step 33: all tasks: mean completion length 1.0 tokens (floor 2, "\
        "median" in alert.message and "for 3 steps" in alert.message
    assert "stop_token_ids" in alert.message


def test_length_collapse_by_a_sharp_drop():
    # 6 tokens is above the floor but under 0.3 × the ~40-token median
    step, alert = only(fires_at(HealthMonitor(), lambda s, m: m.update(
        {"rollout/completion_length": 6.0})))
    assert step == 33 and "mean completion length 6.0 tokens" in alert.message


def test_truncation():
    step, alert = only(fires_at(HealthMonitor(), lambda s, m: m.update(
        {"rollout/truncated_frac": 0.6})))
    assert step == 35  # patience 5
    assert ("truncation at step 35: 60% of completions hit rollout.max_completion_length = 96 "
            "(threshold 20%) for 5 steps") in alert.message


def test_no_signal_for_a_constant_reward():
    def constant(step, m):  # every completion of this task scores 1.0
        m.update({"task/hallucination/zero_var_frac": 1.0, "task/hallucination/reward/mean": 1.0})

    cfg = HealthConfig(reward_stalled={"enabled": False})
    step, alert = only(fires_at(HealthMonitor(cfg), constant))
    assert step == 40  # patience 10
    assert ("no_signal at step 40: task hallucination: 100% of groups score all K completions "
            "the same (reward mean 1.000) for 10 steps") in alert.message
    assert "algorithm.dynamic_sampling: true" in alert.message


def test_non_finite_counts_bad_steps_and_stops_at_patience():
    monitor = HealthMonitor()
    bad_steps = {31, 35, 40}

    def nan(step, m):
        if step in bad_steps:
            m["loss"] = math.nan
        if step == 35:
            m["policy/grad_norm"], m["policy/skipped_updates"] = math.inf, 1

    step, alert = only(fires_at(monitor, nan, failing=20))
    assert step == 40 and alert.action == "stop" and monitor.should_stop
    assert "non_finite at step 40: NaN/inf on 3 steps, now in loss" in alert.message


def test_fp16_overflows_are_the_loss_scalers_until_the_scale_falls_below_one():
    monitor = HealthMonitor()

    def overflow(step, m):  # from step 31 on, every step overflows and halves the scale
        m["policy/grad_norm"], m["policy/loss_scale"] = math.inf, 2.0 ** (46 - step)

    # 2^15, 2^14, ... : the scaler skipping updates is no divergence; from 2^-1 on (step 47)
    # even unscaled gradients overflow, and the third such step stops the run
    step, alert = only(fires_at(monitor, overflow, failing=20))
    assert step == 49 and "now in policy/grad_norm" in alert.message


def test_grad_spike():
    def spikes_at(*steps):
        return lambda s, m: m.update({"policy/grad_norm": 60.0}) if s in steps else None

    # a lone spike is contained by gradient clipping: no alert
    assert fires_at(HealthMonitor(), spikes_at(31), failing=40) == {}
    # a second one within the window (50 steps) is the alert
    step, alert = only(fires_at(HealthMonitor(), spikes_at(31, 52), failing=40))
    assert step == 52
    assert "grad_spike at step 52: grad norm 60 is" in alert.message
    assert "× its running median" in alert.message and "after spikes at steps 31" in alert.message
    step, _ = only(fires_at(HealthMonitor(), spikes_at(*range(31, 71)), failing=40))
    assert step == 32  # a run of spikes: once, at its second step
    lone = HealthConfig(grad_spike={"repeats": 1})
    step, _ = only(fires_at(HealthMonitor(lone), spikes_at(31), failing=40))
    assert step == 31


def test_grad_spikes_clipping_contains_do_not_count():
    """A spike clipped to a few typical norms reached the optimizer as an ordinary gradient:
    the demo's seed 4, converged by step 100, met grad norms 14x and 30x its median 30 steps
    apart (a rare answer in an otherwise unanimous group), both clipped to 1.0 = 2x."""
    record = json.loads((Path(__file__).parent / "fixtures" / "health"
                         / "demo_seed4_grad_norms.json").read_text())
    norms = record["grad_norm"]

    def run(ctx):
        return stream(HealthMonitor(), len(norms), lambda s, m: m.update(
            {"policy/grad_norm": norms[s - 1]}), ctx=ctx)

    clipped = StepContext(temperature=0.7, max_grad_norm=1.0)
    assert run(clipped) == {}
    # without the clipping threshold every spike counts: the same norms raise the alert
    assert [a.check for alerts in run(StepContext(temperature=0.7)).values()
            for a in alerts] == ["grad_spike", "grad_spike"]
    # a spike above a tiny median reaches the optimizer far larger than a typical step even
    # after clipping (1.0 against 0.01): it counts
    tiny = StepContext(temperature=0.9, max_grad_norm=1.0)
    small = lambda s, m: m.update({"policy/grad_norm": 0.01})  # noqa: E731
    monitor = HealthMonitor()
    assert stream(monitor, 30, small, ctx=tiny) == {}
    fired = stream(monitor, 30, lambda s, m: m.update(
        {"policy/grad_norm": 5.0 if s in (40, 50) else 0.01}), start=31, ctx=tiny)
    assert list(fired) == [50]


def test_grad_spikes_further_apart_than_the_window_stay_lone():
    monitor = HealthMonitor()
    assert fires_at(monitor, lambda s, m: m.update({"policy/grad_norm": 60.0})
                    if s in (31, 85) else None, failing=60) == {}
    state = json.loads(json.dumps(monitor.state_dict()))  # a resumed run remembers the spikes
    again = HealthMonitor()
    again.load_state_dict(state)
    fired = stream(again, 5, lambda s, m: m.update({"policy/grad_norm": 60.0}), start=91)
    assert list(fired) == [91]  # 85 and 91: within the window


def test_sampling_ignored():
    def greedy(step, m):  # USERS.md #3: temperature dropped on the way to generate()
        m.update({"policy/entropy": 0.0004, "rollout/identical_group_frac": 1.0})

    step, alert = only(fires_at(HealthMonitor(), greedy))
    assert step == 35  # patience 5
    assert ("sampling_ignored at step 35: sampling at temperature 0.9 but token entropy 0.0004 "
            "nats and 100% of groups with K identical completions for 5 steps") in alert.message
    cold = StepContext(temperature=0.1)  # near-greedy on purpose
    assert fires_at(HealthMonitor(), greedy, ctx=cold) == {}


def test_reward_stalled():
    cfg = HealthConfig(reward_stalled={"patience": 20, "smooth": 5})
    monitor = HealthMonitor(cfg)

    def flat(step, m):
        m["task/fairness/reward/mean"] = 0.6 + 0.004 * (step % 2) - 0.002  # noise < min_delta
        m["task/hallucination/reward/mean"] = 0.02 * step  # still learning

    fired = stream(monitor, 40, flat)
    step, alert = only(fired)
    # first smoothed value (and best) at step 5; no improvement from step 6: 20th at step 25
    assert step == 25
    assert ("reward_stalled at step 25: task fairness: reward mean (smoothed over 5 steps) "
            "0.600 has not beaten its best 0.600 (step 5) by 0.01 for 20 steps") in alert.message


def test_disabled_check_and_stop_action_are_configurable():
    cfg = HealthConfig(truncation={"enabled": False})
    assert fires_at(HealthMonitor(cfg), lambda s, m: m.update({"rollout/truncated_frac": 1.0})) == {}
    cfg = HealthConfig(truncation={"action": "stop", "patience": 2})
    monitor = HealthMonitor(cfg)
    step, alert = only(fires_at(monitor, lambda s, m: m.update({"rollout/truncated_frac": 1.0})))
    assert step == 32 and monitor.should_stop
    error = HealthStop([alert])
    assert error.exit_code == 3
    assert str(error).startswith("run stopped by the health monitor: [health] truncation")
    assert "set health.truncation.action: warn to only warn" in str(error)


def test_alert_event_and_summary():
    monitor = HealthMonitor()
    fires_at(monitor, lambda s, m: m.update({"rollout/truncated_frac": 0.5}))
    (alert,) = monitor.alerts
    event = json.loads(json.dumps(alert.as_event()))
    assert event == {"event": "health_alert", "check": "truncation", "step": 35,
                     "message": alert.message, "action": "warn", "evidence": alert.evidence,
                     "causes": alert.causes, "fix": alert.fix, "best_step": None}
    # the message's parts: what was seen, why it may be, what to try
    assert alert.evidence == ("50% of completions hit rollout.max_completion_length = 96 "
                              "(threshold 20%) for 5 steps")
    assert alert.causes == ["a budget too small for the task, repetition loops, or a stop token "
                            "the model never emits"]
    assert alert.fix.startswith("raise max_completion_length, check stop_token_ids")
    assert monitor.summary().splitlines() == [
        "health: 1 alert(s) in 70 steps", f"  step 35 truncation (warn): {alert.evidence}",
        f"    likely: {alert.causes[0]}", f"    fix: {alert.fix}"]


def test_state_round_trip_resumes_streaks():
    def frozen(step, m):
        m.update({"kl": 0.0, "policy/grad_norm": 0.0})

    straight = HealthMonitor()
    expected = stream(straight, 20, frozen)
    first = HealthMonitor()
    assert stream(first, 6, frozen) == {}
    resumed = HealthMonitor()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
    # the same steps, same seed: continue the stream where it stopped
    rng_steps = stream(resumed, 14, frozen, start=7, seed=0)
    assert [s for s in rng_steps] == [s for s in expected] == [10]
    assert resumed.summary().startswith("health: 1 alert(s) in 20 steps") and resumed.should_stop
    # resuming a stopped run (after fixing it) continues; its past alerts stay in the summary
    again = HealthMonitor()
    again.load_state_dict(json.loads(json.dumps(resumed.state_dict())))
    assert not again.should_stop and again.alerts == resumed.alerts


def test_config_is_strict_and_documented():
    with pytest.raises(ValidationError):
        HealthConfig(truncaton={"threshold": 0.5})
    with pytest.raises(ValidationError):
        HealthConfig(truncation={"action": "explode"})

    def undocumented(model: type[BaseModel], prefix: str = "health") -> list[str]:
        missing = []
        for name, info in model.model_fields.items():
            if not info.description:
                missing.append(f"{prefix}.{name}")
            if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel):
                missing += undocumented(info.annotation, f"{prefix}.{name}")
        return missing

    assert undocumented(HealthConfig) == []


def distinct_chars(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A reward that differs between random completions (used by the tiny-run test)."""
    return [float(len(set(c))) for c in completions]


def _tiny_trainer(tmp_path, tiny_model_dir, **algorithm):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["lora"] = {"enabled": True, "r": 4, "alpha": 8}
    for task in base["tasks"].values():
        task["data"] += "?size=32"
        task["eval_size"] = 4
        # varies between random completions from the first step: advantages ≠ 0
        task["rewards"] = [{"fn": f"{__file__}:distinct_chars"}]
    base["rollout"].update(num_generations=4, max_completion_length=4)
    base["train"].update(micro_batch_size=4, gradient_accumulation_steps=1, learning_rate=1e-2,
                         warmup_steps=0)
    base.setdefault("algorithm", {}).update(algorithm)
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    return config, GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("steps_optimizer", [False, True])
def test_not_learning_on_a_tiny_run_whose_optimizer_never_steps(tmp_path, tiny_model_dir,
                                                               monkeypatch, steps_optimizer):
    config, trainer = _tiny_trainer(tmp_path, tiny_model_dir)
    if not steps_optimizer:  # the injected bug: gradients exist, parameters never change
        monkeypatch.setattr(trainer.optimizer, "step", lambda *a, **k: None)
    monitor = HealthMonitor(HealthConfig(not_learning={"patience": 3}))
    ctx = StepContext(temperature=config.rollout.temperature, kl_measured=True)
    fired = {}
    for _ in range(3):
        metrics = trainer.train_step()
        if alerts := [a for a in monitor.observe(trainer.step, metrics, ctx)
                      if a.check == "not_learning"]:
            fired[trainer.step] = alerts
    if steps_optimizer:
        assert fired == {} and metrics["kl"] > 0
    else:  # LoRA starts at B = 0 and never moves: KL to the adapter-free base stays exactly 0
        assert metrics["kl"] == 0.0 and metrics["policy/grad_norm"] > 0
        assert list(fired) == [3] and monitor.should_stop
        assert "not_learning at step 3: KL 0.0 and update norm 0.0" in fired[3][0].message
        assert metrics["policy/update_norm"] == 0.0


def test_update_norm_is_measured_with_several_passes_per_step(tmp_path, tiny_model_dir):
    # μ = 2: the norm of the first pass's update, not overwritten by the second pass
    _, trainer = _tiny_trainer(tmp_path, tiny_model_dir, num_iterations=2)
    metrics = trainer.train_step()
    assert math.isfinite(metrics["policy/update_norm"]) and metrics["policy/update_norm"] > 0


def test_summary_says_when_checks_were_off():
    off = HealthMonitor(HealthConfig(enabled=False))
    stream(off, 20)
    assert off.summary() == "health: checks were off (health.enabled: false); no step was watched"
    some = HealthMonitor(HealthConfig(truncation={"enabled": False}, grad_spike={"enabled": False}))
    stream(some, 20)
    assert some.summary() == "health: no alerts in 20 steps (checks off: truncation, grad_spike)"
    every = HealthMonitor(HealthConfig(**{name: {"enabled": False} for name in CHECKS}))
    stream(every, 20)
    assert every.summary().startswith("health: every check was off")

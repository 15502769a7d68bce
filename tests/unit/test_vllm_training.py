"""GRPO steps with `rollout.engine: vllm` on a fake vLLM: the engine sleeps through the update,
gets the merged LoRA weights after each optimizer step, and its log-probs weight the loss."""

from __future__ import annotations

import pytest
import torch

from fake_vllm import FakeLLM, FakeSamplingParams
from mogrpo.config import engines
from mogrpo.rollout import vllm_engine
from mogrpo.rollout.weights import checkpoint_state

K, PROMPTS_PER_STEP = 4, 2


def distinct_chars(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A reward that differs between random completions, so advantages are not zero."""
    return [float(len(set(c))) for c in completions]


def sampler_logprob(i: int, k: int, j: int) -> float:
    # the tiny policy gives a random token about log(1/386) = -6: the cap bites at k = 0
    return -8.0 + 1.5 * k - 0.05 * j


def vllm_trainer(tmp_path, tiny_model_dir, monkeypatch, *overrides: str):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    built: list[FakeLLM] = []

    def llm(**kwargs):
        built.append(FakeLLM(logprob=sampler_logprob, **kwargs))
        return built[-1]

    monkeypatch.setattr(engines, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: (llm, FakeSamplingParams))
    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["lora"] = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0}
    base["tasks"] = {"fairness": {"data": "builtin:bias_probe?size=16",
                                  "rewards": [{"fn": f"{__file__}:distinct_chars"}]}}
    base["rollout"].update(num_generations=K, max_completion_length=6, engine="vllm")
    base["train"].update(micro_batch_size=K * PROMPTS_PER_STEP, gradient_accumulation_steps=1,
                         learning_rate=1e-2, warmup_steps=0)
    config, _ = load_config(None, list(overrides), base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    return GRPOTrainer(ctx, make_reference(ctx.policy, needed=True)), built[0]


def test_engine_sleeps_through_the_update_and_gets_each_steps_weights(tmp_path, tiny_model_dir,
                                                                      monkeypatch):
    trainer, llm = vllm_trainer(tmp_path, tiny_model_dir, monkeypatch)
    assert llm.engine_kwargs["enable_sleep_mode"] is True
    assert llm.engine_kwargs["model"] == str(tiny_model_dir)  # the base: LoRA arrives merged
    asleep_in_update = []
    update = trainer.update

    def spy(batch):
        asleep_in_update.append(set(llm.asleep))
        return update(batch)

    monkeypatch.setattr(trainer, "update", spy)
    policy = trainer.ctx.policy
    for _ in range(2):
        metrics = trainer.train_step()
        # after the optimizer step vLLM holds exactly the policy's weights, LoRA merged
        pushed, current = llm.model.loads[-1], checkpoint_state(policy)
        assert pushed.keys() == current.keys()
        assert all(torch.equal(pushed[n], current[n]) for n in pushed)
        assert all(p.grad is None for p in policy.parameters())  # freed before vLLM wakes
        assert metrics["time/weight_sync_s"] >= 0
    q = policy.base_model.model.model.layers[0].self_attn.q_proj
    merged = q.base_layer.weight + 2.0 * q.lora_B["default"].weight @ q.lora_A["default"].weight
    assert torch.allclose(llm.model.loads[-1]["model.layers.0.self_attn.q_proj.weight"], merged)
    assert not torch.equal(merged, q.base_layer.weight)  # the adapter did move
    assert asleep_in_update == [{"weights", "kv_cache"}] * 2
    rollout = [("wake_up", ("kv_cache",)), ("generate", PROMPTS_PER_STEP), ("sleep", 2)]
    push = [("wake_up", ("weights",)), ("apply_model",), ("reset_prefix_cache",)]
    assert llm.calls == [("sleep", 2)] + push + rollout + push + rollout + push
    assert len(llm.model.loads) == 3  # before the first rollout, then after each step


def test_sampler_logprobs_weight_each_token_with_the_truncated_ratio(tmp_path, tiny_model_dir,
                                                                     monkeypatch):
    import mogrpo.trainer.update as update

    trainer, llm = vllm_trainer(tmp_path, tiny_model_dir, monkeypatch)
    calls = []

    def spy(logp, old, advantages, mask, **kwargs):
        calls.append((old.detach().clone(), mask.clone(), kwargs["importance_weights"]))
        return loss(logp, old, advantages, mask, **kwargs)

    loss = update.grpo_loss
    monkeypatch.setattr(update, "grpo_loss", spy)
    metrics = trainer.train_step()
    assert llm.requests[0][1].logprobs == 0  # vLLM was asked for the sampled tokens' log-probs
    (old, mask, weights), = calls  # one micro-batch: row i * K + k is completion k of prompt i
    for row in range(K * PROMPTS_PER_STEP):
        i, k = divmod(row, K)
        for j in range(mask.shape[1]):
            want = min(float(torch.exp(old[row, j] - sampler_logprob(i, k, j))), 3.0) \
                if mask[row, j] else 1.0
            assert float(weights[row, j]) == pytest.approx(want, rel=1e-5)
    capped = float(((weights >= 3.0) & mask.bool()).sum() / mask.sum())
    assert 0 < capped < 1  # the cap bites on some tokens, not on all
    assert metrics["policy/sampler_is_capped_frac"] == pytest.approx(capped)
    assert metrics["policy/sampler_is_weight"] == pytest.approx(
        float(weights[mask.bool()].mean()), rel=1e-6)


def test_correction_off_asks_for_no_logprobs_and_weights_nothing(tmp_path, tiny_model_dir,
                                                                monkeypatch):
    import mogrpo.trainer.update as update

    trainer, llm = vllm_trainer(tmp_path, tiny_model_dir, monkeypatch,
                                "rollout.vllm.importance_correction=false",
                                "rollout.vllm.sleep_during_update=false")
    seen = []
    loss = update.grpo_loss
    monkeypatch.setattr(update, "grpo_loss", lambda *a, **kw: seen.append(
        kw["importance_weights"]) or loss(*a, **kw))
    metrics = trainer.train_step()
    assert llm.requests[0][1].logprobs is None and seen == [None]
    assert "policy/sampler_is_weight" not in metrics
    assert ("sleep", 2) not in llm.calls and llm.engine_kwargs["enable_sleep_mode"] is False

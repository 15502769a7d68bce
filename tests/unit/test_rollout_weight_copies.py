"""Full fine-tuning on a CPU: the trainer frees the gradients after every update, and the native
engine may then copy the weights (fused, packed) for a model of any size; under LoRA the copies
keep the engine's cap."""

from __future__ import annotations

import pytest

import mogrpo.trainer.grpo as grpo
from mogrpo.rollout.projections import PLAIN_MAX_BYTES


def distinct_chars(prompts: list[str], completions: list[str], **columns) -> list[float]:
    return [float(len(set(c))) for c in completions]


def trainer_for(tmp_path, tiny_model_dir, lora: bool):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context, seed_everything

    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["device"] = "cpu"
    base["lora"] = {"enabled": lora, "r": 4, "alpha": 8}
    base["tasks"] = {"fairness": {"data": "builtin:bias_probe?size=16",
                                  "rewards": [{"fn": f"{__file__}:distinct_chars"}]}}
    base["rollout"].update(num_generations=2, max_completion_length=4)
    base["train"].update(micro_batch_size=4, gradient_accumulation_steps=1, warmup_steps=0)
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    return grpo.GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))


@pytest.mark.parametrize("lora", [False, True])
def test_each_rollout_starts_without_gradients_and_with_the_runs_copy_budget(
        tmp_path, tiny_model_dir, monkeypatch, lora):
    trainer = trainer_for(tmp_path, tiny_model_dir, lora)
    seen = []
    generate = grpo.generate_rollout

    def spy(*args, **kwargs):
        grads = [p.grad for p in trainer.ctx.policy.parameters() if p.requires_grad]
        seen.append((kwargs["plain_max_bytes"], all(g is None for g in grads)))
        return generate(*args, **kwargs)

    monkeypatch.setattr(grpo, "generate_rollout", spy)
    for _ in range(2):
        trainer.train_step()
    budget = None if lora else trainer.ctx.plain_max_bytes
    assert budget is None or budget > 100 * PLAIN_MAX_BYTES  # full fine-tuning: no cap
    assert trainer.ctx.plain_max_bytes == budget
    # the second rollout comes after an update: its gradients were freed, not kept for later
    assert seen == [(budget, True), (budget, True)]
    assert all(p.grad is None for p in trainer.ctx.policy.parameters())


def test_the_sft_warm_up_leaves_no_gradients_for_the_first_rollout(tmp_path, tiny_model_dir):
    from mogrpo.tracking.jsonl import MetricsWriter
    from mogrpo.trainer.sft import run_sft

    trainer = trainer_for(tmp_path, tiny_model_dir, lora=False)
    ctx = trainer.ctx
    ctx.config.sft.steps, ctx.config.sft.batch_size = 2, 2
    before = {n: p.detach().clone() for n, p in ctx.policy.named_parameters()}
    with MetricsWriter(tmp_path / "sft.jsonl") as writer:
        run_sft(ctx, writer)
    assert any(not (p == before[n]).all() for n, p in ctx.policy.named_parameters())  # trained
    assert all(p.grad is None for p in ctx.policy.parameters())

"""An agent task trained with `rollout.engine: vllm` (the fake vLLM of `fake_vllm.py`): each
turn is a vLLM request, the tool results go between turns, and the sampler's importance
weights correct only the policy's own tokens — the inserted ones weigh exactly 1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from fake_agent import tool_calling_script
from fake_vllm import FakeLLM, FakeSamplingParams
from mogrpo.config import engines
from mogrpo.rollout import vllm_engine

K, PROMPTS_PER_STEP, CAP = 2, 2, 3.0


def sampler_logprob(i: int, k: int, j: int) -> float:
    # the tiny policy gives a token about -6: the cap bites on even rows, not on odd ones
    # (an episode's rows are requests of their own, each with k = 0)
    return -8.0 + 3.0 * (i % 2)


def agent_vllm_trainer(tmp_path, model_dir, monkeypatch):
    """A trainer of one agent task (a tool and the `Counter` environment) on the fake vLLM."""
    from transformers import AutoTokenizer

    from mogrpo.config import load_config
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    built: list[FakeLLM] = []
    script = tool_calling_script(AutoTokenizer.from_pretrained(model_dir))

    def llm(**kwargs):
        built.append(FakeLLM(script=script, logprob=sampler_logprob, **kwargs))
        return built[-1]

    monkeypatch.setattr(engines, "vllm_unavailable_reason", lambda: None)
    monkeypatch.setattr(vllm_engine, "import_vllm", lambda: (llm, FakeSamplingParams))
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?"}) + "\n"
                            for i in range(8)))
    helpers = Path(__file__).parents[1] / "fake_agent.py"
    base = {"model": {"name_or_path": str(model_dir), "chat_template": "tiny_tools"},
            "output": {"dir": str(tmp_path / "run")},
            "lora": {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0},
            "rollout": {"num_generations": K, "max_completion_length": 192, "engine": "vllm",
                        "vllm": {"importance_cap": CAP}},
            "train": {"max_steps": 1, "micro_batch_size": K * PROMPTS_PER_STEP,
                      "gradient_accumulation_steps": 1, "learning_rate": 1e-2,
                      "warmup_steps": 0},
            "sft": {"enabled": False},
            "tasks": {"calc": {"data": str(data), "rewards": [f"{helpers}:digits"],
                               "tools": [f"{helpers}:calculator"],
                               "environment": f"{helpers}:Counter",
                               "max_tool_calling_iterations": 1}}}
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    return GRPOTrainer(ctx, make_reference(ctx.policy, needed=True)), built[0]


def test_a_tool_task_trains_on_vllm_and_inserted_tokens_weigh_one(tmp_path, tiny_model_dir,
                                                                   monkeypatch):
    import mogrpo.trainer.update as update

    trainer, llm = agent_vllm_trainer(tmp_path, tiny_model_dir, monkeypatch)
    seen, calls = {}, []
    draw, weigh = trainer.generate, update.truncated_importance_weights

    def generate(picks):
        seen["rollout"] = draw(picks)
        return seen["rollout"]

    def spy(old, sampler, mask, cap):
        calls.append((old.clone(), sampler.clone(), mask.clone(), weigh(old, sampler, mask, cap)))
        return calls[-1][-1]

    monkeypatch.setattr(trainer, "generate", generate)
    monkeypatch.setattr(update, "truncated_importance_weights", spy)
    before = {n: p.detach().clone() for n, p in trainer.ctx.policy.named_parameters()
              if p.requires_grad}
    metrics = trainer.train_step()

    ro = seen["rollout"]
    # every episode: a call turn (one vLLM request each), the result inserted, a second turn
    assert [r[1].logprobs for r in llm.requests] == [0, 0]
    assert metrics["task/calc/agent/turns"] == 2.0
    assert metrics["task/calc/agent/tokens_inserted"] > 0
    inserted = ro.completion_mask.bool() & ~ro.generated_mask.bool()  # [B, C]
    assert int(inserted.sum()) == pytest.approx(
        metrics["task/calc/agent/tokens_inserted"] * K * PROMPTS_PER_STEP)
    assert torch.all(ro.sampler_logp[inserted] == 0)  # no sampler log-prob: nothing sampled
    for episode, text in zip(ro.episodes, ro.texts, strict=True):  # the results are in it
        result = episode.environment.count if episode.calls["increment"] else \
            int(re.search(r'"(\d) \* 7"', text).group(1)) * 7
        assert f"<tool_response>{result}</tool_response>" in text

    assert calls, "the sampler correction was not applied"
    mask_total = 0
    for old, sampler, mask, weights in calls:
        # the weights' mask is the training mask: inserted tokens are out of it, weight 1
        assert torch.all(weights[~mask.bool()] == 1.0)
        want = torch.exp(old.double() - sampler.double()).clamp(max=CAP).to(weights.dtype)
        assert torch.allclose(weights[mask.bool()], want[mask.bool()], rtol=1e-5)
        mask_total += int(mask.sum())
    assert mask_total == int(ro.generated_mask.sum())  # every sampled token, once
    assert 0 < metrics["policy/sampler_is_capped_frac"] < 1
    moved = [n for n, p in trainer.ctx.policy.named_parameters()
             if p.requires_grad and not torch.equal(p, before[n])]
    assert moved  # it trained

"""Multi-turn episodes: the loop (through the external engine's interface, with a scripted
engine standing in for vLLM), and the math of a two-turn episode built by hand — its masks,
its log-probs against one forward of the whole sequence, its gradient against a hand-computed
one."""

from __future__ import annotations

import math

import pytest
import torch

from mogrpo.algo.logprobs import completion_logprobs, token_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.modeling.load import load_policy
from mogrpo.modeling.tiny import TOOL_CHAT_TEMPLATE
from mogrpo.rollout.episodes import ToolLoop, generate_episodes, insertion_text
from mogrpo.rollout.native import Decoded
from mogrpo.rollout.sampling import SamplingSettings
from mogrpo.rollout.tools import ToolCall, ToolResult, tool_schema

CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expression: The expression, e.g. "12 * 7".
    """
    return str(eval(expression, {"__builtins__": {}}))  # noqa: S307 - the test's own input


class ScriptedEngine:
    """An `ExternalEngine` (vLLM's interface) that answers each call with the next scripted
    text per row, and records the prompts it was given."""

    def __init__(self, tokenizer, turns: list[list[str]]) -> None:
        self.tokenizer, self.turns, self.prompts = tokenizer, turns, []

    def decode(self, prompts, settings, *, num_generations, stop_ids, pad_id, seed=None,
               record_logprobs=False) -> Decoded:
        self.prompts.append(prompts)
        texts = self.turns[len(self.prompts) - 1]
        rows = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        width = max(len(r) for r in rows)
        tokens = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
        logp = torch.full(tokens.shape, -0.5) if record_logprobs else None
        return Decoded(tokens, 0, logp)


@pytest.fixture()
def agent_policy(tiny_model_dir):
    model, tokenizer = load_policy(str(tiny_model_dir))
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    return model, tokenizer


def _prompt(tokenizer) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": "2+3?"}], tokenize=False,
                                         add_generation_prompt=True,
                                         tools=[tool_schema(calculator)])


def test_the_template_text_between_turns_is_the_difference_of_two_renderings(agent_policy):
    _, tokenizer = agent_policy
    text = insertion_text(tokenizer, [ToolCall("calculator", {"expression": "2+3"})],
                          [ToolResult("calculator", "5")], "<|eot|>")
    # the template's newline after the model's stop, the result's turn, the next prompt
    assert text == "\n<|user|>\n<tool_response>5</tool_response><|eot|>\n<|assistant|>\n"


def test_an_episode_calls_the_tool_and_masks_what_was_inserted(agent_policy):
    model, tokenizer = agent_policy
    engine = ScriptedEngine(tokenizer, [[CALL + "<|eot|>", "no tools<|eot|>"],
                                        ["The answer is 5<|eot|>"]])
    settings = SamplingSettings(max_new_tokens=200)
    rollout = generate_episodes(
        model, tokenizer, [_prompt(tokenizer)] * 2, settings,
        ToolLoop([{"calculator": calculator}] * 2), num_generations=2, max_prompt_length=128,
        add_special_tokens=False, engine=engine, record_logprobs=True)
    ep, plain = rollout.episodes
    assert (ep.turns, dict(ep.calls), plain.turns, dict(plain.calls)) == (2, {"calculator": 1}, 1, {})
    # the second turn continued the first, with the result inserted by the template
    inserted = "\n<|user|>\n<tool_response>5</tool_response><|eot|>\n<|assistant|>\n"
    assert tokenizer.decode(engine.prompts[1][0]) == _prompt(tokenizer) + CALL + "<|eot|>" + inserted
    ids = rollout.completion_ids[0, :rollout.lengths[0]].tolist()
    gen = rollout.generated_mask[0, :rollout.lengths[0]].tolist()
    n1 = len(tokenizer(CALL + "<|eot|>", add_special_tokens=False)["input_ids"])
    n2 = len(tokenizer(inserted, add_special_tokens=False)["input_ids"])
    assert gen == [1] * n1 + [0] * n2 + [1] * (len(ids) - n1 - n2)
    assert tokenizer.decode(ids[n1 + n2:]) == "The answer is 5<|eot|>"
    assert rollout.completion_mask[0].sum() == len(ids)  # attention: the whole episode
    assert ep.inserted == n2 and not bool(rollout.truncated.any())
    # the sampler's log-probs count on sampled tokens only
    assert torch.equal(rollout.sampler_logp[0] != 0, rollout.generated_mask[0].bool())
    assert "<tool_response>5</tool_response>" in rollout.texts[0]
    assert rollout.texts[1] == "no tools" and rollout.train_mask is rollout.generated_mask


def test_the_budget_and_the_round_limit_end_an_episode(agent_policy):
    model, tokenizer = agent_policy
    call_turn = CALL + "<|eot|>"
    n1 = len(tokenizer(call_turn, add_special_tokens=False)["input_ids"])
    # results that do not fit are not inserted: the episode ends after the call
    engine = ScriptedEngine(tokenizer, [[call_turn]])
    rollout = generate_episodes(
        model, tokenizer, [_prompt(tokenizer)], SamplingSettings(max_new_tokens=n1 + 5),
        ToolLoop([{"calculator": calculator}]), num_generations=1, max_prompt_length=128,
        add_special_tokens=False, engine=engine)
    assert int(rollout.lengths[0]) == n1 and rollout.episodes[0].calls["calculator"] == 1
    assert len(engine.prompts) == 1
    engine = ScriptedEngine(tokenizer, [[call_turn], [call_turn], [call_turn]])
    rollout = generate_episodes(
        model, tokenizer, [_prompt(tokenizer)], SamplingSettings(max_new_tokens=300),
        ToolLoop([{"calculator": calculator}], max_iterations=1), num_generations=1,
        max_prompt_length=128, add_special_tokens=False, engine=engine)
    assert rollout.episodes[0].turns == 2 and len(engine.prompts) == 2


def _two_turn_episode(tokenizer):
    """Prompt, then turn 1 (sampled), a tool result (inserted), turn 2 (sampled): ids and masks."""
    prompt = tokenizer(_prompt(tokenizer), add_special_tokens=False)["input_ids"]
    parts = [(CALL + "<|eot|>", 1),
             ("\n<|user|>\n<tool_response>5</tool_response><|eot|>\n<|assistant|>\n", 0),
             ("The answer is 5<|eot|>", 1)]
    ids, gen = [], []
    for text, sampled in parts:
        toks = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids += toks
        gen += [sampled] * len(toks)
    return torch.tensor([prompt]), torch.tensor([ids]), torch.tensor([gen])


def test_two_turn_logprobs_and_gradient_match_one_forward_of_the_whole_sequence(agent_policy):
    model, tokenizer = agent_policy
    model.train(False)
    prompt, ids, gen = _two_turn_episode(tokenizer)
    P, C = prompt.shape[1], ids.shape[1]
    attention = torch.ones_like(ids)
    logp, _ = completion_logprobs(model, prompt, torch.ones_like(prompt), ids, attention)
    # one plain forward of the whole sequence, scored by hand
    whole = torch.cat([prompt, ids], dim=1)
    logits = model(input_ids=whole).logits[:, P - 1:P + C - 1]
    expected = token_logprobs(logits, ids)
    torch.testing.assert_close(logp, expected, atol=1e-5, rtol=1e-5)

    # the loss over the sampled tokens only; with μ = 1 its gradient is that of
    # -A / n * Σ_sampled log π(token), n the sampled tokens (per-sequence mean)
    advantage = torch.tensor([0.7])
    model.zero_grad()
    logp, _ = completion_logprobs(model, prompt, torch.ones_like(prompt), ids, attention)
    out = grpo_loss(logp, logp.detach(), advantage, gen,
                    normalizer=loss_normalizer(gen, "seq_mean", C),
                    aggregation="seq_mean", epsilon_low=0.2, epsilon_high=0.2)
    out.loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    logits = model(input_ids=whole).logits[:, P - 1:P + C - 1]
    hand = -advantage[0] * (token_logprobs(logits, ids) * gen).sum() / gen.sum()
    hand.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, atol=1e-6, rtol=1e-4, msg=name)
    # the inserted tokens carry no gradient: the same loss over every token differs
    model.zero_grad()
    (-advantage[0] * (token_logprobs(model(input_ids=whole).logits[:, P - 1:P + C - 1], ids))
     .mean()).backward()
    assert any(not torch.allclose(got[n], p.grad) for n, p in model.named_parameters())


def failing(x: int) -> int:
    """Always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError("out of order")


def stuck(x: int) -> int:
    """Answers too late.

    Args:
        x: Anything.
    """
    import time

    time.sleep(0.6)
    return x


def _call(name: str, **arguments) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_a_failing_tool_reaches_the_model_and_the_metrics_count_it(agent_policy):
    from types import SimpleNamespace

    from mogrpo.tasks.agent_rollout import agent_metrics

    model, tokenizer = agent_policy
    tools = {"calculator": calculator, "failing": failing, "stuck": stuck}
    # row 0: a good call and a failing one in one turn, then an unknown tool, then an answer;
    # row 1: a call that times out, then an answer; row 2: answers at once. Each list is one
    # round of turns, for the rows still going.
    engine = ScriptedEngine(tokenizer, [
        [_call("calculator", expression="2+3") + _call("failing", x=1) + "<|eot|>",
         _call("stuck", x=2) + "<|eot|>", "5<|eot|>"],
        [_call("nope") + "<|eot|>", "sorry<|eot|>"],
        ["5<|eot|>"]])
    rollout = generate_episodes(
        model, tokenizer, [_prompt(tokenizer)] * 3, SamplingSettings(max_new_tokens=420),
        ToolLoop([tools] * 3, timeout_s=0.2), num_generations=3, max_prompt_length=90,
        add_special_tokens=False, engine=engine)
    first, second, third = rollout.episodes
    assert (first.turns, second.turns, third.turns) == (3, 2, 1)
    # each failure is a message to the model, and the episode went on after it
    assert "error: failing raised RuntimeError: out of order" in rollout.texts[0]
    assert "error: there is no tool 'nope'" in rollout.texts[0]
    assert "error: stuck timed out after 0.2 s" in rollout.texts[1]
    task = SimpleNamespace(name="calc", agent=SimpleNamespace(tool_names=lambda: list(tools)))
    metrics = agent_metrics([task], rollout, torch.zeros(3, dtype=torch.long))
    assert metrics["task/calc/agent/turns"] == pytest.approx(2.0)
    assert metrics["task/calc/tool/calculator/calls"] == pytest.approx(1 / 3)
    assert metrics["task/calc/tool/calculator/error_frac"] == 0.0
    assert metrics["task/calc/tool/failing/error_frac"] == 1.0
    assert metrics["task/calc/tool/stuck/timeout_frac"] == 1.0
    assert metrics["task/calc/tool/stuck/error_frac"] == 0.0  # a timeout is not counted twice
    assert metrics["task/calc/tool/nope/calls"] == pytest.approx(1 / 3)
    assert metrics["task/calc/tool/nope/error_frac"] == 1.0
    sampled = rollout.generated_mask.sum(-1).float()
    assert metrics["task/calc/agent/tokens_generated"] == pytest.approx(float(sampled.mean()))
    assert metrics["task/calc/agent/tokens_inserted"] == pytest.approx(
        float((rollout.lengths - sampled).mean()))


def test_the_kl_and_the_token_normaliser_count_the_sampled_tokens_only(agent_policy):
    from mogrpo.algo.loss import grpo_loss, loss_normalizer

    _, tokenizer = agent_policy
    _, ids, gen = _two_turn_episode(tokenizer)
    logp = torch.full(ids.shape, -1.0)
    ref = logp.clone()
    ref[gen == 0] = -9.0  # the reference disagrees only where the tool's result was inserted
    normalizer = loss_normalizer(gen, "token_mean", ids.shape[1])
    assert normalizer == int(gen.sum()) < ids.shape[1]
    out = grpo_loss(logp, logp, torch.zeros(1), gen, normalizer=normalizer,
                    aggregation="token_mean", ref_logp=ref, beta=0.5)
    assert float(out.loss) == 0.0 and float(out.kl.sum()) == 0.0  # no KL from inserted tokens
    ref[0, 0] = -2.0  # one sampled token that disagrees does count
    out = grpo_loss(logp, logp, torch.zeros(1), gen, normalizer=normalizer,
                    aggregation="token_mean", ref_logp=ref, beta=0.5)
    k3 = math.exp(-1.0) - (-1.0) - 1  # exp(ref - logp) - (ref - logp) - 1
    assert float(out.loss) == pytest.approx(0.5 * k3 / normalizer, rel=1e-5)
    assert float(out.kl[0]) == pytest.approx(k3 / normalizer, rel=1e-5)  # mean over sampled

"""Multi-turn episodes: the loop (through the external engine's interface, with a scripted
engine standing in for vLLM), and the math of a two-turn episode built by hand — its masks,
its log-probs against one forward of the whole sequence, its gradient against a hand-computed
one."""

from __future__ import annotations

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

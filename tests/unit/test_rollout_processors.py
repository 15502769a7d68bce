"""Presence/frequency penalty and the non-finite guard, on hand-made logits and inside generate()."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
)

from mogrpo.rollout.processors import NonFiniteGuard, PresenceFrequencyPenalty

F32 = torch.finfo(torch.float32)


def test_penalty_counts_only_generated_tokens():
    # Prompt [3, 1]; generated [3, 3, 5]: token 3 twice, token 5 once. Prompt's 1 is not penalised.
    input_ids = torch.tensor([[3, 1, 3, 3, 5], [0, 2, 4, 4, 4]])
    scores = torch.zeros(2, 6)
    out = PresenceFrequencyPenalty(presence=0.5, frequency=0.25, prompt_length=2)(input_ids, scores)
    expected = torch.zeros(2, 6)
    expected[0, 3] = -(0.5 + 2 * 0.25)
    expected[0, 5] = -(0.5 + 1 * 0.25)
    expected[1, 4] = -(0.5 + 3 * 0.25)
    assert torch.equal(out, expected)


def test_penalty_is_subtracted_from_existing_logits():
    input_ids = torch.tensor([[7, 1, 1]])
    scores = torch.tensor([[2.0, 1.0, -float("inf")]])
    out = PresenceFrequencyPenalty(presence=0.0, frequency=1.5, prompt_length=1)(input_ids, scores)
    assert out.tolist() == [[2.0, -2.0, -float("inf")]]


def test_penalty_noop_when_zero_or_nothing_generated():
    scores = torch.randn(1, 6)
    ids = torch.tensor([[1, 2, 3]])
    assert PresenceFrequencyPenalty(0.0, 0.0, prompt_length=1)(ids, scores) is scores
    assert PresenceFrequencyPenalty(1.0, 1.0, prompt_length=3)(ids, scores) is scores


def test_guard_replaces_nan_and_pos_inf_and_keeps_masks():
    scores = torch.tensor(
        [
            [1.0, math.nan, math.inf, -math.inf],  # partial: NaN -> min, +inf -> max, -inf kept
            [math.nan] * 4,  # all non-finite -> zeros
            [-math.inf] * 4,  # all masked -> zeros so sampling stays defined
            [0.5, -1.0, 2.0, -math.inf],  # healthy
        ]
    )
    guard = NonFiniteGuard()
    out = guard(torch.zeros(4, 1, dtype=torch.long), scores)
    assert out[0].tolist() == [1.0, F32.min, F32.max, -math.inf]
    assert out[1].tolist() == [0.0] * 4 and out[2].tolist() == [0.0] * 4
    assert torch.equal(out[3], scores[3])
    assert guard.replaced == 2 + 4 + 4 and guard.rows_reset == 2
    assert torch.softmax(out, dim=-1).isfinite().all()


def test_guard_is_noop_on_finite_logits_and_accumulates():
    guard = NonFiniteGuard()
    scores = torch.randn(2, 5)
    assert guard(torch.zeros(2, 1, dtype=torch.long), scores) is scores
    assert guard.replaced == 0
    guard(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[math.nan, 1.0]]))
    guard(torch.zeros(1, 1, dtype=torch.long), torch.tensor([[math.nan, 1.0]]))
    assert guard.replaced == 2


def test_guard_sees_finite_logits_whose_sum_overflows_as_finite():
    # the common path checks the sum: huge finite values overflow it, and must still pass
    guard = NonFiniteGuard()
    scores = torch.tensor([[F32.max, F32.max, 0.0], [1.0, 2.0, 3.0]])
    assert not torch.isfinite(scores.sum())
    assert guard(torch.zeros(2, 1, dtype=torch.long), scores) is scores
    assert guard.replaced == 0 and guard.rows_reset == 0
    # and a -inf (a masked token) is kept as it is
    masked = torch.tensor([[0.5, -math.inf, 2.0]])
    assert torch.equal(guard(torch.zeros(1, 1, dtype=torch.long), masked), masked)
    assert guard.replaced == 0


def test_guard_leaves_headroom_for_low_temperature():
    # generate() divides by the temperature after custom processors; max/0.5 must stay finite.
    out = NonFiniteGuard(temperature=0.5)(
        torch.zeros(1, 1, dtype=torch.long), torch.tensor([[math.inf, 0.0]])
    )
    assert out[0, 0].item() == pytest.approx(F32.max * 0.5)
    assert torch.isfinite(out / 0.5).all()


class InjectNaN(LogitsProcessor):
    """Corrupts logits the way an overflowing fp16 forward does."""

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[0, :] = math.nan
        scores[1, 5] = math.inf
        return scores


@pytest.fixture(scope="module")
def model_and_tok(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(
        tiny_model_dir
    )


def _generate(model, tok, processors, **config):
    batch = tok(["the cat", "dog sat on"], return_tensors="pt", padding=True)
    config = GenerationConfig(
        max_new_tokens=6, pad_token_id=tok.pad_token_id, eos_token_id=[], **config
    )
    with torch.no_grad():
        out = model.generate(
            **batch, generation_config=config, logits_processor=LogitsProcessorList(processors)
        )
    return out[:, batch["input_ids"].shape[1] :]


def test_guard_keeps_sampling_alive_inside_generate(model_and_tok):
    model, tok = model_and_tok
    sampling = dict(do_sample=True, temperature=0.7, top_k=0, top_p=1.0)
    with pytest.raises(RuntimeError):
        _generate(model, tok, [InjectNaN()], **sampling)
    guard = NonFiniteGuard(temperature=0.7)
    torch.manual_seed(0)
    completion = _generate(model, tok, [InjectNaN(), guard], **sampling)
    assert completion.shape == (2, 6)
    assert (completion[1] == 5).all()  # +inf became the largest finite logit: always chosen
    assert guard.replaced == 6 * (model.config.vocab_size + 1) and guard.rows_reset == 6


def test_penalty_inside_generate_prevents_repeats(model_and_tok):
    model, tok = model_and_tok
    plain = _generate(model, tok, [], do_sample=False)
    assert any(
        len(set(row.tolist())) < len(row) for row in plain
    )  # the random model repeats itself
    width = tok(["the cat", "dog sat on"], return_tensors="pt", padding=True)["input_ids"].shape[1]
    penalised = _generate(
        model, tok, [PresenceFrequencyPenalty(100.0, 0.0, width)], do_sample=False
    )
    assert all(len(set(row.tolist())) == len(row) for row in penalised)
    assert torch.equal(penalised[:, 0], plain[:, 0])  # the first token has nothing to penalise

"""The native engine draws every token from the model's own next-token distribution, at every
position and not only the first: thousands of completions of a briefly trained model, tested
against its teacher-forced distribution after generate()'s processors (`tests/sampling_fit.py`:
the exact test, its statistics and their level), with stop ids that end rows at different
steps, penalties, temperature, top-k, top-p and min-p, on the compiled decode step and the
Python one; the same test rejects samplers with small, plausible biases; and the log-probs the
sampler records are the training forward's."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from mogrpo import kernels
from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.kernels.cpu import decode_step as cpu_kernel
from mogrpo.modeling.tiny import random_family_model
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.rollout.sampling import SamplingRules
from sampling_fit import fit, reference_scores

PROMPTS = ["the cat sat on", "答案 因为 the question", "a", "option A B because the context says"]
K = 500  # completions per prompt: 2,000 completions, ~13,000 tokens per sample
MAX_NEW = 16


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def trained(tok, tiny_texts):
    """A tiny Qwen2 after 60 steps of SFT on sentences ending in EOS: peaked next-token
    distributions, like a trained model's, that stop after 3-12 words (rows finish at
    different steps)."""
    model = random_family_model("qwen2", len(tok), pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id, seed=0)
    enc = tok([t + tok.eos_token for t in tiny_texts], return_tensors="pt",
              padding=True)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    labels = ids.masked_fill(mask == 0, -100)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    draws = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(60):
        rows = torch.randint(0, len(ids), (32,), generator=draws)
        loss = model(input_ids=ids[rows], attention_mask=mask[rows], labels=labels[rows]).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(params=["compiled", "python"])
def decode_step(request, monkeypatch):
    """The native engine's decode step: the compiled one (skipped where it cannot be built) or
    the Python one; yields the list of whether each decode ran compiled."""
    if request.param == "python":
        monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    elif cpu_kernel.module() is None:
        pytest.skip("the compiled decode step is not available here")
    ran: list[bool] = []
    chosen = kernels.compiled_decoder

    def recorded(*args):
        out = chosen(*args)
        ran.append(out[0] is not None)
        return out

    monkeypatch.setattr(kernels, "compiled_decoder", recorded)
    return request.param, ran


def sample(model, tok, settings: SamplingSettings, engine: str = "native", **options):
    return generate_rollout(model, tok, PROMPTS, settings, num_generations=K,
                            max_prompt_length=16, engine=engine, generator_seed=7, **options)


def settings_of(tok, **flags) -> SamplingSettings:
    # EOS and a frequent word end completions: rows stop at every step, some never
    stops = [tok.eos_token_id, tok.convert_tokens_to_ids("Ġthe")]
    return SamplingSettings(max_new_tokens=MAX_NEW, stop_token_ids=stops, **flags)


def fit_of(model, tok, ro, settings: SamplingSettings):
    scores = reference_scores(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                              ro.completion_mask, settings, stop_ids=settings.stop_token_ids,
                              pad_id=tok.pad_token_id)
    return fit(scores, ro.completion_ids, ro.completion_mask)


CASES = {
    "plain, 64 rows a decode": ({}, {"generation_batch_size": 64}),
    "temperature, top-k, top-p": ({"temperature": 0.7, "top_k": 10, "top_p": 0.9}, {}),
    "min-p": ({"temperature": 1.3, "min_p": 0.05}, {}),
    "penalties": ({"temperature": 1.2, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                   "frequency_penalty": 0.3, "top_k": 20}, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_native_samples_the_models_distribution_at_every_position(case, trained, tok,
                                                                  decode_step):
    flags, options = CASES[case]
    settings = settings_of(tok, **flags)
    ro = sample(trained, tok, settings, **options)
    step, ran = decode_step
    assert ran and all(ran) == (step == "compiled")
    lengths = torch.bincount(ro.lengths, minlength=MAX_NEW + 1)
    assert int((lengths > 0).sum()) >= 10 and 0 < int(ro.truncated.sum()) < len(ro.lengths)
    result = fit_of(trained, tok, ro, settings)
    assert result.tokens > 8000 and result.positions >= 10
    assert result.failures() == []


def test_generate_passes_the_same_check(trained, tok):
    """The control: generate(), the reference engine, sampled from the same distribution."""
    flags, _ = CASES["penalties"]
    settings = settings_of(tok, **flags)
    assert fit_of(trained, tok, sample(trained, tok, settings, "hf"), settings).failures() == []


def _sharper(call):
    """Temperature 0.9 where 1.0 was asked."""
    return lambda self, logits: call(self, logits) / 0.9


def _top_p_before_temperature(call):
    """The nucleus cut on the scores before the temperature (generate() cuts after)."""
    def biased(self, logits):
        temperature, self.settings.temperature = self.settings.temperature, 1.0
        try:
            return call(self, logits) / temperature
        finally:
            self.settings.temperature = temperature
    return biased


def _penalty_state_of_first_rows(keep):
    """After rows finish, the penalty state of the first rows kept instead of the live ones."""
    def biased(self, rows):
        return keep(self, torch.arange(len(rows)))
    return biased


BIASES = {
    "temperature 0.9 for 1.0": ({}, "__call__", _sharper),
    "top-p before the temperature": ({"temperature": 0.7, "top_p": 0.8}, "__call__",
                                     _top_p_before_temperature),
    "penalty state of the wrong rows": ({"presence_penalty": 0.5, "frequency_penalty": 0.3},
                                        "keep", _penalty_state_of_first_rows),
}


@pytest.mark.parametrize("bias", BIASES)
def test_the_check_rejects_a_slightly_biased_sampler(bias, trained, tok, monkeypatch):
    """The power check: a test that cannot fail proves nothing."""
    flags, method, make = BIASES[bias]
    monkeypatch.setattr(SamplingRules, method, make(getattr(SamplingRules, method)))
    settings = settings_of(tok, **flags)
    assert fit_of(trained, tok, sample(trained, tok, settings), settings).failures() != []


@pytest.mark.parametrize("flags", [
    {"temperature": 0.7, "top_k": 10, "top_p": 0.9},
    {"temperature": 1.2, "repetition_penalty": 1.3, "presence_penalty": 0.5,
     "frequency_penalty": 0.3, "min_p": 0.05},
], ids=["top-k,top-p", "penalties,min-p"])
def test_recorded_logprobs_are_the_training_forwards(flags, trained, tok, decode_step):
    """The sampler records log softmax(logits / T) of each token, before penalties and cuts:
    the policy's probability, which the trainer's forward computes for the ratio (not the
    processed distribution the token was drawn from)."""
    settings = settings_of(tok, **flags)
    ro = generate_rollout(trained, tok, PROMPTS, settings, num_generations=16,
                          max_prompt_length=16, engine="native", generator_seed=3,
                          record_logprobs=True)
    assert len(set(ro.lengths.tolist())) > 5
    with torch.no_grad():
        trainer = completion_logprobs(trained, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                      ro.completion_mask, temperature=settings.temperature)[0]
    torch.testing.assert_close(ro.sampler_logp, trainer, atol=1e-5, rtol=1e-6)
    # and not the processed distribution's, which penalties and cuts move far from it
    scores = reference_scores(trained, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                              ro.completion_mask, settings, stop_ids=settings.stop_token_ids,
                              pad_id=tok.pad_token_id)
    drawn_from = torch.log_softmax(scores, -1).gather(2, ro.completion_ids[..., None])[..., 0]
    live = ro.completion_mask.bool()
    assert float((drawn_from - ro.sampler_logp)[live].abs().max()) > 0.1

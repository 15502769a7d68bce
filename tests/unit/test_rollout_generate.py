"""generate_rollout: sampling flags honoured, no ignored-flag warnings, stops, truncation, layout."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
from transformers.utils import logging as hf_logging

from mogrpo.errors import ConfigError
from mogrpo.modeling.load import LoraSettings, apply_lora
from mogrpo.rollout.generate import (
    SamplingSettings,
    build_generation_config,
    generate_rollout,
    resolve_stop_ids,
)

PROMPTS = ["the cat sat on", "答案 因为 the question"]


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def llama3_like(model):
    """The tiny model with Llama-3's sampling defaults in its generation_config."""
    model.generation_config.do_sample = True
    model.generation_config.temperature = 0.6
    model.generation_config.top_p = 0.9
    return model


def rollout(model, tok, prompts=PROMPTS, k=2, max_prompt_length=32, **settings):
    return generate_rollout(
        model,
        tok,
        list(prompts),
        SamplingSettings(**settings),
        num_generations=k,
        max_prompt_length=max_prompt_length,
    )


@contextmanager
def captured(caplog):
    """Python warnings and the transformers logger (which does not propagate to the root logger)."""
    hf_logger = logging.getLogger("transformers")
    hf_logging.warning_once.cache_clear()  # warning_once would hide a repeat of an earlier warning
    hf_logger.addHandler(caplog.handler)
    caplog.clear()
    try:
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            yield (
                lambda: [str(w.message) for w in record] + [r.getMessage() for r in caplog.records]
            )
    finally:
        hf_logger.removeHandler(caplog.handler)


def flag_warnings(messages):
    return [
        m
        for m in messages
        if "generation flags" in m or "not valid" in m or "seem to have been set" in m
    ]


def test_capture_sees_the_ignored_flags_warning(llama3_like, tok, caplog):
    # Control: the naive greedy config does warn on a Llama-3-like model in transformers 5.
    batch = tok(PROMPTS, return_tensors="pt", padding=True)
    with captured(caplog) as messages:
        llama3_like.generate(
            **batch, generation_config=GenerationConfig(do_sample=False, max_new_tokens=2)
        )
    assert flag_warnings(messages())


@pytest.mark.parametrize(
    "mode",
    [
        dict(greedy=True),
        dict(
            temperature=0.9,
            top_k=20,
            top_p=0.95,
            min_p=0.05,
            presence_penalty=0.3,
            frequency_penalty=0.2,
        ),
        dict(temperature=1.0),
    ],
)
def test_no_ignored_flag_warnings(llama3_like, tok, caplog, mode):
    with captured(caplog) as messages:
        rollout(llama3_like, tok, max_new_tokens=4, **mode)
    assert flag_warnings(messages()) == []
    assert [m for m in messages() if "generation" in m.lower()] == []


def test_llama3_defaults_do_not_leak_into_greedy(model, llama3_like, tok, tiny_model_dir):
    clean = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    a = rollout(clean, tok, greedy=True, max_new_tokens=6)
    b = rollout(llama3_like, tok, greedy=True, max_new_tokens=6)
    assert torch.equal(a.completion_ids, b.completion_ids)


def test_top_k_one_equals_greedy(model, tok):
    greedy = rollout(model, tok, greedy=True, max_new_tokens=8)
    torch.manual_seed(123)
    top1 = rollout(model, tok, temperature=1.3, top_k=1, max_new_tokens=8)
    assert torch.equal(top1.completion_ids, greedy.completion_ids)


def test_temperature_changes_the_distribution(model, tok):
    greedy = rollout(model, tok, k=4, greedy=True, max_new_tokens=8)
    torch.manual_seed(0)
    cold = rollout(model, tok, k=4, temperature=1e-3, max_new_tokens=8)
    torch.manual_seed(0)
    hot = rollout(model, tok, k=4, temperature=5.0, max_new_tokens=8)
    assert torch.equal(cold.completion_ids, greedy.completion_ids)  # all K identical, = argmax
    for p in range(len(PROMPTS)):
        rows = hot.completion_ids[p * 4 : (p + 1) * 4]
        assert len({tuple(r.tolist()) for r in rows}) == 4


def test_top_k_zero_means_no_top_k(model, tok):
    # transformers fills top_k=None with 50; "off" must really sample beyond the 50 most likely.
    torch.manual_seed(0)
    out = rollout(model, tok, prompts=PROMPTS[:1], k=64, temperature=50.0, max_new_tokens=1)
    with torch.no_grad():
        logits = model(input_ids=out.prompt_ids[:1], attention_mask=out.prompt_mask[:1]).logits[
            0, -1
        ]
    rank = {tok_id: r for r, tok_id in enumerate(logits.argsort(descending=True).tolist())}
    assert max(rank[t] for t in out.completion_ids[:, 0].tolist()) >= 50


def test_generator_seed_is_reproducible_and_leaves_global_rng(model, tok):
    state = torch.get_rng_state()
    settings = SamplingSettings(temperature=2.0, max_new_tokens=6)
    a = generate_rollout(
        model, tok, PROMPTS, settings, num_generations=3, max_prompt_length=32, generator_seed=7
    )
    b = generate_rollout(
        model, tok, PROMPTS, settings, num_generations=3, max_prompt_length=32, generator_seed=7
    )
    assert torch.equal(a.completion_ids, b.completion_ids)
    assert torch.equal(torch.get_rng_state(), state)


def test_stop_tokens_cut_mask_and_lengths(model, tok):
    free = rollout(model, tok, greedy=True, max_new_tokens=8, stop_token_ids=[tok.pad_token_id])
    assert free.truncated.all() and free.lengths.tolist() == [8] * 4
    stop = int(free.completion_ids[0, 2])  # the token greedy emits at step 3 of prompt 0
    eot = tok.convert_tokens_to_ids("<|eot|>")
    out = rollout(model, tok, greedy=True, max_new_tokens=8, stop_token_ids=[eot, stop])

    for row in range(4):
        ref = free.completion_ids[row].tolist()
        n = ref.index(stop) + 1 if stop in ref else 8
        assert out.lengths[row].item() == n
        assert out.truncated[row].item() == (stop not in ref)
        assert out.completion_mask[row].tolist()[:n] == [1] * n
        assert out.completion_mask[row].sum().item() == n
        width = out.completion_ids.shape[1]
        assert out.completion_ids[row, :n].tolist() == ref[:n]  # stop token included
        assert out.completion_ids[row, n:].tolist() == [tok.pad_token_id] * (width - n)
        assert out.texts[row] == tok.decode(ref[:n], skip_special_tokens=True).strip()
    assert out.lengths[0].item() <= 3 and not out.truncated[0]


def test_default_stop_ids_come_from_tokenizer_and_checkpoint(model, tok):
    eos, eot = tok.eos_token_id, tok.convert_tokens_to_ids("<|eot|>")
    assert resolve_stop_ids(model, tok, SamplingSettings()) == [eos, eot]
    free = rollout(model, tok, greedy=True, max_new_tokens=8, stop_token_ids=[tok.pad_token_id])
    emitted = int(free.completion_ids[0, 1])
    model.generation_config.eos_token_id = [emitted]  # a checkpoint whose end-of-turn id we emit
    out = rollout(model, tok, greedy=True, max_new_tokens=8)
    assert resolve_stop_ids(model, tok, SamplingSettings()) == [eos, emitted]
    assert out.lengths[0].item() == free.completion_ids[0].tolist().index(emitted) + 1
    assert not out.truncated[0]


@pytest.mark.parametrize("greedy", [True, False])
def test_checkpoint_sampling_defaults_do_not_survive_the_merge(model, greedy):
    # generate() fills every None field from model.generation_config (here Qwen2.5-Instruct's).
    model.generation_config.update(
        do_sample=True,
        temperature=0.7,
        top_p=0.8,
        top_k=20,
        repetition_penalty=1.05,
        typical_p=0.9,
        no_repeat_ngram_size=3,
    )
    settings = SamplingSettings(
        greedy=greedy, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=5
    )
    ours = build_generation_config(settings, stop_ids=[1, 2], pad_id=0)
    effective, _ = model._prepare_generation_config(ours)
    assert effective.do_sample is (not greedy)
    assert effective.repetition_penalty == 1.0 and effective.no_repeat_ngram_size == 0
    assert effective.typical_p == 1.0 and effective.max_new_tokens == 5
    assert effective.eos_token_id == [1, 2] and effective.pad_token_id == 0
    if not greedy:
        assert (effective.temperature, effective.top_k, effective.top_p) == (1.0, 0, 1.0)


def test_max_new_tokens_and_truncated_flag(model, tok):
    out = rollout(
        model, tok, k=3, temperature=1.0, max_new_tokens=5, stop_token_ids=[tok.pad_token_id]
    )
    assert out.completion_ids.shape == (6, 5) and out.completion_mask.shape == (6, 5)
    assert out.truncated.all() and out.lengths.tolist() == [5] * 6
    assert out.lengths.dtype == torch.long and out.truncated.dtype == torch.bool
    assert out.batch_size == 6 and out.num_generations == 3 and len(out.texts) == 6


def test_layout_prompt_major_and_left_padded(model, tok):
    out = rollout(model, tok, k=3, greedy=True, max_new_tokens=3)
    encoded = [tok(p)["input_ids"] for p in PROMPTS]
    width = max(map(len, encoded))
    assert out.prompt_ids.shape == (6, width)
    for i, ids in enumerate(encoded):
        for k in range(3):
            row = i * 3 + k
            assert out.prompt_ids[row, width - len(ids) :].tolist() == ids
            assert out.prompt_mask[row].tolist() == [0] * (width - len(ids)) + [1] * len(ids)
            assert out.prompt_ids[row, : width - len(ids)].eq(tok.pad_token_id).all()


def test_prompts_truncated_from_the_left(model, tok):
    long = "the cat sat on the mat because the context says not enough information " * 3
    full = tok(long)["input_ids"]
    out = rollout(
        model,
        tok,
        prompts=[long, "the cat"],
        k=2,
        max_prompt_length=10,
        greedy=True,
        max_new_tokens=2,
    )
    assert out.prompt_truncated == 1  # prompts, not rows
    assert out.prompt_ids.shape[1] == 10
    assert out.prompt_ids[0].tolist() == full[-10:] and out.prompt_ids[1].tolist() == full[-10:]


def test_context_limit_checked_before_generating(model, tok):
    with pytest.raises(
        ConfigError, match=r"max_prompt_length \(500\) \+ max_new_tokens \(64\).*512"
    ):
        rollout(model, tok, max_prompt_length=500, max_new_tokens=64)


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(temperature=0.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(min_p=1.5), "min_p"),
    ],
)
def test_settings_validated(bad, field):
    with pytest.raises(ConfigError, match=f"^{field} = "):
        SamplingSettings(**bad)


def test_settings_from_a_rollout_section_take_every_sampling_field():
    from dataclasses import fields

    from mogrpo.config.sections import RolloutConfig

    ro = RolloutConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                       frequency_penalty=0.25, repetition_penalty=1.3, stop_token_ids=[7, 9],
                       max_completion_length=12)
    settings = SamplingSettings.from_rollout(ro)
    assert (settings.temperature, settings.top_k, settings.top_p, settings.min_p) == \
        (0.7, 5, 0.9, 0.05)
    assert (settings.presence_penalty, settings.frequency_penalty,
            settings.repetition_penalty) == (0.5, 0.25, 1.3)
    assert settings.stop_token_ids == [7, 9] and settings.max_new_tokens == ro.completion_length
    assert not settings.greedy
    # one schema: every sampling knob a run can set is a rollout field of the same name
    knobs = {f.name for f in fields(SamplingSettings)} - {"max_new_tokens", "greedy"}
    assert knobs <= set(RolloutConfig.model_fields)
    assert SamplingSettings.from_rollout(ro, stop_token_ids=[3]).stop_token_ids == [3]


def test_no_stop_token_names_the_config_key(tok):
    class NoEos:
        eos_token_id = None

    class Bare(torch.nn.Module):
        generation_config = GenerationConfig()

    with pytest.raises(ConfigError, match="set rollout.stop_token_ids"):
        resolve_stop_ids(Bare(), NoEos(), SamplingSettings())


def test_train_mode_restored_and_dropout_off(tiny_model_dir, tok):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attention_dropout=0.9)
    model.train()
    model.model.layers[0].eval()  # a submodule deliberately in eval must stay so
    a = rollout(model, tok, greedy=True, max_new_tokens=6)
    b = rollout(model, tok, greedy=True, max_new_tokens=6)
    assert torch.equal(a.completion_ids, b.completion_ids)  # no dropout noise while sampling
    assert model.training and model.model.layers[1].training and not model.model.layers[0].training


def test_lora_policy_generates_like_its_base(model, tok, tiny_model_dir):
    base = rollout(model, tok, greedy=True, max_new_tokens=6)
    policy = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LoraSettings(r=4))
    out = rollout(policy, tok, greedy=True, max_new_tokens=6)
    assert torch.equal(out.completion_ids, base.completion_ids)

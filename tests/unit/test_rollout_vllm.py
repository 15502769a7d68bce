"""The vLLM engine against a fake vLLM (tests/fake_vllm.py): the import guard, settings
translation, request mapping into the rollout layout, and the weight push (full and LoRA)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from fake_vllm import FakeLLM, FakeSamplingParams
from mogrpo.cli import main
from mogrpo.config import engines
from mogrpo.errors import ConfigError
from mogrpo.modeling.load import LoraSettings, apply_lora
from mogrpo.rollout import vllm_engine
from mogrpo.rollout.generate import SamplingSettings, generate_rollout, resolve_stop_ids
from mogrpo.rollout.vllm_engine import VLLMEngine, decoded_from_outputs, sampling_kwargs

PROMPTS = ["the cat sat on", "答案 因为 the question", "a"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


def engine_for(model, llm: FakeLLM, sleep: bool = True) -> VLLMEngine:
    return VLLMEngine(llm, FakeSamplingParams, model, sleep_during_update=sleep)


# ---------------------------------------------------------------- import guard


def test_missing_vllm_is_refused_with_the_install_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else object())
    reason = engines.vllm_unavailable_reason()
    assert "pip install 'mogrpo[vllm]'" in reason and "CUDA GPU" in reason
    with pytest.raises(ConfigError, match=r"pip install 'mogrpo\[vllm\]'"):
        vllm_engine.import_vllm()


def test_no_gpu_is_refused_even_with_vllm_installed(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs a CUDA GPU and none is visible" in engines.vllm_unavailable_reason()


def test_train_with_engine_vllm_on_this_machine_stops_at_config_time(tmp_path, capsys,
                                                                     monkeypatch):
    monkeypatch.setattr(engines, "vllm_unavailable_reason",
                        lambda: "rollout.engine = vllm needs a CUDA GPU and none is visible")
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({
        "model": {"name_or_path": str(tmp_path / "no-model-loaded")},
        "tasks": {"a": {"data": "builtin:bias_probe", "rewards": ["mc_correct"]}},
        "rollout": {"engine": "vllm", "presence_penalty": 2.5},
        "output": {"dir": str(tmp_path / "run")},
    }))
    assert main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert "rollout.engine = vllm needs a CUDA GPU" in err
    assert "rollout.presence_penalty = 2.5 is outside vLLM's range [-2.0, 2.0]" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


# ---------------------------------------------------------------- settings


def test_sampling_settings_translate_field_by_field():
    settings = SamplingSettings(max_new_tokens=96, temperature=0.9, top_k=40, top_p=0.95,
                                min_p=0.05, presence_penalty=0.3, frequency_penalty=0.2,
                                repetition_penalty=1.1, stop_token_ids=[7])
    assert sampling_kwargs(settings, n=4, stop_ids=[128001, 128009], seed=5, logprobs=True) == {
        "n": 4, "temperature": 0.9, "top_k": 40, "top_p": 0.95, "min_p": 0.05,
        "presence_penalty": 0.3, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
        "max_tokens": 96, "min_tokens": 0, "stop_token_ids": [128001, 128009],
        "ignore_eos": True, "seed": 5, "logprobs": 0, "detokenize": False,
    }


def test_greedy_is_temperature_zero_with_filters_off_and_penalties_kept():
    settings = SamplingSettings(greedy=True, temperature=0.7, top_k=5, top_p=0.5, min_p=0.2,
                                presence_penalty=0.4, repetition_penalty=1.2)
    kw = sampling_kwargs(settings, n=1, stop_ids=[2], seed=None, logprobs=False)
    assert (kw["temperature"], kw["top_k"], kw["top_p"], kw["min_p"]) == (0.0, -1, 1.0, 0.0)
    assert (kw["presence_penalty"], kw["repetition_penalty"]) == (0.4, 1.2)
    assert kw["logprobs"] is None and kw["seed"] is None
    # top_k 0 means "off" in mogrpo; -1 is "off" in every vLLM version (0 is rejected by some)
    assert sampling_kwargs(SamplingSettings(), n=2, stop_ids=[2], seed=None,
                           logprobs=False)["top_k"] == -1


def test_every_sampling_field_reaches_vllm():
    """A new SamplingSettings field the vLLM translation forgot would fail here."""
    base = sampling_kwargs(SamplingSettings(), n=2, stop_ids=[2], seed=None, logprobs=True)
    changed = {"max_new_tokens": 9, "temperature": 0.5, "top_k": 3, "top_p": 0.8, "min_p": 0.1,
               "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
               "greedy": True}
    for f in dataclasses.fields(SamplingSettings):
        if f.name == "stop_token_ids":  # resolved with the model's EOS ids, passed as stop_ids
            continue
        kw = sampling_kwargs(SamplingSettings(**{f.name: changed[f.name]}), n=2, stop_ids=[2],
                             seed=None, logprobs=True)
        assert kw != base, f"SamplingSettings.{f.name} does not reach vLLM"


def test_llm_is_built_with_the_configured_share_sleep_mode_and_derived_length():
    from mogrpo.config import load_config

    config, _ = load_config(None, [
        "model.name_or_path=m", "tasks.a.data=builtin:bias_probe", "tasks.a.rewards=[mc_correct]",
        "rollout.max_prompt_length=100", "rollout.max_completion_length=60",
        "rollout.generation_batch_size=32", "rollout.vllm.gpu_memory_utilization=0.45",
        "rollout.vllm.enforce_eager=true", "seed=3"])
    kw = vllm_engine.llm_kwargs(config, "/models/base", torch.bfloat16)
    assert kw["model"] == "/models/base" and kw["dtype"] == "bfloat16"
    assert kw["gpu_memory_utilization"] == 0.45 and kw["enable_sleep_mode"] is True
    assert kw["max_model_len"] == 160 and kw["max_num_seqs"] == 32
    assert kw["enforce_eager"] is True and kw["seed"] == 3 and kw["tensor_parallel_size"] == 1
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["skip_tokenizer_init"] is True


# ---------------------------------------------------------------- request mapping


def scripted(stop: int):
    """Prompt 0: completion 0 stops at its 3rd token, completion 1 runs to max_tokens.
    Prompt 1: stops at once / after 2 tokens. Prompt 2: max_tokens / stops at the 4th."""
    plans = {(0, 0): [11, 12, stop, 13], (0, 1): [14] * 9, (1, 0): [stop, 15],
             (1, 1): [16, stop], (2, 0): [17, 18, 19, 20, 21, 22], (2, 1): [23, 24, 25, stop]}
    return lambda i, k, prompt, params: plans[(i, k)]


def test_k_completions_per_prompt_land_in_rows_i_times_k(model, tok):
    stop = tok.eos_token_id
    llm = FakeLLM(script=scripted(stop))
    engine = engine_for(model, llm)
    ro = generate_rollout(model, tok, PROMPTS, SamplingSettings(max_new_tokens=5),
                          num_generations=2, max_prompt_length=32, engine=engine,
                          record_logprobs=True)
    prompts, params = llm.requests[0]
    # one request per prompt, unpadded, n = K: vLLM samples the group itself
    assert [p["prompt_token_ids"] for p in prompts] == tok(PROMPTS)["input_ids"]
    assert params.n == 2 and params.max_tokens == 5
    assert params.stop_token_ids == resolve_stop_ids(model, tok, SamplingSettings()) \
        == [stop, tok.convert_tokens_to_ids("<|eot|>")]
    expected = [[11, 12, stop], [14] * 5, [stop], [16, stop], [17, 18, 19, 20, 21],
                [23, 24, 25, stop]]
    assert ro.lengths.tolist() == [len(r) for r in expected]
    assert ro.truncated.tolist() == [False, True, False, False, True, False]
    pad = tok.pad_token_id
    for row, tokens in enumerate(expected):
        assert ro.completion_ids[row].tolist() == tokens + [pad] * (5 - len(tokens))
        assert ro.completion_mask[row].tolist() == [1] * len(tokens) + [0] * (5 - len(tokens))
        assert ro.texts[row] == tok.decode(tokens, skip_special_tokens=True).strip()
    # every row carries its prompt, left-padded as for the other engines
    for i, ids in enumerate(tok(PROMPTS)["input_ids"]):
        for k in range(2):
            assert ro.prompt_ids[2 * i + k][ro.prompt_mask[2 * i + k].bool()].tolist() == ids
    # the sampler's log-prob of each chosen token, 0 at padding
    for i in range(3):
        for k in range(2):
            n = len(expected[2 * i + k])
            want = [-0.25 - 0.5 * k - 0.01 * j - i for j in range(n)] + [0.0] * (5 - n)
            assert ro.sampler_logp[2 * i + k].tolist() == pytest.approx(want)


def test_seeded_requests_are_spaced_k_seeds_apart(model):
    engine = engine_for(model, FakeLLM())
    params = engine.request_params(SamplingSettings(), 3, num_generations=4, stop_ids=[2],
                                   seed=100, record_logprobs=False)
    # vLLM seeds completion k of a request with seed + k: no two completions share a seed
    assert [p.seed for p in params] == [100, 104, 108]
    assert engine.request_params(SamplingSettings(), 3, num_generations=4, stop_ids=[2],
                                 seed=None, record_logprobs=False).seed is None


def test_a_seeded_rollout_repeats_exactly(model, tok):
    def run():
        engine = engine_for(model, FakeLLM())
        return generate_rollout(model, tok, PROMPTS, SamplingSettings(max_new_tokens=6),
                                num_generations=3, max_prompt_length=32, engine=engine,
                                generator_seed=7)
    first, second = run(), run()
    assert torch.equal(first.completion_ids, second.completion_ids)
    assert len({tuple(r) for r in first.completion_ids.tolist()}) == 9  # all distinct


def test_outputs_that_break_the_contract_are_reported():
    from fake_vllm import CompletionOutput, RequestOutput

    one = RequestOutput("0", [1], [CompletionOutput(0, [5, 6], None, "length")])
    with pytest.raises(RuntimeError, match="1 completions for prompt 0, expected 2"):
        decoded_from_outputs([one], 2, pad_id=0, record_logprobs=False)
    with pytest.raises(RuntimeError, match="no log-prob"):
        decoded_from_outputs([one], 1, pad_id=0, record_logprobs=True)


def test_the_string_vllm_is_not_an_engine(model, tok):
    with pytest.raises(ConfigError, match="pass the VLLMEngine"):
        generate_rollout(model, tok, PROMPTS, SamplingSettings(), num_generations=2,
                         max_prompt_length=32, engine="vllm")


# ---------------------------------------------------------------- sleep and weights


def test_sleeping_engine_wakes_weights_pushes_then_wakes_the_cache(model, tok):
    llm = FakeLLM()
    engine = engine_for(model, llm)
    engine.sleep()
    generate_rollout(model, tok, PROMPTS, SamplingSettings(max_new_tokens=4), num_generations=2,
                     max_prompt_length=32, engine=engine)
    assert llm.calls == [("sleep", 2), ("wake_up", ("weights",)), ("apply_model",),
                         ("reset_prefix_cache",), ("wake_up", ("kv_cache",)), ("generate", 3),
                         ("sleep", 2)]
    llm.calls.clear()
    engine.push_weights()  # after the optimizer step: weights only, the cache stays asleep
    assert llm.calls == [("wake_up", ("weights",)), ("apply_model",), ("reset_prefix_cache",)]


def test_without_sleep_mode_the_engine_only_pushes_when_weights_changed(model, tok):
    llm = FakeLLM()
    engine = engine_for(model, llm, sleep=False)
    for _ in range(2):
        generate_rollout(model, tok, PROMPTS, SamplingSettings(max_new_tokens=4),
                         num_generations=2, max_prompt_length=32, engine=engine)
    assert [c[0] for c in llm.calls] == ["apply_model", "reset_prefix_cache", "generate",
                                         "generate"]


def checkpoint_names(model_dir) -> set[str]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_push_after_an_optimizer_step_sends_the_current_weights_under_checkpoint_names(
        model, tok, tiny_model_dir):
    llm = FakeLLM()
    engine = engine_for(model, llm, sleep=False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ids = torch.tensor(tok(PROMPTS[:1])["input_ids"])
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    engine.push_weights()
    pushed = llm.model.loads[-1]
    # exactly the names vLLM reads from a checkpoint (lm_head is tied: saved once)
    assert set(pushed) == checkpoint_names(tiny_model_dir)
    params = dict(model.named_parameters())
    for name, tensor in pushed.items():
        assert torch.equal(tensor, params[name].detach())
    assert not torch.equal(pushed["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])


def test_lora_pushes_merged_weights_and_leaves_the_policy_untouched(model, tiny_model_dir):
    policy = apply_lora(model, LoraSettings(r=4, alpha=8, dropout=0.0,
                                            target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, p in policy.named_parameters():
        if "lora_B" in name:  # peft starts B at 0: make the adapter do something
            p.data.normal_()
    llm = FakeLLM()
    engine_for(policy, llm, sleep=False).push_weights()
    pushed = llm.model.loads[-1]
    assert set(pushed) == checkpoint_names(tiny_model_dir)  # no base_layer / lora_A names
    layer = policy.base_model.model.model.layers[0].self_attn
    for proj in ("q_proj", "v_proj"):
        module = getattr(layer, proj)
        W = module.base_layer.weight.detach()
        A, B = module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach()
        expected = W + (8 / 4) * B @ A  # W + (alpha / r) · B A
        assert torch.allclose(pushed[f"model.layers.0.self_attn.{proj}.weight"], expected,
                              atol=1e-6)
        assert not torch.allclose(expected, W)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert torch.equal(layer.q_proj.base_layer.weight,  # merged out of place
                       original.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(pushed["model.layers.0.self_attn.k_proj.weight"],  # not a target
                       original.model.layers[0].self_attn.k_proj.weight)


def test_dynamic_sampling_keeps_the_sampler_logprobs_of_the_groups_it_keeps(model, tok):
    from mogrpo.rollout.batching import concat_rollouts, select_groups

    def rollout():
        return generate_rollout(model, tok, PROMPTS, SamplingSettings(max_new_tokens=4),
                                num_generations=2, max_prompt_length=32,
                                engine=engine_for(model, FakeLLM()), record_logprobs=True)

    first, second = rollout(), rollout()
    kept = select_groups(first, [2, 0])
    assert torch.equal(kept.sampler_logp, first.sampler_logp[[4, 5, 0, 1]])
    joined = concat_rollouts([kept, second], tok.pad_token_id)
    assert torch.equal(joined.sampler_logp[4:], second.sampler_logp)

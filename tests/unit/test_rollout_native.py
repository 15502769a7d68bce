"""The native rollout engine against `generate()`: same greedy completions, same log-probs, same
sampling rules, same sampling distribution; and a logged fallback for other architectures."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from transformers import AutoTokenizer, GenerationConfig, LogitsProcessorList

from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.modeling.load import LoraSettings, apply_lora
from mogrpo.modeling.tiny import NATIVE_FAMILIES, random_family_model
from mogrpo.rollout import generate as generate_module
from mogrpo.rollout.generate import (
    SamplingSettings,
    build_generation_config,
    generate_rollout,
)
from mogrpo.rollout.native import NativeDecoder, native_decode
from mogrpo.rollout.processors import NonFiniteGuard, PresenceFrequencyPenalty
from mogrpo.rollout.sampling import SamplingRules, draw

PROMPTS = ["the cat sat on", "答案 因为 the question", "a", "option A B because the context says"]
FAMILIES = NATIVE_FAMILIES


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def family_model(family: str, tok, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of `family` with grouped-query attention and spread-out logits."""
    return random_family_model(family, len(tok), pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, seed=seed)


def rollout(model, tok, engine, *, k=2, seed=0, **settings):
    return generate_rollout(model, tok, PROMPTS, SamplingSettings(**settings), num_generations=k,
                            max_prompt_length=32, engine=engine, generator_seed=seed,
                            record_logprobs=engine == "native")


def training_logprobs(model, ro, temperature):
    with torch.no_grad():
        return completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                   ro.completion_mask, temperature=temperature)[0]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_completions_and_logprobs_match_generate(family, tok, decode_kernel):
    from mogrpo.kernels.cpu.mkl_packed import Packed

    model = family_model(family, tok)
    qkv = NativeDecoder(model).plain[0].qkv[0]
    assert isinstance(qkv, Packed) == (decode_kernel == "mkl-packed")
    assert decode_kernel == "mkl-packed" or qkv.is_mkldnn == (decode_kernel == "onednn")
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=10)
    # A token the greedy rows emit mid-way becomes a stop id: rows then finish at different
    # steps and leave the native batch one by one.
    stop = int(hf.completion_ids[0, 3])
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=10, stop_token_ids=[stop, 1])
    native = rollout(model, tok, "native", greedy=True, max_new_tokens=10,
                     stop_token_ids=[stop, 1])
    assert torch.equal(native.completion_ids, hf.completion_ids)
    assert torch.equal(native.lengths, hf.lengths)
    assert native.texts == hf.texts
    assert len(set(native.lengths.tolist())) > 1  # rows really did finish at different steps
    reference = training_logprobs(model, native, 1.0)
    torch.testing.assert_close(native.sampler_logp, reference, atol=1e-5, rtol=0)


def test_the_output_head_is_laid_out_for_the_decode_kernel_up_to_a_size(tok, monkeypatch):
    from mogrpo.kernels.cpu import linear as cpu_linear
    from mogrpo.kernels.cpu import mkl_packed
    from mogrpo.rollout import projections

    if not mkl_packed.works():
        pytest.skip("this torch exports no MKL packed product")
    monkeypatch.setattr(cpu_linear, "decode_on_onednn", lambda: False)
    monkeypatch.setattr(cpu_linear, "decode_on_mkl", lambda: True)
    model = family_model("qwen2", tok)
    head = model.get_output_embeddings().weight
    packed = NativeDecoder(model).head_weight  # a small head: packed for MKL
    assert isinstance(packed, mkl_packed.Packed) and packed.shape == head.shape
    x = torch.randn(3, head.shape[1])
    torch.testing.assert_close(cpu_linear.decode_linear(x, packed), x @ head.detach().t(),
                               atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(projections, "HEAD_COPY_MAX_BYTES", head.numel() * 4 - 1)
    assert NativeDecoder(model).head_weight is head  # a larger one: read in place


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_sampled_logprobs_match_the_training_forward_with_lora(family, tok):
    model = apply_lora(family_model(family, tok), LoraSettings(r=4, alpha=8, dropout=0.3))
    _perturb_adapters(model)
    model.train()  # the engine must turn LoRA dropout off while sampling
    ro = rollout(model, tok, "native", k=4, temperature=0.7, top_k=20, max_new_tokens=12)
    model.eval()
    reference = training_logprobs(model, ro, 0.7)
    # the sampler's adapters merged into W, the training forward's beside it: a few float32
    # roundings apart on log-probs down to ~ -5
    torch.testing.assert_close(ro.sampler_logp, reference, atol=1e-5, rtol=5e-6)
    assert model.base_model.model.model.layers[0].self_attn.q_proj.lora_dropout["default"].p == 0.3


def _perturb_adapters(model):
    with torch.no_grad():  # non-zero adapters, so the LoRA path is really exercised
        for name, p in model.named_parameters():
            if "lora_B" in name or "lora_magnitude" in name:
                p.normal_(0, 0.2)


def test_lora_is_merged_into_plain_weights_and_dora_runs_its_own_forward(tok):
    from peft import LoraConfig, get_peft_model

    lora = apply_lora(family_model("qwen2", tok), LoraSettings(r=4, alpha=8, dropout=0.0))
    assert NativeDecoder(lora).plain is not None  # merged, q/k/v and gate/up fused
    dora = get_peft_model(family_model("qwen2", tok), LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    _perturb_adapters(dora)
    assert NativeDecoder(dora).plain is None  # DoRA cannot be merged: the modules run
    ro = rollout(dora, tok, "native", k=2, temperature=0.8, max_new_tokens=8)
    torch.testing.assert_close(ro.sampler_logp, training_logprobs(dora, ro, 0.8),
                               atol=1e-5, rtol=0)


def test_draw_follows_the_probabilities_and_never_picks_a_zero():
    torch.manual_seed(0)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])  # zeros first, inside and last
    counts = torch.bincount(draw(probs.expand(20000, 6)), minlength=6).double()
    assert counts[probs == 0].sum() == 0
    expected = probs[probs > 0] * 20000
    chi2 = float((((counts[probs > 0] - expected) ** 2) / expected).sum())
    assert chi2 < 9.21  # chi-square 0.99 quantile, 2 degrees of freedom


def test_generation_batch_size_splits_without_changing_greedy_output(tok, monkeypatch):
    from mogrpo.rollout import native, projections

    model = family_model("llama", tok)
    whole = rollout(model, tok, "native", k=3, greedy=True, max_new_tokens=8)
    builds = []
    build = projections.plain_projections
    monkeypatch.setattr(projections, "plain_projections",
                        lambda *a, **kw: builds.append(1) or build(*a, **kw))
    decoders = []
    prefill = native.NativeDecoder.prefill

    def recorded(self, *args):
        decoders.append(self)
        return prefill(self, *args)

    monkeypatch.setattr(native.NativeDecoder, "prefill", recorded)
    split = generate_rollout(model, tok, PROMPTS, SamplingSettings(greedy=True, max_new_tokens=8),
                             num_generations=3, max_prompt_length=32, generation_batch_size=5)
    assert torch.equal(split.completion_ids, whole.completion_ids)
    assert torch.equal(split.prompt_ids, whole.prompt_ids)
    # 12 rows in batches of 5: three decode calls on one fusion and packing of the weights
    assert len(decoders) == 3 and len(builds) == 1
    assert decoders[0].plain is decoders[2].plain is not None


def test_weight_copies_follow_the_callers_budget(tok):
    """The native engine decodes on fused, packed copies of the weights up to a budget (by
    default PLAIN_MAX_BYTES), beyond it through the model's modules, with the same tokens."""
    from mogrpo.rollout import projections

    model = family_model("qwen2", tok)
    linear = sum(m.weight.numel() * 4 for m in model.model.layers.modules()
                 if isinstance(m, torch.nn.Linear))
    assert projections.decode_projections(model).layers is not None  # far below the default
    assert projections.decode_projections(model, linear).layers is not None
    assert projections.decode_projections(model, linear - 1).layers is None
    settings = SamplingSettings(greedy=True, max_new_tokens=8)
    runs = [generate_rollout(model, tok, PROMPTS, settings, num_generations=2,
                             max_prompt_length=32, plain_max_bytes=b) for b in (None, 1)]
    assert torch.equal(runs[0].completion_ids, runs[1].completion_ids)


def test_mkl_packs_of_small_models_reuse_the_last_rollouts_buffers(tok, monkeypatch):
    """On Intel CPUs the packed weights of a model with at most KEEP_MAX_BYTES of decode
    weights are packed into the buffers of the rollout before (no page faulted in anew);
    a larger model's are mapped for the rollout and unmapped after it."""
    import gc

    from mogrpo.kernels.cpu import linear as cpu_linear
    from mogrpo.kernels.cpu import mkl_packed
    from mogrpo.rollout import projections

    if not mkl_packed.works():
        pytest.skip("this torch exports no MKL packed product")
    monkeypatch.setattr(cpu_linear, "decode_on_onednn", lambda: False)
    monkeypatch.setattr(cpu_linear, "decode_on_mkl", lambda: True)
    model = family_model("qwen2", tok)
    gc.collect()  # packs an earlier test left for the collector give their buffers back now
    mkl_packed.POOL.clear()

    def addresses() -> list[int]:
        held = projections.decode_projections(model)
        return [w.address for layer in held.layers
                for w, _ in (layer.qkv, layer.out, layer.gate_up, layer.down)] + \
            [held.head.address]

    first = addresses()
    gc.collect()
    assert mkl_packed.POOL.kept_bytes() > 0
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(1.0)  # an optimizer step, say
    assert sorted(addresses()) == sorted(first)  # the same buffers, packed anew
    gc.collect()
    decoded = NativeDecoder(model)  # packed from the changed weights
    x = torch.randn(3, model.config.intermediate_size)
    torch.testing.assert_close(
        cpu_linear.decode_linear(x, decoded.plain[0].down[0]),
        x @ model.model.layers[0].mlp.down_proj.weight.detach().t(), atol=1e-4, rtol=1e-5)
    del decoded
    gc.collect()
    mkl_packed.POOL.clear()
    monkeypatch.setattr(projections, "KEEP_MAX_BYTES", 0)
    addresses()
    gc.collect()
    assert mkl_packed.POOL.kept_bytes() == 0


FLAG_SETS = [
    {},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_k": 5},
    {"top_p": 0.8},
    {"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05},
    {"min_p": 0.2},
    {"presence_penalty": 0.5, "frequency_penalty": 0.3},
    {"repetition_penalty": 1.3, "temperature": 0.8},
    {"greedy": True, "repetition_penalty": 1.2, "presence_penalty": 0.4},
]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: ",".join(f) or "plain")
def test_sampling_rules_equal_generate_processors(flags, tiny_policy):
    """The native rules give the very scores generate()'s own processor list gives."""
    model = tiny_policy[0]
    settings = SamplingSettings(max_new_tokens=8, **flags)
    torch.manual_seed(0)
    V, P = 50, 6
    prompt = torch.randint(0, V, (3, P))
    generated = torch.randint(0, V, (3, 4))
    logits = torch.randn(3, V) * 3
    logits[1, 7] = float("nan")  # the guard must treat it the same way in both
    config = build_generation_config(settings, stop_ids=[1], pad_id=0)
    custom = LogitsProcessorList([
        PresenceFrequencyPenalty(settings.presence_penalty, settings.frequency_penalty, P),
        NonFiniteGuard(temperature=1.0 if settings.greedy else settings.temperature),
    ])
    processors = model._get_logits_processor(generation_config=config, input_ids_seq_length=P,
                                             logits_processor=custom, device="cpu")
    expected = processors(torch.cat([prompt, generated], 1), logits.clone())

    rules = SamplingRules(settings, prompt, V)
    for column in generated.T:
        rules.observe(column)
    got = rules(logits.clone())
    torch.testing.assert_close(got, expected, atol=0, rtol=0, equal_nan=True)
    assert rules.guard.replaced == 1


def test_native_samples_the_same_distribution_as_generate(tok):
    """First-token frequencies of 3,000 samples per engine agree (chi-square, 1 % level)."""
    model = family_model("llama", tok, seed=3)
    settings = dict(temperature=1.0, top_k=8, max_new_tokens=1)
    counts = {}
    for engine in ("hf", "native"):
        ro = generate_rollout(model, tok, ["the cat sat on"], SamplingSettings(**settings),
                              num_generations=3000, max_prompt_length=16, engine=engine,
                              generator_seed=11)
        counts[engine] = torch.bincount(ro.completion_ids[:, 0], minlength=len(tok)).double()
    used = (counts["hf"] + counts["native"]) > 0
    a, b = counts["hf"][used], counts["native"][used]
    assert int(used.sum()) == 8  # top-k 8 honoured by both
    expected = (a + b) / 2
    chi2 = float((((a - expected) ** 2 + (b - expected) ** 2) / expected).sum())
    assert chi2 < 18.48  # chi-square 0.99 quantile, 7 degrees of freedom


def test_other_architectures_fall_back_to_generate_with_one_line(tok, caplog, monkeypatch):
    # the line is logged once per process: forget what earlier tests already logged
    monkeypatch.setattr(generate_module, "_warned", set())
    config = transformers.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2,
                                     n_positions=128, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    with caplog.at_level(logging.INFO, logger="mogrpo"):
        native = rollout(model, tok, "native", greedy=True, max_new_tokens=5)
        rollout(model, tok, "native", greedy=True, max_new_tokens=5)
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=5)
    assert torch.equal(native.completion_ids, hf.completion_ids)
    lines = [r.getMessage() for r in caplog.records if "rollout engine" in r.getMessage()]
    assert len(lines) == 1
    assert "'gpt2' is not one of the native engine's families" in lines[0]
    assert "generate() instead" in lines[0]
    assert native.sampler_logp is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_equivalence_tests_run_the_fused_decode_path(family, tok):
    """The fused path (one RMSNorm operation, q and k rotated together in four operations) is
    what the tests above compare with generate(); families it does not fit keep the modules'
    own arithmetic."""
    decoder = NativeDecoder(family_model(family, tok))
    assert decoder.plain is not None  # every family's projections run as plain matmuls
    assert decoder.rotate_halves  # q and k turned together (Qwen3's heads normalised first)
    assert (decoder.head_norms[0] is not None) == (family == "qwen3")
    # every family's norms as one RMSNorm operation (Gemma's with 1 + its weight)
    assert decoder.plain[0].norms is not None and decoder.final_norm is not None
    if family == "gemma":
        layer_norm = decoder.layers[0].input_layernorm
        assert torch.equal(decoder.plain[0].norms[0][0], 1 + layer_norm.weight)


def test_qwen3_head_norms_run_on_rows_in_either_order(tok, monkeypatch):
    """Qwen3 normalises each q and k head before the rotation. On rows in `pair_rows` order
    (float32 and float64) its norms' weights are reordered with them; in the model's order
    (the rotate-half path of bf16 and fp16) its modules run. Both give generate()'s greedy
    completions and the training forward's log-probs."""
    from mogrpo.rollout import projections

    model = family_model("qwen3", tok)
    weight = model.model.layers[0].self_attn.q_norm.weight
    assert not torch.equal(weight, torch.ones_like(weight))  # the weights' order matters
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=10)
    for pairs in (True, False):
        if not pairs:
            monkeypatch.setattr(projections, "_pairs", lambda lm, halves: False)
        decoder = NativeDecoder(model)
        assert decoder.rotate_halves and decoder.pairs == pairs
        assert (decoder.head_norms[0].paired is not None) == pairs
        ro = rollout(model, tok, "native", greedy=True, max_new_tokens=10)
        assert torch.equal(ro.completion_ids, hf.completion_ids)
        torch.testing.assert_close(ro.sampler_logp, training_logprobs(model, ro, 1.0),
                                   atol=1e-5, rtol=0)


def test_rows_of_one_prompt_are_prefilled_once(tok):
    """The K rows of a group share their prompt: prefill runs each distinct row once and copies
    its keys, values and first logits to the others — the same as running every row."""
    model = family_model("llama", tok)
    enc = tok(PROMPTS[:3], return_tensors="pt", padding=True, padding_side="left")
    ids = enc["input_ids"].repeat_interleave(4, dim=0)  # [12, P]: 3 prompts x K = 4
    mask = enc["attention_mask"].repeat_interleave(4, dim=0)
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, out: seen.append(args[0].shape[0]))
    shared = NativeDecoder(model)
    with torch.no_grad():
        logits = shared.prefill(ids, mask, max_new_tokens=4)
        assert seen == [3]  # one forward over the 3 distinct prompts
        every = NativeDecoder(model)
        want = every._prefill(ids, mask, max_new_tokens=4)  # all 12 rows
    hook.remove()
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    P = ids.shape[1]  # the columns written so far (the rest are written before being read)
    for got, want_kv in zip(shared.keys + shared.values, every.keys + every.values, strict=True):
        torch.testing.assert_close(got[:, :, :P], want_kv[:, :, :P], atol=1e-5, rtol=0)
    assert torch.equal(shared.bias, every.bias) and torch.equal(shared.positions, every.positions)
    # and the next step continues from the copies alike
    step = torch.arange(12) % 7 + 5
    with torch.no_grad():
        torch.testing.assert_close(shared.step(step), every.step(step), atol=1e-5, rtol=0)


def test_completions_feed_a_training_backward(tok):
    # the decode loop runs in inference mode; what it returns must be ordinary tensors, or
    # the training forward fails ("Inference tensors cannot be saved for backward")
    model = family_model("qwen2", tok)
    ro = rollout(model, tok, "native", k=2, max_new_tokens=6)
    out = native_decode(model, ro.prompt_ids, ro.prompt_mask, SamplingSettings(max_new_tokens=4),
                        stop_ids=[tok.eos_token_id], pad_id=tok.pad_token_id,
                        record_logprobs=True)
    assert not out.tokens.is_inference() and not out.logp.is_inference()
    model.train()
    logp, _ = completion_logprobs(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                                  ro.completion_mask)
    (logp * ro.sampler_logp).sum().backward()
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


def test_complex_pairs_turn_q_and_k_as_rotate_half_does():
    """With each head's rows interleaved, one complex product per pair is the rotation of
    rotate_half; the decoder reorders q and k alike, so attention scores do not change.
    `_fuse` reorders the rows of the q, k and v projections as it joins them."""
    from mogrpo.rollout.layer_ops import Attention, rotate_pairs, turn_halves, turn_tables
    from mogrpo.rollout.projections import _fuse, pair_rows

    torch.manual_seed(0)
    heads, kv_heads, D = 4, 2, 8
    attention = Attention(module=None, heads=heads, kv_heads=kv_heads, head_dim=D, scaling=1.0,
                           rotary=None)
    rows = (heads + 2 * kv_heads) * D
    weight, bias = torch.randn(rows, 16), torch.randn(rows)
    h = torch.randn(3, 5, 16)
    angles = torch.rand(3, 5, D // 2) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)  # [3, 5, D]
    plain = torch.nn.functional.linear(h, weight, bias)
    half_cos, half_sin = turn_tables(cos, sin)
    want = turn_halves(plain[..., :(heads + kv_heads) * D], heads + kv_heads,
                 half_cos[:, :, None], half_sin[:, :, None])  # [3, 5, H + H_kv, D]
    q_end, k_end = heads * D, (heads + kv_heads) * D
    parts = [(weight[a:b], bias[a:b]) for a, b in ((0, q_end), (q_end, k_end), (k_end, rows))]
    w2, b2 = _fuse(parts, pair_rows(attention, rows, weight.device))
    order = pair_rows(attention, rows, weight.device)
    assert torch.equal(w2, weight[order]) and torch.equal(b2, bias[order])
    pairs = torch.nn.functional.linear(h, w2, b2)
    got = rotate_pairs(pairs[..., :(heads + kv_heads) * D], heads + kv_heads,
                        torch.complex(angles.cos(), angles.sin())[:, :, None])
    order = torch.arange(D).view(2, D // 2).t().reshape(-1)  # the interleaved order of a head
    torch.testing.assert_close(got, want[..., order], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pairs[..., (heads + kv_heads) * D:],
                               plain[..., (heads + kv_heads) * D:])  # v as it was
    q, k = got[..., :heads, :], got[..., heads:, :]
    scores = torch.einsum("btgd,btkd->btgk", q, k)
    torch.testing.assert_close(scores, torch.einsum("btgd,btkd->btgk", want[..., :heads, :],
                                                    want[..., heads:, :]), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("width", [64, 128, 256, 896, 1536])
def test_the_decode_steps_rms_norm_equals_the_models_to_the_bit(width):
    """The decode step's RMSNorm (`rms_norm_step`, seven small operations) gives the values of
    `torch.rms_norm` and of the model families' own RMSNorm module exactly."""
    from mogrpo.rollout.layer_ops import rms_norm_step

    torch.manual_seed(width)
    module = transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm(width, eps=1e-6)
    with torch.no_grad():
        module.weight.normal_()
    norm = rms_norm_step(module.weight, module.variance_epsilon)
    with torch.inference_mode():
        for rows, scale in ((16, 1.0), (3, 100.0), (1, 1e-3)):
            x = torch.randn(rows, width) * scale
            want = module(x)
            assert torch.equal(norm(x), want)
            assert torch.equal(torch.rms_norm(x, (width,), module.weight, 1e-6), want)
        prefill_row = torch.randn(4, 7, width)[:, -1]  # a strided view, as `_logits` takes
        assert torch.equal(norm(prefill_row), module(prefill_row))


def test_held_projections_are_built_once_until_the_weights_change(tok):
    """Inside `held_projections` the fused, packed weights are built once and reused by every
    decode call while the weights stay as they are; an in-place change of any weight (an
    optimizer step, a load) or switching LoRA adapters builds them anew, and nothing is held
    after the context."""
    from mogrpo.kernels.cpu.linear import decode_linear
    from mogrpo.rollout import projections

    model = family_model("qwen2", tok)
    settings = {"greedy": True, "max_new_tokens": 6}
    before = rollout(model, tok, "native", **settings).completion_ids
    assert projections.decode_projections(model) is not projections.decode_projections(model)
    with projections.held_projections(model):
        first = projections.decode_projections(model)
        assert projections.decode_projections(model) is first
        assert torch.equal(rollout(model, tok, "native", **settings).completion_ids,
                           before)
        with projections.held_projections(model):  # nested: the outer context holds them
            assert projections.decode_projections(model) is first
        assert projections.decode_projections(model) is first
        assert projections.decode_projections(model, 10**9) is not first  # another budget
        with torch.no_grad():
            model.model.layers[1].mlp.down_proj.weight.mul_(-1.0)
        changed = projections.decode_projections(model)
        assert changed is not first and projections.decode_projections(model) is changed
        x = torch.randn(3, model.config.intermediate_size)
        torch.testing.assert_close(  # built from the changed weights
            decode_linear(x, changed.layers[1].down[0]),
            x @ model.model.layers[1].mlp.down_proj.weight.detach().t(), atol=1e-4, rtol=1e-5)
        flipped = rollout(model, tok, "native", **settings).completion_ids
        assert torch.equal(flipped, rollout(model, tok, "hf", **settings).completion_ids)
    assert not projections._HELD
    assert projections.decode_projections(model) is not projections.decode_projections(model)


def test_held_projections_follow_lora_adapters_switched_on_and_off(tok):
    from mogrpo.kernels.cpu.linear import decode_linear
    from mogrpo.rollout import projections

    model = apply_lora(family_model("llama", tok), LoraSettings(r=4, alpha=8, dropout=0.0))
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)  # adapters that change the outputs
    with projections.held_projections(model):
        on = projections.decode_projections(model)
        with model.disable_adapter():
            off = projections.decode_projections(model)
            assert off is not on and projections.decode_projections(model) is off
        back = projections.decode_projections(model)
        assert back is not off
        x = torch.randn(2, model.config.hidden_size)
        assert not torch.allclose(decode_linear(x, *on.layers[0].qkv),
                                  decode_linear(x, *off.layers[0].qkv))
        assert torch.equal(decode_linear(x, *on.layers[0].qkv),
                           decode_linear(x, *back.layers[0].qkv))


def test_off_cpus_the_decode_step_keeps_torch_rms_norm():
    """The seven-operation RMSNorm is for CPUs; elsewhere (a GPU's fused kernel) the decode
    step calls `torch.rms_norm` itself."""
    import functools

    from mogrpo.rollout.layer_ops import bound_norm

    module = transformers.models.qwen2.modeling_qwen2.Qwen2RMSNorm(8)
    on_cpu = bound_norm(module, (module.weight, 1e-6))
    assert not isinstance(on_cpu, functools.partial)
    meta = torch.empty(8, device="meta")
    elsewhere = bound_norm(module, (meta, 1e-6))
    assert isinstance(elsewhere, functools.partial) and elsewhere.func is torch.rms_norm
    assert elsewhere.keywords["weight"] is meta
    assert bound_norm(module, None) is module  # no fused weights: the module runs


def test_rotary_rows_of_the_kept_table_are_the_modules_values(tok):
    """score_hidden's rotary tables: rows of one table per model, equal to the bits of what the
    model's rotary module gives the same positions; built again for a longer sequence, another
    dtype, or frequencies changed in place; usable by a forward with gradients when first
    built in inference mode."""
    from mogrpo.rollout.layer_ops import turn_tables
    from mogrpo.rollout.scoring import _half_tables

    model = family_model("qwen2", tok)
    backbone = model.model

    def module_tables(positions, dtype=torch.float32):
        cos, sin = turn_tables(*backbone.rotary_emb(torch.zeros(1, dtype=dtype), positions))
        return cos[:, :, None], sin[:, :, None]

    g = torch.Generator().manual_seed(0)
    for length, dtype in [(9, torch.float32), (100, torch.float32), (40, torch.float64)]:
        positions = torch.randint(0, length, (3, 7), generator=g)
        got, want = _half_tables(backbone, positions, dtype, length), module_tables(positions,
                                                                                    dtype)
        for a, b in zip(got, want, strict=True):
            assert a.shape == b.shape == (3, 7, 1, 2, 8) and a.dtype == dtype  # head_dim 16
            assert torch.equal(a, b)
    with torch.no_grad():
        backbone.rotary_emb.inv_freq.mul_(0.5)  # another model's frequencies, in place
    positions = torch.arange(20).view(2, 10)
    for a, b in zip(_half_tables(backbone, positions, torch.float64, 20),
                    module_tables(positions, torch.float64), strict=True):
        assert torch.equal(a, b)
    other = family_model("llama", tok).model
    with torch.inference_mode():
        _half_tables(other, positions, torch.float32, 20)
    x = torch.randn(2, 10, 1, 2, 8, requires_grad=True)
    cos, sin = _half_tables(other, positions, torch.float32, 20)
    (x * cos + x.flip(-2) * sin).sum().backward()
    assert torch.equal(x.grad, cos + sin.flip(-2))


@pytest.mark.parametrize("engine", ["native", "hf"])
def test_a_decode_on_cuda_keeps_sdpa_off_cudnn(engine, tok, monkeypatch):
    """cuDNN's attention builds a plan for every new shape, and a decode meets one at every
    step: each SDPA call of a CUDA decode, native or generate(), runs with that backend off,
    and it is on again after. (No GPU here: the CUDA choice is forced; on a CPU the backend
    flags stay as they are.)"""
    from mogrpo.rollout import native

    seen: list[bool] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    model = family_model("qwen2", tok)
    on_cpu = rollout(model, tok, engine, greedy=True, max_new_tokens=6)
    assert seen and all(seen)
    seen.clear()
    monkeypatch.setattr(generate_module, "decode_attention",
                        lambda device: native.decode_attention(torch.device("cuda")))
    as_on_cuda = rollout(model, tok, engine, greedy=True, max_new_tokens=6)
    assert seen and not any(seen)
    assert torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()
    assert torch.backends.cuda.mem_efficient_sdp_enabled()
    assert torch.equal(as_on_cuda.completion_ids, on_cpu.completion_ids)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 9],
                                  [0, 1, 2, 4, 5, 6, 7, 8, 9], [0, 5, 6, 9], [9], [],
                                  [2, 3, 7, 8, 9], [0, 1, 3, 5, 7, 9]])
def test_finished_rows_leave_the_cache_in_place(rows):
    """The rows that stay move up inside the cache they are in: the first columns then hold
    what copying those rows out would, the columns after them are untouched, and no new cache
    is made (runs shifting by one row, by more rows than the run is long, and by none)."""
    from mogrpo.rollout.cache_rows import row_moves, shift_rows

    torch.manual_seed(len(rows))
    cache = torch.randn(10, 2, 12, 4)
    before = cache.clone()
    kept = shift_rows(cache, row_moves(rows), len(rows), 7)
    assert kept.shape == (len(rows), 2, 12, 4) and kept.is_contiguous()
    assert kept.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert torch.equal(kept[:, :, :7], before[rows][:, :, :7])
    assert torch.equal(cache[:, :, 7:], before[:, :, 7:])
    stay = next((i for i, r in enumerate(rows) if r != i), len(rows))
    assert all(first >= stay for first, _, _ in row_moves(rows))  # rows before stay put

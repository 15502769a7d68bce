"""The native engine's compiled CPU decode step (`mogrpo.kernels.cpu.decode_step`): the same logits
and caches as the Python step, step after step and as rows leave the batch; the families and
layers it takes (Qwen3's per-head q/k norms, Gemma's norms and GELU among them); and the Python
step wherever it cannot be built or is switched off."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch
from transformers import AutoTokenizer

from mogrpo.kernels.cpu import decode_step as cpu_kernel
from mogrpo.modeling.load import LoraSettings, apply_lora
from mogrpo.modeling.tiny import random_family_model
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.rollout.native import NativeDecoder

PROMPTS = ["the cat sat on", "答案 因为 the question", "a", "option A B because the context says"]


@pytest.fixture(scope="module")
def tok(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def kernel():
    module = cpu_kernel.module()
    if module is None:
        pytest.skip("the compiled decode step is not available here (no C++ compiler, or "
                    "MOGRPO_DECODE_KERNEL=0 when the tests started)")
    return module


@pytest.fixture
def python_step(monkeypatch):
    """Decoders built inside take the Python step."""
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)


def model_of(family: str, tok, seed: int = 0, **config):
    model = random_family_model(family, len(tok), pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id, seed=seed)
    for key, value in config.items():
        setattr(model.config, key, value)
    return model


def prompt_batch(tok, k: int = 2):
    enc = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    return (enc["input_ids"].repeat_interleave(k, 0), enc["attention_mask"].repeat_interleave(k, 0))


def run_steps(model, tok, steps: int = 6, leave: dict[int, list[int]] | None = None):
    """Prefill, then `steps` decode steps feeding each row's greedy token, keeping only the
    listed rows after the steps named in `leave`; each step's logits and the final caches."""
    ids, mask = prompt_batch(tok)
    with torch.inference_mode():
        decoder = NativeDecoder(model)
        logits = decoder.prefill(ids, mask, steps + 1)
        seen = []
        for t in range(steps):
            tokens = logits.argmax(-1)
            if leave and t in leave:
                rows = torch.tensor(leave[t])
                decoder.keep_unfinished(rows)
                tokens = tokens[rows]
            logits = decoder.step(tokens)
            seen.append(logits.clone())
        columns = decoder.length
        caches = [c[:, :, :columns].clone() for c in decoder.keys + decoder.values]
    return decoder, seen, caches


def assert_close_runs(compiled, python):
    _, logits, caches = compiled
    _, expected_logits, expected_caches = python
    assert len(logits) == len(expected_logits)
    # float32 rounding in another summation order: differences grow with the values (Gemma's
    # are twice Llama's here: its embeddings are scaled by sqrt(hidden))
    for got, want in [*zip(logits, expected_logits, strict=True),
                      *zip(caches, expected_caches, strict=True)]:
        torch.testing.assert_close(got, want, rtol=1e-5,
                                   atol=max(1e-5, 4e-6 * float(want.abs().max())))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"])
def test_compiled_step_gives_the_python_steps_logits_and_caches(family, tok, kernel, decode_kernel,
                                                                monkeypatch):
    from mogrpo.kernels.cpu.mkl_packed import Packed

    model = model_of(family, tok)
    compiled = run_steps(model, tok, leave={2: [0, 2, 3, 5, 6, 7], 4: [1, 2, 5]})
    decoder = compiled[0]
    assert decoder.compiled is not None and decoder.compiled_head
    qkv = decoder.plain[0].qkv[0]
    assert isinstance(qkv, Packed) == (decode_kernel == "mkl-packed")
    assert decode_kernel == "mkl-packed" or qkv.is_mkldnn == (decode_kernel == "onednn")
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    python = run_steps(model, tok, leave={2: [0, 2, 3, 5, 6, 7], 4: [1, 2, 5]})
    assert python[0].compiled is None
    assert_close_runs(compiled, python)
    # the logits move from step to step: the comparison is not of constants
    assert not torch.allclose(compiled[1][0][:3], compiled[1][1][:3])


def test_compiled_step_takes_biases_on_every_product_and_an_untied_head(tok, kernel, decode_kernel,
                                                                       monkeypatch):
    """Qwen2's q/k/v biases, and biases given to o_proj, down_proj and gate/up by hand (other
    families have them), with a separate output head."""
    model = model_of("qwen2", tok)
    torch.manual_seed(3)
    for layer in model.model.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj, layer.mlp.gate_proj):
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features) * 0.3)
    head = model.lm_head
    head.weight = torch.nn.Parameter(head.weight.detach().clone() + 0.05)
    head.bias = torch.nn.Parameter(torch.randn(head.out_features))
    compiled = run_steps(model, tok)
    assert compiled[0].compiled_head
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    assert_close_runs(compiled, run_steps(model, tok))


def test_attention_on_several_threads_runs_as_batched_products(tok, kernel, monkeypatch):
    """From PARALLEL_ATTENTION multiply-adds (here every step's) with two torch threads."""
    model = model_of("llama", tok)
    monkeypatch.setattr(cpu_kernel, "PARALLEL_ATTENTION", 0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compiled = run_steps(model, tok, leave={2: [0, 1, 4, 6, 7]})
    finally:
        torch.set_num_threads(threads)
    assert compiled[0].compiled is not None
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    assert_close_runs(compiled, run_steps(model, tok, leave={2: [0, 1, 4, 6, 7]}))


def test_layers_wider_in_attention_than_in_the_mlp(tok, kernel, monkeypatch):
    """q/k/v wider than gate/up (the buffers both share are laid out per product)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=24,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         max_position_embeddings=128, initializer_range=0.2,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(5)
    model = LlamaForCausalLM(config).eval()
    compiled = run_steps(model, tok)
    assert compiled[0].compiled is not None
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    assert_close_runs(compiled, run_steps(model, tok))


def test_compiled_step_decodes_lora_with_the_adapters_merged(tok, kernel, monkeypatch):
    model = apply_lora(model_of("llama", tok), LoraSettings(r=4, alpha=8, dropout=0.0))
    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.3)
    compiled = run_steps(model, tok)
    assert compiled[0].compiled is not None
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    assert_close_runs(compiled, run_steps(model, tok))


def test_greedy_rollouts_of_both_steps_are_the_same(tok, kernel, monkeypatch):
    model = model_of("qwen2", tok, seed=4)
    settings = SamplingSettings(greedy=True, max_new_tokens=12)

    def greedy():
        return generate_rollout(model, tok, PROMPTS, settings, num_generations=2,
                                max_prompt_length=32, engine="native", generator_seed=0,
                                record_logprobs=True)

    compiled = greedy()
    monkeypatch.setattr(cpu_kernel, "module", lambda: None)
    python = greedy()
    assert torch.equal(compiled.completion_ids, python.completion_ids)
    torch.testing.assert_close(compiled.sampler_logp, python.sampler_logp,
                               rtol=0, atol=1e-5)


def test_layers_it_cannot_run_take_the_python_step(tok, kernel):
    """An activation the compiled step does not compute (ReLU here): the Python step runs."""
    from transformers.activations import ACT2FN

    model = model_of("llama", tok)
    for layer in model.model.layers:
        layer.mlp.act_fn = ACT2FN["relu"]
    decoder, logits, _ = run_steps(model, tok, steps=2)
    assert decoder.compiled is None and len(logits) == 2


def test_the_activations_it_computes():
    import functools

    from torch import nn
    from transformers.activations import ACT2FN

    silu, gelu_tanh = cpu_kernel.ACTIVATIONS["silu"], cpu_kernel.ACTIVATIONS["gelu_tanh"]
    assert cpu_kernel._activation(ACT2FN["silu"]) == silu
    assert cpu_kernel._activation(nn.SiLU()) == silu
    assert cpu_kernel._activation(torch.nn.functional.silu) == silu
    assert cpu_kernel._activation(ACT2FN["gelu_pytorch_tanh"]) == gelu_tanh  # Gemma's
    assert cpu_kernel._activation(nn.GELU(approximate="tanh")) == gelu_tanh
    # exact GELU, the tanh formula written out in Python (it rounds otherwise), ReLU: no
    assert cpu_kernel._activation(nn.GELU()) is None
    python_tanh = type(ACT2FN["gelu_pytorch_tanh"])(use_gelu_tanh_python=True)
    assert cpu_kernel._activation(python_tanh) is None
    assert cpu_kernel._activation(ACT2FN["relu"]) is None
    assert cpu_kernel._activation(functools.partial(torch.nn.functional.gelu)) is None


def test_the_stack_refuses_inputs_of_the_wrong_shape(tok, kernel):
    model = model_of("llama", tok)
    decoder, _, _ = run_steps(model, tok, steps=1)
    stack, B = decoder.compiled, len(decoder.positions)
    turn = torch.zeros(B, decoder.attention[0].head_dim // 2, 2)
    with pytest.raises(ValueError, match="x must be contiguous float32"):
        stack.step(torch.zeros(B, 3), turn, decoder.bias, decoder.keys, decoder.values, 1)
    with pytest.raises(ValueError, match="one key and one value cache per layer"):
        stack.step(torch.zeros(B, 64), turn, decoder.bias, decoder.keys[:1], decoder.values, 1)
    with pytest.raises(ValueError, match="x must be"):  # more rows than it was built for
        stack.step(torch.zeros(B + 1, 64), turn, decoder.bias, decoder.keys, decoder.values, 1)


def test_the_stack_refuses_a_per_head_norm_of_another_width(kernel):
    hidden, D, heads, inter = 32, 8, 4, 48
    stack = kernel.Stack(0, 4, hidden, D, cpu_kernel.PARALLEL_ATTENTION)

    def add(q_norm):
        stack.add_layer(torch.ones(hidden), 1e-6, torch.ones(hidden), 1e-6,
                        torch.zeros(3 * heads * D, hidden), 3 * heads * D, None,
                        torch.zeros(hidden, heads * D), None, torch.zeros(2 * inter, hidden),
                        2 * inter, None, torch.zeros(hidden, inter), inter, None, heads, heads,
                        D ** -0.5, cpu_kernel.ACTIVATIONS["silu"], q_norm, 1e-6, torch.ones(D),
                        1e-6)

    add(torch.ones(D))  # the right width is taken
    with pytest.raises(ValueError, match="a per-head norm's weight must be float32"):
        add(torch.ones(D // 2))


def test_switched_off_by_the_environment_variable(monkeypatch):
    monkeypatch.setenv(cpu_kernel.ENV, "0")
    monkeypatch.setattr(cpu_kernel, "_build", lambda *a: pytest.fail("built while switched off"))
    cpu_kernel.module.cache_clear()
    try:
        assert cpu_kernel.module() is None
    finally:
        cpu_kernel.module.cache_clear()


def test_a_failed_build_warns_once_and_decoding_goes_on(tok, monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MOGRPO_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_kernel.ENV, raising=False)

    def no_compiler(name, directory):
        raise RuntimeError("Error building extension 'x': [1/2] c++ -c decode_step.cpp\n"
                           "decode_step.cpp:1:10: fatal error: ATen/ATen.h: No such file\n"
                           "ninja: build stopped: subcommand failed.")

    monkeypatch.setattr(cpu_kernel, "_build", no_compiler)
    cpu_kernel.module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mogrpo.kernels.cpu.decode_step"):
            assert cpu_kernel.module() is None
            assert cpu_kernel.module() is None
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1
        assert "(the build failed: decode_step.cpp:1:10: fatal error: ATen/ATen.h: No such " \
            "file); the Python step runs instead (MOGRPO_DECODE_KERNEL=0 skips" in lines[0]
        decoder, logits, _ = run_steps(model_of("llama", tok), tok, steps=2)
        assert decoder.compiled is None and torch.isfinite(logits[-1]).all()
        # the next process does not try again, and says how to
        monkeypatch.setattr(cpu_kernel, "_build", lambda *a: pytest.fail("built again"))
        cpu_kernel.module.cache_clear()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mogrpo.kernels.cpu.decode_step"):
            assert cpu_kernel.module() is None
        directory = cpu_kernel.cache_directory() / cpu_kernel.build_name()
        assert f"ATen/ATen.h: No such file; delete {directory} to build it again" in \
            caplog.records[0].getMessage()
    finally:
        cpu_kernel.module.cache_clear()


def test_without_a_compiler_nothing_is_tried(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("MOGRPO_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setattr(cpu_kernel, "_build", lambda *a: pytest.fail("tried to build"))
    cpu_kernel.module.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="mogrpo.kernels.cpu.decode_step"):
            assert cpu_kernel.module() is None
        assert "(no C++ compiler 'no-such-compiler' to build it: install g++ or set CXX)" in \
            caplog.records[0].getMessage()
    finally:
        cpu_kernel.module.cache_clear()


def test_a_stale_build_lock_is_removed_and_a_fresh_one_waits_for_the_builder(monkeypatch,
                                                                             tmp_path):
    """A lock left by a build that was killed would stall every later start on the builder's
    wait; a lock younger than a build is another process building: its build is waited for
    (through the builder), never imported half-written."""
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("MOGRPO_KERNEL_CACHE", str(tmp_path))
    monkeypatch.delenv(cpu_kernel.ENV, raising=False)
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "built")
    directory = cpu_kernel.cache_directory() / cpu_kernel.build_name()
    directory.mkdir(parents=True)
    lock = directory / "lock"
    lock.touch()
    old = time.time() - cpu_kernel.STALE_LOCK_SECONDS - 60
    os.utime(lock, (old, old))
    (directory / f"{cpu_kernel.build_name()}.so").write_bytes(b"half written")
    cpu_kernel.module.cache_clear()
    try:
        assert cpu_kernel.module() == "built"
        assert not lock.exists() and calls[0]["build_directory"] == str(directory)
        lock.touch()  # another process building now
        cpu_kernel.module.cache_clear()
        assert cpu_kernel.module() == "built" and lock.exists() and len(calls) == 2
    finally:
        cpu_kernel.module.cache_clear()


def test_builds_are_kept_per_python_torch_source_and_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("MOGRPO_KERNEL_CACHE", str(tmp_path))
    directory = cpu_kernel.cache_directory()
    assert directory.parent == tmp_path and torch.__version__ in directory.name
    name = cpu_kernel.build_name()
    assert torch.backends.cpu.get_cpu_capability().lower() in name
    monkeypatch.setattr(cpu_kernel, "SOURCE", tmp_path / "other.cpp")
    (tmp_path / "other.cpp").write_text("// another version\n")
    assert cpu_kernel.build_name() != name


def test_a_decoder_built_outside_inference_mode_after_one_inside(tok):
    """Decoders share each shape's q/k row order (cached); one made inside inference mode, as
    `native_decode` runs, must not break a decoder built outside it: Qwen2's q/k/v biases are
    reordered by it, and are copies that need no gradient."""
    from mogrpo.rollout import layer_ops

    layer_ops.pair_order.cache_clear()
    model = model_of("qwen2", tok)
    with torch.inference_mode():
        NativeDecoder(model)
    bias = NativeDecoder(model).plain[0].qkv[1]
    assert bias is not None and not bias.requires_grad

"""float32 linears on oneDNN: the same values and gradients as `F.linear`, and the same
log-probs and gradients from a model forward run inside `cpu_linears`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from mogrpo.kernels.cpu import linear as cpu_linear
from mogrpo.kernels.cpu import mkl_packed
from mogrpo.kernels.cpu.linear import (
    cpu_linears,
    decode_linear,
    decode_weight,
    linear,
    pack,
    wide_avx512,
)

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch has no oneDNN")


@pytest.fixture(autouse=True)
def training_on_onednn(monkeypatch):
    """The training products on oneDNN, whatever this machine's CPU (on Intel CPUs MKL runs
    them: `training_on_onednn`)."""
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: True)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_and_packed_weights_equal_f_linear(bias):
    torch.manual_seed(0)
    x, w = torch.randn(5, 7, 48), torch.randn(96, 48)
    b = torch.randn(96) if bias else None
    expected = F.linear(x, w, b)
    torch.testing.assert_close(linear(x, w, b), expected, atol=1e-5, rtol=1e-5)
    packed = pack(w)
    assert packed.is_mkldnn  # really the blocked layout, not w itself
    torch.testing.assert_close(linear(x, packed, b), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x[:3, :1], packed, b), expected[:3, :1], atol=1e-5, rtol=1e-5)


def test_other_dtypes_fall_back_to_f_linear():
    x, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    assert not cpu_linear.usable(x, w)
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert pack(w) is w


def test_context_gives_f_linear_gradients():
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 24)
    x = torch.randn(3, 5, 32, requires_grad=True)
    grads = []
    for context in (cpu_linears(layer), None):
        layer.zero_grad()
        x.grad = None
        if context is None:
            y = layer(x)
        else:
            with context:
                y = layer(x)
            assert y.grad_fn.name().endswith("_LinearBackward")  # the oneDNN function ran
        (y * torch.linspace(-1, 1, 24)).sum().backward()
        grads.append((y.detach(), x.grad.clone(), layer.weight.grad.clone(), layer.bias.grad.clone()))
    for got, expected in zip(*grads, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_frozen_weight_gets_no_gradient_inside_the_context():
    layer = torch.nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(2, 8, requires_grad=True)
    with cpu_linears(layer):
        y = layer(x)
    y.sum().backward()
    assert layer.weight.grad is None
    torch.testing.assert_close(x.grad, layer.weight.sum(0).expand(2, 8), atol=1e-6, rtol=1e-6)


def test_model_forward_logprobs_and_gradients_match_without_the_context(monkeypatch):
    from mogrpo import kernels
    from mogrpo.algo import logprobs as logprobs_module
    from mogrpo.algo.products import TORCH

    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    prompt = torch.randint(2, 64, (3, 5))
    completion = torch.randint(2, 64, (3, 6))
    mask = torch.ones(3, 6, dtype=torch.long)
    mask[1, 4:] = 0
    calls = []
    apply = cpu_linear._Linear.apply
    monkeypatch.setattr(cpu_linear._Linear, "apply", lambda *a: calls.append(1) or apply(*a))

    def run(products):
        model.zero_grad()
        logp, _ = logprobs_module.completion_logprobs(model, prompt, torch.ones_like(prompt),
                                                      completion, mask, products=products)
        logp.sum().backward()
        return logp.detach(), [p.grad.clone() for p in model.parameters()]

    on, on_grads = run(kernels.products())
    # q, k, v, o, gate, up, down per layer (the output head projects in head_logprobs)
    assert len(calls) == 2 * 7
    off, off_grads = run(TORCH)  # PyTorch's own products: the model's linears left alone
    assert len(calls) == 14
    torch.testing.assert_close(on, off, atol=1e-5, rtol=0)
    for a, b in zip(on_grads, off_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_the_availability_check_leaves_the_rng_alone():
    """Its first call comes at a different point in a resumed run than in an unbroken one."""
    cpu_linear.available.cache_clear()
    state = torch.get_rng_state()
    assert cpu_linear.available()
    assert torch.equal(torch.get_rng_state(), state)


def test_backward_hands_onednn_plain_strides(monkeypatch):
    # The last position's logit: a one-position slice of [B, T, H], whose weight gradient
    # oneDNN computed ~250x slower than on a copy. Every 2-D operand must reach it contiguous
    # or as the transpose of a contiguous tensor, and the gradients still equal F.linear's.
    torch.manual_seed(0)
    hidden = torch.randn(4, 13, 32, requires_grad=True)
    layer = torch.nn.Linear(32, 24, bias=False)
    w = layer.weight
    layer(hidden[:, -1:, :]).square().sum().backward()
    expected = (hidden.grad, w.grad)
    hidden.grad = w.grad = None

    original = torch.ops.mkldnn._linear_pointwise
    operands = []

    def record(a, b, *rest):
        operands.extend(t for t in (a, b) if t.dim() == 2)
        return original(a, b, *rest)

    with cpu_linears(layer):
        out = layer(hidden[:, -1:, :])
        assert out.grad_fn.name().endswith("_LinearBackward")
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", record)
        out.square().sum().backward()
    torch.testing.assert_close(hidden.grad, expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.grad, expected[1], atol=1e-5, rtol=1e-5)
    assert len(operands) >= 3  # the input gradient's weight, the weight gradient's two
    assert all(t.is_contiguous() or t.t().is_contiguous() for t in operands)


def test_the_context_restores_the_layers_and_leaves_other_models_alone():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    other = torch.nn.Linear(8, 8)
    with cpu_linears(model):
        assert [type(m).__name__ for m in model] == ["CPULinear", "ReLU", "CPULinear"]
        assert type(other) is torch.nn.Linear
        with cpu_linears(model):  # nested: the outer context restores
            pass
        assert type(model[0]) is cpu_linear.CPULinear
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.ReLU, torch.nn.Linear]
    with pytest.raises(RuntimeError, match="boom"), cpu_linears(model):
        raise RuntimeError("boom")
    assert type(model[0]) is torch.nn.Linear
    double = torch.nn.Linear(8, 8).double()
    with cpu_linears(double):  # not float32: left as it is
        assert type(double) is torch.nn.Linear


@pytest.mark.parametrize("on_onednn", [True, False])
def test_the_products_equal_torch_on_either_kernel(monkeypatch, on_onednn):
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: on_onednn)
    torch.manual_seed(0)
    x, w, base = torch.randn(2, 6, 32), torch.randn(24, 32), torch.randn(2, 6, 24)
    torch.testing.assert_close(cpu_linear.linear_add(x, w, base.clone()), base + x @ w.t(),
                               atol=1e-5, rtol=1e-5)
    grad = torch.randn(12, 24)
    torch.testing.assert_close(cpu_linear.product(grad, w.t()), grad @ w, atol=1e-5, rtol=1e-5)
    flat = x.reshape(12, 32)
    torch.testing.assert_close(cpu_linear.weight_product(grad, flat), grad.t() @ flat,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, pack(w)), F.linear(x, w), atol=1e-5, rtol=1e-5)


def test_where_mkl_is_native_the_training_products_stay_on_it(monkeypatch):
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: False)
    torch.manual_seed(0)
    layer = torch.nn.Linear(32, 24)
    with cpu_linears(layer):
        assert type(layer) is cpu_linear.CPULinear  # marked, for peft's layers to fuse around
        y = layer(torch.randn(3, 32, requires_grad=True))
    assert y.grad_fn.name() == "AddmmBackward0"  # torch's own product, not oneDNN's
    x = torch.randn(6, 32)
    assert torch.equal(linear(x, layer.weight), F.linear(x, layer.weight))


def test_mkl_is_native_on_intel_cpus_only():
    assert cpu_linear.mkl_native(_cpuinfo("GenuineIntel", 6, "avx512f"))
    assert cpu_linear.mkl_native(_cpuinfo("GenuineIntel", 6, ""))
    assert not cpu_linear.mkl_native(_cpuinfo("AuthenticAMD", 25, "avx512f"))
    assert not cpu_linear.mkl_native("")


def test_training_products_go_to_onednn_only_where_avx512_beats_mkls_avx2():
    assert cpu_linear.onednn_trains_faster(_cpuinfo("AuthenticAMD", 26, "avx512f"))  # Zen 5
    assert cpu_linear.onednn_trains_faster(_cpuinfo("AuthenticAMD", 25, "avx512f avx512bw"))
    assert not cpu_linear.onednn_trains_faster(_cpuinfo("AuthenticAMD", 25, ""))  # Zen 3
    assert not cpu_linear.onednn_trains_faster(_cpuinfo("GenuineIntel", 6, "avx512f"))
    assert not cpu_linear.onednn_trains_faster("")  # no /proc/cpuinfo: torch's own products


def _cpuinfo(vendor: str, family: int, flags: str) -> str:
    block = (f"processor\t: {{n}}\nvendor_id\t: {vendor}\ncpu family\t: {family}\n"
             f"model\t\t: 17\nflags\t\t: fpu sse2 avx2 {flags}\n\n")
    return block.format(n=0) + block.format(n=1)


def test_full_width_avx512_means_amd_zen5_or_later():
    assert wide_avx512(_cpuinfo("AuthenticAMD", 26, "avx512f avx512bw"))  # Zen 5
    assert wide_avx512(_cpuinfo("AuthenticAMD", 27, "avx512f"))
    assert not wide_avx512(_cpuinfo("AuthenticAMD", 25, "avx512f avx512bw"))  # Zen 4: halves
    assert not wide_avx512(_cpuinfo("AuthenticAMD", 26, "avx512vl"))  # no AVX-512F
    assert not wide_avx512(_cpuinfo("GenuineIntel", 6, "avx512f"))  # MKL runs AVX-512 there
    assert not wide_avx512("")  # no /proc/cpuinfo (macOS, Windows)
    assert not wide_avx512("vendor_id\t: AuthenticAMD\ncpu family\t: ?\n")


def test_cpu_name_tells_the_family_a_bare_model_name_hides():
    info = _cpuinfo("AuthenticAMD", 25, "avx512f").replace("model\t\t: 17",
                                                           "model\t\t: 17\nmodel name\t: AMD EPYC")
    assert cpu_linear.cpu_name(info) == \
        "AMD EPYC (AMD family 25 model 17, no full-width AVX-512 for oneDNN)"
    xeon = _cpuinfo("GenuineIntel", 6, "avx512f").replace(
        "model\t\t: 17", "model\t\t: 85\nmodel name\t: Intel(R) Xeon(R) Processor @ 2.50GHz")
    assert cpu_linear.cpu_name(xeon) == \
        "Intel(R) Xeon(R) Processor @ 2.50GHz (Intel family 6 model 85, training products on MKL)"
    assert cpu_linear.cpu_name("") == "unknown CPU"


needs_mkl_packing = pytest.mark.skipif(not mkl_packed.works(),
                                       reason="this torch exports no MKL packed product")


@pytest.fixture
def decode_rule(monkeypatch):
    """Sets which CPU's decode rule applies: "wide" (full-width AVX-512: oneDNN throughout),
    "intel" (MKL's own code: every weight packed for MKL) or "amd" (MKL's AVX2 code: large
    weights packed for oneDNN, the rest as they are)."""
    def use(rule: str) -> None:
        if rule == "intel" and not mkl_packed.works():
            pytest.skip("this torch exports no MKL packed product")
        monkeypatch.setattr(cpu_linear, "decode_on_onednn", lambda: rule == "wide")
        monkeypatch.setattr(cpu_linear, "decode_on_mkl", lambda: rule == "intel")
    return use


def test_decode_weights_are_packed_for_onednn_from_the_size_where_it_wins(decode_rule):
    decode_rule("amd")
    assert decode_weight(torch.randn(512, 256)).is_mkldnn  # 256 inputs, 2^17 elements
    for shape in [(256, 256), (1280, 128), (128, 640)]:  # MKL's product is the faster one
        small = torch.randn(shape)
        assert decode_weight(small) is small
    small = torch.randn(1280, 64)
    decode_rule("wide")
    assert decode_weight(small).is_mkldnn


def test_on_intel_cpus_every_decode_weight_is_packed_for_mkl(decode_rule):
    decode_rule("intel")
    for shape in [(512, 256), (256, 256), (1280, 128), (5, 3)]:
        packed = decode_weight(torch.randn(shape))
        assert isinstance(packed, mkl_packed.Packed) and packed.shape == shape
        assert cpu_linear.decode_kernel(packed) is mkl_packed.linear
        assert cpu_linear.decode_add_kernel(packed) is mkl_packed.linear_add
        assert isinstance(cpu_linear.decode_product(packed, None, 16), mkl_packed.Product)
    # what the packed product cannot take stays as it is, whatever the CPU
    for w in (torch.randn(8), torch.randn(2, 3, 4), torch.randn(4, 3, dtype=torch.float64)):
        assert decode_weight(w) is w


@needs_mkl_packing
@pytest.mark.parametrize("bias", [True, False])
def test_mkl_packed_products_equal_f_linear_at_any_rows(bias):
    """Packed once for the decode loop's rows, the product takes any number: fewer as rows
    finish, the prefill's prompts x positions, inputs with a leading batch dimension."""
    torch.manual_seed(0)
    w = torch.randn(96, 48, requires_grad=True)
    b = torch.randn(96) if bias else None
    packed = mkl_packed.Packed(w)
    for rows in [1, 3, 15, mkl_packed.PACK_ROWS, 17, 48, 300]:
        x = torch.randn(rows, 48)
        torch.testing.assert_close(mkl_packed.linear(x, packed, b),
                                   F.linear(x, w.detach(), b), atol=1e-5, rtol=1e-5)
    x = torch.randn(4, 12, 96)[..., ::2]  # [4, 12, 48], not contiguous
    out = decode_linear(x, packed, b)
    assert out.shape == (4, 12, 96)
    torch.testing.assert_close(out, F.linear(x, w.detach(), b), atol=1e-5, rtol=1e-5)
    with torch.inference_mode():  # as the decode loop calls it
        torch.testing.assert_close(decode_linear(x, packed, b), out, atol=0, rtol=0)


@pytest.mark.parametrize("rule", ["wide", "intel", "amd"])
def test_decode_products_follow_the_cpu_rule(monkeypatch, decode_rule, rule):
    decode_rule(rule)
    on_onednn = rule == "wide"
    torch.manual_seed(0)
    x, w, b = torch.randn(16, 48), torch.randn(96, 48), torch.randn(96)
    weight = decode_weight(w)
    # small: packed for oneDNN only where every product is oneDNN's; for MKL on Intel CPUs
    assert isinstance(weight, mkl_packed.Packed) == (rule == "intel")
    assert rule == "intel" or weight.is_mkldnn == on_onednn
    calls = []
    original = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(1) or original(*a))
    out = decode_linear(x, weight, b)
    assert len(calls) == int(on_onednn)
    if rule == "amd":  # the BLAS F.linear itself, bit for bit
        assert torch.equal(out, F.linear(x, w, b))
    else:  # another kernel or operand layout: the same product, summed in another order
        torch.testing.assert_close(out, F.linear(x, w, b), atol=1e-5, rtol=1e-5)
    decode_linear(x, w, b)  # an unpacked weight (the output head's) takes the same kernel
    assert len(calls) == 2 * int(on_onednn)


@pytest.mark.parametrize("rule", ["intel", "wide", "amd"])
@pytest.mark.parametrize("out", [600, 100])  # packed for oneDNN on AMD from 2^17 weights
def test_decode_products_compute_what_decode_linear_does(decode_rule, rule, out):
    """The decode step's bound products on every CPU's kernels: x -> x w^T + b, and
    (acc, x) -> acc + x w^T + b."""
    if rule != "intel" and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    decode_rule(rule)
    torch.manual_seed(0)
    w, b = torch.randn(out, 256), torch.randn(out)
    x, acc = torch.randn(16, 256), torch.randn(16, out)
    weight = decode_weight(w)
    want = decode_linear(x, weight, b)
    torch.testing.assert_close(want, F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    assert torch.equal(cpu_linear.decode_product(weight, b, 16)(x), want)
    assert torch.equal(cpu_linear.decode_add_product(weight, b)(acc.clone(), x), acc + want)

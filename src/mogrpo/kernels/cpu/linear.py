"""float32 linear layers on CPUs: each product on the faster of MKL (the BLAS `torch.matmul`
uses) and oneDNN (which the same PyTorch builds ship), by CPU and shape.

PyTorch's CPU builds compute a float32 `F.linear` with MKL's sgemm. On CPUs MKL does not
recognise as Intel's (AMD EPYC, for one), sgemm runs its AVX2 code, while oneDNN uses AVX-512.
How much that buys depends on how wide the CPU computes AVX-512; on Intel CPUs MKL runs its own
AVX-512 code and is the faster of the two for training products:

| 1 core, float32 | [720, 256] x [256, 1920] | a decode step's [16, in] x [in, out] |
|---|---|---|
| EPYC Zen 5 (full-width AVX-512) | MKL 7.3 ms, oneDNN 3.5 ms | oneDNN packed faster (not 128²) |
| EPYC Zen 4 (AVX-512 in two halves) | MKL 6.9 ms, oneDNN 6.6 ms | see below |
| Xeon Cascade Lake (family 6 model 85) | MKL 6.1 ms, oneDNN 7.0 ms | see below |

So the training products (hundreds of rows) run on oneDNN where the CPU has AVX-512 and MKL does
not run its own code (`training_on_onednn`) — at worst ~4 % faster than MKL, at best twice as
fast — on MKL on CPUs without AVX-512 (AMD Zen 3 and older: both then run AVX2 code, and MKL's
update of the vs_trl 8 M-parameter model took 10-20 % less time), and on MKL on Intel CPUs (the Xeon's forward and backward of the vs_trl 8 M-parameter model: 510 ms against
oneDNN's 610; 0.7 M: 65 against 83). A decode step's products (one row per sequence) are a
matter of fixed cost per call against throughput. On Zen 4 at 16 rows, oneDNN on packed weights
is 1.1-1.6x faster than MKL from 256 inputs and in x out = 2^17 up (256 x 512 1.08x, 256 x 768
1.16x, 960 x 256 1.14x, 512 x 3840 1.64x; a whole decode step of the vs_trl 32 M-parameter
model 17 ms instead of 30) and slower below (640 x 128 0.90x, 128 x 384 0.75x, 128 x 128
0.44x; 128 x 1280, 1.11x alone, costs time inside a decode step). Decode weights are therefore
packed for oneDNN where AVX-512 is full width (`wide_avx512`: AMD from Zen 5 on) and elsewhere
from those sizes on; the rest run on MKL. On Intel CPUs (`decode_on_mkl`) every decode weight is
packed for MKL's own packed product instead (`mkl_packed`, `cblas_sgemm_pack`). MKL's sgemm
copies its weight operand into that layout at every call; a packed weight is read once per
product, in the order the kernel consumes it. Xeon, the vs_trl models' native rollout against
the other CPUs' rule (oneDNN-packed from those sizes, plain below; `benchmarks/cpu_choices.py`):
1.10x at 0.7 M parameters, 1.20x at 8 M, 1.07x at 32 M; against the column-major layout it
replaced, the 0.7 M rollout (weights in cache) is unchanged. At training rows (hundreds) the
copy is a small share and the weights change at every step, so the training products stay on
the plain kernels.

The rule is fixed per CPU model and shape rather than timed at start: a timed choice could
differ between two runs of the same seed on the same machine, and the kernels differ in float
rounding. It is the same float32 product either way (IEEE, no reduced precision); only the
summation order differs (~1e-6 relative).

`linear(x, w, b)` is the training products' kernel without autograd (the KL reference's
forward); `decode_weight` and `decode_linear` are the decode loop's (weights packed once per
rollout; on MKL, into buffers kept between rollouts for small models, see `mkl_packed`),
`decode_add_kernel` its products that add into the residual stream, and `decode_product` /
`decode_add_product` the same bound to one weight for the decode step (on MKL into an output
buffer reused step after step: `mkl_packed.Product`); `cpu_linears()` is a
context in which every `nn.Linear` of a model — its own, peft's base layers, the output
head — runs on the training products' kernel,
with a backward whose three products (input, weight and bias gradients) run on it too, and
peft's LoRA layers fused around them. All fall back to `F.linear` off CPUs, for other dtypes,
under autocast (mixed precision), and where the build has no oneDNN.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mogrpo.algo.products import Products
from mogrpo.kernels.cpu import mkl_packed
from mogrpo.kernels.cpu.mkl_packed import Packed


@functools.cache
def available() -> bool:
    """Whether this build runs oneDNN's float32 linear, and it agrees with F.linear."""
    try:
        op = torch.ops.mkldnn._linear_pointwise
        # fixed values, not random ones: drawing here would shift the run's RNG stream at
        # the first call, which a resumed run makes at a different point than an unbroken one
        x = torch.linspace(-1, 1, 24).reshape(3, 8)
        w, b = torch.linspace(-2, 2, 40).reshape(5, 8), torch.linspace(0, 1, 5)
        return bool(torch.allclose(op(x, w, b, "none", [], ""), F.linear(x, w, b), atol=1e-5))
    except (AttributeError, RuntimeError):
        return False


def mkl_native(cpuinfo: str | None = None) -> bool:
    """Whether MKL runs its own fastest code on this CPU: an Intel CPU (MKL picks its code paths
    by vendor). `cpuinfo` as for `wide_avx512`."""
    return _first_cpu(_cpuinfo() if cpuinfo is None else cpuinfo).get("vendor_id") == \
        "GenuineIntel"


@functools.cache
def training_on_onednn() -> bool:
    """Whether the training products (`linear`, `cpu_linears`) run on oneDNN here: where it is
    available and `onednn_trains_faster` says so for this CPU."""
    return available() and onednn_trains_faster()


def onednn_trains_faster(cpuinfo: str | None = None) -> bool:
    """Whether oneDNN outruns MKL at training products on this CPU: one with AVX-512F that MKL
    does not run its own code on (`mkl_native`: Intel's). oneDNN's gain is its AVX-512 code
    against MKL's AVX2 (the module docstring); on a CPU without AVX-512 both run AVX2 and MKL was
    the faster: the vs_trl 8 M-parameter model's update on an AMD EPYC of family 25 model 1
    (Zen 3), alternated, 376-396 ms against oneDNN's 428-491 with 2 threads and 545-581 against
    606-666 with 1 (`benchmarks/profile_step.py --size medium --threads N`). `cpuinfo` as for
    `wide_avx512`."""
    text = _cpuinfo() if cpuinfo is None else cpuinfo
    return not mkl_native(text) and "avx512f" in _first_cpu(text).get("flags", "").split()


def kernels() -> dict[str, str]:
    """Which library computes this CPU's float32 products, for `mogrpo doctor env`: the
    training products' and the decode loop's."""
    if not available():
        return {"training": "MKL (this torch has no oneDNN)", "decode": "MKL"}
    training = ("oneDNN" if training_on_onednn()
                else "MKL (an Intel CPU: MKL runs its own AVX-512 code)" if mkl_native()
                else "MKL (no AVX-512: oneDNN's gain over MKL's AVX2 code)")
    if decode_on_mkl():
        decode = "MKL on packed weights"
    elif decode_on_onednn():
        decode = "oneDNN (full-width AVX-512)"
    else:
        decode = (f"oneDNN from {DECODE_PACK_MIN_IN} inputs and "
                  f"2^{DECODE_PACK_MIN.bit_length() - 1} weights, MKL below")
    return {"training": training, "decode": decode}


def wide_avx512(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes AVX-512 at full width where MKL would not use it: an AMD CPU
    of family 0x1A (Zen 5) or later with AVX-512F. `cpuinfo` is /proc/cpuinfo's text (read
    when not given; False where there is none)."""
    fields = _first_cpu(_cpuinfo() if cpuinfo is None else cpuinfo)
    try:
        family = int(fields.get("cpu family", ""))
    except ValueError:
        return False
    return fields.get("vendor_id") == "AuthenticAMD" and family >= 0x1A and \
        "avx512f" in fields.get("flags", "").split()


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU as benchmark reports name it: model name, vendor, family and model numbers
    (virtual machines often show a bare "AMD EPYC"; the family tells Zen 4 from Zen 5), and
    which kernels that means here."""
    fields = _first_cpu(_cpuinfo() if cpuinfo is None else cpuinfo)
    if not fields:
        return "unknown CPU"
    vendor = {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(fields.get("vendor_id", ""),
                                                                 fields.get("vendor_id", "?"))
    if mkl_native(cpuinfo):
        kernels = "training products on MKL"
    else:
        kernels = f"{'full-width' if wide_avx512(cpuinfo) else 'no full-width'} AVX-512 for oneDNN"
    return (f"{fields.get('model name', '?')} ({vendor} family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {kernels})")


def machine_line() -> str:
    """The machine as benchmark reports open with it: architecture, `cpu_name`, the cores this
    process sees and the Python version."""
    import os
    import platform

    return (f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}")


def _first_cpu(cpuinfo: str) -> dict[str, str]:
    """The first processor block of /proc/cpuinfo's text as fields (it speaks for all)."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break
            continue
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


@functools.cache
def _cpuinfo() -> str:
    if not sys.platform.startswith("linux"):
        return ""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def usable(x: Tensor, w: Tensor) -> bool:
    """The CPU kernels apply: CPU float32 operands, an input of at least 2 dimensions, and no
    CPU autocast (mixed precision: the product is then F.linear's in autocast's dtype, as in
    the model's own forward; these kernels would compute it in float32)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.dim() >= 2 and w.dim() == 2 and not torch.is_autocast_enabled("cpu"))


def pack(w: Tensor) -> Tensor:
    """w [out, in] reordered once into oneDNN's blocked layout, for many `linear` calls (it then
    skips the reorder each call does: at decode shapes that is half its time); w itself where
    oneDNN does not apply. A copy: pack again after the weights change."""
    if w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and available():
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    return w


def linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` (x [..., in], w [out, in], plain or `pack`ed), on oneDNN for a packed
    w and where it applies to a plain one on `training_on_onednn` CPUs; no autograd."""
    if training_on_onednn():
        return _onednn_linear(x, w, b)
    return _onednn_op(x, w, b) if w.is_mkldnn else F.linear(x, w, b)


def _onednn_linear(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """`F.linear` on oneDNN where it applies (or w is packed), else `F.linear` itself."""
    if w.is_mkldnn or usable(x, w):
        return _onednn_op(x, w, b)
    return F.linear(x, w, b)


# inputs and in x out from which oneDNN's packed product outruns MKL's at decode rows (Zen 4)
DECODE_PACK_MIN_IN, DECODE_PACK_MIN = 256, 2**17


@functools.cache
def decode_on_onednn() -> bool:
    """Whether every product of the decode loop runs on oneDNN here (`wide_avx512` CPUs)."""
    return available() and wide_avx512()


def decode_weight(w: Tensor, keep: bool = False) -> Tensor | Packed:
    """w [out, in] as `decode_linear` takes it: `mkl_packed.Packed` where MKL computes the
    decode products (`decode_on_mkl`: Intel CPUs; `keep`: its buffer is kept for the next pack,
    see `mkl_packed`); else `pack`ed for oneDNN where oneDNN computes them (every weight on
    `decode_on_onednn` CPUs, elsewhere the large ones: see the module docstring); else w
    itself. w itself also off CPUs and for other dtypes."""
    if w.dim() != 2 or w.device.type != "cpu" or w.dtype != torch.float32:
        return w
    if decode_on_mkl():
        return Packed(w, keep)
    if decode_on_onednn() or (w.shape[1] >= DECODE_PACK_MIN_IN and w.numel() >= DECODE_PACK_MIN):
        return pack(w)
    return w


@functools.cache
def decode_on_mkl() -> bool:
    """Whether the decode loop's products run on MKL's packed product (`mkl_packed`) here: on
    CPUs where MKL runs its own code (`mkl_native`), where this build exports that product."""
    return mkl_native() and mkl_packed.works()


def decode_linear(x: Tensor, w: Tensor | Packed, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` in the decode loop (w plain or a `decode_weight`): on MKL's packed
    product for a `Packed` w, on oneDNN for a `pack`ed one and for any w where
    `decode_on_onednn`; else on the BLAS."""
    return decode_kernel(w)(x, w, b)


def decode_kernel(w: Tensor | Packed) -> Callable[..., Tensor]:
    """The function `decode_linear` computes with for weights like `w`, to look up once per
    weight rather than per call (a decode step of a small model is mostly call overhead)."""
    if isinstance(w, Packed):
        return mkl_packed.linear
    if w.is_mkldnn:
        return _onednn_op
    return _onednn_linear if decode_on_onednn() else F.linear


def decode_add_kernel(w: Tensor | Packed) -> Callable[..., Tensor]:
    """A function (acc, x, w, b) -> acc + `decode_linear(x, w, b)` for weights like `w`: on
    MKL's packed product, the sum is written into acc by the product itself (`acc` must then
    be a tensor nothing else reads: the decode step's residual stream)."""
    if isinstance(w, Packed):
        return mkl_packed.linear_add
    kernel = decode_kernel(w)
    return lambda acc, x, w, b=None: acc + kernel(x, w, b)


def decode_product(w: Tensor | Packed, b: Tensor | None, rows: int) -> Callable[[Tensor], Tensor]:
    """x [at most `rows`, in] -> `decode_linear(x, w, b)`, as one callable for a loop that calls
    it once per step and is done with each result before the next call: on MKL's packed product
    (`mkl_packed.Product`) every result is the same buffer, overwritten by the next call."""
    if isinstance(w, Packed):
        return mkl_packed.Product(w, b, rows)
    kernel = decode_kernel(w)
    return lambda x: kernel(x, w, b)


def decode_add_product(w: Tensor | Packed, b: Tensor | None) -> Callable[[Tensor, Tensor], Tensor]:
    """(acc, x) -> `decode_add_kernel(w)(acc, x, w, b)` as one callable."""
    kernel = decode_add_kernel(w)
    return lambda acc, x: kernel(acc, x, w, b)


def _onednn_op(x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:
    """x [..., in] times w^T (packed or plain [out, in]) plus b, on oneDNN."""
    return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")


class _Linear(torch.autograd.Function):
    """y = x w^T + b with every product of the forward and the backward on oneDNN."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, b: Tensor | None) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        ctx.has_bias = b is not None
        return _onednn_op(x, w, b)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = product(grad, w.t())  # [..., in]
        flat = grad.reshape(-1, grad.shape[-1])  # [N, out]
        if ctx.needs_input_grad[1]:
            grad_w = weight_product(flat, x.reshape(-1, x.shape[-1]))  # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = flat.sum(0)
        return grad_x, grad_w, grad_b


def linear_add(h: Tensor, w: Tensor, base: Tensor) -> Tensor:
    """base + h w^T (h [..., in], w [out, in], base [..., out], a fresh tensor) in one pass:
    oneDNN's "add" post-op on `training_on_onednn` CPUs, else one in-place addmm into base."""
    if training_on_onednn():
        return torch.ops.mkldnn._linear_pointwise.binary(h, base, w, None, "add")
    flat = base.view(-1, base.shape[-1])
    return flat.addmm_(h.reshape(-1, h.shape[-1]), w.t()).view(base.shape)


def product(a: Tensor, b: Tensor) -> Tensor:
    """a [..., k] @ b^T for b [n, k], on the training products' kernel. For oneDNN each operand
    is made either contiguous or the transpose of a contiguous tensor first: it takes a generic
    path for other strides (the weight gradient of a one-position slice of [B, T, H] — the last
    prompt position's logit — ran ~250x slower than on a copy)."""
    if not training_on_onednn():
        return torch.matmul(a, b.t())
    a = a if _plain_strides(a) else a.contiguous()
    b = b if _plain_strides(b) else b.contiguous()
    return _onednn_op(a, b, None)


def weight_product(grad: Tensor, x: Tensor) -> Tensor:
    """grad^T x for grad [N, out] and x [N, in] (a weight gradient [out, in]), on the training
    products' kernel (MKL reads a transposed operand as it is).

    oneDNN copies a transposed input but reorders its weight operand anyway, so the narrower of
    the two is the one transposed: at [N, 640] x [N, 128] computing (x^T grad)^T copies a fifth
    of what grad^T x copies (the gate and up projections' weight gradients: -30 %)."""
    if not training_on_onednn():
        return grad.t() @ x
    if grad.shape[1] <= x.shape[1]:
        return product(grad.t(), x.t())
    return product(x.t(), grad.t()).t().contiguous()


def _plain_strides(t: Tensor) -> bool:
    return t.is_contiguous() or (t.dim() == 2 and t.t().is_contiguous())


class CPULinear(nn.Linear):
    """An `nn.Linear` inside `cpu_linears`: its forward is `_Linear` where the training products
    run on oneDNN, else `F.linear` (and its mark lets peft's layers around it fuse: see
    `mogrpo.kernels.cpu.lora_linear`)."""

    def forward(self, x: Tensor) -> Tensor:
        return trained_linear(x, self.weight, self.bias)


def trained_linear(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` with autograd, forward and backward on the training products'
    kernel: `_Linear` where they run on oneDNN, else `F.linear` itself (what a `CPULinear`
    computes; `linear` is the same forward without autograd)."""
    if training_on_onednn() and usable(x, w):
        return _Linear.apply(x, w, b)
    return F.linear(x, w, b)


def _recomputes(model: nn.Module) -> bool:
    """Whether some module of `model` has Hugging Face's gradient checkpointing on."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


@contextmanager
def cpu_linears(model: nn.Module) -> Iterator[None]:
    """A context in which every `nn.Linear` of `model` — the model's own, peft's base layers,
    the output head — computes on the training products' kernel, forward and backward: oneDNN
    on `training_on_onednn` CPUs, else torch's own (MKL), with peft's LoRA layers fused around
    them either way (`mogrpo.kernels.cpu.lora_linear`).

    The layers are made `CPULinear` for the context and plain `nn.Linear` again after it:
    only the linears pay for the switch (a mode intercepting every torch call of the forward
    cost a LoRA forward ~10 %). Off for models that are not on a CPU in float32, for
    torch.compile'd ones (the compiler picks its own kernels), and for models that recompute
    activations in the backward (gradient checkpointing): the recomputation runs after this
    context has closed, so it would compute on other layers than the forward did — a
    different arithmetic, and for fused LoRA layers a different set of saved tensors, which
    torch.utils.checkpoint refuses."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cpu" or param.dtype != torch.float32 \
            or hasattr(model, "_orig_mod") or _recomputes(model):
        yield
        return
    layers = [m for m in model.modules() if type(m) is nn.Linear]
    for layer in layers:
        layer.__class__ = CPULinear
    try:
        yield
    finally:
        for layer in layers:
            layer.__class__ = nn.Linear


def times(a: Tensor, b: Tensor) -> Tensor:
    """a @ b, on the training products' kernel for CPU float32 operands."""
    return product(a, b.t()) if usable(a, b) else a @ b


def times_t(a: Tensor, b: Tensor) -> Tensor:
    """a^T @ b, on the training products' kernel for CPU float32 operands."""
    return weight_product(a, b) if usable(a, b) else a.t() @ b


PRODUCTS = Products(linear=linear, times=times, times_t=times_t, model_linears=cpu_linears,
                    linear_types=(CPULinear,))
"""The training products as the math takes them (`mogrpo.algo.products`): the rules above for
CPU float32 tensors, PyTorch's own operators for anything else."""

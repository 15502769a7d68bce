"""The native engine's decode step compiled for CPUs (`decode_step.cpp`): every decoder layer
of a step, the final norm and the head in one call, where the Python step
(`NativeDecoder._step_pairs`) launches ~25 small operations a layer.

On a CPU a decode step of a small model is mostly launch cost: at the vs_trl benchmark's
0.7 M-parameter model the layers' operations other than the four products took 0.73 ms of a
1.20 ms step, and 6.5 of 31 ms at 32 M (`benchmarks/decode_breakdown.py`). The compiled step
runs them as plain loops over buffers it holds for the whole decode, around the same products
(MKL's packed product on Intel CPUs, oneDNN's packed weights or ATen's linear elsewhere). Its
sums (norms, attention scores, softmax) run in another order than PyTorch's kernels: results
agree to float32 rounding, not to the bit.

Built with PyTorch's extension builder on first use (~30 s, with a C++ compiler; the build is
cached per machine, mogrpo and torch version) and used for float32 models with RMSNorms and
SiLU or tanh-GELU MLPs whose q and k the Python step rotates as complex pairs: Llama, Mistral,
Qwen2, Qwen3 (its per-head q/k norms too), Gemma and Phi-3. Without a compiler, or with
MOGRPO_DECODE_KERNEL=0, the Python step runs (one log line says why).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mogrpo.kernels.cpu import mkl_packed
from mogrpo.kernels.cpu.mkl_packed import Packed

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.cpp")
ENV = "MOGRPO_DECODE_KERNEL"  # "0", "off", "false" or "no": never build or use it
# the activations the compiled step computes (decode_step.cpp's kSiLU, kGeluTanh)
ACTIVATIONS = {"silu": 0, "gelu_tanh": 1}
# a layer's attention of at least this many multiply-adds (rows x heads x columns x head dim)
# runs as ATen's batched products when torch has several threads (they run in parallel; the
# compiled loops on one thread)
PARALLEL_ATTENTION = 2**20
STALE_LOCK_SECONDS = 600  # a build takes well under this; an older lock is a killed build's
FAILED = "failed.txt"  # in a build's folder: why it failed (later processes do not retry)

# compiler flags per the vector instructions torch found on this CPU
_FLAGS = {
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512vl", "-mavx512dq", "-mavx512bw"],
    "AVX2": ["-mavx2", "-mfma"],
}


def disabled() -> bool:
    """Whether MOGRPO_DECODE_KERNEL switches the compiled step off."""
    return os.environ.get(ENV, "").strip().lower() in ("0", "off", "false", "no")


def status() -> str:
    """Which decode step a CPU rollout runs here, for `mogrpo doctor env`; builds nothing."""
    if disabled():
        return f"Python ({ENV}={os.environ[ENV]})"
    name = build_name()
    directory = cache_directory() / name
    blocked = _blocked(directory, directory / f"{name}.so", "the compiled step")
    if blocked is not None:
        return f"Python ({blocked})"
    if (directory / f"{name}.so").exists():
        return "compiled (built for this mogrpo, torch and CPU)"
    return "compiled (built at the first CPU decode, ~30 s, once)"


def _blocked(directory: Path, built: Path, what: str = "it") -> str | None:
    """Why the build in `directory` cannot be used or tried here — it failed before, or there is
    no build and no compiler to make it — or None."""
    failed = directory / FAILED
    if failed.exists():
        return f"{failed.read_text().strip()}; delete {directory} to build it again"
    compiler = os.environ.get("CXX", "c++")
    if not built.exists() and shutil.which(compiler) is None:
        return f"no C++ compiler '{compiler}' to build {what}: install g++ or set CXX"
    return None


def cache_directory() -> Path:
    """Where the builds are kept: $MOGRPO_KERNEL_CACHE, else mogrpo/kernels under the user's
    cache directory ($XDG_CACHE_HOME or ~/.cache), one folder per Python and torch version."""
    root = os.environ.get("MOGRPO_KERNEL_CACHE") or Path(
        os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mogrpo" / "kernels"
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    return Path(root) / version


def build_name() -> str:
    """The extension's name: it carries the source's digest and the CPU's instruction set, so a
    build of another version or for another CPU is never loaded."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return f"mogrpo_decode_step_{torch.backends.cpu.get_cpu_capability().lower()}_{digest}"


@functools.cache
def module():
    """The compiled extension, built on first call, or None where it cannot be used here (see
    the module docstring): switched off, no C++ compiler, or the build
    failed (one warning with the reason; a failed build is not tried again by later processes
    until its folder in `cache_directory()` is deleted)."""
    if disabled():
        return None
    name = build_name()
    directory = cache_directory() / name
    built, lock = directory / f"{name}.so", directory / "lock"
    blocked = _blocked(directory, built)
    if blocked is not None:
        _unavailable(blocked)
        return None
    try:
        if built.exists() and not lock.exists():  # built: imported without the builder's lock
            return _import(name, built)
        return _build(name, directory)
    except Exception as error:  # no headers, a failed build: the Python step runs
        reason = _reason(error)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / FAILED).write_text(f"the build failed: {reason}\n")
        except OSError:
            pass
        _unavailable(f"the build failed: {reason}")
        return None


def _unavailable(reason: str) -> None:
    logger.warning("native decode: the compiled CPU step is not available (%s); the Python step "
                   "runs instead (%s=0 skips the attempt)", reason, ENV)


def _reason(error: Exception) -> str:
    """The line of a failed build that says why: the compiler's first error, else the last
    line of the message."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return (errors or lines or [type(error).__name__])[0 if errors else -1]


def _import(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def _build(name: str, directory: Path):
    from torch.utils.cpp_extension import load

    directory.mkdir(parents=True, exist_ok=True)
    lock = directory / "lock"  # the builder's; one left by a killed build would stall it
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_SECONDS:
        lock.unlink(missing_ok=True)
    capability = torch.backends.cpu.get_cpu_capability()
    logger.info("building the native engine's compiled CPU decode step (once per machine and "
                "mogrpo version, ~30 s)")
    return load(name=name, sources=[str(SOURCE)], build_directory=str(directory),
                extra_cflags=["-O3", "-fopenmp-simd", *_FLAGS.get(capability, [])],
                verbose=False)


class DecoderWeights(Protocol):
    """What `decoder_stack` reads of an engine's decoder (the native engine's `NativeDecoder`):
    per layer its fused products and norms (`plain`), attention shapes and per-head q/k norms;
    the final norm and the head."""

    plain: list[Any] | None
    attention: list[Any]
    head_norms: list[Any]
    final_norm: tuple[Tensor, float] | None
    head_weight: Tensor | Packed | None
    head: nn.Module


def decoder_stack(decoder: DecoderWeights, rows: int) -> tuple[object | None, bool]:
    """(The compiled step of a decoder's layers for at most `rows` rows, whether it
    computes the logits too), or (None, False) where it cannot run the layers: no compiled
    module here, or a layer whose norms are not RMSNorms, whose activation is neither SiLU nor
    tanh-GELU (`_activation`) or whose products are not float32 weights (MKL or oneDNN packed, or plain). The logits too where
    the final norm is an RMSNorm and the head such a weight (`projections._head_weight`)."""
    kernel = module()
    if kernel is None or decoder.plain is None:
        return None, False
    head_dim = decoder.attention[0].head_dim
    if any(a.head_dim != head_dim or a.heads % a.kv_heads for a in decoder.attention):
        return None, False
    layers = []  # per layer: its products' weights as the stack takes them, its activation
    for p in decoder.plain:
        products = [(_compiled_weight(w), b) for w, b in (p.qkv, p.out, p.gate_up, p.down)]
        activation = _activation(p.act)
        if p.norms is None or activation is None or any(w is None for w, _ in products):
            return None, False
        layers.append((products, activation))
    head = None  # the head's weight as the stack takes it, where it computes the logits
    if decoder.final_norm is not None and decoder.head_weight is not None:
        head = _compiled_weight(decoder.head_weight)
    # MKL's compute function where some product is MKL-packed (its weight an address)
    packed = any(isinstance(w, int)
                 for w in [head, *(w for products, _ in layers for w, _ in products)])
    stack = kernel.Stack(mkl_packed.compute_address() if packed else 0, rows,
                         decoder.plain[0].qkv[0].shape[1], head_dim, PARALLEL_ATTENTION)
    for p, a, (products, activation), head_norms in zip(decoder.plain, decoder.attention, layers,
                                                        decoder.head_norms, strict=True):
        (first, eps1), (second, eps2) = p.norms
        (qkv, qkv_b), (out, out_b), (gate_up, gate_up_b), (down, down_b) = products
        # Qwen3's per-head q and k norms, their weights in the order of the pairs' rows
        (q_norm, q_eps), (k_norm, k_eps) = head_norms.paired if head_norms else ((None, 0.0),) * 2
        stack.add_layer(first.detach(), eps1, second.detach(), eps2,
                        qkv, p.qkv[0].shape[0], _detached(qkv_b), out, _detached(out_b),
                        gate_up, p.gate_up[0].shape[0], _detached(gate_up_b),
                        down, p.down[0].shape[1], _detached(down_b),
                        a.heads, a.kv_heads, a.scaling, activation, q_norm, q_eps, k_norm, k_eps)
    if head is None:
        return stack, False
    weight, eps = decoder.final_norm
    stack.set_head(weight.detach(), eps, head, decoder.head_weight.shape[0],
                   _detached(decoder.head.bias))
    return stack, True


def _compiled_weight(w: Tensor | Packed) -> int | Tensor | None:
    """A product's weight as the compiled step takes it: an MKL pack's address, or a float32 CPU
    tensor [out, in] (oneDNN's packed layout or plain); None for anything else."""
    if isinstance(w, Packed):
        return w.address
    if isinstance(w, Tensor) and w.dtype == torch.float32 and w.dim() == 2 and \
            w.device.type == "cpu":
        return w.detach()
    return None


def _activation(act: Callable) -> int | None:
    """A layer's activation as the compiled step names it (`ACTIVATIONS`): SiLU (torch's module
    or function, transformers'), or GELU in its tanh approximation (Gemma's: transformers'
    `GELUTanh` on torch's function, or torch's module); None for any other."""
    transformers = type(act).__module__.startswith("transformers")
    if act is F.silu or type(act) is nn.SiLU or (
            transformers and type(act).__name__ == "SiLUActivation"):
        return ACTIVATIONS["silu"]
    inner = getattr(act, "act", None) if transformers and type(act).__name__ == "GELUTanh" \
        else None
    if (type(act) is nn.GELU and act.approximate == "tanh") or (
            isinstance(inner, functools.partial) and inner.func is F.gelu
            and inner.keywords == {"approximate": "tanh"} and not inner.args):
        return ACTIVATIONS["gelu_tanh"]
    return None


def _detached(bias: Tensor | None) -> Tensor | None:
    return None if bias is None else bias.detach()

"""MKL's packed float32 product, called directly: a weight packed once into MKL's own layout
(`cblas_sgemm_pack`) in a buffer mogrpo provides, then many products with it
(`cblas_sgemm_compute`). `cpu_linear` uses it for the decode loop on Intel CPUs.

MKL's sgemm otherwise copies its weight operand into that layout at every call; packed once,
a decode step's product reads each weight once, in the order its kernel takes it. PyTorch's CPU
wheels link MKL into `libtorch_cpu` and export its CBLAS functions; they are found there with
`ctypes` (`cblas`: None where they are not, and nothing here is used then). The products are
the same to the bit as PyTorch's own wrapper of them (`torch.ops.mkl._mkl_linear`), which
allocates its buffer itself. Providing the buffer buys two things:

- **Buffers kept between rollouts.** The weights change at every optimizer step, so they are
  packed anew for every rollout. Into memory the process does not hold, every page written
  costs a page fault, zero-filled by the kernel (on the Xeon VM the benchmarks ran on, ~0.4 ms
  per MB, more than the packing itself: the 32 M model's 122 MB of packs took 33 ms into
  buffers already held, 43-102 ms into fresh ones). Where a model's decode weights take at most
  KEEP_MAX_BYTES, each pack's buffer is kept for the next rollout's pack of that size
  (`Packed(keep=True)`, `POOL`): the vs_trl 8 M-parameter model's rollout is 1.04x faster
  (8 alternated pairs in one process), and its full fine-tuning run's peak RSS 28 MiB higher
  (805-809 MiB against 775-781, two runs each; TRL's 904-922): the pages MKL writes, ~1x
  the weights, stay resident through the update. A larger model's packs take blocks for one
  rollout (`_Block`), as PyTorch's wrapper does: kept, the 32 M model's would add ~150 MiB to
  its run's peak, above TRL's.
- **Accumulating products.** `linear_add(acc, x, w)` adds x w^T into acc in the product
  itself (sgemm's beta = 1), where the decode step adds a projection to the residual stream:
  one operation fewer, the same sum to the bit.
- **Outputs in buffers of their own.** A `Product` writes every result into one buffer, which
  the next call overwrites: the decode step's q/k/v and gate/up projections allocate nothing,
  and their outputs land in memory the cache holds.

MKL asks for buffers several times the weight (`cblas_sgemm_pack_get_size`: 8.8 MiB for a
512 x 512 weight on the Xeon, 5.6 MiB for any weight up to 512 x 512 on an AMD EPYC) and writes
~1x the weight (on the EPYC ~1.25x plus ~150 KiB), in panels with unwritten gaps between them.
The kept buffers are mappings of their own in small pages, whose unwritten pages never become
resident, whatever the kernel's transparent-huge-page setting.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import threading
import weakref
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import Tensor

from mogrpo.kernels.cpu.malloc import mapped

# CBLAS's enumerations (mkl_cblas.h)
_ROW_MAJOR, _NO_TRANS, _TRANS, _PACKED, _B_MATRIX = 101, 111, 112, 151, 162
_ALIGN = 64  # bytes: the alignment MKL asks of its buffers

# the rows MKL is told to expect when it packs a weight; the product then takes any number (the
# packed layout's size does not depend on it). 256 rather than a decode step's 16: the same
# speed at 16 rows, and up to 1.4x faster at a prefill's (Xeon, 80 rows of 512 x 3840: 4.5 ms
# against 6.4); no faster above 256
PACK_ROWS = 256

# decode weights (float32 bytes, all of a model's together) whose packed buffers are kept
# between rollouts: see the module docstring. The vs_trl 8 M-parameter model's (31 MiB) are
# kept; the 32 M model's (123 MiB) are not
KEEP_MAX_BYTES = 64 * 2**20


@functools.cache
def cblas() -> SimpleNamespace | None:
    """MKL's pack and packed-product functions, from the library PyTorch linked MKL into; None
    where it does not export them (a build without MKL, another platform)."""
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        get_size, pack, compute = (lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack,
                                   lib.cblas_sgemm_compute)
    except (OSError, AttributeError):
        return None
    i, p, f = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    get_size.argtypes, get_size.restype = [i, i, i, i], ctypes.c_size_t
    pack.argtypes, pack.restype = [i, i, i, i, i, i, f, p, i, p], None
    compute.argtypes, compute.restype = [i, i, i, i, i, i, p, i, p, i, f, p, i], None
    return SimpleNamespace(get_size=get_size, pack=pack, compute=compute)


def compute_address() -> int:
    """The address of MKL's `cblas_sgemm_compute`, for compiled code that calls it directly
    (`mogrpo.kernels.cpu.decode_step`)."""
    functions = cblas()
    if functions is None:
        raise RuntimeError("this PyTorch build exports no MKL packed product")
    return ctypes.cast(functions.compute, ctypes.c_void_p).value


class _Mapping:
    """A kept buffer: an anonymous private mapping of `nbytes` (its own: a heap block would be
    reused by other tensors when the pool lets it go), in small pages only. Where the kernel
    backs anonymous memory with transparent huge pages (`always`), the first write into a
    2 MiB stretch would make all of it resident: MKL's few written panels would then cost
    2 MiB each (a 64 x 64 weight's pack, 16 KiB of weights: 2052 KiB resident against 164 with
    small pages, AMD EPYC)."""

    __slots__ = ("address", "nbytes", "_map", "_view")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):  # (Linux only; elsewhere no huge pages by default)
            self._map.madvise(mmap.MADV_NOHUGEPAGE)
        self._view = ctypes.c_char.from_buffer(self._map)
        self.address = ctypes.addressof(self._view)

    def close(self) -> None:
        """Unmap it now (it must not be used after)."""
        self._view = None
        self._map.close()


class _Block:
    """A buffer for one rollout: a block from malloc, taken where it fits among the free heap
    memory a process keeps (`train.host_memory`: those pages are in memory already), else
    mapped on its own (`mogrpo.kernels.cpu.malloc.mapped`: never from heap grown for it, where the
    pages MKL does not write would become resident once other tensors reuse them)."""

    __slots__ = ("address", "nbytes", "_tensor")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        with mapped():
            self._tensor: Tensor | None = torch.empty(nbytes + _ALIGN, dtype=torch.uint8)
        self.address = self._tensor.data_ptr() + -self._tensor.data_ptr() % _ALIGN

    def close(self) -> None:
        self._tensor = None


class _Pool:
    """Buffers of packs that were released with `keep`, by size, for the next packs."""

    def __init__(self) -> None:
        self._free: dict[int, list[_Mapping]] = {}
        self._lock = threading.Lock()  # (a release can run in any thread, from the GC)

    def take(self, nbytes: int) -> _Mapping:
        """A kept buffer of `nbytes`, or a new one. (Not in huge pages: the vs_trl 8 M model's
        rollout was no faster with them, 1.001x, and its peak RSS ~30 MiB higher.)"""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return _Mapping(nbytes)

    def give(self, buffer: _Mapping) -> None:
        with self._lock:
            self._free.setdefault(buffer.nbytes, []).append(buffer)

    def clear(self) -> None:
        """Unmap every kept buffer."""
        with self._lock:
            buffers = [b for free in self._free.values() for b in free]
            self._free.clear()
        for buffer in buffers:
            buffer.close()

    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for free in self._free.values() for b in free)


POOL = _Pool()


def _release(buffer: _Mapping | _Block, keep: bool) -> None:
    if keep:
        POOL.give(buffer)
    else:
        buffer.close()


class Packed:
    """A float32 weight w [out, in] in MKL's packed layout, for many products x w^T
    (`linear`). A copy: pack again after w changes. `keep`: its buffer goes back to `POOL`
    for the next pack of the same size when this is dropped (see the module docstring), rather
    than being unmapped."""

    __slots__ = ("shape", "address", "compute", "__weakref__")

    def __init__(self, w: Tensor, keep: bool = False) -> None:
        functions = cblas()
        if functions is None:
            raise RuntimeError("this PyTorch build exports no MKL packed product")
        if w.dim() != 2 or w.dtype != torch.float32 or w.device.type != "cpu":
            raise ValueError("MKL packs a 2-D float32 CPU weight; got "
                             f"{tuple(w.shape)} {w.dtype} on {w.device}")
        w = w.detach().contiguous()
        out, inputs = w.shape
        self.shape = w.shape
        self.compute = functions.compute  # (looked up once: a decode step makes ~30 products)
        nbytes = functions.get_size(_B_MATRIX, PACK_ROWS, out, inputs)
        buffer = POOL.take(nbytes) if keep else _Block(nbytes)
        self.address = buffer.address
        weakref.finalize(self, _release, buffer, keep)
        # B = w^T, given as w read transposed
        functions.pack(_ROW_MAJOR, _B_MATRIX, _TRANS, PACK_ROWS, out, inputs, 1.0,
                       w.data_ptr(), inputs, self.address)


def _rows(x: Tensor, inputs: int) -> Tensor:
    if x.shape[-1] != inputs or x.dtype != torch.float32 or not x.is_cpu:
        raise ValueError(f"a packed {inputs}-input float32 weight cannot take a "
                         f"{x.dtype} input of shape {tuple(x.shape)} on {x.device}")
    return x if x.is_contiguous() else x.contiguous()


def linear(x: Tensor, w: Packed, b: Tensor | None = None) -> Tensor:
    """`F.linear(x, w, b)` for x [..., in] (any number of rows), without autograd: the bias
    is copied into the output and the product added to it, as `torch.addmm` does."""
    out, inputs = w.shape
    x = _rows(x, inputs)
    y = torch.empty(x.shape[:-1] + (out,), dtype=torch.float32)
    if b is not None:
        y.copy_(b)
    w.compute(_ROW_MAJOR, _NO_TRANS, _PACKED, x.numel() // inputs, out, inputs, x.data_ptr(),
              inputs, w.address, 0, 0.0 if b is None else 1.0, y.data_ptr(), out)
    return y


def linear_add(acc: Tensor, x: Tensor, w: Packed, b: Tensor | None = None) -> Tensor:
    """acc + `F.linear(x, w, b)`, written into acc (contiguous float32 [..., out]) and
    returned, the same sum to the bit. Without a bias the product adds itself to acc (sgemm's
    beta = 1: its sum is rounded, then added, as `+` does); with one, the biased product is
    added after (bias, product and acc summed in that order). No autograd."""
    out, inputs = w.shape
    x = _rows(x, inputs)
    if acc.shape[:-1] != x.shape[:-1] or acc.shape[-1] != out or not acc.is_contiguous() \
            or acc.dtype != torch.float32:
        raise ValueError(f"cannot add a product of shape {(*x.shape[:-1], out)} into "
                         f"{acc.dtype} {tuple(acc.shape)}")
    if b is not None:
        return acc.add_(linear(x, w, b))
    w.compute(_ROW_MAJOR, _NO_TRANS, _PACKED, x.numel() // inputs, out, inputs, x.data_ptr(),
              inputs, w.address, 0, 1.0, acc.data_ptr(), out)
    return acc


class Product:
    """x -> `linear(x, w, b)` for x [rows, in] with at most `max_rows` rows, written into an
    output buffer [max_rows, out] of its own: each result is a view of that buffer, and the
    next call overwrites it. For a loop that is done with each result before it calls the same
    product again (the decode step's q/k/v and gate/up projections): no allocation per call,
    and the output lands in memory the cache holds already (the vs_trl 8 M-parameter model's
    33 products of a decode step, 16 rows, weights streamed from memory: 4.87 ms against 5.30
    with a fresh output each). The same values to the bit as `linear`."""

    __slots__ = ("weight", "bias", "_buffer", "_views")

    def __init__(self, w: Packed, b: Tensor | None, max_rows: int) -> None:
        self.weight, self.bias = w, b
        self._buffer = torch.empty(max_rows, w.shape[0], dtype=torch.float32)
        self._views: dict[int, Tensor] = {}  # rows -> the buffer's first rows

    def __call__(self, x: Tensor) -> Tensor:
        w, b = self.weight, self.bias
        out, inputs = w.shape
        x = _rows(x, inputs)
        rows = x.shape[0]
        if x.dim() != 2 or rows > len(self._buffer):
            raise ValueError(f"this product takes at most {len(self._buffer)} rows of "
                             f"{inputs} inputs [rows, {inputs}]; got {tuple(x.shape)}")
        y = self._views.get(rows)
        if y is None:
            y = self._views[rows] = self._buffer[:rows]
        if b is not None:
            y.copy_(b)
        w.compute(_ROW_MAJOR, _NO_TRANS, _PACKED, rows, out, inputs, x.data_ptr(), inputs,
                  w.address, 0, 0.0 if b is None else 1.0, y.data_ptr(), out)
        return y


@functools.cache
def works() -> bool:
    """Whether the packed product is there and agrees with F.linear (fixed values: drawing
    here would shift a run's RNG stream at its first call)."""
    if cblas() is None:
        return False
    try:
        x = torch.linspace(-1, 1, 24).reshape(3, 8)
        w, b = torch.linspace(-2, 2, 40).reshape(5, 8), torch.linspace(0, 1, 5)
        expected = torch.nn.functional.linear(x, w, b)
        packed = Packed(w)
        return bool(torch.allclose(linear(x, packed, b), expected, atol=1e-5)) and \
            bool(torch.allclose(linear_add(torch.ones(3, 5), x, packed, b), expected + 1,
                                atol=1e-5))
    except (OSError, RuntimeError, ValueError):
        return False

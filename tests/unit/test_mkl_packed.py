"""MKL's packed product called directly: its values, the buffers mogrpo maps for it, and the
buffers kept for the next rollout's packs."""

from __future__ import annotations

import ctypes
import errno
import gc
import mmap
import sys

import pytest
import torch
import torch.nn.functional as F

from mogrpo.kernels.cpu import mkl_packed

pytestmark = pytest.mark.skipif(not mkl_packed.works(),
                                reason="this torch exports no MKL packed product")
LINUX = sys.platform.startswith("linux")


PAGE = 4096


def _resident(address: int, nbytes: int) -> int | None:
    """How many of the pages from `address` on are in memory (mincore), or None where the
    range is not mapped."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    start = address - address % PAGE
    pages = (address + nbytes - start + PAGE - 1) // PAGE
    vec = ctypes.create_string_buffer(pages)
    if libc.mincore(start, pages * PAGE, vec) != 0:
        assert ctypes.get_errno() == errno.ENOMEM
        return None
    return sum(byte & 1 for byte in vec.raw)


@pytest.mark.parametrize("bias", [True, False])
def test_linear_add_writes_the_sum_into_its_accumulator(bias):
    torch.manual_seed(0)
    w, x = torch.randn(96, 48), torch.randn(16, 48)
    b = torch.randn(96) if bias else None
    packed = mkl_packed.Packed(w)
    acc = torch.randn(16, 96)
    expected = acc + mkl_packed.linear(x, packed, b)
    out = mkl_packed.linear_add(acc, x, packed, b)
    assert out is acc  # in place: the decode step's residual stream
    assert torch.equal(out, expected)  # the same sum as adding the product afterwards
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    torch.testing.assert_close(mkl_packed.linear(x, packed, b), F.linear(x, w, b),
                               atol=1e-5, rtol=1e-5)


def test_inputs_it_cannot_take_are_refused_with_their_shape():
    packed = mkl_packed.Packed(torch.randn(8, 4))
    with pytest.raises(ValueError, match=r"4-input float32 weight cannot take a torch.float32 "
                                         r"input of shape \(2, 5\)"):
        mkl_packed.linear(torch.randn(2, 5), packed)
    with pytest.raises(ValueError, match="torch.float64"):
        mkl_packed.linear(torch.randn(2, 4, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match=r"packs a 2-D float32 CPU weight; got \(8, 4\) "
                                         r"torch.float64 on cpu"):
        mkl_packed.Packed(torch.randn(8, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"cannot add a product of shape \(2, 8\) into "
                                         r"torch.float32 \(2, 7\)"):
        mkl_packed.linear_add(torch.zeros(2, 7), torch.randn(2, 4), packed)


def _empty_pool() -> None:
    """No kept buffer from an earlier test: packs still referenced (a failed test's frame
    holds its locals) are collected first, so their buffers are unmapped too."""
    gc.collect()
    mkl_packed.POOL.clear()


@pytest.mark.skipif(not LINUX, reason="asks the kernel which pages are in memory (mincore)")
@pytest.mark.parametrize("thp_hint", [None, "MADV_HUGEPAGE"])
def test_a_kept_buffer_is_a_mapping_of_its_own_whose_unwritten_pages_stay_out(thp_hint,
                                                                             monkeypatch):
    """What a user relies on: a kept pack costs memory for what MKL writes, not for the
    several-fold larger buffer MKL asks for. `thp_hint` asks the kernel for transparent huge
    pages on every new mapping first (as the `always` setting does), which would make a whole
    2 MiB stretch resident at its first write; the pool's mappings opt out of them."""
    _empty_pool()
    if thp_hint is not None:
        if not hasattr(mmap, thp_hint):
            pytest.skip(f"this Python's mmap has no {thp_hint}")
        real = mmap.mmap

        def hinted(*args, **kwargs):
            m = real(*args, **kwargs)
            m.madvise(getattr(mmap, thp_hint))  # before the pool's own advice, as `always` is
            return m
        monkeypatch.setattr(mkl_packed.mmap, "mmap", hinted)
    w = torch.randn(64, 64)  # 16 KiB of weights
    size = mkl_packed.cblas().get_size(mkl_packed._B_MATRIX, mkl_packed.PACK_ROWS, 64, 64)
    assert size > 64 * w.numel() * 4  # MKL asks for far more than the weight
    packed = mkl_packed.Packed(w, keep=True)
    try:
        resident = _resident(packed.address, size)
        # MKL writes its panels (~1x the weight on a Xeon, ~1.25x + 150 KiB on an AMD EPYC);
        # the rest of its 5-9 MiB stays out
        assert resident is not None and 0 < resident * PAGE <= size // 8
        x = torch.randn(3, 64)
        torch.testing.assert_close(mkl_packed.linear(x, packed), F.linear(x, w),
                                   atol=1e-5, rtol=1e-5)
    finally:
        del packed
        _empty_pool()


@pytest.mark.skipif(not LINUX, reason="asks the kernel which pages are mapped (mincore)")
def test_a_kept_buffer_serves_the_next_pack_of_its_size_until_the_pool_lets_it_go():
    _empty_pool()
    once = mkl_packed.Packed(torch.randn(32, 16))  # for one rollout: back to malloc after
    del once
    gc.collect()
    assert mkl_packed.POOL.kept_bytes() == 0

    kept = mkl_packed.Packed(torch.randn(32, 16), keep=True)
    address = kept.address
    del kept
    gc.collect()
    assert _resident(address, PAGE) == 1 and mkl_packed.POOL.kept_bytes() > 0
    w = torch.randn(32, 16)
    again = mkl_packed.Packed(w, keep=True)  # the next pack of that size takes it back
    assert again.address == address and mkl_packed.POOL.kept_bytes() == 0
    x = torch.randn(5, 16)
    torch.testing.assert_close(mkl_packed.linear(x, again), F.linear(x, w),
                               atol=1e-5, rtol=1e-5)
    del again
    mkl_packed.POOL.clear()
    assert _resident(address, PAGE) is None  # unmapped


def test_without_the_functions_nothing_is_packed(monkeypatch):
    monkeypatch.setattr(mkl_packed, "cblas", lambda: None)
    assert mkl_packed.works.__wrapped__() is False
    with pytest.raises(RuntimeError, match="exports no MKL packed product"):
        mkl_packed.Packed(torch.randn(4, 4))


@pytest.mark.parametrize("bias", [True, False])
def test_a_product_writes_every_result_into_its_one_buffer(bias):
    """`Product` gives `linear`'s values to the bit, for any number of rows up to its
    maximum, each result a view of the same buffer that the next call overwrites."""
    torch.manual_seed(0)
    w = torch.randn(96, 48)
    b = torch.randn(96) if bias else None
    packed = mkl_packed.Packed(w)
    product = mkl_packed.Product(packed, b, max_rows=16)
    x1, x2, x3 = torch.randn(16, 48), torch.randn(16, 48), torch.randn(5, 48)
    first = product(x1)
    assert torch.equal(first, mkl_packed.linear(x1, packed, b))
    address = first.data_ptr()
    second = product(x2)
    assert second.data_ptr() == address and torch.equal(first, second)  # overwritten
    assert torch.equal(second, mkl_packed.linear(x2, packed, b))
    fewer = product(x3)  # rows leave the batch as completions finish
    assert fewer.shape == (5, 96) and fewer.data_ptr() == address
    assert torch.equal(fewer, mkl_packed.linear(x3, packed, b))
    strided = torch.randn(48, 16).t()  # not contiguous: read through a copy
    assert torch.equal(product(strided), mkl_packed.linear(strided.contiguous(), packed, b))


def test_a_product_refuses_more_rows_than_its_buffer_holds():
    product = mkl_packed.Product(mkl_packed.Packed(torch.randn(8, 4)), None, max_rows=3)
    with pytest.raises(ValueError, match=r"at most 3 rows of 4 inputs \[rows, 4\]; "
                                         r"got \(4, 4\)"):
        product(torch.randn(4, 4))
    product(torch.randn(3, 4))  # three rows: the view of that size is made
    with pytest.raises(ValueError, match=r"got \(3, 2, 4\)"):  # not [rows, in]
        product(torch.randn(3, 2, 4))
    with pytest.raises(ValueError, match="4-input float32 weight cannot take"):
        product(torch.randn(3, 5))

"""Rows of a KV cache [B, H_kv, T_max, D] kept, reordered or moved up in place: what the native
engine does when a prefill of distinct prompts hands each row its prompt's cache, and when finished
rows leave the batch."""

from __future__ import annotations

from torch import Tensor


def rows_of(cache: Tensor, rows: Tensor, columns: int, zero: bool = False) -> Tensor:
    """A cache [len(rows), H_kv, T_max, D] holding `cache`'s rows `rows` in its first
    `columns` columns (the rest left unwritten, or zeros where `zero`)."""
    out = (cache.new_zeros if zero else cache.new_empty)((len(rows), *cache.shape[1:]))
    out[:, :, :columns] = cache[rows, :, :columns]
    return out


def row_moves(rows: list[int]) -> list[tuple[int, int, int]]:
    """The block copies (first, end, shift) that move rows `rows` (strictly rising) of a
    cache to its first len(rows) rows in place: rows first..end-1 take rows first+shift..
    end-1+shift, in this order. A run of rows with the same shift is copied in blocks of at
    most `shift` rows, so no block overlaps its source, and each source is read before an
    earlier block's copy overwrites it. Rows before the first that leaves stay."""
    moves, i, n = [], 0, len(rows)
    while i < n and rows[i] == i:
        i += 1
    while i < n:
        shift = rows[i] - i
        j = i + 1
        while j < n and rows[j] - j == shift:
            j += 1
        moves.extend((first, min(first + shift, j), shift) for first in range(i, j, shift))
        i = j
    return moves


def shift_rows(cache: Tensor, moves: list[tuple[int, int, int]], rows: int,
               columns: int) -> Tensor:
    """`cache` [B, H_kv, T_max, D] with `moves` (see `row_moves`) done on its first `columns`
    columns; its first `rows` rows, a view."""
    for first, end, shift in moves:
        cache[first:end, :, :columns].copy_(cache[first + shift:end + shift, :, :columns])
    return cache[:rows]

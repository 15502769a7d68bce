"""The keyword columns a reward function receives with each batch of completions."""

from __future__ import annotations

from typing import Any

from mogrpo.data.schema import Example


def reward_columns(examples: list[Example], lengths: list[int],
                   truncated: list[bool]) -> dict[str, list[Any]]:
    """One list per column, one entry per completion: every dataset column any of the rows
    has (None in a row without it), then `completion_lengths` and `truncated`.

    `examples[i]` is the row completion i answers (a row repeats for its K completions)."""
    keys: list[str] = []
    for ex in examples:
        keys.extend(k for k in ex.columns if k not in keys)
    columns = {k: [ex.columns.get(k) for ex in examples] for k in keys}
    columns["completion_lengths"] = list(lengths)
    columns["truncated"] = list(truncated)
    return columns

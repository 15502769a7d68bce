"""A task's `data` however it is given — a file, `builtin:NAME`, a Hugging Face dataset
(`{hub: …}`, a `save_to_disk` folder, Parquet, Arrow) — as validated examples; or, for
`streaming: true`, as a stream of examples read while training draws them."""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.data.hf import (
    HFSource,
    check_columns,
    is_dataset_path,
    read_hf_records,
    rename,
    stream_records,
)
from mogrpo.data.problems import ProblemLog
from mogrpo.data.readers import SUPPORTED_EXTENSIONS, Record, read_records
from mogrpo.data.schema import Example, detect_format, parse_examples, parse_row
from mogrpo.data.synthetic import BUILTIN_PREFIX, builtin_rows
from mogrpo.errors import DataError

PREVIEW_ROWS = 64
"""Rows of a streamed task read and checked before the model loads."""


def is_streaming(spec: Any) -> bool:
    return not isinstance(spec, str) and bool(getattr(spec, "streaming", False))


def load_records(spec: Any, seed: int, problems: ProblemLog | None = None) -> list[Record]:
    """Every row of `spec` (a path or `builtin:NAME` string, or a `DataSource` section); a text
    file's bad rows go to `problems` (raised here without one)."""
    if isinstance(spec, str):
        if spec.startswith(BUILTIN_PREFIX):
            return [Record(spec, i + 1, row) for i, row in enumerate(builtin_rows(spec, seed))]
        if is_dataset_path(spec):
            return read_hf_records(HFSource(path=spec))
        return read_records(spec, problems)
    source = HFSource.from_config(spec)
    if source.path and Path(source.path).suffix.lower() in SUPPORTED_EXTENSIONS:
        # a text file read by mogrpo keeps its line numbers; the mapping renames its columns
        records = read_records(source.path, problems)
        check_columns(source, list(dict.fromkeys(k for r in records for k in r.data)))
        return [Record(r.source, r.row, rename(r.data, source.columns)) for r in records]
    return read_hf_records(source)


@dataclass
class ExampleStream:
    """A streamed task's training examples, one pass (epoch) at a time, in a shuffled order
    that depends only on (seed, task, epoch), so a resumed run sees the same prompts."""

    source: HFSource
    format: str
    prompt_template: str | None
    drop_incomplete: bool
    seed: int
    skip_rows: int = 0
    """Rows at the start of the split held out for evaluation."""
    strict: bool = False
    """Values mogrpo would repair (answer `b` read as `B`) are errors."""

    def __call__(self, epoch: int) -> Iterator[Example]:
        records = stream_records(self.source, seed=self.seed, epoch=epoch,
                                 skip_rows=self.skip_rows)
        for record in records:
            example = parse_row(record, self.format, prompt_template=self.prompt_template,
                                drop_incomplete=self.drop_incomplete, strict=self.strict)
            if example is not None:
                yield example


def open_stream(spec: Any, *, task: str, format: str, prompt_template: str | None,
                drop_incomplete: bool, seed: int, eval_size: int, strict: bool = False
                ) -> tuple[list[Example], list[Example], ExampleStream]:
    """(preview, held-out, stream) of a streamed task: the first `eval_size` rows are held out
    and the next `PREVIEW_ROWS` checked now — errors before the model loads — and kept as the
    task's preview (its columns, the SFT warm-up's examples); training draws from the stream."""
    source = HFSource.from_config(spec)
    head = list(itertools.islice(stream_records(source, seed=0, epoch=0, shuffle=False),
                                 eval_size + PREVIEW_ROWS))
    if len(head) <= eval_size:
        raise DataError(f"{source.label}: {len(head)} rows, not more than eval_size "
                        f"{eval_size}; lower `tasks.{task}.eval_size` or add rows")
    fmt = detect_format(head) if format == "auto" else format
    kwargs = dict(format=fmt, prompt_template=prompt_template, drop_incomplete=drop_incomplete,
                  strict=strict)
    held_out = parse_examples(head[:eval_size], **kwargs) if eval_size else []
    preview = parse_examples(head[eval_size:], **kwargs)
    task_seed = zlib.crc32(f"{seed}/{task}".encode())
    stream = ExampleStream(source, fmt, prompt_template, drop_incomplete, task_seed, eval_size,
                           strict)
    return preview, held_out, stream

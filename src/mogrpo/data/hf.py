"""Hugging Face `datasets` as task data: a hub dataset, a folder written by `save_to_disk`, a
Parquet or Arrow file — read whole, or streamed for data that does not fit in memory.

Rows become the same row-numbered `Record`s as files (row N = the split's N-th row), so every
bad row is reported as ``hub:openai/gsm8k (main, train) row 17`` and validated by the same
schema code. A column mapping renames dataset columns to the names mogrpo and the reward
functions use (``{problem: prompt, answer: solution}``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mogrpo.data.readers import SUPPORTED_EXTENSIONS, Record
from mogrpo.errors import DataError

log = logging.getLogger(__name__)

HF_EXTENSIONS = (".parquet", ".arrow")
_SAVED_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
_ROW = "__mogrpo_row__"  # the row index carried through a streamed shuffle


@dataclass(frozen=True)
class HFSource:
    """Where a task's rows come from (the `data: {...}` config form, or a path)."""

    hub: str | None = None
    path: str | None = None
    config: str | None = None
    split: str = "train"
    revision: str | None = None
    columns: Mapping[str, str] = field(default_factory=dict)
    streaming: bool = False
    shuffle_buffer: int = 10_000

    @property
    def label(self) -> str:
        """How messages name the source: `hub:NAME (config, split)` or `PATH (split)`."""
        parts = ", ".join(p for p in (self.config, self.split) if p)
        return f"hub:{self.hub} ({parts})" if self.hub else f"{self.path} ({parts})"

    @classmethod
    def from_config(cls, value: Any) -> HFSource:
        """From a config `DataSource` section, or a plain path string."""
        if isinstance(value, str):
            return cls(path=value)
        names = ("hub", "path", "config", "split", "revision", "columns", "streaming",
                 "shuffle_buffer")
        return cls(**{n: getattr(value, n) for n in names})


def is_dataset_path(spec: str) -> bool:
    """A Parquet/Arrow file or a `save_to_disk` folder (read with `datasets`)."""
    path = Path(spec).expanduser()
    if path.suffix.lower() in HF_EXTENSIONS:
        return True
    return path.is_dir() and any((path / m).exists() for m in _SAVED_MARKERS)


def _datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise DataError("reading Hugging Face datasets needs the `datasets` package: "
                        "pip install datasets") from e
    return datasets


def open_dataset(source: HFSource, streaming: bool) -> Any:
    """The split as a `datasets.Dataset` (or an `IterableDataset` when `streaming`)."""
    datasets = _datasets()
    if source.hub:
        try:
            return datasets.load_dataset(source.hub, source.config, split=source.split,
                                         revision=source.revision, streaming=streaming)
        except Exception as e:  # noqa: BLE001 - the hub raises many kinds; all mean the same
            raise DataError(
                f"cannot load {source.label}: {type(e).__name__}: {e}; check the dataset name, "
                "`config` and `split` (and HF_TOKEN for a gated dataset, or the network)"
            ) from e
    path = Path(source.path or "").expanduser()
    if not path.exists():
        raise DataError(f"dataset not found: {source.path} (resolved to {path.resolve()}); "
                        "check `tasks.<name>.data`")
    if path.is_dir():
        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            if source.split not in ds:
                raise DataError(f"{path}: no split {source.split!r}; it has "
                                f"{', '.join(ds)}. Set `split` under `data`")
            ds = ds[source.split]
        return ds.to_iterable_dataset() if streaming else ds
    suffix = path.suffix.lower()
    builder = {".parquet": "parquet", ".arrow": "arrow", ".jsonl": "json", ".json": "json",
               ".csv": "csv", ".tsv": "csv"}.get(suffix)
    if builder is None:
        raise DataError(f"{path}: unsupported dataset file {suffix or '(no extension)'!r}; "
                        f"supported: {', '.join(HF_EXTENSIONS + SUPPORTED_EXTENSIONS)}")
    extra = {"delimiter": "\t"} if suffix == ".tsv" else {}
    return datasets.load_dataset(builder, data_files=str(path), split="train",
                                 streaming=streaming, **extra)


def check_columns(source: HFSource, names: list[str] | None) -> None:
    if names is None:  # a streamed dataset may not know its columns before the first row
        return
    missing = [c for c in source.columns if c not in names]
    if missing:
        raise DataError(f"{source.label}: `columns` renames {missing[0]!r}, but the dataset has "
                        f"columns {', '.join(names)}; fix the mapping")
    clash = [new for old, new in source.columns.items() if new in names and new not in
             source.columns]
    if clash:
        raise DataError(f"{source.label}: `columns` renames a column to {clash[0]!r}, which the "
                        "dataset already has; map that one too or pick another name")


def rename(row: Mapping[str, Any], columns: Mapping[str, str]) -> dict[str, Any]:
    """A row with the mapped columns renamed (the others kept)."""
    return {columns.get(k, k): v for k, v in row.items()}


def read_hf_records(source: HFSource) -> list[Record]:
    """Every row of the split, in order, as row-numbered records (1 = the first row)."""
    ds = open_dataset(source, streaming=False)
    check_columns(source, list(ds.column_names))
    records = [Record(source.label, i + 1, rename(row, source.columns))
               for i, row in enumerate(ds)]
    if not records:
        raise DataError(f"{source.label}: the split has no rows")
    log.debug("read %d rows from %s", len(records), source.label)
    return records


def stream_records(source: HFSource, *, seed: int, epoch: int, skip_rows: int = 0,
                   shuffle: bool = True, start: int = 0) -> Iterator[Record]:
    """The split's rows one at a time without loading it: the first `skip_rows` rows left
    out (held out for eval), the rest shuffled through a buffer of `source.shuffle_buffer`
    rows — the same order for the same (seed, epoch) — and the first `start` of those
    skipped (a resumed run). Each record keeps its row number in the split."""
    ds = open_dataset(source, streaming=True)
    check_columns(source, ds.column_names)
    ds = ds.map(lambda row, i: {_ROW: i}, with_indices=True)
    if skip_rows:
        ds = ds.skip(skip_rows)
    if shuffle:
        ds = ds.shuffle(seed=seed, buffer_size=source.shuffle_buffer)
        ds.set_epoch(epoch)
    for row in itertools.islice(ds, start, None):
        row = dict(row)
        number = row.pop(_ROW) + 1
        yield Record(source.label, number, rename(row, source.columns))

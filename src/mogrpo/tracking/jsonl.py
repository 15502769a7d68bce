"""The run's JSONL logs (metrics.jsonl, eval.jsonl, ...): one JSON object per line, appended
and flushed as it happens, and repaired atomically when a resume cuts them back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def json_line(record: dict[str, Any]) -> str:
    """One record as a line of a JSONL log."""
    return json.dumps(record, ensure_ascii=False, allow_nan=True) + "\n"


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Tee:
    """Writes each record to several sinks (the metrics file, the trackers)."""

    def __init__(self, *sinks: Any) -> None:
        self.sinks = sinks

    def write(self, record: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.write(record)


def truncate_jsonl(path: Path, last_step: int, key: str = "step") -> int:
    """Drop lines written after `last_step` (and a half-written last line); returns how many.

    The file is replaced atomically, so a kill during the repair leaves the old file whole."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record.get(key), int) and record[key] > last_step:
            dropped += 1
            continue
        kept.append(line)
    _replace(path, "".join(line + "\n" for line in kept))
    return dropped


def rewrite_jsonl(path: Path, records: list[dict[str, Any]]) -> None:
    """Replace `path` atomically by `records`, one JSON object per line (as `MetricsWriter`
    writes them), so the file holds exactly what a checkpoint knows of it."""
    _replace(path, "".join(json_line(r) for r in records))


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)

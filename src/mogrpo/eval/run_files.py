"""What a run directory holds (config.yaml, metrics.jsonl, eval.jsonl, pareto.json,
summary.json), read once for `mogrpo report` and its charts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from mogrpo.errors import MogrpoError
from mogrpo.tracking import names


class ReportError(MogrpoError):
    """The directory is not a run directory (or its files are unreadable)."""


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by a crash: the rest still reports
    return rows


class RunFiles:
    """What a run directory holds, read once."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir
        if not (run_dir / "metrics.jsonl").is_file():
            raise ReportError(f"{run_dir} has no metrics.jsonl; give a run directory (the "
                              "output.dir of a `mogrpo train` run)")
        records = _jsonl(run_dir / "metrics.jsonl")
        self.steps = [r for r in records if "event" not in r and "step" in r]
        self.events = [r for r in records if "event" in r]
        self.evals = _jsonl(run_dir / "eval.jsonl")
        config_path = run_dir / "config.yaml"
        self.config = yaml.safe_load(config_path.read_text(encoding="utf-8")) \
            if config_path.is_file() else {}
        self.summary = self._json("summary.json")
        self.pareto = self._json("pareto.json")
        self.tasks = list((self.config.get("tasks") or {}).keys()) or sorted(
            {names.task_of(k) for r in self.steps for k in r if k.startswith(names.TASK_PREFIX)})

    def _json(self, name: str) -> dict[str, Any]:
        path = self.dir / name
        try:
            return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except json.JSONDecodeError:
            return {}

    def series(self, key: str) -> list[float]:
        return [r[key] for r in self.steps if key in r]

"""The Pareto view over evaluated checkpoints: which ones no other checkpoint beats on every
task score, and which one is best on each task.

All scores are maximised. A missing or NaN score counts as the worst possible value, so a
checkpoint that could not be scored on a task never beats one that could.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Point:
    """One evaluated checkpoint."""

    name: str
    """Checkpoint label, e.g. ``step-20``."""
    step: int
    """Trainer step at which it was evaluated."""
    scores: dict[str, float] = field(default_factory=dict)
    """Eval score per task (higher is better); NaN or absent = could not be scored."""


def _task_names(points: list[Point]) -> list[str]:
    """Every task scored by any point, in first-seen order."""
    return list(dict.fromkeys(t for p in points for t in p.scores))


def _value(point: Point, task: str) -> float:
    """The score used for comparisons: NaN and missing become -inf (the worst)."""
    v = point.scores.get(task, math.nan)
    return -math.inf if math.isnan(v) else v


def _dominates(a: Point, b: Point, tasks: list[str]) -> bool:
    """a >= b on every task and a > b on at least one."""
    va, vb = [_value(a, t) for t in tasks], [_value(b, t) for t in tasks]
    return all(x >= y for x, y in zip(va, vb, strict=True)) and va != vb


def pareto_front(points: list[Point], tasks: list[str] | None = None) -> list[Point]:
    """The points no other point dominates, in input order (maximisation over ``tasks``,
    default: every task any point has a score for).

    Points with exactly equal scores do not dominate each other, so duplicates are all kept:
    two checkpoints that score the same are equally good choices, and dropping either one
    would be an arbitrary pick the user cannot see.
    """
    tasks = _task_names(points) if tasks is None else tasks
    return [p for p in points if not any(_dominates(q, p, tasks) for q in points)]


def best_per_task(points: list[Point], tasks: list[str] | None = None) -> dict[str, Point]:
    """The best point on each task; ties go to the earliest step (then input order).

    A task on which no point has a finite score has no entry.
    """
    tasks = _task_names(points) if tasks is None else tasks
    best: dict[str, Point] = {}
    for t in tasks:
        scored = [p for p in points if _value(p, t) > -math.inf]
        if scored:
            # max() keeps the first of equal keys, so sort by step first (stable).
            best[t] = max(sorted(scored, key=lambda p: p.step), key=lambda p: _value(p, t))
    return best


def _point_to_json(p: Point) -> dict[str, Any]:
    # NaN is not valid JSON: write null and read it back as NaN.
    scores = {t: (None if math.isnan(v) else v) for t, v in p.scores.items()}
    return {"name": p.name, "step": p.step, "scores": scores}


def _point_from_json(d: dict[str, Any]) -> Point:
    scores = {t: (math.nan if v is None else float(v)) for t, v in d["scores"].items()}
    return Point(name=d["name"], step=int(d["step"]), scores=scores)


class ParetoTracker:
    """Every evaluated checkpoint of a run, with its Pareto front and per-task bests.

    Adding a point with the step of one already held replaces it, so re-evaluating a step
    after a resume does not count that checkpoint twice.
    """

    def __init__(self, tasks: list[str] | None = None) -> None:
        self._fixed_tasks = list(tasks) if tasks is not None else None
        self.points: list[Point] = []

    @property
    def tasks(self) -> list[str]:
        """The tasks compared: as given, else every task seen so far."""
        return self._fixed_tasks if self._fixed_tasks is not None else _task_names(self.points)

    def add(self, point: Point) -> bool:
        """Record ``point``; returns whether it is on the front afterwards."""
        self.points = [p for p in self.points if p.step != point.step] + [point]
        self.points.sort(key=lambda p: p.step)
        return any(p is point for p in self.front)

    @property
    def front(self) -> list[Point]:
        """The current Pareto front, in step order."""
        return pareto_front(self.points, self.tasks)

    @property
    def best(self) -> dict[str, Point]:
        """The best checkpoint per task (ties: earliest step)."""
        return best_per_task(self.points, self.tasks)

    def to_json(self) -> dict[str, Any]:
        """Tasks, every point, the front and the best per task; NaN scores as null."""
        return {
            "tasks": self.tasks,
            "points": [_point_to_json(p) for p in self.points],
            "front": [_point_to_json(p) for p in self.front],
            "best": {t: _point_to_json(p) for t, p in self.best.items()},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write :meth:`to_json` to ``path`` atomically: a reader sees the old file or the
        new one, never a half-written one (temp file in the same directory + os.replace)."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(self.to_json(), f, indent=2, allow_nan=False)
                f.write("\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: the fixed task list (or None) and every point."""
        return {"tasks": self._fixed_tasks, "points": [_point_to_json(p) for p in self.points]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        tasks = state.get("tasks")
        self._fixed_tasks = list(tasks) if tasks is not None else None
        self.points = sorted((_point_from_json(d) for d in state["points"]), key=lambda p: p.step)

    def format(self) -> str:
        """A compact table of the front, one line per point; ``*`` marks a score equal to
        the best on that task (every tied point is marked)."""
        front, tasks = self.front, self.tasks
        if not front:
            return "[Pareto] no evaluated steps yet"
        top = {t: _value(p, t) for t, p in self.best.items()}
        widths = [max(len(t), 6) for t in tasks]
        lines = [
            f"[Pareto] {len(front)} of {len(self.points)} evaluated steps on the front "
            "(* = best on that task)",
            "  " + "step".rjust(6) + "".join(f"  {t.rjust(w)}" for t, w in zip(tasks, widths, strict=True)),
        ]
        for p in front:
            cells = []
            for t, w in zip(tasks, widths, strict=True):
                v = p.scores.get(t, math.nan)
                mark = "*" if t in top and _value(p, t) == top[t] else " "
                cells.append(f"  {f'{v:.3f}'.rjust(w)}{mark}")
            lines.append(("  " + str(p.step).rjust(6) + "".join(cells)).rstrip())
        return "\n".join(lines)

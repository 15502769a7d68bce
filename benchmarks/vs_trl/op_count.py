"""Count the ATen operations a training step dispatches outside its generation.

On a GPU nearly every such operation is at least one kernel launch, so where a step is bound by
launches rather than by arithmetic (small batches, as in GRPO's update) their number is what
its time follows. Counted on any device, a CPU included, by a `TorchDispatchMode`: the
forward's operations, the autograd engine's backward ones, the optimizer's.

`OpCounter.pause()` leaves a phase out (the rollout). Views and other operations that only
make a new tensor header (no kernel on any device) are counted apart, as `views`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

# operations that return a view or only change metadata: no kernel runs
VIEWS = frozenset({
    "view", "_unsafe_view", "expand", "t", "transpose", "permute", "slice", "select",
    "unsqueeze", "squeeze", "as_strided", "detach", "alias", "_reshape_alias", "split",
    "split_with_sizes", "unbind", "reshape", "narrow", "view_as", "expand_as", "chunk",
    "unflatten", "flatten", "diagonal", "_unsafe_split", "lift_fresh", "numpy_T", "mT",
    "_to_copy_noop", "empty_like_view", "set_", "resolve_conj", "resolve_neg",
})


class OpCounter(TorchDispatchMode):
    """Counts each ATen operation by name (`aten.mm.default` → "mm") while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        if not self.paused:
            self.ops[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def pause(self) -> Iterator[None]:
        self.paused += 1
        try:
            yield
        finally:
            self.paused -= 1

    def total(self) -> int:
        """Operations counted so far (views included)."""
        return sum(self.ops.values())

    def take(self) -> dict[str, Any]:
        """This step's counts (kernels, views, per operation), and a fresh start."""
        ops, self.ops = dict(self.ops), Counter()
        views = sum(n for name, n in ops.items() if name in VIEWS)
        return {"kernels": sum(ops.values()) - views, "views": views, "ops": ops}


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The median step's kernel and view counts, and the operations of the last step."""
    kernels = sorted(step["kernels"] for step in steps)
    views = sorted(step["views"] for step in steps)
    return {"kernels": kernels[len(kernels) // 2], "views": views[len(views) // 2],
            "ops": steps[-1]["ops"]}


def compare(left: dict[str, Any], right: dict[str, Any], names: tuple[str, str],
            top: int = 25) -> str:
    """A text table: the operations whose counts differ most between two tools' steps."""
    a, b = left["ops"], right["ops"]
    rows = sorted((name for name in set(a) | set(b) if name not in VIEWS),
                  key=lambda name: -abs(a.get(name, 0) - b.get(name, 0)))[:top]
    lines = [f"{'kernels a step (median)':32s} {left['kernels']:>8d} {right['kernels']:>8d}",
             f"{'views a step (median)':32s} {left['views']:>8d} {right['views']:>8d}",
             f"{'operation (last step)':32s} {names[0]:>8s} {names[1]:>8s}"]
    lines += [f"  {name:30s} {a.get(name, 0):>8d} {b.get(name, 0):>8d}" for name in rows]
    return "\n".join(lines)

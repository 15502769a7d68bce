"""The progress bar of the SFT and GRPO loops."""

from __future__ import annotations

import sys
from typing import Any

from tqdm.auto import tqdm

from mogrpo.tasks.task import Task
from mogrpo.tracking import names


class Progress:
    """A tqdm bar showing each task's reward; silent when off or when stderr is not a TTY."""

    def __init__(self, total: int, desc: str, enabled: bool, start: int = 0) -> None:
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = tqdm(total=total, initial=start, desc=desc, disable=not self.enabled,
                        dynamic_ncols=True, leave=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()

    def update(self, metrics: dict[str, Any], tasks: list[Task] | None = None) -> None:
        if not self.enabled:
            return
        postfix = {}
        for task in tasks or []:
            key = names.TASK_REWARD.of(task.name)
            if key in metrics:
                postfix[task.name] = f"{metrics[key]:.3f}"
        if names.LOSS in metrics:
            postfix["loss"] = f"{metrics[names.LOSS]:.4f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)

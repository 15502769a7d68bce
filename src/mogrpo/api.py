"""The Python API, for scripts and notebooks: `Config` and `train`.

```python
from mogrpo import Config, train

def accuracy(completions, solution, **kwargs):
    return [1.0 if s in c[0]["content"] else 0.0 for c, s in zip(completions, solution)]

config = Config(
    model={"name_or_path": "Qwen/Qwen2.5-0.5B-Instruct"},
    tasks={"math": {"data": {"hub": "trl-lib/DeepMath-103K"}, "rewards": [accuracy]}},
    train={"max_steps": 200},
)
summary = train(config)
```

`Config` takes the same sections as a YAML file, and checks them the same way before any
model loads; reward functions can be the Python callables themselves.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mogrpo.config import RunConfig, load_config


class Config(RunConfig):
    """A run's configuration: `Config(source, **sections)`.

    `source` is a YAML file, a dict of sections or another config (optional); keyword arguments
    are sections (`train={"max_steps": 10}`) merged over it, key by key. Priority: keyword
    arguments > environment (`MOGRPO_SECTION__KEY`) > `source` > defaults. Unknown keys, bad
    values and inconsistent settings raise `ConfigError` naming the field and the fix.
    """

    def __init__(self, source: str | Path | Mapping[str, Any] | RunConfig | None = None, /,
                 **sections: Any) -> None:
        path, base = None, None
        if isinstance(source, RunConfig):
            base = source.model_dump()  # Python values (reward callables) stay as they are
        elif isinstance(source, Mapping):
            base = source
        elif source is not None:
            path = source
        config, _ = load_config(path, base=base, arguments=sections)
        super().__init__(**config.model_dump())
        self.limit_notes.update(config.limit_notes)  # not a field: the dump leaves it out


def train(config: RunConfig | str | Path | Mapping[str, Any] | None = None, /, *,
          resume: str | None = None, allow_config_change: bool = False,
          log_level: str | None = None, **sections: Any) -> dict[str, Any]:
    """Run what the config asks for (SFT warm-up, GRPO, evals, saves) in this process, as
    `mogrpo train` does; returns the run summary (also written to RUN_DIR/summary.json).

    `config` is anything `Config` takes, and `sections` are merged over it. `resume` is
    "auto" or a checkpoint path; a run whose rewards are Python callables is resumed from
    Python with the same callables. Console logging goes to stderr at `log_level` (default:
    `logging.level`).
    """
    if sections or not isinstance(config, RunConfig):
        config = Config(config, **sections)
    from mogrpo.cli.console import setup_logging
    from mogrpo.trainer.run import run_training

    setup_logging(log_level or config.logging.level)
    return run_training(config, resume=resume, allow_config_change=allow_config_change)

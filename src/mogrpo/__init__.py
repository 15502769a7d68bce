"""mogrpo: multi-objective GRPO post-training for causal language models.

From Python: ``from mogrpo import Config, train`` (see `mogrpo.api`).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "__version__", "train"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import mogrpo` (and the CLI's start) stays light.
    if name in ("Config", "train"):
        from mogrpo import api

        return getattr(api, name)
    raise AttributeError(f"module 'mogrpo' has no attribute {name!r}")

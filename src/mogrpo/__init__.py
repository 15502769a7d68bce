"""mogrpo: multi-objective GRPO post-training for causal language models.

From Python: ``from mogrpo import Config, train`` (see `mogrpo.api`).
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Config", "__version__", "train"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import mogrpo` (and the CLI's start) stays light. `train` is
    # the package `mogrpo.train`, made callable: it runs `mogrpo.api.train`.
    if name == "Config":
        from mogrpo.api import Config

        return Config
    if name == "train":
        import mogrpo.train

        return mogrpo.train
    raise AttributeError(f"module 'mogrpo' has no attribute {name!r}")

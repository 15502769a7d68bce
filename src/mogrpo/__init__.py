"""mogrpo: multi-objective GRPO post-training for causal language models.

From Python: ``from mogrpo import Config, train`` (see `mogrpo.api`). The root is the public
API and the top of the house: nothing inside the package imports it.
"""

from typing import Any

from mogrpo.version import __version__

__all__ = ["Config", "__version__", "train"]


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import mogrpo` (and the CLI's start) stays light.
    if name in ("Config", "train"):
        import mogrpo.api

        return getattr(mogrpo.api, name)
    raise AttributeError(f"module 'mogrpo' has no attribute {name!r}")

"""The training loops (GRPO, SFT warm-up) and a whole run's sequence.

`mogrpo.train` is also the Python API's `train(config, ...)` (see `mogrpo.api.train`): once
this package is imported, Python binds the name `mogrpo.train` to it, which would hide the
function behind `from mogrpo import train`. So the package itself is callable and forwards
to the function.
"""

import sys
import types
from typing import Any


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from mogrpo.api import train

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

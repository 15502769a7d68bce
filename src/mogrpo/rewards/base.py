"""The reward contract: resolve reward functions by name and call them with checked results.

A reward function is ``fn(prompts, completions, **columns) -> list[float | None]`` (as in TRL):
one score per completion, ``None`` where it cannot score. ``None`` is carried as NaN and never
becomes a silent 0.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from mogrpo.errors import RewardError
from mogrpo.rewards.builtin import format_reward, length_penalty, mc_correct
from mogrpo.rewards.code import code_tests

BUILTIN_REWARDS: dict[str, Callable[..., list]] = {
    "mc_correct": mc_correct,
    "format": format_reward,
    "length_penalty": length_penalty,
    "code_tests": code_tests,
}
_P = inspect.Parameter
_FORMS = "a built-in name, package.module:function, or path/to/file.py:function"


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The function named by `spec`: a builtin, `package.module:function` or `file.py:function`."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward function spec {spec!r} is empty; give {_FORMS}")
    spec = spec.strip()
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    if ":" not in spec:
        close = difflib.get_close_matches(spec, BUILTIN_REWARDS, n=1, cutoff=0.5)
        hint = f"did you mean {close[0]!r}? " if close else ""
        dotted = (
            f" For an imported function write {spec.rpartition('.')[0]}:{spec.rpartition('.')[2]}."
            if "." in spec and not spec.endswith(".py") else ""
        )
        raise RewardError(
            f"unknown reward {spec!r}; {hint}built-in rewards: {', '.join(BUILTIN_REWARDS)}."
            f"{dotted} Otherwise give {_FORMS}"
        )
    target, _, attr = spec.rpartition(":")
    if not target or not attr:
        raise RewardError(f"reward {spec!r} is incomplete; give {_FORMS}")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, spec) if is_file else _import_module(target, spec)
    fn = _attribute(module, target, attr, spec)
    if not callable(fn):
        raise RewardError(
            f"reward {spec!r}: {attr!r} in {target} is a {type(fn).__name__}, not a function; "
            "point at a function fn(prompts, completions, **columns)"
        )
    _check_signature(fn, spec)
    return fn


def _load_file(target: str, spec: str) -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_file():
        raise RewardError(
            f"reward {spec!r}: file {target} not found (resolved to {path.resolve()}); "
            "expected path/to/file.py:function"
        )
    resolved = path.resolve()
    # A unique, stable module name per file, so loading it twice gives the same functions.
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    stem = re.sub(r"\W", "_", resolved.stem)
    name = f"mogrpo_user_{stem}_{digest}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, resolved)
    if module_spec is None or module_spec.loader is None:
        raise RewardError(f"reward {spec!r}: {target} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardError(
            f"reward {spec!r}: running {target} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e
    return module


def _import_module(target: str, spec: str) -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise RewardError(
                f"reward {spec!r}: module {target!r} not found ({e.name!r} cannot be imported); "
                "install it, add its directory to PYTHONPATH, or give path/to/file.py:function"
            ) from None
        raise RewardError(
            f"reward {spec!r}: module {target!r} imports {e.name!r}, which is not installed; "
            f"install it{_where(e)}"
        ) from e
    except Exception as e:
        raise RewardError(
            f"reward {spec!r}: importing {target!r} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e


def _attribute(module: ModuleType, target: str, attr: str, spec: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            defined = [
                n for n, v in vars(module).items()
                if not n.startswith("_") and callable(v)
                and getattr(v, "__module__", None) == module.__name__
            ]
            close = difflib.get_close_matches(part, defined, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RewardError(
                f"reward {spec!r}: {target} has no attribute {attr!r}; {hint}functions defined "
                f"there: {', '.join(defined[:12]) or '(none)'}. Expected form: {_FORMS}"
            )
        obj = getattr(obj, part)
    return obj


def _check_signature(fn: Callable[..., Any], spec: str) -> None:
    """Fail early on a function the trainer cannot call (TRL requires the same signature)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # some builtins and C functions have no signature
        return
    kinds = [p.kind for p in params]
    positional = [k for k in kinds if k in (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 2 and _P.VAR_POSITIONAL not in kinds:
        raise RewardError(
            f"reward {spec!r} must take (prompts, completions, **columns) but its signature is "
            f"{inspect.signature(fn)}"
        )
    if _P.VAR_KEYWORD not in kinds:
        raise RewardError(
            f"reward {spec!r} must accept **kwargs: every dataset column is passed to it as a "
            f"keyword argument; its signature is {inspect.signature(fn)} — add **kwargs"
        )


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _as_scores(name: str, result: Any, n: int) -> list[float]:
    """Check one function's return value against the contract; None and NaN become NaN."""
    if isinstance(result, torch.Tensor | np.ndarray):
        if result.ndim != 1:
            raise RewardError(
                f"reward {name!r} returned an array of shape {tuple(result.shape)}; return a flat "
                f"list with one score per completion ({n})"
            )
        result = result.tolist()
    elif not isinstance(result, list | tuple):
        raise RewardError(
            f"reward {name!r} returned a {type(result).__name__} ({result!r:.60}); it must "
            f"return a list with one score (a number or None) per completion ({n})"
        )
    if len(result) != n:
        raise RewardError(f"reward {name!r} returned {len(result)} values for {n} completions")
    scores = []
    for i, value in enumerate(result):
        if value is None:
            scores.append(math.nan)
            continue
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value
        elif isinstance(value, np.ndarray | np.generic) and value.size == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):  # bool is an int, hence Real
            raise RewardError(
                f"reward {name!r} returned a {type(value).__name__} ({value!r:.40}) at index "
                f"{i}; scores must be numbers, booleans or None"
            )
        value = float(value)
        if math.isinf(value):
            raise RewardError(
                f"reward {name!r} returned {value} at index {i}; return None for a completion "
                "that cannot be scored"
            )
        scores.append(value)
    return scores


def score(
    fns: list[tuple[str, Callable[..., Any], dict[str, Any]]],
    prompts: list,
    completions: list[str],
    columns: dict[str, list],
) -> torch.Tensor:
    """Scores of every completion under every reward: float32 `[B, J]`, NaN where unscored.

    Each `(name, fn, kwargs)` is called as `fn(prompts, completions, **columns, **kwargs)`.
    """
    n = len(completions)
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    out = torch.full((n, len(fns)), math.nan, dtype=torch.float32)  # [B, J]
    for j, (name, fn, kwargs) in enumerate(fns):
        clash = sorted(set(kwargs) & set(columns))
        if clash:
            raise RewardError(
                f"reward {name!r}: kwarg {clash[0]!r} has the name of a column passed to every "
                "reward; rename the kwarg or the column"
            )
        try:
            result = fn(prompts, completions, **columns, **kwargs)
        except RewardError as e:
            raise RewardError(f"reward {name!r}: {e}") from e
        except Exception as e:
            raise RewardError(
                f"reward {name!r} raised {type(e).__name__}: {e}{_where(e)}"
            ) from e
        if n:
            out[:, j] = torch.tensor(_as_scores(name, result, n), dtype=torch.float32)
        else:
            _as_scores(name, result, n)
    return out

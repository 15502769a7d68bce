"""The reward contract (TRL's): resolve reward functions, call them, check their results.

A reward function is called by keyword, as TRL's GRPOTrainer calls it: ``prompts``,
``completions`` (strings, or ``[{"role": "assistant", "content": ...}]`` for chat tasks),
``completion_ids``, ``trainer_state``, ``log_extra``, ``log_metric`` and every column of the
row, plus mogrpo's ``completion_lengths`` and ``truncated``. Any signature that can take that
call works: ``f(completions, **kwargs)``, ``f(completions, solution, **kwargs)``, an
``async def`` (awaited concurrently with the others), or one without ``**kwargs`` (it gets
the arguments it names). It returns one score per completion, ``None`` where it cannot score;
``None`` is carried as NaN and never becomes a silent 0.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from mogrpo.data.schema import Example
from mogrpo.errors import RewardError
from mogrpo.rewards.builtin import (
    format_options,
    format_reward,
    length_options,
    length_penalty,
    mc_correct,
)
from mogrpo.rewards.code import code_options, code_tests
from mogrpo.rewards.columns import reward_columns
from mogrpo.rewards.verilog import verilog_options, verilog_tests
from mogrpo.user_loop import user_loop

BUILTIN_REWARDS: dict[str, Callable[..., list]] = {
    "mc_correct": mc_correct,
    "format": format_reward,
    "length_penalty": length_penalty,
    "code_tests": code_tests,
    "verilog_tests": verilog_tests,
}
# Each built-in's options that hold for every call (a pattern, bounds), checked with its
# kwargs before training, not at the first reward call after the model has loaded.
OPTION_CHECKS: dict[Callable[..., list], Callable[..., Any]] = {
    format_reward: format_options,
    length_penalty: length_options,
    code_tests: code_options,
    verilog_tests: verilog_options,
}
_P = inspect.Parameter
# What the trainer passes to every reward function by keyword (TRL's contract), besides the
# task's columns; and mogrpo's own additions.
TRAINER_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra",
                     "log_metric")
EXTRA_ARGUMENTS = ("completion_lengths", "truncated")
_FORMS = "a built-in name, package.module:function, or path/to/file.py:function"


def resolve_reward(spec: str) -> Callable[..., Any]:
    """The function named by `spec`: a builtin, `package.module:function` or `file.py:function`."""
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"reward function spec {spec!r} is empty; give {_FORMS}")
    spec = spec.strip()
    if spec.startswith("python:"):
        raise RewardError(
            f"reward {spec!r} was a Python function passed to mogrpo.train(); a run from the "
            "command line cannot import it: resume it from Python, passing the function again, "
            "or move it to a module and give package.module:function or path/to/file.py:function"
        )
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
    check_positional_only(fn, spec)
    return fn


def load_spec(spec: str, kind: str) -> Any:
    """The object `package.module:name` or `path/to/file.py:name` names (a tool, an
    environment class); errors name `kind` and the spec."""
    target, _, attr = spec.strip().rpartition(":")
    if not target or not attr:
        raise RewardError(f"{kind} {spec!r} is incomplete; give package.module:name or "
                          "path/to/file.py:name")
    is_file = target.endswith(".py") or "/" in target or "\\" in target
    module = _load_file(target, spec, kind) if is_file else _import_module(target, spec, kind)
    return _attribute(module, target, attr, spec, kind)


def _load_file(target: str, spec: str, kind: str = "reward") -> ModuleType:
    path = Path(target).expanduser()
    if not path.is_file():
        raise RewardError(
            f"{kind} {spec!r}: file {target} not found (resolved to {path.resolve()}); "
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
        raise RewardError(f"{kind} {spec!r}: {target} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise RewardError(
            f"{kind} {spec!r}: running {target} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e
    return module


def _import_module(target: str, spec: str, kind: str = "reward") -> ModuleType:
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as e:
        if e.name and (target == e.name or target.startswith(e.name + ".")):
            raise RewardError(
                f"{kind} {spec!r}: module {target!r} not found ({e.name!r} cannot be imported); "
                "install it, add its directory to PYTHONPATH, or give path/to/file.py:function"
            ) from None
        raise RewardError(
            f"{kind} {spec!r}: module {target!r} imports {e.name!r}, which is not installed; "
            f"install it{_where(e)}"
        ) from e
    except Exception as e:
        raise RewardError(
            f"{kind} {spec!r}: importing {target!r} raised {type(e).__name__}: {e}{_where(e)}"
        ) from e


def _attribute(module: ModuleType, target: str, attr: str, spec: str,
               kind: str = "reward") -> Any:
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
                f"{kind} {spec!r}: {target} has no attribute {attr!r}; {hint}functions defined "
                f"there: {', '.join(defined[:12]) or '(none)'}. Expected form: {_FORMS}"
            )
        obj = getattr(obj, part)
    return obj


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith("<")]
    return f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def _as_scores(name: str, result: Any, n: int, sources: list[str] | None = None) -> list[float]:
    """Check one function's return value against the contract; None and NaN become NaN.
    `sources` (each completion's data row, "file:row") are named in the errors."""
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
        at = f"at index {i}" + (f" (data row {sources[i]})" if sources else "")
        if value is None:
            scores.append(math.nan)
            continue
        if isinstance(value, torch.Tensor):
            value = value.item() if value.numel() == 1 else value
        elif isinstance(value, np.ndarray | np.generic) and value.size == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):  # bool is an int, hence Real
            raise RewardError(
                f"reward {name!r} returned a {type(value).__name__} ({value!r:.40}) {at}; "
                "scores must be numbers, booleans or None"
            )
        value = float(value)
        if math.isinf(value):
            raise RewardError(
                f"reward {name!r} returned {value} {at}; return None for a completion that "
                "cannot be scored"
            )
        scores.append(value)
    return scores



# ----------------------------------------------------------------------------- the call


@dataclass
class TrainerState:
    """What a reward function receives as `trainer_state` (the fields of TRL's, which passes
    transformers' `TrainerState`): progress, for rewards shaped by how far training is."""

    global_step: int = 0
    """Optimizer steps done before this rollout (0 while scoring the first step)."""
    max_steps: int = 0
    """Optimizer steps of the run (`train.max_steps`)."""
    epoch: float = 0.0
    """Passes over this task's prompts so far, fractional (1.5 = halfway through the second)."""
    is_world_process_zero: bool = True
    """Whether this is process 0 of the run (log from one process only)."""
    is_local_process_zero: bool = True
    """Whether this is process 0 of its machine."""


class RewardLog:
    """What reward functions logged through `log_extra` and `log_metric` (TRL's callbacks).

    `extra[column]` holds one value per completion of the calls so far (a column of the
    completions table); `metrics["LABEL/NAME"]` the scalars reward LABEL logged as NAME.
    Thread-safe: async reward functions run on another thread.
    """

    def __init__(self) -> None:
        self.extra: dict[str, list[Any]] = {}
        self.metrics: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def log_extra(self, column: str, values: list[Any]) -> None:
        with self._lock:
            self.extra.setdefault(str(column), []).extend(list(values))

    def metric_logger(self, label: str) -> Callable[[str, float], None]:
        """The `log_metric(name, value)` handed to reward `label`."""
        def log_metric(name: str, value: float) -> None:
            with self._lock:
                self.metrics.setdefault(f"{label}/{name}", []).append(float(value))
        return log_metric


@dataclass(frozen=True)
class _Plan:
    """How a reward function can be called by keyword."""

    names: frozenset[str]  # parameters that may be passed by keyword
    required: tuple[str, ...]  # ... and of those, the ones without a default
    takes_all: bool  # has **kwargs: everything is passed


def _plan(fn: Callable[..., Any]) -> _Plan | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C functions have no signature
        return None
    keyword = [p for p in params if p.kind in (_P.POSITIONAL_OR_KEYWORD, _P.KEYWORD_ONLY)]
    return _Plan(
        names=frozenset(p.name for p in keyword),
        required=tuple(p.name for p in keyword if p.default is _P.empty),
        takes_all=any(p.kind == _P.VAR_KEYWORD for p in params),
    )


def check_positional_only(fn: Callable[..., Any], spec: str) -> None:
    """Reward functions are called by keyword (as TRL calls them): a required positional-only
    parameter can never be filled."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return
    stuck = [p.name for p in params if p.kind == _P.POSITIONAL_ONLY and p.default is _P.empty]
    if stuck:
        raise RewardError(
            f"reward {spec!r}: parameter {stuck[0]!r} of {_signature(fn)} is positional-only, but "
            f"reward functions are called by keyword ({', '.join(TRAINER_ARGUMENTS)} and every "
            "column); remove the '/' and name it after the argument it wants"
        )


def check_reward_call(label: str, fn: Callable[..., Any], kwargs: dict[str, Any],
                      columns: list[str], where: str, fields_open: bool = False) -> None:
    """Fail before training on a function that cannot take the call: a required parameter
    that nothing fills, or a `kwargs` key it cannot receive or that hides a passed argument.

    `columns` are the task's data columns; `where` names the reward in the config;
    `fields_open`: a `rollout_func` may fill any parameter (its extra keys), so none is missing.
    """
    check_positional_only(fn, label)
    passed = [*TRAINER_ARGUMENTS, *EXTRA_ARGUMENTS]
    for key in kwargs:
        if key in passed or key in columns:
            what = "an argument the trainer passes" if key in passed else "a column of the data"
            raise RewardError(
                f"{where}: kwarg {key!r} of reward {label!r} has the name of {what}, which is "
                "passed to every reward; rename the kwarg (or the column)"
            )
    plan = _plan(fn)
    if plan is None:
        return
    # a built-in's **_ takes the trainer's arguments and the columns, never a kwarg: a kwarg it
    # does not name is a typo (`target` for `target_length`) that would be silently dropped
    builtin = any(fn is f for f in BUILTIN_REWARDS.values())
    for key in kwargs:
        if builtin and key not in plan.names:
            options = sorted(plan.names - set(passed))
            close = difflib.get_close_matches(key, options, n=1, cutoff=0.5)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise RewardError(
                f"{where}: kwarg {key!r} is not an option of the built-in reward {label!r}; "
                f"{hint}its options: {', '.join(options)}")
        if not plan.takes_all and key not in plan.names:
            raise RewardError(
                f"{where}: reward {label!r} {_signature(fn)} has no parameter {key!r} for its "
                f"kwarg; add the parameter or **kwargs, or remove {key!r} from kwargs"
            )
    available = {*passed, *columns, *kwargs}
    missing = [name for name in plan.required if name not in available]
    if missing and not fields_open:
        named = [n for n in plan.names if n in ("prompts", "completions", "completion_ids")]
        hint = (" Reward functions are called by keyword, as in TRL: name the parameters "
                "`prompts` and `completions` (or take **kwargs)." if not named else "")
        raise RewardError(
            f"{where}: reward {label!r} {_signature(fn)} needs {missing[0]!r}, which is neither "
            f"an argument the trainer passes ({', '.join(passed)}) nor a column of the task's "
            f"data ({', '.join(columns) or 'none'}) nor one of its kwargs; add the column, give "
            f"the parameter a default, or set it under kwargs.{hint}"
        )
    check = next((c for f, c in OPTION_CHECKS.items() if f is fn), None)
    if check is not None:  # a built-in's options: a bad pattern fails here, not after the load
        try:
            check(**kwargs)
        except RewardError as err:
            raise RewardError(f"{where}.kwargs: {err}") from None


def _signature(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__name__", type(fn).__name__)
    try:
        return f"{name}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return name


def _is_async(fn: Callable[..., Any]) -> bool:
    call = getattr(fn, "__call__", None)  # noqa: B004 - a callable object's own method
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call)


def call_reward(fn: Callable[..., Any], arguments: dict[str, Any]) -> Any:
    """Call `fn` by keyword with the `arguments` its signature takes (all of them if it has
    **kwargs); returns what it returns (a coroutine for an async function)."""
    plan = _plan(fn)
    if plan is not None and not plan.takes_all:
        arguments = {k: v for k, v in arguments.items() if k in plan.names}
    return fn(**arguments)


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def _failure(name: str, e: BaseException) -> RewardError:
    if isinstance(e, RewardError):
        return RewardError(f"reward {name!r}: {e}")
    return RewardError(f"reward {name!r} raised {type(e).__name__}: {e}{_where(e)}")


def score(
    fns: list[tuple[str, Callable[..., Any], dict[str, Any]]],
    prompts: list,
    completions: list,
    columns: dict[str, list],
    *,
    completion_ids: list[list[int]] | None = None,
    trainer_state: TrainerState | None = None,
    log: RewardLog | None = None,
    sources: list[str] | None = None,
) -> torch.Tensor:
    """Scores of every completion under every reward: float32 `[B, J]`, NaN where unscored.

    Each `(name, fn, kwargs)` is called by keyword, as TRL calls it: `prompts`, `completions`,
    `completion_ids`, `trainer_state`, `log_extra`, `log_metric`, every column and its own
    `kwargs` (a function without **kwargs gets the ones it names). Async functions run
    concurrently with each other and with the synchronous ones. `sources`: each
    completion's data row ("file:row"), named when a score breaks the contract.
    """
    n = len(completions)
    for key, values in columns.items():
        if len(values) != n:
            raise ValueError(f"column {key!r} has {len(values)} values for {n} completions")
    log = log if log is not None else RewardLog()
    common = {"prompts": prompts, "completions": completions,
              "completion_ids": completion_ids if completion_ids is not None else [[]] * n,
              "trainer_state": trainer_state or TrainerState(), "log_extra": log.log_extra,
              **columns}
    results: list[Any] = [None] * len(fns)
    pending: list[tuple[int, concurrent.futures.Future]] = []
    for j, (name, fn, kwargs) in enumerate(fns):
        clash = sorted(set(kwargs) & set(common))
        if clash:
            raise RewardError(
                f"reward {name!r}: kwarg {clash[0]!r} has the name of a column passed to every "
                "reward; rename the kwarg or the column"
            )
        arguments = {**common, "log_metric": log.metric_logger(name), **kwargs}
        try:
            result = call_reward(fn, arguments)
        except Exception as e:
            for _, other in pending:  # the async ones started so far would run on unseen
                other.cancel()
            raise _failure(name, e) from e
        if inspect.isawaitable(result):  # runs while the next ones are called, on the loop
            # async tools and environments' get_reward share (`mogrpo.user_loop`)
            pending.append((j, asyncio.run_coroutine_threadsafe(_awaited(result), user_loop())))
        else:
            results[j] = result
    for j, future in pending:
        try:
            results[j] = future.result()
        except Exception as e:
            for _, other in pending:
                other.cancel()
            raise _failure(fns[j][0], e) from e
    out = torch.full((n, len(fns)), math.nan, dtype=torch.float32)  # [B, J]
    for j, (name, _, _) in enumerate(fns):
        values = _as_scores(name, results[j], n, sources)
        if n:
            out[:, j] = torch.tensor(values, dtype=torch.float32)
    return out


def as_completions(prompts: list, texts: list[str]) -> list:
    """TRL's `completions`: the text, or for a chat prompt (a list of messages) the reply as
    `[{"role": "assistant", "content": text}]`."""
    return [[{"role": "assistant", "content": text}] if isinstance(prompt, list) else text
            for prompt, text in zip(prompts, texts, strict=True)]


def score_examples(
    fns: list[tuple[str, Callable[..., Any], dict[str, Any]]],
    examples: list[Example],
    texts: list[str],
    completion_ids: torch.Tensor,
    lengths: list[int],
    truncated: list[bool],
    *,
    trainer_state: TrainerState | None = None,
    log: RewardLog | None = None,
    extra_columns: dict[str, list] | None = None,
) -> torch.Tensor:
    """`score` for the completions of `examples` (one example per completion, each prompt's
    repeated K times): builds TRL's arguments and the columns. `completion_ids` [B, C] is
    right-padded, row b holding `lengths[b]` tokens; `extra_columns` (one value per
    completion) are passed too (`environments`: each rollout's environment). Returns float32
    `[B, J]`."""
    columns = reward_columns(examples, lengths, truncated) | (extra_columns or {})
    prompts = [ex.prompt for ex in examples]
    ids = [row[:n] for row, n in zip(completion_ids.tolist(), lengths, strict=True)]
    return score(fns, prompts, as_completions(prompts, texts), columns, completion_ids=ids,
                 trainer_state=trainer_state, log=log, sources=[ex.source for ex in examples])

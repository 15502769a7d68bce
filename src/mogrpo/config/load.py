"""Loading the run configuration: layered sources, validation before any model loads, and
the field reference.

Priority (highest wins): ``--set section.key=value`` > environment ``MOGRPO_SECTION__KEY`` >
the YAML file > the section defaults (`mogrpo.config.sections`). Every field
carries its documentation in the docstring right under it; ``mogrpo config show`` prints
where each resolved value came from.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from mogrpo.config import engines
from mogrpo.config.hardware import quantized_field, small_gpu_errors
from mogrpo.config.machine import machine_errors
from mogrpo.config.model_limits import chat_template_errors, model_errors
from mogrpo.config.precision import dtype_conflict
from mogrpo.config.rollout import derive_lengths
from mogrpo.config.sections import RunConfig, TaskConfig
from mogrpo.errors import ConfigError

ENV_PREFIX = "MOGRPO_"


# ----------------------------------------------------------------------------- sources


class Sourced:
    """A merged raw config dict plus, per dotted key, where its value came from."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {}
        self.origin: dict[str, str] = {}

    def merge(self, values: Mapping[str, Any], origin: str, prefix: str = "") -> None:
        self._merge_into(self.data, values, origin, prefix)

    def _merge_into(self, target: dict, values: Mapping, origin: str, prefix: str) -> None:
        for key, value in values.items():
            path = f"{prefix}{key}"
            if isinstance(value, Mapping) and isinstance(target.get(key), dict):
                self._merge_into(target[key], value, origin, path + ".")
            elif isinstance(value, Mapping) and isinstance(target.get(key), list) and value \
                    and all(str(k).isdigit() for k in value):
                self._merge_items(target[key], value, origin, path)
            else:
                target[key] = _copy(value)
                self._record(path, value, origin)

    def _merge_items(self, items: list, values: Mapping, origin: str, path: str) -> None:
        """`--set tasks.t.rewards.0.weight=0.5`: into an item of a list, named by its index as
        `config show` names it (a reward written as its name becomes {fn: name})."""
        for index, value in values.items():
            i = int(index)
            if i >= len(items):
                raise ConfigError(f"`{path}.{index}` (from {origin}): {path} has {len(items)} "
                                  f"item(s), 0 to {len(items) - 1}; to add one, set the whole "
                                  f"list: {path}=[...]")
            if isinstance(items[i], str) and path.endswith(".rewards"):
                items[i] = {"fn": items[i]}
            if isinstance(value, Mapping) and isinstance(items[i], dict):
                self._merge_into(items[i], value, origin, f"{path}.{i}.")
            else:
                items[i] = _copy(value)
                self._record(f"{path}.{i}", value, origin)

    def _record(self, path: str, value: Any, origin: str) -> None:
        if isinstance(value, Mapping) and value:
            for key, sub in value.items():
                self._record(f"{path}.{key}", sub, origin)
        else:
            self.origin[path] = origin


def _copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def _nested(dotted: str, value: Any) -> dict[str, Any]:
    keys = dotted.split(".")
    out: dict[str, Any] = {keys[-1]: value}
    for key in reversed(keys[:-1]):
        out = {key: out}
    return out


def parse_value(text: str) -> Any:
    """Parse a command-line or environment value the way YAML would (`0.7`, `true`, `[1, 2]`)."""
    try:
        return yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text


def parse_set(item: str) -> tuple[str, Any]:
    """Split one `--set section.key=value` argument."""
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(
            f"--set {item!r}: expected `section.key=value`, e.g. --set rollout.temperature=0.7"
        )
    return key.strip(), parse_value(value)


def env_overrides(environ: Mapping[str, str]) -> dict[str, tuple[str, Any]]:
    """`MOGRPO_ROLLOUT__TEMPERATURE=0.7` → {"rollout.temperature": ("MOGRPO_…", 0.7)}."""
    found = {}
    for name, value in sorted(environ.items()):
        if not name.startswith(ENV_PREFIX):
            continue
        dotted = name[len(ENV_PREFIX):].lower().replace("__", ".")
        # Only names that address a config field; MOGRPO_JUDGE_KEY and the like are left alone.
        if dotted.split(".", 1)[0] in RunConfig.model_fields:
            found[dotted] = (name, parse_value(value))
    return found


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass the path of a YAML config")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
    environ: Mapping[str, str] | None = None,
    base: Mapping[str, Any] | None = None,
    arguments: Mapping[str, Any] | None = None,
    *,
    machine: bool = True,
) -> tuple[RunConfig, dict[str, str]]:
    """Resolve defaults < `base` < file < environment < `arguments` (keyword arguments of
    `mogrpo.Config`) < `--set` into a validated RunConfig.

    `machine=False` leaves out what only this machine decides (vLLM installed, a CUDA GPU,
    bfloat16, bitsandbytes), for commands that read a config meant for another machine
    (`memory`, `config show`, `data check`); what the model's files decide is checked either
    way. Returns the config and the origin of every value that did not come from the defaults
    (a budget lowered to the model's positions: `model limit (…)`).
    """
    sourced = Sourced()
    if base:
        sourced.merge(base, "built-in")
    if path is not None:
        sourced.merge(read_yaml(path), f"file {path}")
    for dotted, (name, value) in env_overrides(os.environ if environ is None else environ).items():
        sourced.merge(_nested(dotted, value), f"env {name}")
    if arguments:
        sourced.merge(arguments, "Python argument")
    for item in overrides:
        dotted, value = parse_set(item)
        sourced.merge(_nested(dotted, value), f"--set {dotted}")
    check_unknown_keys(sourced.data, RunConfig, sourced.origin)
    check_task_names(sourced)
    try:
        config = RunConfig.model_validate(sourced.data)
    except ValidationError as err:
        raise ConfigError(_format_validation(err, sourced.origin)) from None
    validate(config, machine=machine)
    for key, note in config.limit_notes.items():  # `config show`: why the value changed
        was = _source(key, sourced.origin)
        sourced.origin[key] = f"model limit ({note.split(', ')[0]}; was {was})"
    return config, sourced.origin


# ----------------------------------------------------------------------------- validation


def check_unknown_keys(data: Any, model: type[BaseModel], origin: dict[str, str], prefix: str = "") -> None:
    """Reject keys the schema does not know, with a "did you mean" hint and their source."""
    if not isinstance(data, Mapping):
        return
    fields = model.model_fields
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in fields:
            hint = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            where = _origin_of(path, origin)
            fix = f"did you mean `{prefix}{hint[0]}`?" if hint else (
                f"known keys here: {', '.join(fields)}"
            )
            raise ConfigError(f"unknown config key `{path}`{where}; {fix}")
        annotation = fields[key].annotation
        nested = _nested_model(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            check_unknown_keys(value, annotation, origin, path + ".")
        elif model is RunConfig and key == "tasks" and isinstance(value, Mapping):
            for name, task in value.items():
                check_unknown_keys(task, TaskConfig, origin, f"tasks.{name}.")
        elif nested is not None and nested[1] == "[]." and isinstance(value, list):
            for i, item in enumerate(value):  # rewards, curriculum stages
                check_unknown_keys(item, nested[0], origin, f"{path}.{i}.")
        elif nested is not None:
            check_unknown_keys(value, nested[0], origin, path + ".")


def check_task_names(sourced: Sourced) -> None:
    """A task only `--set` or the environment names, without `data`: a misspelt task name
    (`--set tasks.fairnes.beta=0.05`), not a new task."""
    tasks = sourced.data.get("tasks")
    if not isinstance(tasks, Mapping):
        return
    for name, task in tasks.items():
        sources = {v for k, v in sourced.origin.items() if k.startswith(f"tasks.{name}.")}
        if not isinstance(task, Mapping) or "data" in task or not sources or not all(
                v.startswith(("--set ", "env ")) for v in sources):
            continue
        others = [str(n) for n in tasks if n != name]
        hint = difflib.get_close_matches(str(name), others, n=1, cutoff=0.6)
        raise ConfigError(
            f"`tasks.{name}` (from {sorted(sources)[0]}) is not a task of this config (its "
            f"tasks: {', '.join(others) or 'none'}); "
            + (f"did you mean `tasks.{hint[0]}`?" if hint else
               f"a new task needs `tasks.{name}.data` and `tasks.{name}.rewards` too"))


def _origin_of(path: str, origin: dict[str, str]) -> str:
    source = origin.get(path) or next(
        (v for k, v in origin.items() if k.startswith(path + ".")), None
    )
    parts = path.split(".")
    while source is None and len(parts) > 1:  # inside a list: the list's own source
        parts.pop()
        source = origin.get(".".join(parts))
    return f" (from {source})" if source else ""


def _format_validation(err: ValidationError, origin: dict[str, str]) -> str:
    lines = ["invalid config:"]
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        value = e.get("input")
        shown = "" if isinstance(value, dict) else f" = {value!r}"
        lines.append(f"  {path}{shown}{_origin_of(path, origin)}: {e['msg']}")
    return "\n".join(lines)


def validate(config: RunConfig, *, machine: bool = True) -> None:
    """Cross-field checks, and what the model's config.json and tokenizer files decide
    (`model_limits`: budgets lowered to its positions are noted in `config.limit_notes`);
    every message names the field, the value and the fix. `machine`: also what this machine
    must have for the run (`config.machine`; see `load_config`)."""
    errors: list[str] = []
    ro, tr = config.rollout, config.train
    if not config.model.name_or_path:
        errors.append("model.name_or_path is not set: give a local model directory or a hub id")
    conflict = dtype_conflict(config.model.precision, config.model.dtype)
    if conflict:
        errors.append(conflict)
    if not config.tasks:
        errors.append("no tasks: add at least one under `tasks:` with `data` and `rewards`")
    for name, task in config.tasks.items():
        if not task.rewards:
            errors.append(
                f"tasks.{name}.rewards is empty: add a reward, e.g. `rewards: [mc_correct]`"
            )
    errors.extend(_task_control_errors(config))
    errors.extend(small_gpu_errors(config, machine))
    if ro.engine == "vllm":
        errors.extend(_vllm_errors(config, machine))
    if ro.num_generations < 2:
        errors.append(
            f"rollout.num_generations = {ro.num_generations}: GRPO needs at least 2 completions "
            "per prompt to compare them; set it to 2 or more (4–8 is typical)"
        )
    completions = tr.micro_batch_size * tr.gradient_accumulation_steps
    if ro.num_generations >= 2 and completions % ro.num_generations:
        errors.append(
            f"train.micro_batch_size × train.gradient_accumulation_steps = {completions} "
            f"completions per step is not a multiple of rollout.num_generations = "
            f"{ro.num_generations}: each prompt's {ro.num_generations} completions must all "
            f"be in the step; use e.g. micro_batch_size = {ro.num_generations * max(1, tr.micro_batch_size // ro.num_generations)}"
        )
    length_errors = _length_errors(config)
    errors.extend(length_errors)
    if config.model.name_or_path and not length_errors:
        found, notes = model_errors(config, machine)  # reads config.json: no weights, no torch
        errors.extend(found)
        config.limit_notes.update(notes)
    errors.extend(chat_template_errors(config))
    if config.algorithm.kl_importance_weight == "detached" and config.algorithm.num_iterations == 1:
        errors.append(
            "algorithm.kl_importance_weight = detached has no effect with "
            "algorithm.num_iterations = 1 (the ratio is 1); set num_iterations ≥ 2, use "
            "`differentiable` (TRL's use_bias_correction_kl), or turn it off"
        )
    if config.eval.reward is not None:
        for name, task in config.tasks.items():
            labels = task.objective_labels()
            if config.eval.reward not in labels:
                errors.append(
                    f"eval.reward = {config.eval.reward!r} is not a reward of task {name!r} "
                    f"(it has {', '.join(labels)})"
                )
    try:
        config.curriculum.check_tasks({n: t.weight for n, t in config.tasks.items()})
    except ConfigError as err:
        errors.append(str(err))
    if machine:
        errors.extend(machine_errors(config))
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def _length_errors(config: RunConfig) -> list[str]:
    """The rollout lengths against each other and rollout.max_seq_length (the model's limits:
    `model_limits`)."""
    ro = config.rollout
    if ro.length_allocation != "explicit" and (
        ro.max_prompt_length is not None or ro.max_completion_length is not None
    ):
        return [
            f"rollout.length_allocation = {ro.length_allocation} derives both lengths from "
            "rollout.max_seq_length; remove max_prompt_length/max_completion_length or set "
            "length_allocation: explicit"
        ]
    prompt, completion = derive_lengths(ro)
    if prompt < 1 or completion < 1 or prompt + completion > ro.max_seq_length:
        return [
            f"rollout.max_prompt_length ({prompt}) + rollout.max_completion_length "
            f"({completion}) = {prompt + completion} exceeds rollout.max_seq_length "
            f"({ro.max_seq_length}); shorten one of them or raise max_seq_length"
        ]
    return []


def _vllm_errors(config: RunConfig, machine: bool = True) -> list[str]:
    """`rollout.engine: vllm`: settings vLLM cannot honour, then (with `machine`) the machine:
    vLLM and CUDA."""
    errors = []
    low, high = engines.PENALTY_RANGE
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(config.rollout, name)
        if not low <= value <= high:
            errors.append(f"rollout.{name} = {value} is outside vLLM's range [{low}, {high}]; "
                          "bring it inside or use rollout.engine: auto")
    quantized = quantized_field(config.model)
    if quantized:
        errors.append(f"rollout.engine = vllm cannot follow a quantised policy (its weight push "
                      f"needs unquantised weights); set {quantized}: false or use engine: auto")
    if config.rollout.vllm.server_url is not None:
        return errors  # vLLM and its GPU are the server's; the trainer only talks to it
    if config.device == "cpu":
        errors.append("rollout.engine = vllm needs device: cuda (or auto on a GPU machine), "
                      "or a vllm-server on another machine (rollout.vllm.server_url)")
    elif machine:
        reason = engines.vllm_unavailable_reason()
        if reason is not None:
            errors.append(reason)
    return errors


def _task_control_errors(config: RunConfig) -> list[str]:
    """KL controllers and reward-weight schedules, checked by building them."""
    from mogrpo.algo.kl_control import make_controller
    from mogrpo.algo.schedules import from_config

    errors = []
    for name, task in config.tasks.items():
        try:
            make_controller(name, task.kl.kind, task.beta, **task.kl.options())
        except ConfigError as err:
            errors.append(str(err))
        for i, reward in enumerate(task.rewards):
            try:
                from_config(reward.weight, where=f"tasks.{name}.rewards.{i}.weight")
            except ConfigError as err:
                errors.append(str(err))
    return errors


def describe(config: RunConfig, origin: dict[str, str]) -> list[tuple[str, Any, str]]:
    """(dotted key, value, source) for every leaf of the resolved config."""
    rows: list[tuple[str, Any, str]] = []

    def walk(value: Any, path: str) -> None:
        if isinstance(value, dict) and value and path != "" and not path.endswith("kwargs"):
            for key, sub in value.items():
                walk(sub, f"{path}.{key}" if path else key)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, sub in enumerate(value):
                walk(sub, f"{path}.{i}")
        else:
            rows.append((path, value, _source(path, origin)))

    dumped = config.model_dump(mode="json")
    for key, value in dumped.items():
        if isinstance(value, dict) and value:
            walk(value, key)
        else:
            rows.append((key, value, _source(key, origin)))
    rows.extend(_derived(config))
    return rows


def _source(path: str, origin: dict[str, str]) -> str:
    """Where a value came from: its own entry, or the nearest ancestor's (lists, shorthands)."""
    parts = path.split(".")
    for end in range(len(parts), 0, -1):
        found = origin.get(".".join(parts[:end]))
        if found:
            return found
    return "default"


def _derived(config: RunConfig) -> list[tuple[str, Any, str]]:
    prompt, completion = derive_lengths(config.rollout)
    return [
        ("rollout.max_prompt_length (resolved)", prompt, f"derived: {config.rollout.length_allocation}"),
        ("rollout.max_completion_length (resolved)", completion, f"derived: {config.rollout.length_allocation}"),
        ("prompts per step", config.prompts_per_step, "derived: micro_batch × accumulation / K"),
    ]


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} → {"a.b": 1} (empty dicts stay leaves)."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for key, sub in value.items():
            out.update(flatten(sub, f"{prefix}{key}."))
        return out
    return {prefix.rstrip("."): value}


def to_yaml(config: RunConfig) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False, allow_unicode=True)


def _nested_model(annotation: Any) -> tuple[type[BaseModel], str] | None:
    """`list[Section]` → (Section, "[]."); `Section | None` and `str | Section` → (Section, ".");
    else None."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    if len(models) == 1 and (len(args) == 1 or get_origin(annotation) is not list):
        return models[0], "[]." if get_origin(annotation) is list else "."
    return None


def _scalar_or_section(annotation: Any) -> bool:
    """`str | Section` (e.g. `data`): a value of its own as well as a section."""
    args = [a for a in get_args(annotation) if a is not type(None)]
    return len(args) > 1 and _nested_model(annotation) is not None


def field_reference() -> str:
    """Markdown reference of every config field: key, type, default, meaning."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, info in model.model_fields.items():
            annotation = info.annotation
            key = f"{prefix}{name}"
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                walk(annotation, key + ".")
                continue
            if model is RunConfig and name == "tasks":
                walk(TaskConfig, "tasks.NAME.")
                continue
            nested = _nested_model(annotation)
            if nested is not None and not _scalar_or_section(annotation):
                walk(nested[0], key + nested[1])  # a list of sections, or an optional section
                continue
            default = "required" if info.is_required() else (
                "{}" if info.default_factory is dict else
                "[]" if info.default_factory is list else repr(info.default)
            )
            literal = [a for a in get_args(annotation) if get_origin(a) is Literal
                       and type(None) in get_args(annotation)]
            if get_origin(annotation) is Literal:
                kind = " / ".join(map(str, get_args(annotation)))
            elif literal:  # an optional choice: `a / b / null`
                kind = " / ".join([*map(str, get_args(literal[0])), "null"])
            elif nested is not None:
                kind = " | ".join("{…}" if a is nested[0] else getattr(a, "__name__", str(a))
                                    for a in get_args(annotation)).replace("NoneType", "None")
            else:
                kind = getattr(annotation, "__name__", None) or str(annotation).replace(
                    "typing.", "").replace("collections.abc.Callable[..., Any]", "function")
            cells = [f"`{key}`", kind, default, (info.description or "").replace("\n", " ")]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
            if nested is not None:  # `str | Section`: its own row, then the section's
                walk(nested[0], key + nested[1])

    walk(RunConfig, "")
    return "\n".join(lines)

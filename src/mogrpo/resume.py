"""Config drift between a checkpoint and the config a run is resumed with, and log repair.

Settings that do not change the math done so far (total steps, logging and eval intervals,
output locations) may change on resume; they are listed. Anything else — model, LoRA, tasks
and rewards, lengths, K, algorithm, optimiser — refuses the resume with a field-by-field
diff, unless the user explicitly allows it (then the diff is logged and recorded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mogrpo.checkpoint import CheckpointError
from mogrpo.config import RunConfig, flatten, to_yaml

ALLOWED_PREFIXES = (
    "train.max_steps",
    "logging.",
    "eval.every_steps",
    "eval.print_samples",
    "output.",
)
# Per-task settings that only decide whether data is accepted, not what is trained on.
ALLOWED_TASK_FIELDS = ("strict",)


@dataclass(frozen=True)
class Change:
    """One config field that differs between the checkpoint and the new config."""

    key: str
    old: Any
    new: Any

    @property
    def allowed(self) -> bool:
        if self.key.startswith("tasks.") and self.key.rsplit(".", 1)[-1] in ALLOWED_TASK_FIELDS:
            return True
        return any(self.key == p or (p.endswith(".") and self.key.startswith(p))
                   for p in ALLOWED_PREFIXES)

    def __str__(self) -> str:
        return f"{self.key}: {json.dumps(self.old)} -> {json.dumps(self.new)}"


def config_hash(config: RunConfig) -> str:
    return hashlib.sha256(to_yaml(config).encode("utf-8")).hexdigest()[:16]


def config_diff(saved_yaml: str, config: RunConfig) -> list[Change]:
    """Field-by-field differences, saved (old) vs the new config."""
    old = flatten(yaml.safe_load(saved_yaml) or {})
    new = flatten(config.model_dump(mode="json"))
    keys = sorted(set(old) | set(new))
    return [Change(k, old.get(k), new.get(k)) for k in keys if old.get(k) != new.get(k)]


def check_drift(changes: list[Change], allow: bool, checkpoint: Path) -> list[Change]:
    """Raise on a change that alters the math, unless allowed; return the changes to record."""
    forbidden = [c for c in changes if not c.allowed]
    if forbidden and not allow:
        raise CheckpointError(
            f"the config differs from the one checkpoint {checkpoint} was trained with:\n  "
            + "\n  ".join(str(c) for c in forbidden)
            + "\nthese change the training math, so resuming would not continue the same run; "
            "restore them, start a new run, or pass --allow-config-change to resume anyway "
            "(the change is then recorded in config_changes.jsonl)"
        )
    return changes


def truncate_jsonl(path: Path, last_step: int, key: str = "step") -> int:
    """Drop lines written after `last_step` (and a half-written last line); returns how many."""
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        if isinstance(record.get(key), int) and record[key] > last_step:
            dropped += 1
            continue
        kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    return dropped


def doctor_report(path: Path, config: RunConfig | None = None,
                  problems: list[str] | None = None) -> str:
    """`mogrpo doctor CHECKPOINT`: integrity per file, step, config, versions then and now,
    controller states, and whether resuming with `config` would be allowed. What is wrong (a
    damaged checkpoint, a refused resume) is also appended to `problems`."""
    from mogrpo.checkpoint import CONFIG, MANIFEST, STATE, VERSIONS, verify, versions

    problems = [] if problems is None else problems
    status = verify(path)
    if not status.ok:
        problems.append(f"checkpoint {path} is {status.status}")
    lines = [f"checkpoint {path}", f"  status   {status.status}  (step {status.step})"]
    names = sorted(_read_json(path / MANIFEST).get("files", {}))
    for name in names:
        problem = next((p for p in status.problems if p.startswith(name + " ")), None)
        lines.append(f"  {name:<22} {problem or 'ok'}")
    lines += [f"  {p}" for p in status.problems if not any(p.startswith(n + " ") for n in names)]
    saved = _read_yaml(path / CONFIG)
    state = _read_json(path / STATE)
    if saved:
        tasks = saved.get("tasks", {})
        lora = saved.get("lora", {})
        ro = saved.get("rollout", {})
        lines += [
            "config",
            f"  model    {saved.get('model', {}).get('name_or_path')}  "
            f"lora {'r ' + str(lora.get('r')) if lora.get('enabled') else 'off'}",
            "  tasks    " + ", ".join(f"{n} (beta {t.get('beta')})" for n, t in tasks.items()),
            f"  K {ro.get('num_generations')}  max_seq_length {ro.get('max_seq_length')}  "
            f"max_steps {saved.get('train', {}).get('max_steps')}",
            f"  hash     {state.get('config_hash')}",
        ]
    if state:
        trainer = state.get("trainer", {})
        mixer = trainer.get("mixer", {})
        lines += ["state",
                  f"  step {trainer.get('step')}  skipped updates {trainer.get('skipped_updates')}"
                  f"  sft done {state.get('sft_done')}",
                  f"  task sampler: epoch {mixer.get('epoch')} position {mixer.get('position')}"]
        for name, ctrl in zip(saved.get("tasks", {}), trainer.get("kl_controllers", []), strict=False):
            lines.append(f"  KL controller {name}: {ctrl}")
    then = _read_json(path / VERSIONS)
    if then:
        now = versions()
        lines.append("versions (then -> now)")
        for name in sorted(set(then) | set(now)):
            mark = "" if then.get(name) == now.get(name) else "   <- changed"
            lines.append(f"  {name:<13} {then.get(name)} -> {now.get(name)}{mark}")
    if config is not None and saved:
        changes = config_diff((path / CONFIG).read_text(encoding="utf-8"), config)
        verdict = "refused" if any(not c.allowed for c in changes) else "allowed"
        if verdict == "refused":
            problems.append("a resume with the given config would be refused")
        lines.append(f"resume with the given config: {verdict}")
        lines += [f"  {'allowed' if c.allowed else 'REFUSED'}  {c}" for c in changes] or ["  no changes"]
    return "\n".join(lines)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        return yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return {}

"""`mogrpo doctor CHECKPOINT`: what a checkpoint holds and whether a config may resume it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from mogrpo.checkpoint.resume import config_diff
from mogrpo.checkpoint.store import (
    CONFIG,
    FORMAT_SHARDED,
    MANIFEST,
    STATE,
    VERSIONS,
    verify,
    versions,
)
from mogrpo.config import RunConfig


def doctor_report(path: Path, config: RunConfig | None = None,
                  problems: list[str] | None = None) -> str:
    """`mogrpo doctor CHECKPOINT`: integrity per file, step, config, versions then and now,
    controller states, and whether resuming with `config` would be allowed. What is wrong (a
    damaged checkpoint, a refused resume) is also appended to `problems`."""
    problems = [] if problems is None else problems
    status = verify(path)
    if not status.ok:
        problems.append(f"checkpoint {path} is {status.status}")
    lines = [f"checkpoint {path}", f"  status   {status.status}  (step {status.step})"]
    manifest = _read_json(path / MANIFEST)
    if manifest.get("format") == FORMAT_SHARDED:
        lines.append(f"  format   sharded (torch.distributed.checkpoint): "
                     f"{manifest.get('world_size')} processes, strategy {manifest.get('strategy')}")
    names = sorted(manifest.get("files", {}))
    for name in names:
        problem = next((p for p in status.problems if p.startswith(name + " ")), None)
        lines.append(f"  {name:<26} {problem or 'ok'}")
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

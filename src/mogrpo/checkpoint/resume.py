"""Config drift between a checkpoint and the config a run is resumed with.

Settings that do not change the math done so far (total steps, logging and eval intervals,
output locations, how a step's completions are split into passes) may change on resume; they
are listed. Anything else — model, LoRA, tasks and rewards, lengths, K, algorithm, optimiser —
refuses the resume with a field-by-field diff, unless the user explicitly allows it (then the
diff is logged and recorded).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mogrpo.checkpoint.store import CheckpointError
from mogrpo.config import RunConfig, flatten, to_yaml

ALLOWED_PREFIXES = (
    "train.max_steps",
    "train.host_memory",
    "memory.",  # what an out-of-memory error costs; the sizes it adapted are in the state
    "rollout.vllm.server_url",  # where the server runs; it gets the weights before sampling
    "rollout.vllm.server_timeout_s",
    "logging.",
    "eval.every_steps",
    "eval.print_samples",
    "output.",
)
# Per-task settings that only decide whether data is accepted, not what is trained on.
ALLOWED_TASK_FIELDS = ("strict",)
# How a step's completions are split into passes (memory, not math): `memory.on_oom` halves
# them in a run, and the way to go on after an out-of-memory error it cannot redo is to lower
# them and resume; allowed while the step keeps its completions (micro × accumulation).
BATCH_SPLIT = ("train.micro_batch_size", "train.gradient_accumulation_steps",
               "rollout.generation_batch_size")


@dataclass(frozen=True)
class Change:
    """One config field that differs between the checkpoint and the new config."""

    key: str
    old: Any
    new: Any
    same_step: bool = False
    """A `BATCH_SPLIT` size whose change leaves the step's completions as they were."""

    @property
    def allowed(self) -> bool:
        if self.same_step:
            return True
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
    completions = _step_completions(old)
    same_step = completions is not None and completions == _step_completions(new)
    return [Change(k, old.get(k), new.get(k), same_step and k in BATCH_SPLIT)
            for k in keys if old.get(k) != new.get(k)]


def _step_completions(flat: dict[str, Any]) -> Any:
    """Completions per optimizer step (None where a size is missing)."""
    micro, accumulation = (flat.get(f"train.{k}") for k in
                           ("micro_batch_size", "gradient_accumulation_steps"))
    return micro * accumulation if micro and accumulation else None


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

"""Checkpoints that never lie: atomic save, manifest and verification (`store`), the sharded
state of several processes (`sharded`, imported on its own: it loads torch.distributed.checkpoint),
config drift on resume (`resume`), and `mogrpo doctor CHECKPOINT` (`doctor`)."""

from mogrpo.checkpoint.resume import Change, check_drift, config_diff, config_hash
from mogrpo.checkpoint.store import (
    CHECKPOINTS,
    STATE,
    CheckpointError,
    CheckpointStatus,
    Loaded,
    find_resume,
    list_checkpoints,
    load_checkpoint,
    load_weights,
    prune,
    restore_rng,
    save_checkpoint,
    verify,
)

__all__ = [
    "CHECKPOINTS", "STATE", "Change", "CheckpointError", "CheckpointStatus", "Loaded",
    "check_drift", "config_diff", "config_hash", "find_resume", "list_checkpoints",
    "load_checkpoint", "load_weights", "prune", "restore_rng", "save_checkpoint", "verify",
]

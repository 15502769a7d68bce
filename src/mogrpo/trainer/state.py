"""The run's state: everything a resume needs, collected from the parts that own it and saved
and restored in one place.

A checkpoint (`mogrpo.checkpoint.store`) is this state on disk:

| part | owner | in the checkpoint |
|---|---|---|
| trainable weights | the policy | weights.safetensors |
| optimizer state (`train.optimizer`: AdamW's moments, …) | `GRPOTrainer.optimizer` | optimizer.pt |
| Python, NumPy, torch and CUDA RNGs | the process | rng.safetensors (restored last) |
| step, skipped updates, task mixer, KL controllers, their KL window and β-change log, curriculum, health monitor, judges | `GRPOTrainer` | trainer_state.json `trainer` |
| learning-rate schedule | `GRPOTrainer.scheduler` | `scheduler` |
| eval records (the lines of eval.jsonl), scores, Pareto front | `QuickEval` | `quick_eval` |
| tracker run ids (W&B, MLflow, TensorBoard directory) | `Trackers` (read when they start) | `trackers` |
| SFT done, the summary so far, the config's hash | the run | `sft_done`, `summary`, `config_hash` |

The run's append-only logs are made to agree with the checkpoint on resume, whatever the
moment of the kill: metrics.jsonl is cut back to the checkpoint's step, eval.jsonl is
rewritten from the eval records (so the final `end` eval, which runs after the last
checkpoint, is written once), and the β-change and curriculum logs come back with the state.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from mogrpo.checkpoint import sharded, store
from mogrpo.checkpoint.resume import check_drift, config_diff, config_hash
from mogrpo.checkpoint.store import CheckpointError, Loaded
from mogrpo.config import RunConfig, to_yaml
from mogrpo.eval.quick_eval import QuickEval
from mogrpo.tasks.context import TrainContext
from mogrpo.tracking.jsonl import MetricsWriter, rewrite_jsonl, truncate_jsonl
from mogrpo.tracking.trackers import Trackers
from mogrpo.trainer.completions import COMPLETIONS_FILE
from mogrpo.trainer.distributed import Dist, weights_checksum
from mogrpo.trainer.grpo import GRPOTrainer

log = logging.getLogger(__name__)

METRICS_LOG = "metrics.jsonl"
EVAL_LOG = "eval.jsonl"


@dataclass
class RunState:
    """Everything a resume needs (see the module docstring for what lives where)."""

    config: RunConfig
    ctx: TrainContext
    trainer: GRPOTrainer
    quick_eval: QuickEval
    trackers: Trackers
    summary: dict[str, Any]
    sft_done: bool
    dist: Dist
    run_dir: Path
    main_dir: Path
    """Process 0's run directory (processes r > 0 read its weights and optimizer)."""

    def state_dict(self) -> dict[str, Any]:
        """The JSON part (the weights, optimizer and RNGs are saved as tensors beside it)."""
        return {"trainer": self.trainer.state_dict(),
                "scheduler": self.trainer.scheduler.state_dict(),
                "quick_eval": self.quick_eval.state_dict(), "sft_done": self.sft_done,
                "config_hash": config_hash(self.config), "summary": self.summary,
                "trackers": self.trackers.state_dict(), "world_size": self.dist.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the JSON part; the trackers read theirs when they start (`Trackers(state=)`)."""
        self.trainer.scheduler.load_state_dict(state["scheduler"])
        self.trainer.load_state_dict(state["trainer"])
        self.quick_eval.load_state_dict(state["quick_eval"])
        # this process's own run directory stays (a sharded checkpoint holds process 0's state)
        self.summary.update({k: v for k, v in state.get("summary", {}).items() if k != "run_dir"})
        self.sft_done = bool(state["sft_done"])

    @property
    def sharded(self) -> bool:
        """Checkpoints in the sharded format (DCP): under FSDP2, and with one process when
        `distributed.strategy` is fsdp, so that they resume at any number of processes."""
        return self.trainer.parallel.is_fsdp or self.config.distributed.strategy == "fsdp"

    def save(self, step: int) -> Path:
        """Checkpoint `step`: make the trackers durable, write every part, prune old ones.

        Processes r > 0 hold the same weights and optimizer as process 0, so they save their
        state and RNG only; a checksum of the weights proves they do. Under FSDP2 each holds a
        shard: every process writes its shard and RNGs into one checkpoint of process 0's run
        directory (`checkpoint.sharded`), which process 0 seals with one manifest."""
        self.trackers.barrier()
        state = self.state_dict()
        main = self.dist.is_main
        if self.sharded:
            path = sharded.save_sharded(self.main_dir, step, model=self.ctx.policy,
                                        optimizer=self.trainer.optimizer, state=state,
                                        config_yaml=to_yaml(self.config), strategy="fsdp")
        else:
            model, optimizer = self.ctx.policy, self.trainer.optimizer
            state["weights_checksum"] = weights_checksum(model)
            sums = self.dist.gather(state["weights_checksum"])
            if len(set(sums)) > 1:
                raise CheckpointError(f"step {step}: the processes' weights differ (checksums "
                                      f"{sums}); not saving a checkpoint that would hide it")
            path = store.save_checkpoint(self.run_dir, step, model=model if main else None,
                                         optimizer=optimizer if main else None,
                                         state=state, config_yaml=to_yaml(self.config))
        pareto = self.quick_eval.pareto.to_json()
        protected = {p["step"] for p in pareto["front"]}
        protected |= {p["step"] for p in pareto["best"].values()}
        # never the one just written: after a resume from an older step, newer ones are there
        protected.add(step)
        if main or not self.sharded:  # one sharded checkpoint: process 0's
            store.prune(self.run_dir, self.config.output.keep_last, protected)
        log.info("checkpoint saved: %s", path)
        return path

    def restore(self, loaded: Loaded | sharded.ShardedLoaded) -> None:
        """Put a verified checkpoint back into every part; the RNGs last, as nothing may draw
        from them afterwards."""
        if isinstance(loaded, sharded.ShardedLoaded):
            loaded.load_into(self.ctx.policy, self.trainer.optimizer)  # re-shards if need be
            self.load_state_dict(loaded.state)
            if not loaded.restore_rng():  # the checkpoint had fewer processes: none of ours
                torch.manual_seed(self.config.seed * 1_000_003 + self.dist.rank
                                  + 7_919 * loaded.state["step"])
            return
        trained = yaml.safe_load(loaded.config_yaml) or {}
        saved = trained.get("train", {}).get("optimizer", "adamw")  # older checkpoints: adamw
        if saved != self.config.train.optimizer:  # resumed with --allow-config-change
            # another optimizer's state does not fit this one's: it starts afresh
            log.warning("train.optimizer changed from %s to %s: its state starts empty",
                        saved, self.config.train.optimizer)
            store.load_weights(self.ctx.policy, loaded.weights)
        else:
            self._load_weights(loaded.weights, loaded.optimizer)
        self.load_state_dict(loaded.state)
        store.restore_rng(loaded.rng, loaded.state["rng"])


    def rollback(self, step: int) -> Path | None:
        """Load the weights and optimizer of step `step`'s checkpoint (a health rollback; the
        trainer resets the rest itself); None if that checkpoint is not there intact."""
        name = f"{store.CHECKPOINTS}/step-{step:07d}"
        if self.sharded:
            path = self.main_dir / name
            if not all(self.dist.gather(store.verify(path).ok)):
                return None
            sharded.load_sharded(path, model=self.ctx.policy, optimizer=self.trainer.optimizer)
            return path
        # every process or none: one going back alone would train on other weights
        if not all(self.dist.gather(store.verify(self.run_dir / name).ok)):
            return None
        target = store.load_checkpoint(
            self.run_dir / name, shared_from=None if self.dist.is_main else self.main_dir / name)
        self._load_weights(target.weights, target.optimizer)
        return target.path

    def _load_weights(self, weights: dict[str, Any], optimizer: dict[str, Any]) -> None:
        """Saved trainable weights and optimizer state into the (unsharded) policy."""
        store.load_weights(self.ctx.policy, weights)
        self.trainer.optimizer.load_state_dict(optimizer)


def open_checkpoint(run_dir: Path, config: RunConfig, resume: str, allow_config_change: bool,
                    dist: Dist, main_dir: Path, strategy: str = "none"
                    ) -> Loaded | sharded.ShardedLoaded:
    """Pick and verify the checkpoint, check config drift, and make the logs agree with it.
    A sharded checkpoint (`distributed.strategy: fsdp`) is in process 0's run directory and
    resumes at any number of processes (its tensors are read, re-sharded, once the model is
    wrapped: `RunState.restore`); a DDP or one-process checkpoint at the number that saved it."""
    path = sharded.pick_resume(main_dir, resume) if strategy == "fsdp" or \
        dist.world_size == 1 else None
    if path is not None and (strategy == "fsdp" or sharded.is_sharded(path)):
        loaded = sharded.open_sharded(path)
    elif dist.world_size == 1:
        loaded = store.load_checkpoint(path)
    else:
        loaded = _open_shared_checkpoint(run_dir, resume, dist, main_dir)
    saved_world = loaded.state.get("world_size", getattr(loaded, "world_size", 1))
    if saved_world != dist.world_size and not isinstance(loaded, sharded.ShardedLoaded):
        # whole weights, but one sampling RNG per process that saved them (docs/scale_out.md)
        raise CheckpointError(
            f"checkpoint {loaded.path} was saved by {saved_world} process(es), this run has "
            f"{dist.world_size}; only sharded checkpoints (distributed.strategy: fsdp) resume "
            f"at another number of processes, so resume this one with {saved_world}")
    if saved_world != dist.world_size:
        log.warning("checkpoint %s was saved by %d process(es), this run has %d: weights, "
                    "optimizer, schedule, task mixer and controllers go on exactly; the "
                    "completions differ from a run that kept %d (each process samples from its "
                    "own RNG stream)", loaded.path, saved_world, dist.world_size, saved_world)
    path = loaded.path
    changes = check_drift(config_diff(loaded.config_yaml, config), allow_config_change, path)
    step = loaded.state["step"]
    if changes:
        for change in changes:
            log.info("config change on resume (%s): %s",
                     "allowed" if change.allowed else "FORCED", change)
        with MetricsWriter(run_dir / "config_changes.jsonl") as writer:
            writer.write({"step": step, "checkpoint": str(path),
                          "changes": [{"key": c.key, "old": c.old, "new": c.new,
                                       "allowed": c.allowed} for c in changes]})
    repair_logs(run_dir, loaded.state)
    moved = store.set_aside_newer(run_dir, step)
    if moved:
        log.warning("resuming from step %d, an older checkpoint than the run's newest: %s "
                    "moved to %s, so that --resume auto and output.keep_last follow this run "
                    "from now on (delete them when you no longer need them)", step,
                    ", ".join(p.name for p in moved), moved[0].parent)
    (run_dir / "config.yaml").write_text(to_yaml(config), encoding="utf-8")
    log.info("resuming from %s (step %d)", path, step)
    return loaded


def repair_logs(run_dir: Path, state: dict[str, Any]) -> None:
    """Make the append-only logs hold exactly what the checkpointed run had written: the
    metrics and completions up to its step, the evals it recorded (written anew, atomically)."""
    step = state["step"]
    truncate_jsonl(run_dir / METRICS_LOG, step)
    truncate_jsonl(run_dir / COMPLETIONS_FILE, step)
    quick_eval = state["quick_eval"]
    if "records" in quick_eval:
        rewrite_jsonl(run_dir / EVAL_LOG, quick_eval["records"])
    else:  # a checkpoint from before the records were saved: cut back by step, then read
        truncate_jsonl(run_dir / EVAL_LOG, step)
        path = run_dir / EVAL_LOG
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        quick_eval["records"] = [json.loads(line) for line in lines]


def _other_world(main_dir: Path, world_size: int) -> str:
    """Why no process r > 0 has checkpoints when process 0 saved with another number."""
    try:
        state = store.load_checkpoint(store.find_resume(main_dir, "auto")).state
    except CheckpointError:
        return ""
    saved = state.get("world_size", 1)
    if saved == world_size:
        return ""
    return (f": the newest was saved by {saved} process(es), this run has {world_size}; only "
            "sharded checkpoints (distributed.strategy: fsdp) resume at another number of "
            f"processes, so resume this one with {saved}")


def _open_shared_checkpoint(run_dir: Path, resume: str, dist: Dist, main_dir: Path) -> Loaded:
    """The newest step every process saved intact (or the step of the path given); processes
    r > 0 read the weights and optimizer from process 0's checkpoint of that step."""
    if resume == "auto":
        found = store.list_checkpoints(run_dir)
        # process 0 says why a newer step was passed over (processes r > 0 log errors only)
        mine = ([s.step for s in found if s.ok],
                [(s.step, s.path.name, s.status, "; ".join(s.problems)) for s in found if not s.ok])
        everyone = dist.gather(mine)
        common = set.intersection(*[set(intact) for intact, _ in everyone])
        for rank, (_, bad) in enumerate(everyone):
            for bad_step, name, status, problems in bad:
                if bad_step > max(common, default=-1):
                    log.warning("skipping checkpoint %s of process %d (%s): %s", name, rank,
                                status, problems)
        if not common:
            raise CheckpointError(
                f"--resume auto: no step has an intact checkpoint in every one of the "
                f"{dist.world_size} processes ({main_dir / store.CHECKPOINTS} and .rank-N)"
                + _other_world(main_dir, dist.world_size)
                + "; start a new run or give a checkpoint path")
        step = max(common)
    else:  # a path to one of process 0's checkpoints: that step in every process
        step = store.verify(store.find_resume(main_dir, resume)).step
    name = f"step-{step:07d}"
    shared = None if dist.is_main else main_dir / store.CHECKPOINTS / name
    return store.load_checkpoint(run_dir / store.CHECKPOINTS / name, shared_from=shared)

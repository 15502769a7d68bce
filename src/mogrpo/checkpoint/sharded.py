"""Checkpoints of sharded state: several processes (DDP or FSDP2) save and resume together.

Every process writes its own shard of the trainable weights and of the optimizer state with
`torch.distributed.checkpoint` (DCP), and its own RNG state; process 0 writes the run's JSON
state (the same in every process), the config and the versions, then — after a barrier, once
every process has written — hashes EVERY file into the manifest and renames the directory
into place, exactly as `store.save_checkpoint` does for one process:

    RUN/checkpoints/step-0000042/
        dcp/.metadata              DCP's index of the shards (written by process 0)
        dcp/__R_0.distcp           process R's shard of the weights and AdamW state
        rng/rank-0000R.safetensors process R's torch/CUDA RNGs; Python and NumPy in its metadata
        trainer_state.json         the run's state (process 0)
        config.yaml, versions.json
        manifest.json              "format": "dcp", world_size, strategy, SHA-256 of every file

A checkpoint is complete and verified, or it is ignored: `store.verify` checks every file
(all processes' shards and DCP's metadata); until the rename it is `.tmp-step-N`, which
`--resume auto`, `mogrpo checkpoints` and `mogrpo doctor` never pick. The checkpoint directory
must be on a file system every process sees (as DCP requires); a process whose files process 0
cannot see fails the save with a `CheckpointError`.

Resume with the same world size is exact: each process reads back its own shards (bit for
bit) and its own RNGs. Resume with another world size re-shards: DCP reads every saved shard
into the new layout (2 -> 1, 1 -> 2 and DDP/none <-> FSDP2 give the same full weights and
optimizer state); the processes beyond the saved ones get no RNG back (`restore_rng` is
False; the run seeds them by rank and step and logs both numbers), so such a run continues
correctly but not bit-identically to an uninterrupted one.

Interface (every call is collective: all processes call it, in the same order):

    path = save_sharded(run_dir, step, model=, optimizer=, state=, config_yaml=, strategy=)
    path = pick_resume(run_dir, "auto")    # process 0 picks and verifies, every process agrees
    loaded = open_sharded(path)            # verified; JSON state, this process's RNGs
    ...build and wrap the model and optimizer...
    loaded.load_into(model, optimizer)     # each process reads its shards (re-shards if needed)
    ...restore loaded.state into the run...; loaded.restore_rng()   # the RNGs last

(`load_sharded(path, model=, optimizer=)` is `open_sharded` + `load_into` in one call; a health
rollback uses it and ignores the rest.) Process 0 alone prunes old checkpoints
(`store.prune`).

`model` is the wrapped policy (FSDP2 `fully_shard`, DDP, or a plain module), a plain
transformers model or a peft model; only parameters with `requires_grad` are saved, as in
the single-process format. Note that DCP's `.metadata` is a pickle: resume only checkpoints
you trust (the manifest's hashes catch damage, not forgery).
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from mogrpo.checkpoint import store
from mogrpo.checkpoint.store import CheckpointError

log = logging.getLogger(__name__)

_TRAINABLE = StateDictOptions(ignore_frozen_params=True)
_MODEL, _OPTIM = "model", "optim"  # the two top-level keys of the DCP state dict


# ----------------------------------------------------------------------------- processes


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


def _from_main(value: Any) -> Any:
    """Process 0's `value` in every process (a picklable object)."""
    if _rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every single-process call ("assuming the intent is ..."); that is ours."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _raise_if_any_process(error: str | None) -> None:
    """Raise in every process if any process had an error (a barrier as well)."""
    if _rank_world()[1] == 1:
        errors = [error]
    else:
        errors = [None] * _rank_world()[1]
        dist.all_gather_object(errors, error)
    found = [e for e in errors if e]
    if found:
        raise CheckpointError("; ".join(found))


def _raise_if_any(error: str | None) -> None:
    """Raise process 0's error in every process, so no process waits for a collective the
    others have left."""
    error = _from_main(error)
    if error:
        raise CheckpointError(error)


# ----------------------------------------------------------------------------- saving


def save_sharded(run_dir: Path, step: int, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer, state: dict[str, Any], config_yaml: str,
                 strategy: str) -> Path:
    """Write `checkpoints/step-N` from every process and point `latest` at it (collective).

    `state` is the run's JSON state (process 0's is written; it must be the same in every
    process); `strategy` (`none`, `ddp`, `fsdp`) is recorded in the manifest."""
    rank, world = _rank_world()
    root = run_dir / store.CHECKPOINTS
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / store.RNG_DIR).mkdir(parents=True)
    _barrier()
    tensors = {_MODEL: get_model_state_dict(model, options=_TRAINABLE),
               _OPTIM: get_optimizer_state_dict(model, optimizer)}
    try:
        with _quiet_single_process():
            dcp.save(tensors, no_dist=world == 1,
                     storage_writer=FileSystemWriter(tmp / store.DCP_DIR, sync_files=True))
    except CheckpointException as err:  # a BaseException: carries every process's failure
        raise CheckpointError(f"step {step}: the sharded checkpoint was not saved: {err}") from None
    try:
        _write_rng(tmp, rank)
        error = None
    except OSError as err:
        error = f"process {rank} could not write its RNG state: {err}"
    _raise_if_any_process(error)  # also the barrier: every process's files are written
    if rank == 0:
        try:
            _finish(tmp, final, step, world, strategy, state, config_yaml)
        except (OSError, CheckpointError) as err:
            error = f"step {step}: the sharded checkpoint was not saved: {err}"
    _raise_if_any(error)
    return final


def _write_rng(tmp: Path, rank: int) -> None:
    """This process's RNGs: tensors as tensors, Python's and NumPy's state as JSON metadata."""
    tensors, rng_json = store.rng_state()
    path = tmp / store.rank_rng_file(rank)
    save_file(tensors, path, metadata={"rng": json.dumps(rng_json)})


def _finish(tmp: Path, final: Path, step: int, world: int, strategy: str,
            state: dict[str, Any], config_yaml: str) -> None:
    """Process 0, after every process wrote: the JSON files, a check that every process's
    files are here, then the manifest and the rename (`store.seal`)."""
    store.write_json(tmp / store.STATE, {**state, "step": step})
    (tmp / store.CONFIG).write_text(config_yaml, encoding="utf-8")
    store.write_json(tmp / store.VERSIONS, store.versions())
    shards = {info.relative_path for info in
              FileSystemReader(tmp / store.DCP_DIR).read_metadata().storage_data.values()}
    expected = [f"{store.DCP_DIR}/{name}" for name in sorted(shards)]
    expected += [store.rank_rng_file(r) for r in range(world)]
    missing = [name for name in expected if not (tmp / name).is_file()]
    if missing:
        raise CheckpointError(
            f"process 0 cannot see {', '.join(missing[:4])} in {tmp}: the checkpoint "
            "directory (output.dir) must be on a file system every process shares")
    store.seal(tmp, final, {"step": step, "format": store.FORMAT_SHARDED, "world_size": world,
                            "strategy": strategy, "files": {}, "shared": []})


# ----------------------------------------------------------------------------- loading


def is_sharded(path: Path) -> bool:
    """Whether the checkpoint at `path` is in the sharded (DCP) format."""
    try:
        manifest = json.loads((path / store.MANIFEST).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    return manifest.get("format") == store.FORMAT_SHARDED


def pick_resume(run_dir: Path, resume: str) -> Path:
    """`store.find_resume` run by process 0 (`auto`: the newest checkpoint that verifies, a
    damaged or partial one skipped), its answer given to every process (collective)."""
    path, error = None, None
    if _rank_world()[0] == 0:
        try:
            path = str(store.find_resume(run_dir, resume))
        except CheckpointError as err:
            error = str(err)
    _raise_if_any(error)
    return Path(_from_main(path))


@dataclass
class ShardedLoaded:
    """A verified sharded checkpoint's JSON state and this process's RNGs; `load_into` reads
    its weights and optimizer state once the model is built and wrapped."""

    path: Path
    state: dict[str, Any]
    """trainer_state.json; its `rng` is this process's Python and NumPy RNG state (or absent)."""
    rng: dict[str, torch.Tensor] | None
    """This process's torch/CUDA RNG states; None for a process the checkpoint had no RNG of."""
    config_yaml: str
    world_size: int
    """The world size the checkpoint was saved with."""
    strategy: str

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Every process reads its shards of the weights and optimizer state into `model` and
        `optimizer`, wrapped as they will train; another world size re-shards (collective)."""
        _load_tensors(self.path, model, optimizer, self.world_size)

    def restore_rng(self) -> bool:
        """Put this process's RNGs back (call it last); False if the checkpoint had none."""
        if self.rng is None:
            return False
        store.restore_rng(self.rng, self.state["rng"])
        return True


def open_sharded(path: Path) -> ShardedLoaded:
    """Verify the checkpoint (process 0, every file hashed) and read its JSON state and this
    process's RNGs; no tensors yet (collective)."""
    rank, world = _rank_world()
    error = None
    if rank == 0:
        status = store.verify(path)
        if not status.ok:
            error = f"checkpoint {path} is {status.status}: " + "; ".join(status.problems)
        elif not is_sharded(path):
            error = (f"checkpoint {path} is a single-process checkpoint; resume it with one "
                     "process (distributed.strategy none), or start the sharded run anew")
    _raise_if_any(error)
    manifest = json.loads((path / store.MANIFEST).read_text(encoding="utf-8"))
    saved_world = int(manifest["world_size"])
    if saved_world != world:
        log.debug("checkpoint %s was saved by %d processes, this run has %d: the weights and "
                    "the optimizer are re-sharded exactly; processes without a saved RNG keep "
                    "their seeded ones, so the run is not bit-identical to an uninterrupted one",
                    path, saved_world, world)
    state = json.loads((path / store.STATE).read_text(encoding="utf-8"))
    rng = None
    if rank < saved_world:
        with safe_open(path / store.rank_rng_file(rank), framework="pt") as f:
            rng = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
            state["rng"] = json.loads(f.metadata()["rng"])
    return ShardedLoaded(path=path, state=state, rng=rng,
                         config_yaml=(path / store.CONFIG).read_text(encoding="utf-8"),
                         world_size=saved_world, strategy=manifest.get("strategy", "?"))


def load_sharded(path: Path, *, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> ShardedLoaded:
    """`open_sharded` then `load_into` (collective): weights and optimizer restored in place."""
    loaded = open_sharded(path)
    loaded.load_into(model, optimizer)
    return loaded


def _load_tensors(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                  saved_world: int) -> None:
    """DCP load into the model's and optimizer's own (sharded) state dicts, then set them."""
    tensors = {_MODEL: get_model_state_dict(model, options=_TRAINABLE),
               _OPTIM: get_optimizer_state_dict(model, optimizer)}
    reader = FileSystemReader(path / store.DCP_DIR)
    saved = {key.removeprefix(_MODEL + ".") for key in reader.read_metadata().state_dict_metadata
             if key.startswith(_MODEL + ".")}
    unknown, missing = sorted(saved - set(tensors[_MODEL])), sorted(set(tensors[_MODEL]) - saved)
    if unknown or missing:
        raise CheckpointError(
            f"checkpoint {path} does not fit the model: "
            + (f"it holds {unknown[:3]} which the model lacks " if unknown else "")
            + (f"it lacks {missing[:3]} " if missing else "")
            + "; was the model or the LoRA config changed?")
    try:
        with _quiet_single_process():
            dcp.load(tensors, storage_reader=reader, no_dist=_rank_world()[1] == 1)
    except CheckpointException as err:  # a BaseException: carries every process's failure
        raise CheckpointError(f"checkpoint {path} (saved by {saved_world} processes) could not "
                              f"be read into this model: {err}") from None
    set_model_state_dict(model, tensors[_MODEL], options=StateDictOptions(strict=False))
    set_optimizer_state_dict(model, optimizer, tensors[_OPTIM])

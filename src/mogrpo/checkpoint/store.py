"""Checkpoints that never lie: atomic save, a manifest of hashes, verification, resume.

A checkpoint is a directory `RUN/checkpoints/step-0000042/` holding everything the next step
depends on — trainable weights (safetensors), optimizer (tensors only, loaded with
`weights_only=True`), RNG states, the trainer's JSON state (counters, task sampler, KL
controllers, evals), the resolved config with its hash and the package versions — plus
`manifest.json` with the SHA-256 and size of every file. It is written to a temporary
directory, flushed, renamed into place, and only then is `checkpoints/latest` updated.

A checkpoint of sharded state (several processes under DDP or FSDP2, `checkpoint/sharded.py`)
keeps the same directory, manifest and rename discipline; its manifest says `"format": "dcp"`,
and its weights and optimizer are `dcp/` (torch.distributed.checkpoint), its RNGs one file per
process under `rng/`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from mogrpo.errors import MogrpoError

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
SET_ASIDE = "checkpoints_set_aside"
"""Where a resume from an older step moves the newer checkpoints of the line it left."""
LATEST = "latest"
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"
OPTIMIZER = "optimizer.pt"
RNG = "rng.safetensors"
STATE = "trainer_state.json"
CONFIG = "config.yaml"
VERSIONS = "versions.json"
REQUIRED = (WEIGHTS, OPTIMIZER, RNG, STATE, CONFIG, VERSIONS)
FORMAT_SHARDED = "dcp"
"""The manifest's `format` of a sharded checkpoint (absent: the single-process format)."""
DCP_DIR = "dcp"
DCP_METADATA = f"{DCP_DIR}/.metadata"
RNG_DIR = "rng"
PACKAGES = ("mogrpo", "torch", "transformers", "peft", "accelerate", "safetensors", "numpy")


class CheckpointError(MogrpoError):
    """A checkpoint is missing, incomplete or corrupt, or cannot be resumed."""


@dataclass
class CheckpointStatus:
    """Integrity of one checkpoint directory."""

    path: Path
    step: int
    status: str  # "ok" | "corrupt" | "incomplete"
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ----------------------------------------------------------------------------- writing


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False, allow_nan=True), encoding="utf-8")


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def rank_rng_file(rank: int) -> str:
    """Process `rank`'s RNG file in a sharded checkpoint (relative to the checkpoint)."""
    return f"{RNG_DIR}/rank-{rank:05d}.safetensors"


def required_files(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The files a checkpoint of the manifest's format cannot do without."""
    if manifest.get("format") == FORMAT_SHARDED:
        ranks = range(int(manifest.get("world_size", 1)))
        return (STATE, CONFIG, VERSIONS, DCP_METADATA, *(rank_rng_file(r) for r in ranks))
    return REQUIRED


def rng_state() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors, JSON) of every RNG the run draws from: Python, NumPy, torch, CUDA."""
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = state
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return tensors, {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), pos, has_gauss, cached],
    }


def restore_rng(tensors: dict[str, torch.Tensor], saved: dict[str, Any]) -> None:
    version, internal, gauss = saved["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = saved["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    # by device number: "cuda10" after "cuda9", not after "cuda1"
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda")),
                                       key=lambda k: int(k[4:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


def trainable_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    state: dict[str, Any],
    config_yaml: str,
) -> Path:
    """Write `checkpoints/step-N` atomically and point `latest` at it.

    Without `model` and `optimizer` (processes r > 0 of a multi-process run, whose weights and
    optimizer equal process 0's) the checkpoint holds only this process's state and RNG; its
    manifest lists the two files as `shared`: they are read from process 0's step-N. (FSDP2's
    sharded state has its own format: `checkpoint.sharded`.)"""
    root = run_dir / CHECKPOINTS
    final = root / f"step-{step:07d}"
    tmp = root / f".tmp-step-{step:07d}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shared = []
    if model is not None:
        save_file(trainable_weights(model), tmp / WEIGHTS)
    else:
        shared.append(WEIGHTS)
    if optimizer is not None:
        torch.save(optimizer.state_dict(), tmp / OPTIMIZER)
    else:
        shared.append(OPTIMIZER)
    tensors, rng_json = rng_state()
    save_file(tensors, tmp / RNG)
    write_json(tmp / STATE, {**state, "step": step, "rng": rng_json})
    (tmp / CONFIG).write_text(config_yaml, encoding="utf-8")
    write_json(tmp / VERSIONS, versions())
    seal(tmp, final, {"step": step, "files": {}, "shared": shared})
    return final


def seal(tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
    """Hash every file under `tmp` into `manifest["files"]` (paths relative to `tmp`), write
    the manifest, flush, rename `tmp` to `final` and point `latest` at it, in that order."""
    for path in sorted(tmp.rglob("*")):
        _fsync(path)  # directories too: their entries must be durable before the rename
        if path.is_file():
            manifest["files"][path.relative_to(tmp).as_posix()] = {
                "sha256": _sha256(path), "size": path.stat().st_size}
    write_json(tmp / MANIFEST, manifest)
    _fsync(tmp / MANIFEST)
    _fsync(tmp)
    root = final.parent
    if final.exists():  # the same step saved again (a resumed run passing it): replace it
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(final.name, encoding="utf-8")
    _fsync(pointer)
    os.replace(pointer, root / LATEST)  # last: a crash before this leaves the old pointer


def prune(run_dir: Path, keep_last: int, protected: set[int]) -> list[Path]:
    """Delete checkpoints beyond the newest `keep_last`, except protected steps (best, Pareto)."""
    found = sorted(_step_dirs(run_dir), key=lambda p: _step_of(p))
    keep = {_step_of(p) for p in found[-keep_last:]} | protected if keep_last else None
    removed = []
    for path in found:
        if keep is not None and _step_of(path) not in keep:
            shutil.rmtree(path)
            removed.append(path)
    return removed


def set_aside_newer(run_dir: Path, step: int) -> list[Path]:
    """Move the checkpoints newer than `step` out of `checkpoints/` into `SET_ASIDE/` (a
    resume from an older step starts another line: `--resume auto` and `keep_last` must see
    only its checkpoints, not the line it left). Nothing is deleted; returns the new paths."""
    newer = sorted((p for p in _step_dirs(run_dir) if _step_of(p) > step), key=_step_of)
    moved = []
    for path in newer:
        target = run_dir / SET_ASIDE / path.name
        n = 1
        while target.exists():  # set aside before, by an earlier resume from an older step
            n += 1
            target = run_dir / SET_ASIDE / f"{path.name}-{n}"
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(path, target)
        moved.append(target)
    root = run_dir / CHECKPOINTS
    if moved and (root / f"step-{step:07d}").is_dir():  # `latest` named one moved away
        (root / LATEST).write_text(f"step-{step:07d}", encoding="utf-8")
    return moved


# ----------------------------------------------------------------------------- reading


def _step_of(path: Path) -> int:
    return int(path.name.split("-")[1])


def _step_dirs(run_dir: Path) -> list[Path]:
    root = run_dir / CHECKPOINTS
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-")]


def verify(path: Path) -> CheckpointStatus:
    """Check every file against the manifest: missing → incomplete, wrong size/hash → corrupt."""
    step = _step_of(path) if path.name.startswith("step-") else -1
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return CheckpointStatus(path, step, "incomplete", [f"{MANIFEST} is missing (save interrupted?)"])
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        return CheckpointStatus(path, step, "corrupt", [f"{MANIFEST} is not valid JSON: {err}"])
    problems, status = [], "ok"
    for name in required_files(manifest):
        if name not in manifest["files"] and name not in manifest.get("shared", []):
            problems.append(f"{name} is not listed in the manifest")
            status = "incomplete"
    for name, expected in manifest["files"].items():
        file = path / name
        if not file.is_file():
            problems.append(f"{name} is missing")
            status = "incomplete"
            continue
        size = file.stat().st_size
        if size != expected["size"]:
            problems.append(f"{name} has {size} bytes, the manifest says {expected['size']} (truncated?)")
            status = "corrupt" if status == "ok" else status
        elif _sha256(file) != expected["sha256"]:
            problems.append(f"{name} does not match its SHA-256 in the manifest (corrupted)")
            status = "corrupt" if status == "ok" else status
    return CheckpointStatus(path, manifest.get("step", step), status, problems)


def list_checkpoints(run_dir: Path) -> list[CheckpointStatus]:
    """Every checkpoint of a run, newest first, with its integrity."""
    return [verify(p) for p in sorted(_step_dirs(run_dir), key=_step_of, reverse=True)]


def find_resume(run_dir: Path, resume: str) -> Path:
    """`auto`: the newest checkpoint that verifies (bad newer ones are reported); else a path."""
    if resume != "auto":
        path = Path(resume)
        status = verify(path)
        if not status.ok:
            raise CheckpointError(
                f"checkpoint {path} is {status.status}: " + "; ".join(status.problems)
                + "; pick another with `mogrpo checkpoints RUN_DIR` or use --resume auto"
            )
        return path
    found = list_checkpoints(run_dir)
    for status in found:
        if status.ok:
            return status.path
        log.warning("skipping checkpoint %s (%s): %s", status.path.name, status.status,
                    "; ".join(status.problems))
    again = ("start it again from the beginning with `--set output.overwrite=true` (without "
             "--resume; the run is seeded, so it repeats the steps that were lost)")
    if not found and any((run_dir / name).exists() for name in STARTED):
        raise CheckpointError(
            f"--resume auto: {run_dir} holds a run that stopped before its first checkpoint "
            f"(written every output.save_every steps); nothing to resume: {again}")
    raise CheckpointError(
        f"--resume auto found no intact checkpoint in {run_dir / CHECKPOINTS}; {again}, or "
        "give a checkpoint path"
    )


STARTED = ("metrics.jsonl", "sft_metrics.jsonl")
"""The files a run writes from its first SFT or GRPO step on."""


def has_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir` holds any checkpoint, intact or not."""
    return bool(_step_dirs(run_dir))


@dataclass
class Loaded:
    """What a resume restores from a verified checkpoint."""

    path: Path
    state: dict[str, Any]
    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: dict[str, torch.Tensor]
    config_yaml: str


def load_checkpoint(path: Path, shared_from: Path | None = None) -> Loaded:
    """Read a checkpoint that `verify` accepted. No pickled objects: tensors via safetensors
    or `torch.load(weights_only=True)`, everything else JSON. Files the manifest marks as
    `shared` are read from `shared_from` (process 0's checkpoint of the same step)."""
    status = verify(path)
    if not status.ok:
        raise CheckpointError(f"checkpoint {path} is {status.status}: " + "; ".join(status.problems))
    shared = json.loads((path / MANIFEST).read_text(encoding="utf-8")).get("shared", [])
    if shared:
        if shared_from is None or not verify(shared_from).ok:
            raise CheckpointError(
                f"checkpoint {path} shares {', '.join(shared)} with process 0's checkpoint "
                f"{shared_from}, which is missing or not intact; resume from an earlier step")
    source = {name: (shared_from if name in shared else path) for name in (WEIGHTS, OPTIMIZER)}
    return Loaded(
        path=path,
        state=json.loads((path / STATE).read_text(encoding="utf-8")),
        weights=load_file(source[WEIGHTS] / WEIGHTS),
        optimizer=torch.load(source[OPTIMIZER] / OPTIMIZER, weights_only=True),
        rng=load_file(path / RNG),
        config_yaml=(path / CONFIG).read_text(encoding="utf-8"),
    )


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy saved trainable weights into the model; names must match exactly."""
    params = dict(model.named_parameters())
    missing = [n for n in weights if n not in params]
    expected = [n for n, p in params.items() if p.requires_grad and n not in weights]
    if missing or expected:
        raise CheckpointError(
            "checkpoint weights do not fit the model: "
            + (f"unknown {missing[:3]} " if missing else "")
            + (f"missing {expected[:3]}" if expected else "")
            + "; was the model or LoRA config changed?"
        )
    with torch.no_grad():
        for name, tensor in weights.items():
            params[name].copy_(tensor.to(params[name].device, params[name].dtype))

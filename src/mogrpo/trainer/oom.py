"""An out-of-memory error costs a smaller batch, not the run (`memory.on_oom: adapt`).

The phases of a step that can run out of memory are redone as a unit (`OomGuard.run`):
generation alone (its prompts are already drawn), and the log-prob pass with the update (the
samples are fixed by then; the log-probs are recomputed at the smaller size too, so every
number of the step is the one a run at that size computes). Before a unit the RNGs are saved;
on an out-of-memory error the error and everything its traceback held are dropped, the
gradients freed, the size halved, the RNGs put back and the unit run again: the same samples
and the same random draws (LoRA dropout), so the step does what a run configured with the
smaller size from the start does. The smaller size stays for the rest of the run and is in
the checkpoint (`state_dict`), so a resume keeps it.

What counts as out of memory: `torch.OutOfMemoryError` (the CUDA caching allocator's error,
which `torch.cuda.OutOfMemoryError` names too) and, on a CPU, the RuntimeError of PyTorch's CPU
allocator ("DefaultCPUAllocator: can't allocate memory": malloc refused, e.g. under `ulimit -v`
or a cgroup that does not overcommit). Nothing else: a CUDA error such as an illegal memory
access leaves the device unusable, and redoing the step would hide a bug.

Not redone, with an `OutOfMemory` error naming what to lower: `memory.on_oom: fail`; a size
already at 1; several processes (the others wait in collectives for the one that failed);
an error after the optimizer stepped in this step (μ > 1: redoing would step twice); an error
inside the optimizer's step (part of the update may be applied, and a smaller batch does not
shrink its states). Before a redo the step's gradients are freed and fp16-mixed's loss scaler
forgets that it unscaled them (its scale is kept).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from mogrpo.checkpoint.store import restore_rng, rng_state
from mogrpo.config import RunConfig
from mogrpo.errors import OutOfMemory

log = logging.getLogger("mogrpo.trainer.grpo")
T = TypeVar("T")

GENERATION, LOGPROBS, UPDATE = "generation", "log-prob pass", "update"
MICRO, GENERATION_BATCH = "train.micro_batch_size", "rollout.generation_batch_size"
CPU_ALLOCATOR = "DefaultCPUAllocator: can't allocate memory"
_OOM_TYPES = (getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError),)


def is_oom(err: BaseException) -> bool:
    """Whether `err` is an allocator's out-of-memory error (CUDA's, or PyTorch's CPU one)."""
    return isinstance(err, _OOM_TYPES) or (isinstance(err, RuntimeError)
                                           and CPU_ALLOCATOR in str(err))


class OomGuard:
    """The batch sizes a step runs at (the config's, halved after out-of-memory errors) and
    the redo of a step's phases at a smaller size."""

    def __init__(self, config: RunConfig, world_size: int, device: torch.device,
                 release: Callable[[], None]) -> None:
        self.on_oom = config.memory.on_oom
        self.configured: dict[str, int | None] = {
            MICRO: config.train.micro_batch_size,
            GENERATION_BATCH: config.rollout.generation_batch_size}
        self.sizes = dict(self.configured)
        """The sizes in use; None: the whole step's completions at once."""
        self.events: list[dict[str, Any]] = []
        """Every adaptation of the run (in the checkpoint)."""
        self.pending: list[dict[str, Any]] = []
        """Those not yet written to metrics.jsonl (`take_events`)."""
        self.stepped = False
        """Set by the update once the optimizer stepped in the current unit."""
        self.in_optimizer = False
        """Set by the update as the optimizer's step starts (an error inside it is not redone:
        part of the update may be applied, the states of some tensors made)."""
        self._world_size, self._device, self._release = world_size, device, release

    @property
    def micro_batch_size(self) -> int:
        return int(self.sizes[MICRO])

    @property
    def generation_batch_size(self) -> int | None:
        return self.sizes[GENERATION_BATCH]

    def run(self, step: int, phases: Sequence[tuple[str, Callable[[], Any]]],
            rows: int = 0) -> Any:
        """Run `phases` in order and return the last one's result; on an out-of-memory error
        in any of them, halve the size (generation: `rollout.generation_batch_size`, of the
        `rows` completions; else `train.micro_batch_size`) and run them all again from the
        same RNG state."""
        saved = rng_state()
        while True:
            self.stepped = self.in_optimizer = False
            phase = ""
            try:
                result = None
                for name, fn in phases:
                    phase = name  # which one failed, for the size to halve and the log line
                    result = fn()
                return result
            except Exception as err:
                if not is_oom(err):
                    raise
                key = GENERATION_BATCH if phase == GENERATION else MICRO
                old = self.sizes[key] or rows
                self._check_can_adapt(err, step, phase, key, old)
            # out of the except block: the error, its traceback and the frames holding the
            # step's tensors are gone; the allocator's cache is what made the error (fragments)
            self._release()
            gc.collect()
            if self._device.type == "cuda":
                torch.cuda.empty_cache()
            self._adapt(step, phase, key, old)
            restore_rng(*saved)

    def _check_can_adapt(self, err: BaseException, step: int, phase: str, key: str,
                         old: int) -> None:
        where = f"out of memory in the {phase} of step {step} ({key} {old}): " \
                f"{str(err).splitlines()[0] if str(err) else type(err).__name__}"
        reason = None
        if self.on_oom == "fail":
            reason = ("memory.on_oom is fail; set it to adapt to go on with halved sizes, or "
                      f"lower {key} (`mogrpo memory CONFIG` plans the sizes)")
        elif self._world_size > 1:
            reason = (f"with {self._world_size} processes one process's error cannot be redone "
                      f"alone (the others wait in collectives); lower {key} and resume")
        elif self.in_optimizer and not self.stepped:
            reason = ("the optimizer's own step ran out of memory (its states are made at the "
                      "first step; a smaller batch does not shrink them), and part of the update "
                      "may be applied already, so it is not redone; lower the optimizer's memory "
                      "(train.optimizer: adamw_8bit or paged_adamw_8bit, LoRA, "
                      "distributed.cpu_offload with fsdp; `mogrpo memory CONFIG` plans it) and "
                      "resume from the last checkpoint")
        elif self.stepped:
            reason = ("the optimizer already stepped in this step (algorithm.num_iterations > "
                      f"1), so redoing it would step twice; resume from the last checkpoint with "
                      f"a lower {key}")
        elif old <= 1:
            reason = (f"{key} is 1 already, nothing is left to halve; lower the memory a "
                      "completion needs (rollout.max_seq_length, model.gradient_checkpointing, "
                      "LoRA or 4-bit; `mogrpo memory CONFIG` plans it)")
        if reason is not None:
            raise OutOfMemory(f"{where}; {reason}") from err

    def _adapt(self, step: int, phase: str, key: str, old: int) -> None:
        new = old // 2
        self.sizes[key] = new
        event = {"event": "oom", "step": step, "phase": phase, "key": key, "from": old,
                 "to": new}
        self.events.append(event)
        self.pending.append(event)
        log.warning("[OOM@step %d] %s: %s %d → %d (memory.on_oom: adapt)", step, phase,
                    key.split(".")[-1], old, new)

    def take_events(self) -> list[dict[str, Any]]:
        """The adaptations since the last call (for metrics.jsonl)."""
        taken, self.pending = self.pending, []
        return taken

    def state_dict(self) -> dict[str, Any]:
        return {"sizes": dict(self.sizes), "configured": dict(self.configured),
                "events": list(self.events)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The adapted sizes come back while the config still says what they adapted from;
        a size changed in the config since wins (it is the user's new choice)."""
        self.events = list(state.get("events", []))
        for key, used in state.get("sizes", {}).items():
            was = state["configured"].get(key)
            if key not in self.sizes or used == was:
                continue
            if was == self.configured[key]:
                self.sizes[key] = used
                log.info("%s: %s, as an out-of-memory error adapted it (the config says %s)",
                         key, used, was)
            else:
                log.info("%s: the config's %s (it was %s when an out-of-memory error lowered it "
                         "to %s)", key, self.configured[key], was, used)

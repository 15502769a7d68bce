"""What a run does when it runs out of memory (`memory.on_oom`)."""

from __future__ import annotations

from typing import Literal

from mogrpo.config.base import Section


class MemoryConfig(Section):
    on_oom: Literal["adapt", "fail"] = "adapt"
    """On out-of-memory in generation, a log-prob pass or the update: `adapt` frees what the
    step held, halves `rollout.generation_batch_size` (generation) or `train.micro_batch_size`
    (the others, down to 1), redoes the step from the same samples and RNG state (the same
    math) and keeps the smaller size, also on resume (see docs/memory.md); `fail` stops the
    run. One process only: with several, an out-of-memory error always stops the run."""

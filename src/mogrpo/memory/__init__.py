"""The GPU memory planner: estimate a run's peak from the model's config alone, and what to change.

`estimate` (the per-term model), `ladder` (changes that make it fit), `plan` (both for one GPU
size), `measure` (the peak this process reached) and `cli` (`mogrpo memory`).
"""

from mogrpo.memory.cli import add_parser, cmd_memory, main, parse_size
from mogrpo.memory.estimate import (
    GIB,
    MemoryEstimate,
    Term,
    estimate,
    reward_model_configs,
)
from mogrpo.memory.ladder import Step, ladder, scale_out
from mogrpo.memory.measure import peak_bytes, reset_peak
from mogrpo.memory.model_config import load_model_config
from mogrpo.memory.plan import Plan, plan_run

__all__ = [
    "GIB", "MemoryEstimate", "Plan", "Step", "Term", "add_parser", "cmd_memory",
    "estimate", "ladder", "load_model_config", "main", "parse_size", "peak_bytes", "plan_run",
    "reset_peak", "reward_model_configs", "scale_out",
]

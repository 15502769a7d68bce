"""A run's plan for one GPU size: the estimate, whether it fits, and the ladder's first fit.

`plan_run` is what `mogrpo memory` and `mogrpo plan` compute, and what
`benchmarks/plan_table.py` tabulates: the model's config.json is read (no weights), its module
tree built once on the meta device, and the ladder re-estimates the config as it climbs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mogrpo.config import RunConfig
from mogrpo.memory.estimate import MemoryEstimate, estimate, reward_model_configs
from mogrpo.memory.ladder import Step, ladder, scale_out
from mogrpo.memory.model_config import load_model_config


@dataclass
class Plan:
    """The estimate of a run for `gpu` bytes (per process), and the ladder when it is over."""

    estimate: MemoryEstimate
    gpu: int | None
    """Bytes of one GPU; None when none was given or visible."""
    steps: list[Step]
    """The ladder's changes, cumulative, cheapest first (empty when it fits)."""
    run: RunConfig
    """The config estimated."""
    nproc: int
    estimate_fn: Callable[[RunConfig, int], MemoryEstimate]
    """The estimate of another config for a number of processes (for `scale_out`)."""

    @property
    def fits(self) -> bool:
        return self.gpu is not None and self.estimate.total <= self.gpu

    @property
    def first_fit(self) -> Step | None:
        """The ladder's first step after which the run fits (with every step before it), or
        None when it already fits or all the ladder's rungs together are not enough."""
        return next((s for s in self.steps if self.gpu is not None and s.total <= self.gpu), None)

    def overrides(self, upto: Step) -> list[str]:
        """The `--set` values of every step up to `upto`, later ones winning."""
        merged: dict[str, str] = {}
        for step in self.steps[:self.steps.index(upto) + 1]:
            for override in step.overrides:
                key, value = override.split("=", 1)
                merged[key] = value
        return [f"{k}={v}" for k, v in merged.items()]

    def scale_out(self) -> Step | None:
        """Running on more GPUs instead (see :func:`mogrpo.memory.ladder.scale_out`)."""
        if self.gpu is None:
            return None
        return scale_out(self.estimate_fn, self.run, self.gpu, self.nproc)


def plan_run(config: RunConfig, gpu: int | None, nproc: int = 1,
             model_config: Any = None) -> Plan:
    """Estimate `config` per process for `nproc` processes on GPUs of `gpu` bytes and, when it
    is over, climb the ladder. `model_config`: the model's config.json as loaded (default:
    read from `model.name_or_path`, the Hub cache included, nothing downloaded)."""
    from mogrpo.modeling.architecture import Architecture

    trust = config.model.trust_remote_code
    if model_config is None:
        model_config = load_model_config(config.model.name_or_path, trust_remote_code=trust)
    shape = Architecture.from_config(model_config, trust_remote_code=trust)
    rms = reward_model_configs(config)

    def estimate_fn(run: RunConfig, n: int) -> MemoryEstimate:
        return estimate(shape, run, reward_models=rms, nproc=n, gpu_memory=gpu)

    result = estimate_fn(config, nproc)
    over = gpu is not None and result.total > gpu
    steps = ladder(estimate_fn, config, gpu, nproc) if over else []
    return Plan(result, gpu, steps, config, nproc, estimate_fn)

"""What a run needs to train on several processes: the strategy, and every setting that cannot
run on that many, checked before anything starts (`mogrpo train --nproc`, `mogrpo memory
--nproc`) and again when the processes join (torchrun). Torch-free, so a config error comes in
a second."""

from __future__ import annotations

from mogrpo.config.hardware import process_errors
from mogrpo.config.precision import FSDP_FP16, resolve_precision
from mogrpo.config.sections import DistributedConfig, RunConfig
from mogrpo.errors import ConfigError


def strategy_for(config: DistributedConfig, nproc: int) -> str:
    """`none`, `ddp` or `fsdp` for `nproc` processes: one process is never wrapped, `auto` is
    `ddp`; `none` with several processes is a ConfigError."""
    if nproc < 1:
        raise ConfigError(f"--nproc {nproc}: the number of processes must be at least 1")
    if nproc == 1:
        return "none"
    if config.strategy == "none":
        raise ConfigError(
            f"distributed.strategy: none trains in one process, but {nproc} processes were "
            "asked for (--nproc or torchrun); set distributed.strategy to ddp, fsdp or auto, "
            "or run one process")
    return "ddp" if config.strategy == "auto" else config.strategy


def check_processes(config: RunConfig, nproc: int) -> str:
    """The strategy for `nproc` processes, or one ConfigError listing every setting of
    `config` that cannot run on that many."""
    if nproc < 1:
        strategy_for(config.distributed, nproc)  # raises
    if nproc == 1:
        problems = process_errors(config, "none")
        if problems:
            raise ConfigError(problems[0])
        return "none"
    problems = []
    if config.prompts_per_step % nproc:
        problems.append(f"{config.prompts_per_step} prompts per step do not split over {nproc} "
                        "processes; make train.micro_batch_size × gradient_accumulation_steps / "
                        "rollout.num_generations a multiple of it")
    try:
        strategy = strategy_for(config.distributed, nproc)
    except ConfigError as err:
        problems.append(str(err))
        strategy = None
    problems += process_errors(config, strategy or "")
    mc = config.model
    if strategy == "fsdp" and resolve_precision(mc.precision, mc.dtype, "cuda") == "fp16-mixed":
        problems.append(FSDP_FP16)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError(f"invalid config for {nproc} processes:\n  " + "\n  ".join(problems))
    return strategy

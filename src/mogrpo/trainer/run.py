"""A whole run: validate → read tasks → load model → SFT warm-up → eval → GRPO → eval → save."""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mogrpo.checkpoint.store import (
    CHECKPOINTS,
    STARTED,
    has_checkpoints,
    load_weights,
    verify,
)
from mogrpo.config import RunConfig, to_yaml
from mogrpo.config.hardware import quantized_field
from mogrpo.config.machine import NO_CUDA
from mogrpo.config.precision import FSDP_FP16
from mogrpo.config.processes import check_processes, strategy_for
from mogrpo.errors import ConfigError, MogrpoError
from mogrpo.eval.quick_eval import QuickEval
from mogrpo.eval.report import write_report
from mogrpo.health import HealthStop
from mogrpo.kernels import apply_host_memory
from mogrpo.memory import estimate, reward_model_configs
from mogrpo.modeling.chat import resolve_chat_template
from mogrpo.modeling.load import (
    LoraSettings,
    apply_lora,
    load_policy,
    record_stop_ids,
    save_model,
    save_pretrained,
    trainable_parameters,
)
from mogrpo.modeling.precision import Precision, pure_bf16_warning
from mogrpo.modeling.precision import resolve as resolve_precision
from mogrpo.modeling.quantize import is_quantized
from mogrpo.rollout.generate import SamplingSettings, resolve_stop_ids
from mogrpo.tasks.context import TrainContext
from mogrpo.tasks.task import Task, load_tasks
from mogrpo.tracking.jsonl import MetricsWriter, Tee
from mogrpo.tracking.trackers import Trackers
from mogrpo.trainer.completions import COMPLETIONS_FILE, CompletionLog
from mogrpo.trainer.distributed import Dist, process_group
from mogrpo.trainer.grpo import GRPOTrainer
from mogrpo.trainer.parallel import ParallelPolicy, full_weights, parallelize
from mogrpo.trainer.sft import run_sft
from mogrpo.trainer.startup import startup_summary
from mogrpo.trainer.state import RunState, open_checkpoint

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError(NO_CUDA)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and Dist.current().world_size > 1:
        return torch.device("cuda", torch.cuda.current_device())  # one GPU per process
    return torch.device(name)


def join_processes(config: RunConfig, dist: Dist) -> tuple[RunConfig, Path]:
    """Under torchrun (`dist` of several processes), check the config suits that many.

    Process 0 owns the run directory and the trackers; process r > 0 keeps its own files
    (metrics, its sampling RNG in its checkpoints) in `output.dir/.rank-r`, logs only errors
    and saves no final model; the SFT model is process 0's, in the main run directory."""
    main_dir = Path(config.output.dir)
    check_processes(config, dist.world_size)
    if dist.world_size == 1:
        return config, main_dir
    if not dist.is_main:
        logging.getLogger("mogrpo").setLevel(logging.ERROR)
        data = config.model_dump()
        data["output"]["dir"] = str(Path(config.output.dir) / f".rank-{dist.rank}")
        data["logging"]["trackers"] = []
        config = RunConfig.model_validate(data)
    return config, main_dir


RUN_FILES = ("metrics.jsonl", "sft_metrics.jsonl", "eval.jsonl", "summary.json", "pareto.json",
             "config_changes.jsonl", COMPLETIONS_FILE)


def prepare_run_dir(config: RunConfig, resuming: bool = False) -> Path:
    """Create the run directory; refuse to mix two runs' metrics unless told to overwrite."""
    run_dir = Path(config.output.dir)
    if resuming:
        if not run_dir.is_dir():
            raise ConfigError(f"--resume: output.dir {run_dir} does not exist; nothing to resume")
        return run_dir
    started = [name for name in STARTED if (run_dir / name).exists()]
    if started and not config.output.overwrite:
        # a run's metrics (a kill in the SFT warm-up leaves only sft_metrics.jsonl)
        if has_checkpoints(run_dir):
            raise ConfigError(
                f"output.dir {run_dir} already holds a run ({started[0]}); continue it with "
                "--resume auto, choose another output.dir, or set output.overwrite: true to "
                "replace it"
            )
        if (run_dir / "summary.json").exists():
            raise ConfigError(
                f"output.dir {run_dir} already holds a finished run (summary.json, no "
                "checkpoints/); choose another output.dir, or set output.overwrite: true to "
                "replace it")
        raise ConfigError(
            f"output.dir {run_dir} holds a run that stopped before its first checkpoint "
            f"({started[0]}, no checkpoints/): nothing to continue; start it again with "
            "`--set output.overwrite=true` (or set output.overwrite: true), or choose "
            "another output.dir"
        )
    if started:  # output.overwrite: the old run's files go
        for name in RUN_FILES:
            (run_dir / name).unlink(missing_ok=True)
        for name in ("final", "sft", CHECKPOINTS):
            shutil.rmtree(run_dir / name, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(to_yaml(config), encoding="utf-8")
    return run_dir


def _load_policy(config: RunConfig, base: Path | None, precision: Precision,
                 device: torch.device | None = None) -> tuple[torch.nn.Module, Any]:
    """The policy (LoRA attached when enabled) and tokenizer, from `base` or the config's model
    (loaded onto `device` where that is a GPU), in the dtypes `precision` gives them."""
    mc, lc = config.model, config.lora
    return load_policy(
        str(base) if base else mc.name_or_path,
        dtype=precision.load_dtype(lora=lc.enabled), adapter_dtype=precision.master_dtype,
        gradient_checkpointing=mc.gradient_checkpointing,
        attn_implementation=mc.attn_implementation, trust_remote_code=mc.trust_remote_code,
        lora=LoraSettings(lc.r, lc.alpha, lc.dropout, lc.target_modules) if lc.enabled else None,
        load_in_4bit=mc.load_in_4bit, load_in_8bit=mc.load_in_8bit,
        embeddings_in_4bit=mc.embeddings_in_4bit,
        tokenizer_name_or_path=None if base else mc.tokenizer,
        disable_dropout=mc.disable_dropout,
        device=device,
    )


def build_context(config: RunConfig, tasks: list[Task], base: Path | None = None) -> TrainContext:
    """Load the model (from `base` instead, e.g. the SFT model on resume) and tokenizer, and
    settle how to sample from them."""
    device = resolve_device(config.device)
    mc = config.model
    precision = resolve_precision(mc, device)
    if precision.name == "fp16-mixed" and strategy_for(config.distributed,
                                                       Dist.current().world_size) == "fsdp":
        raise ConfigError(FSDP_FP16)
    policy, tokenizer = _load_policy(config, base, precision, device)
    if mc.chat_template is not None:
        tokenizer.chat_template = resolve_chat_template(mc.chat_template)
    if not quantized_field(mc):
        policy.to(device)  # on a GPU already there (`load_policy`)
    if precision.name == "bf16":
        log.warning("%s", pure_bf16_warning(policy, config.train.learning_rate))
    trainable, total = trainable_parameters(policy)
    log.debug("model %s: %s trainable of %s parameters", mc.name_or_path, f"{trainable:,}", f"{total:,}")
    ro = config.rollout
    ids = resolve_stop_ids(policy, tokenizer, SamplingSettings.from_rollout(ro))
    sampling = SamplingSettings.from_rollout(ro, stop_token_ids=ids)
    engine = None
    if ro.engine == "vllm" and ro.vllm.server_url is not None:  # a server on its own GPU
        from mogrpo.rollout.vllm_server import VLLMServerEngine

        engine = VLLMServerEngine.create(policy, config)
    elif ro.engine == "vllm":  # started once the policy is on the GPU; it samples from its weights
        from mogrpo.rollout.vllm_engine import VLLMEngine

        dist = Dist.current()
        engine = VLLMEngine.create(policy, config, str(base) if base else mc.name_or_path,
                                   rank=dist.rank, world_size=dist.world_size,
                                   dtype=precision.compute_dtype)
    return TrainContext(config, tasks, policy, tokenizer, device, ids, sampling, engine,
                        precision)


def run_training(config: RunConfig, resume: str | None = None,
                 allow_config_change: bool = False) -> dict[str, Any]:
    """Run everything the config asks for; returns the summary also written to summary.json.

    With `resume` ("auto" or a checkpoint path) the run continues from a verified checkpoint
    exactly where it stopped, or refuses with the reason. Under torchrun the processes join
    their group here and leave it when the run is done.
    """
    with process_group(config.device) as dist:
        return _train(config, dist, resume, allow_config_change)


def _train(config: RunConfig, dist: Dist, resume: str | None,
           allow_config_change: bool) -> dict[str, Any]:
    config, main_dir = join_processes(config, dist)
    seed_everything(config.seed)  # the same in every process: same model, same prompts
    # data and reward errors surface before any model loads
    tasks = load_tasks(config, dist.rank, dist.world_size)
    # a process the checkpointed run did not have (1 -> 2 processes) starts its directory afresh
    resuming = resume is not None and (dist.is_main or Path(config.output.dir).is_dir())
    run_dir = prepare_run_dir(config, resuming=resuming)
    loaded = open_checkpoint(run_dir, config, resume, allow_config_change, dist, main_dir,
                             strategy_for(config.distributed, dist.world_size)
                             ) if resume else None
    sft_dir = main_dir / "sft" / "merged"
    # no merged SFT model over a quantised LoRA base (`restart_adapter`): the checkpoint's
    # adapter holds the warm-up, on the configured base; anywhere else a missing `sft/merged`
    # stops the load (it is the base, and the KL reference)
    quantised_lora = config.lora.enabled and (config.model.load_in_4bit
                                              or config.model.load_in_8bit)
    base = sft_dir if loaded and loaded.state["sft_done"] and not quantised_lora else None
    ctx = build_context(config, tasks, base)
    apply_host_memory(config.train.host_memory, ctx.device.type)
    summary_memory = _memory_estimate(ctx, config)
    summary: dict[str, Any] = {"run_dir": str(run_dir), "tasks": [t.name for t in ctx.tasks],
                               "memory_estimate_gib": summary_memory}
    log.info("%s", startup_summary(config, ctx.policy, ctx.device, ctx.tasks, summary_memory,
                                   run_dir, loaded.state["step"] if loaded else 0,
                                   ctx.precision))
    quick_eval = QuickEval(ctx, run_dir, dist)
    sft_done = bool(loaded and loaded.state["sft_done"])
    start_eval: dict[str, float] = {}
    if loaded is None:
        if config.sft.enabled:
            with MetricsWriter(run_dir / "sft_metrics.jsonl") as writer:
                summary.update(run_sft(ctx, writer))
            finish_sft(ctx, sft_dir, write=dist.is_main)
            dist.barrier()  # the SFT model is on disk before anyone may need it
            sft_done = True
        if config.eval.at_start:
            start_eval = quick_eval("start", 0)
    # DDP / FSDP2 (several processes): every process starts from process 0's weights
    parallel, reference = parallelize(ctx.policy, config.distributed, dist, ctx.device,
                                      reference_needed=any(t.config.beta > 0 for t in ctx.tasks),
                                      reference_dtype=ctx.precision.compute_dtype)
    if dist.world_size > 1 and loaded is None:  # each process samples its own completions
        torch.manual_seed(config.seed * 1_000_003 + dist.rank)
    trainer = GRPOTrainer(ctx, reference, parallel)
    trackers = Trackers(
        config, run_dir, state=loaded.state.get("trackers") if loaded else None,
        resume_step=loaded.state["step"] if loaded else None,
    )
    if config.logging.log_completions:
        trainer.completion_log = CompletionLog(run_dir, config.logging.log_completions_every,
                                               trackers)
    state = RunState(config, ctx, trainer, quick_eval, trackers, summary, sft_done, dist, run_dir,
                     main_dir)
    if loaded is not None:
        state.restore(loaded)  # RNG last: after the trackers started
    trainer.health.observe_eval(0, start_eval)  # the baseline of eval_regression

    if trainer.checkpoints_evals and loaded is None and start_eval:
        state.save(0)  # the model GRPO starts from: a rollback may have to go back to it
    try:
        with MetricsWriter(run_dir / "metrics.jsonl") as writer:
            trainer.run(Tee(writer, trackers), lambda step, metrics: _evaluate(
                parallel, quick_eval, str(step), step, metrics), state.save, state.rollback)
    except HealthStop as stop:
        _stopped(stop, trainer, summary, run_dir, sft_done)
        raise
    finally:
        trackers.close()
    return _finish(state, save=dist.is_main)


def _evaluate(parallel: ParallelPolicy, quick_eval: QuickEval, label: str, step: int,
              metrics: dict[str, Any] | None = None) -> dict[str, float]:
    """The greedy quick-eval, with the whole weights gathered under FSDP2."""
    with parallel.gathered():
        return quick_eval(label, step, metrics)


def _finish(state: RunState, save: bool) -> dict[str, Any]:
    """The last eval, the final model (process 0 only: `save`), summary.json and report.md.

    A kill in here leaves the last checkpoint (of the last step); resuming from it repeats
    only this: the eval log is rewritten from the checkpoint first, so `end` is written once."""
    ctx, trainer, quick_eval = state.ctx, state.trainer, state.quick_eval
    summary, run_dir = state.summary, state.run_dir
    end = _evaluate(trainer.parallel, quick_eval, "end", trainer.step, trainer.last_metrics)
    for alert in trainer.health.observe_eval(trainer.step, end, final=True):
        log.warning(alert.message)
    summary["health"] = [a.as_event() for a in trainer.health.alerts]
    summary["rollbacks"] = trainer.rollbacks
    log.info(trainer.health.summary())
    quick_eval.close()
    summary["evals"] = quick_eval.scores
    summary["pareto"] = quick_eval.pareto.to_json()
    summary["beta_changes"] = trainer.beta_changes
    summary["curriculum_changes"] = trainer.curriculum.changes
    policy = ctx.policy
    if trainer.parallel.is_fsdp:  # the shards, whole in an ordinary model on process 0
        policy = _unsharded_policy(state, save)
    if save and ctx.precision.mixed and not ctx.config.lora.enabled:
        # the final model in the compute dtype, as inference loads it (the checkpoints keep
        # the float32 master weights a resume needs; a LoRA merge is in its base's dtype)
        for param in policy.parameters():
            param.data = param.data.to(ctx.precision.compute_dtype)
    if save:
        record_stop_ids(policy, ctx.stop_token_ids)
    # the run is over: merge into the policy itself, not a copy (no second set of weights)
    summary["saved"] = {k: str(v) for k, v in save_model(
        policy, ctx.tokenizer, run_dir / "final", merged=ctx.config.output.save_merged,
        in_place=True).items()} if save else {}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    write_report(run_dir)  # report.md, and its charts where matplotlib is installed
    return summary


def _unsharded_policy(state: RunState, main: bool) -> torch.nn.Module | None:
    """FSDP2's trained weights gathered whole into a freshly loaded copy of the policy on
    process 0 (its frozen weights are those it was loaded with); None in the others."""
    weights = full_weights(state.trainer.parallel)
    if not main:
        return None
    base = state.main_dir / "sft" / "merged" if state.sft_done else None
    policy, _ = _load_policy(state.config, base if base and base.is_dir() else None,
                             state.ctx.precision)
    load_weights(policy, weights)
    return policy


def _stopped(stop: HealthStop, trainer: GRPOTrainer, summary: dict[str, Any], run_dir: Path,
             sft_done: bool) -> None:
    """summary.json of a run a `stop` check ended, naming the best checkpoint to go back to."""
    summary["health"] = [a.as_event() for a in trainer.health.alerts]
    summary["rollbacks"] = trainer.rollbacks
    best = next((a.best_step for a in stop.alerts if a.best_step is not None), None)
    if best is not None:
        summary["best_checkpoint"] = best_checkpoint(run_dir, best, sft_done, trainer.config)
        log.error("best checkpoint on the Pareto front: %s", summary["best_checkpoint"])
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2), encoding="utf-8")
    log.error(trainer.health.summary())


def best_checkpoint(run_dir: Path, step: int, sft_done: bool, config: RunConfig) -> str:
    """Where the weights of evaluated step `step` are: its checkpoint, or for step 0 the model
    GRPO started from."""
    path = run_dir / CHECKPOINTS / f"step-{step:07d}"
    if step > 0 and verify(path).ok:
        return f"step {step}: {path}"
    if step == 0:
        start = run_dir / "sft" / "merged" if sft_done else config.model.name_or_path
        return f"step 0 (before GRPO): {path if verify(path).ok else start}"
    return (f"step {step}: no checkpoint was saved there (save at every eval with "
            "output.save_every = eval.every_steps, or health.eval_regression.action: rollback)")


def _memory_estimate(ctx: TrainContext, config: RunConfig) -> float | None:
    """The planner's estimate for this run, logged next to the measured peak of each step."""
    try:
        gpu = torch.cuda.get_device_properties(ctx.device).total_memory \
            if ctx.device.type == "cuda" else None
        est = estimate(ctx.policy.config, config, device=ctx.device.type,
                       reward_models=reward_model_configs(config), gpu_memory=gpu)
    except MogrpoError as err:  # e.g. an architecture the planner does not model
        log.info("memory estimate unavailable: %s", err)
        return None
    log.debug("%s", est.table())
    log.debug("estimated peak memory %.2f GiB (see `mogrpo memory`); measured per step as "
              "memory/peak_gib", est.total / 2**30)
    return est.total / 2**30


def finish_sft(ctx: TrainContext, sft_dir: Path, write: bool = True) -> None:
    """Save the SFT model (GRPO's reference, and the base a resume reloads) and, under LoRA,
    restart the adapter on top of it. Only process 0 writes (`write`)."""
    from peft import PeftModel

    record_stop_ids(ctx.policy, ctx.stop_token_ids)  # saved with it: it ends as the run's do
    if isinstance(ctx.policy, PeftModel):
        restart_adapter(ctx, sft_dir, write)
    elif write:
        save_pretrained(ctx.policy, ctx.tokenizer, sft_dir)


def restart_adapter(ctx: TrainContext, sft_dir: Path, write: bool = True) -> None:
    """Make the SFT model GRPO's reference under LoRA.

    "Adapters disabled" must mean the warm-up model, not the pre-SFT base, as in
    DeepSeekMath, where the reference is the SFT model. So the warm-up adapter is merged
    into the base, the merged model is saved (the final adapter's base), and a fresh adapter
    (B = 0, so KL starts at exactly 0) is attached for GRPO.
    """
    from peft import PeftModel

    policy = ctx.policy
    if not isinstance(policy, PeftModel):
        return
    if is_quantized(policy.get_base_model()):
        log.warning("quantised base: the SFT adapter cannot be merged losslessly, so the KL "
                    "reference stays the pre-SFT base model")
        return
    lc = ctx.config.lora
    merged = policy.merge_and_unload()
    if write:
        save_pretrained(merged, ctx.tokenizer, sft_dir)
    fresh = apply_lora(merged, LoraSettings(lc.r, lc.alpha, lc.dropout, lc.target_modules),
                       input_grads=ctx.config.model.gradient_checkpointing,
                       adapter_dtype=ctx.precision.master_dtype)
    fresh.peft_config["default"].base_model_name_or_path = str(sft_dir)
    ctx.policy = fresh
    log.info("SFT adapter merged into %s; GRPO trains a fresh adapter on top", sft_dir)

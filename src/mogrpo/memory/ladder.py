"""The ladder: config changes, cheapest first, that bring an estimated peak under a GPU's memory."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mogrpo.config import RunConfig, derive_lengths
from mogrpo.config.hardware import process_errors
from mogrpo.config.precision import resolve_precision
from mogrpo.config.processes import strategy_for
from mogrpo.memory.estimate import MemoryEstimate, with_changes


@dataclass
class Step:
    """One rung of the ladder: a config change, applied on top of the previous ones."""

    change: str
    overrides: list[str]
    saving: int
    """Bytes this change saves, given the steps before it."""
    total: int
    """Estimated peak after this and every earlier step."""
    cost: str
    """What the change costs in quality or speed."""
    changes: dict[str, Any] = field(default_factory=dict, repr=False)
    rung: int = field(default=0, repr=False)
    nproc: int | None = None
    """The number of processes to launch, when the change is to run on more of them."""

    @property
    def arguments(self) -> list[str]:
        """The command-line arguments that make this change (`--nproc N`, `--set K=V` ...)."""
        launch = ["--nproc", str(self.nproc)] if self.nproc else []
        return launch + [arg for o in self.overrides for arg in ("--set", o)]


def _set(changes: Mapping[str, Any]) -> list[str]:
    return [f"{k}={json.dumps(v) if isinstance(v, bool) else v}" for k, v in changes.items()]


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)


Rung = tuple[str, list[dict[str, Any]], str]  # what, candidate changes mildest first, cost
EstimateFn = Callable[[RunConfig, int], MemoryEstimate]
"""The estimate of a config for a number of processes (per process)."""

FSDP_COST = ("each layer's parameters are all-gathered in forward and again in backward and "
             "gradients reduce-scattered (~1.5× DDP's traffic), plus one full gather per rollout")
DDP_COST = "one all-reduce of the gradients per step; every process holds the whole model"


def _micro_batch(run: RunConfig, nproc: int) -> Rung:
    mb = run.train.micro_batch_size
    total = mb * run.train.gradient_accumulation_steps
    options = [{"train.micro_batch_size": d, "train.gradient_accumulation_steps": total // d}
               for d in range(mb - 1, 0, -1) if total % d == 0]
    return ("micro-batch down, accumulation up", options,
            f"none in quality (still {total} completions per optimizer step); more, smaller "
            "forward/backward passes make the update slower")


def _checkpointing(run: RunConfig, nproc: int) -> Rung:
    options = [] if run.model.gradient_checkpointing else [{"model.gradient_checkpointing": True}]
    return ("gradient checkpointing", options,
            "none in quality; each layer is recomputed in backward (~30 % slower update)")


def _colocated_vllm(run: RunConfig) -> bool:
    return run.rollout.engine == "vllm" and run.rollout.vllm.server_url is None


def _vllm_sleep(run: RunConfig, nproc: int) -> Rung:
    awake = _colocated_vllm(run) and not run.rollout.vllm.sleep_during_update
    return ("colocated vLLM asleep during the update",
            [{"rollout.vllm.sleep_during_update": True}] if awake else [],
            "none in quality; its weights are offloaded and its KV cache freed for each update "
            "and restored before the next rollout (seconds per step)")


def _vllm_share(run: RunConfig, nproc: int) -> Rung:
    share = run.rollout.vllm.gpu_memory_utilization
    # three quarters and half of it, down to a multiple of 0.05, at least 0.05
    shares = {max(0.05, int(share * f * 20) / 20) for f in (0.75, 0.5)}
    options = [{"rollout.vllm.gpu_memory_utilization": s} for s in sorted(shares, reverse=True)
               if s < share] if _colocated_vllm(run) else []
    return ("smaller colocated vLLM share", options,
            "none in quality; a smaller KV cache decodes fewer sequences at once (slower "
            "rollouts), and vLLM refuses to start if its weights and one sequence do not fit "
            "in the share")


def _generation_batch(run: RunConfig, nproc: int) -> Rung:
    """Decode the step's completions in smaller batches (the native and hf engines; vLLM's
    memory is its share)."""
    rows = run.train.micro_batch_size * run.train.gradient_accumulation_steps // nproc
    now = min(rows, run.rollout.generation_batch_size or rows)
    options = [{"rollout.generation_batch_size": n} for n in _half_quarter(now)]
    return ("smaller generation batch", options if run.rollout.engine != "vllm" else [],
            "none in quality (the same completions, decoded in more, smaller batches); slower "
            "rollouts")


def _four_bit(run: RunConfig, nproc: int) -> Rung:
    # vLLM cannot follow a quantised policy (its weight push needs unquantised weights)
    ok = run.lora.enabled and not run.model.load_in_4bit and run.rollout.engine != "vllm"
    # an 8-bit base is swapped for a 4-bit one: the base loads in one format
    change = {"model.load_in_8bit": False, "model.load_in_4bit": True} \
        if run.model.load_in_8bit else {"model.load_in_4bit": True}
    return ("4-bit NF4 base weights", [change] if ok else [],
            "small quality cost (QLoRA reports parity with 16-bit LoRA); slower matmuls; needs "
            "bitsandbytes (on a CPU 0.46.1 or newer)")


def _completions(run: RunConfig, nproc: int) -> Rung:
    prompt, completion = derive_lengths(run.rollout)
    # round to multiples of 8 (96, 64, …) as people write them
    lengths = {c // 8 * 8 if c >= 16 else max(1, c) for c in (completion * 3 // 4, completion // 2)}
    options = [{"rollout.length_allocation": "explicit", "rollout.max_prompt_length": prompt,
                "rollout.max_completion_length": c}
               for c in sorted(lengths - {completion}, reverse=True)]
    return ("shorter completions", options,
            "answers that need more tokens are cut and score worse: watch rollout/truncated_frac")


def _fewer_generations(run: RunConfig, nproc: int) -> Rung:
    k, mb = run.rollout.num_generations, run.train.micro_batch_size
    prompts = run.prompts_per_step
    options = []
    for kk in sorted({max(2, k * 3 // 4), max(2, k // 2)} - {k}, reverse=True):
        d = _largest_divisor(prompts * kk, mb)  # keeps every prompt's K completions in one step
        options.append({"rollout.num_generations": kk, "train.micro_batch_size": d,
                        "train.gradient_accumulation_steps": prompts * kk // d})
    return ("fewer completions per prompt (K)", options,
            "noisier group baselines and more zero-variance groups: less signal per prompt")


def _half_quarter(n: int) -> list[int]:
    return sorted({max(1, n // 2), max(1, n // 4)} - {n}, reverse=True)


def _lower_rank(run: RunConfig, nproc: int) -> Rung:
    lc = run.lora
    options = [{"lora.r": r, "lora.alpha": max(1, round(lc.alpha * r / lc.r))}
               for r in _half_quarter(lc.r)]
    return ("lower LoRA rank", options if lc.enabled else [],
            "less adapter capacity (alpha scaled to keep alpha/r); saves little memory")


def _sft_batch(run: RunConfig, nproc: int) -> Rung:
    options = [{"sft.batch_size": b} for b in _half_quarter(run.sft.batch_size)]
    return ("smaller SFT warm-up batch", options if run.sft.enabled else [],
            "noisier warm-up gradients (the SFT loop does not accumulate); consider more "
            "sft.steps")


def _shard(run: RunConfig, nproc: int) -> Rung:
    """FSDP2 over the processes already launched (with one it would shard nothing)."""
    options: list[dict[str, Any]] = []
    if process_errors(run, "fsdp"):  # quantised weights, an optimizer other than adamw
        return ("shard with FSDP2", [], FSDP_COST)
    if nproc > 1 and run.distributed.strategy != "fsdp":
        options.append({"distributed.strategy": "fsdp"})
    mc = run.model
    mixed = resolve_precision(mc.precision, mc.dtype, "cuda") in ("fp32", "bf16-mixed") \
        and run.distributed.mixed_precision == "none"
    if nproc > 1 and mixed:
        # fp32 shards, bf16 gathers and compute: halves what is gathered (and, from fp32, the
        # activations; under autocast no whole-model bf16 copy is kept for the backward)
        options.append({"distributed.strategy": "fsdp", "distributed.mixed_precision": "bf16"})
    return ("shard with FSDP2", options, "none in quality" + (
        " (mixed_precision bf16: bf16 matmuls, gradients reduced in fp32)" if mixed else "")
        + f"; {FSDP_COST}")


def _eight_bit_optimizer(run: RunConfig, nproc: int) -> Rung:
    """Full fine-tuning: AdamW's m and v in 8 bits (2 B a parameter instead of 8)."""
    ok = not run.lora.enabled and run.train.optimizer == "adamw" and \
        strategy_for(run.distributed, nproc) != "fsdp"
    return ("8-bit AdamW states", [{"train.optimizer": "adamw_8bit"}] if ok else [],
            "little in quality (block-wise 8-bit states matched 32-bit Adam in Dettmers et al. "
            "2022); needs bitsandbytes (on a CPU 0.50 or newer), and not with "
            "distributed.strategy: fsdp")


def _pure_bf16(run: RunConfig, nproc: int) -> Rung:
    """Full fine-tuning's last resort: bfloat16 weights and AdamW states (`model.precision`)."""
    mc = run.model
    ok = not run.lora.enabled and resolve_precision(mc.precision, mc.dtype, "cuda") == "bf16-mixed"
    return ("pure bf16 weights and AdamW states", [{"model.precision": "bf16"}] if ok else [],
            "updates below ~0.4 % of a weight round away: AdamW moves each weight by about the "
            "learning rate, so weights of size s stop learning below lr ≈ s · 2^-9 (4e-5 at "
            f"s = 0.02; train.learning_rate is {run.train.learning_rate:g}); the startup log "
            "names this model's figure")


RUNGS: tuple[Callable[[RunConfig, int], Rung], ...] = (
    _micro_batch, _checkpointing, _vllm_sleep, _vllm_share, _generation_batch, _shard, _sft_batch,
    _four_bit, _eight_bit_optimizer,
    _completions, _fewer_generations, _lower_rank, _pure_bf16)
"""Quality-neutral changes first (they cost only speed); then the two that change how weights
or optimizer states are stored, whose quality cost the literature measured as small (4-bit
base weights for LoRA, 8-bit AdamW states for full fine-tuning: never both in one run); then
those that change what GRPO sees (shorter completions, fewer per prompt, a lower rank); pure
bf16, which can stop a run from learning at all, last."""


def ladder(estimate_fn: EstimateFn, run: RunConfig, gpu_bytes: int, nproc: int = 1
           ) -> list[Step]:
    """Config changes, cheapest first and cumulative, until the estimate (per process, for
    `nproc` processes) fits `gpu_bytes`.

    Each rung takes its mildest setting that fits, else its strongest, and is skipped when it
    saves nothing. Empty when the run already fits; the last step's `total` still exceeds the
    GPU when all rungs together are not enough. Running on more GPUs is :func:`scale_out`.
    """
    steps = _climb(estimate_fn, run, gpu_bytes, 1, nproc)
    if not steps or steps[0].rung != 0 or steps[-1].total > gpu_bytes:
        return steps
    # A later rung (checkpointing) may leave room for a larger micro-batch than the first rung
    # had to pick on its own: take the largest that fits without climbing further.
    total = run.train.micro_batch_size * run.train.gradient_accumulation_steps
    picked = steps[0].changes["train.micro_batch_size"]
    for d in range(run.train.micro_batch_size - 1, picked, -1):
        alt = _climb(estimate_fn, run, gpu_bytes, d, nproc) if total % d == 0 else []
        if alt and alt[-1].total <= gpu_bytes and alt[-1].rung <= steps[-1].rung:
            return alt
    return steps


def _climb(estimate_fn: EstimateFn, run: RunConfig, gpu_bytes: int, min_micro_batch: int,
           nproc: int) -> list[Step]:
    current = estimate_fn(run, nproc).total
    steps: list[Step] = []
    for index, rung in enumerate(RUNGS):
        if current <= gpu_bytes:
            break
        what, options, cost = rung(run, nproc)
        options = [o for o in options if o.get("train.micro_batch_size", 1 << 30) >= min_micro_batch
                   or rung is not _micro_batch]
        tried = [(opt, estimate_fn(with_changes(run, opt), nproc).total) for opt in options]
        tried = [(opt, total) for opt, total in tried if total < current]
        if not tried:
            continue
        opt, total = next(((o, t) for o, t in tried if t <= gpu_bytes), tried[-1])
        shown = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in opt.items()
                          if k not in ("rollout.length_allocation", "rollout.max_prompt_length"))
        steps.append(Step(f"{what}: {shown}", _set(opt), current - total, total, cost, opt, index))
        run, current = with_changes(run, opt), total
    return steps


def scale_out(estimate_fn: EstimateFn, run: RunConfig, gpu_bytes: int, nproc: int = 1,
              max_nproc: int = 64) -> Step | None:
    """Running on more GPUs instead of cutting the run: the fewest processes (more than
    `nproc`, at most `max_nproc`, dividing the prompts per step) at which the per-process estimate fits
    `gpu_bytes` under `ddp` or `fsdp`, as the run is or else with gradient checkpointing.

    No quality cost, only GPUs and communication. At equal counts the run as it is beats
    one with checkpointing, and ddp beats fsdp (less traffic; under LoRA fsdp also gathers
    the whole base for every rollout). None when nothing fits within `max_nproc`.
    """
    current = estimate_fn(run, nproc).total
    variants: list[dict[str, Any]] = [{}]
    if not run.model.gradient_checkpointing:
        variants.append({"model.gradient_checkpointing": True})
    # fsdp over the processes already there is the ladder's `_shard` rung
    counts = [n for n in range(nproc + 1, max_nproc + 1) if run.prompts_per_step % n == 0]
    for n in counts:
        for extra in variants:
            for strategy, cost in (("ddp", DDP_COST), ("fsdp", FSDP_COST))[
                    :1 if process_errors(run, "fsdp") else 2]:
                changes = {"distributed.strategy": strategy, **extra}
                total = estimate_fn(with_changes(run, changes), n).total
                if total <= gpu_bytes:
                    what = f"{strategy} over {n} processes" + (
                        ", gradient checkpointing" if extra else "")
                    return Step(what, _set(changes), current - total, total, cost, changes,
                                len(RUNGS), n)
    return None

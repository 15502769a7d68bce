"""The GRPO loop. The trainer only sequences named phases; the math lives in `mogrpo.algo`.

One step: `draw_prompts` → `generate` → `score` (rewards → advantages per task) →
`reference_logprobs` → `update` (μ passes × gradient accumulation) → metrics.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from mogrpo.algo.advantages import group_advantages, reward_stats
from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.config import RunConfig
from mogrpo.data.schema import Example
from mogrpo.modeling.reference import Reference
from mogrpo.rewards.base import score as score_rewards
from mogrpo.rollout.generate import Rollout, generate_rollout
from mogrpo.train.common import (
    MetricsWriter,
    Progress,
    TrainContext,
    build_optimizer,
    build_scheduler,
    render_prompts,
)
from mogrpo.train.tasks import TaskMixer

log = logging.getLogger(__name__)


@dataclass
class ScoredBatch:
    """A step's rollout with everything the update needs."""

    rollout: Rollout
    task_ids: torch.Tensor  # [B] task index of each completion
    advantages: torch.Tensor  # [B]
    beta: torch.Tensor  # [B] KL coefficient of each completion's task
    ref_logp: torch.Tensor | None  # [B, C] or None when no task has β > 0
    old_logp: torch.Tensor | None  # [B, C] rollout-time log-probs; None when μ = 1
    metrics: dict[str, float]


class GRPOTrainer:
    """Runs GRPO steps on a loaded policy; state lives in named, checkpointable parts."""

    def __init__(self, ctx: TrainContext, reference: Reference | None) -> None:
        self.ctx = ctx
        self.config: RunConfig = ctx.config
        self.reference = reference
        self.mixer = TaskMixer(ctx.tasks, ctx.config.seed)
        tc = self.config.train
        self.total_updates = tc.max_steps * self.config.algorithm.num_iterations
        self.optimizer = build_optimizer(ctx.policy, tc.learning_rate, tc.weight_decay, tc.adam_betas)
        self.scheduler = build_scheduler(
            self.optimizer, tc.lr_scheduler, tc.warmup_steps, self.total_updates
        )
        self.step = 0
        self.skipped_updates = 0

    # ------------------------------------------------------------------ phases

    def draw_prompts(self) -> list[tuple[int, Example]]:
        return self.mixer.next_batch(self.config.prompts_per_step)

    def generate(self, picks: list[tuple[int, Example]]) -> Rollout:
        texts, add_special = render_prompts(self.ctx, [(t, ex) for t, ex in picks])
        return generate_rollout(
            self.ctx.policy,
            self.ctx.tokenizer,
            texts,
            self.ctx.sampling,
            num_generations=self.config.rollout.num_generations,
            max_prompt_length=self.config.rollout.prompt_length,
            add_special_tokens=add_special,
        )

    def score(self, picks: list[tuple[int, Example]], rollout: Rollout) -> ScoredBatch:
        """Rewards per task and objective, then group-relative advantages per task."""
        K = rollout.num_generations
        algo = self.config.algorithm
        device = rollout.completion_ids.device
        task_ids = torch.tensor([t for t, _ in picks for _ in range(K)], device=device)
        advantages = torch.zeros(rollout.batch_size, device=device)
        beta = torch.zeros(rollout.batch_size, device=device)
        metrics: dict[str, float] = {}
        lengths = rollout.lengths.tolist()
        truncated = rollout.truncated.tolist()
        for t, task in enumerate(self.ctx.tasks):
            rows = [i for i, (pt, _) in enumerate(picks) if pt == t]
            if not rows:
                continue
            idx = [i * K + k for i in rows for k in range(K)]  # completion rows of this task
            examples = [picks[i][1] for i in rows for _ in range(K)]
            columns = _columns(examples)
            columns["completion_lengths"] = [lengths[j] for j in idx]
            columns["truncated"] = [truncated[j] for j in idx]
            rewards = score_rewards(
                task.reward_fns, [ex.prompt for ex in examples],
                [rollout.texts[j] for j in idx], columns,
            )  # [n*K, J]
            grouped = rewards.view(len(rows), K, -1)
            adv = group_advantages(
                grouped, task.reward_weights, combine=algo.advantage_combine,
                scale=algo.advantage_scaling,
            )  # [n, K]
            index = torch.tensor(idx, device=device)
            advantages[index] = adv.reshape(-1).to(device)
            beta[index] = task.config.beta
            metrics.update(_reward_metrics(task.name, task.reward_labels, task.reward_weights,
                                           grouped, adv))
        return ScoredBatch(rollout, task_ids, advantages, beta, None, None, metrics)

    @torch.no_grad()
    def reference_logprobs(self, batch: ScoredBatch) -> None:
        """Rollout-time log-probs (μ > 1) and reference log-probs (β > 0), micro-batched."""
        need_old = self.config.algorithm.num_iterations > 1
        need_ref = self.reference is not None and bool((batch.beta > 0).any())
        if not (need_old or need_ref):
            return
        old, ref = [], []
        for rows in self._micro_batches(batch.rollout.batch_size):
            args = _slice(batch.rollout, rows)
            if need_old:
                old.append(completion_logprobs(self.ctx.policy, *args, temperature=self.ctx.sampling.temperature)[0])
            if need_ref:
                with self.reference.model() as ref_model:
                    ref.append(completion_logprobs(ref_model, *args, temperature=self.ctx.sampling.temperature)[0])
        width = batch.rollout.completion_ids.shape[1]
        batch.old_logp = _cat_padded(old, width) if need_old else None
        batch.ref_logp = _cat_padded(ref, width) if need_ref else None

    def update(self, batch: ScoredBatch) -> dict[str, float]:
        """μ optimizer updates on the batch, each accumulating over its micro-batches."""
        algo, ro = self.config.algorithm, batch.rollout
        policy = self.ctx.policy
        policy.train()
        normalizer = loss_normalizer(ro.completion_mask, algo.loss_aggregation,
                                     self.config.rollout.completion_length)
        seq_kl = torch.zeros(ro.batch_size)
        totals = {"loss": 0.0, "clip_tokens": 0.0, "tokens": 0, "entropy": 0.0, "grad_norm": 0.0}
        for it in range(algo.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            for rows in self._micro_batches(ro.batch_size):
                args = _slice(ro, rows)
                width = args[2].shape[1]
                logp, entropy = completion_logprobs(
                    policy, *args, temperature=self.ctx.sampling.temperature, with_entropy=it == 0,
                )
                old = batch.old_logp[rows, :width] if batch.old_logp is not None else logp.detach()
                ref = batch.ref_logp[rows, :width] if batch.ref_logp is not None else None
                out = grpo_loss(
                    logp, old, batch.advantages[rows], args[3], normalizer=normalizer,
                    aggregation=algo.loss_aggregation, epsilon_low=algo.epsilon_low,
                    epsilon_high=algo.epsilon_high, ref_logp=ref, beta=batch.beta[rows],
                    kl_estimator=algo.kl_estimator, kl_importance_weight=algo.kl_importance_weight,
                )
                out.loss.backward()  # gradients add up across micro-batches
                totals["loss"] += out.loss.item() / algo.num_iterations
                if it == 0:
                    seq_kl[rows] = out.kl.float().cpu()
                    totals["clip_tokens"] += float(out.clip_frac_tokens)
                    totals["tokens"] += out.num_tokens
                    mask = args[3].bool()
                    totals["entropy"] += float(entropy[mask].sum()) if entropy is not None else 0.0
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in policy.parameters() if p.requires_grad], self.config.train.max_grad_norm
            )
            if torch.isfinite(grad_norm):
                self.optimizer.step()
            else:  # a non-finite gradient would poison AdamW's moments; skip and count it
                self.skipped_updates += 1
                log.warning("step %d: non-finite gradient norm, update skipped", self.step)
            self.scheduler.step()
            totals["grad_norm"] += float(grad_norm) / algo.num_iterations
        tokens = max(totals["tokens"], 1)
        metrics = {
            "loss": totals["loss"],
            "policy/grad_norm": totals["grad_norm"],
            "policy/clip_frac": totals["clip_tokens"] / tokens,
            "policy/entropy": totals["entropy"] / tokens,
            "policy/skipped_updates": self.skipped_updates,
            "kl": float(seq_kl.mean()),
        }
        for t, task in enumerate(self.ctx.tasks):
            mask = batch.task_ids.cpu() == t
            if mask.any():
                metrics[f"task/{task.name}/kl"] = float(seq_kl[mask].mean())
                metrics[f"task/{task.name}/beta"] = task.config.beta
        return metrics

    # ------------------------------------------------------------------ loop

    def train_step(self) -> dict[str, float]:
        t0 = time.perf_counter()
        picks = self.draw_prompts()
        rollout = self.generate(picks)
        t1 = time.perf_counter()
        batch = self.score(picks, rollout)
        t2 = time.perf_counter()
        self.reference_logprobs(batch)
        metrics = self.update(batch)
        t3 = time.perf_counter()
        self.step += 1
        n_tokens = int(rollout.lengths.sum())
        metrics.update(batch.metrics)
        metrics.update({
            "step": self.step,
            "lr": self.scheduler.get_last_lr()[0],
            "rollout/completion_length": float(rollout.lengths.float().mean()),
            "rollout/truncated_frac": float(rollout.truncated.float().mean()),
            "rollout/prompt_truncated": rollout.prompt_truncated,
            "time/rollout_s": t1 - t0,
            "time/reward_s": t2 - t1,
            "time/update_s": t3 - t2,
            "time/step_s": t3 - t0,
            "throughput/completion_tokens_per_s": n_tokens / max(t1 - t0, 1e-9),
        })
        return metrics

    def run(self, writer: MetricsWriter, evaluate: Any = None) -> None:
        """Steps until `train.max_steps`, logging each and evaluating when configured."""
        cfg = self.config
        every = cfg.eval.every_steps
        with Progress(cfg.train.max_steps, "GRPO", cfg.logging.progress_bar, start=self.step) as bar:
            while self.step < cfg.train.max_steps:
                metrics = self.train_step()
                if evaluate is not None and every and self.step % every == 0 and self.step < cfg.train.max_steps:
                    metrics.update(evaluate(self.step))
                writer.write(metrics)
                bar.update(metrics, self.ctx.tasks)
                if self.step % cfg.logging.log_every == 0:
                    log.info(format_step(metrics, [t.name for t in self.ctx.tasks], cfg.train.max_steps))

    def _micro_batches(self, batch_size: int) -> list[slice]:
        size = self.config.train.micro_batch_size
        return [slice(i, min(i + size, batch_size)) for i in range(0, batch_size, size)]


def _columns(examples: list[Example]) -> dict[str, list]:
    keys: list[str] = []
    for ex in examples:
        keys.extend(k for k in ex.columns if k not in keys)
    return {k: [ex.columns.get(k) for ex in examples] for k in keys}


def _slice(ro: Rollout, rows: slice) -> tuple[torch.Tensor, ...]:
    """The micro-batch's tensors, trimmed of columns that are padding in every row."""
    prompt_ids, prompt_mask = ro.prompt_ids[rows], ro.prompt_mask[rows]
    completion_ids, completion_mask = ro.completion_ids[rows], ro.completion_mask[rows]
    first = int(prompt_mask.any(0).float().argmax())  # left padding shared by all rows
    width = max(int(completion_mask.sum(1).max()), 1)
    return (prompt_ids[:, first:], prompt_mask[:, first:],
            completion_ids[:, :width], completion_mask[:, :width])


def _cat_padded(parts: list[torch.Tensor], width: int) -> torch.Tensor:
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1])) for p in parts])


def _reward_metrics(name: str, labels: list[str], weights: list[float],
                    grouped: torch.Tensor, adv: torch.Tensor) -> dict[str, float]:
    stats = reward_stats(grouped)
    out: dict[str, float] = {}
    combined = 0.0
    for j, label in enumerate(labels):
        prefix = f"task/{name}/reward/{label}"
        out[f"{prefix}/mean"] = stats["mean"][j]
        out[f"{prefix}/std"] = stats["std"][j]
        out[f"{prefix}/missing_frac"] = stats["missing_frac"][j]
        if not math.isnan(stats["mean"][j]):
            combined += weights[j] * stats["mean"][j]
    out[f"task/{name}/reward/mean"] = combined
    # A group whose advantages are all zero carries no learning signal.
    out[f"task/{name}/zero_var_frac"] = float((adv.abs().amax(dim=1) < 1e-8).float().mean())
    return out


def format_step(metrics: dict[str, float], tasks: list[str], total: int) -> str:
    """One console line per step: the figures a user watches."""
    parts = [f"step {metrics['step']}/{total}", f"loss {metrics['loss']:+.4f}"]
    for name in tasks:
        if f"task/{name}/reward/mean" in metrics:
            parts.append(
                f"{name}: reward {metrics[f'task/{name}/reward/mean']:.3f} "
                f"kl {metrics[f'task/{name}/kl']:.4f}"
            )
    parts.append(f"len {metrics['rollout/completion_length']:.1f}")
    parts.append(f"trunc {metrics['rollout/truncated_frac']:.0%}")
    parts.append(f"{metrics['time/step_s']:.2f}s")
    return " | ".join(parts)

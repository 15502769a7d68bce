"""The update phases of a GRPO step: the rollout-time and reference log-probs, then μ
optimizer updates on the batch, each accumulating its micro-batches' gradients.

`UpdatePhases` is a part of `GRPOTrainer` (`mogrpo.trainer.grpo`), kept in a file of its own; it
uses the trainer's `ctx`, `config`, `parallel`, `reference`, `dist`, `optimizer`, `scheduler`,
`scaler`, `step`, `skipped_updates`, `oom`, `_sampler_correction` and `_task_kl`.
"""

from __future__ import annotations

import logging

import torch

from mogrpo import kernels
from mogrpo.algo.importance import truncated_importance_weights
from mogrpo.algo.kl import sequence_kl
from mogrpo.algo.logprobs import completion_logprobs, shares_prompts
from mogrpo.algo.loss import grpo_loss, loss_normalizer
from mogrpo.algo.surrogates import LossVariant, mask_truncated, resolve_aggregation
from mogrpo.rollout.batching import first_row, length_buckets, micro_batch
from mogrpo.rollout.generate import Rollout
from mogrpo.rollout.scoring import score_hidden
from mogrpo.tracking import names
from mogrpo.trainer.batches import ScoredBatch
from mogrpo.trainer.optim import step_with_update_norms

log = logging.getLogger("mogrpo.trainer.grpo")
UPDATE_NORM_MAX_PARAMS = 50_000_000


class UpdatePhases:
    """`reference_logprobs` and `update`, with their micro-batching and optimizer step."""

    @torch.no_grad()
    def reference_logprobs(self, batch: ScoredBatch) -> None:
        """Rollout-time log-probs (μ > 1) and reference log-probs (β > 0), micro-batched."""
        need_old = self.config.algorithm.num_iterations > 1
        # under FSDP2 every forward is collective: all processes run it if any needs it
        need_ref = self.reference is not None and self.parallel.agree(bool((batch.beta > 0).any()))
        temperature = self.ctx.sampling.temperature
        ids = batch.rollout.completion_ids  # [B, C]
        old = torch.zeros(ids.shape, device=ids.device) if need_old else None
        ref = torch.zeros(ids.shape, device=ids.device) if need_ref else None
        micro_batches = self._micro_batches(batch.rollout)
        # the update's choice (its policy may be DDP-wrapped): the same rows then take the same
        # arithmetic here, and KL and ratios are exact while the policy equals them
        share = shares_prompts(self.parallel.module)
        min_saved = self._prompt_sharing()
        # under the update's autocast; one context, so the policy's weights are cast once
        with self.ctx.precision.autocast():
            for rows in self.parallel.pad(micro_batches):
                # None: another process has more rows; FSDP2's forwards are collective, so
                # this one runs a row of its own alongside and keeps nothing
                keep = rows is not None
                args = micro_batch(batch.rollout, rows if keep else first_row(micro_batches[0]))
                width = args[2].shape[1]
                if need_old:
                    logp = completion_logprobs(self.ctx.policy, *args, temperature=temperature,
                                               forward=score_hidden, share_prompts=share,
                                               min_saved=min_saved, products=kernels.products())[0]
                    if keep:
                        old[rows, :width] = logp
                if need_ref:
                    with self.reference.model() as ref_model:
                        logp = completion_logprobs(ref_model, *args, temperature=temperature,
                                                   forward=score_hidden, share_prompts=share,
                                                   min_saved=min_saved,
                                                   products=kernels.products())[0]
                    if keep:
                        ref[rows, :width] = logp
        batch.old_logp, batch.ref_logp = old, ref

    def update(self, batch: ScoredBatch) -> dict[str, float]:
        """μ optimizer updates on the batch, each accumulating over its micro-batches."""
        algo, ro = self.config.algorithm, batch.rollout
        policy = self.parallel.module  # the DDP wrapper, or the (sharded) policy itself
        policy.train()
        variant = LossVariant.from_config(algo)
        aggregation = resolve_aggregation(algo.loss_type, algo.loss_aggregation)
        # only the policy's own tokens: an episode's tool results are context, not actions
        train_mask = ro.train_mask  # [B, C]
        loss_mask = (mask_truncated(train_mask, ro.truncated)
                     if algo.mask_truncated_completions else train_mask)  # [B, C]
        # BNPO's normaliser is per micro-batch, so its rows stay in order (as TRL splits them)
        micro_batches = self._micro_batches(ro, by_length=aggregation != "micro_token_mean")
        # the step's global normaliser: a sum over this process's rows, then over processes
        normalizer = self.dist.sum(loss_normalizer(loss_mask, aggregation,
                                                   self.config.rollout.completion_length,
                                                   micro_batches=len(micro_batches)))
        seq_kl = torch.zeros(ro.batch_size)
        totals = {"loss": 0.0, "clip_tokens": 0.0, "tokens": 0, "entropy": 0.0, "grad_norm": 0.0,
                  "update_norm": 0.0, "is_weight": 0.0, "is_capped": 0.0}
        for it in range(algo.num_iterations):
            self.optimizer.zero_grad(set_to_none=True)
            plan = self.parallel.pad(micro_batches)
            for i, rows in enumerate(plan):
                self.parallel.sync_gradients(last=i == len(plan) - 1)  # only the last reduces
                if rows is None:  # FSDP2: another process has more micro-batches
                    self.parallel.idle_backward(lambda: self._forward(
                        policy, micro_batch(ro, first_row(micro_batches[0])))[0])
                    continue
                args = micro_batch(ro, rows)
                width = args[2].shape[1]
                logp, entropy = self._forward(policy, args, with_entropy=it == 0)
                old = batch.old_logp[rows, :width] if batch.old_logp is not None else logp.detach()
                ref = batch.ref_logp[rows, :width] if batch.ref_logp is not None else None
                sampled = train_mask[rows, :width]  # [b, w]
                weights = self._importance_weights(old, ro, rows, sampled,
                                                   totals if it == 0 else None)
                out = grpo_loss(
                    logp, old, batch.advantages[rows], loss_mask[rows, :width],
                    normalizer=normalizer, aggregation=aggregation, epsilon_low=algo.epsilon_low,
                    epsilon_high=algo.epsilon_high, ref_logp=ref, beta=batch.beta[rows],
                    kl_estimator=algo.kl_estimator, kl_importance_weight=algo.kl_importance_weight,
                    variant=variant, importance_weights=weights,
                )
                # gradients add up across micro-batches (fp16: all at the step's loss scale)
                self.parallel.backward(self.scaler.scale(out.loss))
                totals["loss"] += out.loss.item() / algo.num_iterations
                if it == 0:
                    # KL is measured on every completion, also those left out of the loss
                    seq_kl[rows] = (sequence_kl(logp.detach(), ref, sampled, algo.kl_estimator)
                                    if ref is not None and algo.mask_truncated_completions
                                    else out.kl).float().cpu()
                    totals["clip_tokens"] += float(out.clip_frac_tokens)
                    totals["tokens"] += out.num_tokens
                    totals["entropy"] += float(entropy[loss_mask[rows, :width].bool()].sum())
            totals["grad_norm"] += self._apply_gradients(totals if it == 0 else None) \
                / algo.num_iterations
        # free the gradients now rather than at the next update: the rollout in between uses
        # that memory (vLLM wakes into it; the native engine's weight copies, the KV cache)
        self.optimizer.zero_grad(set_to_none=True)
        tokens = max(totals["tokens"], 1)
        metrics = {
            names.LOSS: totals["loss"],
            names.GRAD_NORM: totals["grad_norm"],
            names.UPDATE_NORM: totals["update_norm"],
            names.CLIP_FRAC: totals["clip_tokens"] / tokens,
            names.ENTROPY: totals["entropy"] / tokens,
            names.SKIPPED_UPDATES: self.skipped_updates,
            names.KL: float(seq_kl.mean()),
        }
        if self.scaler.is_enabled():
            metrics[names.LOSS_SCALE] = self.scaler.get_scale()
        if self._sampler_correction and ro.sampler_logp is not None:
            metrics[names.SAMPLER_IS_WEIGHT] = totals["is_weight"] / tokens
            metrics[names.SAMPLER_IS_CAPPED_FRAC] = totals["is_capped"] / tokens
        return metrics | self._task_kl(batch.task_ids.cpu(), seq_kl)

    def _forward(self, policy: torch.nn.Module, args: tuple[torch.Tensor, ...],
                 with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The update's log-probs (and entropies) of a micro-batch, under the run's autocast:
        on a CPU mogrpo's own forward where it applies (`trains_here`), the old and reference
        passes' arithmetic in fewer operations than the model's forward."""
        with self.ctx.precision.autocast():
            return completion_logprobs(policy, *args, temperature=self.ctx.sampling.temperature,
                                       with_entropy=with_entropy, forward=score_hidden,
                                       min_saved=self._prompt_sharing(),
                                       products=kernels.products())

    def _prompt_sharing(self) -> float | None:
        """`train.prompt_sharing` as the least share of a pass's tokens that running each
        distinct prompt once must save (None: never share)."""
        mode = self.config.train.prompt_sharing
        if mode == "auto":
            return kernels.prompt_sharing_min_saved(self.ctx.device.type)
        return 0.0 if mode == "on" else None

    def _apply_gradients(self, totals: dict | None) -> float:
        """Clip the accumulated gradients and take the optimizer and scheduler steps; the
        gradient norm. With `totals` (the first of the μ passes) it records how far the
        weights moved there."""
        # the engine reduced them: the full-batch gradient (FSDP2: this process's shard)
        params = [p for p in self.ctx.policy.parameters() if p.requires_grad]
        scale = self.scaler.get_scale()
        self.scaler.unscale_(self.optimizer)  # fp16: the true gradients, before clipping
        grad_norm = self.parallel.clip_grad_norm(params, self.config.train.max_grad_norm)
        if torch.isfinite(grad_norm):
            # an out-of-memory error inside the optimizer's step (its states are allocated at
            # the first) may leave part of the update applied: from here it is not redone
            self.oom.in_optimizer = True
            # How far the weights moved (0 = nothing is learned), a chunk of weights at a
            # time (`step_with_update_norms`): for adapters and small models only, where the
            # extra optimizer calls cost nothing that counts.
            small = sum(p.numel() for p in params) <= UPDATE_NORM_MAX_PARAMS
            if totals is not None and small:
                diffs = step_with_update_norms(self.optimizer)
                self.oom.stepped = True
                totals["update_norm"] = float(self.parallel.global_norm(diffs))
            else:
                self.optimizer.step()
                self.oom.stepped = True
                if totals is not None:  # too large: not measured (μ > 1 keeps the first's)
                    totals["update_norm"] = float("nan")
        elif self.scaler.is_enabled():  # fp16 overflow at this loss scale: the scaler's job
            log.info("step %d: fp16 gradients overflowed at loss scale %g; update skipped, "
                     "scale halved", self.step + 1, scale)
        else:  # a non-finite gradient would poison AdamW's moments; skip and count it
            self.skipped_updates += 1
            log.warning("step %d: non-finite gradient norm, update skipped", self.step + 1)
        self.oom.stepped = True  # an out-of-memory error from here on cannot redo the step
        self.scaler.update()  # halved after an overflow, doubled after enough clean steps
        self.scheduler.step()
        return float(grad_norm)

    def _importance_weights(self, old: torch.Tensor, ro: Rollout, rows: slice,
                            mask: torch.Tensor, totals: dict | None) -> torch.Tensor | None:
        """[b, T] truncated π_old / π_sampler per token when another engine sampled, else None;
        their sum and the count of capped ones are added to `totals` when given."""
        if not self._sampler_correction or ro.sampler_logp is None:
            return None
        cap = self.config.rollout.vllm.importance_cap
        weights = truncated_importance_weights(old, ro.sampler_logp[rows, :mask.shape[1]],
                                               mask, cap)
        if totals is not None:
            valid = mask.bool()
            totals["is_weight"] += float(weights[valid].sum())
            totals["is_capped"] += float((weights[valid] >= cap).sum())
        return weights

    def _micro_batches(self, ro: Rollout, by_length: bool = True) -> list[slice | torch.Tensor]:
        size = self.oom.micro_batch_size  # train.micro_batch_size, halved by out-of-memory errors
        if not by_length:
            return [slice(i, min(i + size, ro.batch_size)) for i in range(0, ro.batch_size, size)]
        return length_buckets(ro.prompt_mask, ro.completion_mask, size)

"""The GRPO loop. The trainer only sequences named phases; the math lives in `mogrpo.algo`.

One step: `draw_prompts` → `generate` → `score` (rewards per objective) → `keep_informative`
(dynamic sampling, optional) → `advantages` (per task and objective) → `reference_logprobs`
→ `update` (μ passes × gradient accumulation) → `adapt_kl` (β per task) → metrics.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from mogrpo.algo.advantages import group_advantages
from mogrpo.algo.dynamic_sampling import RefillBudget, informative_groups
from mogrpo.algo.kl_control import make_controller
from mogrpo.config import RunConfig
from mogrpo.data.schema import Example
from mogrpo.health import HealthMonitor, HealthStop, StepContext
from mogrpo.memory import peak_bytes, reset_peak
from mogrpo.modeling.reference import Reference
from mogrpo.rewards.base import RewardLog, TrainerState, score_examples
from mogrpo.rollout.batching import (
    concat_rollouts,
    select_groups,
)
from mogrpo.rollout.generate import Rollout, generate_rollout
from mogrpo.tasks.agent_rollout import (
    agent_metrics,
    agent_rollout,
    reward_examples,
    reward_extras,
)
from mogrpo.tasks.context import TrainContext, render_prompts
from mogrpo.tasks.curriculum import Curriculum
from mogrpo.tasks.task import TaskMixer, judges
from mogrpo.tracking import names
from mogrpo.tracking.jsonl import MetricsWriter
from mogrpo.trainer.batches import RewardBatch, ScoredBatch
from mogrpo.trainer.completions import CompletionLog, completion_rows
from mogrpo.trainer.distributed import Dist
from mogrpo.trainer.metrics import format_step, reward_metrics
from mogrpo.trainer.oom import GENERATION, LOGPROBS, UPDATE, OomGuard
from mogrpo.trainer.optim import build_scheduler, train_optimizer
from mogrpo.trainer.parallel import ParallelPolicy
from mogrpo.trainer.progress import Progress
from mogrpo.trainer.update import UpdatePhases

log = logging.getLogger(__name__)


class GRPOTrainer(UpdatePhases):
    """Runs GRPO steps on a loaded policy; its state lives in checkpointable parts."""

    def __init__(self, ctx: TrainContext, reference: Reference | None,
                 parallel: ParallelPolicy | None = None) -> None:
        self.ctx = ctx
        self.parallel = parallel or ParallelPolicy(ctx.policy)
        """The policy across processes (DDP / FSDP2); one process: the policy itself."""
        self.config: RunConfig = ctx.config
        self.reference = reference
        self.mixer = TaskMixer(ctx.tasks, ctx.config.seed)
        self.kl_controllers = [
            make_controller(t.name, t.config.kl.kind, t.config.beta, **t.config.kl.options())
            for t in ctx.tasks
        ]
        self._kl_window: list[list[float]] = [[] for _ in ctx.tasks]
        self.beta_changes: list[str] = []
        tc = self.config.train
        self.total_updates = tc.max_steps * self.config.algorithm.num_iterations
        self.optimizer = train_optimizer(ctx.policy, tc)  # train.optimizer, at its settings
        self.scaler = ctx.precision.grad_scaler()  # fp16-mixed's loss scale; else a no-op
        self.scheduler = build_scheduler(
            self.optimizer, tc.lr_scheduler, tc.warmup_steps, self.total_updates
        )
        self.step = 0
        self.skipped_updates = 0
        self.last_metrics: dict[str, float] = {}
        self._logged_metrics: dict[str, list[float]] = {}
        self.completion_log: CompletionLog | None = None  # set by the run when logged
        self.dist = Dist.current()
        self.curriculum = Curriculum(self.config.curriculum,
                                     {t.name: t.config.weight for t in ctx.tasks})
        self.mixer.set_weights(self.curriculum.weights())
        self.health = HealthMonitor(self.config.health)
        self.health_ctx = StepContext(
            temperature=self.config.rollout.temperature,
            kl_measured=reference is not None and any(t.config.beta > 0 for t in ctx.tasks),
            max_completion_length=self.config.rollout.completion_length,
            kl_budgets={t.name: t.config.kl.kl_budget() for t in ctx.tasks
                        if t.config.kl.kl_budget() is not None},
            kl_bands={t.name: t.config.kl.band() for t in ctx.tasks
                      if t.config.kl.band() is not None},
            full_finetune=not self.config.lora.enabled,
            learning_rate=self.config.train.learning_rate,
            max_grad_norm=self.config.train.max_grad_norm,
        )
        self.rollbacks: list[dict[str, Any]] = []
        self.oom = OomGuard(self.config, self.dist.world_size, ctx.device,
                            release=self._release_step)
        """The batch sizes in use, halved after an out-of-memory error (`memory.on_oom`)."""

    def _release_step(self) -> None:
        """What a step redone after an out-of-memory error must not find: its gradients, and
        (fp16-mixed) a loss scaler that already unscaled them (`unscale_` once per step; the
        error came between it and the scaler's `update`). The scale itself is kept."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler.is_enabled():
            state = self.scaler.state_dict()
            self.scaler = self.ctx.precision.grad_scaler()
            self.scaler.load_state_dict(state)

    # ------------------------------------------------------------------ phases

    def draw_prompts(self, n: int | None = None) -> list[tuple[int, Example]]:
        # every process draws the same global batch; each keeps its share
        return self.dist.shard(self.mixer.next_batch(n or self.config.prompts_per_step))

    def generate(self, picks: list[tuple[int, Example]]) -> Rollout:
        """The completions of `picks`; an out-of-memory error halves the generation batch and
        samples them again from the same RNG state (vLLM manages its memory itself)."""
        if self.ctx.rollout_engine is not None:
            return self._generate(picks)
        rows = len(picks) * self.config.rollout.num_generations
        return self.oom.run(self.step + 1, [(GENERATION, lambda: self._generate(picks))], rows)

    def _generate(self, picks: list[tuple[int, Example]]) -> Rollout:
        """K completions of each prompt; an agent task's are episodes of several turns,
        sampled task by task (picks come grouped by task) and joined."""
        if not any(task.agent is not None for task in self.ctx.tasks):
            return self._single_turn(picks)
        parts, start = [], 0
        while start < len(picks):
            t = picks[start][0]
            end = next((i for i in range(start, len(picks)) if picks[i][0] != t), len(picks))
            task = self.ctx.tasks[t]
            if task.agent is None:
                parts.append(self._single_turn(picks[start:end]))
            else:
                with self.parallel.gathered(), self.ctx.precision.autocast():
                    parts.append(agent_rollout(
                        self.ctx, task, [ex for _, ex in picks[start:end]],
                        num_generations=self.config.rollout.num_generations,
                        record_logprobs=self._sampler_correction,
                        generation_batch_size=self.oom.generation_batch_size))
            start = end
        return concat_rollouts(parts, self.ctx.tokenizer.pad_token_id)

    def _single_turn(self, picks: list[tuple[int, Example]]) -> Rollout:
        texts, add_special = render_prompts(self.ctx, picks)
        # FSDP2: whole weights while decoding; the rollout in the compute dtype
        with self.parallel.gathered(), self.ctx.precision.autocast():
            return generate_rollout(
                self.ctx.policy, self.ctx.tokenizer, texts, self.ctx.sampling,
                num_generations=self.config.rollout.num_generations,
                max_prompt_length=self.config.rollout.prompt_length,
                add_special_tokens=add_special,
                engine=self.ctx.engine,
                generation_batch_size=self.oom.generation_batch_size,
                record_logprobs=self._sampler_correction,
                plain_max_bytes=self.ctx.plain_max_bytes,
            )

    @property
    def _sampler_correction(self) -> bool:
        """Weight tokens by π_trainer / π_sampler: another engine (vLLM) sampled them."""
        return self.ctx.rollout_engine is not None and \
            self.config.rollout.vllm.importance_correction

    def score(self, picks: list[tuple[int, Example]], rollout: Rollout) -> RewardBatch:
        """Every objective of every task, one call per reward function per task."""
        K = rollout.num_generations
        rewards: list[torch.Tensor] = [torch.empty(0)] * len(picks)
        extras: list[dict[str, list]] = [{} for _ in picks]
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        for t, task in enumerate(self.ctx.tasks):
            groups = [g for g, (pt, _) in enumerate(picks) if pt == t]
            if not groups:
                continue
            rows = [g * K + k for g in groups for k in range(K)]
            examples = reward_examples(rollout, rows,
                                       [picks[g][1] for g in groups for _ in range(K)])
            log = RewardLog()
            values = score_examples(
                task.reward_fns, examples,
                [rollout.texts[r] for r in rows], rollout.completion_ids[rows],
                [lengths[r] for r in rows], [truncated[r] for r in rows],
                trainer_state=self._trainer_state(t), log=log,
                extra_columns=reward_extras(task, rollout, rows, examples),
            )  # [n*K, J]
            logged = _per_row(log.extra, len(rows), task.name)
            for i, g in enumerate(groups):
                rewards[g] = values[i * K:(i + 1) * K]
                extras[g] = {c: v[i * K:(i + 1) * K] for c, v in logged.items()}
            for key, scalars in log.metrics.items():
                self._logged_metrics.setdefault(names.reward_logged(task.name, key),
                                               []).extend(scalars)
        return RewardBatch(picks, rollout, rewards, extras)

    def _trainer_state(self, t: int) -> TrainerState:
        """TRL's `trainer_state` for task t's reward functions."""
        return TrainerState(global_step=self.step, max_steps=self.config.train.max_steps,
                            epoch=self.mixer.epoch_of(t), is_world_process_zero=self.dist.is_main,
                            is_local_process_zero=os.environ.get("LOCAL_RANK", "0") == "0")

    def log_completions(self, rewards: RewardBatch, advantages: torch.Tensor) -> None:
        """The step's completions table (`logging.log_completions`), gathered to process 0."""
        step = self.step + 1
        if self.completion_log is None or not self.completion_log.due(step):
            return
        tasks = self.ctx.tasks
        rows = completion_rows(step, [t.name for t in tasks], [t.reward_labels for t in tasks],
                               rewards, advantages)
        rows = [row for part in self.dist.gather(rows) for row in part]
        if self.dist.is_main:
            self.completion_log.write(step, rows)

    def logged_metrics(self) -> dict[str, float]:
        """The step's `log_metric` values of the reward functions, each averaged."""
        taken, self._logged_metrics = self._logged_metrics, {}
        return {key: sum(v) / len(v) for key, v in taken.items() if v}

    def keep_informative(self, batch: RewardBatch) -> tuple[RewardBatch, dict[str, float]]:
        """DAPO dynamic sampling: drop groups without signal, refill up to the round cap."""
        algo = self.config.algorithm
        budget = RefillBudget(algo.max_refill_rounds)
        budget.reset(len(batch.picks))
        kept: list[RewardBatch] = []
        current = batch
        while True:
            keep = budget.observe(self._informative(current))
            groups = [g for g in range(len(current.picks)) if bool(keep[g])]
            if groups:
                kept.append(_select(current, groups))
            # the processes round alike (one prompt stream): another round while any of them
            # is short, each given as many prompts as the one missing the most needs
            missing = self.dist.max(budget.missing if budget.needs_refill() else 0)
            if not missing:
                break
            picks = self.draw_prompts(missing * self.dist.world_size)
            current = self.score(picks, self.generate(picks))
        if not kept:  # nothing informative at all: keep the batch; its advantages are all zero
            kept = [batch]
        merged = RewardBatch(
            [p for b in kept for p in b.picks],
            concat_rollouts([b.rollout for b in kept], self.ctx.tokenizer.pad_token_id),
            [r for b in kept for r in b.rewards],
            [e for b in kept for e in b.extras],
        )
        return merged, budget.metrics(names.DYNAMIC_SAMPLING)

    def _informative(self, batch: RewardBatch) -> torch.Tensor:
        flags = torch.zeros(len(batch.picks), dtype=torch.bool)
        for g, (t, _) in enumerate(batch.picks):
            weights = self.ctx.tasks[t].reward_weights(self.step)
            flags[g] = informative_groups(batch.rewards[g][None], weights)[0]
        return flags

    def advantages(self, batch: RewardBatch) -> tuple[ScoredBatch, dict[str, float]]:
        """Group-relative advantages per task (each task with its own objectives and weights)."""
        algo, ro = self.config.algorithm, batch.rollout
        K, device = ro.num_generations, ro.completion_ids.device
        advantages = torch.zeros(ro.batch_size)
        beta = torch.zeros(ro.batch_size)
        task_ids = torch.tensor([t for t, _ in batch.picks for _ in range(K)])
        metrics: dict[str, float] = {}
        # batch scaling divides by a std over the task's groups of every process: each
        # process joins that gather, also without groups of the task
        shared = algo.advantage_scaling == "batch" and self.dist.world_size > 1
        for t, task in enumerate(self.ctx.tasks):
            groups = [g for g, (pt, _) in enumerate(batch.picks) if pt == t]
            if not groups and not shared:
                continue
            grouped = torch.stack([batch.rewards[g] for g in groups]) if groups else \
                torch.empty(0, K, len(task.reward_labels))  # [n, K, J]
            weights = task.reward_weights(self.step)
            adv = all_process_advantages(grouped, weights, combine=algo.advantage_combine,
                                         scale=algo.advantage_scaling, dist=self.dist)  # [n, K]
            if not groups:
                continue
            rows = torch.tensor([g * K + k for g in groups for k in range(K)])
            advantages[rows] = adv.reshape(-1).cpu()
            beta[rows] = self.kl_controllers[t].beta
            metrics.update(reward_metrics(task.name, task.reward_labels, weights, grouped, adv))
        scored = ScoredBatch(ro, task_ids.to(device), advantages.to(device), beta.to(device))
        return scored, metrics

    def _task_kl(self, task_ids: torch.Tensor, seq_kl: torch.Tensor) -> dict[str, float]:
        """Each task's mean KL over its completions, and its β."""
        metrics = {}
        for t, task in enumerate(self.ctx.tasks):
            mask = task_ids == t
            if mask.any():
                metrics[names.TASK_KL.of(task.name)] = float(seq_kl[mask].mean())
            metrics[names.TASK_BETA.of(task.name)] = self.kl_controllers[t].beta
        return metrics

    def judge_stats(self) -> dict[str, float]:
        """This step's LLM-judge calls: one `[Judge@N]` line per judge, and metrics."""
        metrics: dict[str, float] = {}
        for key, judge in judges(self.ctx.tasks).items():
            stats = judge.take_stats()
            log.info("%s (%s)", judge.format_stats(self.step + 1, stats), key)
            task, label = key.split("/", 1)
            metrics.update(judge.metrics(names.judge_prefix(task, label), stats))
        return metrics

    def adapt_kl(self, metrics: dict[str, float]) -> None:
        """Feed each task's measured KL to its controller; log every change of β."""
        for t, task in enumerate(self.ctx.tasks):
            key = names.TASK_KL.of(task.name)
            if key in metrics:
                self._kl_window[t].append(metrics[key])
            every = task.config.kl.every_steps
            if self.step % every or not self._kl_window[t]:
                continue
            window = self._kl_window[t]
            samples = len(window) * self.config.rollout.num_generations
            change = self.kl_controllers[t].update(sum(window) / len(window), self.step, n=samples)
            self._kl_window[t] = []
            if change is not None:
                line = change.format()
                self.beta_changes.append(line)
                log.info(line)

    # ------------------------------------------------------------------ loop

    def train_step(self) -> dict[str, float]:
        reset_peak(self.ctx.device)
        t0 = time.perf_counter()
        picks = self.draw_prompts()
        rollout = self.generate(picks)
        t1 = time.perf_counter()
        rewards = self.score(picks, rollout)
        metrics: dict[str, float] = {}
        if self.config.algorithm.dynamic_sampling:
            rewards, sampling_metrics = self.keep_informative(rewards)
            metrics.update(sampling_metrics)
        metrics.update(self.judge_stats())
        metrics.update(self.logged_metrics())
        batch, reward_stats = self.advantages(rewards)
        self.log_completions(rewards, batch.advantages)
        t2 = time.perf_counter()
        # one unit: redone after an out-of-memory error, the log-probs at the new size too
        metrics.update(self.oom.run(self.step + 1, [
            (LOGPROBS, lambda: self.reference_logprobs(batch)), (UPDATE, lambda: self.update(batch))]))
        if self.ctx.rollout_engine is not None:  # the next rollout samples the new weights
            sync_start = time.perf_counter()
            with self.parallel.gathered():  # FSDP2: each engine takes the whole model
                self.ctx.rollout_engine.push_weights()
            metrics[names.TIME_WEIGHT_SYNC] = time.perf_counter() - sync_start
        t3 = time.perf_counter()
        self.step += 1
        ro = batch.rollout
        metrics.update(reward_stats)
        metrics.update({
            names.STEP: self.step,
            names.LR: self.scheduler.get_last_lr()[0],
            names.COMPLETION_LENGTH: float(ro.lengths.float().mean()),
            names.TRUNCATED_FRAC: float(ro.truncated.float().mean()),
            names.PROMPT_TRUNCATED: ro.prompt_truncated,
            names.NONFINITE_LOGITS: ro.nonfinite_logits,
            names.IDENTICAL_GROUP_FRAC: _identical_groups(ro),
            names.GROUPS: len(rewards.picks),
            names.TIME_ROLLOUT: t1 - t0,
            names.TIME_REWARD: t2 - t1,
            names.TIME_UPDATE: t3 - t2,
            names.TIME_STEP: t3 - t0,
            names.TOKENS_PER_S: int(rollout.lengths.sum()) / max(t1 - t0, 1e-9),
            # CUDA: peak reserved memory; CPU: the process's peak RSS (compare with `mogrpo memory`)
            names.PEAK_GIB: peak_bytes(self.ctx.device) / 2**30,
        })
        metrics.update(self._task_lengths(batch))
        metrics.update(agent_metrics(self.ctx.tasks, ro, batch.task_ids.cpu()))
        metrics = self.dist.reduce_metrics(metrics)  # the same numbers in every process
        self.adapt_kl(metrics)
        return metrics

    @property
    def checkpoints_evals(self) -> bool:
        """A `rollback` needs a checkpoint at every evaluated step to go back to."""
        health = self.config.health
        return health.enabled and health.eval_regression.enabled \
            and health.eval_regression.action == "rollback"

    def run(self, writer: MetricsWriter, evaluate: Any = None, checkpoint: Any = None,
            rollback: Any = None) -> None:
        """Steps until `train.max_steps`: each is logged, then evaluated and checkpointed
        when due (the checkpoint comes last, so a resume repeats nothing of its step).

        `rollback(step)` is called when the health monitor asks to go back to the best
        checkpoint; it loads that checkpoint's weights and optimizer state and returns its
        path, or None when there is none (the run then stops)."""
        cfg = self.config
        every, save_every = cfg.eval.every_steps, cfg.output.save_every
        with Progress(cfg.train.max_steps, "GRPO", cfg.logging.progress_bar, start=self.step) as bar:
            while self.step < cfg.train.max_steps:
                metrics = self.train_step()
                for event in self.oom.take_events():
                    writer.write(event)
                evaluated = evaluate is not None and every and self.step % every == 0 \
                    and self.step < cfg.train.max_steps
                if evaluated:
                    metrics.update(evaluate(self.step, metrics))
                self.next_stage(metrics)
                writer.write(metrics)
                self.last_metrics = metrics
                bar.update(metrics, self.ctx.tasks)
                self.health_ctx.lr = metrics[names.LR]
                for alert in self.health.observe(self.step, metrics, self.health_ctx):
                    log.warning(alert.message)
                    writer.write(alert.as_event())
                if self.step % cfg.logging.log_every == 0:
                    log.info(format_step(metrics, [t.name for t in self.ctx.tasks], cfg.train.max_steps))
                rolled = self._roll_back(rollback, writer)
                # after a rollback the checkpoint holds the restored state: resumable as it is;
                # a stop leaves a resumable state behind
                if checkpoint is not None and (
                    (save_every and self.step % save_every == 0) or self.step == cfg.train.max_steps
                    or rolled or (evaluated and self.checkpoints_evals) or self.health.should_stop
                ):
                    checkpoint(self.step)
                if self.health.should_stop:
                    raise HealthStop([a for a in self.health.alerts if a.action == "stop"])

    def _roll_back(self, rollback: Any, writer: MetricsWriter) -> bool:
        """Go back to the best checkpoint when the monitor asks: its weights and optimizer
        state (loaded by `rollback`), the learning rate × `lr_factor`; steps, data order, β and
        the curriculum go on. Recorded in metrics.jsonl, the trainer state and the summary."""
        alert = self.health.rollback_alert
        if alert is None:
            return False
        path = rollback(alert.best_step) if rollback is not None and alert.best_step is not None \
            else None
        if path is None:
            log.error("health: no intact checkpoint of step %s to roll back to; stopping",
                      alert.best_step)
            alert.action = "stop"
            self.health.stop()
            return False
        before = self.scheduler.get_last_lr()[0]
        after = self.scale_lr(self.config.health.eval_regression.lr_factor)
        record = {"event": "health_rollback", "step": self.step, "restored_step": alert.best_step,
                  "checkpoint": str(path), "lr_before": before, "lr_after": after,
                  "reason": alert.evidence}
        self.rollbacks.append(record)
        self.health.note_rollback(self.step, alert.best_step)
        writer.write(record)
        log.warning("health: rolled back to step %d (%s); learning rate %.3g -> %.3g",
                    alert.best_step, path, before, after)
        return True

    def scale_lr(self, factor: float) -> float:
        """Multiply the learning rate, for the rest of the schedule, by `factor`; returns the
        new current rate. The scheduler's base rates are in its state_dict, so a resume keeps
        the lowered rate."""
        sched = self.scheduler
        sched.base_lrs = [lr * factor for lr in sched.base_lrs]
        lrs = [base * fn(sched.last_epoch) for base, fn in zip(sched.base_lrs, sched.lr_lambdas,
                                                                 strict=True)]
        for group, lr in zip(self.optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        sched._last_lr = lrs  # what get_last_lr() reports until the next step
        self.health_ctx.learning_rate = sched.base_lrs[0]
        return lrs[0]

    def next_stage(self, metrics: dict[str, Any]) -> None:
        """Record the curriculum stage of this step; move on when its `until` holds."""
        if not self.curriculum.active:
            return
        metrics[names.CURRICULUM_STAGE] = self.curriculum.index
        line = self.curriculum.observe(self.step, metrics)
        if line is not None:
            log.info(line)
            self.mixer.set_weights(self.curriculum.weights())

    def state_dict(self) -> dict[str, Any]:
        """The trainer's own counters, controllers and their logs (JSON-safe); `RunState`
        collects it with the rest of what a resume needs."""
        return {
            "step": self.step,
            "skipped_updates": self.skipped_updates,
            "mixer": self.mixer.state_dict(),
            "kl_controllers": [c.state_dict() for c in self.kl_controllers],
            "kl_window": [list(w) for w in self._kl_window],
            "beta_changes": list(self.beta_changes),
            "judges": {key: judge.state_dict() for key, judge in judges(self.ctx.tasks).items()},
            "health": self.health.state_dict(),
            "curriculum": self.curriculum.state_dict(),
            "rollbacks": list(self.rollbacks),
            "loss_scale": self.scaler.state_dict(),  # {} unless fp16-mixed
            "oom": self.oom.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = state["step"]
        self.skipped_updates = state["skipped_updates"]
        self.mixer.load_state_dict(state["mixer"])
        for controller, saved in zip(self.kl_controllers, state["kl_controllers"], strict=True):
            controller.load_state_dict(saved)
        self._kl_window = [list(w) for w in state["kl_window"]]
        self.beta_changes = list(state.get("beta_changes", []))
        if "health" in state:
            self.health.load_state_dict(state["health"])
        if "curriculum" in state:
            self.curriculum.load_state_dict(state["curriculum"])
        self.rollbacks = list(state.get("rollbacks", []))
        if state.get("loss_scale"):
            self.scaler.load_state_dict(state["loss_scale"])
        if "oom" in state:
            self.oom.load_state_dict(state["oom"])
        self.health_ctx.learning_rate = self.config.train.learning_rate * \
            self.config.health.eval_regression.lr_factor ** len(self.rollbacks)
        for key, judge in judges(self.ctx.tasks).items():
            if key in state.get("judges", {}):
                judge.load_state_dict(state["judges"][key])

    def _task_lengths(self, batch: ScoredBatch) -> dict[str, float]:
        """Each task's mean completion length: one task can collapse to short answers while
        the mean over all tasks still looks healthy."""
        lengths, task_ids = batch.rollout.lengths.float().cpu(), batch.task_ids.cpu()
        return {names.TASK_COMPLETION_LENGTH.of(task.name): float(lengths[task_ids == t].mean())
                for t, task in enumerate(self.ctx.tasks) if bool((task_ids == t).any())}



def _identical_groups(ro: Rollout) -> float:
    """Fraction of prompts whose K completions are all the same text (sampling looks off)."""
    K = ro.num_generations
    groups = [ro.texts[i:i + K] for i in range(0, len(ro.texts), K)]
    return sum(len(set(g)) == 1 for g in groups) / max(len(groups), 1)


def _select(batch: RewardBatch, groups: list[int]) -> RewardBatch:
    return RewardBatch([batch.picks[g] for g in groups], select_groups(batch.rollout, groups),
                       [batch.rewards[g] for g in groups], [batch.extras[g] for g in groups])


def _per_row(extra: dict[str, list], n: int, task: str) -> dict[str, list]:
    """The `log_extra` columns with one value per completion; others are dropped, with a warning."""
    for column in [c for c, v in extra.items() if len(v) != n]:
        log.warning("task %s: log_extra(%r, ...) got %d values for %d completions; column left "
                    "out of the completions table", task, column, len(extra[column]), n)
    return {c: v for c, v in extra.items() if len(v) == n}


def all_process_advantages(grouped: torch.Tensor, weights: torch.Tensor | Sequence[float], *,
                           combine: str, scale: str, dist: Dist) -> torch.Tensor:
    """`group_advantages` of this process's groups [n, K, J]; with a batch-wide std and several
    processes, computed over every process's groups of the task (all-gathered), so the std is
    that of the global batch."""
    if scale != "batch" or dist.world_size == 1:  # group-local: nothing to share
        return group_advantages(grouped, weights, combine=combine, scale=scale)
    K, J = grouped.shape[1:]
    parts = dist.gather(grouped.cpu().tolist())  # every process's [n_r, K, J] rows
    everyone = torch.tensor([row for part in parts for row in part],
                            dtype=grouped.dtype).reshape(-1, K, J)
    start = sum(len(part) for part in parts[:dist.rank])
    adv = group_advantages(everyone, weights, combine=combine, scale=scale)  # [N, K]
    return adv[start:start + len(grouped)].to(grouped.device)

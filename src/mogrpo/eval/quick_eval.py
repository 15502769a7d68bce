"""Greedy quick-eval per task on held-out prompts."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from mogrpo.config.sections import EVAL_BATCH
from mogrpo.data.schema import Example
from mogrpo.eval.pareto import ParetoTracker, Point
from mogrpo.rewards.base import TrainerState, score_examples
from mogrpo.rollout.generate import Rollout, SamplingSettings, generate_rollout
from mogrpo.rollout.projections import held_projections
from mogrpo.tasks.agent_rollout import agent_rollout, reward_examples, reward_extras
from mogrpo.tasks.context import TrainContext, render_prompts
from mogrpo.tracking import names
from mogrpo.tracking.jsonl import MetricsWriter

log = logging.getLogger(__name__)


@dataclass
class TaskEval:
    """Greedy results of one task: score is the mean of its eval reward."""

    score: float
    truncated_frac: float
    mean_length: float
    num_samples: int
    reward: str
    score_std: float = float("nan")
    """Standard deviation of the per-prompt scores: the sampling error of `score` for graded
    rewards (health.eval_regression; for 0/1 scores it equals the binomial one)."""
    samples: list[tuple[str, str]] = field(default_factory=list)
    """The first few (prompt, greedy completion) pairs, for printing."""
    tool_call_frac: float | None = None
    """An agent task's share of episodes that called a tool at least once; None for a task
    without tools (and one whose `rollout_func` samples the episodes)."""

    def as_metrics(self, task: str) -> dict[str, float]:
        return {names.eval_metric(task, k): v for k, v in asdict(self).items()
                if k not in ("reward", "samples") and v is not None}


class Processes(Protocol):
    """The training processes (`mogrpo.trainer.distributed.Dist`): who evaluates which prompts."""

    def shard(self, items: list) -> list: ...

    def gather(self, value: Any) -> list[Any]: ...


def evaluate(ctx: TrainContext, batch_size: int = EVAL_BATCH, samples: int = 0,
             step: int = 0, processes: Processes | None = None) -> dict[str, TaskEval]:
    """Greedy completions for up to `eval.max_samples` held-out prompts of every task, scored
    as at training step `step` (the reward functions' `trainer_state.global_step`).

    With several `processes` each decodes and scores its share of the prompts (interleaved),
    so no reward or judge call is made twice; every process gets the same results."""
    # every batch of every task decodes with the same weights: fused and packed once
    with held_projections(ctx.policy):
        return _evaluate(ctx, batch_size, samples, step, processes)


def _evaluate(ctx: TrainContext, batch_size: int, samples: int, step: int,
              processes: Processes | None) -> dict[str, TaskEval]:
    cfg = ctx.config
    state = TrainerState(global_step=step, max_steps=cfg.train.max_steps)
    greedy = replace(ctx.sampling, greedy=True)
    # no more rows at once than the rollout decodes: a generation_batch_size set to fit the
    # GPU (`mogrpo plan`'s ladder) caps the eval's KV cache too
    batch_size = min(batch_size, cfg.rollout.generation_batch_size or batch_size)
    results: dict[str, TaskEval] = {}
    for t, task in enumerate(ctx.tasks):
        examples = task.eval[: cfg.eval.max_samples]
        if not examples:
            continue
        label = cfg.eval.reward or task.reward_labels[0]
        fn = task.reward_fns[task.reward_labels.index(label)]
        mine = list(range(len(examples)))
        if processes is not None:
            mine = processes.shard(mine)
        rows: list[tuple] = []  # index, score, length, cut, prompt, completion, tool calls
        for start in range(0, len(mine), batch_size):
            indexes = mine[start:start + batch_size]
            chunk = [examples[i] for i in indexes]
            texts, rollout = _greedy_rollout(ctx, t, chunk, greedy)
            seen = reward_examples(rollout, list(range(len(chunk))), chunk)
            values = score_examples([fn], seen, rollout.texts, rollout.completion_ids,
                                    rollout.lengths.tolist(), rollout.truncated.tolist(),
                                    trainer_state=state, extra_columns=reward_extras(
                                        task, rollout, list(range(len(chunk))), chunk))
            calls = [sum(e.calls.values()) if e is not None else None
                     for e in rollout.episodes or [None] * len(chunk)]
            rows.extend(zip(indexes, values[:, 0].tolist(), rollout.lengths.tolist(),
                            rollout.truncated.tolist(), texts, rollout.texts, calls, strict=True))
        if processes is not None:
            rows = sorted(row for part in processes.gather(rows) for row in part)
        _, values, lengths, truncated, prompts, completions, calls = zip(*rows, strict=True)
        scores = [v for v in values if not math.isnan(v)]
        mean = sum(scores) / len(scores) if scores else float("nan")
        results[task.name] = TaskEval(
            score=mean,
            truncated_frac=sum(truncated) / len(truncated),
            mean_length=sum(lengths) / len(lengths),
            num_samples=len(examples),
            reward=label,
            score_std=math.sqrt(sum((v - mean) ** 2 for v in scores) / len(scores))
            if scores else float("nan"),
            samples=list(zip(prompts, completions, strict=True))[:samples],
            tool_call_frac=(sum(c > 0 for c in calls) / len(calls)
                            if all(c is not None for c in calls) else None),
        )
    return results


def _greedy_rollout(ctx: TrainContext, t: int, chunk: list[Example], greedy: SamplingSettings
                    ) -> tuple[list[str], Rollout]:
    """The prompts' texts and their greedy completions; an agent task's are episodes, its
    tools called between the turns as in training (a `rollout_func` samples as it likes)."""
    cfg, task = ctx.config, ctx.tasks[t]
    texts, add_special = render_prompts(ctx, [(t, ex) for ex in chunk])
    with ctx.precision.autocast():  # as the training rollout decodes
        if task.agent is not None:
            return texts, agent_rollout(ctx, task, chunk, num_generations=1,
                                        record_logprobs=False, sampling=greedy)
        return texts, generate_rollout(
            ctx.policy, ctx.tokenizer, texts, greedy, num_generations=1,
            max_prompt_length=cfg.rollout.prompt_length, add_special_tokens=add_special,
            engine=ctx.engine, plain_max_bytes=ctx.plain_max_bytes,
        )


def _initials(tasks: list[str]) -> list[str]:
    """Short column labels: first letters, lengthened until they are unique."""
    for n in range(1, max(len(t) for t in tasks) + 1):
        short = [t[:n].upper() for t in tasks]
        if len(set(short)) == len(short):
            return short
    return tasks


def format_quick_eval(step: int | str, evals: dict[str, dict[str, float]],
                      kl: dict[str, float], beta: dict[str, float]) -> str:
    """The compact per-eval table::

        [QuickEval@20] greedy   fairness 0.452  hallucination 0.497
          truncated  F 0.0%  H 0.0%  | length  F 64.5  H 51.4
          KL         F 0.035 H 0.095 | beta    F 0.1000 H 0.3000

    and, where a task calls tools, the share of its episodes that called one
    (`  tool call  F - H 100.0%`)."""
    tasks = list(evals)
    short = dict(zip(tasks, _initials(tasks), strict=True))

    def row(values: dict[str, float], fmt: str) -> str:
        return " ".join(f"{short[t]} {format(values[t], fmt)}" if t in values and not
                        math.isnan(values[t]) else f"{short[t]} -" for t in tasks)

    scores = "  ".join(f"{t} {evals[t]['score']:.3f}" for t in tasks)
    truncated = row({t: evals[t]["truncated_frac"] for t in tasks}, ".1%")
    length = row({t: evals[t]["mean_length"] for t in tasks}, ".1f")
    calls = {t: evals[t]["tool_call_frac"] for t in tasks
             if evals[t].get("tool_call_frac") is not None}
    return (
        f"[QuickEval@{step}] greedy   {scores}\n"
        f"  truncated  {truncated} | length  {length}\n"
        f"  KL         {row(kl, '.3f')} | beta    {row(beta, '.4f')}"
        + (f"\n  tool call  {row(calls, '.1%')}" if calls else "")
    )


def eval_metrics(results: dict[str, TaskEval]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, r in results.items():
        out.update(r.as_metrics(name))
    return out


class QuickEval:
    """Greedy eval at the start, every `eval.every_steps` and at the end: prints the compact
    table, writes eval.jsonl, keeps the Pareto front of evaluated steps in pareto.json."""

    def __init__(self, ctx: TrainContext, run_dir: Path,
                 processes: Processes | None = None) -> None:
        self.ctx = ctx
        self.run_dir = run_dir
        self.processes = processes
        self.writer = MetricsWriter(run_dir / "eval.jsonl")
        self.pareto = ParetoTracker([t.name for t in ctx.tasks])
        self.scores: dict[str, dict[str, float]] = {}
        self.records: list[dict] = []
        """Every line written to eval.jsonl: part of the state, so a resume rewrites the file
        to exactly the evals its checkpoint knows of."""

    def __call__(self, tag: str, step: int, step_metrics: dict[str, float] | None = None
                 ) -> dict[str, float]:
        results = evaluate(self.ctx, samples=self.ctx.config.eval.print_samples, step=step,
                           processes=self.processes)
        if not results:
            return {}
        step_metrics = step_metrics or {}
        kl = {n: step_metrics.get(names.TASK_KL.of(n), float("nan")) for n in results}
        beta = {t.name: step_metrics.get(names.TASK_BETA.of(t.name), t.config.beta)
                for t in self.ctx.tasks if t.name in results}
        table = format_quick_eval(tag, {n: asdict(r) for n, r in results.items()}, kl, beta)
        log.info(table)
        for name, r in results.items():
            for prompt, completion in r.samples:
                log.info("  [%s] %s\n    -> %s", name, prompt.replace("\n", " ")[-120:], completion)
        record = {n: {k: v for k, v in asdict(r).items() if k != "samples" and v is not None}
                  for n, r in results.items()}
        self.records.append({"step": step, "tag": tag, **record})
        self.writer.write(self.records[-1])
        self.scores[tag] = {n: r.score for n, r in results.items()}
        self.pareto.add(Point(f"step-{step}", step, self.scores[tag]))
        self.pareto.save(self.run_dir / "pareto.json")
        log.info(self.pareto.format())
        return eval_metrics(results)

    def close(self) -> None:
        self.writer.close()

    def state_dict(self) -> dict:
        return {"pareto": self.pareto.state_dict(), "scores": self.scores,
                "records": list(self.records)}

    def load_state_dict(self, state: dict) -> None:
        self.pareto.load_state_dict(state["pareto"])
        self.scores = dict(state["scores"])
        self.records = list(state["records"])

"""Greedy quick-eval per task on held-out prompts."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

from mogrpo.rewards.base import score as score_rewards
from mogrpo.rollout.generate import generate_rollout
from mogrpo.train.common import TrainContext, render_prompts


@dataclass
class TaskEval:
    """Greedy results of one task: score is the mean of its eval reward."""

    score: float
    truncated_frac: float
    mean_length: float
    num_samples: int
    reward: str

    def as_metrics(self, task: str) -> dict[str, float]:
        return {f"eval/{task}/{k}": v for k, v in asdict(self).items() if k != "reward"}


def evaluate(ctx: TrainContext, batch_size: int = 32) -> dict[str, TaskEval]:
    """Greedy completions for up to `eval.max_samples` held-out prompts of every task."""
    cfg = ctx.config
    greedy = replace(ctx.sampling, greedy=True)
    results: dict[str, TaskEval] = {}
    for t, task in enumerate(ctx.tasks):
        examples = task.eval[: cfg.eval.max_samples]
        if not examples:
            continue
        label = cfg.eval.reward or task.reward_labels[0]
        fn = task.reward_fns[task.reward_labels.index(label)]
        scores: list[float] = []
        lengths: list[int] = []
        truncated: list[bool] = []
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            texts, add_special = render_prompts(ctx, [(t, ex) for ex in chunk])
            rollout = generate_rollout(
                ctx.policy, ctx.tokenizer, texts, greedy, num_generations=1,
                max_prompt_length=cfg.rollout.prompt_length, add_special_tokens=add_special,
            )
            columns = {k: [ex.columns.get(k) for ex in chunk] for k in chunk[0].columns}
            columns["completion_lengths"] = rollout.lengths.tolist()
            columns["truncated"] = rollout.truncated.tolist()
            values = score_rewards([fn], [ex.prompt for ex in chunk], rollout.texts, columns)
            scores.extend(v for v in values[:, 0].tolist() if not math.isnan(v))
            lengths.extend(rollout.lengths.tolist())
            truncated.extend(rollout.truncated.tolist())
        results[task.name] = TaskEval(
            score=sum(scores) / len(scores) if scores else float("nan"),
            truncated_frac=sum(truncated) / len(truncated),
            mean_length=sum(lengths) / len(lengths),
            num_samples=len(examples),
            reward=label,
        )
    return results


def format_eval(tag: str, results: dict[str, TaskEval]) -> str:
    """`[Eval@20] greedy  fairness 0.452 (trunc 0%, len 6.0)  hallucination 0.497 (…)`."""
    parts = [
        f"{name} {r.score:.3f} (trunc {r.truncated_frac:.0%}, len {r.mean_length:.1f})"
        for name, r in results.items()
    ]
    return f"[Eval@{tag}] greedy  " + "  ".join(parts)


def eval_metrics(results: dict[str, TaskEval]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, r in results.items():
        out.update(r.as_metrics(name))
    return out

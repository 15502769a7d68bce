"""From raw per-step records to the benchmark's figures: pure functions, no models.

A *run* is one process of one tool: per-step wall times, generation times, completion
tokens, the reward log and its peak RSS. Each step is timed twice: wall time, and the
process's CPU time. With one torch thread per run the CPU time is the work the step did,
which other processes on a shared machine disturb far less than its wall time.
A *pair* is a TRL run and a mogrpo run started one after the other; the speed ratios are
taken within each pair, so a machine that is busier in one minute than the next moves both
sides of a ratio together.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

FINAL_STEPS = 5
"""The final reward is the mean over this many last steps (one step has only 16 samples)."""


def read_reward_log(path: Path, weights: dict[str, float]) -> tuple[list[float], list[list[str]]]:
    """Per step: the mean combined reward and the prompts scored (each once, in order).

    The log has one line per reward-function call; each tool calls every function once per
    step with all of the step's completions.
    """
    calls: dict[str, list[dict[str, Any]]] = {name: [] for name in weights}
    for line in path.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        calls[record["fn"]].append(record)
    steps = min(len(c) for c in calls.values())
    rewards, prompts = [], []
    for s in range(steps):
        rewards.append(sum(w * statistics.fmean(calls[name][s]["scores"])
                           for name, w in weights.items()))
        first = calls[next(iter(weights))][s]["prompts"]
        prompts.append(list(dict.fromkeys(first)))
    return rewards, prompts


def summarize_run(record: dict[str, Any], warmup: int) -> dict[str, Any]:
    """One run's figures over the steps after `warmup`."""
    steps = record["step_s"][warmup:]
    cpu = record["cpu_s"][warmup:]
    gen = record["generation_s"][warmup:]
    tokens = record["completion_tokens"][warmup:]
    if not steps:
        raise ValueError(f"no timed steps: {len(record['step_s'])} steps, {warmup} warm-up; "
                         "run more steps than warm-up steps")
    curve = record["rewards"]
    return {
        "step_ms": 1000 * statistics.median(steps),
        "cpu_ms": 1000 * statistics.median(cpu),
        "generation_share": sum(gen) / sum(steps),
        # the rest of a step: reward, reference pass, policy forward and backward, optimizer
        "rest_ms": 1000 * statistics.median(s - g for s, g in zip(steps, gen, strict=True)),
        "completion_tokens_per_s": sum(tokens) / sum(gen),
        "peak_rss_mib": record["peak_rss_mib"],
        "final_reward": statistics.fmean(curve[-FINAL_STEPS:]) if curve else float("nan"),
        "timed_steps": len(steps),
    }


def summarize_pairs(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Figures of one (size, mode) over its repeats: medians of each tool, and the paired
    speed ratio (mogrpo steps/s ÷ TRL steps/s = TRL step time ÷ mogrpo step time)."""
    trl = [p["trl"]["summary"] for p in pairs]
    mog = [p["mogrpo"]["summary"] for p in pairs]
    ratios = [t["step_ms"] / m["step_ms"] for t, m in zip(trl, mog, strict=True)]
    cpu_ratios = [t["cpu_ms"] / m["cpu_ms"] for t, m in zip(trl, mog, strict=True)]
    keys = ("step_ms", "cpu_ms", "generation_share", "completion_tokens_per_s", "peak_rss_mib",
            "final_reward", "rest_ms")
    rest = [t["rest_ms"] / m["rest_ms"] for t, m in zip(trl, mog, strict=True)]
    return {
        "trl": {k: statistics.median(s[k] for s in trl) for k in keys},
        "mogrpo": {k: statistics.median(s[k] for s in mog) for k in keys},
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "cpu_ratios": cpu_ratios,
        "cpu_ratio": statistics.median(cpu_ratios),
        "cpu_ratio_min": min(cpu_ratios),
        "cpu_ratio_max": max(cpu_ratios),
        "rest_ratio": statistics.median(rest),
        "rest_ratio_min": min(rest),
        "rest_ratio_max": max(rest),
        "repeats": len(pairs),
        "prompts_match": all(p["prompts_match"] for p in pairs),
    }


def markdown_table(results: dict[str, Any]) -> str:
    """The table of every (size, mode): TRL vs mogrpo."""
    head = ("| model | mode | runs | TRL step | mogrpo step | mogrpo / TRL steps/s (min–max) "
            "| CPU per step TRL / mogrpo | mogrpo / TRL by CPU time (min–max) "
            "| generation share TRL / mogrpo | rest of the step TRL / mogrpo (ratio, min–max) "
            "| completion tok/s TRL / mogrpo | peak RSS TRL / mogrpo | final reward TRL / mogrpo |")
    rows = [head, "|---" * 13 + "|"]
    for entry in results["entries"]:
        s, t, m = entry["summary"], entry["summary"]["trl"], entry["summary"]["mogrpo"]
        rows.append(
            f"| {entry['size']} ({entry['params'] / 1e6:.2f} M) | {entry['mode']} "
            f"| {s['repeats']} × {entry.get('steps', '?')} "
            f"| {t['step_ms']:.0f} ms | {m['step_ms']:.0f} ms "
            f"| **{s['ratio']:.2f}×** ({s['ratio_min']:.2f}–{s['ratio_max']:.2f}) "
            f"| {t['cpu_ms']:.0f} / {m['cpu_ms']:.0f} ms "
            f"| **{s['cpu_ratio']:.2f}×** ({s['cpu_ratio_min']:.2f}–{s['cpu_ratio_max']:.2f}) "
            f"| {t['generation_share']:.0%} / {m['generation_share']:.0%} "
            f"| {_rest(s)} "
            f"| {t['completion_tokens_per_s']:.0f} / {m['completion_tokens_per_s']:.0f} "
            f"| {t['peak_rss_mib']:.0f} / {m['peak_rss_mib']:.0f} MiB "
            f"| {t['final_reward']:.3f} / {m['final_reward']:.3f} |"
        )
    return "\n".join(rows)


def _rest(s: dict[str, Any]) -> str:
    """The step without generation, TRL's and mogrpo's, and TRL's ÷ mogrpo's per pair (older
    results, written before it was recorded: a dash)."""
    t, m = s["trl"], s["mogrpo"]
    if "rest_ratio" not in s:
        return "–"
    return (f"{t['rest_ms']:.0f} / {m['rest_ms']:.0f} ms ({s['rest_ratio']:.2f}×, "
            f"{s['rest_ratio_min']:.2f}–{s['rest_ratio_max']:.2f})")

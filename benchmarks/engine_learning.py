"""Does GRPO learn as well on the `native` rollout engine as on `hf` (generate())? Paired by seed.

The vs_trl workload's 0.68 M Qwen2 (two-digit additions, its rewards `correct` 1.0 and
`starts_with_number` 0.2, 4 prompts x 4 completions per step, <= 32 new tokens, temperature 1,
beta 0.04), warmed up once by mogrpo's SFT so that it starts where RL fine-tuning starts, is
trained with full fine-tuning for `--steps` GRPO steps per seed: once with `rollout.engine: hf`
and once with `native`, the same seed, start, prompts and settings otherwise. Each run is its
own `mogrpo train` process with one thread, two at a time, the order of the engines alternated.

Every final model is then scored by the same instrument, greedy decoding with generate() on
`--heldout` additions none of the runs trained on: accuracy (`correct`) and mean combined
reward; the runs' own end-of-run evals (greedy, on their engine) are kept beside it.

Per seed the difference native - hf; over seeds the exact Wilcoxon signed-rank test and the
exact sign-flip permutation test of the mean difference (all 2^n sign patterns), one-sided
against "native learns worse"; the one-sided 95 % lower confidence bound of the mean
difference (the permutation test inverted); and the permutation test shifted by `--margin`
for non-inferiority ("native is not worse by `margin` or more").

    python benchmarks/engine_learning.py            # 20 seeds x 100 steps, ~25 min on 2 cores

Writes benchmarks/results/engine_learning.json and .md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))

import workload  # noqa: E402  (the vs_trl workload: models, prompts, rewards, settings)
from arith_rewards import WEIGHTS, correct, starts_with_number  # noqa: E402

RESULTS = HERE / "results"
ENGINES = ("hf", "native")
NOTE = """\
Accuracy and reward: greedy, by generate(), on held-out additions no run trained on (the
reward is the accuracy + 0.2 wherever every completion opens with a number). Train reward
(last): the mean combined reward of the last training steps' samples. Tests, on the per-seed
differences native - hf, exact over all 2^n sign patterns: Wilcoxon signed-rank (W, the sum
of signed ranks; p (worse) one-sided against "native worse"), the sign-flip permutation test
of the mean difference, its inversion as a one-sided 95 % lower bound, and non-inferiority: p
of "mean(native - hf) <= -margin"."""


@dataclass(frozen=True)
class Plan:
    """What every run of one invocation shares."""

    work: Path
    steps: int
    learning_rate: float
    sft_steps: int
    sft_learning_rate: float
    heldout: int
    last: int  # training steps averaged for the final training reward

    def env(self) -> dict[str, str]:
        """A child's environment: one thread, offline, quiet."""
        return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}


def split_rows(heldout: int) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows): every two-digit addition once, shuffled by a fixed
    seed; the held-out ones never appear in training."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random("engine_learning").shuffle(pairs)
    rows = [{"prompt": f"What is {a} + {b}?\nAnswer:", "answer": a + b} for a, b in pairs]
    return rows[heldout:], rows[:heldout]


def train(plan: Plan, name: str, config: dict[str, Any]) -> Path:
    """One `mogrpo train` run in its own process; its run directory."""
    path = workload.write_mogrpo_config(plan.work / f"{name}.yaml", config)
    log = plan.work / f"{name}.log"
    with log.open("w", encoding="utf-8") as out:
        done = subprocess.run([sys.executable, "-m", "mogrpo.cli", "train", str(path)],
                              env=plan.env(), stdout=out, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed ({done.returncode}); see {log}")
    return Path(config["output"]["dir"])


def base_config(plan: Plan, model: str, seed: int, steps: int, out: Path,
                engine: str | None) -> dict[str, Any]:
    """The vs_trl workload's mogrpo config at this plan's learning rate, with the held-out
    rows as the task's eval data (greedy, at the end of the run)."""
    settings = replace(workload.Settings(), seed=seed, learning_rate=plan.learning_rate)
    config = workload.mogrpo_config(model, plan.work / "train.jsonl", out, steps, False,
                                    settings, engine)
    config["tasks"][workload.TASK]["eval_data"] = str(plan.work / "heldout.jsonl")
    config["eval"] = {"at_start": False, "every_steps": 0, "max_samples": plan.heldout}
    return config


def warm_up(plan: Plan, model: str) -> Path:
    """The SFT model every GRPO run starts from: mogrpo's warm-up on the training rows'
    answers (one GRPO step after it, which is discarded)."""
    config = base_config(plan, model, 0, 1, plan.work / "sft-run", "hf")
    config["sft"] = {"enabled": True, "steps": plan.sft_steps, "batch_size": 32,
                     "learning_rate": plan.sft_learning_rate, "max_length": 32}
    config["tasks"][workload.TASK]["sft_target"] = " {answer}"
    merged = train(plan, "sft", config) / "sft" / "merged"
    # The model's own tokenizer files, not the ones the run saved: loaded as a Qwen2Tokenizer,
    # the workload's tokenizer gains an unknown token `<|endoftext|>` past the model's
    # vocab_size, and a run starting from files that list it is refused (model.tokenizer).
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(model) / name, merged / name)
    return merged


def training_rewards(run: Path) -> list[float]:
    """The weighted mean reward of each GRPO step."""
    rewards = []
    for line in (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "event" not in record and "step" in record:
            rewards.append(sum(w * record[f"task/{workload.TASK}/reward/{name}/mean"]
                               for name, w in WEIGHTS.items()))
    return rewards


def heldout_scores(model_dir: Path, rows: list[dict]) -> dict[str, float]:
    """Greedy accuracy and mean combined reward on `rows`, decoded by generate()."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mogrpo.rollout.generate import SamplingSettings, generate_rollout

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [r["prompt"] for r in rows]
    ro = generate_rollout(model, tok, prompts,
                          SamplingSettings(greedy=True, max_new_tokens=32), num_generations=1,
                          max_prompt_length=32, engine="hf", generation_batch_size=128)
    right = correct(prompts, ro.texts, [r["answer"] for r in rows])
    formatted = starts_with_number(prompts, ro.texts)
    return {"accuracy": statistics.fmean(right),
            "reward": statistics.fmean(WEIGHTS["correct"] * c + WEIGHTS["starts_with_number"] * f
                                       for c, f in zip(right, formatted, strict=True))}


def grpo(plan: Plan, start: Path, seed: int, engine: str) -> Path:
    """One seed's GRPO run on one engine; its run directory."""
    name = f"{engine}-{seed}"
    return train(plan, name, base_config(plan, str(start), seed, plan.steps, plan.work / name,
                                         engine))


def scores_of(plan: Plan, run: Path, seed: int, engine: str, rows: list[dict]) -> dict[str, Any]:
    """A finished run's held-out scores (generate()'s greedy), its own end eval and its
    training rewards."""
    rewards = training_rewards(run)
    summary = json.loads((run / "summary.json").read_text(encoding="utf-8"))
    return {"seed": seed, "engine": engine, **heldout_scores(run / "final" / "model", rows),
            "own_eval": summary["evals"]["end"][workload.TASK],
            "train_reward_last": statistics.fmean(rewards[-plan.last:]),
            "train_reward_mean": statistics.fmean(rewards), "rewards": rewards}

def sign_flip_p(values: list[float], observed: float, larger: bool) -> float:
    """Exact p of sum(signs x |values|) <= observed (`larger`: >=) over all 2^n sign patterns:
    under "no difference" each paired difference is as likely negative as positive."""
    import torch

    subsets = torch.zeros(1, dtype=torch.float64)  # the sums of |v| over every subset
    for v in values:
        subsets = torch.cat([subsets, subsets + abs(v)])
    sums = 2 * subsets - sum(abs(v) for v in values)  # [2^n] the signed sums
    tol = 1e-9 * max(1.0, abs(observed))
    hits = sums >= observed - tol if larger else sums <= observed + tol
    return float(hits.double().mean())


def lower_bound(diffs: list[float], level: float = 0.05) -> float:
    """The one-sided (1 - level) lower confidence bound of the mean difference: the smallest
    shift delta whose sign-flip test of mean(d - delta) <= 0 still has p > level (bisection)."""
    def p_above(delta: float) -> float:
        shifted = [d - delta for d in diffs]
        return sign_flip_p(shifted, sum(shifted), larger=True)

    low, high = min(diffs) - 1e-9, max(diffs) + 1e-9
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if p_above(middle) <= level else (low, middle)
    return low


def signed_ranks(diffs: list[float]) -> list[float]:
    """Wilcoxon's signed ranks of the non-zero differences (average ranks for ties)."""
    nonzero = sorted((abs(d), d) for d in diffs if d != 0)
    ranks: list[float] = []
    for _, group in itertools.groupby(nonzero, key=lambda item: item[0]):
        members = list(group)
        rank = len(ranks) + (len(members) + 1) / 2
        ranks.extend(rank if d > 0 else -rank for _, d in members)
    return ranks


def paired_tests(hf: list[float], native: list[float], margin: float) -> dict[str, float]:
    """One-sided exact tests of "native worse" and of non-inferiority at `margin`."""
    diffs = [n - h for h, n in zip(hf, native, strict=True)]
    ranks = signed_ranks(diffs)
    shifted = [d + margin for d in diffs]
    return {
        "mean_difference": statistics.fmean(diffs),
        "median_difference": statistics.median(diffs),
        "native_better_seeds": sum(d > 0 for d in diffs),
        "native_worse_seeds": sum(d < 0 for d in diffs),
        "wilcoxon_w": sum(ranks),
        "wilcoxon_p_worse": sign_flip_p(ranks, sum(ranks), larger=False),
        "wilcoxon_p_two_sided": min(1.0, 2 * min(sign_flip_p(ranks, sum(ranks), False),
                                                 sign_flip_p(ranks, sum(ranks), True))),
        "permutation_p_worse": sign_flip_p(diffs, sum(diffs), larger=False),
        "lower_bound_95": lower_bound(diffs),
        "margin": margin,
        "non_inferiority_p": sign_flip_p(shifted, sum(shifted), larger=True),
    }


def machine() -> str:
    from mogrpo.kernels.cpu.linear import machine_line

    return machine_line()


def to_markdown(result: dict[str, Any]) -> str:
    runs = {(r["engine"], r["seed"]): r for r in result["runs"]}
    lines = ["| seed | hf accuracy | native accuracy | hf reward | native reward | "
             "hf train reward (last) | native train reward (last) |", "|---" * 7 + "|"]
    for s in result["seeds"]:
        h, n = runs["hf", s], runs["native", s]
        lines.append(f"| {s} | {h['accuracy']:.3f} | {n['accuracy']:.3f} | {h['reward']:.3f} | "
                     f"{n['reward']:.3f} | {h['train_reward_last']:.3f} | "
                     f"{n['train_reward_last']:.3f} |")
    means = {k: {e: statistics.fmean(runs[e, s][k] for s in result["seeds"]) for e in ENGINES}
             for k in ("accuracy", "reward", "train_reward_last")}
    lines.append(f"| mean | {means['accuracy']['hf']:.3f} | {means['accuracy']['native']:.3f} | "
                 f"{means['reward']['hf']:.3f} | {means['reward']['native']:.3f} | "
                 f"{means['train_reward_last']['hf']:.3f} | "
                 f"{means['train_reward_last']['native']:.3f} |")
    lines += ["", "| paired over seeds (native - hf) | mean | median | native better / worse | "
              "Wilcoxon W, p (worse) | p (two-sided) | permutation p (worse) | "
              "95 % lower bound | non-inferiority p |", "|---" * 9 + "|"]
    for key, t in result["tests"].items():
        lines.append(f"| {key} | {t['mean_difference']:+.4f} | {t['median_difference']:+.4f} | "
                     f"{t['native_better_seeds']} / {t['native_worse_seeds']} | "
                     f"{t['wilcoxon_w']:+.1f}, {t['wilcoxon_p_worse']:.3f} | "
                     f"{t['wilcoxon_p_two_sided']:.3f} | {t['permutation_p_worse']:.3f} | "
                     f"{t['lower_bound_95']:+.4f} | "
                     f"{t['non_inferiority_p']:.2g} (margin {t['margin']:g}) |")
    return "\n".join(lines)


def run_all(plan: Plan, seeds: list[int], jobs: int) -> dict[str, Any]:
    """Build, warm up, train every (seed, engine) and score them."""
    import time

    model = workload.build_models(plan.work, ["small"], 0)["small"]["path"]
    train_rows, heldout = split_rows(plan.heldout)
    workload.write_prompts(plan.work / "train.jsonl", train_rows)
    workload.write_prompts(plan.work / "heldout.jsonl", heldout)
    started = time.perf_counter()
    start = warm_up(plan, model)
    start_scores = heldout_scores(start, heldout)
    print(f"SFT start: accuracy {start_scores['accuracy']:.3f}", flush=True)
    # the engines alternate which goes first; a seed's two runs run side by side
    order = [(s, e) for i, s in enumerate(seeds) for e in (ENGINES if i % 2 == 0 else ENGINES[::-1])]
    with ThreadPoolExecutor(jobs) as pool:
        dirs = list(pool.map(lambda job: grpo(plan, start, *job), order))
    runs = []
    for (seed, engine), run in zip(order, dirs, strict=True):
        runs.append(scores_of(plan, run, seed, engine, heldout))
        print(f"seed {seed} {engine}: accuracy {runs[-1]['accuracy']:.3f}", flush=True)
    return {"start": start_scores, "runs": runs, "minutes": (time.perf_counter() - started) / 60}


def write_results(result: dict[str, Any], out: Path) -> None:
    """`out`.json (everything) and `out`.md (the tables, machine, commit and command)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    table = to_markdown(result)
    same = sum(r["own_eval"] == r["accuracy"] for r in result["runs"])
    out.with_suffix(".md").write_text(
        f"# Learning on the native engine against generate(), paired by seed\n\n"
        f"Machine: {result['machine']}. Commit {result['commit']}. Command: "
        f"`{result['command'].strip()}` ({result['minutes']:.0f} min).\n\n"
        f"Start (after SFT): held-out accuracy {result['start']['accuracy']:.3f}, reward "
        f"{result['start']['reward']:.3f}; {result['steps']} GRPO steps at lr "
        f"{result['learning_rate']:g}; {result['heldout']} held-out additions.\n\n{table}\n\n"
        f"The runs' own end-of-run evals (greedy, on their own engine) equal generate()'s "
        f"held-out accuracy in {same} of {len(result['runs'])} runs.\n\n{NOTE}\n", encoding="utf-8")
    print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=list(range(20)))
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=2e-5, help="GRPO learning rate")
    parser.add_argument("--sft-steps", type=int, default=450)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--heldout", type=int, default=512, help="held-out additions")
    parser.add_argument("--last", type=int, default=20,
                        help="final training steps averaged for the final training reward")
    parser.add_argument("--margin", type=float, default=0.02,
                        help="non-inferiority margin (accuracy and reward units)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (one thread each)")
    parser.add_argument("--work", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_learning")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        plan = Plan((args.work or Path(tmp)).resolve(), args.steps, args.lr, args.sft_steps,
                    args.sft_lr, args.heldout, args.last)
        plan.work.mkdir(parents=True, exist_ok=True)
        result = run_all(plan, args.seeds, args.jobs)
    runs = {(r["engine"], r["seed"]): r for r in result["runs"]}
    result["tests"] = {
        key: paired_tests([runs["hf", s][key] for s in args.seeds],
                          [runs["native", s][key] for s in args.seeds], args.margin)
        for key in ("accuracy", "reward", "train_reward_last")}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip() or "unknown"
    command = "python benchmarks/engine_learning.py " + " ".join(sys.argv[1:])
    result |= {"machine": machine(), "commit": commit, "command": command,
               "seeds": args.seeds, "steps": args.steps, "learning_rate": args.lr,
               "sft_steps": args.sft_steps, "sft_learning_rate": args.sft_lr,
               "heldout": args.heldout}
    write_results(result, args.out)


if __name__ == "__main__":
    main()

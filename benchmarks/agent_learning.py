"""Does the calculator agent learn? Run `examples/agent_calculator.py` for several seeds and
record, per seed, the reward curve (each window of GRPO steps: the mean episode reward, its
objectives, the share of episodes that called the calculator) and the held-out greedy eval
after the warm-up and after GRPO (correct answers, episodes that called the tool).

    python benchmarks/agent_learning.py --seeds 0 1 2

Each seed is its own process with one thread (OMP_NUM_THREADS=1), at most `--jobs` (2) at
once; wall and CPU time are each process's own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mogrpo.kernels.cpu.linear import machine_line

ROOT = Path(__file__).resolve().parents[1]
TASK = "calc"
CURVE = {"reward": f"task/{TASK}/reward/mean",
         "correct": f"task/{TASK}/reward/correct/mean",
         "right_call": f"task/{TASK}/reward/calculator_call/mean",
         "calls": f"task/{TASK}/tool/calculator/calls"}


def start_seed(seed: int, work: Path, overrides: list[str]) -> subprocess.Popen:
    sets = [arg for o in ["logging.progress_bar=false", "output.overwrite=true", *overrides]
            for arg in ("--set", o)]
    work.mkdir(parents=True, exist_ok=True)
    log = (work / f"seed{seed}.log").open("w", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen(
        [sys.executable, str(ROOT / "examples" / "agent_calculator.py"), "--seed", str(seed),
         "--out", str(work), *sets], stdout=log, stderr=subprocess.STDOUT, env=env)


def run_all(seeds: list[int], work: Path, overrides: list[str], jobs: int) -> dict[int, dict]:
    """Every seed's process, `jobs` at a time: {seed: {wall_s, cpu_s}}."""
    pending, running, times = list(seeds), {}, {}
    while pending or running:
        while pending and len(running) < jobs:
            seed = pending.pop(0)
            running[start_seed(seed, work, overrides).pid] = (seed, time.perf_counter())
        pid, status, usage = os.wait4(-1, 0)
        if pid not in running:
            continue
        seed, started = running.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            raise SystemExit(f"seed {seed} failed; see {work / f'seed{seed}.log'}")
        times[seed] = {"wall_s": time.perf_counter() - started,
                       "cpu_s": usage.ru_utime + usage.ru_stime}
    return times


def seed_result(seed: int, run: Path, every: int) -> dict:
    """The run's curve (means over windows of `every` GRPO steps) and its evals."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if CURVE["reward"] in r]
    curve = []
    for start in range(0, len(steps), every):
        window = steps[start:start + every]
        curve.append({"steps": f"{window[0]['step']}-{window[-1]['step']}",
                      **{k: statistics.fmean(r.get(key, 0.0) for r in window)
                         for k, key in CURVE.items()}})
    evals = {}
    for line in (run / "eval.jsonl").read_text().splitlines():
        record = json.loads(line)
        evals[record["tag"]] = {"correct": record[TASK]["score"],
                                "tool_call_frac": record[TASK].get("tool_call_frac")}
    sft = [json.loads(line) for line in (run / "sft_metrics.jsonl").read_text().splitlines()]
    health = json.loads((run / "summary.json").read_text()).get("health") or []
    alerts = sorted({f"{a['check']} (step {a['step']})" for a in health})
    return {"seed": seed, "curve": curve, "before": evals["start"], "after": evals["end"],
            "sft_final_loss": sft[-1]["sft/loss"], "alerts": alerts,
            "kl_max": max(r.get(f"task/{TASK}/kl", 0.0) for r in steps)}


def to_markdown(results: list[dict]) -> str:
    lines = ["| seed | correct answer, after SFT → after GRPO | called the tool | highest KL "
             "| health alerts | wall / CPU time |", "|---|---|---|---|---|---|"]
    for r in results:
        b, a = r["before"], r["after"]
        lines.append(f"| {r['seed']} | {b['correct']:.3f} → **{a['correct']:.3f}** | "
                     f"{b['tool_call_frac']:.3f} → {a['tool_call_frac']:.3f} | "
                     f"{r['kl_max']:.3f} | {', '.join(r['alerts']) or 'none'} | "
                     f"{r['wall_s'] / 60:.1f} / {r['cpu_s'] / 60:.1f} min |")
    gains = [r["after"]["correct"] - r["before"]["correct"] for r in results]
    lines.append(f"| mean gain | {statistics.fmean(gains):+.3f} "
                 f"({min(gains):+.3f} to {max(gains):+.3f}) | | | | |")
    lines += ["", "Reward curve: the mean over each window of GRPO steps (64 episodes a step) "
              "of the episode reward (correct + 0.5 × right call), of each objective, and of "
              "the calculator calls per episode.", ""]
    for r in results:
        lines += [f"Seed {r['seed']} (SFT's last loss {r['sft_final_loss']:.3f}):", "",
                  "| steps | reward | correct | right call | calls |", "|---|---|---|---|---|"]
        lines += [f"| {c['steps']} | {c['reward']:.3f} | {c['correct']:.3f} | "
                  f"{c['right_call']:.3f} | {c['calls']:.2f} |" for c in r["curve"]]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--jobs", type=int, default=2, help="seeds run at once (default 2)")
    parser.add_argument("--every", type=int, default=5, help="GRPO steps per curve window")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "bench-agent")
    parser.add_argument("--out", type=Path,
                        default=ROOT / "benchmarks" / "results" / "agent_learning.md")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override for every run")
    args = parser.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip() or "unknown"  # what runs
    times = run_all(args.seeds, args.work.resolve(), args.overrides, args.jobs)
    results = [{**seed_result(s, args.work / f"run-seed{s}", args.every), **times[s]}
               for s in args.seeds]
    command = (f"python benchmarks/agent_learning.py --seeds {' '.join(map(str, args.seeds))} "
               f"--jobs {args.jobs}" + "".join(f" --set {o}" for o in args.overrides))
    table = to_markdown(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# The calculator agent learns: greedy held-out eval (40 questions) after the warm-up "
        f"and after GRPO\n\nMachine: {machine_line()}. Commit {commit}. Command: `{command}` "
        f"({args.jobs} seeds at a time, one thread each).\n\n{table}",
        encoding="utf-8")
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine_line(), "commit": commit, "command": command,
                    "seeds": results}, indent=2), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()

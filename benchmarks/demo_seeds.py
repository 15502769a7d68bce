"""Run `mogrpo demo` for several seeds; record wall time and before/after accuracy per task.

    python benchmarks/demo_seeds.py --seeds 0 1 2 --out benchmarks/results/demo_seeds.md

Each seed runs in its own process (as a user would run it), one after another, so the wall
time is what one demo takes on this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

from mogrpo.algo.cpu_linear import cpu_name


def run_seed(seed: int, work: Path) -> dict:
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "mogrpo.cli", "demo", "--seed", str(seed), "--out", str(work),
         "--set", "logging.progress_bar=false",
         "--set", "output.overwrite=true"],  # a rerun replaces the last one's runs
        check=True, stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    summary = json.loads((work / f"run-seed{seed}" / "summary.json").read_text())
    return {"seed": seed, "seconds": seconds, "evals": summary["evals"], "tasks": summary["tasks"]}


def to_markdown(results: list[dict]) -> str:
    tasks = results[0]["tasks"]
    head = "| seed | " + " | ".join(f"{t} after SFT | {t} after GRPO" for t in tasks) + " | wall time |"
    rule = "|---" * (2 + 2 * len(tasks)) + "|"
    rows = []
    for r in results:
        cells = []
        for t in tasks:
            cells += [f"{r['evals']['start'][t]:.3f}", f"**{r['evals']['end'][t]:.3f}**"]
        rows.append(f"| {r['seed']} | " + " | ".join(cells) + f" | {r['seconds'] / 60:.1f} min |")
    means = []
    for t in tasks:
        for tag in ("start", "end"):
            means.append(f"{sum(r['evals'][tag][t] for r in results) / len(results):.3f}")
    rows.append("| mean | " + " | ".join(means) + " | |")
    return "\n".join([head, rule, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("runs/bench-demo"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_seeds.md"))
    args = parser.parse_args()
    results = [run_seed(seed, args.work) for seed in args.seeds]
    table = to_markdown(results)
    machine = (f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, Python "
               f"{platform.python_version()}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# `mogrpo demo`: greedy held-out accuracy (200 prompts per task)\n\n"
        f"Machine: {machine}. Command: `python benchmarks/demo_seeds.py --seeds "
        f"{' '.join(map(str, args.seeds))}`\n\n{table}\n",
        encoding="utf-8",
    )
    (args.out.with_suffix(".json")).write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()

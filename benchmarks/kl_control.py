"""The KL controllers side by side on the demo's two tasks: `fixed`, `band`, `proportional`
and `dual`, each over the same seeds, only the controller changed.

    python benchmarks/kl_control.py --seeds 0 1 2
    python benchmarks/kl_control.py --seeds 0 1 2 --beta-scale 0.1   # every β starts 10x low

Per controller and task: steps until the KL's window means stay inside the band (the band is
the demo's for every controller; `proportional` steers toward its centre, `fixed` keeps the
demo's starting β), the share of the second half in the band, and the final greedy accuracy.
`--beta-scale F` starts every task's β at F times the demo's (what a user with a guessed β
meets). Writes benchmarks/results/kl_control.md (and .json).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
from pathlib import Path

from demo_seeds import kl_stats, run_seed

from mogrpo.demo import demo_base
from mogrpo.kernels.cpu.linear import machine_line

FIELDS = ("low", "high", "rate", "target", "horizon", "kp", "ki", "max_step", "warmup_steps",
          "beta_min", "beta_max")


def overrides(kind: str, beta_scale: float = 1.0) -> list[str]:
    """The --set lines that give every demo task controller `kind` on the demo's band (every
    other controller field null: a --set merges into the demo's own `kl`), each task's β
    starting at `beta_scale` times the demo's."""
    sets = []
    for name, task in demo_base()["tasks"].items():
        if beta_scale != 1.0:
            sets.append(f"tasks.{name}.beta={task['beta'] * beta_scale:g}")
        kl = task["kl"]
        keep: dict = dict.fromkeys(FIELDS) | {"kind": kind, "every_steps": kl["every_steps"]}
        if kind in ("band", "dual"):
            keep |= {"low": kl["low"], "high": kl["high"]}
        if kind == "dual":
            keep |= {f: kl[f] for f in FIELDS if f in kl and f not in ("low", "high")}
        if kind == "band":
            keep["rate"] = 0.1  # the rate the demo used before `dual`
        if kind == "proportional":
            keep["target"] = round(math.sqrt(kl["low"] * kl["high"]), 4)
        sets.append(f"tasks.{name}.kl={json.dumps(keep)}")
    return sets


def settled(stats: dict) -> str:
    at = stats.get("settled_at", "n/a")
    return "never" if at is None else str(at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kinds", nargs="+", default=["fixed", "band", "proportional", "dual"])
    parser.add_argument("--work", type=Path, default=Path("runs/bench-kl-control"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kl_control.md"))
    parser.add_argument("--beta-scale", type=float, default=1.0,
                        help="start every task's β at this multiple of the demo's")
    parser.add_argument("--add", action="append", default=[], metavar="KIND=JSON",
                        help="take KIND's runs from a JSON of this script or of demo_seeds.py "
                             "(same commit and seeds) instead of running them (the demo's own "
                             "controller is `dual`)")
    args = parser.parse_args()
    added = dict(a.split("=", 1) for a in args.add)
    kinds = [k for k in args.kinds if k not in added] + list(added)
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    for kind, path in added.items():
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        data = data[kind] if isinstance(data, dict) else data  # this script's JSON or demo_seeds'
        runs = {r["seed"]: r for r in data}
        results[kind] = [runs[s] for s in args.seeds]
    bands = {name: (task["kl"]["low"], task["kl"]["high"])
             for name, task in demo_base()["tasks"].items()}
    for seed in args.seeds:  # alternated: each seed's runs back to back
        for kind in args.kinds:
            if kind not in added:
                run = run_seed(seed, args.work / kind, overrides(kind, args.beta_scale))
                run["kl"] = kl_stats(args.work / kind / f"run-seed{seed}", bands)
                results[kind].append(run)
    args.kinds = kinds
    tasks = results[args.kinds[0]][0]["tasks"]
    lines = ["| controller | task | settled by step (per seed) | in band, 2nd half: steps / "
             "windows | final accuracy (mean, per seed) | β at the end |", "|---" * 6 + "|"]
    for kind in args.kinds:
        for t in tasks:
            runs = results[kind]
            kl = [r["kl"][t] for r in runs]
            ends = [r["evals"]["end"][t] for r in runs]
            betas = ", ".join(f"{k['beta']:.3g}" for k in kl)
            steps = statistics.fmean(k.get("in_band_steps", 0) for k in kl)
            windows = statistics.fmean(k.get("in_band_windows", 0) for k in kl)
            lines.append(
                f"| {kind} | {t} | {', '.join(settled(k) for k in kl)} | {steps:.0%} / "
                f"{windows:.0%} | {statistics.fmean(ends):.3f} "
                f"({', '.join(f'{e:.3f}' for e in ends)}) | "
                f"{betas} |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        "# KL controllers on the demo's tasks\n\n"
        f"Machine: {machine_line()}. Commit {commit}. Command: `python benchmarks/kl_control.py "
        f"--seeds {' '.join(map(str, args.seeds))}"
        + (f" --beta-scale {args.beta_scale:g}" if args.beta_scale != 1.0 else "") + "`; β "
        f"started at {args.beta_scale:g}× the demo's.\n\n"
        "Settled by: the step after which every window mean (`every_steps`) of the task's KL "
        "lies inside its band (never: the last window is outside). In band: the share of the "
        "second half's steps (and windows) inside.\n\n" + "\n".join(lines) + "\n",
        encoding="utf-8")
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

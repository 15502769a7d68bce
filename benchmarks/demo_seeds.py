"""Run `mogrpo demo` for several seeds; record wall time, before/after accuracy per task, and
each task's KL against its band.

    python benchmarks/demo_seeds.py --seeds 0 1 2 3 4 5 6 7 8 9

Each seed runs in its own process (as a user would run it), one after another, so the wall
time is what one demo takes on this machine. `--set` passes config overrides to every run
(`benchmarks/kl_control.py` uses it to swap the KL controller).

KL in band: the fraction of the second half's steps whose KL lies inside the task's band, per
step (one step's KL is estimated from ~32 completions of the task) and as the mean of each
window of `every_steps` steps (what the controller judges).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from mogrpo.kernels.cpu.linear import machine_line


def band_of(config: dict, task: str) -> tuple[float, float] | None:
    kl = config["tasks"][task].get("kl") or {}
    if kl.get("low") is None or kl.get("high") is None:
        return None
    return float(kl["low"]), float(kl["high"])


def kl_stats(run: Path, bands: dict[str, tuple[float, float]] | None = None) -> dict[str, dict]:
    """Per task: its band (the run's own, or `bands`: to judge a controller without one), the
    second half's median KL, the fractions in band (per step and per controller window), the
    first step after which the KL's window means stay inside (None if they never do), and the
    last β."""
    config = yaml.safe_load((run / "config.yaml").read_text(encoding="utf-8"))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r and "step" in r]
    out = {}
    for task in config["tasks"]:
        key = f"task/{task}/kl"
        series = [(r["step"], r[key]) for r in steps if isinstance(r.get(key), float | int)]
        band = (bands or {}).get(task) or band_of(config, task)
        every = int((config["tasks"][task].get("kl") or {}).get("every_steps", 1))
        half = [v for s, v in series if s > series[-1][0] / 2]
        stats = {"band": band, "median_kl": statistics.median(half),
                 "beta": steps[-1].get(f"task/{task}/beta")}
        if band is not None:
            low, high = band
            stats["in_band_steps"] = sum(low <= v <= high for v in half) / len(half)
            windows = [statistics.fmean(half[i:i + every]) for i in range(0, len(half), every)]
            stats["in_band_windows"] = sum(low <= w <= high for w in windows) / len(windows)
            means = [(series[i + every - 1][0], statistics.fmean(v for _, v in series[i:i + every]))
                     for i in range(0, len(series) - every + 1, every)]
            outside = [s for s, w in means if not low <= w <= high]
            stats["settled_at"] = None if means and outside and outside[-1] == means[-1][0] \
                else (outside[-1] if outside else 0)
        out[task] = stats
    return out


def run_seed(seed: int, work: Path, overrides: list[str]) -> dict:
    start = time.perf_counter()
    sets = [arg for o in overrides for arg in ("--set", o)]
    subprocess.run(
        [sys.executable, "-m", "mogrpo.cli", "demo", "--seed", str(seed), "--out", str(work),
         "--set", "logging.progress_bar=false",
         "--set", "output.overwrite=true", *sets],  # a rerun replaces the last one's runs
        check=True, stdout=subprocess.DEVNULL,
    )
    seconds = time.perf_counter() - start
    run = work / f"run-seed{seed}"
    summary = json.loads((run / "summary.json").read_text())
    return {"seed": seed, "seconds": seconds, "evals": summary["evals"], "tasks": summary["tasks"],
            "alerts": len(summary.get("health") or []), "kl": kl_stats(run)}


def _spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def to_markdown(results: list[dict]) -> str:
    tasks = results[0]["tasks"]
    head = ("| seed | " + " | ".join(f"{t} after SFT → GRPO | {t} KL (band), in band" for t in tasks)
            + " | alerts | wall time |")
    rule = "|---" * (3 + 2 * len(tasks)) + "|"
    rows = []
    for r in results:
        cells = []
        for t in tasks:
            k = r["kl"][t]
            band = f"{k['band'][0]:g}–{k['band'][1]:g}" if k["band"] else "no band"
            inside = (f"{k['in_band_steps']:.0%} / {k['in_band_windows']:.0%}"
                      if k["band"] else "—")
            cells += [f"{r['evals']['start'][t]:.3f} → **{r['evals']['end'][t]:.3f}**",
                      f"{k['median_kl']:.3f} ({band}), {inside}"]
        rows.append(f"| {r['seed']} | " + " | ".join(cells)
                    + f" | {r['alerts']} | {r['seconds'] / 60:.1f} min |")
    cells = []
    for t in tasks:
        gains = [r["evals"]["end"][t] - r["evals"]["start"][t] for r in results]
        ends = [r["evals"]["end"][t] for r in results]
        kls = [r["kl"][t] for r in results]
        inside = (f"steps {_spread([k['in_band_steps'] for k in kls])}, windows "
                  f"{_spread([k['in_band_windows'] for k in kls])}" if kls[0]["band"] else "—")
        cells += [f"end {_spread(ends)}, gain {_spread(gains)}", inside]
    rows.append("| mean (min–max) | " + " | ".join(cells) + " | | |")
    note = ("KL: the second half's median per-token KL; in band: the share of the second half's "
            "steps inside the band, per step / per controller window (mean of `every_steps`).")
    return "\n".join([head, rule, *rows, "", note])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--work", type=Path, default=Path("runs/bench-demo"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/demo_seeds.md"))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="config override for every run")
    args = parser.parse_args()
    results = [run_seed(seed, args.work, args.overrides) for seed in args.seeds]
    table = to_markdown(results)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    command = "python benchmarks/demo_seeds.py --seeds " + " ".join(map(str, args.seeds)) + \
        "".join(f" --set {o}" for o in args.overrides)
    engine = next((o.split("=", 1)[1] for o in args.overrides
                   if o.startswith("rollout.engine=")), "auto (the default)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        f"# `mogrpo demo`: greedy held-out accuracy (200 prompts per task) and KL per task\n\n"
        f"Machine: {machine_line()}. Commit {commit}. Rollout engine: {engine}. "
        f"Command: `{command}`\n\n{table}\n",
        encoding="utf-8",
    )
    (args.out.with_suffix(".json")).write_text(json.dumps(results, indent=2), encoding="utf-8")
    print(table)


if __name__ == "__main__":
    main()

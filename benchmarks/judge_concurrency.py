"""How close a step's judging comes to ideal concurrency: wall time / (ceil(n/w) · d).

    python benchmarks/judge_concurrency.py --delays 0.5 0.1 --repeats 3 [--keep-alive] \
        --out benchmarks/results/judge_concurrency.md

A local fault-injecting server (tests/judge_server.py, 127.0.0.1) answers every request after a
fixed delay d. A JudgeReward with w workers and no cache judges n distinct completions; with
perfect overlap that takes ceil(n/w) · d, so a ratio of 1.00 means the judge adds nothing but
the server's own latency. Throughput is n / wall (completions judged per second). Each (n, w)
runs `--repeats` times; the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from judge_server import FaultServer, judge_options, reply  # noqa: E402
from mogrpo.rewards.judge import JudgeReward  # noqa: E402

CASES = [(8, 1), (8, 4), (8, 8), (16, 8), (32, 8), (64, 16), (256, 64)]


def measure(n: int, workers: int, delay: float, keep_alive: bool) -> dict:
    with FaultServer(default=reply("5", delay=delay), keep_alive=keep_alive) as server:
        judge = JudgeReward.from_options(
            judge_options(server.url, max_workers=workers, timeout=delay * 10 + 5),
            where="bench", cache_dir=None)
        # One untimed call first: a run pays for setting its client up once, not every step.
        judge(["q"], ["warm-up"])
        server.reset_counters()
        start = time.perf_counter()
        scores = judge(["q"] * n, [f"completion {i}" for i in range(n)])
        wall = time.perf_counter() - start
        overlap = server.max_in_flight
    assert all(s == 0.5 for s in scores), "every call must be scored"
    ideal = math.ceil(n / workers) * delay
    return {"wall_s": wall, "ideal_s": ideal, "ratio": wall / ideal, "per_s": n / wall,
            "max_in_flight": overlap}


def cpu_name() -> str:
    """The CPU's model name (as `lscpu` shows it), or the architecture if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--delays", type=float, nargs="+", default=[0.5, 0.1],
                        help="server delays d in seconds")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--keep-alive", action="store_true",
                        help="the server speaks HTTP/1.1 with persistent connections and "
                             "TCP_NODELAY, as production servers do (default: HTTP/1.0)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/judge_concurrency.md"))
    args = parser.parse_args()
    rows = []
    for delay, (n, workers) in [(d, case) for d in args.delays for case in CASES]:
        runs = [measure(n, workers, delay, args.keep_alive) for _ in range(args.repeats)]
        row = {"n": n, "workers": workers, "delay_s": delay,
               "ideal_s": runs[0]["ideal_s"],
               "wall_s_median": statistics.median(r["wall_s"] for r in runs),
               "ratio_median": statistics.median(r["ratio"] for r in runs),
               "ratio_max": max(r["ratio"] for r in runs),
               "per_s_median": statistics.median(r["per_s"] for r in runs),
               "max_in_flight": min(r["max_in_flight"] for r in runs)}
        rows.append(row)
        print(f"d={delay:g} n={n:>3} w={workers:>2}  ideal {row['ideal_s']:.2f}s  wall {row['wall_s_median']:.2f}s"
              f"  ratio {row['ratio_median']:.3f} (max {row['ratio_max']:.3f})"
              f"  {row['per_s_median']:.1f}/s"
              f"  in flight {row['max_in_flight']}")
    machine = f"{cpu_name()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    head = ("| d | n | workers | ideal ceil(n/w)·d | wall (median) | ratio (median) | ratio (max) "
            "| judged/s (median) | max in flight |")
    lines = [
        "# Judge concurrency", "",
        f"{args.repeats} repeats per row, {machine}; server "
        f"{'HTTP/1.1 keep-alive' if args.keep_alive else 'HTTP/1.0'}.",
        "ratio = wall / (ceil(n/w) · d); 1.00 is perfect overlap.", "",
        head, "|---" * 9 + "|",
        *(f"| {r['delay_s']:g} s | {r['n']} | {r['workers']} | {r['ideal_s']:.2f} s | {r['wall_s_median']:.2f} s | "
          f"{r['ratio_median']:.3f} | {r['ratio_max']:.3f} | {r['per_s_median']:.1f} | {r['max_in_flight']} |"
          for r in rows),
        "",
    ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines), encoding="utf-8")
    args.out.with_suffix(".json").write_text(
        json.dumps({"machine": machine, "keep_alive": args.keep_alive, "rows": rows}, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")


if __name__ == "__main__":
    main()

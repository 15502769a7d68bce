"""Throughput of `verilog_tests`: completions scored per second, by workers and isolation.

    python benchmarks/code_sandbox.py                 # 1, 2, 4 workers; 3 repeats
    python benchmarks/code_sandbox.py --repeats 1 --copies 1

The completions are the example set's references (examples/verilog/problems.jsonl), `copies`
times over (each compiles and passes every check), plus each reference without its `endmodule`
(a compile error, the other common case in early training). Each (isolation, workers) cell is timed `repeats` times in alternation
with the others, so the machine's drift falls on all alike; the table gives the median rate.
Writes benchmarks/results/code_sandbox.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

from mogrpo.rewards.verilog import verilog_tests
from mogrpo.sandbox import probe_isolation

ROOT = Path(__file__).resolve().parents[1]
ROWS = [json.loads(line) for line in
        (ROOT / "examples" / "verilog" / "problems.jsonl").read_text().splitlines()]


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def broken(reference: str) -> str:
    """The reference without its `endmodule`: a compile error, as models often produce."""
    return reference.replace("endmodule", "")


def rate(isolation: str, workers: int, copies: int) -> tuple[float, int]:
    completions = [r["reference"] for r in ROWS] * copies + [broken(r["reference"]) for r in ROWS]
    rows = ROWS * (copies + 1)
    start = time.perf_counter()
    scores = verilog_tests([r["prompt"] for r in rows], completions,
                           testbench=[r["testbench"] for r in rows],
                           top_module=[r["top_module"] for r in rows],
                           workers=workers, isolation=isolation)
    elapsed = time.perf_counter() - start
    assert scores[:len(ROWS) * copies] == [1.0] * (len(ROWS) * copies), scores
    return len(completions) / elapsed, len(completions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=1)
    args = parser.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    modes = ["off"] + (["required"] if probe_isolation().mode == "namespaces" else [])
    rates: dict[tuple[str, int], list[float]] = {}
    count = 0
    rate(modes[-1], 1, 1)  # warm-up: page cache, the probe
    for _ in range(args.repeats):
        for mode in modes:
            for workers in args.workers:
                value, count = rate(mode, workers, args.copies)
                rates.setdefault((mode, workers), []).append(value)
    names = {"off": "limits (no namespaces)", "required": "namespaces (bwrap)"}
    lines = [
        "# verilog_tests throughput: completions scored per second",
        "",
        f"CPU: {cpu_model()}, {os.cpu_count()} logical cores (shared machine, 1-minute load "
        f"{load:.1f} at the start); Linux "
        f"{platform.release()}; {subprocess.run(['iverilog', '-V'], capture_output=True, text=True).stdout.splitlines()[0]}.",
        f"Command: `python benchmarks/code_sandbox.py --repeats {args.repeats} --copies "
        f"{args.copies}`.",
        f"Each run scores {count} completions: the {len(ROWS)} example references "
        f"({args.copies}x, each compiles and passes) and {len(ROWS)} that do not compile. "
        f"Median of {args.repeats} repeats, interleaved; min-max in brackets.",
        f"This machine's isolation: {probe_isolation().mode}"
        + (f" ({probe_isolation().reason})" if probe_isolation().reason else "") + ".",
        "",
        "| isolation | " + " | ".join(f"{w} worker{'s' * (w > 1)}" for w in args.workers) + " |",
        "|---|" + "---|" * len(args.workers),
    ]
    for mode in modes:
        cells = [rates[(mode, w)] for w in args.workers]
        lines.append(f"| {names[mode]} | " + " | ".join(
            f"{statistics.median(c):.1f} ({min(c):.1f}-{max(c):.1f})" for c in cells) + " |")
    text = "\n".join(lines) + "\n"
    out = ROOT / "benchmarks" / "results" / "code_sandbox.md"
    out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()

"""`mogrpo report RUN_DIR [--out FILE] [--window N]`: a run as one Markdown page."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="a Markdown report of a run: evals, rewards, KL, alerts, speed",
        description="Summarise a run directory (finished, running or crashed) as Markdown: "
        "setup, greedy evals and the Pareto front, reward/KL/β per task at the start and the "
        "end, health alerts, β and curriculum changes, speed and memory.")
    parser.add_argument("run_dir", type=Path, help="the run directory (output.dir)")
    parser.add_argument("--out", type=Path, default=None, help="also write the report here")
    parser.add_argument("--window", type=int, default=10,
                        help="steps averaged at the start and the end (default 10)")
    parser.set_defaults(handler=cmd_report)
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    from mogrpo.eval.report import ReportError, build_report

    if args.window < 1:
        raise ReportError(f"--window {args.window} must be >= 1")
    text = build_report(args.run_dir, args.window)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")
    print(text, end="")
    return 0

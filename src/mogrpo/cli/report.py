"""`mogrpo report RUN_DIR [--out FILE] [--html] [--no-charts] [--window N]`: a run as one
Markdown page, with charts beside it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "report", help="a Markdown report of a run, with charts: evals, rewards, KL, alerts",
        description="Summarise a run directory (finished, running or crashed) as Markdown: "
        "setup, greedy evals and the Pareto front, reward/KL/β per task at the start and the "
        "end, health alerts, β and curriculum changes, speed and memory. Writes it to "
        "RUN_DIR/report.md (or --out) and prints it; with matplotlib (pip install "
        "'mogrpo[charts]') also draws charts/*.png beside it: reward per task and objective, "
        "KL per task with its band, β, completion length and truncation, eval scores, the "
        "Pareto front.")
    parser.add_argument("run_dir", type=Path, help="the run directory (output.dir)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write the report (default RUN_DIR/report.md)")
    parser.add_argument("--html", action="store_true", help="also write report.html beside "
                        "the report: one self-contained page, charts inlined")
    parser.add_argument("--no-charts", action="store_true", help="do not draw charts")
    parser.add_argument("--window", type=int, default=10,
                        help="steps averaged at the start and the end (default 10)")
    parser.set_defaults(handler=cmd_report)
    return parser


def cmd_report(args: argparse.Namespace) -> int:
    from mogrpo.eval.report import write_report

    text, out = write_report(args.run_dir, args.out, args.window, charts=not args.no_charts)
    print(text, end="")
    if args.html:
        from mogrpo.eval.report_html import write_html

        page = write_html(text, out.parent, out.with_suffix(".html"),
                          f"Run report: {Path(args.run_dir).name}")
        print(f"html: {page}")
    return 0

"""`mogrpo data check FILE`: validate a data file, or every task file of a run config."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mogrpo.cli.args import add_overrides


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    data = subparsers.add_parser("data", help="check data files",
                                 description="Check data files.")
    sub = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")
    check = sub.add_parser(
        "check", help="validate a data file (or a config's task files) and summarise it",
        description="Read FILE with the rules `mogrpo train` and `mogrpo predict` use, list "
        "every problem (file, row, column, value, fix) and every value mogrpo would repair, and "
        "summarise: rows, usable rows, the answer letters' distribution, prompt lengths (in "
        "tokens with --tokenizer). FILE may be a run config (.yaml): then every task's data "
        "and eval_data are checked with that task's settings. Exit status 0: no problem found; "
        "3: a problem was found; 2: a usage or config error.")
    check.add_argument("file", type=Path, help="a JSONL/JSON/CSV/TSV data file, or a run config")
    check.add_argument("--format", default="auto",
                       help="data file: auto, prompt, chat or multiple_choice (default auto)")
    check.add_argument("--template", default=None, help="data file: the prompt_template")
    check.add_argument("--drop-incomplete", action="store_true",
                       help="data file: count rows with empty fields as dropped, not as problems")
    check.add_argument("--no-answer", action="store_true",
                       help="data file: multiple-choice rows need no correct_answer (a test set)")
    check.add_argument("--strict", action="store_true",
                       help="values mogrpo would repair (answer `b` read as `B`) are problems")
    check.add_argument("--tokenizer", default=None,
                       help="count prompt lengths in tokens of this tokenizer (directory or hub "
                       "id); default: characters")
    check.add_argument("--limit", type=int, default=50,
                       help="problems listed per file (default 50; 0 = all)")
    add_overrides(check)
    check.set_defaults(handler=cmd_data_check)
    return data


def cmd_data_check(args: argparse.Namespace) -> int:
    from mogrpo.data.check import cmd_data

    return cmd_data(args)

"""The `mogrpo` command line: one entry point, one module per command group.

Every command module has `add_parser(subparsers)`, which adds its command (with a `help`
line, a `description` and `--set` where it reads a config) and sets `handler`, a function
`(args) -> exit status` that imports what it needs only when it runs, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys

from mogrpo import __version__
from mogrpo.cli import checkpoints, config, demo, doctor, predict, report, serve, train
from mogrpo.cli.console import setup_logging
from mogrpo.errors import MogrpoError
from mogrpo.memory import cli as memory

EPILOG = """examples:
  mogrpo demo                                   build a tiny model and train it end to end
  mogrpo train run.yaml --set rollout.temperature=0.9
  mogrpo config show run.yaml --set train.max_steps=10
  MOGRPO_TRAIN__LEARNING_RATE=5e-6 mogrpo train run.yaml

priority of values: --set > environment (MOGRPO_SECTION__KEY) > config file > defaults
"""

COMMANDS = (train, checkpoints, doctor, memory, demo, serve, report, predict, config)
"""The command groups, in the order `mogrpo --help` lists them."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mogrpo",
        description="Multi-objective GRPO post-training for causal language models.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mogrpo {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:  # no command, or a group without its subcommand: that level's help
        parser.parse_args([*(sys.argv[1:] if argv is None else argv), "--help"])
        return 2
    setup_logging()
    try:
        return handler(args)
    except MogrpoError as err:
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `mogrpo config fields | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0

"""The `mogrpo` command line: one entry point, one module per command group.

Every command module has `add_parser(subparsers)`, which adds its command (with a `help`
line, a `description` and `--set` where it reads a config) and sets `handler`, a function
`(args) -> exit status` that imports what it needs only when it runs, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
import traceback

from mogrpo.cli import (
    checkpoints,
    config,
    data,
    demo,
    doctor,
    plan,
    predict,
    report,
    serve,
    train,
    vllm_server,
)
from mogrpo.cli.console import setup_logging
from mogrpo.errors import ExitCode, MogrpoError
from mogrpo.memory import cli as memory
from mogrpo.version import __version__

EPILOG = """examples:
  mogrpo demo                                   build a tiny model and train it end to end
  mogrpo train run.yaml --set rollout.temperature=0.9
  mogrpo config show run.yaml --set train.max_steps=10
  MOGRPO_TRAIN__LEARNING_RATE=5e-6 mogrpo train run.yaml

priority of values: --set > environment (MOGRPO_SECTION__KEY) > config file > defaults

exit status: 0 ok; 1 internal error (a bug: traceback printed); 2 usage, config or data error;
3 a check found a problem (doctor, data check, checkpoints, memory, plan, a health stop); 130 Ctrl-C
"""

COMMANDS = (train, checkpoints, doctor, memory, plan, demo, serve, vllm_server, report, data, predict,
            config)
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
        try:
            parser.parse_args([*(sys.argv[1:] if argv is None else argv), "--help"])
        except SystemExit:
            pass
        return ExitCode.USAGE
    setup_logging()
    try:
        return handler(args)
    except MogrpoError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `mogrpo config fields | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except Exception:  # noqa: BLE001 - a bug: keep the traceback for the report, exit 1
        traceback.print_exc()
        print("internal error: this is a bug in mogrpo or in code it called (a reward "
              "function?); the traceback above says where", file=sys.stderr)
        return ExitCode.INTERNAL

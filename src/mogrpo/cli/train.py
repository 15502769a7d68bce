"""`mogrpo train CONFIG [--nproc N] [--resume auto|PATH] [--allow-config-change] [--set K=V ...]`."""

from __future__ import annotations

import argparse
from typing import Any

from mogrpo.cli.args import add_config, add_overrides
from mogrpo.cli.launch import check_nproc, launch
from mogrpo.config.processes import check_processes


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "train", help="run SFT warm-up (optional) and GRPO from a YAML config",
        description="Validate the config, read every task, load the model, then run the "
        "optional SFT warm-up, GRPO, and a greedy eval before and after. Writes config.yaml, "
        "metrics.jsonl, eval.jsonl, summary.json and the final model to output.dir.",
    )
    add_config(parser)
    add_overrides(parser)
    parser.add_argument(
        "--resume", metavar="auto|PATH",
        help="continue the run in output.dir: `auto` = the newest checkpoint that verifies "
        "(corrupt or incomplete ones are reported and skipped), or a checkpoint directory",
    )
    parser.add_argument(
        "--allow-config-change", action="store_true",
        help="resume even though settings that change the training math differ from the "
        "checkpoint's (the diff is logged and recorded in config_changes.jsonl)",
    )
    parser.add_argument(
        "--nproc", type=int, metavar="N",
        help="train with N processes on this machine, one per GPU (default 1): relaunches "
        "this command under torchrun (--standalone --nproc-per-node N); several machines: "
        "run torchrun yourself (README, Scale out)",
    )
    parser.add_argument("--strict", action="store_true",
                        help="refuse data values mogrpo would repair (answer `b` read as `B`, "
                        "stripped whitespace) instead of warning: every task's `strict: true`")
    parser.set_defaults(handler=cmd_train)
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from mogrpo.cli.console import setup_logging
    from mogrpo.config import load_config

    if args.nproc is not None:
        check_nproc(args.nproc)
    config, _ = load_config(args.config, args.overrides)  # before torch: errors in a second
    for task in config.tasks.values() if args.strict else ():
        task.strict = True
    setup_logging(config.logging.level)
    if (args.nproc or 1) > 1:
        check_processes(config, args.nproc)  # what the processes would refuse: before launching
        return launch(args, args.nproc)
    from mogrpo.trainer.run import run_training

    run_training(config, resume=args.resume, allow_config_change=args.allow_config_change)
    return 0

"""`mogrpo plan CONFIG --gpu SIZE`: the memory plan, whether it fits, and the first change that
makes it fit."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from mogrpo.errors import ConfigError, ExitCode


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "plan", help="will a run fit a GPU, and if not, the first change that makes it",
        description="Plan a run's GPU memory from the model's config.json (no weights are "
        "loaded, nothing is downloaded): the estimate term by term, whether it fits --gpu, "
        "and when it does not, the first rung of `mogrpo memory`'s ladder (cheapest first, "
        "cumulative) after which it fits, with the --set flags of every change up to it. "
        "Exit status 3 when it does not fit as configured.")
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument("--gpu", default=None, metavar="SIZE",
                        help="one GPU's memory: 24GB = 24e9 bytes, 24GiB / 24g / 24 = 24 GiB "
                        "(default: the visible GPU's)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes training together, one per GPU (default 1): the plan "
                        "is per process")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)")
    parser.set_defaults(handler=cmd_plan)
    return parser


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan and its verdict; exit 3 when the run as configured does not fit."""
    from mogrpo.config import load_config
    from mogrpo.memory.cli import decimal_hint, gpu_bytes
    from mogrpo.memory.estimate import GIB
    from mogrpo.memory.plan import plan_run

    config, _ = load_config(args.config, args.overrides, machine=False)
    gpu = gpu_bytes(args.gpu)
    if gpu is None:
        raise ConfigError("no GPU visible here: pass --gpu 24GB (or 24GiB) to plan for one")
    plan = plan_run(config, gpu, args.nproc)
    each = " per process" if args.nproc > 1 else ""
    print(plan.estimate.table())
    total = plan.estimate.total
    if plan.fits:
        print(f"\nfits: {total / GIB:.1f} of {gpu / GIB:.1f} GiB{each}")
        return ExitCode.OK
    print(f"\ndoes not fit: {total / GIB:.1f} GiB{each} > {gpu / GIB:.1f} GiB"
          f"{decimal_hint(args.gpu)}")
    first = plan.first_fit
    if first is None:
        wider = plan.scale_out()
        print("no change on the ladder makes it fit" + (
            f"; on more GPUs: {wider.change} → {wider.total / GIB:.1f} GiB per process\n  "
            + " ".join(wider.arguments) if wider else "; use a smaller model or shorter prompts"))
        return ExitCode.FOUND_PROBLEM
    rung = plan.steps.index(first) + 1
    before = f" after {rung - 1} cheaper change{'s' if rung > 2 else ''}" if rung > 1 else ""
    print(f"first fit: rung {rung}{before}: {first.change} → {first.total / GIB:.1f} GiB{each}\n"
          f"  cost: {first.cost}\n"
          f"  {' '.join(arg for o in plan.overrides(first) for arg in ('--set', o))}")
    return ExitCode.FOUND_PROBLEM

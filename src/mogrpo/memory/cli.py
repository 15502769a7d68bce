"""`mogrpo memory CONFIG [--gpu-memory SIZE]`: the breakdown table and, over budget, the ladder."""

from __future__ import annotations

import argparse
import logging
import re
import sys
from pathlib import Path
from typing import Any

from mogrpo.config import load_config
from mogrpo.errors import ConfigError, ExitCode, MogrpoError
from mogrpo.memory.estimate import GIB
from mogrpo.memory.ladder import Step
from mogrpo.memory.plan import plan_run

log = logging.getLogger(__name__)

_UNITS = {"": GIB, "b": 1, "k": 2**10, "m": 2**20, "g": GIB, "t": 2**40}


def parse_size(text: str | int) -> int:
    """`24GB` = 24·10⁹ bytes; `24GiB`, `24G`, `24g` and a bare `24` = 24·2³⁰ bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(([kmgt])(i?)(b?)|b)?\s*", str(text), re.I)
    if not match:
        raise ConfigError(f"memory size {text!r} is not a size; write e.g. 24GB, 24GiB, 16g or "
                          "40 (GiB)")
    number, unit = float(match[1]), (match[3] or match[2] or "").lower()
    decimal = bool(match[3]) and not match[4] and bool(match[5])  # "GB", not "GiB" / "G"
    scale = 1000 ** (" kmgt".index(unit)) if decimal else _UNITS[unit]
    if int(number * scale) < 1:  # no GPU holds nothing: every plan and rung would "not fit"
        raise ConfigError(f"memory size {text!r} is zero; write the GPU's memory, e.g. 24GB, "
                          "24GiB, 16g or 40 (GiB)")
    return int(number * scale)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `memory CONFIG [--gpu-memory SIZE] [--set K=V ...]` to a CLI's subparsers."""
    parser = subparsers.add_parser(
        "memory", help="estimate a run's peak GPU memory and how to make it fit",
        description="Estimate the peak GPU memory of a run from the model's config.json (no "
        "weights are loaded, nothing is downloaded) and, when it exceeds --gpu-memory, list "
        "config changes that bring it under, cheapest first. Exit status 3 when it does not fit.")
    parser.add_argument("config", type=Path, help="YAML config file")
    parser.add_argument("--gpu-memory", default=None, metavar="SIZE",
                        help="GPU memory: 24GB = 24e9 bytes, 24GiB / 24g / 24 = 24 GiB "
                        "(default: the visible GPU's, if any)")
    parser.add_argument("--nproc", type=int, default=1, metavar="N",
                        help="processes training together, one per GPU (default 1): the "
                        "estimate is per process, under distributed.strategy (auto = ddp)")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="SECTION.KEY=VALUE", help="override one config value (repeatable)")
    parser.set_defaults(handler=cmd_memory)
    return parser


def cmd_memory(args: argparse.Namespace) -> int:
    """The `mogrpo memory` command: print the table and, when over budget, the ladder."""
    # before torch: errors in a second; the run may be meant for another machine (a GPU's)
    config, _ = load_config(args.config, args.overrides, machine=False)
    plan = plan_run(config, gpu_bytes(args.gpu_memory), args.nproc)
    print(plan.estimate.table())
    gpu, total = plan.gpu, plan.estimate.total
    if gpu is None:
        print("\nno GPU given or visible: pass --gpu-memory 24GB to check the fit")
        return 0
    each = " per process" if args.nproc > 1 else ""
    if plan.fits:
        print(f"\nfits: {total / GIB:.1f} of {gpu / GIB:.1f} GiB{each}")
        return 0
    print(f"\ndoes not fit: {total / GIB:.1f} GiB{each} > {gpu / GIB:.1f} GiB"
          f"{decimal_hint(args.gpu_memory)}. Changes, cumulative, cheapest first:")
    _print_steps(plan.steps, each)
    wider = plan.scale_out()
    if wider:
        print("or, at no cost in quality, on more GPUs (one process each):")
        _print_steps([wider], " per process")
    if not plan.first_fit and not wider:
        print("  still too big: use a smaller model or shorter prompts")
    return ExitCode.FOUND_PROBLEM


def gpu_bytes(size: str | None) -> int | None:
    """`--gpu-memory`'s bytes; without it the visible GPU's, else None."""
    if size is not None:
        return parse_size(size)
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def decimal_hint(size: str | None) -> str:
    """A note when a size was written in decimal units (`40GB` is 37.3 GiB)."""
    decimal = re.search(r"[kmgt]b\s*$", size or "", re.I)
    return f" ({size} = decimal units; write GiB for binary)" if decimal else ""


def _print_steps(steps: list[Step], each: str) -> None:
    for n, step in enumerate(steps, 1):
        print(f"  {n}. {step.change} — saves {step.saving / GIB:.1f} GiB → {step.total / GIB:.1f} "
              f"GiB{each}\n     cost: {step.cost}\n     {' '.join(step.arguments)}")


def main(argv: list[str] | None = None) -> int:
    """Run `memory` as a standalone command (what `mogrpo memory` does)."""
    parser = argparse.ArgumentParser(prog="mogrpo")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["memory", *(sys.argv[1:] if argv is None else argv)])
    try:
        return cmd_memory(args)
    except MogrpoError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code

"""`mogrpo checkpoints RUN_DIR`: a run's checkpoints with step, scores and integrity."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "checkpoints", help="list a run's checkpoints with step, scores and integrity",
        description="List the checkpoints of a run directory, newest first: step, eval "
        "scores, and status (ok / corrupt / incomplete, with what is wrong).",
    )
    parser.add_argument("run_dir", type=Path, help="the run's output.dir")
    parser.set_defaults(handler=cmd_checkpoints)
    return parser


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from mogrpo.checkpoint.store import (
        FORMAT_SHARDED,
        MANIFEST,
        STARTED,
        STATE,
        list_checkpoints,
    )
    from mogrpo.errors import ExitCode, MogrpoError

    found = list_checkpoints(args.run_dir)
    if not args.run_dir.is_dir():
        raise MogrpoError(f"{args.run_dir} is not a directory; give a run's output.dir")
    if not found:
        started = any((args.run_dir / name).exists() for name in STARTED)
        raise MogrpoError(
            f"no checkpoints in {args.run_dir / 'checkpoints'}; " + (
                "the run stopped before its first one (written every output.save_every steps "
                "and at the end)" if started else "this is not a run's output.dir"))
    for status in found:
        scores = ""
        try:
            state = json.loads((status.path / STATE).read_text(encoding="utf-8"))
            last = list(state["quick_eval"]["scores"].values())[-1]
            scores = "  ".join(f"{task} {score:.3f}" for task, score in last.items())
        except (OSError, KeyError, IndexError, ValueError):
            pass
        shards = ""
        try:
            manifest = json.loads((status.path / MANIFEST).read_text(encoding="utf-8"))
            if manifest.get("format") == FORMAT_SHARDED:
                shards = f"  [{manifest['world_size']} processes, {manifest['strategy']}]"
        except (OSError, KeyError, ValueError):
            pass
        print(f"{status.path.name}  step {status.step:>6}  {status.status:<10}  {scores}{shards}")
        for problem in status.problems:
            print(f"    {problem}")
    return 0 if all(s.ok for s in found) else ExitCode.FOUND_PROBLEM

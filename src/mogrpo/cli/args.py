"""Arguments several commands share, spelt the same way everywhere."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_config(parser: argparse.ArgumentParser) -> None:
    """The run's YAML config as the first positional argument."""
    parser.add_argument("config", type=Path, help="YAML config file")


def add_overrides(parser: argparse.ArgumentParser) -> None:
    """`--set SECTION.KEY=VALUE`, repeatable, into `args.overrides`."""
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set rollout.temperature=0.9",
    )

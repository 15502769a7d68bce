"""`mogrpo config show CONFIG` and `mogrpo config fields`: inspect configs."""

from __future__ import annotations

import argparse
import json
from typing import Any

from mogrpo.cli.args import add_config, add_overrides


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("config", help="inspect configs", description="Inspect configs.")
    commands = parser.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = commands.add_parser(
        "show", help="print the resolved config and where each value came from",
        description="Resolve defaults < file < environment < --set, validate, and print every "
        "value with its source. Exits non-zero with the problem when the config is invalid.",
    )
    add_config(show)
    add_overrides(show)
    show.set_defaults(handler=cmd_show)
    fields = commands.add_parser(
        "fields", help="list every config field with its type, default and meaning",
        description="List every config field with its type, default and one-line meaning.",
    )
    fields.set_defaults(handler=cmd_fields)
    return parser


def cmd_show(args: argparse.Namespace) -> int:
    from mogrpo.config import describe, load_config

    config, origin = load_config(args.config, args.overrides, machine=False)
    rows = describe(config, origin)
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        print(f"{key:<{width}}  {shown:<24}  {source}")
    return 0


def cmd_fields(args: argparse.Namespace) -> int:
    from mogrpo.config import field_reference

    print(field_reference())
    return 0

"""Copy a wheel without some of its files, its RECORD rewritten to match.

    python benchmarks/slim_wheel.py WHEEL OUT_DIR --drop GLOB [--keep GLOB ...]

A file whose path in the wheel matches a `--drop` glob is left out unless it also matches a
`--keep` glob. The copy keeps the wheel's name (its tags still hold) and installs with pip like
the original. Used by `benchmarks/gpu_wheels.sh` to carry bitsandbytes to a GPU machine with
only the native libraries that machine loads.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import sys
import zipfile
from pathlib import Path


def slim(wheel: Path, out_dir: Path, drop: list[str], keep: list[str]) -> tuple[Path, list[str]]:
    """Write OUT_DIR/<wheel's name> without the dropped files; returns it and what was dropped."""
    def dropped(name: str) -> bool:
        return (any(fnmatch.fnmatchcase(name, g) for g in drop)
                and not any(fnmatch.fnmatchcase(name, g) for g in keep))

    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name
    if target.resolve() == wheel.resolve():
        raise SystemExit(f"slim_wheel: OUT_DIR holds {wheel.name} already; name another folder")
    gone: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if dropped(info.filename):
                gone.append(info.filename)
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [row for row in csv.reader(io.StringIO(data.decode("utf-8")))
                        if row and not dropped(row[0])]
                text = io.StringIO()
                csv.writer(text, lineterminator="\n").writerows(rows)
                data = text.getvalue().encode("utf-8")
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return target, gone


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--drop", action="append", required=True,
                        help="glob over paths in the wheel to leave out (repeatable)")
    parser.add_argument("--keep", action="append", default=[],
                        help="glob of paths kept even where a --drop glob matches (repeatable)")
    args = parser.parse_args(argv)
    if not args.wheel.is_file():
        print(f"slim_wheel: no wheel at {args.wheel}", file=sys.stderr)
        return 1
    target, gone = slim(args.wheel, args.out_dir, args.drop, args.keep)
    print(f"{target.name}: {args.wheel.stat().st_size / 2**20:.1f} MiB -> "
          f"{target.stat().st_size / 2**20:.1f} MiB, {len(gone)} files left out")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The documentation site (MkDocs, Material theme, from docs/): it builds with `--strict`, so a
link to a missing page or anchor fails the suite, and every page is reachable from the nav."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def nav_pages(nav: list) -> list[str]:
    pages: list[str] = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        pages.extend(nav_pages(value) if isinstance(value, list) else [value])
    return pages


def test_every_docs_page_is_in_the_nav_and_every_nav_entry_exists():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    listed = nav_pages(config["nav"])
    present = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert sorted(set(listed)) == present, (
        "mkdocs.yml's nav and docs/ differ: add each new page to the nav "
        f"(missing from nav: {sorted(set(present) - set(listed))}; "
        f"in nav but not in docs/: {sorted(set(listed) - set(present))})")
    assert len(listed) == len(set(listed)), "a page is listed twice in the nav"
    assert config.get("strict") is True


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None,
    reason="mkdocs and mkdocs-material are not installed: pip install -e '.[docs]' "
           "(the test extra includes them, so CI runs this)")
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
         "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "config" / "index.html").exists()


def test_the_readme_links_only_to_files_that_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links onward to the docs"
    missing = [t for t in local if not (ROOT / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_docs_commands_names_every_command_and_option():
    from mogrpo.cli.app import build_parser

    text = (DOCS / "commands.md").read_text(encoding="utf-8")

    def walk(parser: argparse.ArgumentParser, path: list[str]):
        yield " ".join(path), None
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from walk(sub, [*path, name])
            else:
                yield from ((" ".join(path), o) for o in action.option_strings
                            if o.startswith("--") and o != "--help")

    missing = [f"{command} {option or ''}".strip() for command, option in walk(build_parser(), ["mogrpo"])
               if (f"`{command}" not in text if option is None else option not in text)]
    assert not missing, f"docs/commands.md does not mention: {missing} (see each one's --help)"

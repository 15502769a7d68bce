"""The package layout: each room imports only the rooms below it (no upward imports)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mogrpo"

# Lowest first. A package may import its own layer and the layers below, never one above.
LAYERS = [
    {"__init__", "errors", "templates"},
    {"algo"},
    {"config"},
    {"data", "modeling", "rollout", "rewards", "memory", "tracking"},
    {"tasks"},
    {"eval", "checkpoint", "health"},  # health reads evals: their Pareto front
    {"train", "serve"},
    {"cli", "demo", "api"},
]
# The config's sections defined beside their feature (see mogrpo/config/__init__.py).
ALLOWED = {("config", "health.config"), ("config", "tasks.curriculum"),
           # validation's vLLM check, imported inside the function (it imports no vLLM)
           ("config", "rollout.vllm_engine")}
# The Python API (`from mogrpo import Config, train`): the root and the callable `mogrpo.train`
# package reach it on first use, inside a function.
ALLOWED_ROOMS = {("__init__", "api"), ("__init__", "train"), ("train", "api")}
ROOT_MODULES = {"__init__", "errors", "templates", "demo", "api"}


def layer_of(room: str) -> int:
    return next(i for i, rooms in enumerate(LAYERS) if room in rooms)


def imports(path: Path) -> set[str]:
    """Every `mogrpo.X...` module a file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            found |= {n for n in names if n.startswith("mogrpo.")}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("mogrpo.")}
    return found


def test_every_room_is_placed_in_a_layer():
    rooms = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir()
                                                  if (p / "__init__.py").is_file()}
    assert rooms <= set().union(*LAYERS), rooms - set().union(*LAYERS)
    assert {p.stem for p in SRC.glob("*.py")} <= ROOT_MODULES, "a loose module at the root"


def test_no_room_imports_one_above_it():
    upward = []
    for path in SRC.rglob("*.py"):
        room = path.relative_to(SRC).parts[0].removesuffix(".py")
        for module in imports(path):
            target = module.split(".")[1]
            if target not in set().union(*LAYERS):  # `from mogrpo import __version__`
                continue
            dotted = ".".join(module.split(".")[1:3])
            if layer_of(target) > layer_of(room) and (room, dotted) not in ALLOWED \
                    and (room, target) not in ALLOWED_ROOMS:
                upward.append(f"{path.relative_to(SRC)} imports {module}")
    assert not upward, "\n".join(sorted(upward))


def root_imports(path: Path) -> list[str]:
    """`from mogrpo import X` / `import mogrpo` statements in a file, as `mogrpo.X` / `mogrpo`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "mogrpo" and node.level == 0:
            found += [f"mogrpo.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name == "mogrpo"]
    return found


def test_only_the_top_layer_imports_the_package_root():
    # The root hands out `train` and `Config` (the trainer and the API) on first use, so a room
    # below the top that imports it — even for `__version__` — reaches upward through it.
    top = LAYERS[-1]
    found = [f"{path.relative_to(SRC)} imports {name}" for path in SRC.rglob("*.py")
             if path.relative_to(SRC).parts[0].removesuffix(".py") not in top | {"__init__"}
             for name in root_imports(path)]
    assert not found, "\n".join(sorted(found))


@pytest.mark.parametrize("module", ["mogrpo.health", "mogrpo.tasks.curriculum", "mogrpo.config",
                                    "mogrpo.tracking.names", "mogrpo.rewards",
                                    "mogrpo.checkpoint", "mogrpo.cli"])
def test_each_package_imports_first_in_a_fresh_interpreter(module):
    # the config's sections and the health / curriculum sections import each other's rooms
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]

"""The house's layout, read from the code's own imports (every `import` in a file: at the top,
inside a function or under TYPE_CHECKING): no import circle between files, no package that
imports one on a floor above it, and hardware code reached only through `mogrpo.kernels`."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "mogrpo"

# Lowest first. A package may import its own floor and the floors below, never one above.
FLOORS = [
    {"errors", "templates", "version", "user_loop"},
    {"algo"},  # the math: pure functions on tensors
    # kernels: code for one kind of hardware, behind mogrpo.kernels; sandbox: running code
    # written by the policy, isolated where the machine allows
    {"config", "kernels", "sandbox"},
    {"data", "modeling", "rollout", "rewards", "memory", "tracking"},
    {"tasks"},
    {"eval", "checkpoint", "health"},  # health reads evals: their Pareto front
    {"trainer", "serve"},
    {"api", "cli", "demo"},
    {"__init__"},  # the public API (`from mogrpo import Config, train`): nothing imports it
]
ROOT_MODULES = {"__init__", "errors", "templates", "version", "user_loop", "demo", "api"}


@cache
def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _resolve(name: str) -> str | None:
    """The module a dotted import names (`mogrpo.a.b.Name` -> `mogrpo.a.b`)."""
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def imports(module: str) -> frozenset[str]:
    """The modules of the package that `module` imports."""
    path = modules()[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            if base.split(".")[0] != "mogrpo":
                continue
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules() else _resolve(base))
        elif isinstance(node, ast.Import):
            found |= {_resolve(a.name) for a in node.names if a.name.split(".")[0] == "mogrpo"}
    return frozenset(found - {None, module})


def room(module: str) -> str:
    """The package (or root module) a module belongs to: `mogrpo.rollout.native` -> rollout."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def floor(name: str) -> int:
    return next(i for i, rooms in enumerate(FLOORS) if name in rooms)


def circles() -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in imports(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while not group or group[-1] != v:
                group.append(stack.pop())
                on_stack.discard(group[-1])
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(modules()):
        if module not in index:
            visit(module)
    return found


def test_every_room_is_placed_on_a_floor():
    rooms = {p.stem for p in SRC.glob("*.py")} | {p.name for p in SRC.iterdir()
                                                  if (p / "__init__.py").is_file()}
    assert rooms <= set().union(*FLOORS), rooms - set().union(*FLOORS)
    assert {p.stem for p in SRC.glob("*.py")} <= ROOT_MODULES, "a loose module at the root"


def test_no_import_circle_between_files():
    assert not circles(), "\n".join(" -> ".join(c) for c in circles())


def test_no_room_imports_one_above_it():
    upward = [f"{module} imports {target}" for module in modules() for target in imports(module)
              if floor(room(target)) > floor(room(module))]
    assert not upward, "\n".join(sorted(upward))


def test_the_math_names_no_processor_and_hardware_code_is_reached_through_kernels():
    # algo/ imports nothing of kernels/; outside kernels/ nobody imports a hardware package
    # (kernels.cpu, a CUDA one to come): they call mogrpo.kernels' functions
    wrong = [f"{module} imports {target}" for module in modules() for target in imports(module)
             if (room(module) == "algo" and room(target) == "kernels")
             or (room(module) != "kernels" and target.startswith("mogrpo.kernels."))]
    assert not wrong, "\n".join(sorted(wrong))


def test_no_package_shares_its_name_with_a_function_of_the_root():
    import mogrpo

    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").is_file()}
    assert not packages & set(mogrpo.__all__)


def test_a_circle_and_an_upward_import_are_found(tmp_path, monkeypatch):
    # the checks themselves: a fake package with both faults
    root = tmp_path / "mogrpo"
    for name, text in {"__init__.py": "", "algo/__init__.py": "",
                       "algo/a.py": "from mogrpo.algo import b\nfrom mogrpo.trainer import t\n",
                       "algo/b.py": "from . import a\n", "trainer/__init__.py": "",
                       "trainer/t.py": ""}.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "SRC", root)
    for function in (modules, imports):
        function.cache_clear()
    try:
        assert circles() == [["mogrpo.algo.a", "mogrpo.algo.b"]]
        assert imports("mogrpo.algo.a") == {"mogrpo.algo.b", "mogrpo.trainer.t"}
        assert floor(room("mogrpo.trainer.t")) > floor(room("mogrpo.algo.a"))
    finally:
        for function in (modules, imports):
            function.cache_clear()


@pytest.mark.parametrize("module", ["mogrpo.health", "mogrpo.tasks.curriculum", "mogrpo.config",
                                    "mogrpo.tracking.names", "mogrpo.rewards", "mogrpo.kernels",
                                    "mogrpo.checkpoint", "mogrpo.cli"])
def test_each_package_imports_first_in_a_fresh_interpreter(module):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent),
                                                        os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]

"""Functions at the design's size: none in `src/mogrpo` over 80 lines (its `def` line to its
last, docstring included), methods and nested functions too, unless a reason is written beside
it: a `# long: <reason>` comment on the `def` line or the line right above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "mogrpo"
MAX_LINES = 80
REASON = re.compile(r"#\s*long:\s*\S")
BLOCKS = ("body", "orelse", "finalbody", "handlers", "cases")  # fields holding statements


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int, int]]:
    """(qualified name, line of its `def`, length in lines) of each function over `limit`
    lines without a `# long: <reason>` beside it."""
    lines = source.splitlines()
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        # a def is a statement: walk the statement lists only, never into expressions
        for child in (c for field in BLOCKS for c in getattr(node, field, ())):
            name = prefix
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}."
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = child.end_lineno - child.lineno + 1
                beside = lines[max(child.lineno - 2, 0):child.lineno]  # the line above, the def
                if length > limit and not any(REASON.search(line) for line in beside):
                    found.append((name[:-1], child.lineno, length))
            visit(child, name)

    visit(ast.parse(source), "")
    return found


def test_no_function_in_src_is_over_80_lines_without_a_reason():
    over = [f"{path.relative_to(SRC.parent)}:{line} {name} ({length} lines)"
            for path in sorted(SRC.rglob("*.py"))
            for name, line, length in long_functions(path.read_text(encoding="utf-8"))]
    assert not over, (
        f"functions over {MAX_LINES} lines; split them into named helpers, or write "
        "`# long: <reason>` on the def line or the line above it:\n  " + "\n  ".join(over))


def _body(n: int, indent: str = "    ") -> str:
    return "".join(f"{indent}x = {i}\n" for i in range(n))


def test_the_check_finds_methods_and_nested_functions_and_honours_a_reason():
    source = (
        "def short():\n" + _body(3)
        + "class Model:\n    def forward(self):\n" + _body(5, " " * 8)
        + "def outer():\n    def inner():\n" + _body(5, " " * 8)
        + "# long: one table, read top to bottom\ndef table():\n" + _body(6)
        + "def kernel():  # long: unrolled on purpose\n" + _body(6)
        + "def unexplained():  # long:\n" + _body(6)
    )
    assert long_functions(source, limit=5) == [
        ("Model.forward", 6, 6), ("outer", 12, 7), ("outer.inner", 13, 6),
        ("unexplained", 34, 7),
    ]

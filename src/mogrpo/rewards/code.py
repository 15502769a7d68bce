"""`fn: code_tests`: run a completion's Python code against the row's tests in a subprocess.

Each completion runs in the sandbox of `mogrpo.sandbox`: its own temporary directory,
a clean environment, `python -I` (no user site, no PYTHON* variables), CPU-time, memory,
file-size and process limits, a wall-clock timeout after which everything it started is killed,
and, where the machine allows (`sandbox.isolation`), no network and no view of the user's
files. The result line carries a per-run nonce sent over stdin, so code that prints a fake
result is not believed, and `passed` is capped at the number of test statements counted outside.

The row's `tests` column holds Python statements, typically asserts. The score is the fraction
of test statements that pass (`partial: true`, the default) or 1.0 only when all pass. A row
without tests scores None (left out of this objective); code that does not parse, raises at
import, exceeds a limit or times out scores 0.0.
"""

from __future__ import annotations

import ast
import json
import os
import re
import secrets
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.errors import RewardError
from mogrpo.rewards.builtin import completion_text, per_completion
from mogrpo.sandbox import (
    Isolation,
    SandboxLimits,
    check_isolation_setting,
    resolve_isolation,
    run_sandboxed,
)

__all__ = ["RunResult", "SandboxLimits", "code_tests", "extract_code", "run_tests"]

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.S)
_MARK = "__MOGRPO_RESULT__"
DEFAULT_LIMITS = SandboxLimits()

# Runs inside the sandbox: the candidate code, then each top-level test statement on its own,
# so one failing assert does not hide the others. Prints one marked JSON line.
_RUNNER = f"""
import ast, json, sys
nonce = sys.stdin.readline().strip()  # marks the genuine result line; never on disk or argv
sys.stdin.close()
code, tests = open("candidate.py", encoding="utf-8").read(), open("tests.py", encoding="utf-8").read()
statements = ast.parse(tests).body
namespace = {{"__name__": "__main__"}}
passed = 0
try:
    exec(compile(code, "candidate.py", "exec"), namespace)
except BaseException as err:
    print("{_MARK}" + nonce + json.dumps({{"passed": 0, "total": len(statements), "error": type(err).__name__}}))
    sys.exit(0)
for statement in statements:
    try:
        exec(compile(ast.Module([statement], []), "tests.py", "exec"), namespace)
        passed += 1
    except BaseException:
        pass
print("{_MARK}" + nonce + json.dumps({{"passed": passed, "total": len(statements)}}))
"""


@dataclass(frozen=True)
class RunResult:
    """How one completion did: tests passed of total, or why nothing ran."""

    passed: int
    total: int
    status: str
    """`ok`, `syntax_error`, `error:<Exception>`, `timeout` or `crashed` (a limit, a signal)."""


def extract_code(text: str, language: str = "python") -> str:
    """The last fenced block tagged `language` (or untagged); else the whole text."""
    blocks = [(tag.lower(), body) for tag, body in _FENCE.findall(text)]
    wanted = [body for tag, body in blocks if tag in ("", language, language[:2])]
    return wanted[-1] if wanted else text


def run_tests(code: str, tests: str, limits: SandboxLimits = DEFAULT_LIMITS,
              isolation: Isolation | None = None) -> RunResult:
    """Run `code` then each statement of `tests` in the sandbox (`isolation`: default `auto`)."""
    try:
        compile(code, "candidate.py", "exec")
    except (SyntaxError, ValueError):
        return RunResult(0, _count(tests), "syntax_error")
    isolation = isolation or resolve_isolation("auto")
    total = _count(tests)
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="mogrpo-code-") as tmp:
        Path(tmp, "candidate.py").write_text(code, encoding="utf-8")
        Path(tmp, "tests.py").write_text(tests, encoding="utf-8")
        Path(tmp, "runner.py").write_text(_RUNNER, encoding="utf-8")
        outcome = run_sandboxed([sys.executable, "-I", "runner.py"], Path(tmp), limits,
                                isolation, stdin=nonce + "\n")
    if outcome.timed_out:
        return RunResult(0, total, "timeout")
    mark = _MARK + nonce
    for line in reversed(outcome.stdout.splitlines()):
        if line.startswith(mark):
            found = json.loads(line[len(mark):])
            status = f"error:{found['error']}" if "error" in found else "ok"
            return RunResult(min(int(found["passed"]), total), total, status)
    return RunResult(0, total, "crashed")


def _count(tests: str) -> int:
    try:
        return len(ast.parse(tests).body)
    except SyntaxError:
        return 0


def code_options(language: Any = "python", isolation: Any = "auto", **_: Any) -> None:
    """`code_tests`' options that hold for every row (also checked before training)."""
    if language != "python":
        raise RewardError(f"code_tests runs Python only, got language {language!r}")
    check_isolation_setting(isolation)


def code_tests(
    prompts: list,
    completions: list,
    tests: Any = None,
    partial: bool = True,
    language: str = "python",
    timeout: float = 5.0,
    memory_mb: int = 1024,
    workers: int | None = None,
    isolation: str = "auto",
    **_: Any,
) -> list[float | None]:
    """Fraction of the row's test statements the completion's code passes (see the module)."""
    if tests is None:
        raise RewardError("code_tests needs a 'tests' column (Python statements, e.g. asserts) "
                          "in the task's data")
    code_options(language=language, isolation=isolation)
    limits = SandboxLimits(timeout=timeout, memory_mb=memory_mb)
    contained = resolve_isolation(isolation)
    row_tests: Sequence[Any] = per_completion(tests, len(completions), "tests")
    for test in row_tests:
        if isinstance(test, str) and test.strip() and _count(test) == 0:
            raise RewardError(f"code_tests: a row's tests do not parse as Python: {test[:80]!r}")

    def one(pair: tuple[Any, Any]) -> float | None:
        completion, test = pair
        if not isinstance(test, str) or not test.strip():
            return None
        result = run_tests(extract_code(completion_text(completion), language), test, limits,
                           contained)
        if result.total == 0:
            return None
        if partial:
            return result.passed / result.total
        return 1.0 if result.passed == result.total else 0.0

    pool = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=pool) as executor:
        return list(executor.map(one, zip(completions, row_tests, strict=True)))

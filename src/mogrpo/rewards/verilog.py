"""`fn: verilog_tests`: compile a completion's Verilog with the row's testbench and simulate it.

The completion's last fenced ```verilog (or ```systemverilog, ```sv, untagged) block, else the
whole completion, is compiled with the row's `testbench` by Icarus Verilog (`iverilog -g2012`)
and simulated (`vvp`), both in the sandbox of `mogrpo.sandbox`.

The testbench reports with the macro `` `MOGRPO_RESULT(passed, total) ``, which mogrpo defines
at the top of the testbench file for each run: it prints a line carrying a per-run nonce that
the completion cannot see (it is compiled before that definition, and may not read files), so a
completion that prints its own result line is not believed. A completion may not use what
could reach around the testbench: hierarchical names (`tb.errors`), `$root`, `$system`, file
and dump tasks, plusargs or `` `include `` (status `forbidden:...`, score 0).

Scores: 0.0 when the code is forbidden or does not compile; otherwise `compile_bonus` plus
(1 - `compile_bonus`) times the fraction of checks passed (`partial: true`, the default) or
times 1 only when all pass. A simulation that times out, crashes or never reports passes no
check. A row without a testbench scores None.
"""

from __future__ import annotations

import os
import re
import secrets
import shlex
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.config.machine import iverilog_missing
from mogrpo.errors import RewardError
from mogrpo.rewards.builtin import completion_text, per_completion
from mogrpo.sandbox import (
    Isolation,
    SandboxLimits,
    check_isolation_setting,
    resolve_isolation,
    run_sandboxed,
)

RESULT_MACRO = "MOGRPO_RESULT"
_MARK = "__MOGRPO_RESULT__"
DEFAULT_LIMITS = SandboxLimits(timeout=10.0)
_FENCE = re.compile(r"```[ \t]*([\w+-]*)[ \t]*\n(.*?)```", re.S)
_TAGS = ("", "verilog", "systemverilog", "sv", "v")
_COMMENT_OR_STRING = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"', re.S)
_MODULE = re.compile(r"\bmodule\s+([A-Za-z_][\w$]*)")
_FORBIDDEN = (
    ("$system", re.compile(r"\$system\b")),
    ("file access", re.compile(
        r"\$(fopen|fclose|fdisplay|fwrite|fstrobe|fmonitor|fgetc|fgets|fscanf|fread|fseek|"
        r"ftell|frewind|rewind|fflush|feof|ferror|ungetc|sscanf|readmem|writemem|sreadmem)"
        r"[bho]?\b")),
    ("dump", re.compile(r"\$dump\w*")),
    ("plusargs", re.compile(r"\$(value|test)\$plusargs\b")),
    ("$root", re.compile(r"\$root\b")),
    ("`include", re.compile(r"`include\b")),
    ("hierarchical name", re.compile(r"(?<![\w$.'\\])[A-Za-z_][\w$]*\s*\.\s*[A-Za-z_]")),
)


@dataclass(frozen=True)
class SimResult:
    """How one completion did: checks passed of total, whether it compiled, and why."""

    passed: int
    total: int
    compiled: bool
    status: str
    """`ok`, `forbidden:<what>`, `missing_module`, `compile_error`, `timeout` or `no_result`
    (the simulation crashed, hit a limit or ended before the testbench reported)."""


def extract_verilog(text: str) -> str:
    """The last fenced block tagged verilog, systemverilog, sv or v (or untagged); else all."""
    blocks = [body for tag, body in _FENCE.findall(text) if tag.lower() in _TAGS]
    return blocks[-1] if blocks else text


def _code_only(source: str) -> str:
    """`source` without comments and with empty strings: what the compiler sees as code."""
    return _COMMENT_OR_STRING.sub(lambda m: '""' if m.group().startswith('"') else " ", source)


def forbidden_construct(source: str) -> str | None:
    """The first construct of `source` a completion may not use (see the module), or None."""
    code = _code_only(source)
    for name, pattern in _FORBIDDEN:
        if pattern.search(code):
            return name
    return None


def _testbench_file(testbench: str, nonce: str) -> str:
    """The testbench after mogrpo's result macro; `line keeps the user's line numbers."""
    return (f'`define {RESULT_MACRO}(passed, total) '
            f'$display("{_MARK}{nonce} %0d %0d", passed, total)\n'
            f'`line 1 "testbench.v" 0\n{testbench}')


def simulate(design: str, testbench: str, limits: SandboxLimits = DEFAULT_LIMITS,
             isolation: Isolation | None = None, top_module: str | None = None) -> SimResult:
    """Compile `design` with `testbench` and run the simulation in the sandbox."""
    forbidden = forbidden_construct(design)
    if forbidden:
        return SimResult(0, 0, False, f"forbidden:{forbidden}")
    if top_module and top_module not in _MODULE.findall(_code_only(design)):
        return SimResult(0, 0, False, "missing_module")
    problem = iverilog_missing()
    if problem:
        raise RewardError(problem)
    isolation = isolation or resolve_isolation("auto")
    iverilog, vvp = (os.path.realpath(shutil.which(t) or t) for t in ("iverilog", "vvp"))
    roots = " ".join(f"-s {shlex.quote(name)}" for name in _MODULE.findall(_code_only(testbench)))
    nonce = secrets.token_hex(16)
    # Compile, mark success, simulate: one sandboxed run (one start-up) for both steps.
    script = (f"{shlex.quote(iverilog)} -g2012 -o sim.vvp {roots} design.v testbench.v "
              f"2>/dev/null || exit 97; : > compiled; exec {shlex.quote(vvp)} -n sim.vvp")
    with tempfile.TemporaryDirectory(prefix="mogrpo-verilog-") as tmp:
        Path(tmp, "design.v").write_text(design, encoding="utf-8")
        Path(tmp, "testbench.v").write_text(_testbench_file(testbench, nonce), encoding="utf-8")
        outcome = run_sandboxed(["/bin/sh", "-c", script], Path(tmp), limits, isolation,
                                readonly=[os.path.dirname(os.path.dirname(p))
                                          for p in (iverilog, vvp)])
        compiled = Path(tmp, "compiled").exists()
    if not compiled:
        return SimResult(0, 0, False, "timeout" if outcome.timed_out else "compile_error")
    mark = _MARK + nonce + " "
    for line in reversed(outcome.stdout.splitlines()):
        if line.startswith(mark):
            passed, total = (int(v) for v in line[len(mark):].split()[:2])
            return SimResult(max(0, min(passed, total)), max(total, 0), True, "ok")
    return SimResult(0, 0, True, "timeout" if outcome.timed_out else "no_result")


def score_result(result: SimResult, partial: bool = True, compile_bonus: float = 0.0) -> float:
    """A result as a reward in [0, 1] (see the module)."""
    if not result.compiled:
        return 0.0
    if result.total <= 0:
        fraction = 0.0
    elif partial:
        fraction = result.passed / result.total
    else:
        fraction = float(result.passed == result.total)
    return compile_bonus + (1.0 - compile_bonus) * fraction


def verilog_options(compile_bonus: Any = 0.0, isolation: Any = "auto", **_: Any) -> None:
    """`verilog_tests`' options that hold for every row (also checked before training)."""
    if not isinstance(compile_bonus, int | float) or not 0.0 <= compile_bonus < 1.0:
        raise RewardError(f"verilog_tests: compile_bonus {compile_bonus!r} must be in [0, 1), "
                          "e.g. 0.1")
    check_isolation_setting(isolation)


def verilog_tests(
    prompts: list,
    completions: list,
    testbench: Any,
    top_module: Any = None,
    partial: bool = True,
    compile_bonus: float = 0.0,
    timeout: float = 10.0,
    memory_mb: int = 1024,
    workers: int | None = None,
    isolation: str = "auto",
    **_: Any,
) -> list[float | None]:
    """Fraction of the row's testbench checks the completion's Verilog passes (see the module)."""
    verilog_options(compile_bonus=compile_bonus, isolation=isolation)
    problem = iverilog_missing()
    if problem:
        raise RewardError(problem)
    limits = SandboxLimits(timeout=timeout, memory_mb=memory_mb)
    contained = resolve_isolation(isolation)
    n = len(completions)
    benches: Sequence[Any] = per_completion(testbench, n, "testbench")
    tops: Sequence[Any] = per_completion(top_module, n, "top_module")

    def one(item: tuple[Any, Any, Any]) -> float | None:
        completion, bench, top = item
        if not isinstance(bench, str) or not bench.strip():
            return None
        design = extract_verilog(completion_text(completion))
        result = simulate(design, bench, limits, contained, top if isinstance(top, str) else None)
        return score_result(result, partial, compile_bonus)

    pool = workers or min(4, os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=pool) as executor:
        return list(executor.map(one, zip(completions, benches, tops, strict=True)))

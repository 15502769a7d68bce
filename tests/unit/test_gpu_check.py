"""`benchmarks/gpu_check.sh` runs on a GPU lent for minutes, by chance: every command it runs
must take the options it is given, or the lease is lost to a typo. Checked here against each
script's own `--help`, and the shell script's syntax with `bash -n`."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("gpu_check.sh", "gpu_run.sh", "gpu_wheels.sh")


def _joined(name: str) -> str:
    text = (ROOT / "benchmarks" / name).read_text(encoding="utf-8")
    return re.sub(r"\\\n\s*", " ", text)  # continuation lines joined


def commands() -> list[tuple[str, list[str]]]:
    """(script, its options) for each Python script gpu_check.sh and gpu_wheels.sh run."""
    found = []
    for name, python in (("gpu_check.sh", r'"\$py"'), ("gpu_wheels.sh", "python3")):
        for match in re.finditer(python + r' (benchmarks/\S+\.py)([^\n;|&]*)', _joined(name)):
            found.append((match.group(1),
                          re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", match.group(2))))
    return found


def test_the_memory_cases_the_check_names_exist():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import memory_vs_plan
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    named = [case for match in re.finditer(r"--cases ([^\n;|&]*)", _joined("gpu_check.sh"))
             for case in match.group(1).split()]
    assert "qwen2.5-0.5b/full-adamw8bit" in named and "qwen2.5-0.5b/qlora-bf16-mixed" in named
    assert set(named) <= set(memory_vs_plan.CASES), set(named) - set(memory_vs_plan.CASES)


def test_the_check_runs_the_steps_it_documents():
    scripts = {script for script, _ in commands()}
    assert scripts >= {"benchmarks/gpu_equivalence.py", "benchmarks/decode_speed.py",
                       "benchmarks/vs_trl/run.py", "benchmarks/profile_step.py",
                       "benchmarks/prompt_sharing.py", "benchmarks/memory_vs_plan.py",
                       "benchmarks/gpu_smoke.py", "benchmarks/slim_wheel.py"}


@pytest.mark.parametrize("script", sorted({s for s, _ in commands()}))
def test_every_option_the_check_passes_exists(script):
    options = {o for s, opts in commands() if s == script for o in opts}
    shown = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True,
                           text=True, cwd=ROOT, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    missing = sorted(o for o in options if not re.search(rf"(?<![\w-]){o}(?![\w-])",
                                                         shown.stdout))
    assert not missing, f"{script} does not take {missing}"


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_scripts_parse(name):
    assert subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / name)]).returncode == 0

"""Every benchmark script imports: a benchmark is run rarely, often on a lent machine, and one
that a refactor broke (a name moved, a module renamed) would fail only then."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

# Each module imported by path in one fresh interpreter (torch and transformers load once), the
# way each is run: its own folder first on sys.path; none runs its main().
IMPORT_ALL = """
import importlib.util, sys, traceback
failed = []
for path in sys.argv[1:]:
    folder = path.rsplit("/", 1)[0]
    sys.path.insert(0, folder)
    try:
        name = "bench_" + path.replace("/", "_").replace(".", "_")
        spec = importlib.util.spec_from_file_location(name, path)
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # as dataclasses need
        spec.loader.exec_module(module)
    except Exception:
        failed.append(path + ": " + traceback.format_exc(limit=1).strip().splitlines()[-1])
    finally:
        sys.path.remove(folder)
print("\\n".join(failed))
"""


def test_every_benchmark_script_imports():
    scripts = sorted(str(p) for p in [*BENCH.glob("*.py"), *BENCH.glob("vs_trl/*.py")])
    assert len(scripts) > 20
    done = subprocess.run([sys.executable, "-c", IMPORT_ALL, *scripts], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "", "benchmarks that do not import:\n" + done.stdout

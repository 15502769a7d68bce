"""`benchmarks/slim_wheel.py`: a wheel without the native libraries a GPU machine does not load
(bitsandbytes ships one per CUDA, ROCm and XPU release, too large to carry to a lent GPU) still
installs with pip, with a RECORD that names exactly the files it holds."""

from __future__ import annotations

import csv
import io
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import slim_wheel  # noqa: E402

FILES = {
    "tinypkg/__init__.py": b"from pathlib import Path\nLIBS = sorted(p.name for p in "
                           b"Path(__file__).parent.glob('*.so'))\n",
    "tinypkg/libtiny_cpu.so": b"cpu" * 100,
    "tinypkg/libtiny_cuda118.so": b"cuda118" * 1000,
    "tinypkg/libtiny_cuda130.so": b"cuda130" * 100,
    "tinypkg/libtiny_rocm64.so": b"rocm" * 1000,
    "tinypkg-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: tinypkg\nVersion: 1.0\n",
    "tinypkg-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: "
                                  b"false\nTag: py3-none-any\n",
}


def _wheel(folder: Path) -> Path:
    path = folder / "tinypkg-1.0-py3-none-any.whl"
    record = [[name, "", str(len(data))] for name, data in FILES.items()]
    record.append(["tinypkg-1.0.dist-info/RECORD", "", ""])
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(record)
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in FILES.items():
            wheel.writestr(name, data)
        wheel.writestr("tinypkg-1.0.dist-info/RECORD", text.getvalue())
    return path


def test_the_copy_keeps_what_is_kept_and_its_record_matches(tmp_path):
    source = _wheel(tmp_path)
    target, gone = slim_wheel.slim(source, tmp_path / "out", drop=["tinypkg/libtiny_*.so"],
                                   keep=["tinypkg/libtiny_cpu.so", "tinypkg/libtiny_cuda13*.so"])
    assert target.name == source.name
    assert sorted(gone) == ["tinypkg/libtiny_cuda118.so", "tinypkg/libtiny_rocm64.so"]
    with zipfile.ZipFile(target) as wheel:
        names = set(wheel.namelist())
        record = [row[0] for row in csv.reader(io.StringIO(
            wheel.read("tinypkg-1.0.dist-info/RECORD").decode()))]
        assert wheel.read("tinypkg/libtiny_cuda130.so") == FILES["tinypkg/libtiny_cuda130.so"]
    assert names == set(record)
    assert "tinypkg/libtiny_cuda118.so" not in names and "tinypkg/libtiny_cpu.so" in names


def test_pip_installs_the_copy(tmp_path):
    source = _wheel(tmp_path)
    assert slim_wheel.main([str(source), str(tmp_path / "out"), "--drop", "tinypkg/*.so",
                            "--keep", "tinypkg/libtiny_cuda130.so"]) == 0
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index",
                           "--no-deps", "--no-compile", "--target", str(site),
                           str(tmp_path / "out" / source.name)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    shown = subprocess.run([sys.executable, "-c", "import tinypkg; print(tinypkg.LIBS)"],
                           capture_output=True, text=True, cwd=site, timeout=60)
    assert shown.stdout.strip() == "['libtiny_cuda130.so']", shown.stderr


def test_a_missing_wheel_is_named(tmp_path, capsys):
    assert slim_wheel.main([str(tmp_path / "nope.whl"), str(tmp_path), "--drop", "*.so"]) == 1
    assert "no wheel at" in capsys.readouterr().err

"""The TRL side-by-side benchmark end to end in its smoke mode (`--quick`): both tools train
the small model on the same prompts and the results file holds sane figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quick_benchmark_writes_sane_results(tmp_path):
    pytest.importorskip("trl")
    out = tmp_path / "results" / "vs_trl"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_trl" / "run.py"), "--quick",
                    "--modes", "full", "--work", str(tmp_path / "work"), "--out", str(out)],
                   check=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    results = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert results["meta"]["steps"] == 4 and results["meta"]["mogrpo_engine"] == "default"
    [entry] = results["entries"]
    assert (entry["size"], entry["mode"]) == ("small", "full")
    assert 0.5e6 < entry["params"] < 0.9e6
    [pair] = entry["pairs"]
    assert pair["prompts_match"]  # both tools scored the same prompts, step by step
    max_reward = sum(results["meta"]["reward_weights"].values())
    for tool in ("trl", "mogrpo"):
        raw, s = pair[tool]["raw"], pair[tool]["summary"]
        assert len(raw["step_s"]) == 4 and all(t > 0 for t in raw["step_s"])
        assert len(raw["cpu_s"]) == 4 and all(c > 0 for c in raw["cpu_s"])
        assert all(0 < g < t for g, t in zip(raw["generation_s"], raw["step_s"], strict=True))
        assert all(4 * 4 <= n <= 16 * 32 for n in raw["completion_tokens"])
        assert len(raw["rewards"]) == 4 and all(0 <= r <= max_reward for r in raw["rewards"])
        assert s["step_ms"] > 0 and 0 < s["generation_share"] < 1
        assert s["completion_tokens_per_s"] > 0 and s["peak_rss_mib"] > 100
    summary = entry["summary"]
    trl_ms, mogrpo_ms = pair["trl"]["summary"]["step_ms"], pair["mogrpo"]["summary"]["step_ms"]
    assert summary["ratio"] == pytest.approx(trl_ms / mogrpo_ms)
    trl_cpu, mogrpo_cpu = pair["trl"]["summary"]["cpu_ms"], pair["mogrpo"]["summary"]["cpu_ms"]
    assert summary["cpu_ratio"] == pytest.approx(trl_cpu / mogrpo_cpu)
    table = out.with_suffix(".md").read_text(encoding="utf-8")
    assert f"**{summary['ratio']:.2f}×**" in table and "| small (0.68 M) | full |" in table

"""`mogrpo report` charts: what each figure plots (values, the KL band, the Pareto front), the
PNG files beside report.md, the self-contained HTML page, and the report without matplotlib."""

from __future__ import annotations

import base64
import json
import re
import sys

import pytest
import yaml

from mogrpo.cli import main
from mogrpo.eval.report import RunFiles, build_report

pytest.importorskip("matplotlib")

from mogrpo.eval import report_charts  # noqa: E402

CONFIG = {
    "model": {"name_or_path": "org/model-1b"},
    "train": {"max_steps": 4},
    "rollout": {"num_generations": 4, "max_completion_length": 32},
    "tasks": {
        "fair": {"data": "f.tsv", "beta": 0.04, "kl": {"kind": "band", "low": 0.02, "high": 0.06},
                 "rewards": [{"fn": "mc_correct"}, {"fn": "format", "weight": 0.1}]},
        "halu": {"data": "h.tsv", "beta": 0.05, "kl": {"kind": "proportional", "target": 0.1},
                 "rewards": [{"fn": "mc_correct"}]},
    },
}
REWARD = {"fair": [0.1, 0.2, 0.4, 0.5], "halu": [0.3, 0.3, 0.35, 0.6]}
KL = {"fair": [0.0, 0.01, 0.03, 0.05], "halu": [0.0, 0.05, 0.08, 0.12]}
EVALS = [(0, "start", 0.25, 0.5), (2, "2", 0.5, 0.4), (4, "end", 0.45, 0.7)]


def step(n: int) -> dict:
    record = {"step": n, "rollout/completion_length": 10.0 + n,
              "rollout/truncated_frac": 0.25 if n == 2 else 0.0}
    for task in ("fair", "halu"):
        record |= {f"task/{task}/reward/mean": REWARD[task][n - 1],
                   f"task/{task}/kl": KL[task][n - 1],
                   f"task/{task}/beta": 0.04 if n < 3 else 0.034,
                   f"task/{task}/reward/mc_correct/mean": REWARD[task][n - 1] - 0.05}
    record["task/fair/reward/format/mean"] = 0.5
    return record


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "two-task-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    (run / "metrics.jsonl").write_text("".join(json.dumps(step(n)) + "\n" for n in range(1, 5)))
    (run / "eval.jsonl").write_text("".join(
        json.dumps({"step": s, "tag": tag, "fair": {"score": f}, "halu": {"score": h}}) + "\n"
        for s, tag, f, h in EVALS))
    points = [{"name": f"step-{s}", "step": s, "scores": {"fair": f, "halu": h}}
              for s, _, f, h in EVALS]
    (run / "pareto.json").write_text(json.dumps({
        "tasks": ["fair", "halu"], "points": points, "front": [points[1], points[2]],
        "best": {"fair": points[1], "halu": points[2]}}))
    return run


def lines(ax) -> dict[str, list[float]]:
    return {line.get_label(): list(line.get_ydata()) for line in ax.get_lines()}


def test_reward_chart_plots_each_task_and_objective(run_dir):
    fig = report_charts.reward_figure(RunFiles(run_dir))
    fair, halu = fig.axes[:2]
    assert lines(fair) == {"reward (weighted)": REWARD["fair"],
                           "format": [0.5] * 4,
                           "mc_correct": pytest.approx([r - 0.05 for r in REWARD["fair"]])}
    assert lines(halu)["reward (weighted)"] == REWARD["halu"]


def test_kl_chart_shades_the_band_of_each_tasks_controller(run_dir):
    fig = report_charts.kl_figure(RunFiles(run_dir))
    fair, halu = fig.axes[:2]
    assert lines(fair)["KL"] == KL["fair"]
    (band,) = fair.patches  # axhspan: the controller's band, full width
    assert band.get_y() == 0.02 and band.get_y() + band.get_height() == pytest.approx(0.06)
    assert band.get_label() == "band 0.02–0.06"
    # a proportional controller has a target, drawn as a dashed line
    assert lines(halu)["target 0.1"] == [0.1, 0.1] and not halu.patches


def test_beta_length_and_eval_charts(run_dir):
    run = RunFiles(run_dir)
    (beta,) = report_charts.beta_figure(run).axes
    assert lines(beta) == {"fair": [0.04, 0.04, 0.034, 0.034], "halu": [0.04, 0.04, 0.034, 0.034]}
    top, bottom = report_charts.length_figure(run).axes
    assert lines(top)["mean completion length"] == [11.0, 12.0, 13.0, 14.0]
    assert lines(top)["budget 32"] == [32, 32]
    assert lines(bottom)["truncated"] == [0.0, 25.0, 0.0, 0.0]  # percent
    (scores,) = report_charts.eval_figure(run).axes
    assert lines(scores) == {"fair": [0.25, 0.5, 0.45], "halu": [0.5, 0.4, 0.7]}
    assert [list(line.get_xdata()) for line in scores.get_lines()] == [[0, 2, 4]] * 2


def test_pareto_chart_joins_the_front_and_labels_kept_checkpoints(run_dir):
    (ax,) = report_charts.pareto_figure(RunFiles(run_dir)).axes
    front = next(line for line in ax.get_lines() if line.get_label() == "Pareto front")
    assert list(front.get_xdata()) == [0.45, 0.5] and list(front.get_ydata()) == [0.7, 0.4]
    kept = [c for c in ax.collections if c.get_label().startswith("kept checkpoint")]
    assert [list(map(tuple, c.get_offsets())) for c in kept] == [[(0.5, 0.4), (0.45, 0.7)]]
    assert [t.get_text() for t in ax.texts] == ["step 0", "step 2", "step 4"]
    assert [t.get_color() for t in ax.texts] == ["tab:gray", "black", "black"]  # start: no ckpt
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("fair score", "halu score")


def test_report_command_writes_pngs_beside_report_md_and_one_html_page(run_dir, capsys):
    assert main(["report", str(run_dir), "--html"]) == 0
    text = (run_dir / "report.md").read_text()
    links = re.findall(r"!\[[^\]]+\]\((charts/\w+\.png)\)", text)
    assert links == [f"charts/{name}.png" for name in report_charts.CHARTS]
    for link in links:
        data = (run_dir / link).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    page = (run_dir / "report.html").read_text()
    inlined = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert [base64.b64decode(x) for x in inlined] == [(run_dir / p).read_bytes() for p in links]
    assert 'src="charts/' not in page and "<h2>Greedy evaluation</h2>" in page
    assert "<td>fair</td>" in page or "<th>fair</th>" in page
    assert capsys.readouterr().out.endswith(f"html: {run_dir / 'report.html'}\n")


def test_without_matplotlib_the_report_says_how_to_get_charts(run_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    assert main(["report", str(run_dir)]) == 0
    text = (run_dir / "report.md").read_text()
    assert text.endswith("## Charts\n\nCharts: install matplotlib (`pip install "
                         "'mogrpo[charts]'`), then `mogrpo report RUN_DIR` draws them beside "
                         "this file.\n")
    assert not (run_dir / "charts").exists()
    without = build_report(run_dir)
    assert without.split("## Charts")[0] == text.split("## Charts")[0]  # the rest as before


def test_steps_with_equal_scores_share_one_label(run_dir):
    pareto = json.loads((run_dir / "pareto.json").read_text())
    for p in pareto["points"]:
        p["scores"] = {"fair": 0.5, "halu": 0.5}
    (run_dir / "pareto.json").write_text(json.dumps(pareto))
    (ax,) = report_charts.pareto_figure(RunFiles(run_dir)).axes
    assert [t.get_text() for t in ax.texts] == ["steps 0, 2, 4"]


def test_a_long_run_draws_a_faint_raw_line_under_its_trailing_mean(tmp_path):
    run = tmp_path / "long-run"
    run.mkdir()
    (run / "config.yaml").write_text(yaml.safe_dump(CONFIG))
    rewards = [0.01 * n for n in range(1, 61)]  # 60 steps: more than the 40 drawn raw
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": n, "task/fair/reward/mean": r, "task/halu/reward/mean": r}) + "\n"
        for n, r in enumerate(rewards, 1)))
    fair = report_charts.reward_figure(RunFiles(run)).axes[0]
    raw, mean = fair.get_lines()[:2]
    assert list(raw.get_ydata()) == rewards and raw.get_alpha() == 0.25
    assert mean.get_label() == "reward (weighted) (mean of 5)"
    assert mean.get_linewidth() == 2.2  # the bold weighted line keeps its style when smoothed
    assert mean.get_ydata()[-1] == pytest.approx(sum(rewards[-5:]) / 5)


def test_write_report_draws_the_charts_beside_report_md(run_dir):
    from mogrpo.eval.report import write_report

    text, out = write_report(run_dir)
    assert out == run_dir / "report.md" and out.read_text() == text
    assert "](charts/reward.png)" in text
    assert sorted(p.name for p in (run_dir / "charts").iterdir()) == \
        sorted(f"{name}.png" for name in report_charts.CHARTS)

"""`mogrpo report RUN_DIR`: one Markdown page on what a run did, from the files it wrote.

It reads only the run directory (config.yaml, metrics.jsonl, eval.jsonl, pareto.json,
summary.json), so it works on a finished run, a run still going, or one that crashed — and
every run writes it at the end as `report.md`.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mogrpo.eval.run_files import ReportError, RunFiles
from mogrpo.tracking import names


def _mean(values: list[float]) -> float:
    finite = [v for v in values if isinstance(v, int | float) and math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _fmt(value: float, digits: int = 3) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) \
        else f"{value:.{digits}f}"


def _status(run: RunFiles) -> str:
    last = run.steps[-1]["step"] if run.steps else 0
    planned = (run.config.get("train") or {}).get("max_steps")
    of = f" of {planned}" if planned else ""
    if "saved" in run.summary:
        return f"finished: {last}{of} steps"
    if run.summary:  # written without a final model: a `stop` health check ended the run
        return f"stopped by the health monitor at step {last}{of}"
    return f"not finished: metrics up to step {last}{of} (no summary.json yet)"


def _setup(run: RunFiles) -> list[str]:
    cfg = run.config
    if not cfg:
        return ["(no config.yaml in the run directory)"]
    model, lora, train = cfg.get("model") or {}, cfg.get("lora") or {}, cfg.get("train") or {}
    rollout = cfg.get("rollout") or {}
    how = f"LoRA r {lora.get('r')}" if lora.get("enabled") else "full fine-tuning"
    per_step = (train.get("micro_batch_size", 0) * train.get("gradient_accumulation_steps", 1))
    lines = [f"- model `{model.get('name_or_path')}`, {how}, lr {train.get('learning_rate')}, "
             f"K {rollout.get('num_generations')}, {per_step} completions per step"]
    for name, task in (cfg.get("tasks") or {}).items():
        rewards = ", ".join(f"{r.get('name') or r['fn']} ×{r.get('weight', 1.0)}"
                            for r in task.get("rewards") or [])
        kl = task.get("kl") or {}
        control = kl.get("kind", "fixed")
        if control in ("band", "dual"):
            control += f" {kl.get('low')}–{kl.get('high')}"
        elif control == "proportional":
            control += f" → {kl.get('target')}"
        lines.append(f"- task **{name}** (`{task.get('data')}`): rewards {rewards}; "
                     f"β {task.get('beta')} ({control})")
    return lines


def _evals(run: RunFiles) -> list[str]:
    if not run.evals:
        return ["No greedy evaluation was run (`eval.every_steps`, `tasks.NAME.eval_size`)."]
    head = "| eval | step | " + " | ".join(run.tasks) + " |"
    lines = [head, "|---" * (2 + len(run.tasks)) + "|"]
    for e in run.evals:
        cells = [_fmt((e.get(t) or {}).get("score", math.nan)) for t in run.tasks]
        lines.append(f"| {e.get('tag')} | {e.get('step')} | " + " | ".join(cells) + " |")
    front = [p["step"] for p in (run.pareto.get("front") or [])]
    if front:
        lines += ["", f"Pareto front (no evaluated step beats these on every task): steps "
                  f"{', '.join(map(str, front))}."]
    return lines


def _signals(run: RunFiles, window: int) -> list[str]:
    n = len(run.steps)
    w = max(1, min(window, n // 2 or 1))
    first, last = run.steps[:w], run.steps[-w:]

    def both(key: str, digits: int = 3) -> str:
        a = _mean([r[key] for r in first if key in r])
        b = _mean([r[key] for r in last if key in r])
        return f"{_fmt(a, digits)} → {_fmt(b, digits)}"

    lines = [f"Means over the first and the last {w} steps.", "",
             "| task | reward | KL | β | zero-variance groups |", "|---|---|---|---|---|"]
    for t in run.tasks:
        lines.append(f"| {t} | {both(names.TASK_REWARD.of(t))} | {both(names.TASK_KL.of(t))} | "
                     f"{both(names.TASK_BETA.of(t), 4)} | "
                     f"{both(names.TASK_ZERO_VAR_FRAC.of(t), 2)} |")
    objectives = sorted({k for r in run.steps for k in r if names.OBJECTIVE_MEAN.matches(k)})
    if objectives:
        lines += ["", "| objective | mean |", "|---|---|"]
        lines += [f"| {names.PerObjective.objective(k)} | {both(k)} |" for k in objectives]
    truncated = run.series(names.TRUNCATED_FRAC)
    lines += ["", f"Completion length {both(names.COMPLETION_LENGTH, 1)} tokens; truncated "
              f"{_fmt(100 * _mean(truncated), 1)} % on average, at most "
              f"{_fmt(100 * max(truncated, default=math.nan), 1)} % in a step."]
    return lines


def _alert(a: dict[str, Any]) -> list[str]:
    """One alert: its step and check, then what was seen, the likely causes and the fix."""
    if not a.get("evidence"):  # written before alerts carried their parts
        return [f"- {a.get('message')}"]
    lines = [f"- **step {a.get('step')}, {a.get('check')}** ({a.get('action')})",
             f"  - evidence: {a['evidence']}"]
    lines += [f"  - likely ({i}): {c}" for i, c in enumerate(a.get("causes") or [], 1)]
    if a.get("fix"):
        lines.append(f"  - fix: {a['fix']}")
    return lines


def _events(run: RunFiles) -> list[str]:
    # summary.json holds every alert (the last eval's too); a run still going has only the log
    alerts = run.summary.get("health") or [e for e in run.events
                                           if e.get("event") == "health_alert"]
    watched = (run.config.get("health") or {}).get("enabled", True)
    quiet = "No health alert." if watched else \
        "Health checks were off (`health.enabled: false`): no step was watched."
    lines = [line for a in alerts for line in _alert(a)] or [quiet]
    rollbacks = run.summary.get("rollbacks") or [e for e in run.events
                                                 if e.get("event") == "health_rollback"]
    for r in rollbacks:
        lines.append(f"- **step {r.get('step')}: rolled back** to step {r.get('restored_step')} "
                     f"(`{r.get('checkpoint')}`), learning rate {r.get('lr_before'):.3g} → "
                     f"{r.get('lr_after'):.3g}")
    if run.summary.get("best_checkpoint"):
        lines.append(f"- best checkpoint on the Pareto front: {run.summary['best_checkpoint']}")
    changes = run.summary.get("beta_changes") or []
    if changes:
        lines += ["", f"{len(changes)} β change(s); the last: `{changes[-1]}`"]
    stages = run.summary.get("curriculum_changes") or []
    lines += [f"- `{line}`" for line in stages]
    return lines


def _speed(run: RunFiles) -> list[str]:
    step = _mean(run.series(names.TIME_STEP))
    if math.isnan(step):
        return ["No timing recorded."]
    parts = {name: _mean(run.series(key)) for name, key in (
        ("rollout", names.TIME_ROLLOUT), ("reward", names.TIME_REWARD),
        ("update", names.TIME_UPDATE))}
    split = ", ".join(f"{name} {100 * v / step:.0f} %" for name, v in parts.items()
                      if not math.isnan(v))
    lines = [f"{step:.2f} s per step ({split}); "
             f"{_mean(run.series(names.TOKENS_PER_S)):.0f} completion tokens/s "
             "while sampling."]
    peak = max(run.series(names.PEAK_GIB), default=math.nan)
    estimate = run.summary.get("memory_estimate_gib")
    if not math.isnan(peak):
        vs = f" (the planner estimated {estimate:.2f} GiB)" if estimate else ""
        lines.append(f"Peak memory {peak:.2f} GiB{vs}.")
    return lines


def _charts(charts: dict[str, str] | None) -> list[str]:
    """Image links to the drawn charts, or the one line that says how to get them."""
    from mogrpo.eval.report_charts import CHARTS, INSTALL_HINT, TITLES, available

    if charts is None:
        if not available():
            return [f"Charts: install matplotlib (`{INSTALL_HINT}`), then `mogrpo report "
                    "RUN_DIR` draws them beside this file."]
        return ["Charts: `mogrpo report RUN_DIR` draws them beside this file."]
    if not charts:
        return ["No data to chart yet."]
    return [f"![{TITLES[name]}]({charts[name]})\n" for name in CHARTS if name in charts]


def build_report(run_dir: str | Path, window: int = 10,
                 charts: dict[str, str] | None = None) -> str:
    """The Markdown report of the run in `run_dir`; `charts` maps drawn charts to their paths
    relative to the report (None: a line saying how to draw them)."""
    run = RunFiles(Path(run_dir))
    sections = [
        (f"# Run report: {run.dir.name}", [_status(run)]),
        ("## Setup", _setup(run)),
        ("## Greedy evaluation", _evals(run)),
        ("## Training signals", _signals(run, window) if run.steps else ["No steps yet."]),
        ("## Health, KL control, curriculum", _events(run)),
        ("## Speed and memory", _speed(run)),
        ("## Charts", _charts(charts)),
    ]
    return "\n\n".join(f"{title}\n\n" + "\n".join(body).rstrip()
                       for title, body in sections) + "\n"


def write_report(run_dir: str | Path, out: Path | None = None, window: int = 10,
                 charts: bool = True) -> tuple[str, Path]:
    """Write the report of `run_dir` to `out` (default RUN_DIR/report.md) and, with matplotlib
    installed and `charts`, its charts into charts/ beside it; returns (text, path)."""
    from mogrpo.eval import report_charts

    if window < 1:
        raise ReportError(f"--window {window} must be >= 1")
    run = RunFiles(Path(run_dir))  # not a run directory: an error before anything is written
    out = out or run.dir / "report.md"
    drawn = None
    if charts and report_charts.available():
        paths = report_charts.write_charts(run, out.parent / "charts")
        drawn = {name: path.relative_to(out.parent).as_posix() for name, path in paths.items()}
    text = build_report(run.dir, window, drawn)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    return text, out

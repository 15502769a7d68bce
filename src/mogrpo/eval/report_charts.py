"""Charts of a run for `mogrpo report`: PNG files drawn with matplotlib (the `charts` extra).

One figure per question a user asks of a run: is each task's reward (and each objective)
going up; is KL inside the band its controller steers toward; how β moved; are completions
getting longer or hitting the budget; how the greedy eval scores moved; and which evaluated
checkpoints form the Pareto front. Only the run directory's files are read (`RunFiles`).

matplotlib is drawn through its object API (`Figure` + the Agg canvas), never pyplot, so no
display and no global state are involved.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mogrpo.tracking import names

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

    from mogrpo.eval.run_files import RunFiles

CHARTS = ("reward", "kl", "beta", "length", "eval", "pareto")
"""The charts, in the order the report shows them (`charts/NAME.png`)."""

TITLES = {
    "reward": "Reward per task and objective",
    "kl": "KL to the reference per task (shaded: the controller's band)",
    "beta": "β per task",
    "length": "Completion length and truncation",
    "eval": "Greedy eval score per task",
    "pareto": "Pareto front of evaluated steps (ringed: kept checkpoints)",
}
INSTALL_HINT = "pip install 'mogrpo[charts]'"


def available() -> bool:
    """Whether matplotlib can be imported (the `charts` extra is installed)."""
    return importlib.util.find_spec("matplotlib") is not None


def _figure(n: int, width: float = 7.0, height: float = 2.6,
            steps: bool = True) -> tuple[Figure, list[Axes]]:
    """A figure of `n` stacked axes; `steps`: whole-number ticks on the x axis."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(width, height * n), layout="constrained")
    axes = fig.subplots(n, 1, squeeze=False)[:, 0].tolist()
    for ax in axes if steps else ():
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


def _series(run: RunFiles, key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of a per-step metric, skipping steps without a finite value."""
    pairs = [(r["step"], r[key]) for r in run.steps
             if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (the first ones average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _plot(ax: Axes, steps: list[int], values: list[float], label: str, **style: Any) -> None:
    """A metric's line; with many steps, a faint raw line under its trailing mean."""
    if len(values) > 40:
        window = max(5, len(values) // 20)
        faint = {k: v for k, v in style.items() if k != "linewidth"}
        line = ax.plot(steps, values, alpha=0.25, linewidth=0.8, **faint)[0]
        ax.plot(steps, _smooth(values, window), color=line.get_color(),
                label=f"{label} (mean of {window})", **{k: v for k, v in style.items()
                                                        if k != "color"})
    else:
        ax.plot(steps, values, marker="o", markersize=3, label=label, **style)


def _objectives(run: RunFiles, task: str) -> list[str]:
    return sorted({k.split("/")[3] for r in run.steps for k in r
                   if names.OBJECTIVE_MEAN.matches(k) and names.task_of(k) == task})


def reward_figure(run: RunFiles) -> Figure:
    """Per task: the weighted reward (bold) and each objective's mean reward."""
    fig, axes = _figure(len(run.tasks))
    for ax, task in zip(axes, run.tasks, strict=True):
        _plot(ax, *_series(run, names.TASK_REWARD.of(task)), "reward (weighted)", linewidth=2.2,
              color="black")
        for objective in _objectives(run, task):
            _plot(ax, *_series(run, names.OBJECTIVE_MEAN.of(task, objective)), objective)
        ax.set_title(f"{task}: reward", loc="left", fontsize=10)
        ax.set_ylabel("mean reward")
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    return fig


def kl_band(config: dict[str, Any], task: str) -> tuple[float, float] | float | None:
    """The KL the task's controller steers toward: (low, high) for a band (`band`, `dual`),
    the target of a proportional controller, None for a fixed β."""
    kl = ((config.get("tasks") or {}).get(task) or {}).get("kl") or {}
    if kl.get("kind") in ("band", "dual") and kl.get("low") is not None \
            and kl.get("high") is not None:
        return float(kl["low"]), float(kl["high"])
    if kl.get("kind") == "proportional" and kl.get("target") is not None:
        return float(kl["target"])
    return None


def kl_figure(run: RunFiles) -> Figure:
    """Per task: measured KL, with the controller's band shaded (or its target dashed)."""
    fig, axes = _figure(len(run.tasks))
    for ax, task in zip(axes, run.tasks, strict=True):
        band = kl_band(run.config, task)
        if isinstance(band, tuple):
            ax.axhspan(*band, color="tab:green", alpha=0.15,
                       label=f"band {band[0]:g}–{band[1]:g}")
        elif band is not None:
            ax.axhline(band, color="tab:green", linestyle="--", label=f"target {band:g}")
        _plot(ax, *_series(run, names.TASK_KL.of(task)), "KL", color="tab:blue")
        ax.set_title(f"{task}: KL", loc="left", fontsize=10)
        ax.set_ylabel("KL")
        ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step")
    return fig


def beta_figure(run: RunFiles) -> Figure:
    """β of every task on one axis (steps: every change the KL controllers made)."""
    fig, (ax,) = _figure(1, height=3.0)
    for task in run.tasks:
        steps, values = _series(run, names.TASK_BETA.of(task))
        ax.step(steps, values, where="post", label=task)
    ax.set_xlabel("step")
    ax.set_ylabel("β")
    ax.legend(fontsize=7)
    return fig


def length_figure(run: RunFiles) -> Figure:
    """Mean completion length (tokens) above the fraction of completions truncated."""
    fig, (top, bottom) = _figure(2)
    _plot(top, *_series(run, names.COMPLETION_LENGTH), "mean completion length")
    budget = (run.config.get("rollout") or {}).get("max_completion_length")
    if budget:
        top.axhline(budget, color="tab:red", linestyle="--", label=f"budget {budget}")
    top.set_ylabel("tokens")
    top.set_title("completion length", loc="left", fontsize=10)
    top.legend(fontsize=7)
    steps, frac = _series(run, names.TRUNCATED_FRAC)
    _plot(bottom, steps, [100 * v for v in frac], "truncated", color="tab:red")
    bottom.set_ylabel("% of completions")
    bottom.set_ylim(bottom=0)
    bottom.set_title("truncated (hit the budget)", loc="left", fontsize=10)
    bottom.set_xlabel("step")
    return fig


def _eval_scores(run: RunFiles, task: str) -> tuple[list[int], list[float]]:
    pairs = [(e["step"], (e.get(task) or {}).get("score")) for e in run.evals]
    pairs = [(s, v) for s, v in pairs if isinstance(v, int | float) and math.isfinite(v)]
    return [s for s, _ in pairs], [v for _, v in pairs]


def eval_figure(run: RunFiles) -> Figure:
    """Greedy eval score of every task at each evaluated step."""
    fig, (ax,) = _figure(1, height=3.0)
    for i, task in enumerate(run.tasks):  # markers and dashes keep equal scores visible
        ax.plot(*_eval_scores(run, task), marker="os^Dv"[i % 5], markersize=7 - i % 3,
                linestyle=("-", "--", ":")[i % 3], label=task)
    ax.set_xlabel("step")
    ax.set_ylabel("score")
    ax.legend(fontsize=7)
    return fig


def _pareto_points(run: RunFiles) -> tuple[list[dict], set[int], set[int]]:
    """Every evaluated point, the steps on the front, and the steps best on some task."""
    points = run.pareto.get("points") or []
    front = {p["step"] for p in run.pareto.get("front") or []}
    best = {p["step"] for p in (run.pareto.get("best") or {}).values()}
    return points, front, best


def _score(point: dict, task: str) -> float:
    value = point["scores"].get(task)
    return float(value) if isinstance(value, int | float) else math.nan


def pareto_figure(run: RunFiles) -> Figure:
    """Eval scores of every evaluated step for each pair of tasks (at most 6 pairs); the front
    joined by a line, kept checkpoints (front and best per task) ringed and labelled."""
    tasks = run.pareto.get("tasks") or run.tasks
    pairs = list(combinations(tasks, 2))[:6]
    fig, axes = _figure(len(pairs), width=5.5, height=4.2, steps=False)
    points, front, best = _pareto_points(run)
    for ax, (x_task, y_task) in zip(axes, pairs, strict=True):
        xs = [_score(p, x_task) for p in points]
        ys = [_score(p, y_task) for p in points]
        ax.scatter(xs, ys, color="tab:gray", s=18, label="evaluated step")
        on_front = sorted((p for p in points if p["step"] in front),
                          key=lambda p: _score(p, x_task))
        if on_front:
            ax.plot([_score(p, x_task) for p in on_front], [_score(p, y_task) for p in on_front],
                    color="tab:orange", marker="o", label="Pareto front")
        kept = [(x, y) for p, x, y in zip(points, xs, ys, strict=True) if p["step"] in front | best]
        if kept:
            ax.scatter(*zip(*kept, strict=True), s=150, facecolors="none", edgecolors="tab:red",
                       label="kept checkpoint (front or best on a task)")
        at: dict[tuple[float, float], list[int]] = {}  # equal scores share one label
        for p, x, y in zip(points, xs, ys, strict=True):
            at.setdefault((x, y), []).append(p["step"])
        for (x, y), steps in at.items():
            chosen = any(step in front | best for step in steps)
            label = f"step {steps[0]}" if len(steps) == 1 else \
                "steps " + ", ".join(map(str, steps[:4])) + (" …" if len(steps) > 4 else "")
            ax.annotate(label, (x, y), textcoords="offset points", xytext=(6, 6), fontsize=7,
                        color="black" if chosen else "tab:gray")
        ax.set_xlabel(f"{x_task} score")
        ax.set_ylabel(f"{y_task} score")
        ax.legend(fontsize=7, loc="lower left")
    return fig


FIGURES: dict[str, Callable[[RunFiles], Figure]] = {
    "reward": reward_figure, "kl": kl_figure, "beta": beta_figure, "length": length_figure,
    "eval": eval_figure, "pareto": pareto_figure,
}


def drawable(run: RunFiles) -> list[str]:
    """The charts this run has data for."""
    names = []
    if run.steps and run.tasks:
        names += ["reward", "kl", "beta", "length"]
    if run.evals and run.tasks:
        names.append("eval")
    if len(run.pareto.get("points") or []) > 0 and len(run.tasks) >= 2:
        names.append("pareto")
    return names


def write_charts(run: RunFiles, out_dir: Path) -> dict[str, Path]:
    """Draw every chart the run has data for into `out_dir` as NAME.png; returns the paths."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in drawable(run):
        fig = FIGURES[name](run)
        fig.suptitle(TITLES[name], fontsize=11)
        FigureCanvasAgg(fig)
        path = out_dir / f"{name}.png"
        fig.savefig(path, dpi=110)
        written[name] = path
    return written

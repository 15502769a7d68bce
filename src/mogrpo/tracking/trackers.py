"""Experiment trackers: TensorBoard, Weights & Biases, MLflow — continued, not restarted, on resume.

The metrics JSONL file is always written; trackers are optional and configured per run
(`logging.trackers`). Each tracker's run identity (W&B run id, MLflow run id, TensorBoard
directory) is part of the checkpoint, so a resumed run continues the same tracker run. Each
checkpoint is also a durability barrier for the trackers (W&B buffers in a helper process
that dies with a killed run, so its run is finished and re-attached there). On resume each
tracker is asked where it stands and gets exactly the steps it lacks: TensorBoard drops
events after the checkpoint (purge_step), W&B reports its own next step, MLflow is asked for
the last logged step. So every tracker ends with one value per step.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from pathlib import Path
from typing import Any

from mogrpo.config import RunConfig, flatten
from mogrpo.errors import ConfigError

log = logging.getLogger(__name__)

TRACKERS = ("tensorboard", "wandb", "mlflow")
# Left over from an earlier run, these make wandb.init attach to *that* run (USERS.md #8).
WANDB_STALE_ENV = ("WANDB_RUN_ID", "WANDB_RESUME")


def markdown(columns: list[str], cells: list[list[Any]]) -> str:
    """A Markdown table (what TensorBoard's text plugin renders)."""
    def text(value: Any) -> str:
        shown = "" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)
        return shown.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(text(v) for v in row) + " |" for row in cells]
    return "\n".join(lines)


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


class TensorBoardTracker:
    def __init__(self, run_dir: Path, state: dict[str, Any], resume_step: int | None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # tensorboard is an optional extra
            raise ConfigError("logging.trackers has tensorboard but it is not installed: "
                              "pip install 'mogrpo[trackers]'") from err
        self.log_dir = state.get("log_dir") or str(run_dir / "tensorboard")
        # Same directory on resume; purge_step hides what a crashed run wrote after the
        # checkpoint, so the steps logged again are not shown twice.
        purge = resume_step + 1 if resume_step is not None else None
        self.writer = SummaryWriter(log_dir=self.log_dir, purge_step=purge)

    def wants(self, step: int) -> bool:
        return True

    def barrier(self) -> None:
        self.writer.flush()

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, name: str, step: int, columns: list[str], cells: list[list[Any]]) -> None:
        self.writer.add_text(name, markdown(columns, cells), step)
        self.writer.flush()

    def state_dict(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir}

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, run_dir: Path, state: dict[str, Any], resume_step: int | None,
                 project: str, name: str, config: dict[str, Any]) -> None:
        try:
            import wandb
        except ImportError as err:
            raise ConfigError("logging.trackers has wandb but it is not installed: "
                              "pip install 'mogrpo[trackers]'") from err
        for var in WANDB_STALE_ENV:
            if var in os.environ:
                log.warning("ignoring %s=%s from the environment: mogrpo picks the W&B run "
                            "from its own checkpoint", var, os.environ[var])
                os.environ.pop(var)
        self.run_id = state.get("run_id") or uuid.uuid4().hex[:12]
        self._init = dict(project=project, name=name, id=self.run_id, dir=str(run_dir),
                          reinit="create_new")
        self.run = wandb.init(config=config, resume="allow" if resume_step else None,
                              **self._init)
        # W&B knows the next step it accepts (its backend's view when online; 0 offline).
        self.next_step = int(getattr(self.run, "step", 0) or 0)

    def wants(self, step: int) -> bool:
        return step >= self.next_step

    def barrier(self) -> None:
        # finish() is W&B's only flush: without it a killed run loses what was buffered.
        import wandb

        self.run.finish()
        self.run = wandb.init(resume="allow", **self._init)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, step: int, columns: list[str], cells: list[list[Any]]) -> None:
        import wandb

        self.run.log({name: wandb.Table(columns=columns, data=cells)}, step=step)

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def close(self) -> None:
        self.run.finish()


class MlflowTracker:
    def __init__(self, run_dir: Path, state: dict[str, Any], tracking_uri: str | None,
                 experiment: str, name: str, config: dict[str, Any]) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise ConfigError("logging.trackers has mlflow but it is not installed: "
                              "pip install 'mogrpo[trackers]'") from err
        self.tracking_uri = state.get("tracking_uri") or tracking_uri or (
            (run_dir / "mlruns").resolve().as_uri())
        if self.tracking_uri.startswith("file:"):
            # The local file store needs no database packages; MLflow 3 asks for this opt-in.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.run_id = state.get("run_id")
        try:
            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            if self.run_id is None:
                found = self.client.get_experiment_by_name(experiment)
                experiment_id = (found.experiment_id if found
                                 else self.client.create_experiment(experiment))
                self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
                for key, value in list(config.items())[:100]:
                    self.client.log_param(self.run_id, key, str(value)[:500])
        except Exception as err:  # noqa: BLE001 - any backend failure is a setup problem
            raise ConfigError(f"MLflow tracking at {self.tracking_uri} failed: {err}; check "
                              "logging.mlflow_tracking_uri") from err
        # The last step MLflow holds: logging is synchronous, so this is exact after a crash.
        logged = self.client.get_metric_history(self.run_id, "step") if state else []
        self.last_logged = max((int(m.step) for m in logged), default=0)

    def wants(self, step: int) -> bool:
        return step > self.last_logged

    def barrier(self) -> None:
        pass

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(key, value, now, step) for key, value in metrics.items()]
        for start in range(0, len(batch), 1000):  # MLflow's batch limit
            self.client.log_batch(self.run_id, metrics=batch[start:start + 1000])

    def log_table(self, name: str, step: int, columns: list[str], cells: list[list[Any]]) -> None:
        # an artifact per logged step: name/step_000020.jsonl, one JSON object per row
        text = "".join(json.dumps(dict(zip(columns, row, strict=True)), ensure_ascii=False,
                                  default=str) + "\n" for row in cells)
        self.client.log_text(self.run_id, text, f"{name}/step_{step:06d}.jsonl")

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri}

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """Every configured tracker behind one `log(metrics, step)`."""

    def __init__(self, config: RunConfig, run_dir: Path, *, state: dict[str, Any] | None = None,
                 resume_step: int | None = None) -> None:
        state = state or {}
        flat = flatten(config.model_dump(mode="json"))
        lc = config.logging
        name = lc.run_name or run_dir.name
        self.trackers: dict[str, Any] = {}
        for tracker in dict.fromkeys(lc.trackers):
            saved = state.get(tracker, {})
            if tracker == "tensorboard":
                self.trackers[tracker] = TensorBoardTracker(run_dir, saved, resume_step)
            elif tracker == "wandb":
                self.trackers[tracker] = WandbTracker(run_dir, saved, resume_step,
                                                      lc.project, name, flat)
            elif tracker == "mlflow":
                self.trackers[tracker] = MlflowTracker(run_dir, saved, lc.mlflow_tracking_uri,
                                                       lc.project, name, flat)
        self.last_step = resume_step or 0

    def write(self, metrics: dict[str, Any]) -> None:
        """Send one step's metrics (a metrics-file record with a `step`)."""
        step = int(metrics["step"])
        self.last_step = step
        numbers = _numbers(metrics)
        for tracker in self.trackers.values():
            if tracker.wants(step):
                tracker.log(numbers, step)

    def log_table(self, name: str, step: int, columns: list[str], cells: list[list[Any]]) -> None:
        """Send a table (rows of `cells` under `columns`) logged at `step`."""
        for tracker in self.trackers.values():
            if tracker.wants(step):
                tracker.log_table(name, step, columns, cells)

    def barrier(self) -> None:
        """Make everything sent so far durable (called with every checkpoint)."""
        for tracker in self.trackers.values():
            tracker.barrier()

    def state_dict(self) -> dict[str, Any]:
        return {name: t.state_dict() for name, t in self.trackers.items()} | {
            "last_step": self.last_step}

    def close(self) -> None:
        for tracker in self.trackers.values():
            tracker.close()

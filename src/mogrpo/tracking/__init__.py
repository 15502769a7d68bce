"""Where metrics go: the run's JSONL logs (`jsonl`) and the experiment trackers
(`trackers`: TensorBoard, W&B, MLflow)."""

from mogrpo.tracking.jsonl import MetricsWriter, Tee, rewrite_jsonl, truncate_jsonl
from mogrpo.tracking.trackers import Trackers

__all__ = ["MetricsWriter", "Tee", "Trackers", "rewrite_jsonl", "truncate_jsonl"]

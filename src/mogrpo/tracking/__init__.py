"""Where metrics go and what they are called: the metric names (`names`), the run's JSONL
logs (`jsonl`) and the experiment trackers (`trackers`: TensorBoard, W&B, MLflow).

Nothing is imported here: the health checks import `names`, and the config's sections import
the health checks' section, which `trackers` reads."""

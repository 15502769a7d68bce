"""One mogrpo run of the benchmark through its CLI entry point, in its own process (run.py).

    python benchmarks/vs_trl/mogrpo_worker.py CONFIG.yaml CPU.json

Runs `mogrpo train CONFIG.yaml` exactly as the command line does, and records the process CPU
time of each GRPO step (`GRPOTrainer.train_step`, the span `time/step_s` covers), which a busy
shared machine disturbs far less than wall time. Everything else comes from metrics.jsonl.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path


def main() -> int:
    config, out = sys.argv[1], Path(sys.argv[2])
    from mogrpo.cli import main as mogrpo_main
    from mogrpo.trainer.grpo import GRPOTrainer

    cpu_s: list[float] = []
    train_step = GRPOTrainer.train_step

    def timed(self: GRPOTrainer) -> dict[str, float]:
        start = time.process_time()
        metrics = train_step(self)
        cpu_s.append(time.process_time() - start)
        return metrics

    GRPOTrainer.train_step = timed  # type: ignore[method-assign]
    code = mogrpo_main(["train", config])
    out.write_text(json.dumps({"cpu_s": cpu_s}), encoding="utf-8")
    return code


if __name__ == "__main__":
    sys.exit(main())

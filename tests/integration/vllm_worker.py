"""One process of `mogrpo train CONFIG` under torchrun with `rollout.engine: vllm`, on the fake
vLLM of tests/fake_vllm.py (see test_vllm_processes.py).

Each process builds its own engine; after the run it saves what its engine was built with,
every prompt it was asked to complete and the last weights pushed into it, to OUT/rankR.pt.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: fake_vllm
from fake_vllm import FakeLLM, FakeSamplingParams  # noqa: E402
from mogrpo.config import (
    engines,  # noqa: E402
    load_config,  # noqa: E402
)
from mogrpo.rollout import vllm_engine  # noqa: E402
from mogrpo.trainer.run import run_training  # noqa: E402


def main() -> None:
    config_path, out = sys.argv[1], Path(sys.argv[2])
    built: list[FakeLLM] = []

    def llm(**kwargs):
        built.append(FakeLLM(**kwargs))
        return built[-1]

    engines.vllm_unavailable_reason = lambda: None  # no GPU needed by the fake
    vllm_engine.import_vllm = lambda: (llm, FakeSamplingParams)
    config, _ = load_config(config_path, [])
    run_training(config)
    (engine,) = built
    prompts = [tuple(p["prompt_token_ids"]) for batch, _ in engine.requests for p in batch]
    torch.save({"kwargs": engine.engine_kwargs, "prompts": prompts,
                "pushes": len(engine.model.loads), "last": engine.model.loads[-1]},
               out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()

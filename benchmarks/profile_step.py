"""Where one mogrpo GRPO step of the vs_trl workload spends its CPU time, phase by phase.

    python benchmarks/profile_step.py --size small --mode full
    python benchmarks/profile_step.py --size medium --mode lora --cprofile runs/prof.txt

Runs `mogrpo train` on the vs_trl benchmark's model, prompts and settings (1 torch thread),
with the trainer's phases and the update's parts wrapped in CPU-time counters
(`time.process_time`). Prints the median CPU time per step of each phase over the steps after
the warm-up; `--cprofile FILE` also writes cProfile's cumulative listing of the timed steps.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))
import workload  # noqa: E402  (the vs_trl models, prompts and config)

PHASES = [  # (label, module path, attribute): the trainer's phases, then the update's parts
    ("rollout", "mogrpo.trainer.grpo.GRPOTrainer", "generate"),
    ("  native decode", "mogrpo.rollout.generate", "native_decode"),
    ("reward", "mogrpo.trainer.grpo.GRPOTrainer", "score"),
    ("advantages", "mogrpo.trainer.grpo.GRPOTrainer", "advantages"),
    ("reference forward", "mogrpo.trainer.grpo.GRPOTrainer", "reference_logprobs"),
    ("update", "mogrpo.trainer.grpo.GRPOTrainer", "update"),
    ("  log-prob forwards (policy, ref)", "mogrpo.trainer.grpo", "completion_logprobs"),
    ("  loss", "mogrpo.trainer.grpo", "grpo_loss"),
    ("  backward", "torch.Tensor", "backward"),
    ("  grad clip", "torch.nn.utils", "clip_grad_norm_"),
]


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    if module and attr[0].isupper():
        return getattr(sys.modules[module] if module in sys.modules else
                       __import__(module, fromlist=[attr]), attr)
    return __import__(path, fromlist=["_"])


def _wrap(owner, attr: str, label: str, spent: dict[str, float]) -> None:
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = time.process_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += time.process_time() - start

    setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(workload.SIZES), default="small")
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/profile_step"))
    parser.add_argument("--cprofile", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    settings = workload.Settings()
    model_dir = args.work / "models" / args.size
    if not (model_dir / "config.json").exists():
        workload.build_models(args.work, [args.size], settings.seed)
    data = workload.write_prompts(args.work / "prompts.jsonl", workload.prompt_rows(settings.seed))
    config = workload.mogrpo_config(str(model_dir), data, args.work / "run", args.steps,
                                    args.mode == "lora", settings)
    path = workload.write_mogrpo_config(args.work / "config.yaml", config)

    from mogrpo.cli import main as mogrpo_main
    from mogrpo.trainer.grpo import GRPOTrainer

    spent: dict[str, float] = defaultdict(float)
    for label, owner, attr in PHASES:
        _wrap(_resolve(owner), attr, label, spent)
    _wrap(torch.optim.AdamW, "step", "  optimizer", spent)
    per_step: list[dict[str, float]] = []
    profiler = cProfile.Profile() if args.cprofile else None
    train_step = GRPOTrainer.train_step

    def timed(self: GRPOTrainer) -> dict[str, float]:
        spent.clear()
        on = profiler is not None and self.step >= args.warmup
        if on:
            profiler.enable()
        start = time.process_time()
        metrics = train_step(self)
        spent["step"] = time.process_time() - start
        if on:
            profiler.disable()
        per_step.append(dict(spent))
        return metrics

    GRPOTrainer.train_step = timed  # type: ignore[method-assign]
    mogrpo_main(["train", str(path)])
    timed_steps = per_step[args.warmup:]
    step = statistics.median(s["step"] for s in timed_steps)
    print(f"{args.size} {args.mode}: median CPU per step {step * 1000:.1f} ms "
          f"over {len(timed_steps)} steps")
    labels = [label for label, _, _ in PHASES] + ["  optimizer"]
    for label in labels:
        ms = statistics.median(s.get(label, 0.0) for s in timed_steps) * 1000
        print(f"{label:32s} {ms:8.1f} ms  {ms / step / 10:5.1f}%")
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(80)
        args.cprofile.parent.mkdir(parents=True, exist_ok=True)
        args.cprofile.write_text(out.getvalue(), encoding="utf-8")


if __name__ == "__main__":
    main()

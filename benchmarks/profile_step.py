"""Where one mogrpo GRPO step of the vs_trl workload spends its CPU time, phase by phase.

    python benchmarks/profile_step.py --size small --mode full
    python benchmarks/profile_step.py --size medium --mode lora --cprofile runs/prof.txt

Runs `mogrpo train` on the vs_trl benchmark's model, prompts and settings (`--threads`, 1 by
default), with the trainer's phases and the update's parts wrapped in time counters: CPU time
(`time.process_time`) with one thread, wall time with more (CPU time then sums the threads).
Prints the median time per step of each phase over the steps after the warm-up; `--cprofile FILE` also writes cProfile's cumulative listing of the timed steps.
`--trl` then runs TRL's GRPOTrainer on the same model, prompts and threads
(`vs_trl/trl_worker.py --phases`) and prints its phases (wall time) beside them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
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
    ("  log-prob forwards (policy, ref)", "mogrpo.trainer.update", "completion_logprobs"),
    ("  loss", "mogrpo.trainer.update", "grpo_loss"),
    ("  backward", "torch.Tensor", "backward"),
    ("  grad clip", "torch.nn.utils", "clip_grad_norm_"),
]


def _resolve(path: str):
    module, _, attr = path.rpartition(".")
    if module and attr[0].isupper():
        return getattr(sys.modules[module] if module in sys.modules else
                       __import__(module, fromlist=[attr]), attr)
    return __import__(path, fromlist=["_"])


CLOCK = time.process_time  # wall time (time.perf_counter) with several threads


def _wrap(owner, attr: str, label: str, spent: dict[str, float]) -> None:
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = CLOCK()
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += CLOCK() - start

    setattr(owner, attr, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(workload.SIZES), default="small")
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--work", type=Path, default=Path("runs/profile_step"))
    parser.add_argument("--cprofile", type=Path, default=None)
    parser.add_argument("--trl", action="store_true",
                        help="then profile TRL's step on the same model, prompts and threads")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1; vs_trl's default is the cores)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.threads == 1 else time.perf_counter
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
        start = CLOCK()
        metrics = train_step(self)
        spent["step"] = CLOCK() - start
        if on:
            profiler.disable()
        per_step.append(dict(spent))
        return metrics

    GRPOTrainer.train_step = timed  # type: ignore[method-assign]
    mogrpo_main(["train", str(path)])
    timed_steps = per_step[args.warmup:]
    step = statistics.median(s["step"] for s in timed_steps)
    clock = "CPU" if args.threads == 1 else f"wall ({args.threads} threads)"
    print(f"{args.size} {args.mode}: median {clock} per step {step * 1000:.1f} ms "
          f"over {len(timed_steps)} steps")
    labels = [label for label, _, _ in PHASES] + ["  optimizer"]
    for label in labels:
        ms = statistics.median(s.get(label, 0.0) for s in timed_steps) * 1000
        print(f"{label:32s} {ms:8.1f} ms  {ms / step / 10:5.1f}%")
    if args.trl:
        trl_phases(args, model_dir, settings)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(80)
        args.cprofile.parent.mkdir(parents=True, exist_ok=True)
        args.cprofile.write_text(out.getvalue(), encoding="utf-8")


def trl_phases(args: argparse.Namespace, model_dir: Path, settings: workload.Settings) -> None:
    """TRL's step on the same model and prompts (mogrpo's draw order), wall time per phase."""
    rows = workload.prompt_rows(settings.seed)
    order = workload.write_prompts(args.work / f"order-{args.steps}.jsonl",
                                   workload.mogrpo_order(rows, args.steps, settings))
    out = args.work / "trl-phases.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, str(HERE / "vs_trl" / "trl_worker.py"), "--model",
                    str(model_dir), "--prompts", str(order), "--steps", str(args.steps),
                    "--mode", args.mode, "--out", str(out), "--phases"], check=True, env=env)
    record = json.loads(out.read_text(encoding="utf-8"))
    steps = record["step_s"][args.warmup:]
    phases = record["phases"][args.warmup:]
    print(f"TRL {args.size} {args.mode}: median wall per step "
          f"{statistics.median(steps) * 1000:.1f} ms over {len(steps)} steps")
    for label in dict.fromkeys(k for p in phases for k in p):
        ms = statistics.median(p.get(label, 0.0) for p in phases) * 1000
        print(f"{label:32s} {ms:8.1f} ms")


if __name__ == "__main__":
    main()

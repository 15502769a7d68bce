"""Where one mogrpo GRPO step of the vs_trl workload spends its CPU time, phase by phase.

    python benchmarks/profile_step.py --size small --mode full
    python benchmarks/profile_step.py --size medium --mode lora --cprofile runs/prof.txt

Runs `mogrpo train` on the vs_trl benchmark's model, prompts and settings (`--threads`, 1 by
default), with the trainer's phases and the update's parts wrapped in time counters: CPU time
(`time.process_time`) with one thread, wall time with more (CPU time then sums the threads).
Prints the median time per step of each phase over the steps after the warm-up; `--cprofile FILE` also writes cProfile's cumulative listing of the timed steps.
`--trl` then runs TRL's GRPOTrainer on the same model, prompts and threads
(`vs_trl/trl_worker.py --phases`) and prints its phases (wall time) beside them.
`--ops` counts instead the ATen operations each step dispatches outside its rollout (on a GPU
nearly each is a kernel launch; `vs_trl/op_count.py`), with `--trl` TRL's too, and prints the
operations whose counts differ most (the times printed then include the counting's overhead).
`--device cuda` runs on the GPU, where each phase's time ends with a synchronize; `--precision
bf16-mixed` trains in float32 weights under bf16 autocast (TRL with `bf16=True`).
"""

from __future__ import annotations

import argparse
import contextlib
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
import op_count  # noqa: E402
import torch_profile  # noqa: E402
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
SYNC = False  # on a GPU: wait for the queued kernels before reading the clock


def _now() -> float:
    if SYNC:
        torch.cuda.synchronize()
    return CLOCK()


COUNTER: op_count.OpCounter | None = None  # with --ops


def _wrap(owner, attr: str, label: str, spent: dict[str, float]) -> None:
    original = getattr(owner, attr)

    def timed(*args, **kwargs):
        start = _now()
        ops = COUNTER.total() if COUNTER is not None else 0
        try:
            return original(*args, **kwargs)
        finally:
            spent[label] += _now() - start
            if COUNTER is not None:
                spent[label + " ops"] += COUNTER.total() - ops

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
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32")
    parser.add_argument("--ops", action="store_true",
                        help="count each step's operations outside the rollout (and TRL's)")
    parser.add_argument("--torch-profile", type=Path, default=None,
                        help="write torch.profiler's summary of the timed steps, the rollout "
                        "left out (with --trl, TRL's beside it as FILE.trl.txt)")
    parser.add_argument("--prompt-sharing", choices=["auto", "on", "off"], default="auto",
                        help="train.prompt_sharing (each distinct prompt once in the forwards)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the printed tables to this file")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the median step and phases (ms) as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global CLOCK, SYNC
    SYNC = args.device == "cuda"
    CLOCK = time.process_time if args.threads == 1 and not SYNC else time.perf_counter
    settings = workload.Settings()
    model_dir = args.work / "models" / args.size
    if not (model_dir / "config.json").exists():
        workload.build_models(args.work, [args.size], settings.seed)
    data = workload.write_prompts(args.work / "prompts.jsonl", workload.prompt_rows(settings.seed))
    config = workload.mogrpo_config(str(model_dir), data, args.work / "run", args.steps,
                                    args.mode == "lora", settings, device=args.device,
                                    precision=args.precision)
    config["train"]["prompt_sharing"] = args.prompt_sharing
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
    global COUNTER
    counter = COUNTER = op_count.OpCounter() if args.ops else None
    counts: list[dict] = []
    tprof = (torch_profile.StepProfiler(args.torch_profile, args.device == "cuda")
             if args.torch_profile else None)
    if counter is not None or tprof is not None:  # the rollout is left out of both
        generate = GRPOTrainer.generate

        def uncounted(self: GRPOTrainer, *a, **kw):
            with (counter.pause() if counter else contextlib.nullcontext()), \
                    (tprof.paused() if tprof else contextlib.nullcontext()):
                return generate(self, *a, **kw)

        GRPOTrainer.generate = uncounted  # type: ignore[method-assign]

    def timed(self: GRPOTrainer) -> dict[str, float]:
        spent.clear()
        on = profiler is not None and self.step >= args.warmup
        if on:
            profiler.enable()
        if tprof is not None and self.step >= args.warmup:
            tprof.begin()
        start = _now()
        if counter is not None:
            with counter:
                metrics = train_step(self)
            counts.append(counter.take())
        else:
            metrics = train_step(self)
        spent["step"] = _now() - start
        if tprof is not None:
            tprof.end()
        if on:
            profiler.disable()
        per_step.append(dict(spent))
        return metrics

    GRPOTrainer.train_step = timed  # type: ignore[method-assign]
    mogrpo_main(["train", str(path)])
    timed_steps = per_step[args.warmup:]
    step = statistics.median(s["step"] for s in timed_steps)
    clock = ("wall, synchronized" if SYNC else
             "CPU" if args.threads == 1 else f"wall ({args.threads} threads)")
    lines = [f"{args.size} {args.mode} {args.precision} on {args.device}: median {clock} per "
             f"step {step * 1000:.1f} ms over {len(timed_steps)} steps"
             + (" (with the operation count's overhead)" if counter else "")]
    labels = [label for label, _, _ in PHASES] + ["  optimizer"]
    phases_ms = {}
    for label in labels:
        ms = phases_ms[label.strip()] = statistics.median(
            s.get(label, 0.0) for s in timed_steps) * 1000
        ops = (f"  {statistics.median(s.get(label + ' ops', 0) for s in timed_steps):6.0f} "
               "operations" if counter else "")
        lines.append(f"{label:32s} {ms:8.1f} ms  {ms / step / 10:5.1f}%{ops}")
    print("\n".join(lines))
    if tprof is not None:
        tprof.write(f"mogrpo {args.size} {args.mode} {args.precision} on {args.device}")
    mine = op_count.summarize(counts[args.warmup:]) if counter else None
    if args.trl:
        lines += trl_phases(args, model_dir, settings, mine)
    elif mine is not None:
        table = op_count.compare(mine, mine, ("mogrpo", "mogrpo"))
        print(table)
        lines.append(table)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "size": args.size, "mode": args.mode, "device": args.device,
            "precision": args.precision, "prompt_sharing": args.prompt_sharing,
            "threads": args.threads, "clock": clock, "steps": len(timed_steps),
            "step_ms": step * 1000, "phases_ms": phases_ms,
            **({"kernels": mine["kernels"]} if mine else {})}), encoding="utf-8")
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(80)
        args.cprofile.parent.mkdir(parents=True, exist_ok=True)
        args.cprofile.write_text(out.getvalue(), encoding="utf-8")


def trl_phases(args: argparse.Namespace, model_dir: Path, settings: workload.Settings,
               mine: dict | None) -> list[str]:
    """TRL's step on the same model and prompts (mogrpo's draw order), wall time per phase
    (and, with `mine`, mogrpo's operation counts beside TRL's); the lines printed."""
    rows = workload.prompt_rows(settings.seed)
    order = workload.write_prompts(args.work / f"order-{args.steps}.jsonl",
                                   workload.mogrpo_order(rows, args.steps, settings))
    out = args.work / "trl-phases.json"
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "MKL_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false",
           "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, str(HERE / "vs_trl" / "trl_worker.py"), "--model",
                    str(model_dir), "--prompts", str(order), "--steps", str(args.steps),
                    "--mode", args.mode, "--out", str(out), "--phases", "--device", args.device,
                    "--precision", args.precision] + (["--ops"] if mine else [])
                   + (["--torch-profile", str(args.torch_profile.with_suffix(".trl.txt")),
                       "--warmup", str(args.warmup)] if args.torch_profile else []),
                   check=True, env=env)
    record = json.loads(out.read_text(encoding="utf-8"))
    steps = record["step_s"][args.warmup:]
    phases = record["phases"][args.warmup:]
    lines = [f"TRL {args.size} {args.mode} {args.precision} on {args.device}: median wall per "
             f"step {statistics.median(steps) * 1000:.1f} ms over {len(steps)} steps"]
    for label in dict.fromkeys(k for p in phases for k in p):
        ms = statistics.median(p.get(label, 0.0) for p in phases) * 1000
        lines.append(f"{label:32s} {ms:8.1f} ms")
    if mine is not None:
        theirs = op_count.summarize(record["ops"][args.warmup:])
        lines.append("operations a step outside the rollout (mogrpo, TRL):")
        lines.append(op_count.compare(mine, theirs, ("mogrpo", "TRL")))
    print("\n".join(lines))
    return lines


if __name__ == "__main__":
    main()

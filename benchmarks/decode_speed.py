"""Decode speed of the rollout engines at equal batch: completion tokens per second.

Builds the vs_trl benchmark's Qwen2 models (`--arch`: Qwen3 or Llama of the same shapes) from
scratch (three sizes, one tokenizer), then times `generate_rollout` with `engine="hf"`
(transformers' generate) and `engine="native"` on the same prompts, K and settings,
alternating the engines run by run. No stop id can occur, so
every row decodes the full budget and the engines do the same number of tokens.

`native` runs twice: as a training rollout does, fusing and packing the weights at every call
(the update changes them between rollouts), and with the weights held between calls
(`held_projections`, as `mogrpo predict`, the quick eval and `mogrpo serve` decode batch after
batch with the same weights; on a copy of the model, so the first arm packs at every call).
Where the native engine runs its compiled CPU decode step (`kernels/cpu/decode_step.py`), a fourth
arm runs the native engine with the Python step instead, packing per call: the compiled step's
own speed-up. On CUDA, where the native engine replays its decode step from CUDA graphs
(`kernels/cuda/graph_step.py`, one capture per bucket of rows and rollout, counted in the
time), a fourth arm runs it with the eager step instead (MOGRPO_DECODE_GRAPH=0), packing per
call: the graphs' own speed-up.

    python benchmarks/decode_speed.py                     # all sizes, 5 repeats
    python benchmarks/decode_speed.py --sizes small --repeats 3
    python benchmarks/decode_speed.py --arch qwen3 --out benchmarks/results/decode_speed_qwen3
    python benchmarks/decode_speed.py --device cuda --sizes small large xl --prompts 16 --k 8

On a GPU (`--device cuda`) the work is asynchronous and CPU time means little: read the ratios
by wall time there (each call ends synchronized).

The process's malloc keeps freed memory (`train.host_memory: keep`, which `mogrpo train`,
`predict` and `serve` set on a CPU), for both engines alike.

Writes benchmarks/results/decode_speed.json and .md: median tokens/s per engine by wall time
and by process CPU time (with one torch thread, CPU time is the work done, and what other load
on a shared machine disturbs least), and the ratios native / hf with the min-max of the
per-repeat ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from mogrpo.kernels.cpu import decode_step as cpu_kernel
from mogrpo.kernels.cpu.host_memory import keep_freed_memory
from mogrpo.kernels.cpu.linear import cpu_name
from mogrpo.kernels.cuda import graph_step
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.rollout.projections import held_projections

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))
import workload  # noqa: E402  (the vs_trl models and prompts)

SIZES = list(workload.SIZES)
RESULTS = HERE / "results"


ARMS = ("hf", "native", "held")  # generate(); native packing per call; native, weights held
# on a CPU where the native engine runs its compiled decode step: native packing per call, with
# the step as PyTorch operations instead (MOGRPO_DECODE_KERNEL=0)
PYTHON_ARM = "python-step"
# on CUDA: native packing per call, with the eager decode step instead of the graphed one
# (MOGRPO_DECODE_GRAPH=0)
EAGER_ARM = "eager-step"


@contextlib.contextmanager
def arm_context(arm: str):
    """The Python decode step for PYTHON_ARM, the eager CUDA step for EAGER_ARM; nothing for
    the others."""
    if arm == EAGER_ARM:
        with mock.patch.dict(os.environ, {graph_step.ENV: "0"}):
            yield
        return
    if arm != PYTHON_ARM:
        yield
        return
    compiled = cpu_kernel.module
    cpu_kernel.module = lambda: None
    try:
        yield
    finally:
        cpu_kernel.module = compiled


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_engine(model, engine: str, tok, args) -> tuple[float, float]:
    """Completion tokens per second of wall time and of CPU time, of one rollout call
    (`engine`: "hf" or "native")."""
    settings = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0,
                                stop_token_ids=[len(tok) + 7])  # an id no model can emit
    prompts = [row["prompt"] for row in workload.prompt_rows(0, args.prompts)]
    synchronize(args.device)
    start, cpu = time.perf_counter(), time.process_time()
    ro = generate_rollout(model, tok, prompts, settings, num_generations=args.k,
                          max_prompt_length=64, engine=engine, generator_seed=0)
    synchronize(args.device)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tokens = int(ro.lengths.sum())
    return tokens / seconds, tokens / cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=workload.CPU_SIZES, choices=SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the vs_trl default, steadier on a shared machine)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--arch", choices=["qwen2", "qwen3", "gemma", "llama"], default="qwen2",
                        help="the models' family (the vs_trl sizes; default qwen2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_speed")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA GPU here")
    torch.set_num_threads(args.threads)
    # the process's malloc keeps freed memory, as in `mogrpo train`, `predict` and `serve` on a
    # CPU; both engines run in this process under the same setting
    host_memory = "keep" if keep_freed_memory() is None else "C library defaults"
    rows = []
    compiled = args.device == "cpu" and cpu_kernel.module() is not None
    graphed = args.device == "cuda" and not graph_step.disabled()
    # the native engine's own step against its fallback: compiled / Python, graphed / eager
    extra = PYTHON_ARM if compiled else EAGER_ARM if graphed else None
    step_ratio = "compiled_step_ratio" if compiled else "graph_step_ratio"
    arms = (*ARMS, extra) if extra else ARMS
    for size, model, tok in workload.loaded_models(args.sizes, arch=args.arch):
        model.to(args.device)
        held_model = copy.deepcopy(model)  # its projections are held; `model`'s are not
        models = {"hf": (model, "hf"), "native": (model, "native"),
                  "held": (held_model, "native"), PYTHON_ARM: (model, "native"),
                  EAGER_ARM: (model, "native")}
        with held_projections(held_model):
            for arm in arms:  # warm-up, not recorded
                with arm_context(arm):
                    time_engine(*models[arm], tok, args)
            runs: dict[str, list[float]] = {arm: [] for arm in arms}
            cpu: dict[str, list[float]] = {arm: [] for arm in arms}
            for i in range(args.repeats):
                for arm in arms if i % 2 == 0 else arms[::-1]:
                    with arm_context(arm):
                        wall_rate, cpu_rate = time_engine(*models[arm], tok, args)
                    runs[arm].append(wall_rate)
                    cpu[arm].append(cpu_rate)
        del held_model
        row = {"size": size, "parameters": model.num_parameters(),
               "batch": args.prompts * args.k, "new_tokens": args.new_tokens}
        pairs = [("native", "hf"), ("held", "hf")]
        if extra:  # the engine's step against its fallback, both packing per call
            pairs.append(("native", extra))
        for name, rates in (("", runs), ("cpu_", cpu)):
            for arm in arms:
                row[f"{arm}_tokens_per_{name or 'wall_'}s"] = statistics.median(rates[arm])
            for arm, base in pairs:
                key = f"{name}{arm}_ratio" if base == "hf" else f"{name}{step_ratio}"
                ratios = [n / h for n, h in zip(rates[arm], rates[base], strict=True)]
                row[key] = statistics.median(ratios)
                row[f"{key}_min"], row[f"{key}_max"] = min(ratios), max(ratios)
        row["runs"], row["cpu_runs"] = runs, cpu
        rows.append(row)
        print(f"{size}: CPU tok/s hf {row['hf_tokens_per_cpu_s']:.0f}, native "
              f"{row['native_tokens_per_cpu_s']:.0f} (x{row['cpu_native_ratio']:.2f}), held "
              f"{row['held_tokens_per_cpu_s']:.0f} (x{row['cpu_held_ratio']:.2f})"
              + (f", compiled / Python step x{row['cpu_compiled_step_ratio']:.2f}"
                 if compiled else "")
              + (f", by wall time graphed / eager step x{row['graph_step_ratio']:.2f}"
                 if graphed else ""))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
            "cpu": cpu_name(), "host_memory": host_memory, "device": args.device,
            "arch": args.arch,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
            "decode_step": "compiled" if compiled else "CUDA graphs" if graphed else
            "Python" if args.device == "cpu" else "eager"}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| size | parameters | batch × tokens | generate() tok/s (CPU) | native tok/s (CPU), "
             "packing per call | native / generate by CPU time | native tok/s (CPU), weights "
             "held | held / generate by CPU time | by wall time: native / generate, held / "
             "generate |" + (" compiled step / Python step by CPU time |" if compiled else "")
             + (" graphed step / eager step by wall time |" if graphed else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.2f} M | {r['batch']} × {r['new_tokens']} "
            f"| {r['hf_tokens_per_cpu_s']:.0f} | {r['native_tokens_per_cpu_s']:.0f} | "
            f"**{r['cpu_native_ratio']:.2f}×** ({r['cpu_native_ratio_min']:.2f}–"
            f"{r['cpu_native_ratio_max']:.2f}) | {r['held_tokens_per_cpu_s']:.0f} | "
            f"**{r['cpu_held_ratio']:.2f}×** ({r['cpu_held_ratio_min']:.2f}–"
            f"{r['cpu_held_ratio_max']:.2f}) | {r['native_ratio']:.2f}×, {r['held_ratio']:.2f}× |"
            + (f" {r['cpu_compiled_step_ratio']:.2f}× ({r['cpu_compiled_step_ratio_min']:.2f}–"
               f"{r['cpu_compiled_step_ratio_max']:.2f}) |" if compiled else "")
            + (f" **{r['graph_step_ratio']:.2f}×** ({r['graph_step_ratio_min']:.2f}–"
               f"{r['graph_step_ratio_max']:.2f}) |" if graphed else ""))
    gpu = f"GPU: {meta['gpu']} (read the wall-time column); " if meta["gpu"] else ""
    family = {"qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma", "llama": "Llama"}[args.arch]
    lines.append(f"\n{family} models of the vs_trl shapes. "
                 f"{gpu}CPU: {meta['cpu']}; torch {meta['torch']}, {args.threads} thread(s), "
                 f"{args.repeats} repeats, the {len(arms)} arms alternated (order reversed every "
                 f"repeat); host memory: {meta['host_memory']} (all arms, as `mogrpo train`, "
                 "`predict` and `serve` run on a CPU). Packing per call: as a training rollout "
                 "(the weights change between rollouts). Weights held: as `predict`, the quick "
                 "eval and `serve` (`held_projections`)." + (
                     " Native decode step compiled (`kernels/cpu/decode_step.py`); the Python step: "
                     "the same engine with it off (MOGRPO_DECODE_KERNEL=0), packing per call."
                     if compiled else
                     " Native decode step replayed from CUDA graphs (`kernels/cuda/graph_step.py`, "
                     "captures counted in the time); the eager step: the same engine with them "
                     "off (MOGRPO_DECODE_GRAPH=0), packing per call." if graphed else
                     " Native decode step: the Python step." if args.device == "cpu" else
                     " Native decode step: eager."))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

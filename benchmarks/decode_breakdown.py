"""Where a native rollout's time goes: weight preparation, prefill, decode steps, sampling, and
how much of a decode step is its four projections' products.

    python benchmarks/decode_breakdown.py                    # the vs_trl medium model
    python benchmarks/decode_breakdown.py --sizes small medium large --out runs/breakdown.md

Builds the vs_trl benchmark's Qwen2 models from scratch, then runs `generate_rollout` with the
native engine (16 rows × 32 tokens, no stop id, 1 torch thread, freed memory kept as `mogrpo
train` does) with CPU-time counters around `NativeDecoder.prefill`, `NativeDecoder.step` and
the decode loop. A second series replaces each layer's projection kernels inside the decode
step with one returning a preallocated zero tensor: the step time left is what the step's
other operations cost (norms, rotation, cache writes, attention, residuals, the output head),
and the difference is the products'. These run on the Python decode step; a last series runs
the compiled one (`kernels/cpu/decode_step.py`) where it is available. The counters read the
decoder's internals (its per-layer tuples): a diagnostic, not an API.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

import mogrpo.rollout.native as native
from mogrpo.kernels.cpu import decode_step as cpu_kernel
from mogrpo.kernels.cpu.host_memory import keep_freed_memory
from mogrpo.kernels.cpu.linear import cpu_name
from mogrpo.rollout.generate import SamplingSettings, generate_rollout

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))
import workload  # noqa: E402  (the vs_trl models and prompts)

PARTS = ("rollout", "decode loop", "prefill", "steps")


def _counted(totals: dict[str, float], label: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        start = time.process_time()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[label] += time.process_time() - start
    return counted


def _stubbed_layers(original):
    """`NativeDecoder._step_layers` with the q/k/v and gate/up products returning zeros of
    their output shape (one buffer per shape, so the stub allocates nothing per call), and the
    two that add into the residual stream returning it as it is."""
    buffers: dict[tuple[int, int], torch.Tensor] = {}

    def zeros(width: int):
        def product(x):
            key = (x.shape[0], width)
            if key not in buffers:
                buffers[key] = torch.zeros(key)
            return buffers[key]
        return product

    def unchanged(acc, x):
        return acc

    def layers(self, rows):
        return [(*layer[:2], zeros(p.qkv[0].shape[0]), unchanged, zeros(p.gate_up[0].shape[0]),
                 unchanged, *layer[6:]) for layer, p in zip(original(self, rows), self.plain,
                                                            strict=True)]
    return layers


def measure(model, tok, repeats: int, stub: bool, compiled: bool = False) -> dict[str, float]:
    """Median CPU ms per rollout of each part over `repeats` rollouts (after one warm-up), on
    the Python decode step, or on the compiled one (`compiled`, not with `stub`)."""
    settings = SamplingSettings(max_new_tokens=32, temperature=1.0,
                                stop_token_ids=[len(tok) + 7])  # no row stops early
    prompts = [row["prompt"] for row in workload.prompt_rows(0, 4)]
    saved = {name: getattr(native.NativeDecoder, name)
             for name in ("prefill", "step", "_step_layers")}
    saved_decode = native._decode
    per_part: dict[str, list[float]] = {p: [] for p in PARTS}
    totals: dict[str, float] = dict.fromkeys(PARTS, 0.0)
    native.NativeDecoder.prefill = _counted(totals, "prefill", saved["prefill"])
    native.NativeDecoder.step = _counted(totals, "steps", saved["step"])
    native._decode = _counted(totals, "decode loop", saved_decode)
    if stub:
        native.NativeDecoder._step_layers = _stubbed_layers(saved["_step_layers"])
    available = cpu_kernel.module
    if not compiled:
        cpu_kernel.module = lambda: None
    try:
        for i in range(repeats + 1):
            for part in PARTS:
                totals[part] = 0.0
            start = time.process_time()
            generate_rollout(model, tok, prompts, settings, num_generations=4,
                             max_prompt_length=64, engine="native", generator_seed=0)
            totals["rollout"] = time.process_time() - start
            if i:  # the first is the warm-up
                for part in PARTS:
                    per_part[part].append(totals[part] * 1e3)
    finally:
        for name, fn in saved.items():
            setattr(native.NativeDecoder, name, fn)
        native._decode = saved_decode
        cpu_kernel.module = available
    return {part: statistics.median(values) for part, values in per_part.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["medium"], choices=list(workload.SIZES))
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()
    lines = ["| size | rollout | weights, tokenising | prefill | decode steps (per step) | "
             "sampling | steps without the products (per step) | products per step | "
             "compiled step: rollout, decode steps (per step) |",
             "|---|---|---|---|---|---|---|---|---|"]
    compiled = cpu_kernel.module() is not None
    for size, model, tok in workload.loaded_models(args.sizes):
        whole, stubbed = measure(model, tok, args.repeats, False), \
            measure(model, tok, args.repeats, True)
        fast = measure(model, tok, args.repeats, False, compiled=True) if compiled else None
        steps = 31  # 32 tokens: the prefill gives the first logits
        lines.append(
            f"| {size} | {whole['rollout']:.1f} ms | "
            f"{whole['rollout'] - whole['decode loop']:.1f} ms | {whole['prefill']:.1f} ms | "
            f"{whole['steps']:.1f} ms ({whole['steps'] / steps:.2f}) | "
            f"{whole['decode loop'] - whole['prefill'] - whole['steps']:.1f} ms | "
            f"{stubbed['steps']:.1f} ms ({stubbed['steps'] / steps:.2f}) | "
            f"{(whole['steps'] - stubbed['steps']) / steps:.2f} ms | "
            + (f"{fast['rollout']:.1f} ms, {fast['steps']:.1f} ms ({fast['steps'] / steps:.2f}) |"
               if fast else "not available here |"))
        print(lines[-1], flush=True)
    lines.append(f"\nCPU time, median of {args.repeats} rollouts of 16 rows × 32 tokens after a "
                 f"warm-up; CPU: {cpu_name()}; torch {torch.__version__}, 1 thread.")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

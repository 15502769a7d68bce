"""Decode speed of the rollout engines at equal batch: completion tokens per second.

Builds the vs_trl benchmark's Qwen2 models from scratch (three sizes, one tokenizer), then times
`generate_rollout` with `engine="hf"` (transformers' generate) and `engine="native"` on the
same prompts, K and settings, alternating the two engines run by run. No stop id can occur, so
every row decodes the full budget and both engines do the same number of tokens.

    python benchmarks/decode_speed.py                     # all sizes, 5 repeats
    python benchmarks/decode_speed.py --sizes small --repeats 3

The process's malloc keeps freed memory (`train.host_memory: keep`, which `mogrpo train`,
`predict` and `serve` set on a CPU), for both engines alike.

Writes benchmarks/results/decode_speed.json and .md: median tokens/s per engine by wall time
and by process CPU time (with one torch thread, CPU time is the work done, and what other load
on a shared machine disturbs least), and the ratios native / hf with the min-max of the
per-repeat ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from mogrpo.algo.cpu_linear import cpu_name
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.train.host_memory import keep_freed_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))
import workload  # noqa: E402  (the vs_trl models and prompts)

SIZES = list(workload.SIZES)
RESULTS = HERE / "results"


def time_engine(model, tok, engine: str, args) -> tuple[float, float]:
    """Completion tokens per second of wall time and of CPU time, of one rollout call."""
    settings = SamplingSettings(max_new_tokens=args.new_tokens, temperature=1.0,
                                stop_token_ids=[len(tok) + 7])  # an id no model can emit
    prompts = [row["prompt"] for row in workload.prompt_rows(0, args.prompts)]
    start, cpu = time.perf_counter(), time.process_time()
    ro = generate_rollout(model, tok, prompts, settings, num_generations=args.k,
                          max_prompt_length=64, engine=engine, generator_seed=0)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    tokens = int(ro.lengths.sum())
    return tokens / seconds, tokens / cpu_seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=SIZES, choices=SIZES)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (1: the vs_trl default, steadier on a shared machine)")
    parser.add_argument("--out", type=Path, default=RESULTS / "decode_speed")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    # the process's malloc keeps freed memory, as in `mogrpo train`, `predict` and `serve` on a
    # CPU; both engines run in this process under the same setting
    host_memory = "keep" if keep_freed_memory() is None else "C library defaults"
    rows = []
    for size, model, tok in workload.loaded_models(args.sizes):
        for engine in ("hf", "native"):  # warm-up, not recorded
            time_engine(model, tok, engine, args)
        runs: dict[str, list[float]] = {"hf": [], "native": []}
        cpu: dict[str, list[float]] = {"hf": [], "native": []}
        for _ in range(args.repeats):
            for engine in ("hf", "native"):
                wall_rate, cpu_rate = time_engine(model, tok, engine, args)
                runs[engine].append(wall_rate)
                cpu[engine].append(cpu_rate)
        ratios = [n / h for n, h in zip(runs["native"], runs["hf"], strict=True)]
        cpu_ratios = [n / h for n, h in zip(cpu["native"], cpu["hf"], strict=True)]
        rows.append({
            "size": size, "parameters": model.num_parameters(),
            "batch": args.prompts * args.k, "new_tokens": args.new_tokens,
            "hf_tokens_per_s": statistics.median(runs["hf"]),
            "native_tokens_per_s": statistics.median(runs["native"]),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "runs": runs,
            "hf_tokens_per_cpu_s": statistics.median(cpu["hf"]),
            "native_tokens_per_cpu_s": statistics.median(cpu["native"]),
            "cpu_ratio": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
            "cpu_ratio_max": max(cpu_ratios), "cpu_runs": cpu,
        })
        r = rows[-1]
        print(f"{size}: wall hf {r['hf_tokens_per_s']:.0f} / native "
              f"{r['native_tokens_per_s']:.0f} tok/s x{r['ratio']:.2f}; CPU hf "
              f"{r['hf_tokens_per_cpu_s']:.0f} / native {r['native_tokens_per_cpu_s']:.0f} "
              f"tok/s x{r['cpu_ratio']:.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": args.threads, "repeats": args.repeats,
            "cpu": cpu_name(), "host_memory": host_memory}
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    lines = ["| size | parameters | batch × tokens | generate() tok/s (wall / CPU) | "
             "native tok/s (wall / CPU) | native / generate by wall time | "
             "native / generate by CPU time |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['size']} | {r['parameters'] / 1e6:.2f} M | {r['batch']} × "
                     f"{r['new_tokens']} | {r['hf_tokens_per_s']:.0f} / "
                     f"{r['hf_tokens_per_cpu_s']:.0f} | {r['native_tokens_per_s']:.0f} / "
                     f"{r['native_tokens_per_cpu_s']:.0f} | {r['ratio']:.2f}× "
                     f"({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) | **{r['cpu_ratio']:.2f}×** "
                     f"({r['cpu_ratio_min']:.2f}–{r['cpu_ratio_max']:.2f}) |")
    lines.append(f"\nCPU: {meta['cpu']}; torch {meta['torch']}, {args.threads} thread(s), "
                 f"{args.repeats} repeats alternated; host memory: {meta['host_memory']} "
                 "(both engines, as `mogrpo train`, `predict` and `serve` run on a CPU).")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

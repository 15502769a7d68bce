"""Two of mogrpo's CPU choices timed against their alternative, alternated in one process.

    python benchmarks/cpu_choices.py                       # all sizes, 12 repeats
    python benchmarks/cpu_choices.py --sizes small --repeats 6

On the vs_trl benchmark's models, prompts and settings (16 rows: 4 prompts x 4 completions,
32 new tokens, 1 torch thread):

- **decode weights**: a native rollout with every decode weight packed for MKL's packed product
  (`cpu_linear.decode_on_mkl`, chosen on Intel CPUs) against the rule for other CPUs: large
  weights packed for oneDNN, the rest as they are.
- **update forward**: the forward and backward of the update's log-probs on mogrpo's own
  forward (`rollout.scoring.score_hidden` with gradients, chosen on CPUs where `trains_here`)
  against the model's Hugging Face forward, on one rollout's completions.

Each repeat runs both arms one after the other (order swapped every repeat) and records their
CPU time; the first repeat is a warm-up. Because both arms share the process, the machine's
drift between runs (large on shared virtual machines) falls on both alike. Writes
benchmarks/results/cpu_choices.json and .md: the median CPU time of each arm and the median
(min-max) of the per-repeat ratios (alternative / mogrpo's choice: above 1, the choice is the
faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.kernels.cpu import linear as cpu_linear
from mogrpo.kernels.cpu.host_memory import keep_freed_memory
from mogrpo.kernels.cpu.linear import cpu_name
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.rollout.scoring import score_hidden, trains_here

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))
import workload  # noqa: E402  (the vs_trl models and prompts)

SIZES = list(workload.SIZES)


def alternate(arms: dict[str, Callable[[], None]], repeats: int) -> dict[str, list[float]]:
    """CPU seconds of each arm per repeat after a warm-up, the order swapped every repeat."""
    names = list(arms)
    spent: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats + 1):
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.process_time()
            arms[name]()
            if i:
                spent[name].append(time.process_time() - start)
    return spent


def rollout_arm(model, tok, on_mkl: bool) -> Callable[[], None]:
    settings = SamplingSettings(max_new_tokens=32, temperature=1.0,
                                stop_token_ids=[len(tok) + 7])  # no row stops early
    prompts = [row["prompt"] for row in workload.prompt_rows(0, 4)]

    def run() -> None:
        cpu_linear.decode_on_mkl = lambda: on_mkl
        generate_rollout(model, tok, prompts, settings, num_generations=4,
                         max_prompt_length=64, engine="native", generator_seed=0)
    return run


def update_arm(model, batch, own: bool) -> Callable[[], None]:
    def run() -> None:
        logp, _ = completion_logprobs(model, *batch, with_entropy=True,
                                      forward=score_hidden if own else None)
        logp.sum().backward()
        model.zero_grad(set_to_none=True)
    return run


def row(size: str, choice: str, spent: dict[str, list[float]]) -> dict:
    mine, other = spent["mogrpo"], spent["alternative"]
    ratios = [o / m for m, o in zip(mine, other, strict=True)]
    return {"size": size, "choice": choice, "mogrpo_ms": statistics.median(mine) * 1e3,
            "alternative_ms": statistics.median(other) * 1e3,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "runs": spent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=workload.CPU_SIZES, choices=SIZES)
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "cpu_choices")
    args = parser.parse_args()
    torch.set_num_threads(1)
    keep_freed_memory()  # as `mogrpo train` runs on a CPU
    chosen = cpu_linear.decode_on_mkl()
    rows = []
    for size, model, tok in workload.loaded_models(args.sizes):
        spent = alternate({"mogrpo": rollout_arm(model, tok, chosen),
                           "alternative": rollout_arm(model, tok, not chosen)}, args.repeats)
        cpu_linear.decode_on_mkl = lambda: chosen
        rows.append(row(size, "decode weights", spent))
        settings = SamplingSettings(max_new_tokens=32, temperature=1.0)
        prompts = [r["prompt"] for r in workload.prompt_rows(0, 4)]
        ro = generate_rollout(model, tok, prompts, settings, num_generations=4,
                              max_prompt_length=64, engine="native", generator_seed=0)
        batch = (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
        model.train()
        if not trains_here(model):
            raise SystemExit(f"{size}: mogrpo's forward does not train this model here")
        spent = alternate({"mogrpo": update_arm(model, batch, True),
                           "alternative": update_arm(model, batch, False)}, args.repeats)
        rows.append(row(size, "update forward", spent))
        for r in rows[-2:]:
            print(f"{size} {r['choice']}: mogrpo {r['mogrpo_ms']:.1f} ms, alternative "
                  f"{r['alternative_ms']:.1f} ms, x{r['ratio']:.3f}", flush=True)
    layout = "packed for MKL" if chosen else "packed for oneDNN from 2^17, the rest as they are"
    meta = {"torch": torch.__version__, "repeats": args.repeats, "cpu": cpu_name(),
            "decode_layout_chosen": layout}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    arms = {"decode weights": (layout, "the other rule"),
            "update forward": ("mogrpo's forward", "the model's forward")}
    lines = ["| size | choice | mogrpo's arm | alternative | CPU mogrpo / alternative | "
             "alternative / mogrpo (min–max) |", "|---|---|---|---|---|---|"]
    for r in rows:
        mine, other = arms[r["choice"]]
        lines.append(f"| {r['size']} | {r['choice']} | {mine} | {other} | "
                     f"{r['mogrpo_ms']:.1f} / {r['alternative_ms']:.1f} ms | "
                     f"**{r['ratio']:.3f}×** ({r['ratio_min']:.2f}–{r['ratio_max']:.2f}) |")
    lines.append(f"\nCPU: {meta['cpu']}; torch {meta['torch']}, 1 thread, {args.repeats} "
                 "repeats after a warm-up, the arms alternated in one process. Decode weights: "
                 "a native rollout of 16 rows x 32 tokens. Update forward: the forward and "
                 "backward of one such rollout's log-probs.")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()

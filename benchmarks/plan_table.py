"""What fits where: the memory planner over models × training methods × GPU sizes.

    python benchmarks/plan_table.py            # writes benchmarks/results/plan_table.md

Each cell is `mogrpo plan`'s verdict for one GPU (`mogrpo.memory.plan_run`, device "cuda", the
1 GiB CUDA context and allocator term included): the planned peak when the run fits as
configured, else the first rung of the ladder after which it fits (with every cheaper change
before it), else "does not fit". Computed from the published config.json files in
`benchmarks/model_configs/` — nothing is measured here and nothing is downloaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mogrpo.config import RunConfig
from mogrpo.memory import GIB, plan_run

HERE = Path(__file__).parent
CONFIGS = HERE / "model_configs"
OUT = HERE / "results" / "plan_table.md"

MODELS = {"Qwen2.5-0.5B": "qwen2.5-0.5b", "Qwen2.5-1.5B": "qwen2.5-1.5b",
          "Llama-3.1-8B": "llama-3.1-8b", "Qwen2.5-14B": "qwen2.5-14b"}
METHODS: dict[str, dict[str, Any]] = {
    "full (bf16-mixed, AdamW)": {},
    "LoRA r 16": {"lora": {"enabled": True, "r": 16, "alpha": 32}},
    "QLoRA r 16 (4-bit base)": {"lora": {"enabled": True, "r": 16, "alpha": 32},
                                "model": {"load_in_4bit": True}},
    "full, 8-bit AdamW": {"train": {"optimizer": "adamw_8bit"}},
}
GPUS_GIB = (24, 40, 80)
PROMPTS, K, PROMPT, COMPLETION, MICRO_BATCH = 8, 8, 512, 512, 4
SHAPE = (f"{PROMPTS} prompts × {K} completions a step, {PROMPT} prompt + {COMPLETION} completion "
         f"tokens, micro-batch {MICRO_BATCH} (gradient accumulation "
         f"{PROMPTS * K // MICRO_BATCH}), gradient checkpointing on, fused SDPA attention, "
         "bf16-mixed precision, a KL reference (β 0.04: a frozen copy under full fine-tuning, "
         "the base with adapters off under LoRA), all 64 completions generated at once by the "
         "native engine, one GPU, one process")


def run_config(method: str) -> RunConfig:
    """The GRPO run of the table's shape with `method`'s changes."""
    data: dict[str, Any] = {
        "model": {"name_or_path": "planned", "precision": "bf16-mixed",
                  "gradient_checkpointing": True, "attn_implementation": "sdpa"},
        "tasks": {"t": {"data": "x.jsonl", "rewards": ["mc_correct"], "beta": 0.04}},
        "rollout": {"num_generations": K, "max_prompt_length": PROMPT,
                    "max_completion_length": COMPLETION, "max_seq_length": PROMPT + COMPLETION},
        "train": {"micro_batch_size": MICRO_BATCH,
                  "gradient_accumulation_steps": PROMPTS * K // MICRO_BATCH},
    }
    for section, values in METHODS[method].items():
        data[section] = {**data.get(section, {}), **values}
    return RunConfig.model_validate(data)


def cell(model: dict, method: str, gpu_gib: int, notes: list[str], where: str) -> str:
    """`fits, 21.3`, `rung 3 (8-bit AdamW states) → 22.9 [n]` or `does not fit (63.5)`; a
    rung's note (appended to `notes`) gives every `--set` up to it."""
    plan = plan_run(run_config(method), gpu_gib * GIB, model_config=model)
    if plan.fits:
        return f"fits, {plan.estimate.total / GIB:.1f}"
    first = plan.first_fit
    if first is None:
        best = plan.steps[-1].total if plan.steps else plan.estimate.total
        return f"does not fit ({best / GIB:.1f} after every rung)"
    notes.append(f"{where}: `" + " ".join(f"--set {o}" for o in plan.overrides(first)) + "`")
    rung = plan.steps.index(first) + 1
    return f"rung {rung}: {first.change.split(':')[0]} → {first.total / GIB:.1f} [{len(notes)}]"


def table() -> tuple[str, list[str]]:
    """The Markdown table (one row per model and method, one column per GPU size) and its
    notes: the flags of each fitting rung."""
    lines = ["| model | method | as configured | "
             + " | ".join(f"{g} GiB GPU" for g in GPUS_GIB) + " |",
             "|---|---|---|" + "---|" * len(GPUS_GIB)]
    notes: list[str] = []
    for name, file in MODELS.items():
        model = json.loads((CONFIGS / f"{file}.json").read_text(encoding="utf-8"))
        for method in METHODS:
            configured = plan_run(run_config(method), None, model_config=model).estimate.total
            cells = [cell(model, method, g, notes, f"{name}, {method}, {g} GiB")
                     for g in GPUS_GIB]
            lines.append(f"| {name} | {method} | {configured / GIB:.1f} | "
                         + " | ".join(cells) + " |")
    return "\n".join(lines), notes


def main() -> None:
    rows, notes = table()
    text = f"""# What fits where: the memory planner's table

`python benchmarks/plan_table.py` — planned, not measured: `mogrpo plan` for each model's
published config.json (`benchmarks/model_configs/`), training method and GPU size.

Shape: {SHAPE}.

Figures are planned peaks in GiB. A cell is "fits" with the peak, or the ladder's first rung
after which the run fits (the ladder is cumulative and cheapest first: rung 3 comes with
rungs 1 and 2; the numbered note gives the `--set` flags of all of them) with the peak after
it, or "does not fit" with the peak after every rung.
GPU sizes are GiB (an "80 GB" H100 reports 79.6 GiB, an A100 40 GB 39.4 GiB: leave headroom).
The 4-bit and 8-bit rows need a CUDA GPU and bitsandbytes (`mogrpo[gpu]`). What the planner
counts, term by term: `docs/memory.md`.

{rows}

Reading it: the QLoRA rows plan more than the LoRA rows as configured because with a 4-bit
base under mixed precision the norms are float32 (`mogrpo.modeling.quantize`), so the residual
stream, the activations and the KV cache are float32 — twice the bf16 figures; here the
generation of all 64 completions at once is the peak, and a smaller
`rollout.generation_batch_size` (no cost in quality) is the first rung. The ladder takes, in
order, every rung that saves something, so a fitting rung's flags can include an earlier one
that did not fit on its own (the 8-bit optimizer before shorter completions and pure bf16 in
notes 2 and 5).

Notes: the flags for `mogrpo train` (or `mogrpo plan` to check them):

{chr(10).join(f"{n}. {note}" for n, note in enumerate(notes, 1))}
"""
    OUT.write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

"""Measured vs estimated memory of one training micro-batch (forward + backward) on CPU.

    python benchmarks/memory_estimate.py --out benchmarks/results/memory_estimate.md

For tiny Llama models of a few sizes (full fine-tuning and LoRA, with and without gradient
checkpointing), each case runs in its own process: load the model in fp32, one warm-up step
(so lazy kernel setup and the AdamW states are out of the way), `zero_grad(set_to_none=True)`
as the trainer does, reset the peak RSS (Linux `clear_refs`), then one micro-batch through
`completion_logprobs` + `grpo_loss` + backward. Peak RSS growth is compared with the planner's
training-phase terms for `device="cpu"`: activations + logits + gradients (which the backward
allocates).

A second column counts the bytes autograd actually saves (`saved_tensors_hooks`, each storage
once): it checks the per-layer formula without the allocator in the way.

Children run with MALLOC_MMAP_THRESHOLD_=65536 so glibc serves every tensor above 64 KiB with
mmap and returns it on free; without it, freed memory stays in the heap and RSS says little.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

CASES = [  # hidden, layers, heads, micro-batch, prompt, completion, lora, checkpointing, dtype
    (128, 2, 4, 4, 64, 64, False, False, "float32"),
    (256, 4, 4, 8, 128, 128, False, False, "float32"),
    (512, 6, 8, 8, 128, 128, False, False, "float32"),
    (512, 6, 8, 8, 128, 128, True, False, "float32"),
    (512, 6, 8, 8, 128, 128, False, True, "float32"),
    (512, 6, 8, 8, 128, 128, True, True, "float32"),
    (512, 6, 8, 8, 128, 128, False, False, "bfloat16"),
    (512, 6, 8, 8, 128, 128, True, False, "bfloat16"),
    (768, 8, 12, 4, 192, 192, True, False, "float32"),
]
VOCAB = 4096


def texts(n: int = 4000, seed: int = 0) -> list[str]:
    """Random syllable words, so the byte-level BPE can learn a vocabulary of VOCAB tokens."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(n)]


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(case: dict) -> dict:
    """One measurement, in this (fresh) process."""
    import gc

    import torch

    from mogrpo.algo.logprobs import completion_logprobs
    from mogrpo.algo.loss import grpo_loss
    from mogrpo.config import RunConfig
    from mogrpo.memory import estimate, load_model_config, reset_peak
    from mogrpo.modeling.load import LoraSettings, load_policy
    from mogrpo.trainer.optim import build_optimizer

    torch.manual_seed(0)
    lora = LoraSettings(r=8) if case["lora"] else None
    model, _ = load_policy(case["dir"], dtype=case["dtype"], lora=lora,
                           gradient_checkpointing=case["checkpointing"])
    model.train()
    optimizer = build_optimizer(model, 1e-4, 0.0, (0.9, 0.999))
    vocab = load_model_config(case["dir"]).vocab_size

    def step(b: int, p: int, c: int, hook: bool = False) -> int:
        prompt = torch.randint(10, vocab, (b, p))
        completion = torch.randint(10, vocab, (b, c))
        ones_p, ones_c = torch.ones(b, p, dtype=torch.long), torch.ones(b, c, dtype=torch.long)
        saved: dict[int, int] = {}
        params = {q.untyped_storage().data_ptr() for q in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            s = t.untyped_storage()
            if s.data_ptr() not in params:
                saved[s.data_ptr()] = max(saved.get(s.data_ptr(), 0), s.nbytes())
            return t

        hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if hook else None
        if hooks:
            hooks.__enter__()
        logp, _ = completion_logprobs(model, prompt, ones_p, completion, ones_c, with_entropy=True)
        ref = (logp.detach() - 0.1)
        out = grpo_loss(logp, logp.detach(), torch.randn(b), ones_c, normalizer=float(b),
                        ref_logp=ref, beta=0.04)
        if hooks:
            hooks.__exit__(None, None, None)
        out.loss.backward()
        return sum(saved.values())

    step(1, 8, 8)  # warm-up: kernels, threads, AdamW states
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    gc.collect()
    b, p, c = case["micro_batch"], case["prompt"], case["completion"]
    reset_peak("cpu")
    before = _status("VmRSS")
    start = time.perf_counter()
    saved = step(b, p, c, hook=not case["checkpointing"])
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")

    run = RunConfig.model_validate({
        "model": {"name_or_path": case["dir"], "dtype": case["dtype"],
                  "gradient_checkpointing": case["checkpointing"]},
        "lora": {"enabled": case["lora"], "r": 8},
        "rollout": {"num_generations": 2, "max_prompt_length": p, "max_completion_length": c,
                    "max_seq_length": p + c},
        "train": {"micro_batch_size": b},
    })
    est = estimate(load_model_config(case["dir"]), run, device="cpu")
    return {**case, "vocab": vocab, "measured": peak - before, "saved": saved, "seconds": seconds,
            "estimate": est["activations"] + est["logits"] + est["gradients"],
            # autograd keeps the fp32 log-softmax rows (the logits themselves in fp32)
            "est_saved": est["activations"] + b * vocab * 4 * (c + 1 if case["dtype"] == "float32"
                                                                else c)}


def to_markdown(rows: list[dict]) -> str:
    mib = 2**20
    head = ("| hidden × layers | micro-batch × tokens | training | measured RSS growth | "
            "estimate | error | autograd saved | formula | error |")
    lines = [head, "|---" * 9 + "|"]
    for r in rows:
        kind = ("LoRA r 8" if r["lora"] else "full") + (" + ckpt" if r["checkpointing"] else "")
        kind += ", bf16" if r["dtype"] == "bfloat16" else ""
        err = r["estimate"] / r["measured"] - 1
        if r["checkpointing"]:
            exact = "— | — | —"
        else:
            exact = (f"{r['saved'] / mib:.1f} MiB | {r['est_saved'] / mib:.1f} MiB | "
                     f"{r['est_saved'] / r['saved'] - 1:+.1%}")
        lines.append(f"| {r['hidden']} × {r['layers']} | {r['micro_batch']} × "
                     f"{r['prompt'] + r['completion']} | {kind} | {r['measured'] / mib:.1f} MiB | "
                     f"{r['estimate'] / mib:.1f} MiB | **{err:+.1%}** | {exact} |")
    return "\n".join(lines)


NOTES = """
*measured RSS growth*: peak RSS during one micro-batch's forward + backward minus RSS before it
(after a warm-up step and `zero_grad(set_to_none=True)`, as in the trainer). *estimate*: the
planner's `activations + logits + gradients` for `device="cpu"`. *autograd saved*: bytes of
the tensors autograd keeps for backward (each storage once), against the planner's activations
plus the log-softmax rows it keeps — a check of the per-layer formula alone.

How to read the errors:

- The per-layer formula is within about ±2 % of what autograd really keeps, fp32 and bf16,
  full fine-tuning and LoRA.
- The planner counts every gradient as live at the peak; in a step's first micro-batch
  (gradients set to None) backward allocates them while it frees activations, so the real
  peak holds between none and most of them. Without checkpointing the peak comes early in
  backward (full fine-tuning 512 × 6: measured 676 MiB = activations + logits 666 MiB + almost
  no gradients; the estimate with all 104 MiB of them is +14 %); with checkpointing activations
  are small and the peak comes later, with about 60 % of the gradients. From the second
  micro-batch of an accumulation on, and through the optimizer step, all are resident, so the
  planner keeps them in training: it errs high (up to +16 %), low by at most ~1 %. (The trainer
  frees them after the step, so the planner leaves them out of the next generation.) LoRA's gradients are
  tiny: within ±3 %.
- What RSS adds that the planner does not model: glibc and torch's CPU allocator (rounding,
  per-thread arenas; MALLOC_MMAP_THRESHOLD_ keeps that small here), kernel workspaces, and Python
  objects of the autograd graph — a few MiB, which is why the smallest model's error is noise.
- On a GPU the CUDA caching allocator adds fragmentation instead; the planner's fixed 1 GiB
  "CUDA context + allocator" term stands for the context and that slack. It is not measured
  here (no GPU on this machine).
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/memory_estimate.md"))
    parser.add_argument("--work", type=Path, default=Path("runs/bench-memory"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return

    from mogrpo.modeling.tiny import build_tiny_model

    corpus = texts()
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    rows = []
    for hidden, layers, heads, mb, prompt, completion, lora, ckpt, dtype in CASES:
        model_dir = args.work / f"tiny-{hidden}x{layers}"
        if not (model_dir / "config.json").exists():
            build_tiny_model(model_dir, corpus, hidden_size=hidden, num_layers=layers,
                             num_heads=heads, vocab_size=VOCAB, max_position_embeddings=1024)
        case = {"dir": str(model_dir), "hidden": hidden, "layers": layers, "micro_batch": mb,
                "prompt": prompt, "completion": completion, "lora": lora, "checkpointing": ckpt,
                "dtype": dtype}
        out = subprocess.run([sys.executable, __file__, "--child", json.dumps(case)], env=env,
                             check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
        print(to_markdown(rows[-1:]).splitlines()[-1], flush=True)
    import torch

    machine = (f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
               f"torch {torch.__version__}, vocabulary {rows[0]['vocab']} tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(f"# Memory planner: measured vs estimated (CPU)\n\n{machine}\n\n"
                        f"{to_markdown(rows)}\n{NOTES}", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""The memory planner against measurement at real shapes: 2 GRPO steps per configuration.

    python benchmarks/memory_vs_plan.py --cases qwen2.5-0.5b/lora+ckpt       # one at a time
    python benchmarks/memory_vs_plan.py --cases ... --measure profiler       # CPU: slow, exact
    python benchmarks/memory_vs_plan.py --report                             # the table only
    python benchmarks/memory_vs_plan.py --cases ... --out benchmarks/results/h200/memory_vs_plan

Random-weight models built from the published configs in `benchmarks/model_configs/`
(`AutoModelForCausalLM.from_config`, nothing downloaded; a small byte-level BPE tokenizer, the
model keeping its published vocabulary size), trained by `mogrpo.train` for 2 GRPO steps: 4
prompts × 2 completions, 64 prompt + 32 completion tokens, one micro-batch of 8, a KL
reference (β 0.04). Each configuration runs in a process of its own and records:

- RSS peak: the process's resident-set high-water mark over the steps (`memory/peak_gib` of
  metrics.jsonl: VmHWM, reset at each step's start). Runs set `MALLOC_MMAP_THRESHOLD_=65536`,
  so glibc maps every block of 64 KiB or more on its own and returns it when freed: RSS then
  follows the live tensors rather than what the allocator keeps.
- fixed overhead: RSS after Python, torch, transformers and mogrpo are imported, before any
  model loads — the part of RSS that is not tensors and that the planner does not count.
- measured: on CPU by default RSS peak − fixed overhead (`--measure rss`: costs nothing, counts
  a little more than tensors — the tokenizer, the data, Python objects, small blocks malloc
  keeps); with `--measure profiler` the tensor peak from torch.profiler's record of every
  allocation and free (`profile_memory`) over the two steps' windows — exact for tensors, but
  recording each of a decode loop's allocations at this size is far slower; on a
  GPU `torch.cuda.max_memory_allocated`.

The plan is `mogrpo.memory.estimate` for the same run config on the device the case ran on
("cpu": no CUDA context term; "cuda": less its CUDA context term, which
`max_memory_allocated` does not see), computed when the report is written, so a change to the
planner needs no new measurement. Results accumulate in OUT.json (`--out`, default
`benchmarks/results/memory_vs_plan`: the CPU's), the table goes to OUT.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
CONFIGS = HERE / "model_configs"
RESULTS = HERE / "results"
PROMPTS, K, PROMPT, COMPLETION = 4, 2, 64, 32
TOKENIZER_VOCAB = 4096
CASES = {  # name: model config, LoRA, gradient checkpointing, model.precision
    "qwen2.5-0.5b/full": ("qwen2.5-0.5b", False, False, "fp32"),
    "qwen2.5-0.5b/full+ckpt": ("qwen2.5-0.5b", False, True, "fp32"),
    "qwen2.5-0.5b/full-bf16-mixed": ("qwen2.5-0.5b", False, False, "bf16-mixed"),
    "qwen2.5-0.5b/full-adamw8bit": ("qwen2.5-0.5b", False, False, "fp32"),
    "qwen2.5-0.5b/lora": ("qwen2.5-0.5b", True, False, "fp32"),
    "qwen2.5-0.5b/lora-bf16-mixed": ("qwen2.5-0.5b", True, False, "bf16-mixed"),
    "qwen2.5-0.5b/lora+ckpt": ("qwen2.5-0.5b", True, True, "fp32"),
    "llama-3.2-1b/lora": ("llama-3.2-1b", True, False, "fp32"),
    "llama-3.2-1b/lora+ckpt": ("llama-3.2-1b", True, True, "fp32"),
    "qwen2.5-1.5b/lora": ("qwen2.5-1.5b", True, False, "fp32"),
    "qwen2.5-1.5b/lora+ckpt": ("qwen2.5-1.5b", True, True, "fp32"),
    "qwen2.5-0.5b/qlora": ("qwen2.5-0.5b", True, False, "fp32"),
    "qwen2.5-0.5b/qlora-bf16-mixed": ("qwen2.5-0.5b", True, False, "bf16-mixed"),
    "qwen2.5-0.5b/qlora+emb4": ("qwen2.5-0.5b", True, False, "fp32"),
    "qwen2.5-1.5b/qlora": ("qwen2.5-1.5b", True, False, "fp32"),
    "qwen2.5-1.5b/qlora+emb4": ("qwen2.5-1.5b", True, False, "fp32"),
}
BASES = {  # a configuration's kind (after the "/"): the model settings of its quantised base
    "qlora": {"load_in_4bit": True},
    "qlora-bf16-mixed": {"load_in_4bit": True},
    "qlora+emb4": {"load_in_4bit": True, "embeddings_in_4bit": True},
}
OPTIMIZERS = {"full-adamw8bit": "adamw_8bit"}  # a kind's train.optimizer (else adamw)


def random_reward(prompts: list, completions: list, **columns: object) -> list[float]:
    """A score per completion that varies within every group, so each step has a gradient."""
    return [random.random() for _ in completions]


def run_config(case: str, model_dir: str, data: str, out: str) -> dict:
    """The mogrpo run config of `case` (a dict `mogrpo.train` takes)."""
    _, lora, ckpt, precision = CASES[case]
    return {
        "seed": 0,
        "model": {"name_or_path": model_dir, "precision": precision, "use_chat_template": False,
                  "gradient_checkpointing": ckpt, **BASES.get(case.split("/")[1], {})},
        "lora": {"enabled": lora, "r": 16, "alpha": 32, "dropout": 0.0,
                 "target_modules": "all-linear"},
        "tasks": {"t": {"data": data, "beta": 0.04,
                        "rewards": [{"fn": f"{Path(__file__).resolve()}:random_reward"}]}},
        "rollout": {"num_generations": K, "max_prompt_length": PROMPT,
                    "max_completion_length": COMPLETION, "max_seq_length": PROMPT + COMPLETION},
        "train": {"max_steps": 2, "micro_batch_size": PROMPTS * K, "warmup_steps": 0,
                  "gradient_accumulation_steps": 1,
                  "optimizer": OPTIMIZERS.get(case.split("/")[1], "adamw")},
        "sft": {"enabled": False},
        "eval": {"at_start": False, "every_steps": 0},
        "output": {"dir": out, "save_every": 0, "save_merged": False, "overwrite": True},
        "logging": {"trackers": [], "progress_bar": False},
    }


def texts(n: int = 2000, seed: int = 0) -> list[str]:
    """Random syllable words: prompts long enough to fill PROMPT tokens, and a corpus for the
    tokenizer."""
    rng = random.Random(seed)
    syllables = [a + b for a in "bcdfghjklmnprstvwz" for b in "aeiou"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(60, 120))) for _ in range(n)]


def build(name: str, out: Path) -> None:
    """A random-weight model of the published config `name` and a small tokenizer, saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from mogrpo.modeling.tiny import train_tokenizer

    tokenizer = train_tokenizer(texts(), TOKENIZER_VOCAB, 4096)
    published = json.loads((CONFIGS / f"{name}.json").read_text())
    ids = dict(zip(("bos_token_id", "eos_token_id", "pad_token_id"),
                   tokenizer.convert_tokens_to_ids([tokenizer.eos_token] * 2
                                                   + [tokenizer.pad_token]), strict=True))
    config = AutoConfig.for_model(**{**published, **ids, "dtype": "bfloat16"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # half the disk
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def _rss(field: str = "VmRSS") -> int:
    """This process's resident set (`VmHWM`: its high-water mark), in bytes."""
    status = Path("/proc/self/status").read_text()
    return int(next(x for x in status.splitlines() if x.startswith(field + ":")).split()[1]) \
        * 1024


def child(case: str, model_dir: str, work: str, measure: str) -> dict:
    """Two GRPO steps of `case`, measured (`measure`: "rss" or "profiler" on CPU), in this
    (fresh) process."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    import mogrpo.trainer.run  # everything a run imports, before the overhead is read
    from mogrpo import train
    from mogrpo.modeling.quantize import frozen_weight_bytes
    from mogrpo.trainer.grpo import GRPOTrainer

    fixed = _rss()
    base: dict[str, int] = {}
    load = mogrpo.trainer.run.load_policy

    def weighed(*args: object, **kwargs: object) -> tuple:
        """`load_policy`, and the bytes of the frozen weights it loaded, as stored."""
        model, tokenizer = load(*args, **kwargs)
        base["base_bytes"], base["base_params"] = frozen_weight_bytes(model)
        return model, tokenizer

    mogrpo.trainer.run.load_policy = weighed
    data = Path(work) / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts(64, seed=1)))
    config = run_config(case, model_dir, str(data), str(Path(work) / "run"))
    step = GRPOTrainer.train_step

    def marked(self: GRPOTrainer) -> dict:
        with record_function("mogrpo_step"):
            return step(self)

    GRPOTrainer.train_step = marked  # type: ignore[method-assign]
    cuda = torch.cuda.is_available()
    start = time.perf_counter()
    peak = None
    if cuda:
        train(config)
        peak = torch.cuda.max_memory_allocated()
    elif measure == "rss":
        train(config)
    else:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            train(config)
        trace = Path(work) / "trace.json"
        prof.export_chrome_trace(str(trace))
        peak = _step_peak(json.loads(trace.read_text())["traceEvents"])
        trace.unlink()
    metrics = [json.loads(x) for x in (Path(work) / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    steps = [m for m in metrics if "loss" in m]
    # the steps' `memory/peak_gib` is the device's: RSS on a CPU, CUDA reserved memory on a GPU
    step_peak = max(m["memory/peak_gib"] for m in steps) * 2**30
    rss_peak = _rss("VmHWM") if cuda else step_peak  # on a GPU, the host's over the run
    return {"case": case, "device": "cuda" if cuda else "cpu",
            "measure": "max_memory_allocated" if cuda else measure,
            "measured": peak if peak is not None else rss_peak - fixed, "tensor_peak": peak,
            "rss_peak": rss_peak, "fixed": fixed, **base,
            **({"cuda_reserved": step_peak} if cuda else {}),
            "steps": len(steps), "seconds": time.perf_counter() - start,
            "prompt_truncated": [m.get("rollout/prompt_truncated") for m in steps],
            "completion_length": [m.get("rollout/completion_length") for m in steps]}


def _step_peak(events: list[dict]) -> int:
    """The most bytes allocated at once inside a `mogrpo_step` window (the profiler's running
    'Total Allocated', counted from the profile's start, before the model loaded)."""
    windows = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "mogrpo_step"
               and e.get("ph") == "X"]
    memory = [(e["ts"], e["args"]["Total Allocated"]) for e in events if e.get("name") == "[memory]"]
    return max(total for ts, total in memory if any(a <= ts <= b for a, b in windows))


MEASURES = {"rss": "RSS peak − fixed", "profiler": "tensor peak (profiler)",
            "max_memory_allocated": "CUDA max allocated"}


def plan(case: str, device: str = "cpu") -> tuple[int, object]:
    """The planner's estimate of `case` on `device` ("cpu", or "cuda" less the CUDA context
    term, which `torch.cuda.max_memory_allocated` does not count)."""
    from mogrpo.config import RunConfig
    from mogrpo.memory import estimate

    name = CASES[case][0]
    published = json.loads((CONFIGS / f"{name}.json").read_text())
    run = RunConfig.model_validate(run_config(case, "model", "prompts.jsonl", "run"))
    est = estimate(published, run, device=device)
    return est.total - (est["overhead"] if device == "cuda" else 0), est


def report(results: dict[str, dict], command: str) -> str:
    """The markdown page: machine, command, one row per configuration, the notes."""
    import torch

    from mogrpo.kernels.cpu.linear import cpu_name

    gib = 2**30
    gpu = (f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "")
    lines = [
        "# Memory planner vs measurement at real shapes",
        "",
        f"{cpu_name()}, {os.cpu_count()} cores{gpu}, Python {platform.python_version()}, torch "
        f"{torch.__version__}. `{command}` (each configuration in its own process, one at a "
        f"time). {PROMPTS} prompts × {K} completions, {PROMPT} + {COMPLETION} tokens, 2 GRPO "
        "steps, β 0.04 (a reference), AdamW (`full-adamw8bit`: bitsandbytes' 8-bit AdamW); LoRA "
        "r 16 on all linear layers.",
        "",
        "| configuration | parameters | plan | measured | how measured | plan / measured | "
        "RSS peak | fixed overhead | RSS − overhead | bytes / parameter (measured) | "
        "frozen base, B / parameter: plan | stored | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    from mogrpo.modeling.architecture import Architecture

    for case, r in results.items():
        total, est = plan(case, r.get("device", "cpu"))
        params = Architecture.from_config(
            json.loads((CONFIGS / f"{CASES[case][0]}.json").read_text())).params
        lora = CASES[case][1]
        planned = f"{est['weights'] / params:.3f}" if lora else "–"
        stored = f"{r['base_bytes'] / r['base_params']:.3f}" if "base_bytes" in r and lora \
            else "–"
        lines.append(
            f"| {case} | {params / 1e9:.3f} B | {total / gib:.2f} GiB | "
            f"{r['measured'] / gib:.2f} GiB | {MEASURES[r['measure']]}"
            + (f" (reserved {r['cuda_reserved'] / gib:.2f} GiB)" if "cuda_reserved" in r else "")
            + " | "
            f"**{total / r['measured']:.2f}** | "
            f"{r['rss_peak'] / gib:.2f} GiB | {r['fixed'] / gib:.2f} GiB | "
            f"{(r['rss_peak'] - r['fixed']) / gib:.2f} GiB | "
            f"{r['measured'] / params:.1f} | {planned} | {stored} | {r['seconds']:.0f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="*", default=[], choices=sorted(CASES), metavar="CASE")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "mogrpo-mvp")
    parser.add_argument("--report", action="store_true", help="only write the table")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_vs_plan",
                        help="results path without suffix: OUT.json (kept, added to) and OUT.md")
    parser.add_argument("--measure", choices=("rss", "profiler"), default="rss",
                        help="on CPU: RSS peak − fixed overhead (cheap) or torch.profiler's "
                        "tensor peak (slow)")
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--build", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        build(args.build, args.work / args.build)
        return
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], str(args.work / "case"),
                               args.child[2])))
        return
    store = args.out.with_suffix(".json")
    results = json.loads(store.read_text()) if store.exists() else {}
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    if args.measure == "profiler":
        # transformers loads (and converts bf16 -> fp32) the weights on worker threads, whose
        # allocations the profiler does not record: it saw 37 of a model's 75 MiB. One thread.
        env["HF_DEACTIVATE_ASYNC_LOAD"] = "1"
    for case in args.cases:
        model_dir = args.work / CASES[case][0]
        if not (model_dir / "config.json").exists():
            subprocess.run([sys.executable, __file__, "--work", str(args.work), "--build",
                            CASES[case][0]], check=True, env=env)
        (args.work / "case").mkdir(parents=True, exist_ok=True)
        out = subprocess.run([sys.executable, __file__, "--work", str(args.work), "--child", case,
                              str(model_dir), args.measure], env=env, check=True,
                             stdout=subprocess.PIPE, text=True).stdout  # stderr: the run's log
        results[case] = json.loads(out.strip().splitlines()[-1])
        store.write_text(json.dumps(results, indent=1) + "\n")
        print(case, results[case], flush=True)
    on_cpu = all(r.get("device", "cpu") == "cpu" for r in results.values())
    command = ("python benchmarks/memory_vs_plan.py --cases CASE [--measure profiler]" if on_cpu
               else f"python benchmarks/memory_vs_plan.py --cases {' '.join(results)} --out OUT")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".md").write_text(
        report(results, command) + (NOTES if args.out == RESULTS / "memory_vs_plan" else
                                    GPU_NOTES if not on_cpu else ""))
    print(f"wrote {args.out.with_suffix('.md')}")


GPU_NOTES = """
On a GPU "measured" is `torch.cuda.max_memory_allocated()` over the whole run (the model's load
and both steps): the most bytes PyTorch's tensors held at once. The plan beside it is the
planner's total for device "cuda" less its 1 GiB term for the CUDA context and allocator slack,
which that counter does not see; "reserved" is what the caching allocator held at most in the
steps (`torch.cuda.max_memory_reserved`: the tensors and the blocks it keeps for reuse). The RSS
columns are the host process's (its high-water mark over the run).
"""


NOTES = """
Reading it: "RSS peak − fixed" counts a little more than tensors (the tokenizer, the data,
Python objects, the small blocks glibc keeps), so a plan / measured ratio a few per cent below
1 is consistent with a right plan without proving it; the tensor peak itself is `--measure
profiler`'s, far slower at these sizes (13 minutes were not enough for the first step of 0.5B
LoRA under load 8). The plan is for device "cpu" (no CUDA context term) and fp32, as the CPU
trains. The seconds are wall time on a shared machine (other work ran beside every case), not
a speed figure.

Bytes per parameter: full fine-tuning in fp32 holds 20 B a parameter whatever the batch
(weights 4, AdamW's m and v 8, the reference copy 4, gradients 4: the planner's terms); the
measured 21.3 adds this small batch's activations and the chunked log-prob head (1.3 and
0.6 GiB planned). Under bf16-mixed the reference is bf16 (2 B): 18 B a parameter, and the
measured 19.3 (`qwen2.5-0.5b/full-bf16-mixed`: fp32 master weights, AdamW states and gradients,
bf16 autocast; at ac56d05, one thread, beside other work for its first half: this CPU has no
native bf16, so its 1,760 s are no speed figure) adds the same batch's activations, in bf16.
With bitsandbytes' 8-bit AdamW (`full-adamw8bit`, bitsandbytes 0.50.2, whose optimizers step
CPU tensors from 0.50.0; at c61571b4, one thread, beside other work) m and v take 2 B a
parameter and an fp32 absmax per 256 values instead of 8 B (0.94 GiB here, to the planner's
byte), but on a CPU its step dequantises one tensor's m and v to fp32 and computes in fp32
copies: 5 fp32 copies of the largest tensor, the tied 151,936 × 896 embedding (2.54 GiB),
above the states. So the peak falls only from 9.80 to 9.11 GiB on this shape; the planner
counts the copies on a CPU (none on CUDA, where bitsandbytes steps in place).
`qwen2.5-1.5b/lora` (a 16-bit base loaded in fp32, as the CPU trains) ran at 2b13028 with 2
threads beside other work.

"frozen base, B / parameter": the planner's weights term over the parameters, and the frozen
weights as stored once loaded (`mogrpo.modeling.quantize.frozen_weight_bytes`: every frozen
parameter and buffer, with NF4's absmax, nested constants and code tables). A LoRA base loads
in the compute dtype, float32 on the CPU: 4 B.

The QLoRA rows (`qlora`: `model.load_in_4bit`; `qlora+emb4`: with `model.embeddings_in_4bit`)
ran on the CPU with bitsandbytes 0.50.2, under `nice -n 19` and `OMP_NUM_THREADS=1` beside
other work on the shared 2-core machine (qwen2.5-0.5b/qlora with the code of commit 4c02d4b,
the other two with that of 6165a4a; the commits after it up to f12f63b change docstrings and
tests only). The stored base matches the plan
to 0.001 B a parameter (~1 KiB of code tables per quantised tensor besides). With a float32
embedding Qwen2.5-0.5B's base is 1.48 B a parameter on the CPU; with the embedding and head in
NF4, 0.517. The step's peak does not drop with it on the CPU: the head is dequantised whole in
float32 while it runs (151936 × 896 × 4 B = 0.54 GB, more than the 0.47 GB its NF4 storage
saves), as the plan says (2.20 against 2.13 GiB) and the measurement shows (2.41 against 2.36
GiB); under bf16 on a GPU that copy is half as large. The QLoRA plans are 6-10 % under the
measurement, 0.21-0.30 GiB, about the 16-bit LoRA row's 0.20 GiB. qwen2.5-1.5b/qlora took 16
minutes on the shared machine; its `qlora+emb4` and `lora` rows were not run (each over ~15
minutes here: llama-3.2-1b/lora took 20).

The LoRA + checkpointing rows were first blocked by a trainer bug (the checkpoint's
recomputation left the CPU products the forward ran on: `CheckpointError`); since 66bb0c0 the
CPU products stay off for a model that recomputes, and the rows are measured.
"""

if __name__ == "__main__":
    main()

"""Peak memory of the policy's log-prob forward and backward: the model's [B, C, V] logits
(`token_logprobs_and_entropy`, the path before issue 37) against the chunked head
(`mogrpo.algo.head_logprobs`), on a CPU.

    python benchmarks/logprob_memory.py --out benchmarks/results/logprob_memory.md

A Qwen2.5-0.5B-shaped decoder (hidden 896, 14 heads, 2 KV heads, MLP 4864, tied embeddings) cut
to 2 layers, float32, random weights, at the vocabularies of Qwen2.5 (151,936) and Llama 3
(128,256): 2 prompts of 32 tokens x 8 completions of 512 tokens (B x T = 16 x 512),
`completion_logprobs` with entropy (the first update pass) through the model's own forward, then
the backward of a weighted sum of the log-probs. Each case runs in a process of its own and
reports:

- tensor peak: the most bytes of tensors alive at once during the pass (torch.profiler's
  record of every allocation and free, counted from the pass's start: activations, what autograd
  saves, logits and their temporaries, parameter gradients);
- RSS peak: the process's resident-set high-water mark during the pass (VmHWM after resetting
  it), over the RSS before it.

The head's products at these shapes are ~2.2 TFLOP each: about 20 minutes in all on 2 shared
cores of a Zen 3 EPYC (each case 4-7 minutes).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mogrpo.kernels.cpu.linear import cpu_name

LAYERS, PROMPTS, K, PROMPT, COMPLETION = 2, 2, 8, 32, 512
QWEN25_05B = dict(hidden_size=896, num_attention_heads=14, num_key_value_heads=2,
                  intermediate_size=4864, tie_word_embeddings=True, max_position_embeddings=4096)
VOCABS = (151_936, 128_256)


def _rss(field: str) -> int:
    """VmRSS or VmHWM of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _allocation_peak(trace: Path) -> int:
    """The highest 'Total Allocated' of the profiler's memory events: bytes allocated since the
    profile began, less those freed."""
    events = json.loads(trace.read_text())["traceEvents"]
    return max((e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"),
               default=0)


def one_case(vocab: int, chunked: bool, trace: Path) -> dict:
    """Build the model, run one forward and backward, and measure it."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import Qwen2Config, Qwen2ForCausalLM

    import mogrpo.algo.logprobs as logprobs

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=vocab, num_hidden_layers=LAYERS,
                                         **QWEN25_05B)).train()
    if not chunked:  # the path before: the model's own logits
        logprobs.output_head = lambda model: None
    g = torch.Generator().manual_seed(1)
    B = PROMPTS * K
    prompt_ids = torch.randint(3, vocab, (PROMPTS, PROMPT), generator=g).repeat_interleave(K, 0)
    completion_ids = torch.randint(3, vocab, (B, COMPLETION), generator=g)
    ones_p, ones_c = torch.ones_like(prompt_ids), torch.ones_like(completion_ids)
    weights = torch.randn(B, COMPLETION, generator=g)
    before = _rss("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to the RSS now
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        logp, entropy = logprobs.completion_logprobs(model, prompt_ids, ones_p, completion_ids,
                                                     ones_c, with_entropy=True)
        (logp * weights).sum().backward()
    seconds = time.perf_counter() - start
    rss_peak = _rss("VmHWM")
    prof.export_chrome_trace(str(trace))
    return {"vocab": vocab, "path": "chunked" if chunked else "full logits",
            "tensor_peak": _allocation_peak(trace), "rss_peak_growth": rss_peak - before,
            "rss_before": before, "seconds": seconds,
            "logp_sum": float(logp.detach().sum()), "entropy_mean": float(entropy.mean())}


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def report(results: list[dict], command: str) -> str:
    lines = [
        "# Log-prob memory: full logits against the chunked head",
        "",
        f"`{command}` on {cpu_name()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}; one run per case, each in a process of its own.",
        "",
        f"Qwen2.5-0.5B's shape (hidden 896, MLP 4864, tied embeddings) with {LAYERS} layers, "
        f"float32, random weights; {PROMPTS} prompts of {PROMPT} tokens x {K} completions of "
        f"{COMPLETION} tokens (B x T = {PROMPTS * K} x {COMPLETION}); `completion_logprobs` "
        "with entropy through the model's forward, then the backward of a weighted sum. "
        "Tensor peak: the most tensor bytes alive at once from the pass's start "
        "(torch.profiler's allocation record). RSS peak: the process's high-water mark during "
        "the pass over its RSS before. Times are indicative only on a shared machine.",
        "",
        "| vocab | path | tensor peak | RSS peak growth | time | tensor peak vs full |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        full = next(f for f in results if f["vocab"] == r["vocab"] and f["path"] == "full logits")
        lines.append(f"| {r['vocab']:,} | {r['path']} | {_gib(r['tensor_peak'])} | "
                     f"{_gib(r['rss_peak_growth'])} | {r['seconds']:.1f} s | "
                     f"{r['tensor_peak'] / full['tensor_peak']:.3f} |")
    lines += ["", "Both paths' log-prob sums agree: " + ", ".join(
        f"{r['vocab']:,} {r['path']}: {r['logp_sum']:.3f}" for r in results) + ".", "",
        "What the full-logit path holds at its peak: the float32 logits [16, 512, V] (4.6 GiB "
        "at 151,936) kept for the backward, their gradient, and the full-size zero buffer "
        "autograd builds for each row chunk's slice of them in the backward. What the chunked "
        "path holds: the decoder's activations (the same in both), the hidden states, one "
        "chunk's logits and the tied weight's gradient (V x 896 float32, 0.51 GiB at 151,936)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    parser.add_argument("--vocab", type=int, nargs="+", default=list(VOCABS))
    parser.add_argument("--one", nargs=2, metavar=("VOCAB", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:  # a case in this process: its JSON on stdout's last line
        with tempfile.TemporaryDirectory() as folder:
            trace = Path(folder) / "trace.json"
            print(json.dumps(one_case(int(args.one[0]), args.one[1] == "chunked", trace)))
        return
    results = []
    for vocab in args.vocab:
        for path in ("full", "chunked"):
            done = subprocess.run([sys.executable, __file__, "--one", str(vocab), path],
                                  check=True, capture_output=True, text=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(json.dumps(results[-1]), flush=True)
    command = "python benchmarks/logprob_memory.py" + (f" --out {args.out}" if args.out else "")
    text = report(results, command)
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

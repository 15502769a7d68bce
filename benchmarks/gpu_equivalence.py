"""The native rollout engine against `generate()` on a CUDA GPU: the checks of
tests/unit/test_rollout_native.py, which CI runs on CPUs only, run again on the GPU.

    python benchmarks/gpu_equivalence.py [--device cuda] [--out benchmarks/results/gpu_equivalence]

For each family the native engine serves (Llama, Mistral, Qwen2, Qwen3, Gemma, Phi-3; tiny
random models with grouped-query attention and spread-out logits, as in the unit tests):

- fp32 (TF32 off): greedy completions with two stop ids equal `generate()`'s, row for row, and
  the sampler's log-probs equal the training forward's within 1e-4;
- bf16: the share of greedy tokens equal to `generate()`'s before the first difference (two
  kernels' bf16 roundings may flip a near-tie: reported, not required) and the log-prob gap;
- LoRA (merged into the sampler's weights, dropout on in the module): sampled log-probs
  against the training forward, fp32;
- the first-token distribution of 3,000 samples per engine (top-k 8): chi-square, 7 degrees of
  freedom, below 18.48 (the 1 % level);
- the native engine's graphed decode (static steps replayed from CUDA graphs, what it runs on
  CUDA) against its eager decode (MOGRPO_DECODE_GRAPH=0), per family, with buckets down to one
  row so that rows leaving move the decode through several captured graphs: fp32 greedy
  completions equal and log-probs within 1e-5, sampled completions (top-k, top-p, penalties)
  equal from one seed; no capture may fail. bf16: token agreement and log-prob gap, reported.
  bf16-mixed (float32 weights under bf16 autocast, as `mogrpo train` decodes on a GPU: the
  graphs read autocast's cached bf16 copies): no capture may fail and no replay may differ
  from its eager step; completions and log-prob gap against the eager decode, reported.

On a CUDA device the native engine runs the graphed decode by default, so the checks against
`generate()` above check it too.

Writes OUT.json and OUT.md; exits 1 if an fp32 check fails. `--device cpu` runs the same checks
here (what the unit tests already assert).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from unittest import mock

import torch
import transformers
from transformers import AutoTokenizer

from mogrpo import kernels
from mogrpo.algo.logprobs import completion_logprobs
from mogrpo.kernels.cuda import graph_step
from mogrpo.modeling.load import LoraSettings, apply_lora
from mogrpo.modeling.tiny import NATIVE_FAMILIES, build_tiny_model, random_family_model
from mogrpo.rollout import static_decode
from mogrpo.rollout.generate import SamplingSettings, generate_rollout

RESULTS = Path(__file__).resolve().parent / "results"
PROMPTS = ["the cat sat on", "答案 因为 the question", "a", "option A B because the context says"]
FAMILIES = list(NATIVE_FAMILIES)
LOGP_ATOL = 1e-4
GRAPH_LOGP_ATOL = 1e-5  # graphed against eager native decode, fp32: the same arithmetic
CHI2_LIMIT = 18.48  # chi-square 0.99 quantile, 7 degrees of freedom


def family_model(family: str, tok, device: str, dtype: torch.dtype, seed: int = 0):
    return random_family_model(family, len(tok), pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id, seed=seed).to(device=device,
                                                                           dtype=dtype)


def rollout(model, tok, engine: str, prompts=PROMPTS, k: int = 2, seed: int = 0, **settings):
    return generate_rollout(model, tok, prompts, SamplingSettings(**settings), num_generations=k,
                            max_prompt_length=32, engine=engine, generator_seed=seed,
                            record_logprobs=engine == "native")


def logp_gap(model, ro, temperature: float) -> float:
    """Largest |sampler log-prob - training forward's| over the completion tokens."""
    device = next(model.parameters()).device
    with torch.no_grad():
        reference = completion_logprobs(
            model, ro.prompt_ids.to(device), ro.prompt_mask.to(device),
            ro.completion_ids.to(device), ro.completion_mask.to(device),
            temperature=temperature)[0]
    mask = ro.completion_mask.to(device).bool()
    gap = (ro.sampler_logp.to(device).float() - reference.float()).abs()[mask]
    return float(gap.max()) if gap.numel() else 0.0


def agreement(a: torch.Tensor, b: torch.Tensor, lengths: torch.Tensor) -> float:
    """Share of tokens equal before each row's first difference."""
    same = 0
    for row in range(a.shape[0]):
        n = int(lengths[row])
        diff = (a[row, :n] != b[row, :n]).nonzero()
        same += int(diff[0]) if diff.numel() else n
    return same / max(int(lengths.sum()), 1)


def greedy_check(family: str, tok, device: str, dtype: torch.dtype) -> dict:
    model = family_model(family, tok, device, dtype)
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=10)
    stop = int(hf.completion_ids[0, 3])  # a stop id mid-way: rows finish at different steps
    hf = rollout(model, tok, "hf", greedy=True, max_new_tokens=10, stop_token_ids=[stop, 1])
    native = rollout(model, tok, "native", greedy=True, max_new_tokens=10,
                     stop_token_ids=[stop, 1])
    same = (native.completion_ids.shape == hf.completion_ids.shape
            and torch.equal(native.completion_ids, hf.completion_ids))
    width = min(native.completion_ids.shape[1], hf.completion_ids.shape[1])
    return {
        "completions_equal": bool(same),
        "lengths_equal": bool(torch.equal(native.lengths, hf.lengths)),
        "token_agreement": agreement(native.completion_ids[:, :width],
                                     hf.completion_ids[:, :width], hf.lengths.clamp(max=width)),
        "rows_finish_apart": len(set(native.lengths.tolist())) > 1,
        "logp_max_gap": logp_gap(model, native, 1.0),
    }


def lora_check(family: str, tok, device: str) -> dict:
    model = apply_lora(family_model(family, tok, device, torch.float32),
                       LoraSettings(r=4, alpha=8, dropout=0.3))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.2)
    model.train()  # the engine turns LoRA dropout off while it samples
    ro = rollout(model, tok, "native", k=4, temperature=0.7, top_k=20, max_new_tokens=12)
    model.eval()
    return {"logp_max_gap": logp_gap(model, ro, 0.7)}


def distribution_check(tok, device: str) -> dict:
    model = family_model("llama", tok, device, torch.float32, seed=3)
    counts = {}
    for engine in ("hf", "native"):
        ro = generate_rollout(model, tok, ["the cat sat on"],
                              SamplingSettings(temperature=1.0, top_k=8, max_new_tokens=1),
                              num_generations=3000, max_prompt_length=16, engine=engine,
                              generator_seed=11)
        counts[engine] = torch.bincount(ro.completion_ids[:, 0].cpu(), minlength=len(tok))
    used = (counts["hf"] + counts["native"]) > 0
    a, b = counts["hf"][used].double(), counts["native"][used].double()
    expected = (a + b) / 2
    chi2 = float((((a - expected) ** 2 + (b - expected) ** 2) / expected).sum())
    return {"tokens_used": int(used.sum()), "chi2": chi2}


def direct_capture(step, pool):
    """`graph_step.capture` without a GPU (`--device cpu`): a replay calls the step and refreshes
    one output tensor, so the graphed decode's bookkeeping runs, and is checked, here too."""
    out = step().clone()
    return (lambda: out.copy_(step())), out, pool


@contextlib.contextmanager
def graphs(on: bool, runners: list):
    """The native engine with its CUDA graphs on (each runner it makes appended to `runners`,
    buckets down to one row) or off (MOGRPO_DECODE_GRAPH=0: the eager step)."""
    if not on:
        with mock.patch.dict(os.environ, {graph_step.ENV: "0"}):
            yield
        return
    real = kernels.graph_runner

    def recording(device):
        maker = real(device)
        if maker is None and device.type == "cpu":  # --device cpu: replays call the step
            maker = functools.partial(graph_step.GraphedStep, capture=direct_capture)
        if maker is None:
            return None

        def make(step):
            runners.append(maker(step))
            return runners[-1]
        return make

    with mock.patch.dict(os.environ, {graph_step.ENV: "1"}), \
            mock.patch.object(kernels, "graph_runner", recording), \
            mock.patch.object(static_decode, "SMALLEST_BUCKET", 1):
        yield


def graph_check(family: str, tok, device: str, dtype: torch.dtype,
                autocast: torch.dtype | None = None) -> dict:
    """The graphed native decode against the eager one (see the module docstring); `autocast`:
    both under autocast to that dtype (mixed precision: float32 weights, the capture reading
    autocast's cached copies). Each check starts with the graphs on: a replay that differed (or
    a capture that failed) turns them off for the process, which would fail every later check
    for no fault of its own."""
    graph_step.DISTRUSTED = graph_step.UNCAPTURABLE = None
    model = family_model(family, tok, device, dtype)
    with (torch.autocast(device, dtype=autocast) if autocast is not None
          else contextlib.nullcontext()):
        return _graph_check(model, tok)


def _graph_check(model, tok) -> dict:
    runners: list = []
    with graphs(False, runners):
        first = rollout(model, tok, "native", k=4, greedy=True, max_new_tokens=10)
    # a token of each group's greedy rows at step 2, 3, ...: the groups finish at different
    # steps, and the decode moves down through several buckets
    ids, lengths = first.completion_ids, first.lengths
    stops = sorted({int(ids[4 * g, min(1 + g, int(lengths[4 * g]) - 1)])
                    for g in range(len(PROMPTS))} | {1})
    runs = {}
    cases = {"greedy": {"greedy": True, "stop_token_ids": stops},
             "sampled": {"temperature": 0.8, "top_k": 20, "top_p": 0.9,
                         "repetition_penalty": 1.2, "presence_penalty": 0.3,
                         "stop_token_ids": stops}}
    for name, settings in cases.items():
        for on in (False, True):
            with graphs(on, runners):
                runs[name, on] = rollout(model, tok, "native", k=4, max_new_tokens=10, **settings)
    eager, graphed = runs["greedy", False], runs["greedy", True]
    width = min(eager.completion_ids.shape[1], graphed.completion_ids.shape[1])
    mask = eager.completion_mask.bool()[:, :width]
    gap = (eager.sampler_logp[:, :width] - graphed.sampler_logp[:, :width]).abs()[mask]
    sampled = runs["sampled", False].completion_ids, runs["sampled", True].completion_ids
    return {
        "greedy_equal": bool(torch.equal(eager.completion_ids, graphed.completion_ids)),
        "token_agreement": agreement(graphed.completion_ids[:, :width],
                                     eager.completion_ids[:, :width],
                                     eager.lengths.clamp(max=width)),
        "logp_max_gap": float(gap.max()) if gap.numel() else 0.0,
        "sampled_equal": bool(sampled[0].shape == sampled[1].shape
                              and torch.equal(*sampled)),
        "rows_finish_apart": len(set(eager.lengths.tolist())) > 1,
        "captured": [r.captured for r in runners],
        "capture_failed": next((r.failed for r in runners if r.failed), None),
        "graphs_turned_off": graph_step.DISTRUSTED or graph_step.UNCAPTURABLE,
    }


def graph_failures(family: str, check: dict) -> list[str]:
    """What an fp32 `graph_check` must show: equal completions, close log-probs, graphs
    captured for more than one bucket, none failed."""
    failures = []
    if not (check["greedy_equal"] and check["sampled_equal"]):
        failures.append(f"{family} graphed: completions differ from the eager decode's")
    if not check["logp_max_gap"] <= GRAPH_LOGP_ATOL:
        failures.append(f"{family} graphed: log-prob gap {check['logp_max_gap']:.2e}")
    if check["capture_failed"] or not any(len(c) > 1 for c in check["captured"]):
        failures.append(f"{family} graphed: captured {check['captured']}, "
                        f"failed: {check['capture_failed']}")
    if check["graphs_turned_off"]:
        failures.append(f"{family} graphed: turned off ({check['graphs_turned_off']})")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--out", type=Path, default=RESULTS / "gpu_equivalence")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("torch sees no CUDA GPU here (try --device cpu)")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both engines
    torch.backends.cudnn.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        texts = PROMPTS * 20 + ["the answer is because the question says so"] * 20
        tok = AutoTokenizer.from_pretrained(build_tiny_model(Path(tmp) / "tok", texts))
    failures: list[str] = []
    report: dict = {"device": args.device, "torch": torch.__version__,
                    "transformers": transformers.__version__,
                    "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else None,
                    "fp32": {}, "bf16": {}, "lora": {}, "graphed": {}}
    for family in FAMILIES:
        fp32 = report["fp32"][family] = greedy_check(family, tok, args.device, torch.float32)
        if not (fp32["completions_equal"] and fp32["lengths_equal"]):
            failures.append(f"{family} fp32: greedy completions differ from generate()'s")
        if not fp32["logp_max_gap"] <= LOGP_ATOL:
            failures.append(f"{family} fp32: log-prob gap {fp32['logp_max_gap']:.2e}")
        report["bf16"][family] = greedy_check(family, tok, args.device, torch.bfloat16)
        print(f"{family}: fp32 {fp32}, bf16 {report['bf16'][family]}", flush=True)
    for family in ("llama", "qwen2"):
        lora = report["lora"][family] = lora_check(family, tok, args.device)
        if not lora["logp_max_gap"] <= LOGP_ATOL:
            failures.append(f"{family} LoRA: log-prob gap {lora['logp_max_gap']:.2e}")
    for family in FAMILIES:
        graphed = report["graphed"][family] = {
            "fp32": graph_check(family, tok, args.device, torch.float32),
            "bf16": graph_check(family, tok, args.device, torch.bfloat16),
            "bf16-mixed": graph_check(family, tok, args.device, torch.float32,
                                      autocast=torch.bfloat16)}
        failures += graph_failures(family, graphed["fp32"])
        mixed = graphed["bf16-mixed"]
        if mixed["capture_failed"] or mixed["graphs_turned_off"]:
            failures.append(f"{family} graphed under bf16 autocast: failed "
                            f"{mixed['capture_failed']}, off {mixed['graphs_turned_off']}")
        print(f"{family} graphed: {graphed}", flush=True)
    dist = report["distribution"] = distribution_check(tok, args.device)
    if dist["tokens_used"] != 8 or not dist["chi2"] < CHI2_LIMIT:
        failures.append(f"first-token distribution: {dist}")
    report["failures"] = failures
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    lines = [f"# Native engine vs generate() on {report['gpu'] or 'CPU'}", "",
             f"torch {report['torch']}, transformers {report['transformers']}; "
             "`python benchmarks/gpu_equivalence.py`", "",
             "| family | fp32 greedy equal | fp32 log-prob gap | bf16 greedy token agreement "
             "| bf16 log-prob gap |", "|---|---|---|---|---|"]
    for family in FAMILIES:
        f, b = report["fp32"][family], report["bf16"][family]
        lines.append(f"| {family} | {f['completions_equal'] and f['lengths_equal']} "
                     f"| {f['logp_max_gap']:.1e} | {b['token_agreement']:.1%} "
                     f"| {b['logp_max_gap']:.1e} |")
    lines += ["", "LoRA (fp32, sampled): " + ", ".join(
        f"{k} log-prob gap {v['logp_max_gap']:.1e}" for k, v in report["lora"].items()),
        f"First-token distribution, 3,000 samples per engine: chi-square {dist['chi2']:.2f} "
        f"over {dist['tokens_used']} tokens (limit {CHI2_LIMIT}).", ""]
    how = "CUDA graphs" if args.device == "cuda" else "replays calling the step (no GPU)"
    lines += [f"Graphed native decode ({how}, buckets down to 1 row) against the eager native "
              "decode:", "",
              "| family | fp32 greedy, sampled equal | fp32 log-prob gap | buckets captured "
              "(greedy decode) | bf16 token agreement | bf16 log-prob gap "
              "| bf16-mixed greedy, sampled equal | bf16-mixed log-prob gap |",
              "|---|---|---|---|---|---|---|---|"]
    for family, g in report["graphed"].items():
        f, b, m = g["fp32"], g["bf16"], g["bf16-mixed"]
        lines.append(f"| {family} | {f['greedy_equal']}, {f['sampled_equal']} "
                     f"| {f['logp_max_gap']:.1e} | {f['captured'][0] if f['captured'] else '-'} "
                     f"| {b['token_agreement']:.1%} | {b['logp_max_gap']:.1e} "
                     f"| {m['greedy_equal']}, {m['sampled_equal']} | {m['logp_max_gap']:.1e} |")
    lines.append("")
    lines.append("Failures: " + ("; ".join(failures) if failures else "none"))
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

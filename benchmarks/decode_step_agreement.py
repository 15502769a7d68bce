"""Do the compiled and the Python decode steps give the same completions on a trained model?

    mogrpo demo && python benchmarks/decode_step_agreement.py runs/demo/run-seed0/final/model

Decodes the built-in demo tasks' questions (200 of each, rendered with the model's chat
template) with the native engine twice — with its compiled CPU decode step
(`mogrpo.kernels.cpu.decode_step`) and with the Python step — greedily (1 completion each) and
sampled (4 each, the same seed), and prints how many completions are identical token for token
and the largest gap between their sampler log-probs. The compiled step's sums round
differently, so the two can part only where two tokens are within float32 rounding of a tie.
"""

from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mogrpo.data.synthetic import builtin_rows
from mogrpo.kernels.cpu import decode_step as cpu_kernel
from mogrpo.modeling.chat import render_prompt
from mogrpo.rollout.generate import SamplingSettings, generate_rollout


def question(row: dict) -> str:
    options = " ".join(f"{key[-1]}. {value}" for key, value in row.items()
                       if key.startswith("option_"))
    return f"{row.get('context', '')} {row['question']} {options}".strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="a local model directory (e.g. a demo run's final/model)")
    parser.add_argument("--per-task", type=int, default=200)
    parser.add_argument("--new-tokens", type=int, default=24)
    args = parser.parse_args()
    compiled = cpu_kernel.module
    if compiled() is None:
        parser.error("the compiled decode step is not available here (see `mogrpo doctor env`)")
    model = AutoModelForCausalLM.from_pretrained(args.model).eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    rows = [row for task in ("bias_probe", "grounded_qa")
            for row in builtin_rows(f"builtin:{task}", seed=0, size=args.per_task)]
    prompts = [render_prompt(tok, question(row))[0] for row in rows]
    for greedy, k in ((True, 1), (False, 4)):
        settings = SamplingSettings(greedy=greedy, max_new_tokens=args.new_tokens)
        runs = []
        for step in (compiled, lambda: None):
            cpu_kernel.module = step
            try:
                runs.append(generate_rollout(model, tok, prompts, settings, num_generations=k,
                                             max_prompt_length=256, engine="native",
                                             generator_seed=0, record_logprobs=True))
            finally:
                cpu_kernel.module = compiled
        a, b = runs
        if a.completion_ids.shape != b.completion_ids.shape:
            print(f"{'greedy' if greedy else 'sampled'}: completions of different lengths")
            continue
        same = (a.completion_ids == b.completion_ids).all(dim=1)
        gap = (a.sampler_logp - b.sampler_logp).abs()[same].max() if same.any() else torch.nan
        print(f"{'greedy' if greedy else 'sampled'}: {int(same.sum())}/{len(same)} completions "
              f"identical; largest sampler log-prob gap on them {float(gap):.2e}")


if __name__ == "__main__":
    main()

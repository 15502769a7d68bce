"""The calculator agent, learned from scratch on a CPU. A tiny model is built (as `mogrpo demo`
builds one: nothing is downloaded) and warmed up on worked examples — 40% call the
`calculator` tool and answer with its result, 60% answer from memory — then GRPO trains it on
`examples/agent_calculator.yaml`, rewarded for the right number and for a call that computed
it. A model this small cannot do the arithmetic: GRPO finds out that the calculator pays.
Prints the held-out greedy eval after the warm-up and after GRPO: correct answers, and the
episodes that called the tool.

    python examples/agent_calculator.py [--seed N] [--out DIR] [--set KEY=VALUE ...]

About 3 minutes of one CPU core. `benchmarks/agent_learning.py` runs it over 3 seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = Path(__file__).with_suffix(".yaml")
DATA = Path(__file__).with_name("agent_calculator") / "sums.jsonl"
sys.path.insert(0, str(DATA.parent))  # the tool, for the tokenizer's corpus

# The tiny model: 2 layers, wide enough (256) to learn to copy within a minute of warm-up; one
# token per digit (as Qwen2's tokenizer), so a number is copied digit by digit.
TINY = {"hidden_size": 256, "num_layers": 2, "num_heads": 4, "vocab_size": 800,
        "split_digits": True}
FROM_MEMORY = 0.6
"""The share of worked examples that answer without the calculator."""


def sums(seed: int = 0) -> list[dict[str, Any]]:
    """The example's rows (`agent_calculator/sums.jsonl`): every question "(a + b) * c" with
    one-digit a, b, c (512), its answer, and a worked example for the warm-up in TRL's
    conversational form (the `completion` column): 40% call the calculator and answer with its
    result, 60% answer from memory. A model of this size cannot do the arithmetic, so it
    learns the calculator's way or stays wrong: GRPO is to find that out."""
    digits = range(2, 10)
    problems = [(a, b, c) for a in digits for b in digits for c in digits]
    rng, rows = random.Random(seed), []
    for a, b, c in rng.sample(problems, len(problems)):
        expression, answer = f"({a} + {b}) * {c}", str((a + b) * c)
        call = {"type": "function",
                "function": {"name": "calculator", "arguments": {"expression": expression}}}
        if rng.random() < FROM_MEMORY:
            completion = [{"role": "assistant", "content": f"The answer is {answer}."}]
        else:
            completion = [{"role": "assistant", "content": "", "tool_calls": [call]},
                          {"role": "tool", "name": "calculator", "content": answer},
                          {"role": "assistant", "content": answer}]
        rows.append({"prompt": [{"role": "user", "content": f'Compute "{expression}".'}],
                     "answer": answer, "completion": completion})
    return rows


def tokenizer_corpus(rows: list[dict[str, Any]]) -> list[str]:
    """Each row's whole episode as the tiny model's chat template renders it, tools listed."""
    from tools import calculator
    from transformers.utils.chat_template_utils import render_jinja_template

    from mogrpo.modeling.tiny import TOOL_CHAT_TEMPLATE

    texts = []
    for row in rows:
        rendered, _ = render_jinja_template(
            conversations=[row["prompt"] + row["completion"]], tools=[calculator],
            chat_template=TOOL_CHAT_TEMPLATE)
        texts.append(rendered[0])
    return texts


def prepare(out: Path, seed: int, overrides: list[str]):
    """Build (or reuse) this seed's tiny model under `out` and resolve the example's config."""
    from mogrpo.config import load_config
    from mogrpo.modeling.tiny import build_tiny_model

    model_dir = out / f"tiny-model-seed{seed}"
    config, _ = load_config(CONFIG, [f"model.name_or_path={model_dir}", f"seed={seed}",
                                     f"output.dir={out / f'run-seed{seed}'}", *overrides])
    if not (model_dir / "config.json").exists():
        rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines()]
        build_tiny_model(model_dir, tokenizer_corpus(rows), seed=seed, **TINY)
    return config


def before_after(run_dir: Path) -> str:
    """The held-out greedy eval after the warm-up (`start`) and after GRPO (`end`)."""
    records = {}
    for line in (run_dir / "eval.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        records[record["tag"]] = record["calc"]
    start, end = records["start"], records["end"]
    lines = [f"{'held-out, greedy':<22}{'after SFT':>10}{'after GRPO':>12}"]
    for label, key in (("correct answer", "score"), ("called the tool", "tool_call_frac")):
        lines.append(f"{label:<22}{start[key]:>10.3f}{end[key]:>12.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "agent_calculator")
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        metavar="KEY=VALUE", help="override a config field (repeatable)")
    args = parser.parse_args(argv)
    out = args.out.resolve()
    os.chdir(ROOT)  # the config's paths are the repository's
    from mogrpo.cli.console import setup_logging
    from mogrpo.trainer.run import run_training

    config = prepare(out, args.seed, args.overrides)
    setup_logging(config.logging.level)
    summary = run_training(config)
    print(before_after(Path(summary["run_dir"])))
    print(f"\nrun directory: {summary['run_dir']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`mogrpo demo`: build a tiny model, SFT warm-up, GRPO on two built-in tasks, before/after.

Nothing is downloaded: the model and its tokenizer are built from scratch on the tasks' text,
from the seed, so the demo runs anywhere in a few minutes on 2 CPU cores.
"""

from __future__ import annotations

import logging
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from mogrpo.config import RunConfig, load_config
from mogrpo.data.readers import Record
from mogrpo.data.schema import parse_examples
from mogrpo.data.synthetic import builtin_rows

log = logging.getLogger(__name__)

# The tiny model's architecture: small enough for a CPU, large enough to learn the tasks.
TINY = {"hidden_size": 128, "num_layers": 4, "num_heads": 4, "vocab_size": 400}


def demo_base() -> dict[str, Any]:
    """The packaged demo config (`mogrpo/configs/demo.yaml`) as a dict."""
    text = resources.files("mogrpo").joinpath("configs/demo.yaml").read_text(encoding="utf-8")
    return yaml.safe_load(text)


def tokenizer_corpus(base: dict[str, Any], seed: int) -> list[str]:
    """Every prompt and target the demo tasks can produce, for training the BPE tokenizer."""
    texts = []
    for task in base["tasks"].values():
        rows = builtin_rows(task["data"], seed)
        records = [Record(task["data"], i + 1, row) for i, row in enumerate(rows)]
        for ex in parse_examples(records, format="multiple_choice"):
            texts.append(f"{ex.prompt}\nAnswer: {ex.columns['correct_answer']}")
    return texts


def prepare_demo(out: Path, seed: int, overrides: list[str]) -> RunConfig:
    """Build (or reuse) the tiny model for this seed and resolve the demo config."""
    base = demo_base()
    model_dir = out / f"tiny-model-seed{seed}"
    base["seed"] = seed
    base["model"]["name_or_path"] = str(model_dir)
    base["output"]["dir"] = str(out / f"run-seed{seed}")
    config, _ = load_config(None, overrides, base=base)  # a --set typo: before any model
    if not (model_dir / "config.json").exists():
        from mogrpo.modeling.tiny import build_tiny_model  # imports torch

        log.info("building the tiny model in %s", model_dir)
        build_tiny_model(model_dir, tokenizer_corpus(base, seed), seed=seed, **TINY)
    return config


def format_summary(summary: dict[str, Any]) -> str:
    """The before/after table printed at the end of the demo."""
    evals = summary.get("evals", {})
    start, end = evals.get("start", {}), evals.get("end", {})
    lines = ["", f"{'task':<16}{'after SFT':>10}{'after GRPO':>12}{'change':>9}"]
    for task in summary["tasks"]:
        before, after = start.get(task, float("nan")), end.get(task, float("nan"))
        lines.append(f"{task:<16}{before:>10.3f}{after:>12.3f}{after - before:>+9.3f}")
    lines.append(f"\nrun directory: {summary['run_dir']}")
    return "\n".join(lines)

"""Shared integration fixtures; the helper modules here (user rewards, W&B reader) importable."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny Llama-style model with a tokenizer trained on the demo tasks' text."""
    from mogrpo.demo import demo_base, tokenizer_corpus
    from mogrpo.modeling.tiny import build_tiny_model

    out = tmp_path_factory.mktemp("tiny")
    return build_tiny_model(out / "model", tokenizer_corpus(demo_base(), 0), seed=0,
                            hidden_size=32, num_layers=2, num_heads=2, vocab_size=300)

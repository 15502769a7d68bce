"""Shared fixtures for unit tests: one tiny model built per session, offline."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

WORDS = (
    "the a cat dog sat on mat answer question because cannot be determined context says "
    "not enough information yes no A B C D option reasoning 答案 理由 因为 根据 选项"
).split()


def synthetic_texts(n: int = 300, seed: int = 0) -> list[str]:
    """Short pseudo-sentences (English and Chinese words) to train the tiny tokenizer on."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


@pytest.fixture(scope="session")
def tiny_texts() -> list[str]:
    return synthetic_texts()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_texts: list[str]) -> Path:
    """A tiny random Llama with the mogrpo chat template, saved once per test session."""
    from mogrpo.modeling.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), tiny_texts, seed=0)


@pytest.fixture(scope="session")
def tiny_policy(tiny_model_dir: Path):
    """(model, tokenizer) loaded from `tiny_model_dir`; tests must not modify the model."""
    from mogrpo.modeling.load import load_policy

    return load_policy(str(tiny_model_dir))


@pytest.fixture(params=["blas", "mkl-packed", "onednn"])
def decode_kernel(request, monkeypatch):
    """Each kernel the decode loop's products may run on (which one depends on the CPU: see
    `cpu_linear.decode_on_onednn` and `decode_on_mkl`), whatever this machine's CPU: the BLAS
    on weights as they are, MKL on packed weights, or oneDNN."""
    from mogrpo.kernels.cpu import linear as cpu_linear
    from mogrpo.kernels.cpu import mkl_packed

    if request.param == "onednn" and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    if request.param == "mkl-packed" and not mkl_packed.works():
        pytest.skip("this torch exports no MKL packed product")
    monkeypatch.setattr(cpu_linear, "decode_on_onednn", lambda: request.param == "onednn")
    monkeypatch.setattr(cpu_linear, "decode_on_mkl", lambda: request.param == "mkl-packed")
    return request.param

"""The package metadata builds without deprecation warnings (what `pip wheel .` reads)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_pyproject_applies_without_a_deprecation_warning(monkeypatch):
    pytest.importorskip("setuptools", minversion="77")
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution

    monkeypatch.chdir(ROOT)  # readme and package paths are relative to the project root
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dist = apply_configuration(Distribution(), ROOT / "pyproject.toml")
    messages = [str(w.message) for w in caught if "deprecat" in str(w.message).lower()]
    assert messages == []
    assert dist.metadata.license_expression == "Apache-2.0"

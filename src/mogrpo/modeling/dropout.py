"""Model dropout off, so that every pass that scores log-probs is deterministic.

GRPO compares log-probs of the same tokens from several passes: sampling, the rollout-time
("old") pass, the reference and the update. The update runs in `train()` mode, so a model whose
config has dropout (GPT-2's `resid/embd/attn_pdrop` 0.1, OPT's `dropout` 0.1) would score with
random masks while the other passes do not: KL at step 1 is then not 0, and on-policy ratios are
not 1. Dropout is therefore switched off once, at load time, on the model's own modules, float
attributes and config fields (some models read `config.attention_dropout` at every forward and
pass it to SDPA). LoRA's `lora_dropout` is left as configured: it only regularises the adapter
and, with B = 0 at the start, cannot move the first step's log-probs.

The config's original values are kept and written back into every config.json mogrpo saves, so a
saved model keeps the dropout its checkpoint shipped.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

log = logging.getLogger(__name__)

# rate names in transformers: dropout, attention_dropout, attn_pdrop, layerdrop, dropout_p,
# hidden_dropout_prob, attn_drop, dropout_rate, … (flags such as token_dropout are booleans)
_DROPOUT_NAME = re.compile(r"[a-z_]*(dropout|pdrop|drop)(_p|_prob|_rate)?")
_ORIGINAL = "_mogrpo_dropout_config"  # attribute of the base model: {config path: value}
_DROPOUT_MODULES = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout,
                    nn.FeatureAlphaDropout)


def _base(model: nn.Module) -> nn.Module:
    """The transformers model under DDP / peft wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model


@functools.cache
def _rate_name(attr: str) -> bool:
    """Whether an attribute or config field named `attr` holds a dropout rate. Cached: the same
    few dozen names recur on every module, and the update checks the model at every step
    (`active_dropout`), where matching each name anew took ~0.6 ms at 30 modules."""
    return _DROPOUT_NAME.fullmatch(attr) is not None


def _is_lora(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _rate(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def _configs(model: nn.Module) -> dict[str, Any]:
    """The model's config and its text config when that is a separate object."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    found = {"": config}
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        name = next((k for k, v in vars(config).items() if v is text), "text_config")
        found[name] = text
    return found


def _rates(model: nn.Module) -> Iterator[tuple[Any, str, str, float, str | None]]:
    """Every non-zero dropout rate of `model` outside LoRA: (owner, attribute, name in the
    report, rate, path in the config for a config field, else None)."""
    for name, module in model.named_modules():
        if _is_lora(name):
            continue
        if isinstance(module, _DROPOUT_MODULES) and module.p > 0:
            yield module, "p", f"{name}.p", module.p, None
        for attr, value in list(vars(module).items()):
            if _rate_name(attr) and _rate(value):
                yield module, attr, f"{name}.{attr}".lstrip("."), float(value), None
    for prefix, config in _configs(_base(model)).items():
        for key, value in list(vars(config).items()):
            if _rate_name(key) and _rate(value):
                path = f"{prefix}.{key}".lstrip(".")
                yield config, key, f"config.{path}", float(value), path


def disable_dropout(model: nn.Module) -> dict[str, float]:
    """Set every dropout rate of `model` to 0 except LoRA's; returns {what: rate it had}.

    Covers dropout modules (`nn.Dropout` …: GPT-2's attn/resid/embd dropout, Phi-3's
    resid dropout), float rates kept on modules (OPT's `dropout`, Llama's `attention_dropout`,
    handed to SDPA) and config fields read during the forward (Falcon's `hidden_dropout`).
    """
    base = _base(model)
    original: dict[str, float] = getattr(base, _ORIGINAL, {})
    changed: dict[str, float] = {}
    for owner, attr, name, rate, path in list(_rates(model)):
        changed[name] = rate
        if path is not None:
            original.setdefault(path, rate)
        setattr(owner, attr, 0.0)
    if original:
        setattr(base, _ORIGINAL, original)
    return changed


def active_dropout(model: nn.Module) -> dict[str, float]:
    """Every non-zero dropout rate left in `model` outside LoRA (empty after `disable_dropout`)."""
    return {name: rate for _, _, name, rate, _ in _rates(model)}


@contextmanager
def original_dropout_config(model: nn.Module) -> Iterator[None]:
    """Put the config's original dropout rates back while saving (config.json keeps them)."""
    base = _base(model)
    original: dict[str, float] = getattr(base, _ORIGINAL, {})
    configs = _configs(base)

    def put(values: dict[str, float]) -> None:
        for path, value in values.items():
            prefix, _, key = path.rpartition(".")
            if prefix in configs:
                setattr(configs[prefix], key, value)

    put(original)
    try:
        yield
    finally:
        put(dict.fromkeys(original, 0.0))

"""Policy, tokenizer and KL reference loading; tiny models built from scratch for demos and tests."""

from mogrpo.modeling.architecture import Architecture, ModuleTree, lora_targets
from mogrpo.modeling.chat import has_chat_template, render_prompt
from mogrpo.modeling.dropout import active_dropout, disable_dropout
from mogrpo.modeling.load import (
    LoraSettings,
    apply_lora,
    enable_checkpointing,
    load_policy,
    load_tokenizer,
    resolve_dtype,
    save_model,
    save_pretrained,
    trainable_parameters,
)
from mogrpo.modeling.reference import Reference, make_reference
from mogrpo.modeling.tiny import build_tiny_model

__all__ = [
    "Architecture",
    "LoraSettings",
    "ModuleTree",
    "Reference",
    "active_dropout",
    "apply_lora",
    "build_tiny_model",
    "disable_dropout",
    "enable_checkpointing",
    "has_chat_template",
    "load_policy",
    "load_tokenizer",
    "lora_targets",
    "make_reference",
    "render_prompt",
    "resolve_dtype",
    "save_model",
    "save_pretrained",
    "trainable_parameters",
]

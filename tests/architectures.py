"""Tiny random decoders of eleven Hugging Face families, built from configs (nothing downloaded).

Each family gets the mogrpo tiny tokenizer and the sizes a test needs; `DROPOUT` families keep
the dropout their real checkpoints ship (GPT-2's 0.1 everywhere, OPT's `dropout` 0.1), so a test
can show that no GRPO pass is stochastic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

H, LAYERS, HEADS, FFN = 32, 2, 4, 64

FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    # name: (model_type, config fields beyond vocabulary and special ids)
    "gpt2": ("gpt2", dict(n_embd=H, n_layer=LAYERS, n_head=HEADS, n_positions=256,
                          resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)),
    "llama": ("llama", dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=2, intermediate_size=FFN,
                            tie_word_embeddings=False)),
    "llama_tied": ("llama", dict(hidden_size=H, num_hidden_layers=LAYERS,
                                 num_attention_heads=HEADS, num_key_value_heads=2,
                                 intermediate_size=FFN, tie_word_embeddings=True)),
    "qwen2": ("qwen2", dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=2, intermediate_size=FFN)),
    "mistral": ("mistral", dict(hidden_size=H, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, num_key_value_heads=2,
                                intermediate_size=FFN)),
    "gemma": ("gemma", dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                            num_key_value_heads=1, intermediate_size=FFN, head_dim=16)),
    "gemma2": ("gemma2", dict(hidden_size=H, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS, num_key_value_heads=2,
                              intermediate_size=FFN, head_dim=8, sliding_window=16)),
    "phi3": ("phi3", dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                          num_key_value_heads=2, intermediate_size=FFN)),
    "opt": ("opt", dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        ffn_dim=FFN, word_embed_proj_dim=H, dropout=0.1,
                        max_position_embeddings=256)),
    "gpt_neox": ("gpt_neox", dict(hidden_size=H, num_hidden_layers=LAYERS,
                                  num_attention_heads=HEADS, intermediate_size=FFN)),
    "falcon": ("falcon", dict(hidden_size=H, num_hidden_layers=LAYERS,
                              num_attention_heads=HEADS)),
}
DROPOUT = ("gpt2", "opt")


def family_config(family: str, vocab_size: int = 300, **changes: Any):
    """The transformers config of a tiny `family` model (special ids 0, 1, 2 unless given)."""
    from transformers import AutoConfig

    model_type, fields = FAMILIES[family]
    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **(ids | fields | changes))


def build_family(out: Path, family: str, texts: list[str], seed: int = 0, **changes: Any) -> Path:
    """Save a tiny random `family` model with the mogrpo tiny tokenizer in `out`."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mogrpo.modeling.tiny import EOS, EOT, PAD, train_tokenizer

    tokenizer = train_tokenizer(texts, 300, 256)
    pad, eos, eot = tokenizer.convert_tokens_to_ids([PAD, EOS, EOT])
    config = family_config(family, vocab_size=len(tokenizer), pad_token_id=pad,
                           bos_token_id=eos, eos_token_id=eos, **changes)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=[eos, eot], pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out

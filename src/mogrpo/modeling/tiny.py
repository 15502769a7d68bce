"""Tiny causal LMs built from scratch: the demo and every test run on these, offline, in seconds.

The model is untrained (random weights) but real: a Hugging Face Llama, Qwen2, Qwen3 or Gemma
with a byte-level BPE tokenizer, two stop ids and a chat template shaped like Llama-3's, saved so that
`AutoModelForCausalLM` / `AutoTokenizer` load it like any hub checkpoint.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from mogrpo.errors import ConfigError

logger = logging.getLogger(__name__)

# The families mogrpo's native rollout engine serves: (config class, model class, extra config
# fields) of transformers, for `random_family_model`.
NATIVE_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {"head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}

PAD = "<|pad|>"
EOS = "<|end_of_text|>"
EOT = "<|eot|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
SPECIAL_TOKENS = [PAD, EOS, EOT, USER, ASSISTANT, SYSTEM]

# Every turn is `<|role|>\n{content}<|eot|>\n`; the generation prompt is `<|assistant|>\n`, so a
# chat model stops on <|eot|> (second stop id, as Llama-3's <|eot_id|>) and a base model on EOS.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('Unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eot|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

# The same turns, plus tool calling in the Hermes / Qwen2.5 form: the tools listed in a system
# turn, a call written `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, its result
# in a user turn `<tool_response>...</tool_response>`. For agent tasks on tiny models
# (`model.chat_template`); the tools are listed by name and arguments to keep prompts short.
TOOL_CHAT_TEMPLATE = (
    "{%- if tools -%}{{ '<|system|>\\nTools:' }}"
    "{%- for t in tools -%}{{ ' ' + t['function']['name'] + '('"
    " + (t['function']['parameters']['properties'] | list | join(', ')) + ')' }}{%- endfor -%}"
    "{{ '. Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|eot|>\\n' }}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}"
    "{{ '<|user|>\\n<tool_response>' + message['content'] + '</tool_response><|eot|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] is defined"
    " and message['tool_calls'] -%}"
    "{{ '<|assistant|>\\n' + (message['content'] or '') }}"
    "{%- for c in message['tool_calls'] -%}"
    "{{ '<tool_call>' + ({'name': c['function']['name'], 'arguments': c['function']['arguments']}"
    " | tojson) + '</tool_call>' }}"
    "{%- endfor -%}{{ '<|eot|>\\n' }}"
    "{%- elif message['role'] in ['system', 'user', 'assistant'] -%}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|eot|>\\n' }}"
    "{%- else -%}{{ raise_exception('Unknown chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>\\n' }}{%- endif -%}"
)

ARCHITECTURES = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
                 "qwen3": (Qwen3Config, Qwen3ForCausalLM),
                 "gemma": (GemmaConfig, GemmaForCausalLM)}


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int,
                    split_digits: bool = False) -> PreTrainedTokenizerFast:
    """Train a deterministic byte-level BPE tokenizer on `texts` and wrap it for transformers;
    `split_digits`: every digit a token of its own, as Qwen2's and Llama 3's tokenizers have
    them (a number is then copied digit by digit)."""
    tok = Tokenizer(models.BPE())
    # Byte-level: every string (Chinese included) encodes without an unknown token.
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), byte_level]) if split_digits \
        else byte_level
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        eos_token=EOS,
        additional_special_tokens=[EOT, USER, ASSISTANT, SYSTEM],
        padding_side="left",
        model_max_length=max_length,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(
    out_dir: str | Path,
    texts: Iterable[str],
    *,
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
    split_digits: bool = False,
) -> Path:
    """Build, save and return the directory of a tiny random causal LM plus tokenizer
    (`split_digits`: one token per digit, see `train_tokenizer`).

    Same `texts`, `seed` and sizes give identical weights and an identical tokenizer.json.
    """
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"unknown tiny-model arch {arch!r}; choose one of {sorted(ARCHITECTURES)}"
        )
    if hidden_size % num_heads:
        raise ConfigError(
            f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}; "
            "pick sizes such that hidden_size % num_heads == 0"
        )
    text_list = [t for t in texts if t]
    if not text_list:
        raise ConfigError(
            "build_tiny_model got no texts to train its tokenizer on; pass a few strings"
        )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(text_list, vocab_size, max_position_embeddings, split_digits)
    pad_id, eos_id, eot_id = tokenizer.convert_tokens_to_ids([PAD, EOS, EOT])

    config_cls, model_cls = ARCHITECTURES[arch]
    # Qwen3's and Gemma's head size is a field of its own (128, 256 by default): hidden / heads,
    # as the others
    shape = {"head_dim": hidden_size // num_heads} if arch in ("qwen3", "gemma") else {}
    config = config_cls(
        **shape,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model: PreTrainedModel = model_cls(config).to(torch.float32)
    # A fresh config: only stop and pad ids, no sampling defaults that generate() would merge in.
    model.generation_config = GenerationConfig(eos_token_id=[eos_id, eot_id], pad_token_id=pad_id)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _no_unknown_token(out)
    logger.info(
        "built tiny %s model (%d parameters, vocab %d) in %s",
        arch,
        model.num_parameters(),
        len(tokenizer),
        out,
    )
    return out


def _no_unknown_token(folder: Path) -> None:
    """Say in the saved tokenizer config that the tokenizer has no unknown token (byte-level
    BPE needs none). Otherwise transformers loads a Qwen2 or Qwen3 folder's tokenizer as
    `Qwen2Tokenizer`, whose default unknown token `<|endoftext|>` is then added as a token
    past the model's vocabulary: one more id than the embedding has, which `mogrpo train`
    refuses (and every save of that tokenizer keeps)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8"))
    config.setdefault("unk_token", None)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def random_family_model(family: str, vocab_size: int, *, pad_token_id: int, eos_token_id: int,
                        seed: int = 0) -> PreTrainedModel:
    """A tiny random model of a `NATIVE_FAMILIES` family in eval mode (2 layers, hidden 64,
    grouped-query attention: 4 query heads over 2 key heads), its logits spread out
    (initializer_range 0.2) so greedy and sampled tokens vary, every RMSNorm's weights (Qwen3's
    per-head norms too) drawn in [0.5, 1.5] rather than all ones (Gemma's: zeros), so that a
    weight applied wrongly or in the wrong order shows: what the rollout engines are compared
    on, in the tests and in `benchmarks/gpu_equivalence.py`."""
    import transformers

    config_name, model_name, extra = NATIVE_FAMILIES[family]
    config = getattr(transformers, config_name)(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.2, **{"pad_token_id": pad_token_id, **extra},
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms' weights not all ones (Gemma's: zeros), so that they count
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    model.generation_config = GenerationConfig(eos_token_id=eos_token_id,
                                               pad_token_id=pad_token_id)
    return model

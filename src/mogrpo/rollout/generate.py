"""Rollout with Hugging Face `generate`: K completions per prompt, with the sampling flags honoured.

transformers >= 5 fills every generation field left `None` from `model.generation_config`
(a Llama-3 checkpoint ships temperature 0.6 / top_p 0.9, Qwen2.5 a repetition penalty of 1.05).
So the config built here sets every field that shapes the next-token distribution, including
neutral values, leaving nothing for the checkpoint's defaults to fill in — training then scores
exactly the distribution that was sampled.
"""

from __future__ import annotations

import functools
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, get_args

import torch
from torch import nn
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedTokenizerBase

from mogrpo.config.model_limits import position_limit
from mogrpo.config.rollout import RolloutEngine
from mogrpo.errors import ConfigError, DataError
from mogrpo.rollout.layout import unsupported_reason
from mogrpo.rollout.native import Decoded, StepCallback, decode_attention, native_decode
from mogrpo.rollout.processors import NonFiniteGuard, PresenceFrequencyPenalty
from mogrpo.rollout.projections import decode_projections
from mogrpo.rollout.sampling import SamplingSettings

logger = logging.getLogger(__name__)

# Fields with no neutral non-None value: if the checkpoint sets one, generate() applies it.
_UNBLOCKABLE_FIELDS = (
    "top_h",
    "suppress_tokens",
    "begin_suppress_tokens",
    "bad_words_ids",
    "sequence_bias",
    "forced_bos_token_id",
    "forced_eos_token_id",
    "exponential_decay_length_penalty",
    "watermarking_config",
    "guidance_scale",
)
_warned: set[str] = set()  # inherited-field warnings already logged (once per process)
ENGINES = get_args(RolloutEngine)


@dataclass
class Rollout:
    """K completions per prompt; row `i * K + k` is completion k of prompt i."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    completion_ids: torch.Tensor  # [B, C] right-padded with the pad id
    completion_mask: torch.Tensor  # [B, C] 1 up to and including the first stop token
    # (an episode of several turns: 1 on every token of it, the inserted ones too)
    lengths: torch.Tensor  # [B] int, completion_mask.sum(-1)
    truncated: torch.Tensor  # [B] bool, no stop token within max_new_tokens
    texts: list[str]
    num_generations: int
    prompt_truncated: int = 0
    nonfinite_logits: int = 0
    """Logits the NonFiniteGuard had to replace (0 in a healthy run)."""
    sampler_logp: torch.Tensor | None = None
    """[B, C] log-prob of each token at sampling time (native engine: under softmax(logits / T);
    vllm: under the distribution vLLM sampled from), when asked; else None."""
    generated_mask: torch.Tensor | None = None
    """[B, C] 1 on the tokens the policy sampled, 0 on the tool results and template text
    inserted between the turns of an episode (`mogrpo.rollout.episodes`); None: a single turn,
    every token of `completion_mask` sampled."""
    episodes: list[Any] | None = None
    """Per row: what its episode did (`mogrpo.rollout.episodes.Episode`: turns, tool calls,
    its environment), None for a single-turn row; None when no row has an episode."""
    extra_fields: list[dict[str, Any]] | None = None
    """Per row: the keys a task's `rollout_func` returned besides the ids, log-probs and
    env_mask, with this row's value (TRL's `extra_fields`, given to the reward functions);
    None when no row has any."""

    @property
    def train_mask(self) -> torch.Tensor:
        """[B, C] the tokens the loss, the KL and the length normalisers count: those the
        policy sampled. `completion_mask` stays the attention mask of the whole sequence."""
        return self.completion_mask if self.generated_mask is None else self.generated_mask

    @property
    def batch_size(self) -> int:
        """Number of completions (prompts x K)."""
        return int(self.completion_ids.shape[0])


def build_generation_config(
    settings: SamplingSettings, *, stop_ids: list[int], pad_id: int
) -> GenerationConfig:
    """A complete GenerationConfig: sampling flags as given, every other logits-shaping field neutral."""
    common: dict[str, Any] = dict(
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=list(stop_ids),
        pad_token_id=pad_id,
        num_beams=1,
        num_return_sequences=1,
        use_cache=True,
        # generate() must return a plain tensor of sequences whatever the checkpoint says.
        return_dict_in_generate=False,
        output_scores=False,
        output_logits=False,
        repetition_penalty=settings.repetition_penalty,
        no_repeat_ngram_size=0,
        # min_new_tokens overrides any min_length in the checkpoint; setting min_length too would
        # make generate() warn that both are set.
        min_new_tokens=0,
        renormalize_logits=False,
        # Neutral values the greedy validator accepts silently; leaving them None would let a
        # checkpoint's temperature/top_p merge in and trigger "generation flags are not valid".
        typical_p=1.0,
        epsilon_cutoff=0.0,
        eta_cutoff=0.0,
    )
    if settings.greedy:
        # 1.0 / 1.0 / 50 are the values the validator treats as "unset": they block the
        # checkpoint's sampling defaults without a warning, and greedy decoding ignores them.
        return GenerationConfig(do_sample=False, temperature=1.0, top_p=1.0, top_k=50, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=settings.temperature,
        top_k=settings.top_k,  # 0 (not None), else generate() would apply top_k=50
        top_p=settings.top_p,
        min_p=settings.min_p,
        **common,
    )


def resolve_stop_ids(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, settings: SamplingSettings
) -> list[int]:
    """Stop ids: the configured ones, else the tokenizer's EOS plus the checkpoint's EOS ids."""
    if settings.stop_token_ids:
        return list(dict.fromkeys(int(t) for t in settings.stop_token_ids))
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    model_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if model_eos is not None:
        ids.extend(int(t) for t in ([model_eos] if isinstance(model_eos, int) else model_eos))
    if not ids:
        raise ConfigError(
            "no stop token: no stop ids are set and neither the tokenizer nor the model's "
            "generation config has an EOS token; set rollout.stop_token_ids to the id(s) that end "
            "a completion"
        )
    return list(dict.fromkeys(ids))


def _warn_inherited_fields(model: nn.Module, config: GenerationConfig) -> None:
    """Log checkpoint generation fields that generate() will merge in and mogrpo cannot neutralise."""
    model_config = getattr(model, "generation_config", None)
    if model_config is None:
        return
    fields = {
        name: getattr(model_config, name, None)
        for name in _UNBLOCKABLE_FIELDS
        if getattr(model_config, name, None) is not None and getattr(config, name, None) is None
    }
    if not config.do_sample and getattr(model_config, "min_p", None) is not None:
        fields["min_p"] = model_config.min_p  # harmless for greedy, but transformers will warn
    key = repr(sorted(fields.items()))
    if fields and key not in _warned:
        _warned.add(key)
        logger.warning(
            "the model's generation_config sets %s; transformers applies these on top of mogrpo's "
            "sampling settings. Remove them from generation_config.json if unintended.",
            fields,
        )


def _context_limit(model: nn.Module) -> tuple[int | None, str]:
    """The model's positions as validation reads them from config.json (RoPE scaling too)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        return None, ""
    return position_limit(config.to_dict())


def tokenize_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    *,
    max_prompt_length: int,
    add_special_tokens: bool,
    pad_id: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Left-pad prompts to a common width, cutting over-long ones from the left (their end, near the
    question, is what matters). Returns (ids [N, P], mask [N, P], number of prompts cut)."""
    # verbose=False: over-long prompts are cut below, so the tokenizer's length warning is noise.
    encoded = tokenizer(prompt_texts, add_special_tokens=add_special_tokens, verbose=False)[
        "input_ids"
    ]
    cut = 0
    rows: list[list[int]] = []
    for i, ids in enumerate(encoded):
        if not ids:
            raise DataError(
                f"prompt {i} is empty after tokenization: {prompt_texts[i]!r}; drop or fill it"
            )
        if len(ids) > max_prompt_length:
            ids = ids[-max_prompt_length:]
            cut += 1
        rows.append(ids)
    width = max(len(r) for r in rows)
    prompt_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    prompt_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        prompt_ids[i, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
        prompt_mask[i, width - len(ids) :] = 1
    return prompt_ids, prompt_mask, cut


@contextmanager
def _eval_mode(model: nn.Module):
    """Eval mode (dropout off) for sampling; restores each submodule's own flag afterwards."""
    flags = {m: m.training for m in model.modules()}
    model.eval()
    try:
        yield
    finally:
        for module, training in flags.items():
            module.training = training


def split_completions(
    completion: torch.Tensor, stop_ids: list[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut raw generated tokens at the first stop token.

    Returns (completion_ids with pad after the stop, completion_mask, lengths, truncated).
    """
    width = completion.shape[1]
    stops = torch.tensor(stop_ids, device=completion.device)
    is_stop = torch.isin(completion, stops)  # [B, C]
    has_stop = is_stop.any(dim=1)  # [B]
    first_stop = is_stop.int().argmax(dim=1)  # [B]; 0 when no stop, masked by has_stop below
    lengths = torch.where(has_stop, first_stop + 1, torch.full_like(first_stop, width))
    positions = torch.arange(width, device=completion.device)[None, :]
    mask = (positions < lengths[:, None]).long()  # [B, C]
    ids = torch.where(mask.bool(), completion, torch.full_like(completion, pad_id))
    return ids, mask, lengths.long(), ~has_stop


class ExternalEngine(Protocol):
    """An engine that batches and samples on its own (vLLM): whole groups in, `Decoded` out."""

    def decode(self, prompts: list[list[int]], settings: SamplingSettings, *,
               num_generations: int, stop_ids: list[int], pad_id: int, seed: int | None = None,
               record_logprobs: bool = False) -> Decoded:
        """K completions for each prompt (unpadded token ids), row `i * K + k`."""
        ...


def choose_engine(model: nn.Module, engine: str, total_length: int) -> str:
    """`native` or `hf` for this model; a fallback is logged once per reason."""
    if engine == "hf":
        return "hf"
    reason = unsupported_reason(model, total_length)
    if reason is None:
        return "native"
    if reason not in _warned:
        _warned.add(reason)
        level = logging.WARNING if engine == "native" else logging.INFO
        logger.log(level, "rollout engine: %s; generating with transformers' generate() instead",
                   reason)
    return "hf"


def _hf_decode(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    settings: SamplingSettings, *, stop_ids: list[int], pad_id: int,
) -> Decoded:
    """The reference engine: `model.generate` with every sampling field set explicitly."""
    width = prompt_ids.shape[1]
    config = build_generation_config(settings, stop_ids=stop_ids, pad_id=pad_id)
    _warn_inherited_fields(model, config)
    guard = NonFiniteGuard(temperature=1.0 if settings.greedy else settings.temperature)
    processors = LogitsProcessorList(
        [PresenceFrequencyPenalty(settings.presence_penalty, settings.frequency_penalty, width),
         guard]
    )
    sequences = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        generation_config=config,
        logits_processor=processors,
    )  # [B, P + C]
    return Decoded(sequences[:, width:], guard.replaced, rows_reset=guard.rows_reset)


def _pad_right(parts: list[torch.Tensor | None], value: int) -> torch.Tensor:
    width = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, width - p.shape[1]), value=value)
                      for p in parts])


def _decode_batches(
    model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    settings: SamplingSettings, chosen: str, *, stop_ids: list[int], pad_id: int,
    generator_seed: int | None, generation_batch_size: int | None, record_logprobs: bool,
    plain_max_bytes: int | None = None, on_step: StepCallback | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int, int]:
    """Decode [B, P] prompt rows in batches of `generation_batch_size` with `native` or `hf`.
    Returns (token parts, log-prob parts, non-finite logits replaced, rows reset)."""
    rows = prompt_ids.shape[0]
    step = generation_batch_size or rows
    parts, logps, nonfinite, rows_reset = [], [], 0, 0
    device = prompt_ids.device
    devices = [device] if device.type == "cuda" else []
    with (
        _eval_mode(model),
        torch.no_grad(),
        torch.random.fork_rng(devices=devices, enabled=generator_seed is not None),
        decode_attention(device),  # generate() too: see decode_attention
    ):
        if generator_seed is not None:
            torch.manual_seed(generator_seed)
        # the weights do not change between the batches: fused and packed once for all of them
        projections = decode_projections(model, plain_max_bytes) if chosen == "native" else None
        for start in range(0, rows, step):
            ids, mask = prompt_ids[start:start + step], prompt_mask[start:start + step]
            if chosen == "native":
                # the callback numbers rows over the whole [B, P], not this batch's slice
                shifted = on_step if on_step is None or start == 0 else \
                    functools.partial(_shifted_step, on_step, start)
                out = native_decode(model, ids, mask, settings, stop_ids=stop_ids, pad_id=pad_id,
                                    record_logprobs=record_logprobs, projections=projections,
                                    on_step=shifted)
            else:
                out = _hf_decode(model, ids, mask, settings, stop_ids=stop_ids, pad_id=pad_id)
            parts.append(out.tokens)
            nonfinite += out.nonfinite_logits
            rows_reset += out.rows_reset
            logps.append(out.logp)
    return parts, logps, nonfinite, rows_reset


def _check_rollout_arguments(
    model: nn.Module, prompt_texts: list[str], settings: SamplingSettings, *,
    num_generations: int, max_prompt_length: int, engine: str | ExternalEngine,
    generation_batch_size: int | None,
) -> None:
    """Reject `generate_rollout`'s bad arguments before anything is tokenized or decoded."""
    if num_generations < 1:
        raise ConfigError(f"num_generations = {num_generations} must be >= 1")
    if engine == "vllm":
        raise ConfigError("rollout.engine = vllm: pass the VLLMEngine the run built "
                          "(TrainContext.rollout_engine) as `engine`, not the string")
    if isinstance(engine, str) and engine not in ENGINES:
        raise ConfigError(f"rollout.engine = {engine!r} is not one of {list(ENGINES)}")
    if generation_batch_size is not None and generation_batch_size < 1:
        raise ConfigError(f"rollout.generation_batch_size = {generation_batch_size} must be >= 1")
    if max_prompt_length < 1:
        raise ConfigError(f"max_prompt_length = {max_prompt_length} must be >= 1")
    if not prompt_texts:
        raise DataError("generate_rollout got no prompts")
    limit, source = _context_limit(model)
    if limit is not None and max_prompt_length + settings.max_new_tokens > limit:
        raise ConfigError(
            f"max_prompt_length ({max_prompt_length}) + max_new_tokens ({settings.max_new_tokens}) = "
            f"{max_prompt_length + settings.max_new_tokens} exceeds the model's {limit} "
            f"positions ({source}); lower one of them so they fit"
        )


def _pad_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad id, else its EOS id."""
    pad_id = (
        tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    )
    if pad_id is None:
        raise ConfigError(
            "the tokenizer has neither a pad nor an EOS token; set tokenizer.pad_token"
        )
    return pad_id


def _prompt_rows(model: nn.Module, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
                 num_generations: int, cut: int,
                 max_prompt_length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each prompt's ids and mask repeated K times, row `i * K + k`, on the model's device."""
    if cut:
        logger.debug("%d of %d prompts cut from the left to %d tokens",
                     cut, prompt_ids.shape[0], max_prompt_length)
    device = next(model.parameters()).device
    rows_ids = prompt_ids.repeat_interleave(num_generations, dim=0).to(device)  # [B, P]
    rows_mask = prompt_mask.repeat_interleave(num_generations, dim=0).to(device)  # [B, P]
    return rows_ids, rows_mask


def _decode_external(
    engine: ExternalEngine, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor,
    settings: SamplingSettings, *, num_generations: int, stop_ids: list[int], pad_id: int,
    seed: int | None, record_logprobs: bool,
) -> tuple[list[torch.Tensor], list[torch.Tensor | None], int, int]:
    """Decode with an engine that batches on its own, given each [B, P] prompt once unpadded.
    Returns what `_decode_batches` does, in one part."""
    unpadded = [ids[mask.bool()].tolist()
                for ids, mask in zip(prompt_ids, prompt_mask, strict=True)]
    out = engine.decode(unpadded, settings, num_generations=num_generations,
                        stop_ids=stop_ids, pad_id=pad_id, seed=seed,
                        record_logprobs=record_logprobs)
    return [out.tokens], [out.logp], 0, 0


def _decode_texts(tokenizer: PreTrainedTokenizerBase, completion_ids: torch.Tensor,
                  lengths: torch.Tensor) -> list[str]:
    """Each completion's text, up to its length, without special tokens and stripped."""
    return [
        tokenizer.decode(row[: int(n)].tolist(), skip_special_tokens=True).strip()
        for row, n in zip(completion_ids, lengths, strict=True)
    ]


def _shifted_step(on_step: StepCallback, start: int, rows: torch.Tensor,
                  tokens: torch.Tensor) -> None:
    on_step(rows + start, tokens)


def decode_rows(
    model: nn.Module, rows_ids: torch.Tensor, rows_mask: torch.Tensor,
    settings: SamplingSettings, engine: str | ExternalEngine, *, stop_ids: list[int],
    pad_id: int, generation_batch_size: int | None = None, record_logprobs: bool = False,
    plain_max_bytes: int | None = None,
) -> Decoded:
    """One continuation of each [B, P] left-padded row of token ids (an episode's next turn):
    the raw tokens [B, C] (not cut at the stop), and their sampling-time log-probs when asked
    and the engine records them."""
    if isinstance(engine, str):
        chosen = choose_engine(model, engine, rows_ids.shape[1] + settings.max_new_tokens)
        parts, logps, nonfinite, rows_reset = _decode_batches(
            model, rows_ids, rows_mask, settings, chosen, stop_ids=stop_ids, pad_id=pad_id,
            generator_seed=None, generation_batch_size=generation_batch_size,
            record_logprobs=record_logprobs, plain_max_bytes=plain_max_bytes)
        recorded = record_logprobs and chosen == "native"
    else:
        parts, logps, nonfinite, rows_reset = _decode_external(
            engine, rows_ids, rows_mask, settings, num_generations=1, stop_ids=stop_ids,
            pad_id=pad_id, seed=None, record_logprobs=record_logprobs)
        recorded = record_logprobs
    logp = _pad_right(logps, 0) if recorded and all(p is not None for p in logps) else None
    return Decoded(_pad_right(parts, pad_id), nonfinite, logp, rows_reset)


def generate_rollout(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompt_texts: list[str],
    settings: SamplingSettings,
    *,
    num_generations: int,
    max_prompt_length: int,
    add_special_tokens: bool = True,
    generator_seed: int | None = None,
    engine: str | ExternalEngine = "auto",
    generation_batch_size: int | None = None,
    record_logprobs: bool = False,
    plain_max_bytes: int | None = None,
    on_step: StepCallback | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each prompt.

    `engine` is `native` (mogrpo's decode loop), `hf` (`model.generate`), `auto` (native
    where the model can run on it) or an `ExternalEngine` object (the colocated vLLM engine,
    which batches on its own). `generation_batch_size` caps the completions decoded at
    once (None: all). `generator_seed` makes the sample reproducible without disturbing the
    global RNG stream. `record_logprobs` (native and vllm engines) keeps each token's
    sampling-time log-prob in `Rollout.sampler_logp`. `plain_max_bytes` bounds the weight
    copies the native engine makes to decode faster (None: its default, `PLAIN_MAX_BYTES`).
    `on_step(rows, tokens)` (native engine only; the others never call it) sees each decode
    step's tokens as they are chosen: the rows [b] still decoding, numbered as the rollout's
    rows, and their new tokens [b].
    """
    _check_rollout_arguments(model, prompt_texts, settings, num_generations=num_generations,
                             max_prompt_length=max_prompt_length, engine=engine,
                             generation_batch_size=generation_batch_size)
    pad_id = _pad_id(tokenizer)
    stop_ids = resolve_stop_ids(model, tokenizer, settings)

    prompt_ids, prompt_mask, cut = tokenize_prompts(
        tokenizer, prompt_texts, max_prompt_length=max_prompt_length,
        add_special_tokens=add_special_tokens, pad_id=pad_id,
    )
    rows_ids, rows_mask = _prompt_rows(model, prompt_ids, prompt_mask, num_generations, cut,
                                       max_prompt_length)
    if isinstance(engine, str):
        chosen = choose_engine(model, engine, rows_ids.shape[1] + settings.max_new_tokens)
        parts, logps, nonfinite, rows_reset = _decode_batches(
            model, rows_ids, rows_mask, settings, chosen, stop_ids=stop_ids, pad_id=pad_id,
            generator_seed=generator_seed, generation_batch_size=generation_batch_size,
            record_logprobs=record_logprobs, plain_max_bytes=plain_max_bytes, on_step=on_step)
    else:  # vLLM batches itself: one request per prompt, n = K completions each
        chosen = "external"
        parts, logps, nonfinite, rows_reset = _decode_external(
            engine, prompt_ids, prompt_mask, settings, num_generations=num_generations,
            stop_ids=stop_ids, pad_id=pad_id, seed=generator_seed,
            record_logprobs=record_logprobs)
    if nonfinite:
        logger.warning("replaced %d non-finite logits during rollout (%d rows reset)",
                       nonfinite, rows_reset)
    generated = _pad_right(parts, pad_id)  # [B, C]

    completion_ids, completion_mask, lengths, truncated = split_completions(
        generated, stop_ids, pad_id
    )
    texts = _decode_texts(tokenizer, completion_ids, lengths)
    return Rollout(
        prompt_ids=rows_ids,
        prompt_mask=rows_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        lengths=lengths,
        truncated=truncated,
        texts=texts,
        num_generations=num_generations,
        prompt_truncated=cut,
        nonfinite_logits=nonfinite,
        sampler_logp=(_pad_right(logps, 0) * completion_mask
                      if record_logprobs and chosen in ("native", "external") else None),
    )

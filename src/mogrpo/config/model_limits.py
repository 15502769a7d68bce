"""What the model decides about a run, read from its config.json and tokenizer files before any
weights load: how many positions it has (prompt + completion must fit), and how many token ids
its embeddings hold (the tokenizer must not produce more).

The files come from a local directory (or, for `mogrpo memory`, a config.json path) or, for a
hub id, from the local Hugging Face cache only: validation never goes to the network (offline
that costs ~25 s of retries), so a hub model not yet downloaded is checked by the rollout
instead. Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mogrpo.config.hardware import saved_quantization_errors
from mogrpo.config.rollout import derive_lengths
from mogrpo.config.sections import RunConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
"""A hub id is "name" or "owner/name"; anything else that does not exist locally is a bad path."""
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                 "max_seq_len")
"""The names families give their context length (GPT-2: n_positions, ChatGLM: seq_length,
MPT: max_seq_len); where several are set, the smallest binds."""
TOKENIZER_BYTES = 100 * 2**20
"""Larger tokenizer.json files are not parsed: reading one must stay well under a second."""


@dataclass(frozen=True)
class ModelLimits:
    """A model's limits as its files state them; None where they do not say."""

    model: str
    """`model.name_or_path`, as the messages name it."""
    positions: int | None
    """Tokens of prompt + completion the model can attend over (rope scaling included)."""
    positions_from: str
    """Where `positions` comes from, e.g. `max_position_embeddings = 128`."""
    vocab_size: int | None
    """Rows of the model's token embedding."""
    tokenizer_tokens: int | None
    """Largest token id the tokenizer can produce, plus one (None: not read)."""
    quantization: dict[str, Any] | None = None
    """config.json's `quantization_config`: how a checkpoint saved quantised stores its weights
    (None: it was not)."""


def find_file(name_or_path: str, filename: str) -> Path | None:
    """`filename` of a local model directory, or of a hub id in the local cache; else None."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        found = path / filename if path.is_dir() else None
        return found if found is not None and found.is_file() else None
    if not HUB_ID.match(name_or_path):
        return None
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(name_or_path, filename)
    except ValueError:  # an id the hub would refuse (`a--b`): the loader says so
        return None
    return Path(cached) if isinstance(cached, str) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None  # the loader reports an unreadable file with its own words
    return data if isinstance(data, dict) else None


def text_fields(config: dict[str, Any]) -> dict[str, Any]:
    """A config's language-model fields: a multimodal config's `text_config` over its own (as
    transformers' `get_text_config`)."""
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


def position_limit(config: dict[str, Any]) -> tuple[int | None, str]:
    """(positions, where they come from) of a config.json dict or `PretrainedConfig.to_dict()`.

    RoPE scaling, as transformers documents `factor`: "a factor of x will enable the model to
    handle sequences of length x * original maximum pre-trained length", the original being
    `original_max_position_embeddings` where given (yarn, llama3, longrope), else
    `max_position_embeddings`; the larger of that and the stated positions binds (llama3 and
    longrope configs state the extended length already). Per-layer-type RoPE (Gemma 3) takes
    the least extended layer type, as the model loaded by transformers has it."""
    fields = text_fields(config)
    found = [(fields[k], k) for k in POSITION_KEYS if isinstance(fields.get(k), int)
             and not isinstance(fields[k], bool) and fields[k] > 0]
    if not found:
        return None, "no position limit in its config"
    positions, key = min(found)
    rope = fields.get("rope_parameters") or fields.get("rope_scaling")
    layers = list(rope.values()) if isinstance(rope, dict) and rope and all(
        isinstance(v, dict) for v in rope.values()) else [rope]
    if len(layers) == 1 and "rope_local_base_freq" in fields:
        # Gemma 3's config.json: the one scaling is its global layers'; the sliding layers
        # keep their own unscaled RoPE (transformers makes it per layer type on load)
        layers.append(None)
    extended = min(_rope_extended(r, positions) for r in layers)
    if extended <= positions:
        return positions, f"{key} = {positions}"
    kind = next(r.get("rope_type") or r.get("type") for r in layers if isinstance(r, dict))
    scaling = f"RoPE {kind} scaling" if kind else "RoPE scaling"
    return extended, f"{key} = {positions}, {scaling} to {extended}"


def _rope_extended(rope: Any, positions: int) -> int:
    """The context a RoPE scaling dict extends to (`positions` where it does not)."""
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) == "default":
        return positions
    factor = rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        return positions
    original = rope.get("original_max_position_embeddings") or positions
    return int(factor * original)


def tokenizer_tokens(name_or_path: str) -> int | None:
    """The largest token id the tokenizer can produce, plus one: from tokenizer.json (its
    vocabulary and added tokens) and tokenizer_config.json's added tokens; None when neither is
    at hand (a sentencepiece-only tokenizer, a hub tokenizer not in the cache). From
    tokenizer_config.json alone it is a lower bound, still enough to find too many."""
    ids: list[int] = []
    path = find_file(name_or_path, "tokenizer.json")
    data = _read_json(path) if path is not None and path.stat().st_size <= TOKENIZER_BYTES \
        else None
    if data is not None:
        vocab = (data.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):  # BPE, WordPiece, WordLevel: {token: id}
            ids += [i for i in vocab.values() if isinstance(i, int)]
        elif isinstance(vocab, list):  # Unigram: [[piece, score], ...], the id is the index
            ids.append(len(vocab) - 1)
        ids += [t["id"] for t in data.get("added_tokens") or []
                if isinstance(t, dict) and isinstance(t.get("id"), int)]
    path = find_file(name_or_path, "tokenizer_config.json")
    data = _read_json(path) if path is not None else None
    if data is not None and isinstance(data.get("added_tokens_decoder"), dict):
        ids += [int(k) for k in data["added_tokens_decoder"] if str(k).isdigit()]
    return max(ids) + 1 if ids else None


def read_limits(config: RunConfig) -> ModelLimits | None:
    """The limits of the run's model, or None when its config.json is not at hand (a hub id
    not in the cache, a path that does not exist: the loader says why)."""
    mc = config.model
    name = mc.name_or_path or ""
    path = Path(name).expanduser()
    file = path if path.is_file() else find_file(name, "config.json")
    data = _read_json(file) if file is not None else None
    if data is None:
        return None
    positions, source = position_limit(data)
    vocab = text_fields(data).get("vocab_size")
    tokens = None if path.is_file() else tokenizer_tokens(mc.tokenizer or name)
    quantization = text_fields(data).get("quantization_config")
    return ModelLimits(name, positions, source, vocab if isinstance(vocab, int) else None,
                       tokens, quantization if isinstance(quantization, dict) else None)


def missing_config(config: RunConfig) -> str | None:
    """The error for a model directory without config.json (nothing could load from it)."""
    name = config.model.name_or_path
    path = Path(name).expanduser() if name else None
    if path is None or not path.is_dir() or (path / "config.json").is_file():
        return None
    return (f"model.name_or_path = {name!r} is a directory without config.json; pass the "
            "directory save_pretrained wrote (config.json, weights, tokenizer files)")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "vocab.txt")
"""A directory holding none of these has no tokenizer (save_pretrained writes the first two)."""


def missing_tokenizer(config: RunConfig) -> str | None:
    """The error for a local tokenizer directory without tokenizer files (a model saved without
    its tokenizer): transformers fails with a traceback about sentencepiece."""
    mc = config.model
    name = mc.tokenizer or mc.name_or_path
    path = Path(name).expanduser() if name else None
    if path is None or not path.is_dir() or any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    field = "model.tokenizer" if mc.tokenizer else "model.name_or_path"
    fix = "point it at the directory tokenizer.save_pretrained wrote, or a hub id" if \
        mc.tokenizer else ("save the tokenizer there too (tokenizer.save_pretrained), or set "
                           "model.tokenizer to the directory or hub id that has it")
    return (f"{field} = {name!r} has no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}); "
            f"{fix}")


def fit_lengths(config: RunConfig, limits: ModelLimits) -> tuple[list[str], dict[str, str]]:
    """(errors, notes): lengths the user gave that exceed the model's positions are errors;
    budgets that lengths are derived from (`rollout.max_seq_length` where a length is not
    given, `sft.max_length`) are lowered to the positions, each change noted by its key for
    the startup summary."""
    ro, positions = config.rollout, limits.positions
    if positions is None:
        return [], {}
    model = f"model {limits.model} ({limits.positions_from})"
    errors = _rollout_errors(config, positions, f"the {positions} positions of {model}")
    notes, where = {}, f"the positions of {model}"
    if not errors and sum(derive_lengths(ro)) > positions:
        total, ro.max_seq_length = ro.max_seq_length, positions
        prompt, completion = derive_lengths(ro)
        unset = [f"rollout.{n}" for n in ("max_prompt_length", "max_completion_length")
                 if getattr(ro, n) is None]
        how = f"rollout.length_allocation = {ro.length_allocation}" \
            if ro.length_allocation != "explicit" else \
            f"{' and '.join(unset)} {'is' if len(unset) == 1 else 'are'} not set"
        notes["rollout.max_seq_length"] = (f"{total} → {positions}, {where}; {how}: {prompt} "
                                           f"prompt + {completion} completion tokens")
    if config.sft.enabled and config.sft.max_length > positions:
        notes["sft.max_length"] = (f"{config.sft.max_length} → {positions}, {where}: longer "
                                   "warm-up examples are cut")
        config.sft.max_length = positions
    return errors, notes


def _rollout_errors(config: RunConfig, positions: int, where: str) -> list[str]:
    """The rollout lengths the user gave that cannot fit `positions`, with the fix."""
    ro = config.rollout
    if ro.length_allocation != "explicit":
        return []  # both lengths derive from max_seq_length, which fit_lengths lowers
    prompt, completion = ro.max_prompt_length, ro.max_completion_length
    other = " or use a model with more positions"
    if prompt is not None and completion is not None and prompt + completion > positions:
        fix = f"set rollout.max_prompt_length ≤ {positions - completion}" if completion < \
            positions else (f"set rollout.max_completion_length < {positions} and "
                            f"rollout.max_prompt_length ≤ {positions} minus it")
        return [f"rollout.max_prompt_length ({prompt}) + rollout.max_completion_length "
                f"({completion}) = {prompt + completion} exceeds {where}; {fix}{other}"]
    for name, value, rest in (("max_completion_length", completion, "prompt"),
                              ("max_prompt_length", prompt, "completion")):
        if value is not None and value >= positions:
            return [f"rollout.{name} = {value} leaves no room for a {rest} in {where}; set it "
                    f"below {positions} (the {rest} gets the rest){other}"]
    return []


def vocab_errors(config: RunConfig, limits: ModelLimits) -> list[str]:
    """A tokenizer that produces ids the model has no embedding for."""
    tokens, vocab = limits.tokenizer_tokens, limits.vocab_size
    if tokens is None or vocab is None or tokens <= vocab:
        return []
    mc = config.model
    field = f"model.tokenizer = {mc.tokenizer!r}" if mc.tokenizer else \
        f"the tokenizer of model.name_or_path = {limits.model!r}"
    return [f"{field} has {tokens} tokens (ids up to {tokens - 1}), but model {limits.model} "
            f"embeds only vocab_size = {vocab} of them; use the tokenizer saved with the model, "
            f"or save the model with its embeddings resized to {tokens} "
            "(model.resize_token_embeddings)"]


def stop_errors(config: RunConfig, limits: ModelLimits) -> list[str]:
    """Stop ids the model cannot sample (beyond its embeddings): they replace its EOS, so no
    completion would ever stop (e.g. Llama 3's 128001 and 128009 kept for a smaller model)."""
    vocab, ids = limits.vocab_size, config.rollout.stop_token_ids
    beyond = [i for i in ids if vocab is not None and i >= vocab]
    if not beyond:
        return []
    return [f"rollout.stop_token_ids = {ids}: {', '.join(map(str, beyond))} "
            f"{'is' if len(beyond) == 1 else 'are'} beyond the vocabulary of model "
            f"{limits.model} (vocab_size = {vocab}: ids 0 to {vocab - 1}), so no completion "
            "would stop on them; give this model's end-of-turn ids, or remove "
            "rollout.stop_token_ids to stop on its EOS tokens"]


def has_chat_template(name_or_path: str) -> bool | None:
    """Whether the tokenizer's files carry a chat template (tokenizer_config.json's
    `chat_template`, or a chat_template.jinja / .json beside it); None when they are not at
    hand. Local directories only: a hub cache may hold tokenizer_config.json without the
    template file beside it."""
    folder = Path(name_or_path).expanduser()
    if not (folder / "tokenizer_config.json").is_file():
        return None
    data = _read_json(folder / "tokenizer_config.json") or {}
    return bool(data.get("chat_template")) or any(
        (folder / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))


def chat_template_file(value: str) -> Path | None:
    """The .jinja file `model.chat_template` names; None where it is the template's text (or
    `tiny_tools`)."""
    return Path(value).expanduser() if value.strip().endswith(".jinja") and "{" not in value \
        else None


def missing_chat_template_file(value: str) -> str | None:
    """The error for a `model.chat_template` naming a .jinja file that is not there."""
    path = chat_template_file(value)
    if path is None or path.is_file():
        return None
    return (f"model.chat_template: file {value} not found (resolved to {path.resolve()}); give "
            "a .jinja file, the template's text or tiny_tools")


def chat_template_errors(config: RunConfig) -> list[str]:
    """What needs a chat template the run will not have: `model.use_chat_template: true`, a
    task with tools (the template renders them) or with `format: chat`, against a tokenizer
    whose files have none and no `model.chat_template`; a `.jinja` file that does not exist."""
    mc = config.model
    value = mc.chat_template
    if value is not None:
        missing = missing_chat_template_file(value)
        return [missing] if missing else []
    needs = [f"tasks.{n} has tools (the chat template renders them and their results)"
             for n, t in config.tasks.items() if t.has_tools]
    needs += [f"tasks.{n}.format = chat" for n, t in config.tasks.items() if t.format == "chat"]
    if mc.use_chat_template is False:
        return [f"{need}, but model.use_chat_template = false; remove model.use_chat_template "
                "(or set it true)" for need in needs]
    needs += ["model.use_chat_template = true"] if mc.use_chat_template else []
    name = mc.tokenizer or mc.name_or_path
    if not needs or not name or has_chat_template(name) is not False:
        return []
    field = f"model.tokenizer = {name!r}" if mc.tokenizer else \
        f"the tokenizer of model.name_or_path = {name!r}"
    return [f"{need}, but {field} has no chat template; set model.chat_template (Jinja text, a "
            ".jinja file, or tiny_tools), or use a tokenizer that has one" for need in needs]


def model_errors(config: RunConfig, run: bool = True) -> tuple[list[str], dict[str, str]]:
    """(errors, notes) of everything the model's files decide; `config` gets the lowered
    budgets (`fit_lengths`). `run`: the run starts here, so its tokenizer must be at hand too
    (the memory planner needs only config.json)."""
    missing = missing_config(config)
    if missing is not None:
        return [missing], {}
    tokenizer = missing_tokenizer(config) if run else None
    limits = read_limits(config)
    if limits is None:
        return [tokenizer] if tokenizer else [], {}
    errors, notes = fit_lengths(config, limits)
    errors += [tokenizer] if tokenizer else []
    errors += saved_quantization_errors(config.model, config.lora.enabled, limits.model,
                                        limits.quantization)
    return errors + vocab_errors(config, limits) + stop_errors(config, limits), notes

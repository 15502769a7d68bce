"""A reward model as a reward function: `fn: reward_model`, an
`AutoModelForSequenceClassification` (local path or hub id) with its own tokenizer and chat
template, scoring prompt + completion in batches. The score is the first logit, as in TRL.

Options (the reward's `kwargs`) are checked when the config loads; the weights load at the
first call, on the policy's device or on the CPU.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError

from mogrpo.config.base import Section
from mogrpo.errors import ConfigError, RewardError

log = logging.getLogger(__name__)
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


class RewardModelOptions(Section):
    model: str
    """The sequence-classification reward model: a local directory or a hub id."""
    tokenizer: str | None = None
    """Its tokenizer when it is not next to the model."""
    chat_template: str | None = None
    """A Jinja chat template for chat tasks, when the reward model's tokenizer has none."""
    device: Literal["policy", "cpu"] = "policy"
    """Where it runs: the policy's device (counted by the memory planner) or the CPU."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weight dtype; `auto` is float32 on CPU and bfloat16 on GPU."""
    batch_size: int = Field(16, ge=1)
    """Completions scored per forward pass."""
    max_length: int | None = Field(None, ge=1)
    """Cut prompt + completion to this many tokens (from the left, keeping the completion)."""
    normalize: Literal["none", "sigmoid", "standardize"] = "none"
    """The score: the raw logit, sigmoid(logit) in (0, 1), or (logit − mean) / std."""
    mean: float = 0.0
    """standardize: the logit's mean over typical completions."""
    std: float = Field(1.0, gt=0)
    """standardize: the logit's standard deviation over typical completions."""
    trust_remote_code: bool = False
    """Allow the reward model's own code from its hub repository to run."""


def parse_options(options: Any, where: str) -> RewardModelOptions:
    """Validated options; errors name the config path and the fix."""
    if not isinstance(options, dict):
        raise ConfigError(f"{where} = {options!r:.80}: a reward model's kwargs must be a mapping "
                          "with at least `model`")
    try:
        parsed = RewardModelOptions.model_validate(options)
    except ValidationError as err:
        lines = [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()]
        raise ConfigError("invalid reward model options:\n  " + "\n  ".join(lines)) from None
    _check_model(parsed, where)
    return parsed


def _check_model(options: RewardModelOptions, where: str) -> None:
    """A local model must exist and be a sequence classifier (read from config.json only)."""
    path = Path(options.model).expanduser()
    local = path.exists() or options.model.startswith((".", "/", "~")) or options.model.count("/") > 1
    if not local:
        return  # a hub id: checked when it loads
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{where}.model = {options.model!r}: no config.json there (resolved to "
                          f"{path.resolve()}); give a directory written by save_pretrained")
    import json

    architectures = json.loads(config_file.read_text(encoding="utf-8")).get("architectures") or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ConfigError(
            f"{where}.model = {options.model!r} is a {', '.join(architectures)}, not a "
            "sequence-classification model; a reward model scores with one logit per text "
            "(AutoModelForSequenceClassification)")


def model_params(config: Any) -> int:
    """Parameters of a sequence classifier from its config (the memory planner)."""
    from mogrpo.modeling.architecture import Architecture

    shape = Architecture.from_config(config)
    raw = config if isinstance(config, dict) else config.to_dict()
    labels = raw.get("num_labels") or len(raw.get("id2label") or {}) or 1
    head = 0 if shape.tied else shape.vocab * shape.hidden  # no LM head; a score head instead
    return shape.params - head + shape.hidden * labels


class RewardModelReward:
    """Scores completions with a sequence-classification model (reward contract: TRL's)."""

    def __init__(self, options: RewardModelOptions, *, policy_device: str = "auto",
                 where: str = "reward_model") -> None:
        self.options = options
        self.policy_device = policy_device
        self.where = where
        self._model: Any = None
        self._tokenizer: Any = None

    @classmethod
    def from_options(cls, options: Any, *, where: str, policy_device: str = "auto"
                     ) -> RewardModelReward:
        return cls(parse_options(options, where), policy_device=policy_device, where=where)

    @property
    def device(self) -> Any:
        import torch

        if self.options.device == "cpu" or self.policy_device == "cpu" \
                or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        o, device = self.options, self.device
        dtype = _DTYPES.get(o.dtype) or ("float32" if device.type == "cpu" else "bfloat16")
        try:
            tokenizer = AutoTokenizer.from_pretrained(o.tokenizer or o.model,
                                                      trust_remote_code=o.trust_remote_code)
            model = AutoModelForSequenceClassification.from_pretrained(
                o.model, dtype=getattr(torch, dtype), trust_remote_code=o.trust_remote_code)
        except Exception as e:  # noqa: BLE001 - hub, file and format errors alike
            raise RewardError(f"{self.where}: cannot load reward model {o.model!r}: "
                              f"{type(e).__name__}: {e}") from e
        if tokenizer.pad_token is None:  # the classifier finds each row's last token by padding
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "right"
        tokenizer.truncation_side = "left"  # keep the completion when cutting
        if o.chat_template:
            tokenizer.chat_template = o.chat_template
        model.config.pad_token_id = tokenizer.pad_token_id
        self._model = model.to(device).eval()
        self._tokenizer = tokenizer
        log.info("%s: reward model %s on %s (%s)", self.where, o.model, device, dtype)

    def text(self, prompt: Any, completion: Any) -> str:
        """prompt + completion as the reward model reads it: through its chat template for a
        chat task (TRL's `apply_chat_template(prompt + completion)`), concatenated otherwise."""
        if isinstance(prompt, list):
            reply = completion if isinstance(completion, list) else [
                {"role": "assistant", "content": str(completion)}]
            if not getattr(self._tokenizer, "chat_template", None):
                raise RewardError(
                    f"{self.where}: the task's prompts are chat messages but the reward model's "
                    "tokenizer has no chat template; set `chat_template` in its kwargs")
            return self._tokenizer.apply_chat_template(prompt + reply, tokenize=False)
        return str(prompt) + (completion if isinstance(completion, str) else str(completion))

    def __call__(self, prompts: list[Any], completions: list[Any], **_: Any) -> list[float]:
        import torch

        if self._model is None:
            self._load()
        o = self.options
        texts = [self.text(p, c) for p, c in zip(prompts, completions, strict=True)]
        scores: list[float] = []
        for start in range(0, len(texts), o.batch_size):
            batch = self._tokenizer(texts[start:start + o.batch_size], return_tensors="pt",
                                    padding=True, add_special_tokens=False,
                                    truncation=o.max_length is not None, max_length=o.max_length)
            with torch.inference_mode():
                out = self._model(**batch.to(self.device), use_cache=False)
                logits = out.logits[:, 0].float()  # [b]
            scores.extend(self.normalize(v) for v in logits.tolist())
        return scores

    def normalize(self, logit: float) -> float:
        o = self.options
        if o.normalize == "sigmoid":
            return 1.0 / (1.0 + math.exp(-logit)) if logit >= 0 else \
                math.exp(logit) / (1.0 + math.exp(logit))
        if o.normalize == "standardize":
            return (logit - o.mean) / o.std
        return logit

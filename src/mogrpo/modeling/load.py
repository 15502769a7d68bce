"""Load the policy and tokenizer (LoRA, 4-bit, checkpointing, attention), count and save them."""

from __future__ import annotations

import copy
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub.errors import StrictDataclassError
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from mogrpo import kernels
from mogrpo.config.machine import accelerator_problems
from mogrpo.config.model_limits import HUB_ID
from mogrpo.errors import ConfigError, ModelError
from mogrpo.modeling.architecture import ModuleTree, check_lora_targets, lora_targets
from mogrpo.modeling.dropout import disable_dropout as switch_off_dropout
from mogrpo.modeling.dropout import original_dropout_config
from mogrpo.modeling.embeddings4bit import quantize_embeddings
from mogrpo.modeling.quantize import (
    check_bitsandbytes,
    is_quantized,
    prepare_quantized,
    quantization_config,
    quantized_device_map,
)

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass
class LoraSettings:
    """Low-rank adapters (peft LoRA) on top of frozen base weights."""

    r: int = 8
    """Adapter rank."""
    alpha: int = 16
    """Scaling numerator: the update is (alpha / r) * B @ A."""
    dropout: float = 0.05
    """Dropout on the adapter input during training."""
    target_modules: list[str] | str = "all-linear"
    """Module names to adapt, or "all-linear" for every linear layer except the output head."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """Map a dtype name to torch: auto = float32 on CPU, else bfloat16 if the GPU has it, else
    float16 (for inference: `predict`, `serve`; training loads as `model.precision` says)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ConfigError(f"model.dtype = {dtype!r} is not one of {list(DTYPES)}")
    if dtype != "auto":
        return getattr(torch, dtype)
    if not torch.cuda.is_available():
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def _check_source(name_or_path: str, what: str) -> None:
    """Fail early on a path that is neither a local directory nor shaped like a hub id."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelError(
                f"{what} {name_or_path!r} is a file; pass the directory that holds config.json"
            )
        return
    if not HUB_ID.match(name_or_path) or name_or_path.startswith((".", "~")):
        raise ModelError(
            f"{what} {name_or_path!r} does not exist and is not a Hugging Face hub id; "
            "pass an existing local directory or an id like 'Qwen/Qwen2.5-0.5B-Instruct'"
        )


def _unreachable(name_or_path: str, what: str, err: Exception) -> ModelError:
    reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
    if Path(name_or_path).expanduser().is_dir():
        return ModelError(
            f"cannot load {what} from directory {name_or_path!r}: {reason}. It must hold the files "
            "written by save_pretrained (config.json, weights, tokenizer files)"
        )
    return ModelError(
        f"cannot load {what} {name_or_path!r}: this machine could not fetch it from the Hugging Face "
        f"hub (offline, gated or misspelled id; {reason}). Download it once with "
        "`huggingface-cli download` and pass the local directory, or set HF_HUB_OFFLINE=1 to use "
        "the local cache"
    )


def _check_accelerators(quantized: str | None, attn_implementation: str | None,
                        device: torch.device | None) -> None:
    if quantized:
        check_bitsandbytes(quantized, device)
    # (4-bit and 8-bit weights: bitsandbytes' own check above, with its message)
    problems = accelerator_problems(attn_implementation)
    if problems:
        raise ModelError(problems[0])


def load_tokenizer(
    name_or_path: str, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    """Load a tokenizer with left padding and a pad token (EOS when it has none)."""
    _check_source(name_or_path, "tokenizer")
    try:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    # ValueError: no tokenizer files ("Couldn't instantiate the backend tokenizer")
    except (OSError, ValueError) as err:
        raise _unreachable(name_or_path, "tokenizer", err) from err
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ModelError(
                f"tokenizer {name_or_path!r} has neither a pad nor an EOS token; add one "
                "(tokenizer.add_special_tokens) and save it, then point model.tokenizer at it"
            )
        logger.info(
            "tokenizer %s has no pad token; padding with EOS %r", name_or_path, tokenizer.eos_token
        )
        tokenizer.pad_token = tokenizer.eos_token
    # Decoder-only generation continues from the last position, so prompts pad on the left.
    tokenizer.padding_side = "left"
    return tokenizer


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Activation (gradient) checkpointing with the non-reentrant implementation."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_policy(
    name_or_path: str,
    *,
    dtype: str | torch.dtype = "auto",
    gradient_checkpointing: bool = False,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    lora: LoraSettings | None = None,
    load_in_4bit: bool = False,
    load_in_8bit: bool = False,
    embeddings_in_4bit: bool = False,
    tokenizer_name_or_path: str | None = None,
    disable_dropout: bool = True,
    device: torch.device | None = None,
    adapter_dtype: torch.dtype = torch.float32,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM (optionally 4- or 8-bit, with LoRA) and its tokenizer from a directory or
    hub id.

    `disable_dropout` sets the model's own dropout to 0 (see `mogrpo.modeling.dropout`; LoRA's
    dropout is kept); a wrong `lora.target_modules` is reported before the weights load.
    `device` a CUDA device: the weights load straight onto it, never whole in host memory
    (otherwise they load on the CPU, where the caller moves them); a quantised base loads
    where `quantized_device_map` says (the CPU too, with bitsandbytes >= 0.46.1). `dtype` is that of every
    weight as loaded (a quantised base's compute dtype); LoRA adapters are `adapter_dtype`,
    and a quantised base's 1-D weights too when that is float32 (`prepare_quantized`).
    `embeddings_in_4bit` (with `load_in_4bit`): the embedding and head in NF4 as well
    (`mogrpo.modeling.embeddings4bit`).
    """
    torch_dtype = resolve_dtype(dtype)
    if load_in_4bit and load_in_8bit:
        raise ConfigError("model.load_in_4bit and model.load_in_8bit are both set; keep one")
    bits = 4 if load_in_4bit else 8 if load_in_8bit else None
    if embeddings_in_4bit and bits != 4:
        raise ConfigError("model.embeddings_in_4bit is set without model.load_in_4bit; set "
                          "both, or embeddings_in_4bit: false")
    _check_accelerators(f"model.load_in_{bits}bit" if bits else None, attn_implementation,
                        device)
    config = _causal_lm_config(name_or_path, trust_remote_code)
    if lora is not None:
        check_lora_targets(config, lora.target_modules, trust_remote_code=trust_remote_code)
    tokenizer = load_tokenizer(
        tokenizer_name_or_path or name_or_path, trust_remote_code=trust_remote_code
    )
    model = _load_weights(name_or_path, _load_kwargs(torch_dtype, trust_remote_code,
                                                     attn_implementation, bits, device))
    if disable_dropout:
        _log_dropout(switch_off_dropout(model), lora)

    if embeddings_in_4bit:
        logger.info("NF4 %s (model.embeddings_in_4bit)",
                    " and ".join(quantize_embeddings(model, torch_dtype)))
    if bits:
        # float32 adapters (mixed precision): the 1-D weights too, not peft's every 16-bit
        # weight; pure bf16: nothing (see mogrpo.modeling.quantize)
        prepare_quantized(model, upcast=adapter_dtype == torch.float32)
    if gradient_checkpointing:
        enable_checkpointing(model)
    if lora is not None:
        model = apply_lora(model, lora, input_grads=gradient_checkpointing,
                           adapter_dtype=adapter_dtype)
    trainable, total = trainable_parameters(model)
    logger.info(
        "loaded %s (%s, %s): %d of %d parameters trainable",
        name_or_path,
        torch_dtype,
        "LoRA" if lora else "full",
        trainable,
        total,
    )
    return model, tokenizer


def _causal_lm_config(name_or_path: str, trust_remote_code: bool) -> PretrainedConfig:
    """The model's transformers config; a ModelError unless it is a decoder-only causal LM."""
    _check_source(name_or_path, "model")
    try:
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as err:  # ValueError: a directory without a usable config.json
        raise _unreachable(name_or_path, "model", err) from err
    except StrictDataclassError as err:  # a field of the wrong type, e.g. "2048" for an int
        raise ModelError(invalid_config_json(name_or_path, err)) from err
    remote_causal = "AutoModelForCausalLM" in (getattr(config, "auto_map", None) or {})
    if getattr(config, "is_encoder_decoder", False) or not (
        config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES or remote_causal
    ):
        raise ModelError(
            f"model {name_or_path!r} (model_type {config.model_type!r}) is not a causal language model; "
            "mogrpo trains decoder-only models such as Llama, Qwen2, Mistral or Gemma"
        )
    return config


def invalid_config_json(name_or_path: str, err: Exception) -> str:
    """The message for a config.json transformers refuses field by field."""
    reason = " ".join(str(err).split())
    return (f"model {name_or_path!r}: its config.json does not fit its model type ({reason}); "
            "fix that field in config.json (or save the config again with save_pretrained)")


def _load_kwargs(torch_dtype: torch.dtype, trust_remote_code: bool,
                 attn_implementation: str | None, bits: int | None,
                 device: torch.device | None) -> dict:
    """`from_pretrained`'s arguments: dtype, attention, quantisation and target device."""
    kwargs: dict = {"dtype": torch_dtype, "trust_remote_code": trust_remote_code}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if bits:
        kwargs["quantization_config"] = quantization_config(bits, torch_dtype)
        kwargs["device_map"] = quantized_device_map(device)
    elif device is not None and device.type == "cuda":
        kwargs["device_map"] = {"": torch.cuda.current_device() if device.index is None
                                else device.index}
    return kwargs


def _load_weights(name_or_path: str, kwargs: dict) -> PreTrainedModel:
    """`AutoModelForCausalLM.from_pretrained`, its failures as ModelErrors that say why."""
    try:
        return AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    except OSError as err:
        raise _unreachable(name_or_path, "model", err) from err
    except (ValueError, ImportError) as err:
        raise ModelError(f"cannot load model {name_or_path!r}: {err}") from err


def _log_dropout(changed: dict[str, float], lora: LoraSettings | None) -> None:
    if not changed:
        return
    fields = {k.removeprefix("config."): v for k, v in changed.items() if k.startswith("config.")}
    shown = ", ".join(f"{k} {v:g}" for k, v in sorted(fields.items())) or "module rates"
    kept = f"; LoRA dropout stays {lora.dropout:g}" if lora is not None else ""
    logger.info("model dropout off in every pass (model.disable_dropout): %s → 0 (%d places)%s",
                shown, len(changed), kept)


def apply_lora(
    model: PreTrainedModel, settings: LoraSettings, *, input_grads: bool = False,
    adapter_dtype: torch.dtype = torch.float32,
) -> PreTrainedModel:
    """Wrap `model` with fresh LoRA adapters (B = 0, so the output is unchanged at first) in
    `adapter_dtype`, whatever the base's; their dropout is `FastDropout`, their layers
    `FusedLoraLinear`."""
    from peft import LoraConfig, get_peft_model

    if settings.r < 1 or settings.alpha <= 0 or not 0 <= settings.dropout < 1:
        raise ConfigError(
            f"lora r={settings.r}, alpha={settings.alpha}, dropout={settings.dropout}: need r >= 1, "
            "alpha > 0 and 0 <= dropout < 1"
        )
    targets = lora_targets(ModuleTree.from_model(model), settings.target_modules)
    if input_grads:
        # Checkpointed blocks of a frozen base only pass gradients to the adapters if the
        # embedding output requires grad.
        model.enable_input_require_grads()
    config = LoraConfig(
        task_type="CAUSAL_LM",
        r=settings.r,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=settings.target_modules,
        # transformers' Conv1D (GPT-2) stores its weight transposed: say so, rather than have
        # peft correct the flag with a warning on every run
        fan_in_fan_out=bool(targets) and all(t.conv1d for t in targets),
        bias="none",
    )
    with warnings.catch_warnings():
        # peft probes the deprecated `is_gradient_checkpointing` alias of transformers 5.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning
        )
        try:
            # peft upcasts bf16/fp16 adapters to fp32 by default; pure bf16 asks it not to
            model = get_peft_model(model, config,
                                   autocast_adapter_dtype=adapter_dtype == torch.float32)
        except ValueError as err:
            raise ConfigError(f"lora.target_modules = {settings.target_modules!r}: {err}") from err
    for param in model.parameters():
        # the trained weights are the adapters: their dtype is the master dtype, whatever
        # peft made of a float32 base (left as is) or a half-precision one
        if param.requires_grad and param.dtype != adapter_dtype:
            param.data = param.data.to(adapter_dtype)
    # the same layers and dropout, fused and their masks drawn faster on CPUs
    kernels.prepare_lora(model)
    return model


def trainable_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; 4-bit weights counted as their unpacked size."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if param.__class__.__name__ == "Params4bit":  # bitsandbytes packs two 4-bit values per byte
            n *= 2
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def record_stop_ids(model: torch.nn.Module, stop_ids: list[int]) -> None:
    """Make `stop_ids` the EOS ids of the model's generation_config, so the model saves them:
    plain transformers, `mogrpo predict` and `mogrpo serve` then end a completion where the
    run's rollouts and greedy eval ended it (`rollout.stop_token_ids` may name ids the
    checkpoint's own generation_config lacks, e.g. Llama-3 base's `<|eot_id|>`)."""
    base = model.get_base_model() if _is_peft(model) else model
    config = getattr(base, "generation_config", None)
    if config is not None:
        config.eos_token_id = list(stop_ids)


def save_model(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: str | Path,
    *,
    merged: bool = True,
    in_place: bool = False,
) -> dict[str, Path]:
    """Save for reuse with plain transformers/peft; returns {"adapter", "merged"} or {"model"} paths.

    A LoRA policy saves its adapter and, with `merged`, a full model with the adapter merged in.
    By default the merge happens on a copy so the model keeps its adapters (a second copy of the
    weights in memory); `in_place=True` merges into the model itself — no extra memory, but the
    model is a plain transformers model afterwards (for the end of a run).
    """
    out = Path(out_dir)
    paths: dict[str, Path] = {}
    if not _is_peft(model):
        paths["model"] = out / "model"
        save_pretrained(model, tokenizer, paths["model"])
        return paths

    paths["adapter"] = out / "adapter"
    model.save_pretrained(paths["adapter"])
    tokenizer.save_pretrained(paths["adapter"])
    if not merged:
        return paths
    base = model.get_base_model()
    if is_quantized(base):
        logger.warning(
            "not saving a merged model: merging into quantized weights loses precision. Load the base "
            "in bfloat16, attach %s with peft.PeftModel.from_pretrained and call merge_and_unload()",
            paths["adapter"],
        )
        return paths
    merged_model = (model if in_place else copy.deepcopy(model)).merge_and_unload()
    paths["merged"] = out / "merged"
    save_pretrained(merged_model, tokenizer, paths["merged"])
    del merged_model
    return paths


def save_pretrained(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                    out_dir: str | Path) -> None:
    """`save_pretrained` of model and tokenizer; config.json keeps the dropout rates the model
    was loaded with (training switched them off, see `mogrpo.modeling.dropout`)."""
    with original_dropout_config(model):
        model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def resolve_model_dir(path: str) -> str:
    """A model directory, also accepting a run directory (its `final/merged` or `final/model`)."""
    root = Path(path).expanduser()
    if (root / "config.json").is_file() or not root.is_dir():
        return path  # a model directory, or a hub id for load_policy to resolve
    for candidate in (root / "final" / "merged", root / "final" / "model"):
        if (candidate / "config.json").is_file():
            logger.info("using %s, the final model of run %s", candidate, root)
            return str(candidate)
    if (root / "final" / "adapter" / "adapter_config.json").is_file():
        raise ModelError(
            f"run {path} saved only its LoRA adapter ({root / 'final' / 'adapter'}; "
            "output.save_merged was false): merge it into its base with peft "
            "(PeftModel.from_pretrained(base, adapter).merge_and_unload()) and give that "
            "model directory")
    if (root / "adapter_config.json").is_file():
        raise ModelError(
            f"{path} holds a LoRA adapter, not a model; use the merged model saved beside it "
            f"({root.parent / 'merged'})")
    raise ModelError(f"{path} holds no config.json (nor final/merged or final/model of a run)")

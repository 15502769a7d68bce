"""Peak GPU memory of a GRPO run, estimated from the model's config.json alone (no weights).

Peak = what is always resident (weights, adapters, gradients, AdamW states, reference copy, CUDA
context) + the largest of three phases that never overlap: generation (KV cache, prefill),
training (one micro-batch's activations and logits) and the AdamW step's temporaries.

Activations follow the method of Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198, §4.1): count, per layer and token, every tensor
autograd keeps for the backward pass. Their GPT block gives 34·h + 5·a·s bytes (16-bit);
a Hugging Face Llama/Qwen2 block (RMSNorm, SwiGLU, GQA, fused SDPA/flash attention that keeps
no s×s scores) keeps, with p the activation dtype's bytes:

    8·h                    the two RMSNorm inputs (HF RMSNorm upcasts and keeps them in fp32)
  + p·(2·q_dim + 2·kv_dim) q, k, v and the output, kept by the fused attention kernel
  + 3·p·I                  SwiGLU: gate, SiLU(gate), up
  + p·(4·h + I)            full fine-tuning only: the inputs of trainable weights
  + (4 + m)·d_in + 4·r     per LoRA module: fp32 dropout output (peft casts to the adapter
                           dtype) and its mask (m = 1 byte on CUDA, 4 on CPU), lora_A's output
  + a·s·(4 + p)            eager attention only: softmax output (fp32) and its cast

With gradient checkpointing each layer keeps only its input (p·h) and one layer is recomputed
at a time (Korthikanti's "full recomputation", 2·s·b·h per layer in 16-bit).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mogrpo.config import RunConfig, derive_lengths
from mogrpo.errors import ConfigError, ModelError, MogrpoError

GIB = 2**30
CUDA_OVERHEAD = GIB
"""CUDA context (torch, cuBLAS, cuDNN kernels: ~0.3–0.6 GiB) plus allocator slack, rounded up."""
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""bitsandbytes NF4 with double quantisation (QLoRA, Dettmers et al. 2023): 4 bits per weight,
an 8-bit absmax per 64-weight block and an fp32 constant per 256 blocks = 4.127 bits."""
ADAPTER_BYTES = 4  # peft's autocast_adapter_dtype keeps LoRA weights in fp32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PHASES = ("always", "generation", "reward models", "training", "optimizer step", "SFT warm-up")


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-style decoder that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> ModelShape:
        """From a config.json dict or a transformers `PretrainedConfig` (text part of multimodal)."""
        if not isinstance(config, Mapping):
            config = config.get_text_config().to_dict()
        config = config.get("text_config") or config
        experts = [config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts")]
        if any(isinstance(e, int) and e > 1 for e in experts):
            raise ModelError("mixture-of-experts configs are not modelled by the memory planner "
                             "yet; it covers dense decoders (Llama, Qwen2, Mistral, Gemma)")
        need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size")
        missing = [k for k in need if not config.get(k)]
        if missing:
            raise ModelError(f"the model config lacks {', '.join(missing)}; the memory planner "
                             "needs a Llama-style decoder config.json")
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
            kv_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            intermediate=config["intermediate_size"], vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama/Mistral only with attention_bias.
            qkv_bias=config.get("model_type") == "qwen2" or bool(config.get("attention_bias")),
        )

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def linears(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each projection in one block."""
        h, q, kv, i = self.hidden, self.q_dim, self.kv_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def linear_params(self) -> int:
        """Weights of every block projection (what 4-bit quantises)."""
        return self.layers * sum(a * b for a, b in self.linears().values())

    def params(self) -> int:
        """All parameters: embeddings, blocks (projections, q/k/v biases, 2 norms), final norm, head."""
        bias = (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
        embed = self.vocab * self.hidden
        return (embed * (1 if self.tied else 2) + self.linear_params()
                + self.layers * (bias + 2 * self.hidden) + self.hidden)


@dataclass
class Term:
    """One line of the breakdown."""

    key: str
    label: str
    bytes: int
    phase: str
    note: str


@dataclass
class MemoryEstimate:
    """The terms of a run's peak memory; `total` = always + the largest phase."""

    terms: list[Term]
    activations_by_checkpointing: dict[bool, int]
    """Training activations without (False) and with (True) gradient checkpointing."""
    title: str = ""
    assumptions: list[str] = field(default_factory=list)

    def __getitem__(self, key: str) -> int:
        return next(t.bytes for t in self.terms if t.key == key)

    def phase(self, name: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase == name)

    @property
    def total(self) -> int:
        return self.phase("always") + max(self.phase(p) for p in PHASES[1:])

    def table(self) -> str:
        """The breakdown in GiB, one term per line, then the peak."""
        width = max(len(t.label) for t in self.terms)
        lines = [self.title] if self.title else []
        lines.append(f"{'term':<{width}}  {'GiB':>7}  {'phase':<14}  how")
        lines += [f"{t.label:<{width}}  {t.bytes / GIB:7.2f}  {t.phase:<14}  {t.note}"
                  for t in self.terms]
        lines.append("-" * (width + 27))
        peak = max(PHASES[1:], key=self.phase)
        lines.append(f"{'peak':<{width}}  {self.total / GIB:7.2f}  = always "
                     f"{self.phase('always') / GIB:.2f} + {peak} {self.phase(peak) / GIB:.2f}")
        lines += [f"assumes: {a}" for a in self.assumptions]
        return "\n".join(lines)


def lora_modules(target: list[str] | str) -> list[str]:
    """Block projections LoRA adapts: `all-linear` = all seven (peft leaves the head out)."""
    if target == "all-linear":
        return list(PROJECTIONS)
    if isinstance(target, str):  # peft: a regex matched against the full module name
        found = [p for p in PROJECTIONS if re.fullmatch(target, p) or re.fullmatch(
            target, f"model.layers.0.{'mlp' if p in PROJECTIONS[4:] else 'self_attn'}.{p}")]
    else:
        unknown = [t for t in target if t not in PROJECTIONS]
        if unknown:
            raise ConfigError(f"lora.target_modules {unknown} are not projections the memory "
                              f"planner knows ({', '.join(PROJECTIONS)}); use those names")
        found = [p for p in PROJECTIONS if p in target]
    if not found:
        raise ConfigError(f"lora.target_modules = {target!r} matches no projection of "
                          f"{', '.join(PROJECTIONS)}")
    return found


def layer_activation_bytes(shape: ModelShape, p: int, *, full_ft: bool, lora: list[str],
                           rank: int, dropout: float, mask_bytes: int, eager_len: int = 0) -> int:
    """Bytes autograd keeps per token in one decoder layer (formula in the module docstring)."""
    h, i = shape.hidden, shape.intermediate
    total = 2 * 4 * h + p * (2 * shape.q_dim + 2 * shape.kv_dim) + 3 * p * i
    if eager_len:
        total += shape.heads * eager_len * (4 + (p if p < 4 else 0))
    if full_ft:
        total += p * (4 * h + i)
    linears = shape.linears()
    if dropout > 0 or p < ADAPTER_BYTES:
        # each module makes its own fp32 copy of its input (cast, then dropout with a mask)
        mask = mask_bytes if dropout > 0 else 0
        total += sum((ADAPTER_BYTES + mask) * linears[m][0] for m in lora)
    elif not full_ft:  # fp32, no dropout: one saved input per distinct input, o's is kept already
        groups = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "mlp",
                  "up_proj": "mlp", "down_proj": "down"}
        total += sum(linears[{"qkv": "q_proj", "mlp": "gate_proj", "down": "down_proj"}[g]][0]
                     for g in {groups[m] for m in lora if m in groups}) * ADAPTER_BYTES
    return total + len(lora) * ADAPTER_BYTES * rank


def estimate(model_config: Mapping[str, Any] | Any, run: RunConfig, *,
             dtype_bytes: int | None = None, device: str = "cuda",
             master_weights: bool = False,
             reward_models: Mapping[str, Any] | None = None) -> MemoryEstimate:
    """Estimate the peak memory of `run` on one `device` ("cuda" or "cpu") for this model.

    `dtype_bytes` overrides the weight dtype (`model.dtype`; `auto` = bf16 on CUDA, fp32 on
    CPU). The optimizer is mogrpo's: torch AdamW, states in the trainable parameters' dtype;
    `master_weights=True` models mixed precision instead (fp32 master copy + fp32 m, v).
    `reward_models` maps each `fn: reward_model` reward (`tasks.NAME.rewards.I`) to its
    config (see :func:`reward_model_configs`); one left out is not counted, and said so.
    """
    shape = ModelShape.from_config(model_config)
    mc, lc = run.model, run.lora
    if mc.load_in_4bit and not lc.enabled:
        raise ConfigError("model.load_in_4bit trains nothing without LoRA (4-bit weights are "
                          "frozen); set lora.enabled: true")
    w = dtype_bytes or {"float32": 4, "bfloat16": 2, "float16": 2}.get(
        mc.dtype, 4 if device == "cpu" else 2)
    # prepare_model_for_kbit_training casts every non-4-bit weight to fp32, so the residual
    # stream, the activations and the KV cache of a 4-bit model are fp32.
    p = 4 if mc.load_in_4bit else w
    terms = _resident_terms(shape, run, w, device, master_weights) + _phase_terms(shape, run, p,
                                                                                  device)
    rm_terms, rm_notes = _reward_model_terms(run, reward_models or {}, device, w)
    terms += rm_terms
    terms.sort(key=lambda t: PHASES.index(t.phase))  # stable: resident first, then by phase
    prompt, completion = derive_lengths(run.rollout)
    title = (f"memory estimate: {shape.params() / 1e9:.2f} B params, {w} B weights"
             f"{' (4-bit base)' if mc.load_in_4bit else ''}, "
             f"{f'LoRA r {lc.r}' if lc.enabled else 'full fine-tuning'}, micro-batch "
             f"{run.train.micro_batch_size} × ({prompt} prompt + {completion} completion) tokens")
    assumptions = [
        "eager attention keeps s×s scores" if mc.attn_implementation == "eager" else
        "fused SDPA/flash attention (no s×s scores kept)",
        "fp32 master weights + fp32 AdamW m, v" if master_weights and not lc.enabled and w < 4
        else "torch AdamW, m and v in the trainable parameters' dtype (mogrpo's optimizer)",
        "gradients resident: from the 2nd micro-batch and through the next generation on "
        "(with accumulation 1, the 1st micro-batch peaks before they exist)", *rm_notes]
    activations = {gc: _activations(shape, with_changes(run, {"model.gradient_checkpointing": gc}), p,
                                    device, run.train.micro_batch_size, prompt + completion,
                                    completion + 1)[0] for gc in (False, True)}
    other = activations[not mc.gradient_checkpointing]
    for term in terms:
        if term.key == "activations":
            term.note += f" ({'without' if mc.gradient_checkpointing else 'with'}: {other / GIB:.2f})"
    return MemoryEstimate(terms, activations, title, assumptions)


def _add(terms: list[Term], key: str, label: str, value: float, phase: str, note: str) -> None:
    terms.append(Term(key, label, int(math.ceil(value)), phase, note))


def _resident_terms(shape: ModelShape, run: RunConfig, w: int, device: str,
                    master_weights: bool) -> list[Term]:
    """Weights, adapters, gradients, AdamW states, reference, CUDA context."""
    mc, lc = run.model, run.lora
    n_all, n_lin = shape.params(), shape.linear_params()
    modules = lora_modules(lc.target_modules) if lc.enabled else []
    linears = shape.linears()
    n_lora = shape.layers * sum(lc.r * sum(linears[m]) for m in modules)
    trainable, t_bytes = (n_lora, ADAPTER_BYTES) if lc.enabled else (n_all, w)
    terms: list[Term] = []
    if mc.load_in_4bit:
        _add(terms, "weights", "weights (4-bit NF4)", n_lin * NF4_BYTES + (n_all - n_lin) * 4,
             "always", f"{n_lin / 1e9:.2f} B block weights × {NF4_BYTES:.3f} B + "
             f"{(n_all - n_lin) / 1e9:.2f} B others × 4 B (fp32)")
    else:
        _add(terms, "weights", "weights", n_all * w, "always", f"{n_all / 1e9:.2f} B × {w} B")
    if lc.enabled:
        _add(terms, "lora", f"LoRA adapters (r {lc.r})", n_lora * ADAPTER_BYTES, "always",
             f"{n_lora / 1e6:.1f} M × 4 B (fp32), {len(modules)} modules × {shape.layers} layers")
    _add(terms, "gradients", "gradients", trainable * t_bytes, "always",
         f"{trainable / 1e6:,.1f} M trainable × {t_bytes} B")
    state = 12 if master_weights and t_bytes < 4 else 2 * t_bytes
    _add(terms, "optimizer", "AdamW states", trainable * state, "always",
         "fp32 master + m + v" if state == 12 else f"m, v × {t_bytes} B")
    kl = not run.tasks or any(t.beta > 0 for t in run.tasks.values())
    _add(terms, "reference", "reference model", n_all * w if kl and not lc.enabled else 0,
         "always", "every task β = 0: none" if not kl else
         "LoRA: the base with adapters off" if lc.enabled else "a frozen full copy")
    _add(terms, "overhead", "CUDA context + allocator", CUDA_OVERHEAD if device == "cuda" else 0,
         "always", "fixed" if device == "cuda" else "none on CPU")
    # foreach AdamW holds one sqrt(v)-sized buffer while it steps (an own phase: no activations)
    _add(terms, "adamw_step", "AdamW step temporaries", trainable * t_bytes, "optimizer step",
         "foreach AdamW's sqrt(v) buffer")
    return terms


def _activations(shape: ModelShape, run: RunConfig, p: int, device: str, batch: int, seq: int,
                 head_positions: int) -> tuple[int, int]:
    """(bytes, per token per layer) autograd keeps for `batch` sequences of `seq` tokens."""
    lc = run.lora
    per_layer = layer_activation_bytes(
        shape, p, full_ft=not lc.enabled, lora=lora_modules(lc.target_modules) if lc.enabled
        else [], rank=lc.r, dropout=lc.dropout, mask_bytes=1 if device == "cuda" else 4,
        eager_len=seq if run.model.attn_implementation == "eager" else 0)
    tokens = batch * seq
    # final norm's fp32 input; a trainable head also keeps its normed input and the head's input
    head = tokens * 4 * shape.hidden + (0 if lc.enabled else p * shape.hidden * (
        tokens + batch * head_positions))
    if run.model.gradient_checkpointing:  # layer inputs + one layer recomputed at a time
        return tokens * (shape.layers * p * shape.hidden + per_layer) + head, per_layer
    return tokens * shape.layers * per_layer + head, per_layer


def _phase_terms(shape: ModelShape, run: RunConfig, p: int, device: str) -> list[Term]:
    """Generation (KV cache, prefill) and training (activations, logits) of one step."""
    prompt, completion = derive_lengths(run.rollout)
    seq, b = prompt + completion, run.train.micro_batch_size
    n_gen = b * run.train.gradient_accumulation_steps  # prompts per step × K, generated at once
    kv_token = 2 * shape.layers * shape.kv_dim * p
    terms: list[Term] = []
    _add(terms, "kv_cache", "KV cache (generation)", kv_token * seq * n_gen, "generation",
         f"{n_gen} seqs × {seq} tokens × {kv_token / 1024:.0f} KiB ({shape.kv_heads} KV heads)")
    # no_grad prefill: one layer's residual, normed input and SwiGLU at a time; last-token logits
    _add(terms, "prefill", "prefill working set",
         n_gen * prompt * p * (2 * shape.hidden + 3 * shape.intermediate) + n_gen * shape.vocab * 12,
         "generation", f"{n_gen} prompts × {prompt} tokens, one layer at a time")
    act, per_layer = _activations(shape, run, p, device, b, seq, completion + 1)
    how = "checkpointed" if run.model.gradient_checkpointing else "no checkpointing"
    _add(terms, "activations", "activations (training)", act, "training",
         f"{b} seqs × {seq} tokens × {per_layer / 1024:.0f} KiB/layer, {how}")
    # the head's logits over the completion, then their gradient, in the activation dtype, and
    # the fp32 rows the log-softmax keeps for backward (mogrpo.algo.logprobs)
    _add(terms, "logits", "logits (training)",
         b * shape.vocab * (p * (completion + 1) + 4 * completion), "training",
         f"{b} × {completion + 1} × {shape.vocab} vocab × ({p} B + fp32)")
    sft = run.sft
    if sft.enabled:  # the warm-up: whole sequences, and HF's loss upcasts all their logits
        act, _ = _activations(shape, run, p, device, sft.batch_size, sft.max_length,
                              sft.max_length)
        _add(terms, "sft_activations", "SFT activations", act, "SFT warm-up",
             f"{sft.batch_size} seqs × {sft.max_length} tokens, {how}")
        _add(terms, "sft_logits", "SFT logits", sft.batch_size * sft.max_length * shape.vocab * (
            p + 4 + (4 if p < 4 else 0)), "SFT warm-up", "logits, fp32 copy and log-softmax")
    return terms


def reward_model_specs(run: RunConfig) -> dict[str, dict[str, Any]]:
    """The `fn: reward_model` rewards of `run` that run on the policy's device, by config path."""
    return {f"tasks.{name}.rewards.{i}": r.kwargs for name, task in run.tasks.items()
            for i, r in enumerate(task.rewards)
            if isinstance(r.fn, str) and r.fn.strip() == "reward_model" and r.kwargs.get("device", "policy") != "cpu"}


def _reward_model_terms(run: RunConfig, configs: Mapping[str, Any], device: str, w: int
                        ) -> tuple[list[Term], list[str]]:
    """Each reward model on the policy's device: its weights (resident: it stays loaded) and
    one scoring batch's working set (no_grad, one layer at a time, no KV cache)."""
    from mogrpo.rewards.reward_model import model_params

    terms: list[Term] = []
    notes: list[str] = []
    prompt, completion = derive_lengths(run.rollout)
    for where, options in reward_model_specs(run).items():
        config = configs.get(where)
        if config is None:
            notes.append(f"reward model {options.get('model')} ({where}) not counted: its "
                         "config.json was not available")
            continue
        shape = ModelShape.from_config(config)
        rm_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(options.get("dtype", "auto"),
                                                                   4 if device == "cpu" else w)
        params = model_params(config)
        _add(terms, f"reward_model:{where}", f"reward model ({where})", params * rm_bytes,
             "always", f"{params / 1e9:.2f} B × {rm_bytes} B, {options.get('model')}")
        batch, seq = options.get("batch_size", 16), prompt + completion
        _add(terms, f"reward_scoring:{where}", f"reward scoring ({where})",
             batch * seq * rm_bytes * (2 * shape.hidden + 3 * shape.intermediate),
             "reward models", f"{batch} texts × {seq} tokens, one layer at a time")
    return terms, notes


def reward_model_configs(run: RunConfig) -> dict[str, Any]:
    """The config of every reward model `reward_model_specs` lists that can be read offline."""
    from mogrpo.memory.cli import load_model_config

    found: dict[str, Any] = {}
    for where, options in reward_model_specs(run).items():
        try:
            found[where] = load_model_config(str(options.get("model")),
                                             trust_remote_code=bool(options.get("trust_remote_code")))
        except MogrpoError:
            continue
    return found


def with_changes(run: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """`run` with `section.key` values replaced (and validated again)."""
    data = run.model_dump()
    for dotted, value in changes.items():
        section, key = dotted.split(".")  # every ladder change is `section.key`
        data[section][key] = value
    return RunConfig.model_validate(data)

"""Peak GPU memory of a GRPO run, estimated from the model's config alone (no weights).

Peak = what is always resident (weights, adapters, gradients, optimizer states, reference copy,
CUDA context) + the largest of three phases that never overlap: generation (KV cache, prefill),
training (one micro-batch's activations and logits) and the optimizer step's temporaries. The
optimizer's figures, per `train.optimizer`, are `mogrpo.memory.optimizer`'s.

The model's shape comes from its own module tree, built on the meta device
(`mogrpo.modeling.architecture`): parameters counted exactly, every linear layer with its
shape, so fused QKV, gated or plain MLPs, multi-query / grouped attention, Conv1D and tied
embeddings count as they are, and LoRA is costed on the modules it would actually wrap.

Activations follow the method of Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models" (arXiv 2205.05198, §4.1): count, per layer and token, every tensor
autograd keeps for the backward pass. Their GPT block gives 34·h + 5·a·s bytes (16-bit);
a Hugging Face decoder block with fused SDPA/flash attention (no s×s scores kept) keeps, with
p the activation dtype's bytes and I the MLP width:

    4·h per RMSNorm        HF RMSNorms upcast and keep their input in fp32 (Llama: 2, Gemma2: 4)
  + p·h per LayerNorm      the input, in the activation dtype (GPT-2, OPT, GPT-NeoX, Falcon)
  + p·(2·q_dim + 2·kv_dim) q, k, v and the output, kept by the fused attention kernel
  + p·(q_dim + kv_dim)     fused QKV with rotary q, k (Phi-3, GPT-NeoX): v is a view of the
                           fused output, which stays alive whole
  + 3·p·I | p·I            gated MLP: gate, act(gate), up | plain MLP: what the activation
                           keeps — a fused GELU its input, ReLU its output (the down projection's
                           input too), GPT-2's gelu_new (elementary ops) 4·p·I
  + p·(n_rms·h + 2·h + I)  full fine-tuning only: the inputs of trainable weights (RMSNorm
                           weights, attention and MLP inputs, the MLP output projection's input
                           unless a ReLU keeps it already)
  + (4 + m)·d_in + 4·r     per LoRA module: fp32 dropout output (peft casts to the adapter
                           dtype) and its mask (m = 1 byte on CUDA, 4 on CPU), lora_A's output
  + a·s·(4 + p [+ p])      eager attention only (asked for, or the model's default, e.g.
                           Gemma2's): softmax output (fp32) and its cast [and the tanh of
                           logit soft-capping]

Checked against what autograd keeps on CPU for eleven families in
`benchmarks/results/memory_architectures.md` (−7 % … +7 %).

Several processes (`nproc`, `distributed.strategy`): each generates and trains on its share of
the step's completions. `ddp` keeps everything resident on every process, plus DDP's gradient
buckets; `fsdp` keeps 1/N of it and adds what FSDP2 gathers (`_fsdp_terms`). The figures are
per process.

Every block is costed like the first (true of the dense decoders covered). With gradient
checkpointing each layer keeps only its input (p·h) and one layer is recomputed at a time
(Korthikanti's "full recomputation", 2·s·b·h per layer in 16-bit).

Precision (`model.precision`, `mogrpo.config.precision`): trained weights, their gradients and
AdamW's m and v are in the master dtype (float32, bfloat16 under pure `bf16`); a frozen LoRA
base, the reference copy, activations, logits and the KV cache in the compute dtype (p). Under
bf16-mixed full fine-tuning autocast also holds a bfloat16 copy of every matmul weight while it
trains (saved for the backward) and while it generates (cast once per rollout).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from mogrpo.config import ModelConfig, RunConfig, derive_lengths
from mogrpo.config.hardware import quantization_errors, quantized_field
from mogrpo.config.precision import MASTER_BYTES, resolve_precision
from mogrpo.config.processes import check_processes, strategy_for
from mogrpo.config.sections import EVAL_BATCH
from mogrpo.errors import ConfigError, MogrpoError
from mogrpo.memory.head import chunked, head_bytes, layer_tokens, shared_prompts
from mogrpo.memory.optimizer import Trained, state_bytes, step_bytes
from mogrpo.memory.optimizer import describe as describe_optimizer
from mogrpo.memory.weights import weight_bytes, weight_label

if TYPE_CHECKING:  # the module tree is built with torch: imported when an estimate is made
    from mogrpo.modeling.architecture import Architecture, LinearLayer

GIB = 2**30
CUDA_OVERHEAD = GIB
"""CUDA context (torch, cuBLAS, cuDNN kernels: ~0.3–0.6 GiB) plus allocator slack, rounded up."""
ADAPTER_BYTES = 4  # LoRA adapters are trained weights: float32 but under pure bf16
PHASES = ("always", "generation", "reward models", "training", "optimizer step", "SFT warm-up")


@dataclass
class Term:
    """One line of the breakdown."""

    key: str
    label: str
    bytes: int
    phase: str
    note: str
    also: tuple[str, ...] = ()
    """Further phases the term is held in (the gradients: training, the optimizer step and
    the SFT warm-up, but not generation)."""


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
        return sum(t.bytes for t in self.terms if t.phase == name or name in t.also)

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


@dataclass(frozen=True)
class Layout:
    """How `nproc` processes share one optimizer step, as the trainer splits it: each takes
    `completions / nproc` of the step's completions (whole groups), generates them and trains
    on them in micro-batches of at most `train.micro_batch_size`."""

    strategy: str
    nproc: int
    micro_batch_size: int
    completions: int
    """Completions per optimizer step over all processes (micro-batch × accumulation)."""

    @property
    def rows(self) -> int:
        """This process's completions per step (what it generates at once)."""
        return self.completions // self.nproc

    @property
    def micro_batch(self) -> int:
        """This process's training micro-batch."""
        return min(self.micro_batch_size, self.rows)

    @property
    def shard(self) -> int:
        """What the model, gradients and optimizer state are divided by on each process."""
        return self.nproc if self.strategy == "fsdp" else 1

    def assumptions(self) -> list[str]:
        if self.strategy == "none":
            return []
        lines = [f"{self.nproc} processes share the step's {self.completions} completions: "
                 f"{self.rows} each, trained in micro-batches of {self.micro_batch}"]
        if self.strategy == "ddp":
            lines.append("ddp: every process holds the whole model, its gradients, AdamW state "
                         "and reference, plus DDP's gradient buckets (a second gradient copy)")
        else:
            lines.append("fsdp: FSDP2 fully_shard on each decoder block and on the root "
                         "(embeddings, head, final norm); parameters, gradients, AdamW state "
                         f"and the reference split {self.nproc} ways; layers gathered as they run")
        return lines


def lora_modules(shape: Architecture, target: list[str] | str) -> list[LinearLayer]:
    """The modules LoRA wraps (peft's rules; `all-linear` = every linear but the head)."""
    from mogrpo.modeling.architecture import lora_targets

    return lora_targets(shape.modules, target)


def layer_activation_bytes(shape: Architecture, p: int, *, full_ft: bool, lora: list[LinearLayer],
                           rank: int, dropout: float, mask_bytes: int, eager_len: int = 0) -> int:
    """Bytes autograd keeps per token in one decoder layer (formula in the module docstring).

    `lora`: the adapted layers of one block."""
    h, i = shape.hidden, shape.intermediate
    total = 4 * shape.rms_norms * h + p * shape.layer_norms * h
    total += p * (2 * shape.q_dim + 2 * shape.kv_dim)
    if shape.fused_qkv_view:  # v keeps the whole fused q|k|v output alive
        total += p * (shape.q_dim + shape.kv_dim)
    if eager_len:
        total += shape.heads * eager_len * (4 + (p if p < 4 else 0) + (p if shape.softcap else 0))
    # the MLP output projection's input: kept by a ReLU anyway, else only when it is trained
    down_input_kept = not shape.gated_mlp and shape.activation == "output"
    total += p * i * (3 if shape.gated_mlp else {"output": 1, "gelu_new": 4}.get(
        shape.activation, 1))
    if full_ft:
        total += p * (shape.rms_norms * h + 2 * h + (0 if down_input_kept else i))
    if dropout > 0 or p < ADAPTER_BYTES:
        # each module makes its own fp32 copy of its input (cast, then dropout with a mask)
        mask = mask_bytes if dropout > 0 else 0
        total += sum((ADAPTER_BYTES + mask) * m.in_features for m in lora)
    elif not full_ft:
        # fp32, no dropout: modules that share an input save it once; the attention output
        # projection's input is kept by the attention already
        inputs = {m.role: m.in_features for m in lora if m.role != "attn_out"
                  and not (m.role == "mlp_out" and down_input_kept)}
        total += sum(inputs.values()) * ADAPTER_BYTES
    return total + len(lora) * ADAPTER_BYTES * rank


def estimate(model_config: Architecture | Mapping[str, Any] | Any, run: RunConfig, *,
             device: str = "cuda",
             reward_models: Mapping[str, Any] | None = None,
             nproc: int = 1, gpu_memory: int | None = None) -> MemoryEstimate:
    """Estimate the peak memory of `run` on one `device` ("cuda" or "cpu") for this model,
    per process when `nproc` processes train together (`distributed.strategy`).

    `model_config`: an `Architecture`, a transformers config or a config.json dict (its module
    tree is built on the meta device once and cached). The dtypes are `model.precision`'s
    (`auto`: bf16-mixed on CUDA, assumed to have bfloat16; fp32 on CPU). The optimizer is
    `train.optimizer` (`mogrpo.memory.optimizer`): torch AdamW by default, m and v in the
    trained weights' (master) dtype.
    `reward_models` maps each `fn: reward_model` reward (`tasks.NAME.rewards.I`) to its
    config (see :func:`reward_model_configs`); one left out is not counted, and said so.
    Several processes split the step's completions (each generates and trains on its share);
    `ddp` replicates the model, gradients and AdamW state, `fsdp` shards them (see
    :func:`_fsdp_terms` for what it gathers). `gpu_memory` (bytes of one GPU) sizes a
    colocated vLLM engine's share (`_vllm_terms`).
    """
    from mogrpo.modeling.architecture import Architecture

    shape = model_config if isinstance(model_config, Architecture) else Architecture.from_config(
        model_config, trust_remote_code=run.model.trust_remote_code)
    mc, lc = run.model, run.lora
    quantized = _quantized(run)
    precision = resolve_precision(mc.precision, mc.dtype, device)
    compute = 4 if precision == "fp32" else 2
    # resident weights: trained ones in the master dtype, a frozen LoRA base in the compute one
    w = compute if lc.enabled else MASTER_BYTES[precision]
    strategy = strategy_for(run.distributed, nproc)
    if nproc > 1 and run.prompts_per_step % nproc:
        check_processes(run, nproc)  # the split the trainer would refuse, with its message
    # what FSDP2 gathers: bf16 under its mixed precision, else the weights as kept
    fsdp_bf16 = strategy == "fsdp" and run.distributed.mixed_precision == "bf16"
    c = 2 if fsdp_bf16 else w
    # a quantised base's norms are fp32 under mixed precision (mogrpo.modeling.quantize), so its
    # residual stream, activations and KV cache are fp32; under pure bf16 nothing is upcast
    p = MASTER_BYTES[precision] if quantized else 2 if fsdp_bf16 else compute
    layout = Layout(strategy, nproc, run.train.micro_batch_size,
                    run.train.micro_batch_size * run.train.gradient_accumulation_steps)
    terms = (_resident_terms(shape, run, precision, device, layout)
             + _phase_terms(shape, run, p, device, layout))
    if precision.endswith("-mixed") and not lc.enabled and not fsdp_bf16:
        _add_autocast(terms, shape, compute)
    if strategy == "fsdp":
        terms += _fsdp_terms(shape, run, c)
    rm_terms, rm_notes = _reward_model_terms(run, reward_models or {}, device,
                                             4 if device == "cpu" else 2)
    terms += rm_terms
    vllm_terms, vllm_notes = _vllm_terms(run, gpu_memory)
    terms += vllm_terms
    if not run.sft.enabled:  # what a warm-up would hold is no phase of this run
        terms = [replace(t, also=tuple(a for a in t.also if a != "SFT warm-up"))
                 for t in terms]
    terms.sort(key=lambda t: PHASES.index(t.phase))  # stable: resident first, then by phase
    prompt, completion = derive_lengths(run.rollout)
    title = _title(shape, run, precision, w, quantized, layout, (prompt, completion))
    assumptions = [*_assumptions(shape, mc, precision), *layout.assumptions(), *rm_notes,
                   *vllm_notes]
    activations = _activations_both_ways(shape, run, p, device, layout, prompt, completion, terms)
    return MemoryEstimate(terms, activations, title, assumptions)


def _add_autocast(terms: list[Term], shape: Architecture, compute: int) -> None:
    """Mixed-precision full fine-tuning: the 16-bit copies autocast makes of the matmul weights."""
    weights = shape.linear_params() + shape.vocab * shape.hidden  # and the head's
    _add(terms, "autocast", "autocast weight copies", weights * compute, "training",
         f"{weights / 1e9:.2f} B matmul weights × {compute} B, kept for the backward; "
         "also while generating and in SFT", also=("generation", "SFT warm-up"))


def _title(shape: Architecture, run: RunConfig, precision: str, w: int, quantized: str | None,
           layout: Layout, lengths: tuple[int, int]) -> str:
    """The estimate's first line: model, precision, weights, training mode and micro-batch."""
    prompt, completion = lengths
    strategy, nproc, lc = layout.strategy, layout.nproc, run.lora
    where = "" if strategy == "none" else (
        f" per process ({strategy}, {nproc} process{'es' if nproc > 1 else ''})")
    return (f"memory estimate{where}: {shape.model_type}, {shape.params / 1e9:.2f} B params, "
            f"{precision}, {w} B weights"
            f"{f' ({quantized[-4]}-bit base)' if quantized else ''}, "
            f"{f'LoRA r {lc.r}' if lc.enabled else 'full fine-tuning'}, micro-batch "
            f"{layout.micro_batch} × ({prompt} prompt + {completion} completion) tokens")


def _assumptions(shape: Architecture, mc: ModelConfig, precision: str) -> list[str]:
    """What the estimate assumes of attention, precision and gradients' lifetime."""
    eager = (mc.attn_implementation or shape.attention) == "eager"
    return [
        "eager attention keeps s×s scores" + (f" ({shape.model_type}'s default)"
                                              if not mc.attn_implementation else "")
        if eager else "fused SDPA/flash attention (no s×s scores kept)",
        f"model.precision {precision}: " + (
            "bfloat16 weights (updates below ~0.4 % of a weight are lost)"
            if precision == "bf16" else "float32 trained weights"
            + (f", matmuls and activations in {'bf' if 'bf' in precision else 'fp'}16 under "
               "autocast" if precision.endswith("-mixed") else "")),
        "gradients held from the 2nd micro-batch of a pass on (with one micro-batch, from its "
        "backward, which frees the activations as it makes them), through the optimizer step, "
        "and freed before the next generation"]


def _activations_both_ways(shape: Architecture, run: RunConfig, p: int, device: str,
                           layout: Layout, prompt: int, completion: int,
                           terms: list[Term]) -> dict[bool, int]:
    """Training activations without and with gradient checkpointing; the activations term's
    note gains the figure of the setting the run does not use."""
    checkpointing = run.model.gradient_checkpointing
    activations = {gc: _activations(shape, with_changes(run, {"model.gradient_checkpointing": gc}), p,
                                    device, layout.micro_batch, prompt + completion,
                                    completion + 1, layout.strategy, prompt)[0]
                   for gc in (False, True)}
    other = activations[not checkpointing]
    for term in terms:
        if term.key == "activations":
            term.note += f" ({'without' if checkpointing else 'with'}: {other / GIB:.2f})"
    return activations


def _quantized(run: RunConfig) -> str | None:
    """`model.load_in_4bit` / `load_in_8bit` where one is set; a ConfigError where it cannot
    train (both set, or no LoRA)."""
    problems = quantization_errors(run.model, run.lora.enabled)
    if problems:
        raise ConfigError(problems[0])
    return quantized_field(run.model)


def _add(terms: list[Term], key: str, label: str, value: float, phase: str, note: str,
         also: tuple[str, ...] = ()) -> None:
    terms.append(Term(key, label, int(math.ceil(value)), phase, note, also))


def _resident_terms(shape: Architecture, run: RunConfig, precision: str, device: str,
                    layout: Layout) -> list[Term]:
    """Weights, adapters, gradients, optimizer states, reference, CUDA context; under fsdp each
    process holds 1/N of all but the context (FSDP2 pads a parameter's first dimension to a
    multiple of N: a few KiB more, not counted), and with `distributed.cpu_offload` none of
    them on the GPU (they are in host memory, with the optimizer step)."""
    lc = run.lora
    n_all = shape.params
    modules = lora_modules(shape, lc.target_modules) if lc.enabled else []
    n_lora = sum(lc.r * (m.in_features + m.out_features) for m in modules)
    master, compute = MASTER_BYTES[precision], 4 if precision == "fp32" else 2
    a_bytes = ADAPTER_BYTES if master == 4 else master
    trainable, t_bytes = (n_lora, a_bytes) if lc.enabled else (n_all, master)
    trained = Trained.of(shape, modules if lc.enabled else None, lc.r)
    n = layout.shard
    host = layout.strategy == "fsdp" and run.distributed.cpu_offload
    on_gpu = 0 if host else 1 / n
    per = f" / {n} (shard)" if n > 1 else ""
    per += "; in host memory (distributed.cpu_offload)" if host else ""
    weights, how = weight_bytes(shape, run, precision)
    terms: list[Term] = []
    _add(terms, "weights", weight_label(run), weights * on_gpu, "always", how + per)
    if lc.enabled:
        _add(terms, "lora", f"LoRA adapters (r {lc.r})", n_lora * a_bytes * on_gpu, "always",
             f"{n_lora / 1e6:.1f} M × {a_bytes} B, {len(modules)} modules "
             f"({', '.join(sorted({m.leaf for m in modules}))}){per}")
    # held from the first backward to the optimizer step; the trainer frees them before the
    # next rollout (and after the SFT warm-up)
    # with one micro-batch a pass, none exist in its forward, and the backward frees the
    # activations as it makes them: they are counted with the optimizer step, not training
    many = layout.rows > layout.micro_batch
    _add(terms, "gradients", "gradients", trainable * t_bytes * on_gpu,
         "training" if many else "optimizer step",
         f"{trainable / 1e6:,.1f} M trainable × {t_bytes} B{per}; " + (
             "in training from the 2nd micro-batch on" if many else "one micro-batch a pass: "
             "from its backward") + ", through the optimizer step; freed before generation",
         also=("optimizer step", "SFT warm-up") if many else ("SFT warm-up",))
    if not lc.enabled and shape.tied:
        _add(terms, "embedding_grad", "tied embedding gradient", shape.vocab * shape.hidden
             * t_bytes * on_gpu, "optimizer step", "the input embedding's dense gradient at "
             "the end of the backward, before autograd adds it to the head's")
    if layout.strategy == "ddp":
        _add(terms, "ddp_buckets", "DDP gradient buckets", trainable * t_bytes, "always",
             "gradients copied into buckets for the all-reduce")
    kind = run.train.optimizer
    label, state_how = describe_optimizer(kind, t_bytes)
    _add(terms, "optimizer", label, state_bytes(kind, trained, t_bytes) * on_gpu, "always",
         state_how + per)
    kl = not run.tasks or any(t.beta > 0 for t in run.tasks.values())
    _add(terms, "reference", "reference model", n_all * compute * on_gpu
         if kl and not lc.enabled else 0, "always", "every task β = 0: none" if not kl else
         "LoRA: the base with adapters off" if lc.enabled else
         f"a frozen full copy in the compute dtype ({compute} B)" + per)
    _add(terms, "overhead", "CUDA context + allocator", CUDA_OVERHEAD if device == "cuda" else 0,
         "always", "fixed" if device == "cuda" else "none on CPU")
    # what the step allocates on top of the states (an own phase: no activations)
    _add(terms, "optimizer_step", "optimizer step temporaries",
         step_bytes(kind, trained, t_bytes, device) * on_gpu, "optimizer step", {
             "adamw": "none: fused AdamW steps in place",
             "adafactor": "fp32 grad² and its estimate, of the largest matrix"}.get(
                 kind, "none: bitsandbytes steps in place" if device != "cpu" else
                 "bitsandbytes' CPU step: fp32 m, v, gradient, sqrt(v) and quotient of the "
                 "largest tensor") + per)
    return terms


def _fsdp_terms(shape: Architecture, run: RunConfig, c: int) -> list[Term]:
    """What FSDP2 gathers on top of the shards, in the compute dtype (`c` bytes).

    Training: the root unit (embeddings, head, final norm: FSDP2 keeps the root gathered from
    its forward to the end of its backward) plus the running block and the one prefetched
    behind it — or, with `reshard_after_forward: false`, every block until its backward —
    and, in backward, the unsharded gradients of the root and one block before their
    reduce-scatter (cast to fp32 for the reduction under bf16 mixed precision). Rollout with
    the native or hf engine: the whole model gathered once for generation.
    """
    lc, dc = run.lora, run.distributed
    rest = shape.params - shape.layers * shape.block_params
    blocks = 2 if dc.reshard_after_forward else shape.layers
    terms: list[Term] = []
    gathered = (rest + blocks * shape.block_params) * c
    how = (f"root {rest / 1e6:,.0f} M + {blocks} blocks × {shape.block_params / 1e6:,.0f} M "
           f"× {c} B" + (" (running + prefetched)" if dc.reshard_after_forward
                         else " (reshard_after_forward: false)"))
    _add(terms, "fsdp_gather", "FSDP gathered layers", gathered, "training", how)
    if lc.enabled:  # the adapters of one block (the root has none unless LoRA targets it)
        unit = sum(lc.r * (m.in_features + m.out_features)
                   for m in lora_modules(shape, lc.target_modules) if m.layer == 0)
    else:
        unit = rest + shape.block_params
    mixed = dc.mixed_precision == "bf16"
    # gradients come in the compute dtype; bf16 mixed precision reduces them in fp32
    reduce = (2 + 4) if mixed else ADAPTER_BYTES if lc.enabled else c
    _add(terms, "fsdp_grads", "FSDP unsharded gradients", unit * reduce, "training",
         f"{unit / 1e6:,.1f} M × {reduce} B before reduce-scatter")
    if run.sft.enabled:
        _add(terms, "fsdp_gather_sft", "FSDP gathered layers (SFT)", gathered + unit * reduce,
             "SFT warm-up", "as in training")
    if run.rollout.engine != "vllm":
        _add(terms, "fsdp_rollout", "FSDP full model for rollout", shape.params * c,
             "generation", f"{shape.params / 1e9:.2f} B × {c} B gathered to generate")
    return terms


def _activations(shape: Architecture, run: RunConfig, p: int, device: str, batch: int, seq: int,
                 head_positions: int, strategy: str = "none", prompt: int = 0) -> tuple[int, int]:
    """(bytes, per token per layer) autograd keeps for `batch` sequences of `seq` tokens, the
    first `prompt` of them a prompt shared by K rows where the forward shares prompts
    (`mogrpo.memory.head`: each distinct prompt once, its keys and values joined to each row's)."""
    lc = run.lora
    lora = [m for m in lora_modules(shape, lc.target_modules) if m.layer == 0] if lc.enabled else []
    per_layer = layer_activation_bytes(
        shape, p, full_ft=not lc.enabled, lora=lora, rank=lc.r, dropout=lc.dropout,
        mask_bytes=1 if device == "cuda" else 4,
        eager_len=seq if (run.model.attn_implementation or shape.attention) == "eager" else 0)
    shared = shared_prompts(shape, run, strategy, device, batch, prompt, seq - prompt)
    tokens = layer_tokens(batch, prompt, seq - prompt, run.rollout.num_generations, shared)
    # each row's copy of its prompt's keys and values, kept by the attention of its completion
    joined = batch * prompt * 2 * shape.kv_dim * p * shape.layers if shared else 0
    # the final norm's input (fp32 for an RMSNorm); a trainable head also keeps its normed
    # input and the head's input
    norm = 4 if shape.rms_norms else p
    kept = tokens * norm * shape.hidden + joined + (0 if lc.enabled else p * shape.hidden * (
        tokens + batch * head_positions))
    if run.model.gradient_checkpointing:  # layer inputs + one layer recomputed at a time
        return tokens * (shape.layers * p * shape.hidden + per_layer) + kept, per_layer
    return tokens * shape.layers * per_layer + kept, per_layer


def _phase_terms(shape: Architecture, run: RunConfig, p: int, device: str,
                 layout: Layout) -> list[Term]:
    """Generation (KV cache, prefill) and training (activations, logits) of one step, for
    this process's share of it."""
    prompt, completion = derive_lengths(run.rollout)
    seq, b = prompt + completion, layout.micro_batch
    # this process's prompts × K, generated at once unless rollout.generation_batch_size caps it
    n_gen = min(layout.rows, run.rollout.generation_batch_size or layout.rows)
    n_eval = _eval_rows(run, layout.nproc)
    rows_how = " (the quick eval's batch)" if n_eval > n_gen else ""
    n_gen = max(n_gen, n_eval)
    kv_token = 2 * shape.layers * shape.kv_dim * p
    # an NF4 head (model.embeddings_in_4bit) is dequantised whole, in the compute dtype, for
    # each product: prefill's, a decode step's, the log-prob head's (kept for its backward)
    nf4_head = run.model.load_in_4bit and run.model.embeddings_in_4bit
    compute = 4 if resolve_precision(run.model.precision, run.model.dtype, device) == "fp32" \
        else 2
    dequantised = shape.vocab * shape.hidden * compute if nf4_head else 0
    dequantised_how = f"the NF4 head dequantised ({shape.vocab} × {shape.hidden} × {compute} B)"
    terms: list[Term] = []
    if run.rollout.engine != "vllm":  # vLLM's KV cache and prefill are in its share
        _add(terms, "kv_cache", "KV cache (generation)", kv_token * seq * n_gen, "generation",
             f"{n_gen} seqs{rows_how} × {seq} tokens × {kv_token / 1024:.0f} KiB "
             f"({shape.kv_heads} KV heads)")
        # no_grad prefill: one layer's residual, normed input and MLP (gate, up, act | fc1,
        # act) at a time; last-token logits
        mlp = (3 if shape.gated_mlp else 2) * shape.intermediate
        _add(terms, "prefill", "prefill working set",
             n_gen * prompt * p * (2 * shape.hidden + mlp) + n_gen * shape.vocab * 12
             + dequantised, "generation", f"{n_gen} prompts × {prompt} tokens, one layer at a "
             "time" + (f"; {dequantised_how}" if nf4_head else ""))
    act, per_layer = _activations(shape, run, p, device, b, seq, completion + 1,
                                  layout.strategy, prompt)
    how = "checkpointed" if run.model.gradient_checkpointing else "no checkpointing"
    shared = shared_prompts(shape, run, layout.strategy, device, b, prompt, completion)
    _add(terms, "activations", "activations (training)", act, "training",
         f"{b} seqs × {seq} tokens × {per_layer / 1024:.0f} KiB/layer, {how}"
         + (f"; each distinct prompt once ({math.ceil(b / run.rollout.num_generations)})"
            if shared else ""))
    precision = resolve_precision(run.model.precision, run.model.dtype, device)
    trained_head = not run.lora.enabled
    head_w = MASTER_BYTES[precision] if trained_head else 4 if precision == "fp32" else 2
    value, head_how = head_bytes(shape, b, completion, p, trained=trained_head,
                                 is_chunked=chunked(shape, layout.strategy),
                                 weight_bytes=head_w)
    if nf4_head:
        value += dequantised
        head_how += f"; {dequantised_how}"
    _add(terms, "logits", "log-prob head (training)", value, "training", head_how)
    sft = run.sft
    if sft.enabled:  # the warm-up: whole sequences, and HF's loss upcasts all their logits
        act, _ = _activations(shape, run, p, device, sft.batch_size, sft.max_length,
                              sft.max_length)
        _add(terms, "sft_activations", "SFT activations", act, "SFT warm-up",
             f"{sft.batch_size} seqs × {sft.max_length} tokens, {how}")
        # the backward's peak: the logits (kept by the loop), the fp32 log-softmax the loss
        # saved, its dense gradient from the NLL and the fp32 logits' gradient — 16 B a logit
        # in fp32, 14 under a 16-bit autocast (whose fp32 copy is freed after the forward)
        _add(terms, "sft_logits", "SFT logits", sft.batch_size * sft.max_length * shape.vocab * (
            p + 12), "SFT warm-up", "logits; fp32 log-softmax, its gradient and the fp32 "
             "logits' gradient (backward)")
    return terms


def _eval_rows(run: RunConfig, nproc: int) -> int:
    """Held-out prompts the greedy quick eval decodes at once on a process (0: no task has
    any): up to `EVAL_BATCH` of a task's `eval.max_samples`, shared by the processes, no more
    than `rollout.generation_batch_size`."""
    held_out = [run.eval.max_samples if t.eval_data is not None
                else min(t.eval_size, run.eval.max_samples) for t in run.tasks.values()]
    rows = math.ceil(max(held_out, default=0) / nproc)
    return min(rows, EVAL_BATCH, run.rollout.generation_batch_size or EVAL_BATCH)


def _vllm_terms(run: RunConfig, gpu_memory: int | None) -> tuple[list[Term], list[str]]:
    """`rollout.engine: vllm`: a colocated engine takes gpu_memory_utilization of the GPU for
    its weights and KV cache while it samples (all the time without sleep_during_update); a
    vllm-server takes nothing of this GPU."""
    if run.rollout.engine != "vllm":
        return [], []
    vc = run.rollout.vllm
    if vc.server_url is not None:
        return [], ["rollouts sampled by the vllm-server at rollout.vllm.server_url: no KV "
                    "cache or generation memory on this GPU"]
    if gpu_memory is None:
        return [], [f"vLLM's share not counted (rollout.vllm.gpu_memory_utilization "
                    f"{vc.gpu_memory_utilization} of a GPU whose size is not known): pass "
                    "--gpu-memory"]
    terms: list[Term] = []
    _add(terms, "vllm", "vLLM engine (weights + KV cache)",
         vc.gpu_memory_utilization * gpu_memory,
         "generation" if vc.sleep_during_update else "always",
         f"{vc.gpu_memory_utilization:.0%} of {gpu_memory / GIB:.0f} GiB"
         + ("; asleep outside the rollout" if vc.sleep_during_update else "; never released"))
    return terms, []


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
        from mogrpo.modeling.architecture import Architecture

        shape = Architecture.from_config(config)
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
    from mogrpo.memory.model_config import load_model_config

    found: dict[str, Any] = {}
    for where, options in reward_model_specs(run).items():
        try:
            found[where] = load_model_config(str(options.get("model")),
                                             trust_remote_code=bool(options.get("trust_remote_code")))
        except MogrpoError:
            continue
    return found


def with_changes(run: RunConfig, changes: Mapping[str, Any]) -> RunConfig:
    """`run` with `section.key` (or `section.sub.key`) values replaced (and validated again)."""
    data = run.model_dump()
    for dotted, value in changes.items():
        *path, key = dotted.split(".")
        target = data
        for part in path:
            target = target[part]
        target[key] = value
    return RunConfig.model_validate(data)

"""Per-token log-probabilities and entropies of completions under a causal LM.

Logits are divided by the *sampling* temperature before the softmax, so the trainer scores
the same distribution that produced the samples (DeepSeekMath GRPO, arXiv 2402.03300,
computes ratios against the sampling policy).

Two paths give the same numbers (docs/logprobs.md). Where the model's output is its head's
product and nothing else (`output_head`), `completion_logprobs` takes the last hidden states
and projects them a chunk of tokens at a time (`mogrpo.algo.head_logprobs`), never holding
[B, C, V] logits; elsewhere the model's own logits go through `token_logprobs_and_entropy`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

from mogrpo.algo.head_logprobs import (
    CHUNK_BYTES,
    OutputHead,
    check_temperature,
    compute_dtype,
    entropy_from,
    head_logprobs,
)
from mogrpo.algo.products import TORCH, Products


def _scaled_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[slice, Tensor]]:
    """``logits / temperature`` upcast to at least float32, a chunk of batch rows at a time.

    Working in row chunks keeps the float32 temporary at about CHUNK_BYTES instead of
    [B, T, V], which is what matters for bf16 models with 150k-token vocabularies.
    """
    check_temperature(temperature)
    dtype = compute_dtype(logits.dtype)
    B, T, V = logits.shape
    rows = max(1, CHUNK_BYTES // max(1, T * V * torch.finfo(dtype).bits // 8))
    for start in range(0, B, rows):
        chunk = logits[start:start + rows].to(dtype)
        yield slice(start, start + rows), chunk / temperature if temperature != 1.0 else chunk


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """Log-probability of each target token under ``softmax(logits / temperature)``.

    logits [B, T, V], targets [B, T] int -> [B, T] float32 (float64 for float64 logits).
    Computed as ``gather(z) - logsumexp(z)``, so no full log-softmax copy is materialised.
    """
    return token_logprobs_and_entropy(logits, targets, temperature)[0]


def token_entropy(logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Entropy of ``softmax(logits / temperature)`` at every position.

    logits [B, T, V] -> [B, T] float32 (float64 for float64 logits), using
    H = logsumexp(z) - sum_v p_v z_v.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros(logits.shape[:2], dtype=compute_dtype(logits.dtype))
    return torch.cat([entropy_from(z, torch.logsumexp(z, dim=-1))
                      for _, z in _scaled_chunks(logits, temperature)])  # [B, T]


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                               with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` and, when asked, `token_entropy` (without gradients) from one pass
    over each chunk of logits: both start from the same logsumexp."""
    if logits.shape[0] == 0:
        empty = logits.new_zeros(logits.shape[:2], dtype=compute_dtype(logits.dtype))
        return empty, empty.clone() if with_entropy else None
    logp, entropy = [], []
    for rows, z in _scaled_chunks(logits, temperature):  # z [b, T, V]
        picked, lse = _PickedLogProb.apply(z, targets[rows].long())  # [b, T] each
        logp.append(picked)
        if with_entropy:
            with torch.no_grad():
                entropy.append(entropy_from(z, lse))
    return torch.cat(logp), torch.cat(entropy) if with_entropy else None


class _PickedLogProb(torch.autograd.Function):
    """(gather(z, targets) - logsumexp(z), logsumexp(z)) for z [b, T, V], targets [b, T]; the
    first with the gradient autograd gives it, to the bit, from one [b, T, V] buffer.

    Autograd's backward of the two operations allocates three buffers the size of the logits
    (zeros for the gather's scatter, the logsumexp's exp(z - lse) term, their sum) and passes
    over them five times; here the logsumexp term is computed as autograd does and the gathered
    positions get their gradient added in place — the same two-term sums, so the same values
    (at most the sign of a zero differs). At a 150k-token vocabulary each pass saved is the
    size of the logits."""

    @staticmethod
    def forward(ctx, z: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        lse = torch.logsumexp(z, dim=-1)  # [b, T]
        picked = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [b, T]
        ctx.save_for_backward(z, lse, targets)
        ctx.mark_non_differentiable(lse)
        return picked - lse, lse

    @staticmethod
    def backward(ctx, grad: Tensor, _unused: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        z, lse, targets = ctx.saved_tensors
        # logsumexp's backward, as autograd writes it: grad * exp(z - lse), its grad being -grad
        grad_z = (-grad).unsqueeze(-1) * (z - lse.unsqueeze(-1)).exp()
        return grad_z.scatter_add_(-1, targets.unsqueeze(-1), grad.unsqueeze(-1)), None


def wrapper_chain(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then each module it wraps (PEFT ``get_base_model()``, torch.compile
    ``._orig_mod``, DDP ``.module``), down to the Hugging Face causal LM inside."""
    seen: set[int] = set()
    while id(model) not in seen:
        seen.add(id(model))
        yield model
        if hasattr(model, "get_base_model"):
            model = model.get_base_model()
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):
            model = model._orig_mod
        elif isinstance(getattr(model, "module", None), nn.Module):
            model = model.module


def _accepts_logits_to_keep(model: nn.Module) -> bool:
    """Whether the underlying HF causal LM's forward takes ``logits_to_keep``: wrappers forward
    keyword arguments untouched, so the first module in the chain that declares it decides."""
    return any("logits_to_keep" in inspect.signature(m.forward).parameters
               for m in wrapper_chain(model))


# Model types whose Hugging Face forward continues from a cache of prompt keys and values with
# gradients flowing through it, giving the one-pass forward's log-probs and gradients (checked
# family by family: tests/unit/test_shared_prompts.py). Others always take the one-pass forward.
SHARED_PROMPT_TYPES = frozenset({"falcon", "gemma", "gemma2", "gpt2", "gpt_neox", "llama", "mistral",
                                 "phi3", "qwen2", "qwen3"})  # not OPT: its positions ignore the cache


def token_positions(attention_mask: Tensor) -> Tensor:
    """``cumsum(attention_mask) - 1``: the positions generate() gave the tokens of left-padded
    rows, so padding does not shift rotary or learned positions."""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def shares_prompts(model: nn.Module) -> bool:
    """Whether `model`'s forward can run each distinct prompt once (`_completion_logits`): a
    Hugging Face causal LM of a `SHARED_PROMPT_TYPES` family, not recomputing activations in
    the backward (gradient checkpointing), not wrapped by DDP or FSDP2 (whose hooks expect one
    forward per backward)."""
    chain = list(wrapper_chain(model))
    lm = chain[-1]
    config = getattr(lm, "config", None)
    if getattr(config, "model_type", None) not in SHARED_PROMPT_TYPES \
            or not _accepts_logits_to_keep(model):
        return False
    if any(getattr(child, "gradient_checkpointing", False) is True for child in lm.children()):
        return False
    ddp = any(isinstance(m, nn.parallel.DistributedDataParallel) for m in chain)
    return not ddp and not sharded(model)


def sharing_pays(saved: int, tokens: int, min_saved: float) -> bool:
    """Whether running each distinct prompt once, which skips `saved` of a pass's `tokens`,
    saves at least `min_saved` of them."""
    return saved > 0 and saved >= min_saved * tokens


def sharded(model: nn.Module) -> bool:
    """Whether FSDP2 shards `model` (its forward must run through FSDP's hooks, which gather
    each unit's parameters)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a build without torch.distributed
        return False
    return any(isinstance(m, FSDPModule) for m in wrapper_chain(model))


def distinct_prompts(prompt_ids: Tensor, prompt_mask: Tensor) -> tuple[Tensor, Tensor] | None:
    """(distinct rows [U, 2P] of ids then mask, the distinct row of each row [B]), or None when
    every row is different (nothing to share)."""
    rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)  # [B, 2P]
    distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
    return None if len(distinct) == len(rows) else (distinct, inverse)


# transformers 5.24 renamed a forward's `past_key_values` argument and output field `cache`
# (the old name warns, and goes in 5.40).
_CACHE_SINCE_5_24 = "cache" if Version(transformers.__version__).release >= (5, 24) \
    else "past_key_values"


def _cache_argument(model: nn.Module) -> str:
    """The name the HF causal LM's forward takes a KV cache by: the first module in the wrapper
    chain that declares `cache` or `past_key_values` decides (remote code written for older
    transformers declares the old name, and would ignore a `cache=` in its **kwargs); where
    none declares either, the installed transformers' name."""
    for m in wrapper_chain(model):
        parameters = inspect.signature(m.forward).parameters
        for name in ("cache", "past_key_values"):
            if name in parameters:
                return name
    return _CACHE_SINCE_5_24


# Model types whose causal LM's output is its head's product of the last hidden states and
# nothing else (checked family by family: tests/unit/test_head_logprobs.py), and those whose
# forward then applies a tanh cap, ``final_logit_softcapping``, which `head_logprobs`
# reproduces. Any other model, or one of these whose config asks for an output scale, keeps the
# full logits.
PLAIN_HEAD_TYPES = frozenset({"falcon", "gemma", "gpt2", "gpt_neox", "llama", "mistral", "opt",
                              "phi3", "qwen2", "qwen3"})
SOFTCAP_HEAD_TYPES = frozenset({"gemma2"})
_OUTPUT_SCALES = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def output_head(model: nn.Module, products: Products = TORCH) -> OutputHead | None:
    """The head `completion_logprobs` projects the last hidden states with, chunk by chunk; None
    where the model's logits must come from its own forward: a family not known to output
    ``lm_head(hidden)`` (with Gemma 2's tanh cap at most), a config with an output scale, a
    head that is not a plain `nn.Linear` (LoRA or modules_to_save on it, 8-bit; an NF4 head,
    `model.embeddings_in_4bit`, is projected dequantised) or that something else wraps
    (accelerate's hooks), torch.compile'd or FSDP2-sharded models (the compiled graph, the
    shards)."""
    chain = list(wrapper_chain(model))
    lm = chain[-1]
    config = getattr(lm, "config", None)
    model_type = getattr(config, "model_type", None)
    softcap = None
    if model_type in SOFTCAP_HEAD_TYPES:
        softcap = getattr(config, "final_logit_softcapping", None)
    elif model_type not in PLAIN_HEAD_TYPES or \
            any(getattr(config, name, None) is not None for name in _OUTPUT_SCALES):
        return None
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) not in (nn.Linear, *products.linear_types) and not _nf4_linear(head) \
            or "forward" in vars(head) or head._forward_hooks or head._forward_pre_hooks:
        return None
    if sharded(model) or any(hasattr(m, "_orig_mod") for m in chain):
        return None
    return OutputHead(head, None if softcap is None else float(softcap), products)


def _nf4_linear(module: nn.Module | None) -> bool:
    """Whether `module` is bitsandbytes' `Linear4bit` (without importing bitsandbytes)."""
    kind = type(module)
    return kind.__name__ == "Linear4bit" and kind.__module__.startswith("bitsandbytes.")


@contextmanager
def _head_inputs(head: OutputHead | None) -> Iterator[list[Tensor]]:
    """While open, `head`'s forward records its input — the last hidden states the model would
    project, after its final norm and ``logits_to_keep`` slice — and returns an empty
    [..., 0] tensor in place of the logits (the model's code after the head, such as Gemma 2's
    cap, then costs nothing). Through every wrapper's forward (peft, DDP), so their hooks run.
    Nothing is patched when `head` is None."""
    seen: list[Tensor] = []
    if head is None:
        yield seen
        return

    def record(x: Tensor) -> Tensor:
        seen.append(x)
        return x[..., :0]

    module = head.module
    module.forward = record
    try:
        yield seen
    finally:
        del module.forward


def _completion_outputs(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                        completion_ids: Tensor, completion_mask: Tensor,
                        groups: tuple[Tensor, Tensor] | None,
                        head: OutputHead | None = None, products: Products = TORCH) -> Tensor:
    """At the positions that predict each completion token: the last hidden states [B, C, H]
    that `head` projects, where it is given (`output_head`); else the logits [B, C, V].

    The K completions of a group share their prompt, so given the `distinct_prompts` groups
    each distinct prompt runs once: its keys and values, computed with
    gradients, are copied to the rows that hold it, and the completions run on top of them.
    The same attention over the same keys (to float rounding), with a K-th of the prompts'
    arithmetic in the forward and the backward; the gradient through the copies adds up the K
    completions' shares, as the one-pass forward does. LoRA dropout on prompt positions then
    draws one mask per prompt rather than one per completion.
    """
    B, P = prompt_ids.shape
    C = completion_ids.shape[1]
    attention_mask = torch.cat([prompt_mask.long(), completion_mask.long()], dim=1)  # [B, P+C]
    # the model's linears on the chosen products, both passes
    with products.model_linears(model), _head_inputs(head) as seen:
        def out(result) -> Tensor:  # what the head saw, or the logits it gave
            return seen.pop() if head is not None else result.logits

        if groups is None:
            kwargs = {}
            if _accepts_logits_to_keep(model):
                # Only positions P-1 .. P+C-1 reach the head.
                kwargs["logits_to_keep"] = C + 1
            states = out(model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=attention_mask,
                position_ids=token_positions(attention_mask),
                use_cache=False,
                **kwargs,
            ))
            # The state at position t predicts token t+1: keep P-1 .. P+C-2.
            return states[:, -(C + 1) : -1, :]
        distinct, inverse = groups
        mask = distinct[:, P:]
        prompts = model(input_ids=distinct[:, :P], attention_mask=mask,
                        position_ids=token_positions(mask), use_cache=True, logits_to_keep=1)
        first = out(prompts)[inverse]  # [B, 1, ·]: predicts completion token 0
        if C == 1:
            return first
        name = _cache_argument(model)
        cache = getattr(prompts, name)
        cache.reorder_cache(inverse)  # row b gets its prompt's keys and values
        attention_mask = attention_mask[:, : P + C - 1]
        rest = out(model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask,
                         position_ids=token_positions(attention_mask)[:, P:], **{name: cache},
                         use_cache=True))  # [B, C-1, ·]: predict tokens 1 .. C-1
    return torch.cat([first, rest], dim=1)


def completion_logprobs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    completion_ids: Tensor,
    completion_mask: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    forward: Callable[..., Tensor | None] | None = None,
    share_prompts: bool | None = None,
    min_saved: float | None = 0.0,
    products: Products = TORCH,
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the completion tokens given their prompts.

    prompt_ids/prompt_mask [B, P] are left-padded; completion_ids/completion_mask [B, C]
    right-padded. Position ids are ``cumsum(attention_mask) - 1`` -- the positions HF
    ``generate`` gave the tokens -- so padding does not shift rotary/learned positions. Rows
    sharing a prompt run it once (`_completion_outputs`) where `share_prompts` says so — by
    default where the model allows it (`shares_prompts`); a pass whose log-probs are compared
    with another model's (the reference with the policy) takes the other's choice, so both run
    the same arithmetic. ``min_saved``: the least share of the pass's tokens (prompt and
    completion widths, padding included) that sharing must save, else one pass runs (0: share
    whenever two rows hold one prompt; None: never; the trainer passes `train.prompt_sharing`'s,
    `mogrpo.kernels.prompt_sharing_min_saved` for `auto`). Decided from the pass's own inputs,
    so passes over the same rows decide alike.

    Where `output_head` finds a plain head, the last hidden states of the completion tokens
    (padding left out) are projected a chunk of tokens at a time (`head_logprobs`: no [B, C, V]
    logits, in the forward or the backward); elsewhere the model's own logits are used. Both
    give the same values to float rounding; every pass of one model takes the same path, so
    the policy's, rollout-time and reference log-probs agree to the bit while weights are equal.

    Returns ``(logp, entropy)``, both [B, C] float32; ``entropy`` is None unless
    ``with_entropy``. Positions where ``completion_mask == 0`` are set to 0. ``logp`` carries
    gradients; ``entropy`` is computed without them (it is a monitoring signal, as in TRL,
    and keeping its [C, V] softmax for backward would double activation memory; call
    :func:`token_entropy` directly for an entropy bonus).

    ``forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, groups)`` may
    compute the last hidden states [B, C, H] (after the final norm) of rows that share prompts
    instead (mogrpo's own forward, `mogrpo.rollout.scoring.score_hidden`), for models with a
    plain head; where it returns None the model's forward runs. ``products``: the matrix
    products of the head and of the model's linears (`mogrpo.kernels.products()` picks them
    for the machine; PyTorch's own by default).
    """
    args = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    share = min_saved is not None and (shares_prompts(model) if share_prompts is None
                                       else share_prompts)
    (rows, width), tokens = prompt_ids.shape, prompt_ids.numel() + completion_ids.numel()
    # not even one prompt for all rows would save enough: no need to find the distinct ones
    # (which waits for the device on a GPU)
    share = share and sharing_pays((rows - 1) * width, tokens, min_saved)
    groups = distinct_prompts(prompt_ids, prompt_mask) if share else None
    if groups is not None and not sharing_pays((rows - len(groups[0])) * width, tokens,
                                               min_saved):
        groups = None
    head = output_head(model, products)
    keep = completion_mask.bool()  # [B, C]
    if head is None:
        logits = _completion_outputs(model, *args, groups, products=products)  # [B, C, V]
        logp, entropy = token_logprobs_and_entropy(logits, completion_ids, temperature,
                                                   with_entropy)
        return logp.masked_fill(~keep, 0.0), \
            entropy.masked_fill(~keep, 0.0) if entropy is not None else None
    hidden = forward(model, *args, groups) if forward and groups is not None else None
    if hidden is None:
        hidden = _completion_outputs(model, *args, groups, head, products)  # [B, C, H]
    # only the completion's real tokens are projected; padding stays 0
    logp, entropy = head_logprobs(hidden[keep], head, completion_ids[keep], temperature,
                                  with_entropy)  # [n] each
    return _scatter(logp, keep), _scatter(entropy, keep) if entropy is not None else None


def _scatter(values: Tensor, keep: Tensor) -> Tensor:
    """values [n] at the True positions of keep [B, C], 0 elsewhere: [B, C]."""
    return values.new_zeros(keep.shape).masked_scatter(keep, values)

"""Per-token log-probabilities and entropies of completions under a causal LM.

Logits are divided by the *sampling* temperature before the softmax, so the trainer scores
the same distribution that produced the samples (DeepSeekMath GRPO, arXiv 2402.03300,
computes ratios against the sampling policy).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator

import torch
import transformers
from packaging.version import Version
from torch import Tensor, nn

from mogrpo.algo.cpu_linear import cpu_linears
from mogrpo.errors import ConfigError


def _compute_dtype(logits: Tensor) -> torch.dtype:
    """float32, or float64 when the logits already are (never downcast)."""
    return torch.promote_types(logits.dtype, torch.float32)


# Rows of logits upcast together: small enough that the float32 copy stays modest for a
# 150k-token vocabulary, large enough that small models do a few big operations, not B small ones.
CHUNK_BYTES = 64 * 2**20


def _scaled_chunks(logits: Tensor, temperature: float) -> Iterator[tuple[slice, Tensor]]:
    """``logits / temperature`` upcast to at least float32, a chunk of batch rows at a time.

    Working in row chunks keeps the float32 temporary at about CHUNK_BYTES instead of
    [B, T, V], which is what matters for bf16 models with 150k-token vocabularies.
    """
    if not temperature > 0:
        raise ConfigError(f"sampling temperature must be > 0, got {temperature!r}")
    dtype = _compute_dtype(logits)
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
        return logits.new_zeros(logits.shape[:2], dtype=_compute_dtype(logits))
    return torch.cat([_entropy(z, torch.logsumexp(z, dim=-1))
                      for _, z in _scaled_chunks(logits, temperature)])  # [B, T]


def token_logprobs_and_entropy(logits: Tensor, targets: Tensor, temperature: float = 1.0,
                               with_entropy: bool = False) -> tuple[Tensor, Tensor | None]:
    """`token_logprobs` and, when asked, `token_entropy` (without gradients) from one pass
    over each chunk of logits: both start from the same logsumexp."""
    if logits.shape[0] == 0:
        empty = logits.new_zeros(logits.shape[:2], dtype=_compute_dtype(logits))
        return empty, empty.clone() if with_entropy else None
    logp, entropy = [], []
    for rows, z in _scaled_chunks(logits, temperature):  # z [b, T, V]
        picked, lse = _PickedLogProb.apply(z, targets[rows].long())  # [b, T] each
        logp.append(picked)
        if with_entropy:
            with torch.no_grad():
                entropy.append(_entropy(z, lse))
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


def _entropy(z: Tensor, lse: Tensor) -> Tensor:
    """logsumexp(z) - sum_v p_v z_v for z [b, T, V] and its logsumexp [b, T]. p is 0 where
    z = -inf (masked vocabulary entries), and 0 * -inf is NaN: nansum leaves those terms out (a
    NaN logit still makes the entropy NaN, through the logsumexp)."""
    p = torch.softmax(z, dim=-1)
    return lse - torch.nansum(p * z, dim=-1)


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


def _completion_logits(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor,
                       completion_ids: Tensor, completion_mask: Tensor,
                       groups: tuple[Tensor, Tensor] | None) -> Tensor:
    """Logits [B, C, V] at the positions that predict each completion token.

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
    with cpu_linears(model):  # CPU float32: the linears on the faster kernel, both passes
        if groups is None:
            kwargs = {}
            if _accepts_logits_to_keep(model):
                # Only positions P-1 .. P+C-1 are projected onto the vocabulary.
                kwargs["logits_to_keep"] = C + 1
            logits = model(
                input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                attention_mask=attention_mask,
                position_ids=token_positions(attention_mask),
                use_cache=False,
                **kwargs,
            ).logits
            # The logit at position t predicts token t+1: keep P-1 .. P+C-2.
            return logits[:, -(C + 1) : -1, :]
        distinct, inverse = groups
        mask = distinct[:, P:]
        prompts = model(input_ids=distinct[:, :P], attention_mask=mask,
                        position_ids=token_positions(mask), use_cache=True, logits_to_keep=1)
        first = prompts.logits[inverse]  # [B, 1, V]: predicts completion token 0
        if C == 1:
            return first
        name = _cache_argument(model)
        cache = getattr(prompts, name)
        cache.reorder_cache(inverse)  # row b gets its prompt's keys and values
        attention_mask = attention_mask[:, : P + C - 1]
        rest = model(input_ids=completion_ids[:, :-1], attention_mask=attention_mask,
                     position_ids=token_positions(attention_mask)[:, P:], **{name: cache},
                     use_cache=True).logits  # [B, C-1, V]: predict tokens 1 .. C-1
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
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (and optionally entropies) of the completion tokens given their prompts.

    prompt_ids/prompt_mask [B, P] are left-padded; completion_ids/completion_mask [B, C]
    right-padded. Position ids are ``cumsum(attention_mask) - 1`` -- the positions HF
    ``generate`` gave the tokens -- so padding does not shift rotary/learned positions. Rows
    sharing a prompt run it once (`_completion_logits`) where `share_prompts` says so — by
    default where the model allows it (`shares_prompts`); a pass whose log-probs are compared
    with another model's (the reference with the policy) takes the other's choice, so both run
    the same arithmetic.

    Returns ``(logp, entropy)``, both [B, C] float32; ``entropy`` is None unless
    ``with_entropy``. Positions where ``completion_mask == 0`` are set to 0. ``logp`` carries
    gradients; ``entropy`` is computed without them (it is a monitoring signal, as in TRL,
    and keeping its [C, V] softmax for backward would double activation memory; call
    :func:`token_entropy` directly for an entropy bonus).

    ``forward(model, prompt_ids, prompt_mask, completion_ids, completion_mask, groups)`` may
    compute the [B, C, V] logits of rows that share prompts instead (mogrpo's own forward for
    passes without gradients, `mogrpo.rollout.scoring.score_logits`); where it returns None the
    model's forward runs.
    """
    args = (prompt_ids, prompt_mask, completion_ids, completion_mask)
    share = shares_prompts(model) if share_prompts is None else share_prompts
    groups = distinct_prompts(prompt_ids, prompt_mask) if share else None
    logits = forward(model, *args, groups) if forward and groups is not None else None
    if logits is None:
        logits = _completion_logits(model, *args, groups)  # [B, C, V]
    keep = completion_mask.bool()  # [B, C]
    logp, entropy = token_logprobs_and_entropy(logits, completion_ids, temperature, with_entropy)
    return logp.masked_fill(~keep, 0.0), \
        entropy.masked_fill(~keep, 0.0) if entropy is not None else None

"""What the training forward and backward hold for the output head, and which tokens the
decoder's layers see: the planner's model of `mogrpo.algo.head_logprobs` and of prompt sharing.

The chunked head (`docs/logprobs.md`) never holds the [N, V] logits: its forward computes a
chunk of `CHUNK_BYTES` of float32 logits at a time and, with the entropy (the first update
pass), the softmax and its product with the logits beside them — three chunks; its backward
computes each chunk again and, when the head is trained (full fine-tuning), builds the head's
[V, H] weight gradient in float32 before autograd adds it to `.grad`. Where every token fits in
one chunk, the forward keeps that chunk's softmax for the backward instead of recomputing it. It saves the hidden
states (counted with the activations), the targets and one logsumexp per token.

The model's own [B, C, V] logits (`token_logprobs_and_entropy`) remain where `output_head`
takes them: FSDP2-sharded models and families outside the chunked list; there the logits
(activation dtype) for C + 1 positions and the float32 rows the log-softmax keeps are counted.

Prompt sharing (`mogrpo.algo.logprobs.shares_prompts`): the update's forward runs each
distinct prompt once and the K completions on its keys and values — not under gradient
checkpointing, DDP or FSDP2, nor for OPT, and with `train.prompt_sharing: auto` only where it
pays on the device for the longest prompt and completion (`kernels.prompt_sharing_min_saved`).
A micro-batch is assumed to hold whole groups, so it has ⌈rows / K⌉ distinct prompts.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mogrpo.kernels import prompt_sharing_min_saved

if TYPE_CHECKING:
    from mogrpo.config import RunConfig
    from mogrpo.modeling.architecture import Architecture

CHUNK_BYTES = 64 * 2**20
"""`mogrpo.algo.head_logprobs.CHUNK_BYTES` (tested equal): float32 logits per chunk."""
CHUNKED_TYPES = frozenset({"llama", "qwen2", "qwen3", "mistral", "phi3", "gpt2", "opt",
                           "gpt_neox", "falcon", "gemma", "gemma2"})
"""Families whose head `output_head` projects a chunk at a time (its PLAIN_HEAD_TYPES and
SOFTCAP_HEAD_TYPES; tested equal)."""
SHARED_TYPES = frozenset({"falcon", "gemma", "gemma2", "gpt2", "gpt_neox", "llama", "mistral",
                          "phi3", "qwen2", "qwen3"})
"""`mogrpo.algo.logprobs.SHARED_PROMPT_TYPES` (tested equal)."""


def chunked(shape: Architecture, strategy: str) -> bool:
    """Whether the update's log-probs come from the chunked head (not from [B, C, V] logits)."""
    return shape.model_type in CHUNKED_TYPES and strategy != "fsdp"


def shared_prompts(shape: Architecture, run: RunConfig, strategy: str, device: str,
                   rows: int, prompt: int, completion: int) -> bool:
    """Whether the update's forward runs each distinct prompt of a micro-batch of `rows`
    completions (`prompt` + `completion` tokens) once on `device` (`train.prompt_sharing`)."""
    sharing = run.train.prompt_sharing
    if (sharing == "off" or shape.model_type not in SHARED_TYPES
            or run.model.gradient_checkpointing or strategy != "none" or not prompt):
        return False
    saved = (rows - math.ceil(rows / run.rollout.num_generations)) * prompt
    least = 0.0 if sharing == "on" else prompt_sharing_min_saved(device)
    # as mogrpo.algo.logprobs.sharing_pays decides
    return saved > 0 and saved >= least * rows * (prompt + completion)


def layer_tokens(rows: int, prompt: int, completion: int, k: int, shared: bool) -> int:
    """Tokens through the decoder's layers for `rows` completions of `prompt` + `completion`."""
    return (math.ceil(rows / k) * prompt + rows * completion) if shared \
        else rows * (prompt + completion)


def head_bytes(shape: Architecture, rows: int, completion: int, p: int, *, is_chunked: bool,
               trained: bool, weight_bytes: int) -> tuple[int, str]:
    """(bytes, how) of the head's working set in one micro-batch's forward and backward.

    `p`: the activation dtype's bytes; `trained`: the head's weight is trained (its gradient
    is built in float32 in the backward); `weight_bytes`: the head weight's dtype (a 16-bit
    head takes a 16-bit copy of each chunk's gradient)."""
    V = shape.vocab
    n_tok = rows * completion
    if not is_chunked:
        return (rows * V * (p * (completion + 1) + 4 * completion),
                f"{rows} × {completion + 1} × {V} vocab × ({p} B + fp32): the model's logits")
    n = min(n_tok, max(1, CHUNK_BYTES // (V * 4)))
    chunk = n * V * 4
    grad_w = V * shape.hidden * 4 if trained else 0
    # forward: logits, softmax and their product (entropy); backward: the logits again (their
    # gradient in place) and a 16-bit copy for a 16-bit head, next to the weight gradient
    backward = chunk + (n * V * weight_bytes if weight_bytes < 4 else 0) + grad_w
    # every token in one chunk: its softmax is kept from the forward to the backward (which
    # then does not compute the logits again)
    kept = chunk if n_tok <= n else 0
    how = (f"chunks of {n} tokens × {V} vocab in fp32 (forward: 3 chunks; backward: 1"
           + (" + the softmax kept from the forward" if kept else "")
           + (f" + the head's fp32 weight gradient {grad_w / 2**30:.2f} GiB" if trained else "")
           + f"), {n_tok} tokens' logsumexp, target, log-prob")
    return max(3 * chunk, kept + backward) + 16 * n_tok, how

"""A tiny float64 language model and one fixed GRPO batch, shared by the gradient tests
(accumulation in tests/unit, data parallelism in tests/integration)."""

from __future__ import annotations

import torch
from torch import nn

from mogrpo.algo.logprobs import token_logprobs

V, D, B, T = 11, 6, 5, 7
LENGTHS = [7, 2, 5, 1, 4]  # different lengths, so per-sequence and per-token means differ


class TinyLM(nn.Module):
    """Logits for position t from the token at t (no mixing across rows), in float64."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D, dtype=torch.float64)
        self.head = nn.Linear(D, V, dtype=torch.float64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.emb(ids)))  # [B, T, V]


def make_batch() -> tuple[TinyLM, dict[str, torch.Tensor]]:
    """The same seeded model and batch on every call (and in every process)."""
    g = torch.Generator().manual_seed(0)
    model = TinyLM()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64))
    inputs = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T) < torch.tensor(LENGTHS)[:, None]).long()  # [B, T]
    with torch.no_grad():
        logp = token_logprobs(model(inputs), targets)
    # Rollout-time and reference log-probs away from the current ones, so ratios leave the
    # clip band on both sides and the KL term is non-trivial.
    old_logp = logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref_logp = logp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    advantages = torch.tensor([1.0, -0.7, 0.4, -1.3, 0.9], dtype=torch.float64)
    beta = torch.tensor([0.05, 0.2, 0.0, 0.1, 0.3], dtype=torch.float64)  # per task
    return model, dict(inputs=inputs, targets=targets, mask=mask, old_logp=old_logp,
                       ref_logp=ref_logp, advantages=advantages, beta=beta)


def shared_prompt_batch(vocab: int, K: int = 3) -> tuple[torch.Tensor, ...]:
    """3 prompts (lengths 5, 3, 7, left-padded to 7) x K completions of lengths 1..6 (C = 6),
    token ids in [3, vocab): (prompt_ids, prompt_mask, completion_ids, completion_mask)."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 3, 7)]
    P, C, B = 7, 6, 3 * K
    prompt_ids = torch.tensor([[0] * (P - len(p)) + p for p in prompts]).repeat_interleave(K, 0)
    prompt_mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    completion_ids = torch.randint(3, vocab, (B, C), generator=g) * completion_mask
    return prompt_ids, prompt_mask.repeat_interleave(K, 0), completion_ids, completion_mask

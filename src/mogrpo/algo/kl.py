"""Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

Schulman, "Approximating KL divergence" (2020), http://joschu.net/blog/kl-approx.html.
With log r = ref_logp - logp evaluated on samples x ~ pi:

- k1 = -log r              unbiased, high variance, can be negative per token;
- k2 = (log r)^2 / 2       biased, low variance, always >= 0;
- k3 = (r - 1) - log r     unbiased, low variance, always >= 0 (GRPO's choice,
                           DeepSeekMath arXiv 2402.03300).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mogrpo.algo.choices import KL_ESTIMATORS
from mogrpo.errors import ConfigError

# Upper clamp on log r inside exp() for k3. log r > 20 needs logp < -20 (ref_logp <= 0),
# i.e. pi sampled a token it gives probability < 2e-9. The clamp changes the estimate only on
# such events, so its bias is negligible in practice, while without it float32 exp overflows
# to inf at log r ~ 89 and one token's inf turns the whole loss into inf/NaN.
K3_LOG_RATIO_MAX = 20.0

# Below this |log r|, k3 uses its Taylor series: expm1(x) - x loses all significant digits
# in float32 for |x| ~ 1e-6 because both terms are ~x while their difference is ~x^2/2.
_K3_SERIES_BELOW = 1e-2


def _k3(log_r: Tensor) -> Tensor:
    """(e^x - 1) - x, accurate for tiny |x| and finite for large x."""
    small = log_r.abs() < _K3_SERIES_BELOW
    x = torch.where(small, log_r, 0.0)
    # x^2/2 + x^3/6 + x^4/24; the next term is < 1e-9 relative at |x| = 1e-2.
    series = x * x * (0.5 + x * (1.0 / 6.0 + x / 24.0))
    direct = torch.expm1(log_r.clamp(max=K3_LOG_RATIO_MAX)) - log_r
    # Both branches are >= 0 except where the clamp bites and log r > e^20 - 1 (~4.9e8):
    # keep the documented guarantee k3 >= 0 there too.
    return torch.where(small, series, direct).clamp(min=0.0)


def kl_estimate(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref); logp/ref_logp [B, T] -> [B, T].

    Computed in at least float32. ``estimator`` is one of ``KL_ESTIMATORS`` (Schulman 2020):
    k1 = -log r, k2 = (log r)^2 / 2, k3 = (r - 1) - log r with log r = ref_logp - logp.
    Identical inputs give exactly 0 for every estimator.
    """
    if estimator not in KL_ESTIMATORS:
        raise ConfigError(
            f"kl_estimator={estimator!r} is not supported; choose one of {list(KL_ESTIMATORS)}"
        )
    dtype = torch.promote_types(torch.promote_types(logp.dtype, ref_logp.dtype), torch.float32)
    logp, ref_logp = logp.to(dtype), ref_logp.to(dtype)
    if estimator == "k1":
        return logp - ref_logp  # = -log r, written so equal inputs give +0.0
    log_r = ref_logp - logp  # [B, T]
    if estimator == "k2":
        return 0.5 * log_r * log_r
    return _k3(log_r)


def sequence_kl(logp: Tensor, ref_logp: Tensor, mask: Tensor, estimator: str = "k3") -> Tensor:
    """Per-sequence mean of the per-token KL estimate over `mask`; [B, T] -> [B] (0 for an
    empty row). What mogrpo logs and adapts β on."""
    maskf = mask.to(torch.promote_types(logp.dtype, torch.float32))
    kl = kl_estimate(logp, ref_logp, estimator)
    return (torch.where(mask.bool(), kl, 0.0) * maskf).sum(-1) / maskf.sum(-1).clamp(min=1.0)

"""What the rollout engines accept, for the config's checks: constants and a machine check that
import no engine (vLLM itself is imported only by `mogrpo.rollout.vllm_engine`)."""

from __future__ import annotations

import importlib.util

VLLM_INSTALL_HINT = "pip install 'mogrpo[vllm]'"
PENALTY_RANGE = (-2.0, 2.0)  # vLLM's bounds on presence / frequency penalties


def vllm_unavailable_reason() -> str | None:
    """Why `rollout.engine: vllm` cannot run here (None when it can). Imports no vLLM."""
    if importlib.util.find_spec("vllm") is None:
        return (f"rollout.engine = vllm, but vLLM is not installed: `{VLLM_INSTALL_HINT}` (vLLM "
                "needs a CUDA GPU); or use rollout.engine: auto")
    import torch

    if not torch.cuda.is_available():
        return ("rollout.engine = vllm needs a CUDA GPU and none is visible "
                "(torch.cuda.is_available() is False); use rollout.engine: auto on this machine")
    return None

"""The rollout section (`rollout`): how completions are sampled, by which engine, and the
vLLM engine's own settings (`rollout.vllm`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt

from mogrpo.config.base import Section

RolloutEngine = Literal["auto", "native", "hf", "vllm"]


class VLLMConfig(Section):
    gpu_memory_utilization: float = Field(0.3, gt=0, lt=1)
    """Share of the GPU's memory vLLM may take for its weights and KV cache; the rest is the
    trainer's (policy, reference, optimizer, activations)."""
    sleep_during_update: bool = True
    """Free vLLM's weights and KV cache while the trainer updates (sleep level 2); its weights
    are pushed back after the optimizer step. Off: both stay allocated, no wake-up cost."""
    importance_correction: bool = True
    """Weight each token's loss by min(π_trainer / π_vLLM, importance_cap): truncated importance
    sampling for the sampler/trainer log-prob mismatch (TRL's `token_truncate` mode)."""
    importance_cap: float = Field(3.0, ge=1)
    """Upper bound of that per-token weight (TRL's default cap, 3.0)."""
    tensor_parallel_size: Literal[1] = 1
    """GPUs vLLM shards the model over; colocated in the training process it is 1 (and a
    vllm-server runs on one GPU)."""
    enforce_eager: bool = False
    """Skip CUDA-graph capture: faster start, slower decoding (useful for tiny smoke runs)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """vLLM's weight dtype; `auto` = the run's compute dtype (`model.precision`: bfloat16
    under bf16-mixed, not the float32 of its master weights). The model length is derived:
    max_prompt_length + max_completion_length."""
    server_url: str | None = Field(None, pattern=r"^https?://[^/\s]+/?$")
    """`http://HOST:PORT` of a `mogrpo vllm-server` on a GPU of its own: it samples the
    rollouts and gets the policy's weights before the first rollout and after every optimizer
    step (NCCL from a CUDA policy, else gloo). None: vLLM colocated in each training process.
    The server's own flags (`mogrpo vllm-server --help`) then take the place of
    gpu_memory_utilization, enforce_eager and dtype, and nothing sleeps. A server started
    with `MOGRPO_VLLM_SERVER_TOKEN` in its environment wants the same value in the trainer's
    (sent as a bearer token, never logged)."""
    server_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one answer of the server (a rollout, a bucket of weights) and for its
    joining the weight group."""


class RolloutConfig(Section):
    num_generations: int = 4
    """K: completions sampled per prompt (the group of group-relative advantages); ≥ 2."""
    max_seq_length: int = Field(512, ge=2)
    """Token budget for prompt + completion; lengths not given are derived from it, or from the
    model's positions where it has fewer (config.json is read before the model loads)."""
    length_allocation: Literal["explicit", "balanced", "prompt_heavy", "completion_heavy"] = (
        "explicit"
    )
    """How prompt and completion lengths are derived from `max_seq_length`: `explicit` uses
    the two lengths below (a missing one gets the remainder); `balanced` splits 50/50,
    `prompt_heavy` 75/25, `completion_heavy` 25/75."""
    max_prompt_length: int | None = Field(None, ge=1)
    """Prompt tokens kept (longer prompts are cut from the left)."""
    max_completion_length: int | None = Field(None, ge=1)
    """Maximum new tokens per completion (a completion that reaches it is `truncated`)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature; log-probs are computed at the same temperature."""
    top_k: int = Field(0, ge=0)
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off)."""
    min_p: float = Field(0.0, ge=0, lt=1)
    """Drop tokens below min_p × the top probability (0 = off)."""
    presence_penalty: float = 0.0
    """Subtract this from the logit of every token already generated (OpenAI semantics)."""
    frequency_penalty: float = 0.0
    """Subtract this × the count of each token already generated."""
    repetition_penalty: float = Field(1.0, gt=0)
    """CTRL-style repetition penalty over the prompt and the completion so far (1.0 = off)."""
    stop_token_ids: list[NonNegativeInt] = Field(default_factory=list)
    """Token ids that end a completion (e.g. [128001, 128009]); default: the model's EOS."""
    engine: RolloutEngine = "auto"
    """Who generates: `native` (mogrpo's decode loop: Llama, Mistral, Qwen2/3, Gemma, Phi-3),
    `hf` (transformers' generate(), the reference), `auto` (native where the model can run on
    it, else hf with one log line saying why), `vllm` (vLLM colocated on the training GPU,
    one engine per training process, `pip install 'mogrpo[vllm]'`, CUDA only; or a `mogrpo
    vllm-server` on a GPU of its own, `rollout.vllm.server_url`; options under
    `rollout.vllm`)."""
    generation_batch_size: int | None = Field(None, ge=1)
    """Completions decoded at once (prompts × K); None = the whole step's. Independent of
    `train.micro_batch_size`: lower it only to cap generation memory. vllm: its
    max_num_seqs."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vLLM engine (used when `engine: vllm`)."""

    @property
    def prompt_length(self) -> int:
        return derive_lengths(self)[0]

    @property
    def completion_length(self) -> int:
        return derive_lengths(self)[1]


_SPLITS = {"balanced": 0.5, "prompt_heavy": 0.75, "completion_heavy": 0.25}


def derive_lengths(rollout: RolloutConfig) -> tuple[int, int]:
    """(max_prompt_length, max_completion_length) after the length allocation strategy."""
    total = rollout.max_seq_length
    if rollout.length_allocation == "explicit":
        prompt, completion = rollout.max_prompt_length, rollout.max_completion_length
        if prompt is None and completion is None:
            prompt = round(total * _SPLITS["balanced"])
            completion = total - prompt
        elif prompt is None:
            prompt = total - completion
        elif completion is None:
            completion = total - prompt
        return prompt, completion
    prompt = round(total * _SPLITS[rollout.length_allocation])
    return prompt, total - prompt

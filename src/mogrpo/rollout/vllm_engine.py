"""vLLM as the rollout engine, colocated in the training process (CUDA only, `mogrpo[vllm]`).

One GRPO step with `rollout.vllm.sleep_during_update` (the default):

    rollout   wake_up(kv_cache) → generate(n = K per prompt) → sleep(level 2)
    update    the trainer has the GPU to itself: vLLM holds neither weights nor KV cache
    push      wake_up(weights) → load_weights(policy, LoRA merged) → reset_prefix_cache

Level 2 discards vLLM's weights instead of parking them in CPU memory (level 1): they are
replaced by the push after every optimizer step anyway, so a CPU copy would only cost a
transfer. vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so the push hands
vLLM's `load_weights` the trainer's tensors directly, through `LLM.apply_model`, with no
serialisation and no second copy of the model.

LoRA: the merged weights (W + scale · B @ A, computed out of place) are pushed rather than the
adapter. vLLM then decodes at base-model speed with no LoRA kernels, needs no `enable_lora` /
`max_lora_rank` limits, and no adapter is written to disk and re-loaded every step; the cost is
one on-device copy of the adapted matrices per step.

Log-probs: vLLM reports each sampled token's log-prob under the distribution it sampled from
(`logprobs_mode="processed_logprobs"`: after vLLM's penalties, temperature and filters), the
`q` of the importance correction in `mogrpo.algo.importance`. vLLM applies min-p before top-k /
top-p, transformers after them: with both min_p and top_p set the two can keep slightly
different tokens.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mogrpo.config import engines
from mogrpo.errors import ConfigError
from mogrpo.rollout.native import Decoded
from mogrpo.rollout.weights import checkpoint_weights

if TYPE_CHECKING:
    from mogrpo.config import RunConfig
    from mogrpo.rollout.sampling import SamplingSettings

log = logging.getLogger(__name__)

def import_vllm() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """vLLM's `LLM` and `SamplingParams`, or a ConfigError that says how to get them."""
    reason = engines.vllm_unavailable_reason()
    if reason is not None:
        raise ConfigError(reason)
    # The engine core in this process: the weight push passes tensors by reference.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    return LLM, SamplingParams


def sampling_kwargs(settings: SamplingSettings, *, n: int, stop_ids: list[int],
                    seed: int | None, logprobs: bool) -> dict[str, Any]:
    """`SamplingParams` keyword arguments for mogrpo's sampling settings, every field set."""
    greedy = settings.greedy
    return dict(
        n=n,
        temperature=0.0 if greedy else settings.temperature,  # vLLM: 0 is greedy
        top_k=settings.top_k if settings.top_k > 0 and not greedy else -1,  # -1: off, any version
        top_p=1.0 if greedy else settings.top_p,
        min_p=0.0 if greedy else settings.min_p,
        # penalties shape greedy decoding too, as in the native and hf engines
        presence_penalty=settings.presence_penalty,
        frequency_penalty=settings.frequency_penalty,
        repetition_penalty=settings.repetition_penalty,
        max_tokens=settings.max_new_tokens,
        min_tokens=0,
        # exactly mogrpo's stop ids: without ignore_eos vLLM would also stop at the
        # checkpoint's EOS when the configured stop ids leave it out
        stop_token_ids=list(stop_ids),
        ignore_eos=True,
        seed=seed,
        logprobs=0 if logprobs else None,  # 0: the sampled token's log-prob only
        detokenize=False,  # mogrpo decodes the ids itself
    )


def llm_kwargs(config: RunConfig, model_path: str, policy_dtype: torch.dtype, *,
               rank: int = 0, world_size: int = 1) -> dict[str, Any]:
    """`LLM(...)` keyword arguments for a colocated engine serving `model_path`.

    With several training processes (torchrun) each runs an engine of its own on its own GPU:
    vLLM's `external_launcher` backend takes the process's place from torchrun's environment
    instead of starting workers, and each engine draws from its own seed (`seed + rank`), so
    the processes' completions are independent samples."""
    ro, vc = config.rollout, config.rollout.vllm
    kwargs: dict[str, Any] = dict(
        model=model_path,
        skip_tokenizer_init=True,  # prompts go in as token ids, completions come back as ids
        dtype=str(policy_dtype).removeprefix("torch.") if vc.dtype == "auto" else vc.dtype,
        gpu_memory_utilization=vc.gpu_memory_utilization,
        tensor_parallel_size=vc.tensor_parallel_size,
        enable_sleep_mode=vc.sleep_during_update,
        enforce_eager=vc.enforce_eager,
        max_model_len=ro.prompt_length + ro.completion_length,
        seed=config.seed + rank,
        trust_remote_code=config.model.trust_remote_code,
        logprobs_mode="processed_logprobs",
    )
    if world_size > 1:
        kwargs["distributed_executor_backend"] = "external_launcher"
    if ro.generation_batch_size is not None:
        kwargs["max_num_seqs"] = ro.generation_batch_size
    return kwargs


def _chosen_logprobs(completion: Any, ids: list[int]) -> list[float]:
    """The log-prob of each sampled token, from vLLM's per-position {token: Logprob} maps."""
    if completion.logprobs is None or len(completion.logprobs) != len(ids):
        raise RuntimeError(
            "vLLM returned no log-prob for some sampled tokens; it must run with "
            "SamplingParams(logprobs=0)"
        )
    return [float(step[token].logprob) for step, token in zip(completion.logprobs, ids,
                                                              strict=True)]


def completion_rows(outputs: list[Any], num_generations: int, *, record_logprobs: bool
                    ) -> tuple[list[list[int]], list[list[float]] | None]:
    """vLLM's `RequestOutput`s (one per prompt, K completions each) as token-id rows, row
    `i * K + k` completion k of prompt i, and each row's sampled-token log-probs (None unless
    `record_logprobs`)."""
    rows: list[list[int]] = []
    logps: list[list[float]] = []
    for i, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != num_generations:
            raise RuntimeError(f"vLLM returned {len(completions)} completions for prompt {i}, "
                               f"expected {num_generations}")
        for completion in completions:
            ids = [int(t) for t in completion.token_ids]
            rows.append(ids)
            if record_logprobs:
                logps.append(_chosen_logprobs(completion, ids))
    return rows, logps if record_logprobs else None


def decoded_from_rows(rows: list[list[int]], logps: list[list[float]] | None, *, pad_id: int,
                      device: torch.device | str = "cpu") -> Decoded:
    """`completion_rows` as a `Decoded`, each row right-padded with `pad_id`."""
    width = max([1, *(len(r) for r in rows)])
    tokens = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows], dtype=torch.long)
    logp = (torch.tensor([lp + [0.0] * (width - len(lp)) for lp in logps], dtype=torch.float32)
            if logps is not None else None)  # [B, C]
    return Decoded(tokens.to(device), 0, logp.to(device) if logp is not None else None, 0)


def decoded_from_outputs(outputs: list[Any], num_generations: int, *, pad_id: int,
                         record_logprobs: bool, device: torch.device | str = "cpu") -> Decoded:
    """vLLM's `RequestOutput`s as a `Decoded`: row `i * K + k` is completion k of prompt i."""
    rows, logps = completion_rows(outputs, num_generations, record_logprobs=record_logprobs)
    return decoded_from_rows(rows, logps, pad_id=pad_id, device=device)


def request_seeds(seed: int | None, num_prompts: int, num_generations: int) -> list[int] | None:
    """One seed per request when the rollout is seeded, spaced K apart: vLLM seeds completion
    k of a request with seed + k."""
    if seed is None:
        return None
    return [seed + i * num_generations for i in range(num_prompts)]


class VLLMEngine:
    """A vLLM `LLM` that samples the rollouts of one policy and follows its weights.

    `llm` is `vllm.LLM` (or any object with its `generate`, `sleep`, `wake_up`, `apply_model`
    and `reset_prefix_cache`), `sampling_params` the `vllm.SamplingParams` class.
    """

    def __init__(self, llm: Any, sampling_params: Callable[..., Any], policy: nn.Module, *,
                 sleep_during_update: bool = True, device: torch.device | str = "cpu") -> None:
        self.llm = llm
        self.sampling_params = sampling_params
        self.policy = policy
        self.sleep_during_update = sleep_during_update
        self.device = torch.device(device)
        self.weights_awake = True  # vLLM's weight memory is mapped
        self.kv_awake = True  # its KV-cache memory is mapped
        self.weights_current = False  # it holds the policy's latest weights
        self.pushes = 0

    @classmethod
    def create(cls, policy: nn.Module, config: RunConfig, model_path: str, *, rank: int = 0,
               world_size: int = 1, dtype: torch.dtype | None = None) -> VLLMEngine:
        """Start vLLM on `model_path` (the policy's base checkpoint) next to the trainer (in
        process `rank` of `world_size`, each with an engine of its own), computing in `dtype`
        (the run's compute dtype; None: the policy's weights' dtype)."""
        LLM, SamplingParams = import_vllm()
        param = next(policy.parameters())
        kwargs = llm_kwargs(config, model_path, dtype or param.dtype, rank=rank,
                            world_size=world_size)
        log.info("starting vLLM on %s (%.0f%% of the GPU's memory, max_model_len %d)",
                 model_path, 100 * kwargs["gpu_memory_utilization"], kwargs["max_model_len"])
        engine = cls(LLM(**kwargs), SamplingParams, policy,
                     sleep_during_update=config.rollout.vllm.sleep_during_update,
                     device=param.device)
        if engine.sleep_during_update:
            engine.sleep()  # until the first rollout: SFT, eval setup and the reference need room
        return engine

    # ------------------------------------------------------------------ memory

    def sleep(self) -> None:
        """Release vLLM's weights and KV cache (level 2: the next push restores the weights)."""
        self.llm.sleep(level=2)
        self.weights_awake = self.kv_awake = self.weights_current = False

    def _wake(self, tag: str) -> None:
        if self.device.type == "cuda":
            # The trainer's freed blocks sit in PyTorch's caching allocator; vLLM's own
            # allocator can only map memory that the cache has handed back to the driver.
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=[tag])

    # ------------------------------------------------------------------ weights

    def push_weights(self) -> int:
        """Copy the policy's current weights into vLLM (LoRA merged); returns how many tensors.

        Under FSDP2 the caller gathers the weights first (`ParallelPolicy.gathered`): every
        process pushes the whole model into its own engine."""
        if not self.weights_awake:
            self._wake("weights")
            self.weights_awake = True
        count = 0

        def counted() -> Iterator[tuple[str, Tensor]]:
            nonlocal count
            for name, tensor in checkpoint_weights(self.policy):
                count += 1
                yield name, tensor

        # runs on vLLM's model inside this process; load_weights maps checkpoint names to its
        # fused layers (qkv_proj, gate_up_proj) and copies into its tensors in place
        self.llm.apply_model(lambda model: model.load_weights(counted()))
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
        self.weights_current = True
        self.pushes += 1
        log.debug("pushed %d weight tensors to vLLM", count)
        return count

    # ------------------------------------------------------------------ sampling

    def request_params(self, settings: SamplingSettings, num_prompts: int, *,
                       num_generations: int, stop_ids: list[int], seed: int | None,
                       record_logprobs: bool) -> Any:
        """One `SamplingParams` for every request, or one per request when seeded: vLLM seeds
        completion k of a request with seed + k, so requests are spaced K seeds apart."""
        def params(request_seed: int | None) -> Any:
            return self.sampling_params(**sampling_kwargs(
                settings, n=num_generations, stop_ids=stop_ids, seed=request_seed,
                logprobs=record_logprobs))

        seeds = request_seeds(seed, num_prompts, num_generations)
        return params(None) if seeds is None else [params(s) for s in seeds]

    def decode(self, prompts: list[list[int]], settings: SamplingSettings, *,
               num_generations: int, stop_ids: list[int], pad_id: int, seed: int | None = None,
               record_logprobs: bool = False) -> Decoded:
        """K completions for each prompt (token ids, unpadded): rows `i * K + k`."""
        if not self.weights_awake or not self.weights_current:
            self.push_weights()
        if not self.kv_awake:
            self._wake("kv_cache")
            self.kv_awake = True
        params = self.request_params(settings, len(prompts), num_generations=num_generations,
                                     stop_ids=stop_ids, seed=seed,
                                     record_logprobs=record_logprobs)
        try:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts],
                                        sampling_params=params, use_tqdm=False)
        finally:
            if self.sleep_during_update:
                self.sleep()
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} prompts")
        return decoded_from_outputs(outputs, num_generations, pad_id=pad_id,
                                    record_logprobs=record_logprobs, device=self.device)

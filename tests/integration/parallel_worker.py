"""One process of the DDP / FSDP2 equivalence test, run by torchrun (see test_parallel.py).

Each case loads the tiny model, wraps it for its strategy (`mogrpo.trainer.parallel`), and runs
the GRPO trainer's own `reference_logprobs` + `update` on three fixed global batches of three
prompts × K = 2; process r keeps its share of the prompts (uneven with 2 processes: 2 prompts
and 1, so 2 micro-batches and 1). Process 0 saves the summed losses, the norms and the whole
trainable weights after the 3 optimizer steps (× μ), plus what FSDP2 holds locally.

usage: parallel_worker.py OUT MODEL_DIR
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch

from mogrpo.algo.choices import LOSS_AGGREGATIONS
from mogrpo.config import load_config
from mogrpo.demo import demo_base
from mogrpo.rollout.batching import select_groups
from mogrpo.rollout.generate import Rollout, generate_rollout
from mogrpo.tasks.context import render_prompts
from mogrpo.tasks.task import load_tasks
from mogrpo.tracking import names
from mogrpo.trainer import optim
from mogrpo.trainer.distributed import Dist, process_group
from mogrpo.trainer.grpo import GRPOTrainer, ScoredBatch
from mogrpo.trainer.parallel import full_weights, parallelize
from mogrpo.trainer.run import build_context, seed_everything

K, PROMPTS, STEPS = 2, 3, 3
SHARES = {1: [[0, 1, 2]], 2: [[0, 1], [2]]}  # prompts of each process
# (loss aggregation, μ, LoRA); with 2 processes each runs under DDP and under FSDP2
SETTINGS = [(a, mu, False) for a in LOSS_AGGREGATIONS for mu in (1, 2)] + [("token_mean", 2, True)]
STRATEGIES = ("ddp", "fsdp")
# the update norm's chunked optimizer step in many chunks of at most 4 KiB of weights (a larger
# tensor alone): in every case, FSDP2's sharded parameters included
optim.UPDATE_NORM_CHUNK_BYTES = 4096


def case_name(aggregation: str, mu: int, lora: bool) -> str:
    return f"{aggregation}-mu{mu}" + ("-lora" if lora else "")


def config_for(model: Path, out: Path, strategy: str, aggregation: str, mu: int, lora: bool):
    base = demo_base()
    base["model"]["name_or_path"] = str(model)
    base["output"]["dir"] = str(out / "run")
    # no LoRA dropout: its masks are random draws, which differ between 1 and 2 processes
    base["lora"] = {"enabled": lora, "r": 4, "alpha": 8, "dropout": 0.0}
    for task in base["tasks"].values():
        task["data"] += "?size=8"
        task["eval_size"] = 2
    base["rollout"].update(num_generations=K, max_completion_length=6)
    base["train"].update(micro_batch_size=2, gradient_accumulation_steps=3, learning_rate=1e-3,
                         warmup_steps=0)
    base["algorithm"] = {"loss_aggregation": aggregation, "num_iterations": mu}
    base["distributed"] = {"strategy": strategy}
    config, _ = load_config(None, [], base=base)
    return config


def global_batch(step: int, vocab: int, pad: int) -> ScoredBatch:
    """The same batch in every process: 3 prompts × K completions of different lengths."""
    g = torch.Generator().manual_seed(100 + step)
    B, P, C = PROMPTS * K, 5, 6
    prompt_ids = torch.randint(2, vocab, (PROMPTS, P), generator=g).repeat_interleave(K, 0)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0:K, :2] = 0  # left padding on the first prompt
    prompt_ids[prompt_mask == 0] = pad
    lengths = torch.randint(1, C + 1, (B,), generator=g)
    completion_mask = (torch.arange(C) < lengths[:, None]).long()
    completion_ids = torch.randint(2, vocab, (B, C), generator=g).masked_fill(
        completion_mask == 0, pad)
    rollout = Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, lengths,
                      lengths == C, [""] * B, K)
    advantages = torch.randn(B, generator=g)
    beta = torch.tensor([0.05] * (2 * K) + [0.0] * K)  # the last prompt's task has β = 0
    task_ids = torch.tensor([0] * (2 * K) + [1] * K)
    return ScoredBatch(rollout, task_ids, advantages, beta)


def share(batch: ScoredBatch, groups: list[int]) -> ScoredBatch:
    rows = torch.tensor([g * K + k for g in groups for k in range(K)])
    return ScoredBatch(select_groups(batch.rollout, groups), batch.task_ids[rows],
                       batch.advantages[rows], batch.beta[rows])


def run_case(strategy: str, aggregation: str, mu: int, lora: bool, model: Path, out: Path,
             dist: Dist) -> dict:
    config = config_for(model, out, strategy, aggregation, mu, lora)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    if dist.rank == 1:  # a different start: the engine must give every process process 0's
        with torch.no_grad():
            for p in ctx.policy.parameters():
                p.add_(0.01)
    parallel, reference = parallelize(ctx.policy, config.distributed, dist, ctx.device,
                                      reference_needed=True)
    trainer = GRPOTrainer(ctx, reference, parallel)
    result: dict = {"strategy": parallel.strategy}
    texts, special = render_prompts(ctx, [(0, ex) for ex in ctx.tasks[0].eval[:2]])
    greedy = replace(ctx.sampling, greedy=True)
    for engine in ("native", "hf") if mu == 1 or lora else ():
        # greedy, from the weights every process now shares
        with parallel.gathered():
            ro = generate_rollout(ctx.policy, ctx.tokenizer, texts, greedy, num_generations=1,
                                  max_prompt_length=32, add_special_tokens=special, engine=engine)
        result[f"greedy_{engine}"] = ro.completion_ids
    params = [p for p in ctx.policy.parameters() if p.requires_grad]
    grads_held: list[int] = []  # per optimizer step: gradient elements this process holds
    optimizer_step = trainer.optimizer.step

    def step_and_count(*args, **kwargs):
        if parallel.is_fsdp:  # the update frees the gradients after the step
            grads_held.append(parallel.local_numel([p.grad for p in params]))
        return optimizer_step(*args, **kwargs)

    trainer.optimizer.step = step_and_count
    losses, grad_norms, update_norms, micro = [], [], [], []
    vocab, pad = ctx.policy.config.vocab_size, ctx.tokenizer.pad_token_id
    for step in range(STEPS):
        local = share(global_batch(step, vocab, pad), SHARES[dist.world_size][dist.rank])
        micro.append(len(trainer._micro_batches(local.rollout)))
        trainer.reference_logprobs(local)
        metrics = trainer.update(local)
        losses.append(dist.sum(metrics[names.LOSS]))
        grad_norms.append(metrics[names.GRAD_NORM])
        update_norms.append(metrics[names.UPDATE_NORM])
    result.update(losses=losses, grad_norms=grad_norms, update_norms=update_norms,
                  micro_batches=dist.gather(micro))
    if parallel.is_fsdp:
        weights = full_weights(parallel)
        state = [t for s in trainer.optimizer.state.values() for t in s.values()
                 if torch.is_tensor(t) and t.dim() > 0]
        result["local"] = {"params": parallel.local_numel(params),
                           "grads": grads_held[-1],
                           "adam": parallel.local_numel(state),
                           "full": sum(w.numel() for w in weights.values())}
    else:
        weights = {n: p.detach().clone() for n, p in ctx.policy.named_parameters()
                   if p.requires_grad}
    result["weights"] = weights
    return result


def main() -> None:
    out, model = Path(sys.argv[1]), Path(sys.argv[2])
    with process_group("cpu") as dist:
        strategies = STRATEGIES if dist.world_size > 1 else ("none",)
        for setting in SETTINGS:
            for strategy in strategies:
                result = run_case(strategy, *setting, model, out, dist)
                if dist.is_main:
                    torch.save(result, out / f"{case_name(*setting)}-{strategy}.pt")

if __name__ == "__main__":
    main()

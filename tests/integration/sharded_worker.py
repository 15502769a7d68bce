"""One process of the sharded-checkpoint tests, run by torchrun (see test_sharded_checkpoint.py).

    sharded_worker.py MODE MODEL_DIR RUN_DIR OUT [STRATEGY]

The model is the tiny Llama of MODEL_DIR, wrapped with FSDP2 (`fully_shard` per decoder layer,
then the root) when STRATEGY is `fsdp`, with DDP when `ddp`, left plain when `none`; AdamW.
Each step draws this process's batch from its own torch, NumPy and Python RNGs (seeded per
rank), so a resume that did not restore them would train on other batches. Modes:

- `train`: steps 1-2, save step 2, steps 3-4, save step 4; the full weights and optimizer
  state after steps 2 and 4 go to OUT/full-2.pt and OUT/full-4.pt (process 0).
- `resume`: pick the checkpoint (`--resume auto`), load it; OUT/loaded.pt holds what was
  loaded, OUT/rng-R.pt process R's torch RNG state once restored; if it is step 2, steps 3-4
  follow and OUT/full-4.pt holds the result.
- `kill-shard`: as `train`, but process 1 SIGKILLs itself right after writing its shard of
  step 4 (before the barrier); `kill-rename`: process 0 SIGKILLs itself after writing step 4's
  manifest, before the rename.
"""

from __future__ import annotations

import faulthandler
import os
import random
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM, AutoTokenizer

from mogrpo.checkpoint import sharded, store
from mogrpo.trainer.distributed import DRAIN_S

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def build(model_dir: str, strategy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if strategy == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif strategy == "ddp":
        model = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return model, optimizer


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, vocab: int) -> None:
    length = random.randint(6, 10)  # Python RNG
    ids = torch.randint(0, vocab, (2, length))  # torch RNG
    ids = (ids + int(np.random.randint(0, vocab))) % vocab  # NumPy RNG
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def dump(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> None:
    weights = get_model_state_dict(model, options=FULL)
    optim = get_optimizer_state_dict(model, optimizer, options=FULL)
    if dist.get_rank() == 0:
        torch.save({"weights": weights, "optimizer": optim}, path)


def main() -> None:
    mode, model_dir, run_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    strategy = sys.argv[5] if len(sys.argv) > 5 else "fsdp"
    # a hung collective fails within minutes and shows where it hung
    faulthandler.dump_traceback_later(240, exit=True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=180))
    rank = dist.get_rank()
    model, optimizer = build(model_dir, strategy)
    vocab = AutoTokenizer.from_pretrained(model_dir).vocab_size
    random.seed(rank)
    np.random.seed(100 + rank)
    torch.manual_seed(200 + rank)

    def save(step: int) -> None:
        sharded.save_sharded(run_dir, step, model=model, optimizer=optimizer,
                             state={"run": "test", "world": dist.get_world_size()},
                             config_yaml="seed: 0\n", strategy=strategy)

    if mode == "resume":
        loaded = sharded.open_sharded(sharded.pick_resume(run_dir, "auto"))
        loaded.load_into(model, optimizer)
        if loaded.restore_rng():
            torch.save(torch.get_rng_state(), out / f"rng-{rank}.pt")
        dump(model, optimizer, out / "loaded.pt")
        first = loaded.state["step"] + 1
    else:
        first = 1
        if mode == "kill-shard" and rank == 1:
            write_rng = sharded._write_rng

            def write_then_die(tmp: Path, rank: int) -> None:
                write_rng(tmp, rank)
                if tmp.name.endswith("4"):
                    os.kill(os.getpid(), signal.SIGKILL)
            sharded._write_rng = write_then_die
        if mode == "kill-rename" and rank == 0:
            rename = os.rename

            def die_before_rename(src: Path, dst: Path) -> None:
                if Path(dst).name.endswith("4"):
                    os.kill(os.getpid(), signal.SIGKILL)
                rename(src, dst)
            store.os.rename = die_before_rename
    for step in range(first, 5):
        train_step(model, optimizer, vocab)
        if step in (2, 4) and mode != "resume":
            save(step)
            dump(model, optimizer, out / f"full-{step}.pt")
        elif step == 4:
            dump(model, optimizer, out / "full-4.pt")
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(DRAIN_S)  # as `process_group` does (it joins only with several processes)


if __name__ == "__main__":
    main()

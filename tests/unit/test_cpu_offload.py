"""`distributed.cpu_offload`: `shard` gives every FSDP2 unit PyTorch's CPUOffloadPolicy, and
the optimizer steps the offloaded shards to the same bits as the plain ones (a one-process
gloo group in a process of its own; on a GPU the shards would live in pinned host memory,
which this CPU-only check cannot show)."""

from __future__ import annotations

from pathlib import Path

OFFLOADED = """
import sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[2])
from architectures import family_config
from mogrpo.config.sections import DistributedConfig
from mogrpo.trainer.distributed import DRAIN_S, Dist
from mogrpo.trainer.optim import build_optimizer
from mogrpo.trainer.parallel import shard
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
ids = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
weights = []
for offload in (False, True):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family_config("llama", vocab_size=300))
    units = shard(model, DistributedConfig(strategy="fsdp", cpu_offload=offload), Dist.current())
    policies = {type(u._get_fsdp_state()._fsdp_param_group.offload_policy).__name__
                for u in units}
    optimizer = build_optimizer(model, 1e-2, 0.0, (0.9, 0.999))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    weights.append([p.full_tensor() for p in model.parameters()])
    print(offload, len(units), sorted(policies), optimizer.param_groups[0]["fused"])
same = all(torch.equal(a, b) for a, b in zip(*weights, strict=True))
torch.manual_seed(0)
start = AutoModelForCausalLM.from_config(family_config("llama", vocab_size=300))
moved = all(not torch.equal(a, b) for a, b in zip(weights[1], start.parameters(), strict=True))
print(same, moved)
dist.barrier()
dist.destroy_process_group()
time.sleep(DRAIN_S)
"""


def test_offloaded_shards_step_to_the_plain_shards_bits(tmp_path):
    from multiproc import run

    tests = str(Path(__file__).resolve().parents[1])
    lines = run(["-c", OFFLOADED, str(tmp_path / "store"), tests]).stdout.splitlines()
    # every decoder block and the root: no offload, then CPUOffloadPolicy; fused AdamW
    assert lines[0].split(" ", 2)[::2] == ["False", "['OffloadPolicy'] True"]
    assert lines[1].split(" ", 2)[::2] == ["True", "['CPUOffloadPolicy'] True"]
    assert lines[0].split()[1] == lines[1].split()[1]  # the same units
    assert lines[2] == "True True"  # same weights with and without offload; they trained

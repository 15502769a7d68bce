"""The optimizer step measured chunk by chunk: the same weights and state as one step, the
norms of what moved, and the parameter groups left as they were."""

from __future__ import annotations

import pytest
import torch

from mogrpo.trainer.optim import _chunks, build_optimizer, step_with_update_norms


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 50))
    model[0].weight.requires_grad_(False)  # a frozen tensor the optimizer does not hold
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.randn_like(p)
    return model


def test_chunks_keep_order_and_budget():
    sizes = [4, 4, 12, 2, 2, 2]  # float32 elements: 16, 16, 48, 8, 8, 8 bytes
    params = [torch.zeros(n) for n in sizes]
    chunks = list(_chunks(params, budget=32))
    assert [[len(p) for p in c] for c in chunks] == [[4, 4], [12], [2, 2, 2]]
    assert [p for c in chunks for p in c] == params  # same tensors, same order


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])  # every optimizer steps per tensor
@pytest.mark.parametrize("budget", [1, 300, 2**30])  # one tensor a chunk, a few, all at once
def test_chunked_step_gives_one_steps_bits(budget, kind):
    plain, chunked = _model_with_grads(), _model_with_grads()
    opt_plain = build_optimizer(plain, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99), kind=kind)
    opt_chunked = build_optimizer(chunked, lr=1e-2, weight_decay=0.1, betas=(0.9, 0.99),
                                  kind=kind)
    for _ in range(3):  # the moments and the step count carry over between steps
        before = [p.detach().clone() for p in plain.parameters()]
        opt_plain.step()
        norms = step_with_update_norms(opt_chunked, budget=budget)
        for a, b in zip(plain.parameters(), chunked.parameters(), strict=True):
            assert torch.equal(a, b)
        moved = [(p.detach() - b).norm() for p, b in zip(plain.parameters(), before, strict=True)
                 if p.requires_grad]
        assert len(norms) == len(moved) == 4
        for n, m in zip(norms, moved, strict=True):
            assert torch.equal(n, m) and n > 0
    state_plain, state_chunked = opt_plain.state_dict(), opt_chunked.state_dict()
    assert state_plain["param_groups"] == state_chunked["param_groups"]
    for key, value in state_plain["state"].items():
        for name, saved in value.items():  # tensors, and Adafactor's step count
            other = state_chunked["state"][key][name]
            assert torch.equal(saved, other) if torch.is_tensor(saved) else saved == other


def test_frozen_weights_and_zero_lr_report_no_movement():
    model = _model_with_grads()
    opt = build_optimizer(model, lr=0.0, weight_decay=0.0, betas=(0.9, 0.99))
    frozen = model[0].weight.detach().clone()
    assert [float(n) for n in step_with_update_norms(opt, budget=64)] == [0.0] * 4
    assert torch.equal(model[0].weight, frozen)


def test_groups_restored_after_an_error():
    model = _model_with_grads()
    opt = build_optimizer(model, lr=1e-2, weight_decay=0.0, betas=(0.9, 0.99))
    groups = [list(g["params"]) for g in opt.param_groups]
    original = opt.step
    calls = []

    def failing_step(*args, **kwargs):
        calls.append(len(opt.param_groups[0]["params"]))
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return original(*args, **kwargs)

    opt.step = failing_step
    with pytest.raises(RuntimeError, match="out of memory"):
        step_with_update_norms(opt, budget=1)
    assert calls == [1, 1]  # one tensor per chunk; the second chunk failed
    assert [list(g["params"]) for g in opt.param_groups] == groups
    opt.step = original
    assert len(step_with_update_norms(opt)) == 4  # whole again: every weight steps

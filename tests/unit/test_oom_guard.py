"""`OomGuard`: what counts as out of memory, when a step is redone and when the run stops."""

from __future__ import annotations

import random

import pytest
import torch

from mogrpo.config import RunConfig
from mogrpo.errors import OutOfMemory
from mogrpo.trainer.oom import GENERATION, MICRO, UPDATE, OomGuard, is_oom


def guard(world_size: int = 1, **memory) -> OomGuard:
    config = RunConfig.model_validate({"train": {"micro_batch_size": 8}, "memory": memory})
    return OomGuard(config, world_size, torch.device("cpu"), release=lambda: None)


def oom() -> Exception:
    return torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_what_counts_as_out_of_memory():
    assert is_oom(oom()) and is_oom(torch.cuda.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 1099511627776 bytes"))
    assert not is_oom(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not is_oom(MemoryError())  # Python's own: not a tensor allocation


def test_a_redo_draws_the_same_random_numbers_at_half_the_size():
    g, sizes, draws = guard(), [], []

    def phase():
        sizes.append(g.micro_batch_size)
        draws.append((torch.rand(2), random.random()))
        if len(sizes) == 1:
            raise oom()
        return "done"

    assert g.run(3, [(UPDATE, phase)]) == "done"
    assert sizes == [8, 4]
    assert torch.equal(draws[0][0], draws[1][0]) and draws[0][1] == draws[1][1]
    assert g.take_events() == [{"event": "oom", "step": 3, "phase": UPDATE, "key": MICRO,
                                "from": 8, "to": 4}]
    assert g.take_events() == []


def test_generation_halves_the_whole_step_when_unset():
    g = guard()
    calls = []

    def phase():
        calls.append(g.generation_batch_size)
        if len(calls) == 1:
            raise oom()

    g.run(1, [(GENERATION, phase)], rows=16)
    assert calls == [None, 8] and g.micro_batch_size == 8


@pytest.mark.parametrize(("make", "text"), [
    (lambda: guard(on_oom="fail"), "memory.on_oom is fail"),
    (lambda: guard(world_size=2), "with 2 processes"),
])
def test_no_redo_when_told_or_with_several_processes(make, text):
    with pytest.raises(OutOfMemory, match=text):
        make().run(1, [(UPDATE, lambda: (_ for _ in ()).throw(oom()))])


def test_size_1_or_a_stepped_optimizer_stops_the_run():
    g = guard()
    with pytest.raises(OutOfMemory, match=r"\(train.micro_batch_size 1\).*nothing is left"):
        g.run(1, [(UPDATE, lambda: (_ for _ in ()).throw(oom()))])
    assert [e["to"] for e in g.events] == [4, 2, 1]

    g = guard()

    def stepped():
        g.stepped = True  # μ > 1: the first pass's optimizer step is taken
        raise oom()
    with pytest.raises(OutOfMemory, match="optimizer already stepped"):
        g.run(1, [(UPDATE, stepped)])


def test_other_errors_pass_through():
    with pytest.raises(ValueError):
        guard().run(1, [(UPDATE, lambda: (_ for _ in ()).throw(ValueError("bug")))])


def test_a_resume_keeps_the_adapted_size_unless_the_config_changed_it():
    adapted = guard()
    adapted.sizes[MICRO] = 2
    resumed = guard()
    resumed.load_state_dict(adapted.state_dict())
    assert resumed.micro_batch_size == 2
    changed = OomGuard(RunConfig.model_validate({"train": {"micro_batch_size": 4}}), 1,
                       torch.device("cpu"), release=lambda: None)
    changed.load_state_dict(adapted.state_dict())
    assert changed.micro_batch_size == 4  # the user's new choice wins

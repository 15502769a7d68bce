"""`process_group`: a run under torchrun joins the group torchrun describes and leaves it when
the run is done (after a barrier), never after an error, and never leaves a group it did not
join. torch.distributed's calls are recorded here; the 2-process tests run the real ones."""

from __future__ import annotations

import pytest

from mogrpo.trainer import distributed


@pytest.fixture
def calls(monkeypatch):
    log: list[tuple] = []
    state = {"joined": False}

    def init(backend):
        log.append(("init", backend))
        state["joined"] = True

    def destroy():
        log.append(("destroy",))
        state["joined"] = False

    fake = distributed.dist
    monkeypatch.setattr(fake, "init_process_group", init)
    monkeypatch.setattr(fake, "destroy_process_group", destroy)
    monkeypatch.setattr(fake, "barrier", lambda: log.append(("barrier",)))
    monkeypatch.setattr(fake, "is_initialized", lambda: state["joined"])
    monkeypatch.setattr(fake, "get_rank", lambda: 1)
    monkeypatch.setattr(fake, "get_world_size", lambda: 2)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(distributed.time, "sleep", lambda s: log.append(("sleep", s)))
    return log, state


def test_a_run_joins_with_gloo_on_cpu_and_leaves_after_a_barrier(calls):
    log, _ = calls
    with distributed.process_group("cpu") as dist:
        assert dist == distributed.Dist(rank=1, world_size=2)
        assert log == [("init", "gloo")]
    # then the GIL is released so gloo's threads can free the last collectives' tensors
    assert log == [("init", "gloo"), ("barrier",), ("destroy",), ("sleep", distributed.DRAIN_S)]


def test_on_gpus_host_tensors_have_a_backend_too(calls, monkeypatch):
    """NCCL alone takes only CUDA tensors; the run's own sums are host scalars."""
    log, _ = calls
    devices = []
    monkeypatch.setattr(distributed.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(distributed.torch.cuda, "set_device", devices.append)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with distributed.process_group("cuda"):
        assert log == [("init", "cpu:gloo,cuda:nccl")] and devices == [1]


def test_after_an_error_the_group_is_left_to_the_process_exit(calls):
    log, state = calls
    with pytest.raises(RuntimeError, match="reward failed"), distributed.process_group("cpu"):
        raise RuntimeError("reward failed")
    assert log == [("init", "gloo")]  # no barrier a failed peer would never reach
    assert state["joined"]


def test_a_group_the_caller_joined_stays_joined(calls):
    log, state = calls
    state["joined"] = True
    with distributed.process_group("cpu") as dist:
        assert dist.world_size == 2
    assert log == [] and state["joined"]


def test_one_process_touches_nothing(calls, monkeypatch):
    log, _ = calls
    monkeypatch.delenv("WORLD_SIZE")
    with distributed.process_group("cpu") as dist:
        assert dist == distributed.Dist()
    assert log == []

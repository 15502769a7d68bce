"""`rollout.engine: vllm` with 2 processes (torchrun, gloo, the fake vLLM of tests/fake_vllm.py).

Each process runs an engine of its own: built with vLLM's `external_launcher` backend (it takes
the process's place from torchrun instead of starting workers) and its own seed, asked only for
its share of the prompts, and given the whole model after every optimizer step (under FSDP2
gathered from the shards; LoRA merged in). After the run, the weights each engine holds are
those of the final model process 0 saved (with LoRA: its merged model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from test_torchrun_train import final_weights_of, lines, train, write_config

from multiproc import torchrun

WORKER = Path(__file__).with_name("vllm_worker.py")
STEPS = 2


@pytest.mark.parametrize(("strategy", "lora"), [
    ("fsdp", False), pytest.param("fsdp", True, marks=pytest.mark.slow),
    pytest.param("ddp", True, marks=pytest.mark.slow)])
def test_each_process_samples_its_share_with_an_engine_holding_the_whole_model(
        tmp_path, tiny_model, strategy, lora):
    config = write_config(tmp_path, tiny_model, "run", STEPS)
    data = yaml.safe_load(config.read_text())
    data["rollout"]["engine"] = "vllm"
    data["distributed"] = {"strategy": strategy}
    data["sft"]["enabled"] = False
    if not lora:
        data["lora"] = {"enabled": False}
    config.write_text(yaml.safe_dump(data))
    torchrun(str(WORKER), str(config), str(tmp_path), timeout=600)

    engines = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    for rank, engine in enumerate(engines):
        assert engine["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert engine["kwargs"]["seed"] == rank  # the config's seed 0 + rank
        assert engine["pushes"] >= 1 + STEPS  # before the first rollout, after every step
    # the processes sampled different prompts (each its share of every step's groups)
    assert not set(engines[0]["prompts"]) & set(engines[1]["prompts"])
    final = final_weights_of(tmp_path / "run" / "final" / ("merged" if lora else "model"))
    for engine in engines:  # the whole model, in checkpoint names, in each process's engine
        assert engine["last"].keys() <= final.keys()
        assert {k for k in final if k not in engine["last"]} <= {"lm_head.weight"}  # tied
        for name, tensor in engine["last"].items():
            assert tensor.shape == final[name].shape, name
            assert torch.allclose(tensor, final[name], atol=1e-6), name


@pytest.mark.slow
def test_two_processes_share_one_vllm_server_and_only_the_first_pushes(tmp_path, tiny_model):
    """`rollout.vllm.server_url` under DDP: both processes sample from one server (here a
    fake vLLM behind the real HTTP server, in this test's process); process 0 pushes the
    weights before the first rollout and after every step, the other waits for it."""
    from fake_vllm import FakeLLM, FakeSamplingParams
    from mogrpo.rollout.vllm_server import RolloutServer, start_rollout_server

    llm = FakeLLM()
    http, _ = start_rollout_server(
        RolloutServer(llm, FakeSamplingParams, model="tiny", max_model_len=None, timeout_s=120),
        "127.0.0.1", 0)
    try:
        host, port = http.server_address[:2]
        config = write_config(tmp_path, tiny_model, "run", STEPS)
        data = yaml.safe_load(config.read_text())
        data["rollout"]["engine"] = "vllm"
        data["rollout"]["vllm"] = {"server_url": f"http://{host}:{port}"}
        data["distributed"] = {"strategy": "ddp"}
        data["sft"]["enabled"] = False
        data["lora"] = {"enabled": False}
        config.write_text(yaml.safe_dump(data))
        train(config)
    finally:
        http.shutdown()
        http.server_close()
    assert [m["step"] for m in lines(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    # one push (its last bucket resets the prefix cache) before sampling, then one per step
    assert llm.calls.count(("reset_prefix_cache",)) == 1 + STEPS
    assert sum(1 for c in llm.calls if c[0] == "generate") >= 2 * STEPS  # both processes
    final = final_weights_of(tmp_path / "run" / "final" / "model")
    last = llm.model.loads[-1]
    assert {k for k in final if k not in last} <= {"lm_head.weight"}  # tied
    for name, tensor in last.items():
        assert torch.allclose(tensor, final[name], atol=1e-6), name

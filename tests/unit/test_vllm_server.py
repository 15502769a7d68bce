"""`mogrpo vllm-server` and its client, on CPU: a fake vLLM behind the real HTTP server, the
weights through a real gloo group of two (the trainer and the server, here two threads)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from fake_vllm import FakeLLM, FakeSamplingParams
from http_json import post_json
from mogrpo.errors import ConfigError
from mogrpo.rollout.generate import SamplingSettings
from mogrpo.rollout.vllm_engine import VLLMEngine
from mogrpo.rollout.vllm_server import (
    TOKEN_ENV,
    RolloutServer,
    VLLMServerEngine,
    _address_toward,
    start_rollout_server,
    weight_backend,
)
from mogrpo.rollout.weights import checkpoint_state

K = 3
PROMPTS = [[5, 6, 7], [8], [9, 10]]


@pytest.fixture
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


@pytest.fixture
def served():
    """(the fake LLM, the RolloutServer, its URL), stopped after the test."""
    llm = FakeLLM()
    server = RolloutServer(llm, FakeSamplingParams, model="tiny", max_model_len=4096,
                           timeout_s=30)
    http, _ = start_rollout_server(server, "127.0.0.1", 0)
    host, port = http.server_address[:2]
    yield llm, server, f"http://{host}:{port}"
    http.shutdown()
    http.server_close()


def distinct_chars(prompts: list[str], completions: list[str], **columns) -> list[float]:
    """A reward that differs between random completions, so advantages are not zero."""
    return [float(len(set(c))) for c in completions]


def settings(**kw) -> SamplingSettings:
    return SamplingSettings(max_new_tokens=6, temperature=0.9, top_k=20, top_p=0.95,
                            presence_penalty=0.5, **kw)


def test_rollouts_from_the_server_match_the_colocated_engine_row_for_row(served, model):
    llm, _, url = served
    client = VLLMServerEngine(url, model, timeout_s=30)
    assert client.info == {"model": "tiny", "max_model_len": 4096, "gpu": None}
    kwargs = dict(num_generations=K, stop_ids=[13, 17], pad_id=0, seed=40, record_logprobs=True)
    remote = client.decode(PROMPTS, settings(), **kwargs)
    local = VLLMEngine(FakeLLM(), FakeSamplingParams, model, sleep_during_update=False).decode(
        PROMPTS, settings(), **kwargs)
    assert torch.equal(remote.tokens, local.tokens)  # row i * K + k: completion k of prompt i
    assert torch.equal(remote.logp, local.logp)
    prompts, params = llm.requests[-1]
    assert [p["prompt_token_ids"] for p in prompts] == PROMPTS
    assert [p.seed for p in params] == [40, 43, 46]  # one seed per prompt, K apart
    assert params[0].kwargs["temperature"] == 0.9 and params[0].kwargs["top_k"] == 20
    assert params[0].kwargs["presence_penalty"] == 0.5 and params[0].n == K
    assert params[0].kwargs["stop_token_ids"] == [13, 17] and params[0].logprobs == 0


def test_a_server_with_a_token_answers_only_requests_that_carry_it(model, monkeypatch):
    server = RolloutServer(FakeLLM(), FakeSamplingParams, model="tiny", max_model_len=4096,
                           timeout_s=30, token="s3cret-value")
    http, _ = start_rollout_server(server, "127.0.0.1", 0)
    host, port = http.server_address[:2]
    url = f"http://{host}:{port}"
    try:
        body = {"prompts": PROMPTS, "n": 1}
        for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret-value"}):
            code, reply = post_json(url + "/generate", body, headers)
            assert code == 401 and f"set {TOKEN_ENV}" in reply["error"]
            assert "s3cret" not in reply["error"]

        monkeypatch.delenv(TOKEN_ENV, raising=False)  # a trainer without it: stopped at start
        with pytest.raises(ConfigError, match=f"refused this trainer \\(no {TOKEN_ENV}\\)"):
            VLLMServerEngine(url, model, timeout_s=30)
        monkeypatch.setenv(TOKEN_ENV, "s3cret-valu")
        with pytest.raises(ConfigError, match=f"a wrong {TOKEN_ENV}") as refused:
            VLLMServerEngine(url, model, timeout_s=30)
        assert "s3cret" not in str(refused.value)
        monkeypatch.setenv(TOKEN_ENV, "s3cret-value")
        client = VLLMServerEngine(url, model, timeout_s=30)  # GET /health carried it
        assert client.info["model"] == "tiny"
        out = client.decode(PROMPTS, settings(), num_generations=K, stop_ids=[13], pad_id=0,
                            seed=1, record_logprobs=False)
        assert out.tokens.shape[0] == len(PROMPTS) * K
        assert client.push_weights() > 0  # the weight group's requests carry it too
    finally:
        http.shutdown()
        http.server_close()


def test_unseeded_requests_share_one_setting_and_log_probs_are_optional(served, model):
    llm, _, url = served
    out = VLLMServerEngine(url, model, timeout_s=30).decode(
        PROMPTS, settings(), num_generations=2, stop_ids=[13], pad_id=0)
    assert out.logp is None and out.tokens.shape[0] == 6
    params = llm.requests[-1][1]
    assert not isinstance(params, list) and params.seed is None and params.logprobs is None


def test_the_first_rollout_pushes_the_policy_and_each_push_sends_the_current_weights(
        served, model):
    llm, server, url = served
    client = VLLMServerEngine(url, model, timeout_s=30, bucket_bytes=40_000)  # several buckets
    client.decode(PROMPTS[:1], settings(), num_generations=K, stop_ids=[13], pad_id=0)
    assert server.backend == "gloo"
    assert llm.calls[-2:] == [("reset_prefix_cache",), ("generate", 1)]  # weights before sampling
    loads = llm.model.loads
    assert len(loads) > 2 and all(loads)  # bucketed; each /weights/load carried tensors

    def received() -> dict[str, torch.Tensor]:
        got: dict[str, torch.Tensor] = {}
        for load in llm.model.loads:
            got.update(load)
        return got

    want = checkpoint_state(model)
    got = received()
    assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    with torch.no_grad():  # an optimizer step
        model.model.layers[0].mlp.up_proj.weight.add_(0.25)
    llm.model.loads.clear()
    assert client.push_weights() == len(want)
    got = received()
    name = "model.layers.0.mlp.up_proj.weight"
    assert torch.equal(got[name], model.model.layers[0].mlp.up_proj.weight)
    assert llm.calls.count(("reset_prefix_cache",)) == 2  # once per push, after its last bucket
    assert client.pushes == 2


def test_no_server_at_the_url_is_a_config_error_that_says_how_to_start_one(model):
    with pytest.raises(ConfigError, match="no vllm-server answers there.*mogrpo vllm-server"):
        VLLMServerEngine("http://127.0.0.1:9", model, timeout_s=5)


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"prompts": [[1, "a"]], "n": 1}, 400, "non-empty lists of token ids"),
    ({"prompts": [[1]], "n": 0}, 400, "'n' must be an integer >= 1"),
    ({"prompts": [[1]], "n": 1, "sampling": {"best_of": 2}}, 400, "best_of"),
    ({"prompts": [[1], [2]], "n": 1, "seeds": [1]}, 400, "one integer per prompt"),
])
def test_bad_generate_requests_are_refused_with_the_reason(served, body, status, message):
    _, _, url = served
    code, reply = post_json(url + "/generate", body)
    assert code == status and message in reply["error"]


def test_weights_before_the_group_and_unknown_routes_are_refused(served):
    _, _, url = served
    code, reply = post_json(url + "/weights/load", {"tensors": [["w", "float32", [2]]]})
    assert code == 409 and "POST /weights/group first" in reply["error"]
    code, reply = post_json(url + "/weights/load", {"tensors": [["w", "complex64", [2]]]})
    assert code == 400 and "dtypes among" in reply["error"]
    code, reply = post_json(url + "/weights/group", {"host": "127.0.0.1", "port": 1,
                                                "backend": "mpi"})
    assert code == 400 and "gloo or nccl" in reply["error"]
    code, reply = post_json(url + "/v1/chat/completions", {"messages": []})
    assert code == 404 and "/generate" in reply["error"]


def test_a_sampling_setting_vllm_refuses_is_a_400(served):
    llm, server, url = served

    def strict(**kwargs):
        if kwargs.get("top_p", 1.0) <= 0:
            raise ValueError("top_p must be in (0, 1]")
        return FakeSamplingParams(**kwargs)

    server.sampling_params = strict
    code, reply = post_json(url + "/generate", {"prompts": [[1]], "n": 1, "sampling": {"top_p": 0}})
    assert code == 400 and "top_p must be in (0, 1]" in reply["error"]
    assert llm.requests == []  # nothing reached vLLM


def test_config_takes_a_server_url_without_vllm_or_a_gpu_here(tmp_path, tiny_model_dir):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base

    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["device"] = "cpu"
    base["rollout"]["engine"] = "vllm"
    config, _ = load_config(None, ["rollout.vllm.server_url=http://10.0.0.7:8100"], base=base)
    assert config.rollout.vllm.server_url == "http://10.0.0.7:8100"
    with pytest.raises(ConfigError, match="server_url"):
        load_config(None, ["rollout.vllm.server_url=10.0.0.7:8100"], base=base)
    with pytest.raises(ConfigError, match="needs device: cuda.*server_url"):
        load_config(None, [], base=base)  # colocated vLLM on a CPU machine


def test_training_steps_sample_from_the_server_and_push_after_each_optimizer_step(
        tmp_path, tiny_model_dir, served):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    llm, _, url = served
    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["device"] = "cpu"
    base["tasks"] = {"fairness": {"data": "builtin:bias_probe?size=16",
                                  "rewards": [{"fn": f"{__file__}:distinct_chars"}]}}
    base["rollout"].update(num_generations=K, max_completion_length=6, engine="vllm")
    base["rollout"]["vllm"] = {"server_url": url, "server_timeout_s": 30}
    base["train"].update(micro_batch_size=K * 2, gradient_accumulation_steps=1,
                         learning_rate=1e-2, warmup_steps=0)
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    assert isinstance(ctx.rollout_engine, VLLMServerEngine)
    trainer = GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))
    for _ in range(2):
        metrics = trainer.train_step()
        pushed = llm.model.loads[-1]  # one bucket: the tiny model is far below 256 MiB
        current = checkpoint_state(ctx.policy)
        assert pushed.keys() == current.keys()
        assert all(torch.equal(pushed[n], current[n]) for n in current)  # after the step
        assert metrics["time/weight_sync_s"] >= 0
        assert "policy/sampler_is_weight" in metrics  # the sampler's log-probs weight the loss
    assert [c for c in llm.calls if c[0] == "generate"] == [("generate", 2)] * 2
    assert ctx.rollout_engine.pushes == 3  # before the first rollout, then after each step


@pytest.mark.parametrize(("device", "server_gpu", "own_gpu", "backend"), [
    ("cuda", "GPU-b", "GPU-a", "nccl"),  # a server on another GPU
    ("cuda", "GPU-a", "GPU-a", "gloo"),  # on the trainer's GPU: NCCL refuses one device twice
    ("cuda", None, "GPU-a", "gloo"),  # a server without CUDA (a fake)
    ("cpu", "GPU-b", None, "gloo"),  # a policy in host memory
])
def test_weights_go_over_nccl_only_between_two_gpus(device, server_gpu, own_gpu, backend):
    assert weight_backend(torch.device(device), server_gpu, own_gpu) == backend


def test_the_weight_group_is_hosted_at_the_address_the_server_reaches():
    for url in ("http://127.0.0.1:8100", "http://localhost:8100/", "http://[::1]:8100"):
        assert _address_toward(url) == "127.0.0.1"
    try:  # the interface the route out leaves by (no packet is sent)
        remote = _address_toward("http://192.0.2.7:8100")
    except ConfigError as err:  # a machine with no route at all
        assert "no route from this machine to 192.0.2.7" in str(err)
    else:
        assert remote != "127.0.0.1" and remote.count(".") == 3


def test_a_server_too_short_for_the_rollout_stops_the_run_before_any_step(
        tmp_path, tiny_model_dir, served):
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context

    _, server, url = served
    server.max_model_len = 64  # as `mogrpo vllm-server MODEL --max-model-len 64`
    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path / "run")
    base["device"] = "cpu"
    base["rollout"].update(engine="vllm", max_prompt_length=48, max_completion_length=24,
                           max_seq_length=72)
    base["rollout"]["vllm"] = {"server_url": url}
    config, _ = load_config(None, [], base=base)
    with pytest.raises(ConfigError, match=r"holds at most 64 tokens a sequence, but "
                       r"rollout.max_prompt_length \+ max_completion_length = 48 \+ 24 = 72: "
                       r"restart it with --max-model-len 72"):
        build_context(config, load_tasks(config))


def test_vllm_server_without_vllm_is_one_error_line(monkeypatch, capsys):
    # docs/commands.md: `mogrpo[vllm]`; without it, an error line and status 2 (it was an
    # ImportError traceback: the install hint it imported had moved)
    import importlib.util

    from mogrpo.cli import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "vllm" else real(name, *a))
    assert main(["vllm-server", "some/model"]) == 2
    assert capsys.readouterr().err == (
        "error: vllm-server needs vLLM: `pip install 'mogrpo[vllm]'` on a machine with a CUDA "
        "GPU\n")

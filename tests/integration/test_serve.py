"""`mogrpo serve` on a tiny model: the official OpenAI client, a judge, batching and errors
(streaming, concurrency and the completions route: test_serve_stream.py)."""

from __future__ import annotations

import argparse
import json
import threading
import time
import urllib.error
import urllib.request

import pytest

from http_json import post_json
from judge_server import build_seven_model, judge_options
from mogrpo.cli.serve import add_parser
from mogrpo.errors import ModelError
from mogrpo.rewards.judge import JudgeReward
from mogrpo.serve.server import resolve_model_dir, start_server

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    return build_seven_model(tmp_path_factory.mktemp("seven") / "model")


@pytest.fixture(scope="module")
def served(seven):
    server, thread = start_server(str(seven), port=0, max_batch=4, max_new_tokens=8)
    yield server
    server.close()
    thread.join(timeout=10)
    assert not thread.is_alive()


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=30)


def post(server, body: dict | bytes) -> tuple[int, dict]:
    return post_json(f"{server.url}/chat/completions", body)


def test_openai_client_round_trip(served):
    api = client(served)
    reply = api.chat.completions.create(
        model="anything", temperature=0, max_tokens=8,
        messages=[{"role": "system", "content": "Grade it."},
                  {"role": "user", "content": "Anna was late. Who was late? Answer: Anna"}])
    choice = reply.choices[0]
    assert (choice.message.role, choice.message.content, choice.finish_reason) == (
        "assistant", "7", "stop")
    assert reply.model == "model" and reply.usage.completion_tokens == 2  # "7" + end of turn
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 2 > 2
    assert [m.id for m in api.models.list().data] == ["model"]


def test_n_stop_and_length(served):
    status, body = post(served, {"messages": [{"role": "user", "content": "hi"}], "n": 2,
                                 "temperature": 0})
    assert status == 200 and [c["message"]["content"] for c in body["choices"]] == ["7", "7"]
    status, body = post(served, {"messages": [{"role": "user", "content": "hi"}], "stop": ["7"],
                                 "temperature": 0})
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == ("", "stop")
    status, body = post(served, {"messages": [{"role": "user", "content": "hi"}],
                                 "max_tokens": 1, "temperature": 0})
    assert (body["choices"][0]["message"]["content"], body["choices"][0]["finish_reason"]) == ("7", "length")


def test_a_model_without_chat_template_gets_plain_text(served, monkeypatch):
    monkeypatch.setattr(served.batcher.tokenizer, "chat_template", None)
    system_and_user = [{"role": "system", "content": "Grade."}, {"role": "user", "content": "hi"}]
    status, body = post(served, {"messages": system_and_user, "temperature": 0})
    assert status == 200 and body["choices"][0]["message"]["content"] == "7"
    turns = [*system_and_user, {"role": "assistant", "content": "7"}, {"role": "user", "content": "?"}]
    status, body = post(served, {"messages": turns})
    assert status == 400 and "no chat template is in use" in body["error"]["message"]


def test_a_judge_scores_through_the_server(served):
    judge = JudgeReward.from_options(judge_options(served.url, timeout=30), where="judge",
                                     cache_dir=None)
    scores = judge(["Who was late?"] * 3, ["Anna", "Ben", "Cannot be determined"])
    assert scores == [pytest.approx(0.7)] * 3
    stats = judge.last_stats()
    assert (stats["requests"], stats["failed"], stats["answers"]) == (3, 0, {"primary": 3})


def test_concurrent_requests_share_generate_calls(served, monkeypatch):
    batcher = served.batcher
    fill = batcher._fill
    busy, release = threading.Event(), threading.Event()

    def held(jobs, rows):  # the first batch holds the worker, so the next requests queue up
        if not release.is_set():
            busy.set()
            release.wait(20)
        fill(jobs, rows)

    monkeypatch.setattr(batcher, "_fill", held)
    before = (batcher.batches, batcher.generate_calls)
    results: list[tuple[int, dict]] = []

    def send(body):
        results.append(post(served, body))

    blocker = threading.Thread(target=send, args=({"messages": [{"role": "user", "content": "x"}]},))
    blocker.start()
    assert busy.wait(20)
    bodies = [{"messages": [{"role": "user", "content": f"q{i}"}], "temperature": 0}
              for i in range(6)] + [{"messages": [{"role": "user", "content": "q"}], "top_p": 0.5}]
    threads = [threading.Thread(target=send, args=(b,)) for b in bodies]
    for t in threads:
        t.start()
    for _ in range(6000):  # bounded wait (<= 60 s: a loaded machine) for all 7 to be queued
        if batcher.queue.qsize() == len(bodies):
            break
        release.wait(0.01)
    queued = batcher.queue.qsize()
    release.set()
    assert queued == len(bodies)  # else the batches below are not the ones this test counts
    for t in [blocker, *threads]:
        t.join(timeout=30)
    assert len(results) == 8 and {status for status, _ in results} == {200}
    for _ in range(500):  # a request is answered when it stops, before its batch is counted
        if batcher.batches - before[0] >= 3:
            break
        time.sleep(0.01)
    batches, calls = batcher.batches - before[0], batcher.generate_calls - before[1]
    # The blocker alone, then 4 (max_batch) drained at once, then the other 3; the sampled
    # request (top_p 0.5) has its own settings, so its batch makes two generate calls. (On
    # this test's machines the sampled one was now and then drained alone, after the other
    # two: 4 batches of one call each. Either way 4 calls serve 8 requests.)
    assert calls == 4 and batcher.largest_batch == 4 and batches in (3, 4)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools",
     "'tools' is not supported"),
    ({"messages": []}, "messages", "messages: List should have at least 1 item"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role",
     "messages[0].role: Input should be 'system', 'developer', 'user' or 'assistant'"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": 3}, "temperature",
     "temperature: Input should be less than or equal to 2 (got 3)"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1.5}, "max_tokens",
     "max_tokens: Input should be a valid integer"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a"] * 5}, "stop",
     "at most 4 stop strings"),
    ({"prompt": "hi"}, "messages", "messages: Field required"),
    (b"{not json", None, "not valid JSON"),
    (b"[1, 2]", None, "must be a JSON object"),
])
def test_bad_requests_get_openai_style_errors(served, body, param, message):
    code, payload = post(served, body)
    assert code == 400 and message in payload["error"]["message"]
    assert (payload["error"]["type"], payload["error"]["param"]) == ("invalid_request_error", param)


def test_a_prompt_longer_than_the_context_is_400_context_length_exceeded(served):
    with pytest.raises(openai.BadRequestError) as caught:
        client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "word " * 600}], stream=True)
    error = caught.value.body
    assert caught.value.status_code == 400 and error["code"] == "context_length_exceeded"
    assert "fit the model's context (512)" in error["message"] and error["param"] == "messages"


def test_a_body_over_4_mib_is_413_before_it_is_parsed(served):
    code, payload = post(served, b'{"messages": "' + b"x" * (4 << 20) + b'"}')
    assert code == 413 and payload["error"]["code"] == "request_too_large"
    assert payload["error"]["message"] == "the body is over 4194304 bytes"


def test_unknown_routes_are_404_in_openai_style(served):
    code, payload = post_json(served.url + "/embeddings", {"input": "x"})
    assert code == 404 and "no route POST /v1/embeddings" in payload["error"]["message"]
    assert payload["error"]["type"] == "not_found_error"


def test_health_and_models_with_and_without_the_v1_prefix(served):
    root = served.url.removesuffix("/v1")
    for url in (f"{root}/health", f"{root}/v1/health"):
        with urllib.request.urlopen(url, timeout=10) as answer:
            assert json.loads(answer.read()) == {"status": "ok"}
    with urllib.request.urlopen(f"{root}/models", timeout=10) as answer:
        assert [m["id"] for m in json.loads(answer.read())["data"]] == ["model"]


def test_openai_client_sees_a_bad_request_error(served):
    with pytest.raises(openai.BadRequestError, match=r"n: Input should be less than or equal to 16 \(got 99\)"):
        client(served).chat.completions.create(
            model="m", n=99, messages=[{"role": "user", "content": "hi"}])


def test_run_directory_resolves_to_its_final_model(tmp_path, seven):
    run = tmp_path / "run"
    (run / "final" / "merged").mkdir(parents=True)
    (run / "final" / "merged" / "config.json").write_text("{}")
    assert resolve_model_dir(str(run)) == str(run / "final" / "merged")
    assert resolve_model_dir(str(seven)) == str(seven)
    (run / "final" / "adapter").mkdir()
    (run / "final" / "adapter" / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelError, match="holds a LoRA adapter, not a model; use the merged"):
        resolve_model_dir(str(run / "final" / "adapter"))
    (run / "final" / "merged" / "config.json").unlink()  # output.save_merged: false
    with pytest.raises(ModelError, match=r"saved only its LoRA adapter .*save_merged was false"):
        resolve_model_dir(str(run))


def test_cli_arguments():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["serve", "runs/x/final/merged", "--port", "0", "--max-batch", "2"])
    assert (args.command, args.model_path, args.host, args.port, args.max_batch,
            args.max_new_tokens) == ("serve", "runs/x/final/merged", "127.0.0.1", 0, 2, 256)


def test_close_stops_serving(seven):
    server, thread = start_server(str(seven), port=0, max_new_tokens=4)
    url = server.url
    assert post(server, {"messages": [{"role": "user", "content": "hi"}]})[0] == 200
    server.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and not server.batcher.thread.is_alive()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/models", timeout=2)


def test_requests_decode_on_one_build_of_the_weights_until_the_server_stops(seven, monkeypatch):
    from mogrpo.rollout import projections

    built = []
    build = projections._build_projections
    monkeypatch.setattr(projections, "_build_projections", lambda *a: built.append(1) or build(*a))
    server, thread = start_server(str(seven), port=0, max_new_tokens=4)
    model = projections.unwrap_causal_lm(server.batcher.model)
    for content in ("hi", "again", "and again"):
        status, body = post(server, {"messages": [{"role": "user", "content": content}],
                                     "temperature": 0})
        assert status == 200 and body["choices"][0]["message"]["content"] == "7"
    assert len(built) == 1 and model in projections._HELD  # fused and packed once for all three
    server.close()
    thread.join(timeout=10)
    assert not server.batcher.thread.is_alive() and model not in projections._HELD


def test_on_a_cpu_requests_reuse_freed_memory_as_training_steps_do(seven, monkeypatch):
    import mogrpo.serve.server as serve_server

    calls = []
    monkeypatch.setattr(serve_server, "apply_host_memory", lambda *a: calls.append(a))
    server, thread = start_server(str(seven), port=0, max_new_tokens=4)
    server.close()
    thread.join(timeout=10)
    assert calls == [("auto", "cpu")]  # train.host_memory's default, for this device

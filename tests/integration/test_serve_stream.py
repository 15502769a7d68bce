"""`mogrpo serve` streaming, concurrency and /v1/completions, through the official openai client.

The echo model is a tiny random model with tied embeddings: greedy, it repeats the last token of
its prompt, so each request's answer is known and distinct ("the über" -> "über über ...",
"the fox" -> "xx...", "the naïve" -> the bytes of "ve" and half of "ï", over and over).
"""

from __future__ import annotations

import sys
import threading

import pytest

from judge_server import build_seven_model
from mogrpo.cli import main
from mogrpo.modeling.tiny import build_tiny_model
from mogrpo.serve.server import start_server

openai = pytest.importorskip("openai")

WORDS = ["fox", "café", "naïve", "über", "jumps", "dog", "lazy", "quick"]  # 8 last tokens


@pytest.fixture(scope="module")
def echo(tmp_path_factory):
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café über straße"] * 10
    path = build_tiny_model(tmp_path_factory.mktemp("echo") / "model", corpus, vocab_size=300,
                            hidden_size=32, num_layers=1, num_heads=2)
    server, thread = start_server(str(path), port=0, max_batch=8, max_new_tokens=12,
                                  model_name="echo")
    yield server
    server.close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def seven(tmp_path_factory):
    path = build_seven_model(tmp_path_factory.mktemp("seven") / "model")
    server, thread = start_server(str(path), port=0, max_new_tokens=8)
    yield server
    server.close()
    thread.join(timeout=10)


def client(server):
    return openai.OpenAI(base_url=server.url, api_key="x", max_retries=0, timeout=30)


def complete(server, word: str, stream: bool, **options) -> tuple[str, str, int]:
    """(text, finish_reason, number of chunks with text) of a greedy completion of `word`."""
    kwargs = dict(model="echo", prompt=f"the {word}", temperature=0, max_tokens=6, **options)
    if not stream:
        choice = client(server).completions.create(**kwargs).choices[0]
        return choice.text, choice.finish_reason, 1
    chunks = list(client(server).completions.create(stream=True, **kwargs))
    texts = [c.choices[0].text for c in chunks]
    assert all(c.object == "text_completion" for c in chunks) and len({c.id for c in chunks}) == 1
    return "".join(texts), chunks[-1].choices[0].finish_reason, sum(bool(t) for t in texts)


def test_chat_stream_in_the_openai_chunk_format(seven):
    chunks = list(client(seven).chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Who was late?"}], temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "7"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2  # "7" + end
    assert {c.object for c in chunks} == {"chat.completion.chunk"}


def test_a_streamed_completion_is_the_plain_one_sent_token_by_token(echo):
    text, finish, pieces = complete(echo, "über", stream=True)
    assert (text, finish) == complete(echo, "über", stream=False)[:2]
    assert text == " ".join(["über"] * 6) and finish == "length" and pieces >= 1
    text, finish, _ = complete(echo, "über", stream=True, stop=["r üb"])
    assert (text, finish) == ("übe", "stop") == complete(echo, "über", stream=False,
                                                         stop=["r üb"])[:2]
    # a token holding half a character: what is streamed is still the plain completion
    assert complete(echo, "naïve", stream=True)[:2] == complete(echo, "naïve", stream=False)[:2]


def test_the_first_words_arrive_while_the_rest_is_still_being_decoded(echo, monkeypatch):
    import mogrpo.serve.batcher as batcher

    first_chunk, waited = threading.Event(), []

    class Paused(batcher.TextStream):  # the decode stops at its 3rd token until a chunk came
        def push(self, token):
            if len(self.ids) == 2:
                waited.append(first_chunk.wait(20))
            return super().push(token)

    monkeypatch.setattr(batcher, "TextStream", Paused)
    chunks = client(echo).completions.create(model="echo", prompt="the über", temperature=0,
                                             max_tokens=6, stream=True)
    texts = []
    for chunk in chunks:
        texts.append(chunk.choices[0].text)
        if texts[-1]:
            first_chunk.set()
    assert waited == [True] and texts[0] == "über"  # sent before the 3rd token was decoded
    assert "".join(texts) == " ".join(["über"] * 6)


def test_several_prompts_and_n_number_their_choices(echo):
    reply = client(echo).completions.create(model="echo", prompt=["the fox", "the dog"], n=2,
                                            temperature=0, max_tokens=2)
    assert [(c.index, c.text) for c in reply.choices] == [
        (0, "xx"), (1, "xx"), (2, "gg"), (3, "gg")]
    assert reply.usage.completion_tokens == 8
    chunks = client(echo).completions.create(model="echo", prompt=["the fox", "the dog"],
                                             temperature=0, max_tokens=2, stream=True)
    texts: dict[int, str] = {}
    for chunk in chunks:
        texts[chunk.choices[0].index] = texts.get(chunk.choices[0].index, "") + chunk.choices[0].text
    assert texts == {0: "xx", 1: "gg"}


def test_concurrent_requests_share_a_batch_and_keep_their_own_text(echo):
    alone = {word: complete(echo, word, stream=False)[0] for word in WORDS}
    assert len(set(alone.values())) == len(WORDS)
    batches = echo.batcher.batches
    results: dict[tuple[str, bool], str] = {}
    barrier = threading.Barrier(2 * len(WORDS))

    def send(word: str, stream: bool) -> None:
        barrier.wait(10)
        results[word, stream] = complete(echo, word, stream)[0]

    threads = [threading.Thread(target=send, args=(w, s)) for w in WORDS for s in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results == {(w, s): alone[w] for w in WORDS for s in (False, True)}
    # 16 requests in fewer generate batches than requests: they were batched
    assert echo.batcher.batches - batches < 2 * len(WORDS) and echo.batcher.largest_batch > 1


def test_unknown_model_is_404_when_the_server_was_given_a_name(echo):
    with pytest.raises(openai.NotFoundError) as caught:
        client(echo).completions.create(model="gpt-4o", prompt="the fox", max_tokens=1)
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"


def test_bad_requests_through_the_client_before_any_stream(echo):
    with pytest.raises(openai.BadRequestError, match=r"'echo' is not supported"):
        client(echo).completions.create(model="echo", prompt="x", echo=True, stream=True)
    with pytest.raises(openai.BadRequestError, match="at most 500 fit") as caught:
        client(echo).completions.create(model="echo", prompt="the fox " * 400, stream=True)
    assert (caught.value.code, caught.value.param) == ("context_length_exceeded", "prompt")


def test_serve_without_the_extra_says_what_to_install(monkeypatch, capsys):
    import mogrpo.serve as serve

    monkeypatch.setattr(serve, "find_spec", lambda name: None if name == "uvicorn" else True)
    monkeypatch.setitem(sys.modules, "mogrpo.serve.server", None)  # an import would fail loudly
    assert main(["serve", "some/model"]) == 2
    err = capsys.readouterr().err
    assert err == ("error: mogrpo serve needs uvicorn, which is not installed: "
                   "pip install 'mogrpo[serve]'\n")

"""A fault-injecting OpenAI-compatible chat-completions server for judge tests and benchmarks.

Binds 127.0.0.1 on an ephemeral port. Each request gets one scripted behaviour: the next one
queued for a substring of its last message (`by_content`), else the next of `script`, else
`default` (a behaviour or a function of the message text; by default the reply "7"). The server counts calls and the
most requests it held in flight at once (from arrival until it starts answering), and records
every request's body and headers (an `http.client.HTTPMessage`: names case-insensitive). With `overlap=k`, each request waits (up to 10 s) until k
requests have been in flight at once before its delay starts, so a test of concurrency does not
depend on how fast a loaded machine starts the client's threads. With `keep_alive=True` it
speaks HTTP/1.1 with persistent connections and TCP_NODELAY, as production servers do (by
default HTTP/1.0: one connection per request).

    with FaultServer(script=[status(500)], default=reply("7")) as server:
        ...  # point a judge at server.url
        assert server.calls == 2
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Behaviour:
    """What the server does with one request, after waiting `delay` seconds."""

    kind: str  # "reply", "status", "malformed", "drop", "echo_auth"
    text: str | None = ""  # None: a reply whose message content is null
    status: int = 200
    retry_after: str | None = None
    delay: float = 0.0
    tokens: int = 10


def reply(text: str | None, delay: float = 0.0, tokens: int = 10) -> Behaviour:
    """A valid chat completion whose message content is `text` (None: null, as a reasoning
    model cut off by max_tokens sends)."""
    return Behaviour("reply", text=text, delay=delay, tokens=tokens)


def status(code: int, retry_after: str | None = None, delay: float = 0.0) -> Behaviour:
    """An HTTP error (500, 429 with a Retry-After header, 401, ...)."""
    return Behaviour("status", status=code, retry_after=retry_after, delay=delay)


def malformed() -> Behaviour:
    """HTTP 200 with a body that is not JSON."""
    return Behaviour("malformed")


def drop(delay: float = 0.0) -> Behaviour:
    """Close the connection without sending any response."""
    return Behaviour("drop", delay=delay)


def echo_auth(code: int = 401) -> Behaviour:
    """HTTP 401 whose body echoes the Authorization header (as careless servers do); with
    code 200, a chat completion whose message echoes it (a debugging proxy, say)."""
    return Behaviour("echo_auth", status=code)


Default = Behaviour | Callable[[str], Behaviour]


class _Server(ThreadingHTTPServer):
    # The default listen backlog (5) drops connections when many workers connect at once;
    # the client then waits a SYN retransmit (1 s), which would be the server's cost, not the judge's.
    request_queue_size = 128
SEVEN = reply("7")


class FaultServer:
    """The server, its scripted behaviours and its counters; use as a context manager."""

    def __init__(self, *, script: list[Behaviour] | None = None,
                 by_content: dict[str, list[Behaviour]] | None = None,
                 default: Default = SEVEN, overlap: int = 0, keep_alive: bool = False) -> None:
        self.script: deque[Behaviour] = deque(script or [])
        self.by_content = {k: deque(v) for k, v in (by_content or {}).items()}
        self.default = default
        self.calls = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.overlap = overlap
        self.keep_alive = keep_alive
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.overlapped = threading.Condition(self.lock)  # notified when max_in_flight grows
        self.stopping = threading.Event()
        self.httpd: ThreadingHTTPServer | None = None
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """Base URL to give a judge provider (`.../v1`)."""
        assert self.httpd is not None, "start() the server first"
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def start(self) -> FaultServer:
        self.httpd = _Server(("127.0.0.1", 0), _handler(self))
        self.httpd.daemon_threads = True
        self.httpd.block_on_close = False  # stop() must not wait for delayed handlers
        self.thread = threading.Thread(target=self.httpd.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()  # delayed handlers wake up at once
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()
        if self.thread is not None:
            self.thread.join(timeout=5)

    def __enter__(self) -> FaultServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def reset_counters(self) -> None:
        with self.lock:
            self.calls = self.max_in_flight = 0
            self.requests.clear()

    def wait_for_overlap(self) -> None:
        """Hold a request until `overlap` requests have been in flight at once (10 s at most)."""
        with self.overlapped:
            self.overlapped.wait_for(
                lambda: self.max_in_flight >= self.overlap or self.stopping.is_set(), timeout=10)

    def choose(self, content: str) -> Behaviour:
        with self.lock:
            for needle, queue in self.by_content.items():
                if needle in content and queue:
                    return queue.popleft()
            if self.script:
                return self.script.popleft()
        return self.default(content) if callable(self.default) else self.default


def _handler(server: FaultServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        if server.keep_alive:  # as production servers answer: HTTP/1.1 keep-alive, no Nagle delay
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

        def log_message(self, format: str, *args: Any) -> None:  # keep test output quiet
            pass

        def do_GET(self) -> None:
            if self.path.rstrip("/").endswith("/models"):
                self._send(200, json.dumps({"object": "list", "data": [{"id": "fault"}]}).encode())
            else:
                self._send(404, b'{"error": {"message": "not found"}}')

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                data = json.loads(body)
                content = str(data["messages"][-1]["content"])
            except (ValueError, KeyError, IndexError, TypeError):
                data, content = None, ""
            with server.lock:
                server.calls += 1
                server.in_flight += 1
                server.max_in_flight = max(server.max_in_flight, server.in_flight)
                # The message itself, not a dict: header names are case-insensitive (httpx sends
                # them in lower case), and so is its .get().
                server.requests.append({"body": data, "headers": self.headers})
                server.overlapped.notify_all()
            try:
                behaviour = server.choose(content)
                server.wait_for_overlap()
                if behaviour.delay:
                    server.stopping.wait(behaviour.delay)
            finally:
                # No longer in flight once answering starts: the client may send its next
                # request as soon as it reads this answer, possibly before this thread runs again.
                with server.lock:
                    server.in_flight -= 1
            try:
                self._act(behaviour, data or {})
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (its timeout): nothing left to answer

        def _act(self, behaviour: Behaviour, data: dict[str, Any]) -> None:
            if behaviour.kind == "drop":
                self.close_connection = True
                return
            if behaviour.kind == "malformed":
                self._send(200, b'{"choices": [{"message": {"content": "5"')
            elif behaviour.kind == "echo_auth" and behaviour.status == 200:
                echoed = reply(f"you sent {self.headers.get('Authorization')}")
                self._send(200, json.dumps(_completion(data, echoed)).encode())
            elif behaviour.kind == "echo_auth":
                echoed = f"Incorrect API key provided: {self.headers.get('Authorization')}"
                self._send(401, json.dumps({"error": {"message": echoed}}).encode())
            elif behaviour.kind == "status":
                headers = {"Retry-After": behaviour.retry_after} if behaviour.retry_after else {}
                message = json.dumps({"error": {"message": f"scripted {behaviour.status}"}})
                self._send(behaviour.status, message.encode(), headers)
            else:
                self._send(200, json.dumps(_completion(data, behaviour)).encode())

        def _send(self, code: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(payload)

    return Handler


def _completion(request: dict[str, Any], behaviour: Behaviour) -> dict[str, Any]:
    return {
        "id": "chatcmpl-fault",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.get("model", "fault"),
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": behaviour.text}}],
        "usage": {"prompt_tokens": behaviour.tokens - 1, "completion_tokens": 1,
                  "total_tokens": behaviour.tokens},
    }


def judge_options(*urls: str, names: tuple[str, ...] = ("primary", "backup", "third"),
                  **overrides: Any) -> dict[str, Any]:
    """Judge reward options for providers at `urls` (named primary, backup, ...): a 0-10 number
    parser, 2 s timeout, one retry with a 10 ms backoff; `overrides` replace any option."""
    options: dict[str, Any] = {
        "providers": [{"name": name, "base_url": url, "model": "judge-model"}
                      for name, url in zip(names, urls, strict=False)],
        "template": "Question: {prompt}\nAnswer: {completion}\nScore 0-10:",
        "parser": {"kind": "number", "min": 0, "max": 10},
        "timeout": 2.0,
        "retries": 1,
        "backoff": 0.01,
    }
    options.update(overrides)
    return options


def build_seven_model(out: Path) -> Path:
    """A tiny model that answers "7" (then ends its turn) to any prompt: a judge reading it
    gets 7/10."""
    return build_constant_model(out, "7", ["the judge says 7 out of 10", "score 1 2 3 4 5 6 7 8 9"])


def build_constant_model(out: Path, answer: str, corpus: list[str]) -> Path:
    """A tiny model that answers the single token `answer`, then ends its turn, to any prompt.

    Its blocks add nothing (o_proj and down_proj are zero), so the last hidden state is the last
    token's embedding; dimension 0 is always on and dimension 1 only after `answer`, and the
    head maps (on, off) to `answer` and (on, on) to the end-of-turn token.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mogrpo.modeling.tiny import EOT, build_tiny_model

    path = build_tiny_model(out, corpus, seed=0, hidden_size=32, num_layers=1, num_heads=2,
                            vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    token, eot = tokenizer.convert_tokens_to_ids([answer, EOT])
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embedding = model.get_input_embeddings().weight
        embedding[:, :2] = torch.tensor([1.0, 0.0])
        embedding[token, 1] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[:2] = 1.0
        head = torch.zeros_like(embedding)
        head[token, :2] = torch.tensor([10.0, -20.0])
        head[eot, :2] = torch.tensor([5.0, 20.0])
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(path)
    return path

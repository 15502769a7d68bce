"""`mogrpo serve`: a local model behind the OpenAI chat-completions API.

So a local model can be the judge of a run (`base_url: http://127.0.0.1:8000/v1`) and a trained
policy can be tried with any OpenAI client. Requests are answered by one worker thread that
drains a queue: whatever arrived together (up to `max_batch`) is generated in one
`generate_rollout` call per group of identical sampling settings. Binds loopback by default;
there is no authentication, so expose it on another interface only on a trusted network.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch

from mogrpo.errors import ConfigError, MogrpoError
from mogrpo.kernels import apply_host_memory
from mogrpo.modeling.chat import has_chat_template, render_prompt
from mogrpo.modeling.load import load_policy, resolve_model_dir
from mogrpo.rollout.generate import SamplingSettings, generate_rollout
from mogrpo.rollout.projections import held_projections
from mogrpo.serve.api import RequestError, completion_response, make_handler, parse_request

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600.0
"""A request still unanswered after this long gets HTTP 504 (the worker is stuck or swamped)."""


@dataclass
class Job:
    """One chat-completions request waiting for the worker."""

    text: str
    add_special_tokens: bool
    settings: SamplingSettings
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)
    choices: list[tuple[str, str, int]] = field(default_factory=list)  # (text, finish, tokens)
    prompt_tokens: int = 0
    error: RequestError | None = None

    def group(self) -> str:
        """Requests with equal keys can share one generate() call."""
        return json.dumps([dataclasses.asdict(self.settings), self.n, self.seed,
                           self.add_special_tokens])


class Batcher:
    """The worker thread: drains the queue, groups requests by settings, generates per group."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_batch: int) -> None:
        self.model, self.tokenizer, self.max_batch = model, tokenizer, max_batch
        config = getattr(model, "config", None)
        self.context = getattr(config, "max_position_embeddings", None) if config else None
        self.queue: queue.Queue[Job] = queue.Queue()
        self.batches = self.generate_calls = self.largest_batch = 0  # for logs and tests
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mogrpo-serve-batcher", daemon=True)
        self.thread.start()

    def submit(self, job: Job, timeout: float = REQUEST_TIMEOUT_S) -> Job:
        if self._stop.is_set():
            raise RequestError(503, "the server is shutting down")
        self.queue.put(job)
        deadline = time.monotonic() + timeout
        while not job.done.wait(0.5):
            if not self.thread.is_alive():  # stopped after this job was queued
                raise RequestError(503, "the server is shutting down")
            if time.monotonic() > deadline:
                raise RequestError(504, f"no completion within {timeout:g}s; the server is overloaded")
        if job.error is not None:
            raise job.error
        return job

    def _run(self) -> None:
        # the weights never change while serving: fused and packed once for every request
        with held_projections(self.model):
            self._serve()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                jobs = [self.queue.get(timeout=0.1)]
            except queue.Empty:
                continue
            while len(jobs) < self.max_batch:
                try:
                    jobs.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            groups: dict[str, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.group(), []).append(job)
            for group in groups.values():
                self._generate(group)
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(jobs))
        self._fail_pending()

    def _generate(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        try:
            jobs = self._admit(jobs)
            if jobs:
                self._fill(jobs)
        except Exception as err:  # a failed batch answers 500 instead of killing the worker
            logger.exception("generation failed for a batch of %d requests", len(jobs))
            for job in jobs:
                job.error = RequestError(500, f"generation failed: {type(err).__name__}: {err}")
        finally:
            for job in jobs:
                job.done.set()
        logger.debug("generated %d requests in %.2fs", len(jobs), time.perf_counter() - start)

    def _admit(self, jobs: list[Job]) -> list[Job]:
        """Refuse prompts that do not fit the context (generate_rollout would cut them silently)."""
        settings = jobs[0].settings
        limit = (self.context or 10**9) - settings.max_new_tokens
        ids = self.tokenizer([j.text for j in jobs], add_special_tokens=jobs[0].add_special_tokens,
                             verbose=False)["input_ids"]
        admitted = []
        for job, prompt in zip(jobs, ids, strict=True):
            if not prompt:
                job.error = RequestError(400, "the rendered prompt is empty", "messages")
                job.done.set()
            elif len(prompt) > limit:
                job.error = RequestError(
                    400, f"the prompt has {len(prompt)} tokens; with max_tokens "
                    f"{settings.max_new_tokens} at most {max(limit, 0)} fit the model's context "
                    f"({self.context})", "messages")
                job.done.set()
            else:
                job.prompt_tokens = len(prompt)
                admitted.append(job)
        return admitted

    def _fill(self, jobs: list[Job]) -> None:
        first = jobs[0]
        self.generate_calls += 1
        rollout = generate_rollout(
            self.model, self.tokenizer, [j.text for j in jobs], first.settings,
            num_generations=first.n,
            max_prompt_length=max(j.prompt_tokens for j in jobs),
            add_special_tokens=first.add_special_tokens,
            generator_seed=first.seed,
        )
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        for i, job in enumerate(jobs):
            for row in range(i * first.n, (i + 1) * first.n):
                text, finish = _apply_stop(rollout.texts[row], job.stop,
                                           "length" if truncated[row] else "stop")
                job.choices.append((text, finish, int(lengths[row])))

    def _fail_pending(self) -> None:
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                return
            job.error = RequestError(503, "the server is shutting down")
            job.done.set()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)


def _apply_stop(text: str, stops: list[str], finish: str) -> tuple[str, str]:
    """Cut at the earliest stop string (applied after generation: they are not token ids)."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], "stop") if cuts else (text, finish)


class ChatServer(ThreadingHTTPServer):
    """The HTTP server; `close()` stops it and its batcher."""

    daemon_threads = True
    # close() must not wait for idle keep-alive connections (they time out after 30 s).
    block_on_close = False
    # A listen backlog of 5 (the default) drops bursts of connections, costing clients a 1 s
    # SYN retransmit each.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], batcher: Batcher, *, model_name: str,
                 max_new_tokens: int) -> None:
        self.batcher, self.model_name, self.max_new_tokens = batcher, model_name, max_new_tokens
        self.created = int(time.time())
        super().__init__(address, make_handler(self))

    def complete(self, request: dict[str, Any]) -> dict[str, Any]:
        """Answer one chat-completions request body (blocks until its batch is generated)."""
        messages, sampling = parse_request(request, max_new_tokens=self.max_new_tokens)
        tokenizer = self.batcher.tokenizer
        prompt: str | list[dict[str, str]] = messages
        if not has_chat_template(tokenizer) and all(m["role"] != "assistant" for m in messages):
            # A base model has no chat template: send system and user text as plain text.
            prompt = "\n\n".join(m["content"] for m in messages)
        try:
            text, add_special = render_prompt(tokenizer, prompt)
        except MogrpoError as err:
            raise RequestError(400, str(err), "messages") from None
        job = self.batcher.submit(Job(text=text, add_special_tokens=add_special, **sampling))
        return completion_response(self.model_name, job.choices, job.prompt_tokens)

    @property
    def url(self) -> str:
        """Base URL for an OpenAI client, e.g. `http://127.0.0.1:8000/v1`."""
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/v1"

    def close(self) -> None:
        """Stop accepting requests, answer queued ones with 503, and stop the worker."""
        self.shutdown()
        self.server_close()
        self.batcher.stop()


def start_server(
    model_path: str, host: str = "127.0.0.1", port: int = 8000, *, max_batch: int = 8,
    max_new_tokens: int = 256, model_name: str | None = None, dtype: str = "auto",
) -> tuple[ChatServer, threading.Thread]:
    """Load the model and serve it in a background thread; `server.close()` shuts it down.

    `port=0` picks a free port (see `server.url`)."""
    if not 0 <= port <= 65535 or max_batch < 1 or max_new_tokens < 1:
        raise ConfigError(
            f"serve: port {port}, max_batch {max_batch}, max_new_tokens {max_new_tokens}: need "
            "0 <= port <= 65535, max_batch >= 1 and max_new_tokens >= 1")
    directory = resolve_model_dir(model_path)
    gpu = torch.device("cuda") if torch.cuda.is_available() else None  # weights load onto it
    model, tokenizer = load_policy(directory, dtype=dtype, device=gpu)
    # on a CPU, request after request reuses the memory the last one freed (as training steps do)
    apply_host_memory("auto", next(model.parameters()).device.type)
    name = model_name or Path(directory.rstrip("/")).name or directory
    batcher = Batcher(model, tokenizer, max_batch=max_batch)
    try:
        server = ChatServer((host, port), batcher, model_name=name, max_new_tokens=max_new_tokens)
    except OSError as err:
        batcher.stop()
        raise ConfigError(f"serve: cannot listen on {host}:{port} ({err}); pick another --port") from err
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.1},
                              name="mogrpo-serve", daemon=True)
    thread.start()
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without authentication: anyone who can reach it can use "
                       "the model", host)
    return server, thread

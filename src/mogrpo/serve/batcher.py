"""The worker of `mogrpo serve`: one thread that generates every request, batched.

Requests wait in a queue. The worker takes what is there (up to `max_batch`), waiting up to
`batch_wait_s` for as many requests as its last batch had (so concurrent clients, whose
requests arrive a few milliseconds apart, share a batch, and a lone client never waits), and
generates each group of requests with the same sampling settings in one `generate_rollout`.
The decode loop reports every step's tokens (`on_step`): a streamed request gets each new piece
of its text as it is decoded, and a request whose completions have all stopped is answered
then, not when the longest row of its batch ends. Events reach the requests' asyncio queues
with one `call_soon_threadsafe` per step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mogrpo.rollout.generate import SamplingSettings, generate_rollout, resolve_stop_ids
from mogrpo.rollout.projections import held_projections
from mogrpo.serve.api import RequestError
from mogrpo.serve.stream import TextStream, apply_stop

logger = logging.getLogger(__name__)


@dataclass
class Reply:
    """Where the worker sends one HTTP request's events: ("delta", index, text),
    ("done", index, text, finish_reason, tokens) or ("error", RequestError)."""

    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: bool = False  # the client went away: jobs not started yet are skipped


@dataclass
class Job:
    """One prompt of a request: `n` completions, choices `first` .. `first + n - 1`."""

    text: str
    add_special_tokens: bool
    settings: SamplingSettings
    reply: Reply
    n: int = 1
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    first: int = 0
    prompt_tokens: int = 0

    def group(self) -> str:
        """Jobs with equal keys can share one generate() call."""
        return json.dumps([dataclasses.asdict(self.settings), self.n, self.seed,
                           self.add_special_tokens])


@dataclass
class _Row:
    """One completion being generated: its job, its choice index and its tokens so far."""

    job: Job
    index: int
    stream: TextStream | None
    ids: list[int] = field(default_factory=list)
    done: bool = False


class Batcher:
    """The worker thread: drains the queue, groups jobs by settings, generates per group."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_batch: int,
                 batch_wait_s: float = 0.005) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        config = getattr(model, "config", None)
        self.context = getattr(config, "max_position_embeddings", None) if config else None
        self.queue: queue.Queue[Job] = queue.Queue()
        self.batches = self.generate_calls = self.largest_batch = 0  # for logs and tests
        self._last_batch = 1
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mogrpo-serve-batcher", daemon=True)
        self.thread.start()

    def admit(self, text: str, add_special_tokens: bool, settings: SamplingSettings,
              param: str) -> int:
        """The prompt's token count; RequestError 400 if it is empty or does not leave room
        for max_tokens in the model's context (generate_rollout would cut it silently)."""
        ids = self.tokenizer(text, add_special_tokens=add_special_tokens, verbose=False)["input_ids"]
        limit = (self.context or 10**9) - settings.max_new_tokens
        if not ids:
            raise RequestError(400, "the rendered prompt is empty", param)
        if len(ids) > limit:
            raise RequestError(
                400, f"the prompt has {len(ids)} tokens; with max_tokens "
                f"{settings.max_new_tokens} at most {max(limit, 0)} fit the model's context "
                f"({self.context})", param, "context_length_exceeded")
        return len(ids)

    def submit(self, job: Job) -> None:
        if self._stop.is_set() or not self.thread.is_alive():
            raise RequestError(503, "the server is shutting down")
        self.queue.put(job)

    def _run(self) -> None:
        # the weights never change while serving: fused and packed once for every request
        with held_projections(self.model):
            self._serve()

    def _serve(self) -> None:
        while not self._stop.is_set():
            jobs = self._drain()
            if not jobs:
                continue
            groups: dict[str, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.group(), []).append(job)
            for group in groups.values():
                self._generate(group)
            self.batches += 1
            self.largest_batch = max(self.largest_batch, len(jobs))
        self._fail_pending()

    def _drain(self) -> list[Job]:
        """The next batch: what is queued, waiting up to batch_wait_s for as many jobs as the
        last batch had."""
        try:
            jobs = [self.queue.get(timeout=0.1)]
        except queue.Empty:
            return []
        deadline = time.monotonic() + self.batch_wait_s
        while len(jobs) < self.max_batch:
            wait = deadline - time.monotonic() if len(jobs) < self._last_batch else 0
            try:
                jobs.append(self.queue.get(timeout=wait) if wait > 0 else self.queue.get_nowait())
            except queue.Empty:
                break
        self._last_batch = len(jobs)
        return [job for job in jobs if not job.reply.cancelled]

    def _generate(self, jobs: list[Job]) -> None:
        start = time.perf_counter()
        rows = [_Row(job, job.first + k, TextStream(self.tokenizer, job.stop) if job.stream
                     else None) for job in jobs for k in range(job.n)]
        try:
            self._fill(jobs, rows)
        except Exception as err:  # a failed batch answers 500 instead of killing the worker
            logger.exception("generation failed for a batch of %d requests", len(jobs))
            error = RequestError(500, f"generation failed: {type(err).__name__}: {err}")
            _post([(job.reply, ("error", error)) for job in jobs])
        logger.debug("generated %d requests in %.2fs", len(jobs), time.perf_counter() - start)

    def _fill(self, jobs: list[Job], rows: list[_Row]) -> None:
        first = jobs[0]
        stop_ids = set(resolve_stop_ids(self.model, self.tokenizer, first.settings))

        def on_step(live: torch.Tensor, chosen: torch.Tensor) -> None:
            events = []
            for r, token in zip(live.tolist(), chosen.tolist(), strict=True):
                row = rows[r]
                if row.stream is not None:
                    delta = row.stream.push(token)
                    if delta:
                        events.append((row.job.reply, ("delta", row.index, delta)))
                else:
                    row.ids.append(token)
                if token in stop_ids:  # this completion has ended: answer it now
                    ids = row.stream.ids if row.stream is not None else row.ids
                    text = self.tokenizer.decode(ids, skip_special_tokens=True).strip()
                    events.append(self._finish(row, text, "stop", len(ids)))
            _post(events)

        self.generate_calls += 1
        rollout = generate_rollout(
            self.model, self.tokenizer, [j.text for j in jobs], first.settings,
            num_generations=first.n, max_prompt_length=max(j.prompt_tokens for j in jobs),
            add_special_tokens=first.add_special_tokens, generator_seed=first.seed,
            on_step=on_step)
        lengths, truncated = rollout.lengths.tolist(), rollout.truncated.tolist()
        _post([self._finish(row, rollout.texts[r], "length" if truncated[r] else "stop",
                            int(lengths[r]))
               for r, row in enumerate(rows) if not row.done])

    def _finish(self, row: _Row, text: str, finish: str, tokens: int) -> tuple[Reply, tuple]:
        """The "done" event of a row: its text cut at a stop string, with what the stream has
        not sent yet."""
        row.done = True
        text, finish = apply_stop(text, row.job.stop, finish)
        rest = row.stream.finish(text) if row.stream is not None else text
        return row.job.reply, ("done", row.index, rest, finish, tokens)

    def _fail_pending(self) -> None:
        events = []
        while True:
            try:
                job = self.queue.get_nowait()
            except queue.Empty:
                break
            events.append((job.reply, ("error", RequestError(503, "the server is shutting down"))))
        _post(events)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=30)


def _post(events: list[tuple[Reply, tuple]]) -> None:
    """Put events on their replies' queues, from the worker thread: one wake-up per loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Reply, tuple]]] = {}
    for reply, event in events:
        by_loop.setdefault(reply.loop, []).append((reply, event))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:  # the loop has closed: the server is gone, nobody is waiting
            pass


def _deliver(items: list[tuple[Reply, tuple]]) -> None:
    for reply, event in items:
        reply.events.put_nowait(event)

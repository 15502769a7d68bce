"""A private asyncio event loop on a daemon thread, where a judge's requests run concurrently.

The reward contract is synchronous (`judge(prompts, completions) -> scores`), while the HTTP
client is async. The judge submits its requests to its own loop, on its own thread, and the
calling thread waits on `concurrent.futures` futures. Why not `asyncio.run()` once per step:

- it refuses to run in a thread whose loop is already running (a notebook, an async server
  that calls the reward); a loop on another thread works from any caller;
- connections (keep-alive, TLS sessions) belong to the loop that opened them, so a loop per
  step would reconnect to the provider every step; this loop lives as long as the judge.

After a fork (multiprocessing, DataLoader workers) the child inherits a loop that no thread
runs and connections it shares with its parent: `alive` is False there, and the owner starts
a fresh loop (and fresh connections) instead of touching the parent's.
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop running forever on a daemon thread; `submit` schedules a coroutine on it."""

    def __init__(self, name: str, owner: object, clients: dict[str, Any]) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        # A judge dropped without close() must not leave its thread running for good, nor its
        # connections open: `clients` (the owner's, filled later) are closed on this loop first,
        # as their transports belong to it.
        weakref.finalize(owner, _shutdown, self.loop, clients)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def alive(self) -> bool:
        """True in the process that started the loop, while its thread runs."""
        return self.pid == os.getpid() and self._thread.is_alive() and not self.loop.is_closed()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Run `coro` on the loop; its result (or exception) arrives in the returned future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop and wait for its thread (call from any thread but the loop's own)."""
        if not self.alive:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def _shutdown(loop: asyncio.AbstractEventLoop, clients: dict[str, Any]) -> None:
    async def close_all() -> None:
        for client in list(clients.values()):
            try:
                await client.close()
            except Exception:  # closing what nobody uses any more must not raise anywhere
                pass
        clients.clear()
        loop.stop()

    if not loop.is_closed():
        try:
            asyncio.run_coroutine_threadsafe(close_all(), loop)
        except RuntimeError:  # closed in the meantime
            pass

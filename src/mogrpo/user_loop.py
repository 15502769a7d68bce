"""One event loop, on a daemon thread, for the user's async code: tools, reward functions and
environments' `get_reward`.

One loop for all of them, because they share objects bound to it (a reward awaits a task an
environment's tool started); on a thread of its own, so that it works whether or not the
caller runs a loop (a notebook does); made afresh in a forked child, which inherits the loop
but not the thread that runs it. (The LLM judge keeps a loop of its own: `rewards/judge/loop.py`.)
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Sequence
from typing import Any

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_pid: int | None = None


def user_loop() -> asyncio.AbstractEventLoop:
    """The running loop for the user's coroutines (`asyncio.run_coroutine_threadsafe`)."""
    global _loop, _pid
    with _lock:
        if _loop is None or _loop.is_closed() or _pid != os.getpid():
            _loop, _pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="mogrpo-user-async",
                             daemon=True).start()
        return _loop


def await_all(awaitables: Sequence[Any]) -> list[Any]:
    """Await `awaitables` together on the user loop, from any thread but its own; their
    results in order (an exception of one is raised here)."""
    async def gather() -> list[Any]:
        return list(await asyncio.gather(*awaitables))

    return asyncio.run_coroutine_threadsafe(gather(), user_loop()).result()

"""`mogrpo serve`: a local model behind the OpenAI API, on Starlette and uvicorn.

So a local model can be the judge of a run (`base_url: http://127.0.0.1:8000/v1`) and a trained
policy can be tried with any OpenAI client, streaming included. The model's weights are loaded
once and held (fused and packed) while serving; one worker thread generates every request
(`serve/batcher.py`), the HTTP routes are `serve/app.py`. Binds loopback by default; there is no
authentication, so expose it on another interface only on a trusted network.

Needs the `serve` extra (`pip install 'mogrpo[serve]'`): starlette and uvicorn.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from pathlib import Path

import torch
import uvicorn

from mogrpo.errors import ConfigError
from mogrpo.kernels import apply_host_memory
from mogrpo.modeling.load import load_policy, resolve_model_dir
from mogrpo.serve.app import ServeOptions, build_app
from mogrpo.serve.batcher import Batcher

__all__ = ["ChatServer", "resolve_model_dir", "start_server"]

logger = logging.getLogger(__name__)


class ChatServer:
    """A running server: its `url`, its `batcher`, and `close()`."""

    def __init__(self, batcher: Batcher, options: ServeOptions, sock: socket.socket) -> None:
        self.batcher, self.options = batcher, options
        self.model_name = options.model_name
        self.server_address = sock.getsockname()[:2]
        # log_config=None: uvicorn leaves the process's logging as mogrpo set it up
        config = uvicorn.Config(build_app(batcher, options), log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=5)
        self.uvicorn = uvicorn.Server(config)
        self._socket = sock

    def serve(self) -> None:
        """Answer requests until `close()` (the body of the server thread)."""
        self.uvicorn.run(sockets=[self._socket])

    @property
    def url(self) -> str:
        """Base URL for an OpenAI client, e.g. `http://127.0.0.1:8000/v1`."""
        host, port = self.server_address
        return f"http://{host}:{port}/v1"

    def close(self) -> None:
        """Answer queued requests with 503 and stop the worker, then stop the HTTP server."""
        self.batcher.stop()
        self.uvicorn.should_exit = True


def start_server(
    model_path: str, host: str = "127.0.0.1", port: int = 8000, *, max_batch: int = 8,
    max_new_tokens: int = 256, model_name: str | None = None, dtype: str = "auto",
    batch_wait_ms: float = 5.0,
) -> tuple[ChatServer, threading.Thread]:
    """Load the model and serve it in a background thread; `server.close()` shuts it down.

    `port=0` picks a free port (see `server.url`). With `model_name` given, a request naming
    another model gets 404; without it, any model id is answered by this model (so a judge
    config written for another provider works unchanged)."""
    if not 0 <= port <= 65535 or max_batch < 1 or max_new_tokens < 1 or batch_wait_ms < 0:
        raise ConfigError(
            f"serve: port {port}, max_batch {max_batch}, max_new_tokens {max_new_tokens}, "
            f"batch_wait_ms {batch_wait_ms}: need 0 <= port <= 65535, max_batch >= 1, "
            "max_new_tokens >= 1 and batch_wait_ms >= 0")
    sock = _listen(host, port)
    try:
        directory = resolve_model_dir(model_path)
        gpu = torch.device("cuda") if torch.cuda.is_available() else None  # weights load onto it
        model, tokenizer = load_policy(directory, dtype=dtype, device=gpu)
    except BaseException:
        sock.close()
        raise
    # on a CPU, request after request reuses the memory the last one freed (as training steps do)
    apply_host_memory("auto", next(model.parameters()).device.type)
    name = model_name or Path(directory.rstrip("/")).name or directory
    options = ServeOptions(name, max_new_tokens, strict_model=model_name is not None,
                           created=int(time.time()))
    batcher = Batcher(model, tokenizer, max_batch=max_batch, batch_wait_s=batch_wait_ms / 1000)
    server = ChatServer(batcher, options, sock)
    thread = threading.Thread(target=server.serve, name="mogrpo-serve", daemon=True)
    thread.start()
    for _ in range(500):  # until it accepts connections (bounded: 10 s)
        if server.uvicorn.started or not thread.is_alive():
            break
        time.sleep(0.02)
    if host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without authentication: anyone who can reach it can use "
                       "the model", host)
    return server, thread


def _listen(host: str, port: int) -> socket.socket:
    """A bound socket (before the model loads, so a taken port is reported in a second)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as err:
        raise ConfigError(f"serve: cannot listen on {host}:{port} ({err}); pick another "
                          "--port") from err
    return sock

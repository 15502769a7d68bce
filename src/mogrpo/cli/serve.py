"""`mogrpo serve MODEL_PATH`: a model behind the OpenAI API (the server is `mogrpo.serve.server`,
imported only when the command runs so `--help` stays fast and works without the extra)."""

from __future__ import annotations

import argparse
from typing import Any

from mogrpo.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `mogrpo serve MODEL_PATH [--host] [--port] [--max-batch] [--max-new-tokens] ...`."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over the OpenAI API (chat and text completions, streaming)",
        description="Serve a Hugging Face model directory (or a run directory: its final model) "
        "at http://HOST:PORT/v1 with POST /v1/chat/completions and /v1/completions (stream: "
        "true sends server-sent events as tokens are decoded), GET /v1/models and GET /health, "
        "for use as a local judge or to try a trained policy with any OpenAI client. Concurrent "
        "requests are batched. Binds 127.0.0.1 by default; the server has no authentication. "
        "Needs `pip install 'mogrpo[serve]'`.")
    parser.add_argument("model_path", metavar="MODEL_PATH", help="model directory, run directory or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 = any free port)")
    parser.add_argument("--max-batch", type=int, default=8, help="requests generated together (default 8)")
    parser.add_argument("--batch-wait-ms", type=float, default=5.0,
                        help="longest wait for more requests to join a batch, once the last batch "
                        "had several (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="cap on max_tokens of any request (default 256)")
    parser.add_argument("--name", default=None,
                        help="model id reported by /v1/models; requests naming another get 404 "
                        "(default: the directory name, and any model id is accepted)")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16 (default auto)")
    parser.set_defaults(handler=cmd_serve)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C); returns the exit code."""
    from mogrpo.serve import missing_extra

    problem = missing_extra()
    if problem is not None:
        raise ConfigError(problem)
    from mogrpo.serve.server import logger, start_server

    server, thread = start_server(
        args.model_path, args.host, args.port, max_batch=args.max_batch,
        max_new_tokens=args.max_new_tokens, model_name=args.name, dtype=args.dtype,
        batch_wait_ms=args.batch_wait_ms)
    logger.info("serving %s at %s (POST /chat/completions and /completions, GET /models; max "
                "batch %d, max new tokens %d); Ctrl-C stops", server.model_name, server.url,
                args.max_batch, args.max_new_tokens)
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
    except KeyboardInterrupt:
        logger.info("stopping the server")
    finally:
        server.close()
        thread.join(timeout=10)
    return 0

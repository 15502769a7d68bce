"""`mogrpo vllm-server MODEL`: vLLM on a GPU of its own, sampling a training run's rollouts
(`rollout.vllm.server_url`; see `mogrpo.rollout.vllm_server`, imported only when the command
runs so `--help` stays fast)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `mogrpo vllm-server MODEL [--host] [--port] [--gpu-memory-utilization] ...`."""
    parser = subparsers.add_parser(
        "vllm-server", help="sample a training run's rollouts with vLLM on a GPU of its own",
        description="Start vLLM on MODEL (the policy's base checkpoint: a directory or hub id) "
        "and answer a trainer whose config sets rollout.engine: vllm and rollout.vllm.server_url: "
        "http://HOST:PORT. The trainer pushes its weights before the first rollout and after "
        "every optimizer step (NCCL from a CUDA policy, else gloo). Pick the GPU with "
        "CUDA_VISIBLE_DEVICES; one GPU per server. Needs `pip install 'mogrpo[vllm]'`. Binds "
        "127.0.0.1 by default. With MOGRPO_VLLM_SERVER_TOKEN set (here and in the trainer's "
        "environment, to the same value) it answers only requests that carry it; without, "
        "anyone who reaches it can load weights into it.")
    parser.add_argument("model", metavar="MODEL", help="model directory or hub id")
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="share of the GPU's memory vLLM takes (default 0.9)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + completion (default: the model's)")
    parser.add_argument("--dtype", default="auto",
                        help="auto, bfloat16, float16 or float32 (default auto: the checkpoint's)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="skip CUDA-graph capture (faster start, slower decoding)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--trust-remote-code", action="store_true",
                        help="allow the checkpoint's own model code")
    parser.add_argument("--timeout", type=float, default=600.0,
                        help="seconds to wait for the trainer's weight group (default 600)")
    parser.set_defaults(handler=cmd_vllm_server)
    return parser


def cmd_vllm_server(args: argparse.Namespace) -> int:
    """Run the server until interrupted (Ctrl-C); returns the exit code."""
    import importlib.util
    import os

    import torch

    from mogrpo.config.engines import VLLM_INSTALL_HINT
    from mogrpo.errors import ConfigError
    from mogrpo.rollout.vllm_engine import import_vllm
    from mogrpo.rollout.vllm_server import (
        TOKEN_ENV,
        RolloutServer,
        is_loopback,
        log,
        start_rollout_server,
    )

    if not 0 <= args.port <= 65535 or not 0 < args.gpu_memory_utilization < 1:
        raise ConfigError(f"vllm-server: --port {args.port} must be in 0..65535 and "
                          f"--gpu-memory-utilization {args.gpu_memory_utilization} in (0, 1)")
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(f"vllm-server needs vLLM: `{VLLM_INSTALL_HINT}` on a machine with a CUDA GPU")
    if not torch.cuda.is_available():
        raise ConfigError("vllm-server needs a CUDA GPU and none is visible "
                          "(torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES)")
    LLM, SamplingParams = import_vllm()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len,
              enforce_eager=args.enforce_eager, seed=args.seed,
              trust_remote_code=args.trust_remote_code, logprobs_mode="processed_logprobs")
    length = getattr(getattr(llm, "llm_engine", None), "model_config", None)
    server = RolloutServer(llm, SamplingParams, model=args.model,
                           max_model_len=getattr(length, "max_model_len", args.max_model_len),
                           timeout_s=args.timeout, token=os.environ.get(TOKEN_ENV))
    http, thread = start_rollout_server(server, args.host, args.port)
    host, port = http.server_address[:2]
    if server.token is not None:
        log.info("requests must carry the token in %s", TOKEN_ENV)
    elif not is_loopback(args.host):
        log.warning("serving on %s without a token: anyone who can reach it can load weights "
                    "into it; set %s here and in the trainer's environment", args.host,
                    TOKEN_ENV)
    log.info("vllm-server for %s at http://%s:%d; set rollout.vllm.server_url to it. Ctrl-C "
             "stops", args.model, host, port)
    try:
        while thread.is_alive():
            thread.join(timeout=0.5)
    except KeyboardInterrupt:
        log.info("stopping the vllm-server")
    finally:
        http.shutdown()
        http.server_close()
    return 0

"""vLLM on a GPU of its own: `mogrpo vllm-server` and the trainer's client for it.

    CUDA_VISIBLE_DEVICES=1 mogrpo vllm-server MODEL --port 8100    # the generation GPU
    CUDA_VISIBLE_DEVICES=0 mogrpo train run.yaml                      # the training GPU
        # run.yaml: rollout.engine: vllm, rollout.vllm.server_url: http://127.0.0.1:8100

The trainer keeps its GPU for the update and the server keeps its own for sampling: nothing
sleeps, and the server's memory share is all weights and KV cache. Requests travel as JSON over
HTTP (prompt token ids in; completion token ids and each sampled token's log-prob out). The
weights travel through a torch.distributed group of the two processes (trainer rank 0, server
rank 1; `weight_backend`: NCCL from a CUDA policy to another GPU, else gloo), set up at the
first push: after every
optimizer step the trainer broadcasts each tensor (checkpoint names, LoRA merged) in buckets of
at most `BUCKET_BYTES`, and the server loads each bucket with vLLM's `load_weights` and resets
its prefix cache after the last. The first rollout pushes too, so a server started from the
base checkpoint samples an SFT'd or resumed policy. One server on one GPU: tensor parallelism
would need the weights inside vLLM's worker processes.

Endpoints (JSON bodies):

    GET  /health          -> {"model", "max_model_len", "gpu" (its UUID)}
    POST /generate        {"prompts": [[id, ...], ...], "n": K, "sampling": {SamplingParams
                          fields but n and seed}, "seeds": [one per prompt] | null}
                          -> {"tokens": [[id, ...], ...] (row i*K + k: completion k of
                          prompt i), "logprobs": [[float, ...], ...] | null}
    POST /weights/group   {"host", "port", "backend"}: join the trainer's weight group
    POST /weights/load    {"tensors": [[name, dtype, shape], ...], "last": bool}: receive
                          those tensors by broadcast, in order, and load them

Where `MOGRPO_VLLM_SERVER_TOKEN` is set in the server's environment, every request must carry
it (`Authorization: Bearer TOKEN`; the trainer sends it from the same variable in its own
environment) or is refused with 401: whoever can load weights into the server decides what
the run trains on. The token is never logged. The weight group's rendezvous (a TCPStore the
trainer hosts for the server to join) has no token of its own: keep both on a trusted network.
"""

from __future__ import annotations

import datetime
import hmac
import ipaddress
import json
import logging
import os
import socket
import threading
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mogrpo.errors import ConfigError
from mogrpo.rollout.native import Decoded
from mogrpo.rollout.vllm_engine import (
    completion_rows,
    decoded_from_rows,
    request_seeds,
    sampling_kwargs,
)
from mogrpo.rollout.weights import checkpoint_weights

if TYPE_CHECKING:
    from mogrpo.config import RunConfig
    from mogrpo.rollout.sampling import SamplingSettings

log = logging.getLogger(__name__)

TOKEN_ENV = "MOGRPO_VLLM_SERVER_TOKEN"  # the shared secret, on both sides; never logged
BUCKET_BYTES = 256 * 2**20  # tensors per /weights/load request: the server holds one bucket
MAX_BODY_BYTES = 64 * 2**20
# the SamplingParams fields a request may set (n and seed come per request)
SAMPLING_FIELDS = frozenset({
    "temperature", "top_k", "top_p", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos",
    "logprobs", "detokenize",
})
_DTYPES = {str(t).removeprefix("torch."): t for t in (
    torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
    torch.uint8, torch.int8, torch.bool)}


class RequestError(Exception):
    """A request the server refuses, with its HTTP status."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def weight_group(store: dist.Store, rank: int, backend: str,
                 timeout: datetime.timedelta) -> dist.ProcessGroup:
    """The two-process group the weights travel through (not torch.distributed's default
    group: the trainer may run under torchrun, and vLLM sets up one of its own)."""
    store = dist.PrefixStore("mogrpo-weights", store)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def weight_backend(device: torch.device, server_gpu: str | None, own_gpu: str | None) -> str:
    """How the weights travel: NCCL from a CUDA policy to a server on another GPU; gloo (through
    host memory) otherwise, including a server on the trainer's own GPU, where NCCL would
    refuse two ranks on one device."""
    if device.type == "cuda" and server_gpu is not None and server_gpu != own_gpu:
        return "nccl"
    return "gloo"


def _gpu_id(device: torch.device | None) -> str | None:
    """The UUID of `device` (None: the current CUDA device), or None without CUDA."""
    if not torch.cuda.is_available() or (device is not None and device.type != "cuda"):
        return None
    return str(torch.cuda.get_device_properties(device or torch.cuda.current_device()).uuid)


def _broadcast(group: dist.ProcessGroup, tensor: Tensor) -> dist.Work:
    options = dist.BroadcastOptions()
    options.rootRank, options.rootTensor = 0, 0
    return group.broadcast([tensor], options)


# ---------------------------------------------------------------------------------- server


class RolloutServer:
    """What `mogrpo vllm-server` answers, over `llm` (vllm.LLM, or anything with its
    `generate`, `apply_model` and `reset_prefix_cache`) and `sampling_params` (the
    vllm.SamplingParams class)."""

    def __init__(self, llm: Any, sampling_params: Callable[..., Any], *, model: str,
                 max_model_len: int | None, timeout_s: float = 600.0,
                 token: str | None = None) -> None:
        self.llm, self.sampling_params = llm, sampling_params
        self.token = token or None  # requests must carry it (see the module docstring)
        self.model, self.max_model_len = model, max_model_len
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.lock = threading.Lock()  # vLLM's LLM runs one call at a time
        self.group: dist.ProcessGroup | None = None
        self.backend = "gloo"
        self._joining: threading.Thread | None = None
        self._join_error: BaseException | None = None

    def health(self) -> dict[str, Any]:
        return {"model": self.model, "max_model_len": self.max_model_len, "gpu": _gpu_id(None)}

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts, n = body.get("prompts"), body.get("n")
        sampling, seeds = body.get("sampling") or {}, body.get("seeds")
        if not isinstance(prompts, list) or not prompts or not all(
                isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompts):
            raise RequestError(400, "'prompts' must be a non-empty list of non-empty lists of "
                                    "token ids")
        if not _is_int(n) or n < 1:
            raise RequestError(400, f"'n' must be an integer >= 1, got {n!r}")
        if not isinstance(sampling, dict) or not set(sampling) <= SAMPLING_FIELDS:
            unknown = sorted(set(sampling) - SAMPLING_FIELDS) if isinstance(sampling, dict) \
                else sampling
            raise RequestError(400, f"'sampling' has fields vllm-server does not take: "
                                    f"{unknown} (it takes {sorted(SAMPLING_FIELDS)})")
        if seeds is not None and (not isinstance(seeds, list) or len(seeds) != len(prompts)
                                  or not all(_is_int(s) for s in seeds)):
            raise RequestError(400, "'seeds' must be null or one integer per prompt")
        try:
            params = self.sampling_params(**sampling, n=n, seed=None) if seeds is None else \
                [self.sampling_params(**sampling, n=n, seed=s) for s in seeds]
        except (TypeError, ValueError) as err:
            raise RequestError(400, f"vLLM refused the sampling settings: {err}") from None
        with self.lock:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        sampling_params=params, use_tqdm=False)
        if len(outputs) != len(prompts):
            raise RuntimeError(f"vLLM answered {len(outputs)} of {len(prompts)} prompts")
        rows, logps = completion_rows(outputs, n, record_logprobs=sampling.get("logprobs")
                                      is not None)
        return {"tokens": rows, "logprobs": logps}

    def join_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """Start joining the trainer's weight group (the trainer joins after this answer)."""
        host, port, backend = body.get("host"), body.get("port"), body.get("backend")
        if not isinstance(host, str) or not _is_int(port) or backend not in ("gloo", "nccl"):
            raise RequestError(400, "'host' (str), 'port' (int) and 'backend' (gloo or nccl) "
                                    "are required")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RequestError(400, "backend nccl needs a CUDA GPU on the server; none is "
                                    "visible")

        def join() -> None:
            try:
                store = dist.TCPStore(host, port, 2, is_master=False, timeout=self.timeout)
                self.group = weight_group(store, 1, backend, self.timeout)
            except Exception as err:  # reported by the next /weights/load
                self._join_error = err

        self.group, self.backend, self._join_error = None, backend, None
        self._joining = threading.Thread(target=join, name="mogrpo-weight-group", daemon=True)
        self._joining.start()
        return {"joining": True}

    def load(self, body: dict[str, Any]) -> dict[str, Any]:
        """Receive the listed tensors (the trainer broadcasts them meanwhile) and load them."""
        tensors = body.get("tensors")
        if not isinstance(tensors, list) or not all(
                isinstance(t, list) and len(t) == 3 and isinstance(t[0], str)
                and t[1] in _DTYPES and isinstance(t[2], list)
                and all(_is_int(d) and d >= 0 for d in t[2]) for t in tensors):
            raise RequestError(400, "'tensors' must list [name, dtype, shape] triples with "
                                    f"dtypes among {sorted(_DTYPES)}")
        if self._joining is None:
            raise RequestError(409, "no weight group yet: POST /weights/group first")
        self._joining.join(self.timeout.total_seconds())
        group = self.group
        if group is None:
            raise RequestError(500, f"joining the trainer's weight group failed: "
                                    f"{self._join_error or 'timed out'}")
        device = torch.device("cuda", torch.cuda.current_device()) \
            if self.backend == "nccl" else torch.device("cpu")
        received = []
        for name, dtype, shape in tensors:
            tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
            _broadcast(group, tensor).wait()
            received.append((name, tensor))
        with self.lock:  # vLLM's load_weights maps checkpoint names onto its fused layers
            self.llm.apply_model(lambda model: model.load_weights(iter(received)))
            if body.get("last"):
                self.llm.reset_prefix_cache()  # its cached KV came from the old weights
        return {"loaded": len(received)}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _handler(server: RolloutServer) -> type[BaseHTTPRequestHandler]:
    routes = {"/generate": server.generate, "/weights/group": server.join_group,
              "/weights/load": server.load}

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("%s %s", self.address_string(), format % args)

        def _refused(self) -> bool:
            """Answer 401 where the server wants a token and the request lacks it."""
            if server.token is None:
                return False
            sent = self.headers.get("Authorization") or ""
            if hmac.compare_digest(sent.encode(), f"Bearer {server.token}".encode()):
                return False
            self.close_connection = True  # a body, if any, is left unread
            self._send(401, {"error": f"this vllm-server wants the token it was started with: "
                                      f"set {TOKEN_ENV} in the trainer's environment to it"})
            return True

        def do_GET(self) -> None:
            if self._refused():
                return
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                self._send(200, server.health())
            else:
                self._send(404, {"error": f"no route GET {path}; GET /health"})

        def do_POST(self) -> None:
            if self._refused():
                return
            path = self.path.split("?", 1)[0].rstrip("/")
            self.close_connection = True  # until the body is read
            try:
                if path not in routes:
                    raise RequestError(404, f"no route POST {path}; POST {sorted(routes)}")
                size = int(self.headers.get("Content-Length") or 0)
                if not 0 < size <= MAX_BODY_BYTES:
                    raise RequestError(413 if size else 400,
                                       f"the body must hold 1 to {MAX_BODY_BYTES} bytes")
                try:
                    body = json.loads(self.rfile.read(size))
                    self.close_connection = False
                except ValueError:
                    raise RequestError(400, "the body is not valid JSON") from None
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                self._send(200, routes[path](body))
            except RequestError as err:
                self._send(err.status, {"error": str(err)})
            except Exception as err:  # the server keeps serving; the trainer sees the reason
                log.exception("POST %s failed", path)
                self._send(500, {"error": f"{type(err).__name__}: {err}"})

        def _send(self, status: int, payload: dict[str, Any]) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False


def start_rollout_server(server: RolloutServer, host: str = "127.0.0.1", port: int = 8100
                         ) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Serve `server` over HTTP in a background thread (`port=0`: any free port); stop it
    with `.shutdown()` and `.server_close()`."""
    try:
        http = _HTTPServer((host, port), _handler(server))
    except OSError as err:
        raise ConfigError(f"vllm-server: cannot listen on {host}:{port} ({err}); pick another "
                          "--port") from err
    thread = threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.1},
                              name="mogrpo-vllm-server", daemon=True)
    thread.start()
    return http, thread


# ---------------------------------------------------------------------------------- client


class VLLMServerEngine:
    """The trainer's side: rollouts sampled by a `mogrpo vllm-server`, which gets the policy's
    weights before the first rollout and after every optimizer step (`push_weights`).

    With several training processes each asks for its own prompts; process 0 pushes the
    weights (the same in every process after a step) and the others wait for it."""

    def __init__(self, url: str, policy: nn.Module, *, timeout_s: float = 600.0,
                 bucket_bytes: int = BUCKET_BYTES) -> None:
        self.url = url.rstrip("/")
        self.policy = policy
        self.timeout_s = timeout_s
        self.bucket_bytes = bucket_bytes
        self.device = next(policy.parameters()).device
        self.token = os.environ.get(TOKEN_ENV) or None
        self.group: dist.ProcessGroup | None = None
        self._store: dist.Store | None = None
        self.weights_current = False  # the server holds the policy's latest weights
        self.pushes = 0
        self.info = self._call("GET", "/health")
        self.backend = weight_backend(self.device, self.info.get("gpu"), _gpu_id(self.device))
        log.info("rollouts sampled by the vllm-server at %s (model %s)", self.url,
                 self.info.get("model"))

    @classmethod
    def create(cls, policy: nn.Module, config: RunConfig) -> VLLMServerEngine:
        """The client for `rollout.vllm.server_url`; a ConfigError, before any step, when the
        server cannot hold a prompt and its completion."""
        ro = config.rollout
        engine = cls(ro.vllm.server_url, policy, timeout_s=ro.vllm.server_timeout_s)
        limit, needed = engine.info.get("max_model_len"), ro.prompt_length + ro.completion_length
        if isinstance(limit, int) and limit < needed:
            raise ConfigError(
                f"the vllm-server at {engine.url} holds at most {limit} tokens a sequence, but "
                f"rollout.max_prompt_length + max_completion_length = {ro.prompt_length} + "
                f"{ro.completion_length} = {needed}: restart it with --max-model-len {needed} "
                "(if the model allows it) or shorten the rollout")
        return engine

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        headers = {"Content-Type": "application/json"}
        if self.token is not None:
            headers["Authorization"] = f"Bearer {self.token}"
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            try:
                reason = json.loads(err.read()).get("error", "")
            except ValueError:
                reason = ""
            if err.code == 401:  # a setup mistake, not a fault of the run
                raise ConfigError(
                    f"rollout.vllm.server_url = {self.url}: the server refused this trainer "
                    f"({'a wrong' if self.token else 'no'} {TOKEN_ENV}): {reason}") from None
            raise RuntimeError(f"vllm-server {method} {path} answered {err.code}: "
                               f"{reason or err.reason}") from None
        except (urllib.error.URLError, OSError) as err:
            raise ConfigError(
                f"rollout.vllm.server_url = {self.url}: no vllm-server answers there "
                f"({getattr(err, 'reason', err)}). Start one on the generation GPU with "
                "`mogrpo vllm-server MODEL --port PORT`, or unset server_url to run vLLM "
                "colocated") from None

    def decode(self, prompts: list[list[int]], settings: SamplingSettings, *,
               num_generations: int, stop_ids: list[int], pad_id: int, seed: int | None = None,
               record_logprobs: bool = False) -> Decoded:
        """K completions for each prompt (token ids, unpadded): rows `i * K + k`."""
        if not self.weights_current:
            self.push_weights()
        sampling = sampling_kwargs(settings, n=num_generations, stop_ids=stop_ids, seed=None,
                                   logprobs=record_logprobs)
        del sampling["n"], sampling["seed"]
        reply = self._call("POST", "/generate", {
            "prompts": [list(map(int, p)) for p in prompts], "n": num_generations,
            "sampling": sampling, "seeds": request_seeds(seed, len(prompts), num_generations)})
        rows, logps = reply.get("tokens"), reply.get("logprobs")
        if not isinstance(rows, list) or len(rows) != len(prompts) * num_generations \
                or (record_logprobs and (not isinstance(logps, list) or len(logps) != len(rows))):
            raise RuntimeError(f"vllm-server answered {len(rows or [])} completions for "
                               f"{len(prompts)} prompts x {num_generations}")
        return decoded_from_rows(rows, logps if record_logprobs else None, pad_id=pad_id,
                                 device=self.device)

    def push_weights(self) -> int:
        """Send the policy's current weights (LoRA merged); returns how many tensors this
        process sent (0 in processes other than the first)."""
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        count = self._push() if not several or dist.get_rank() == 0 else 0
        if several:
            dist.barrier()  # no process samples before the server holds the new weights
        self.weights_current = True
        self.pushes += 1
        return count

    def _push(self) -> int:
        if self.group is None:
            self._join()
        bucket: list[tuple[str, Tensor]] = []
        size = count = 0
        for name, tensor in checkpoint_weights(self.policy):
            tensor = tensor.detach().contiguous()
            if self.backend == "gloo" and tensor.device.type != "cpu":
                tensor = tensor.cpu()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
            count += 1
            if size >= self.bucket_bytes:
                self._send(bucket, last=False)
                bucket, size = [], 0
        self._send(bucket, last=True)  # (an empty last bucket still resets the prefix cache)
        log.debug("pushed %d weight tensors to the vllm-server", count)
        return count

    def _join(self) -> None:
        """Set up the weight group: this process hosts its store; the server joins it."""
        timeout = datetime.timedelta(seconds=self.timeout_s)
        host = _address_toward(self.url)
        store = dist.TCPStore(host, 0, 2, is_master=True, timeout=timeout,
                              wait_for_workers=False)
        self._call("POST", "/weights/group", {"host": host, "port": store.port,
                                              "backend": self.backend})
        self.group, self._store = weight_group(store, 0, self.backend, timeout), store

    def _send(self, bucket: list[tuple[str, Tensor]], *, last: bool) -> None:
        """One /weights/load request, answered once the server has received and loaded the
        tensors this process broadcasts meanwhile."""
        assert self.group is not None
        meta = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in bucket]
        reply: dict[str, Any] = {}

        def post() -> None:
            try:
                reply["ok"] = self._call("POST", "/weights/load", {"tensors": meta, "last": last})
            except Exception as err:
                reply["error"] = err

        poster = threading.Thread(target=post, name="mogrpo-weight-push", daemon=True)
        poster.start()
        for _, tensor in bucket:
            work = _broadcast(self.group, tensor)
            while not work.is_completed():  # a refused request would leave it waiting
                if "error" in reply:
                    self.group = None  # a broadcast is left pending: set up anew next time
                    raise reply["error"]
                poster.join(0.001)
            work.wait()
        poster.join(self.timeout_s)
        if "error" in reply:
            raise reply["error"]
        if "ok" not in reply:
            raise RuntimeError(f"vllm-server did not confirm the weights within "
                               f"{self.timeout_s:.0f} s")


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) is this machine's loopback: `localhost`,
    127.0.0.0/8 or ::1 (other names are not resolved)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name
        return False


def _address_toward(url: str) -> str:
    """This machine's address as the server at `url` reaches it: loopback for a local
    server, else the interface the route to it leaves by (no packet is sent)."""
    host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
    if is_loopback(host):
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, urllib.parse.urlsplit(url).port or 80))
            return probe.getsockname()[0]
    except OSError as err:  # no route (or an IPv6-only host): say so rather than hang later
        raise ConfigError(f"rollout.vllm.server_url = {url}: no route from this machine to "
                          f"{host} for the weight group ({err})") from None

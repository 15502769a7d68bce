"""Throughput and latency of `mogrpo serve` under 1, 8 and 32 concurrent clients, old and new.

    git worktree add --detach /tmp/serve-old <old commit>
    python benchmarks/serve_load.py --old-src /tmp/serve-old/src --out benchmarks/results/serve_load.md
    git worktree remove /tmp/serve-old

Both servers run as subprocesses (`mogrpo serve`, --max-batch 32) on the same tiny model files,
started together and measured alternately, round after round. Each client is a thread with the
official openai client that sends its requests one after another (a closed loop) to
/v1/chat/completions, greedy, max_tokens 32. Reported per server, mode and number of clients:
requests/s, p50/p95 latency and time to first token (streamed: the first chunk with text; not
streamed: the whole answer, which is when its first token reaches the client). The old server
refuses `stream`, so it is measured without.

The model is a random tiny Llama with tied embeddings and no chat template: greedy, it repeats
the last token of its prompt, so the prompts "request k: WORD" (k < 88, 44 distinct words) have
known answers, distinct but for a pair of words ending in the same token. Every answer under load is compared with the same prompt's answer alone; one
that differs (lost, cut, or carrying another request's text) is counted and fails the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import openai

HERE = Path(__file__).resolve().parent
NEW_SRC = HERE.parent / "src"
CORPUS = ["the quick brown fox jumps over the lazy dog", "naïve café über straße",
          "pack my box with five dozen liquor jugs", "sphinx of black quartz judge my vow"] * 10
MAX_TOKENS = 32


def build_model(directory: Path) -> list[str]:
    """The echo model (see the module docstring); returns the words its prompts end with."""
    sys.path.insert(0, str(NEW_SRC))
    from transformers import AutoTokenizer

    from mogrpo.modeling.tiny import build_tiny_model

    path = build_tiny_model(directory, CORPUS, vocab_size=512, hidden_size=64, num_layers=2,
                            num_heads=4)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)  # the user's text is the prompt, as plain text
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").unlink(missing_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(path)
    pieces = {tokenizer.decode([i]).strip() for i in range(len(tokenizer))}
    return sorted(p for p in pieces if len(p) >= 3 and p.isalpha())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(src: str, model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": src}
    process = subprocess.Popen(
        [sys.executable, "-m", "mogrpo.cli", "serve", str(model), "--port", str(port),
         "--max-batch", "32", "--max-new-tokens", str(MAX_TOKENS)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{url}/models", timeout=1)
            return process, url
        except OSError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"the server from {src} did not start")


def ask(api: openai.OpenAI, prompt: str, stream: bool) -> tuple[str, float, float]:
    """(answer, latency s, time to first token s) of one request."""
    kwargs = dict(model="m", temperature=0, max_tokens=MAX_TOKENS,
                  messages=[{"role": "user", "content": prompt}])
    start = time.perf_counter()
    if not stream:
        text = api.chat.completions.create(**kwargs).choices[0].message.content
        latency = time.perf_counter() - start
        return text, latency, latency
    first, parts = None, []
    for chunk in api.chat.completions.create(stream=True, **kwargs):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece:
            first = first or time.perf_counter() - start
            parts.append(piece)
    latency = time.perf_counter() - start
    return "".join(parts), latency, first if first is not None else latency


def load(url: str, prompts: list[str], reference: dict[str, str], clients: int, stream: bool,
         per_client: int) -> dict:
    """`clients` threads, each sending `per_client` requests in a row."""
    results: list[tuple[float, float]] = []
    wrong: list[str] = []
    barrier = threading.Barrier(clients + 1)

    def client(c: int) -> None:
        api = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        barrier.wait()
        for r in range(per_client):
            prompt = prompts[(c * per_client + r) % len(prompts)]
            try:
                text, latency, first = ask(api, prompt, stream)
            except openai.OpenAIError as err:
                text, latency, first = f"<{type(err).__name__}>", 0.0, 0.0
            if text != reference[prompt]:
                wrong.append(f"{prompt!r}: {text[:40]!r}")
            results.append((latency, first))

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    barrier.wait()
    start = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    latencies = sorted(r[0] for r in results)
    firsts = sorted(r[1] for r in results)
    return {"requests": len(results), "wrong": wrong, "rps": len(results) / wall,
            "p50": statistics.median(latencies), "p95": _p95(latencies),
            "ttft50": statistics.median(firsts), "ttft95": _p95(firsts)}


def _p95(values: list[float]) -> float:
    return values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old-src", required=True, help="src/ of a checkout of the old server")
    parser.add_argument("--clients", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=96,
                        help="requests per measurement (at least 2 per client)")
    parser.add_argument("--out", type=Path, default=None, help="write the results table here")
    args = parser.parse_args()
    args.load_before = os.getloadavg()[0]  # other processes' load skews every figure
    with tempfile.TemporaryDirectory() as tmp:
        words = build_model(Path(tmp) / "model")
        servers = {"old": start(args.old_src, Path(tmp) / "model"),
                   "new": start(str(NEW_SRC), Path(tmp) / "model")}
        try:
            rows = measure(servers, words, args)
        finally:
            for process, _ in servers.values():
                process.terminate()
                process.wait(30)
    report = render(rows, args)
    print(report)
    if args.out:
        args.out.write_text(report)
    return 1 if any(row["wrong"] for row in rows) else 0


def measure(servers: dict, words: list[str], args: argparse.Namespace) -> list[dict]:
    prompts = [f"request {k}: {words[k % len(words)]}" for k in range(2 * len(words))]
    references = {}
    for name, (_, url) in servers.items():  # each prompt alone, as the reference
        api = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        references[name] = {p: ask(api, p, False)[0] for p in prompts}
    assert references["old"] == references["new"], "the servers answer differently"
    args.distinct = f"{len(set(references['new'].values()))} distinct answers to {len(prompts)}"
    cells = [(c, name, stream) for c in map(int, args.clients.split(","))
             for name, stream in (("old", False), ("new", False), ("new", True))]
    rows = {cell: [] for cell in cells}
    for _ in range(args.rounds):  # alternated: old and new side by side in each round
        for clients, name, stream in cells:
            per_client = max(2, args.requests // clients)
            url = servers[name][1]
            load(url, prompts, references[name], clients, stream, 1)  # warm the connections
            rows[clients, name, stream].append(
                load(url, prompts, references[name], clients, stream, per_client))
    out = []
    for (clients, name, stream), runs in rows.items():
        merged = {k: statistics.median(r[k] for r in runs)
                  for k in ("rps", "p50", "p95", "ttft50", "ttft95")}
        out.append({"clients": clients, "server": name, "stream": stream, **merged,
                    "requests": sum(r["requests"] for r in runs),
                    "wrong": [w for r in runs for w in r["wrong"]]})
    return out


def render(rows: list[dict], args: argparse.Namespace) -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in subprocess.run(
        ["lscpu"], capture_output=True, text=True).stdout.splitlines()
        if line.startswith("Model name")), platform.processor())
    lines = [
        "# `mogrpo serve` under load: old (http.server) and new (Starlette + uvicorn)", "",
        f"CPU: {cpu}, {os.cpu_count()} cores (shared; load average {args.load_before:.1f} "
        f"before, {os.getloadavg()[0]:.1f} after); Python {platform.python_version()}.",
        f"Command: `python benchmarks/serve_load.py --old-src <checkout of the old server>/src "
        f"--clients {args.clients} --rounds {args.rounds} --requests {args.requests}`", "",
        "Tiny echo Llama (64 hidden, 2 layers), greedy, max_tokens 32, /v1/chat/completions, "
        f"--max-batch 32; {args.distinct} prompts; each figure the median of the rounds. TTFT "
        "of a request that is not streamed is its latency.", "",
        "| clients | server | stream | requests/s | p50 latency ms | p95 latency ms | "
        "p50 TTFT ms | p95 TTFT ms | requests | wrong or lost |",
        "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['clients']} | {r['server']} | {'yes' if r['stream'] else 'no'} | "
            f"{r['rps']:.1f} | {r['p50'] * 1e3:.0f} | {r['p95'] * 1e3:.0f} | "
            f"{r['ttft50'] * 1e3:.0f} | {r['ttft95'] * 1e3:.0f} | {r['requests']} | "
            f"{len(r['wrong'])} |")
    wrong = [w for r in rows for w in r["wrong"]]
    if wrong:
        lines += ["", "Wrong answers (first 10): " + "; ".join(wrong[:10])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())

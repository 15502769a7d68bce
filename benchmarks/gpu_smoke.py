"""A short GRPO run with each rollout engine on one CUDA GPU; their step and rollout times.

    python benchmarks/gpu_smoke.py [--model DIR] [--steps 8] [--engines native vllm vllm-server]

Without `--model`, a small Qwen2-style model (~4 M parameters, head_dim 64) and its tokenizer
are built from scratch from the demo tasks' text, so nothing is downloaded. Each engine trains
in its own `mogrpo train` process on the demo's two tasks (8 prompts × 8 completions, ≤ 16 new
tokens, LoRA off, no SFT, one short eval at the end); the median of `time/step_s` and
`time/rollout_s` from its metrics.jsonl, after the warm-up steps, goes to the JSON file.
`vllm-server` starts `mogrpo vllm-server` in a process of its own (on the second GPU where
there is one, else beside the trainer on the first, its weights then travelling through host
memory) and trains against it with `rollout.vllm.server_url`.
`benchmarks/gpu_smoke.sh` checks for the GPU and the vllm extra, then runs this.
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
import time
import urllib.request
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import yaml

from mogrpo.demo import demo_base, tokenizer_corpus
from mogrpo.modeling.tiny import build_tiny_model

QWEN2_SMALL = {"arch": "qwen2", "hidden_size": 256, "num_layers": 4, "num_heads": 4,
               "vocab_size": 400}


def fail(message: str) -> None:
    print(f"gpu_smoke: {message}", file=sys.stderr)
    sys.exit(1)


def run_config(model: str, engine: str, steps: int, out: Path, enforce_eager: bool) -> dict:
    """The demo's tasks and settings, shortened: `steps` GRPO steps, no SFT, a tiny eval."""
    config = demo_base()
    config["model"]["name_or_path"] = model
    config["output"] = {"dir": str(out), "overwrite": True}
    config["sft"] = {"enabled": False}
    config["eval"] = {"at_start": False, "every_steps": 0, "max_samples": 16}
    config["train"].update(max_steps=steps, warmup_steps=0)
    config["logging"] = {"progress_bar": False, "log_every": 1}
    config["rollout"]["engine"] = "vllm" if engine == "vllm-server" else engine
    if engine == "vllm":
        config["rollout"]["vllm"] = {"enforce_eager": enforce_eager}
    return config


@contextmanager
def vllm_server(model: str, work: Path, enforce_eager: bool):
    """`mogrpo vllm-server MODEL` in its own process until the block ends; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ)
    share = "0.3"
    if torch.cuda.device_count() > 1:
        env["CUDA_VISIBLE_DEVICES"], share = "1", "0.8"  # the trainer keeps GPU 0
    cmd = [sys.executable, "-m", "mogrpo.cli", "vllm-server", model, "--port", str(port),
           "--gpu-memory-utilization", share, *(["--enforce-eager"] if enforce_eager else [])]
    log = (work / "vllm-server.log").open("w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            if server.poll() is not None:
                fail(f"`{' '.join(cmd)}` exited {server.returncode}; see {log.name}")
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                time.sleep(1)
        else:
            fail(f"the vllm-server did not answer within 10 minutes; see {log.name}")
        yield url
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.close()


def train(config: dict, work: Path) -> list[dict]:
    """Run `mogrpo train` in its own process; the per-step metrics it wrote."""
    path = work / f"{Path(config['output']['dir']).name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "mogrpo.cli", "train", str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        fail(f"`mogrpo train {path}` failed (exit {done.returncode}):\n"
             f"{(done.stdout + done.stderr)[-6000:]}")
    lines = (Path(config["output"]["dir"]) / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if "time/step_s" in m]


def summarise(steps: list[dict], warmup: int) -> dict:
    timed = steps[warmup:] or steps
    out = {
        "step_s_median": statistics.median(m["time/step_s"] for m in timed),
        "rollout_s_median": statistics.median(m["time/rollout_s"] for m in timed),
        "update_s_median": statistics.median(m["time/update_s"] for m in timed),
        "completion_length_mean": statistics.mean(m["rollout/completion_length"] for m in timed),
        "peak_gib_max": max(m["memory/peak_gib"] for m in steps),
        "steps": [{k: m[k] for k in ("step", "time/step_s", "time/rollout_s", "loss")}
                  for m in steps],
    }
    if "time/weight_sync_s" in steps[0]:
        out["weight_sync_s_median"] = statistics.median(m["time/weight_sync_s"] for m in timed)
        out["sampler_is_weight_mean"] = statistics.mean(
            m["policy/sampler_is_weight"] for m in timed if "policy/sampler_is_weight" in m)
    return out


def installed(package: str) -> str | None:
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="local model directory (default: build one)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of medians")
    parser.add_argument("--engines", nargs="+", default=["native", "vllm", "vllm-server"],
                        choices=["native", "hf", "vllm", "vllm-server"])
    parser.add_argument("--enforce-eager", action="store_true", help="vLLM without CUDA graphs")
    parser.add_argument("--work", type=Path, default=Path("runs/gpu-smoke"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu_smoke.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        fail("no CUDA GPU is visible (torch.cuda.is_available() is False); run this on a GPU")
    if {"vllm", "vllm-server"} & set(args.engines) and installed("vllm") is None:
        fail("vllm is not installed: pip install -e '.[vllm]' (benchmarks/gpu_smoke.sh does)")
    if args.steps <= args.warmup:
        fail(f"--steps {args.steps} leaves nothing after {args.warmup} warm-up steps")
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if not model:
        model = str(args.work / "qwen2-small")
        if not (Path(model) / "config.json").exists():
            build_tiny_model(model, tokenizer_corpus(demo_base(), 0), seed=0, **QWEN2_SMALL)
    results = {}
    for engine in args.engines:
        config = run_config(model, engine, args.steps, args.work / f"run-{engine}",
                            args.enforce_eager)
        if engine == "vllm-server":
            with vllm_server(model, args.work, args.enforce_eager) as url:
                config["rollout"]["vllm"] = {"server_url": url}
                results[engine] = summarise(train(config, args.work), args.warmup)
        else:
            results[engine] = summarise(train(config, args.work), args.warmup)
        print(f"{engine}: step {results[engine]['step_s_median']:.3f} s, "
              f"rollout {results[engine]['rollout_s_median']:.3f} s (medians)")
    for engine in {"vllm", "vllm-server"} & set(results):
        if "weight_sync_s_median" not in results[engine]:
            fail(f"the {engine} run logged no time/weight_sync_s: it did not generate with vLLM")
    report = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
        "model": "built qwen2-small" if not args.model else Path(args.model).name,
        "steps": args.steps, "warmup_steps": args.warmup,
        "versions": {p: installed(p) for p in ("mogrpo", "torch", "transformers", "vllm")},
        "python": platform.python_version(),
        "engines": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

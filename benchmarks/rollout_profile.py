"""Where a training rollout's time goes, native engine against generate(), on a CPU or a GPU.

    python benchmarks/rollout_profile.py [--device cuda] [--out DIR]
    python benchmarks/rollout_profile.py --train native --out DIR   # inside `mogrpo train`

The rollout `benchmarks/gpu_smoke.py` trains with: its Qwen2 model (~4 M parameters, head_dim
64, built from scratch), 8 of the demo's prompts × 8 completions, ≤ 16 new tokens, temperature
1, the end-of-text id as stop id, sampler log-probs recorded. Times each engine (alternated,
after a warm-up), then profiles one native call: torch.profiler's operators by self CPU time
(with CUDA activity on a GPU: how many synchronizations and host-device copies a call makes)
and cProfile's Python functions. Writes DIR/rollout_profile.txt and prints the timings.

`--train ENGINE` instead runs `mogrpo train` on gpu_smoke.py's config (the demo's two tasks,
6 steps) in this process and profiles the trainer's rollouts (`GRPOTrainer.generate`) from the
third step on: what a training rollout costs beyond the decode loop. It writes
DIR/train_rollout_profile_ENGINE.txt.

`--allow-cudnn` lets SDPA pick cuDNN's attention kernel while decoding, as before 262c1d8
(`mogrpo.rollout.native.decode_attention` keeps it out on CUDA): the two runs side by side
show what that choice is worth on a GPU.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mogrpo.demo import demo_base, tokenizer_corpus
from mogrpo.kernels.cpu.host_memory import keep_freed_memory
from mogrpo.modeling.tiny import build_tiny_model
from mogrpo.rollout.generate import SamplingSettings, generate_rollout

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_smoke import QWEN2_SMALL  # noqa: E402  (the smoke test's model shape)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--out", type=Path, default=Path("runs/rollout-profile"))
    parser.add_argument("--train", choices=["native", "hf"], default=None,
                        help="profile the rollouts of a short `mogrpo train` with this engine")
    parser.add_argument("--allow-cudnn", action="store_true",
                        help="let SDPA use cuDNN's attention kernel while decoding")
    args = parser.parse_args()
    if args.allow_cudnn:
        from contextlib import nullcontext

        from mogrpo.rollout import generate

        generate.decode_attention = lambda device: nullcontext()
    torch.set_num_threads(args.threads)
    if args.train:
        return profile_training(args.train, args.out, args.allow_cudnn)
    texts = tokenizer_corpus(demo_base(), 0)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_model(Path(tmp) / "m", texts, seed=0, **QWEN2_SMALL)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype))
        model = model.to(args.device).eval()
        tok = AutoTokenizer.from_pretrained(path)
    prompts = sorted(texts, key=len)[-8:]  # the longest: the demo's prompts run to ~140 tokens
    settings = SamplingSettings(max_new_tokens=16, temperature=1.0,
                                stop_token_ids=[tok.eos_token_id])

    def call(engine: str):
        ro = generate_rollout(model, tok, prompts, settings, num_generations=8,
                              max_prompt_length=144, engine=engine, generator_seed=0,
                              record_logprobs=engine == "native")
        if args.device == "cuda":
            torch.cuda.synchronize()
        return ro

    if args.device == "cpu":
        keep_freed_memory()  # as `mogrpo train` on a CPU, for both engines
    times: dict[str, list[float]] = {"hf": [], "native": []}
    for engine in times:
        call(engine)  # warm-up
    for i in range(args.repeats):
        for engine in ("hf", "native") if i % 2 == 0 else ("native", "hf"):
            start = time.perf_counter()
            ro = call(engine)
            times[engine].append(time.perf_counter() - start)
    lines = [f"device {args.device}, {args.dtype}"
             + (", cuDNN attention allowed" if args.allow_cudnn else "")
             + (f" ({torch.cuda.get_device_name(0)})" if args.device == "cuda" else ""),
             f"prompt tokens {int(ro.prompt_mask.sum(1).max())} max, completion tokens "
             f"{int(ro.lengths.sum())} in {ro.lengths.numel()} rows"]
    for engine, t in times.items():
        lines.append(f"{engine}: median {statistics.median(t) * 1000:.1f} ms "
                     f"({', '.join(f'{x * 1000:.0f}' for x in t)})")
    print("\n".join(lines), flush=True)

    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        call("native")
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)
    profiler = cProfile.Profile()
    profiler.enable()
    call("native")
    profiler.disable()
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(30)
    args.out.mkdir(parents=True, exist_ok=True)
    report = "\n".join(lines) + "\n\n" + table + "\n\n" + stream.getvalue()
    (args.out / "rollout_profile.txt").write_text(report, encoding="utf-8")
    print(table[:6000])


def profile_training(engine: str, out: Path, allow_cudnn: bool) -> None:
    """`mogrpo train` on gpu_smoke.py's config with `engine`, its rollouts profiled."""
    import yaml
    from gpu_smoke import QWEN2_SMALL, run_config

    from mogrpo.cli import main as mogrpo_main
    from mogrpo.trainer.grpo import GRPOTrainer

    out.mkdir(parents=True, exist_ok=True)
    model = out / "qwen2-small"
    if not (model / "config.json").exists():
        build_tiny_model(model, tokenizer_corpus(demo_base(), 0), seed=0, **QWEN2_SMALL)
    config = run_config(str(model), engine, 6, out / f"run-{engine}", enforce_eager=True)
    path = out / f"{engine}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    profiler, calls, seconds = cProfile.Profile(), [0], []
    generate = GRPOTrainer.generate

    def profiled(self, picks):
        calls[0] += 1
        if calls[0] < 3:
            return generate(self, picks)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        profiler.enable()
        try:
            ro = generate(self, picks)
            if cuda:
                torch.cuda.synchronize()
        finally:
            profiler.disable()
        seconds.append(time.perf_counter() - start)
        return ro

    GRPOTrainer.generate = profiled  # type: ignore[method-assign]
    mogrpo_main(["train", str(path)])
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream)
    stats.sort_stats("tottime").print_stats(25)
    stats.sort_stats("cumulative").print_stats(40)
    allowed = " (cuDNN attention allowed)" if allow_cudnn else ""
    head = (f"{engine}{allowed}: {len(seconds)} profiled rollouts, "
            f"{', '.join(f'{s * 1000:.0f}' for s in seconds)} ms")
    (out / f"train_rollout_profile_{engine}.txt").write_text(head + "\n" + stream.getvalue(),
                                                             encoding="utf-8")
    print(head)
    print(stream.getvalue()[:7000])


if __name__ == "__main__":
    main()

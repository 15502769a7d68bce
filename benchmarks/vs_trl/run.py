"""Side-by-side GRPO benchmark: TRL's GRPOTrainer and mogrpo on the same models, prompts,
rewards and settings.

    python benchmarks/vs_trl/run.py --sizes small medium large --modes full lora \
        --repeats 3 --steps 20 --out benchmarks/results/vs_trl
    python benchmarks/vs_trl/run.py --quick          # smoke run: small, 4 steps, 1 repeat
    python benchmarks/vs_trl/run.py --device cuda --sizes small large xl --modes full lora
    python benchmarks/vs_trl/run.py --arch qwen3 --sizes small medium --out \
        benchmarks/results/vs_trl_qwen3    # the same shapes as Qwen3 models (per-head q/k norms)

`--device cuda` runs both tools on the first CUDA GPU (still without vLLM: both generate with
their own engines, TRL with `generate()`). `--precision bf16-mixed` trains both in float32
weights under bfloat16 autocast (TRL `bf16=True`, mogrpo `model.precision: bf16-mixed`), as
users train on GPUs; the default is fp32 for both.

Every (tool, size, mode, repeat) is its own process, TRL and mogrpo one after the other
(the first of each pair alternates between repeats). Writes OUT.json (every step of every run)
and OUT.md (the table). Needs `pip install 'mogrpo[bench]'`. See README.md here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import summary
import workload
from arith_rewards import LOG_ENV, WEIGHTS

HERE = Path(__file__).resolve().parent
TOOLS = ("trl", "mogrpo")


@dataclass
class Bench:
    """What every run of one invocation shares."""

    work: Path
    steps: int
    warmup: int
    threads: int
    engine: str | None
    device: str = "cpu"
    arch: str = "qwen2"  # the models' family (workload.build_models)
    precision: str = "fp32"  # or bf16-mixed, for both tools
    settings: workload.Settings = field(default_factory=workload.Settings)
    models: dict[str, dict[str, Any]] = field(default_factory=dict)
    pool: Path = Path()
    order: Path = Path()

    def env(self, reward_log: Path) -> dict[str, str]:
        """The child's environment: threads pinned, offline, quiet, the reward log named."""
        env = dict(os.environ)
        env.update({
            "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads),
            "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore",
            LOG_ENV: str(reward_log),
        })
        return env


def run_child(cmd: list[str], env: dict[str, str], log: Path) -> tuple[float, float]:
    """Run `cmd` to the end; return (wall seconds, peak RSS in MiB of that process alone).

    `os.wait4` gives the child's own resource usage (RUSAGE_CHILDREN would be the maximum
    over every child waited for so far)."""
    start = time.perf_counter()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode} (log {log}):\n{tail}")
    return wall, usage.ru_maxrss / 1024  # Linux reports KiB


def run_trl(bench: Bench, size: str, mode: str, run_dir: Path) -> dict[str, Any]:
    """One TRL run; its per-step record."""
    result = run_dir / "trl.json"
    cmd = [sys.executable, str(HERE / "trl_worker.py"), "--model", bench.models[size]["path"],
           "--prompts", str(bench.order), "--steps", str(bench.steps), "--mode", mode,
           "--out", str(result), "--device", bench.device, "--precision", bench.precision]
    wall, rss = run_child(cmd, bench.env(run_dir / "rewards.jsonl"), run_dir / "log.txt")
    record = json.loads(result.read_text(encoding="utf-8"))
    return {**record, "wall_s": wall, "peak_rss_mib": rss}


def run_mogrpo(bench: Bench, size: str, mode: str, run_dir: Path) -> dict[str, Any]:
    """One mogrpo run through its CLI entry point (`mogrpo train CONFIG`, with the CPU time of
    each step recorded by mogrpo_worker.py); its per-step record."""
    out_dir = run_dir / "run"
    config = workload.mogrpo_config(bench.models[size]["path"], bench.pool, out_dir,
                                    bench.steps, mode == "lora", bench.settings, bench.engine,
                                    bench.device, bench.precision)
    path = workload.write_mogrpo_config(run_dir / "config.yaml", config)
    cpu = run_dir / "cpu.json"
    cmd = [sys.executable, str(HERE / "mogrpo_worker.py"), str(path), str(cpu)]
    wall, rss = run_child(cmd, bench.env(run_dir / "rewards.jsonl"), run_dir / "log.txt")
    record = read_mogrpo_metrics(out_dir / "metrics.jsonl", bench.settings.batch_size)
    record["cpu_s"] = json.loads(cpu.read_text(encoding="utf-8"))["cpu_s"]
    for bulky in ("final", "checkpoints"):  # the saved model is not part of the benchmark
        shutil.rmtree(out_dir / bulky, ignore_errors=True)
    return {**record, "wall_s": wall, "peak_rss_mib": rss}


def read_mogrpo_metrics(path: Path, batch_size: int) -> dict[str, list]:
    """Per-step times and completion tokens from mogrpo's metrics.jsonl (step lines only)."""
    steps = [m for m in map(json.loads, path.read_text(encoding="utf-8").splitlines())
             if "time/step_s" in m]
    return {
        "step_s": [m["time/step_s"] for m in steps],
        "generation_s": [m["time/rollout_s"] for m in steps],
        "completion_tokens": [round(m["rollout/completion_length"] * batch_size) for m in steps],
    }


def run_pair(bench: Bench, size: str, mode: str, repeat: int) -> dict[str, Any]:
    """TRL and mogrpo one after the other (which goes first alternates with `repeat`)."""
    order = TOOLS if repeat % 2 == 0 else TOOLS[::-1]
    pair: dict[str, Any] = {"order": list(order)}
    prompts = {}
    for tool in order:
        run_dir = bench.work / "runs" / f"{size}-{mode}-r{repeat}-{tool}"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir(parents=True)
        runner = run_trl if tool == "trl" else run_mogrpo
        record = runner(bench, size, mode, run_dir)
        record["rewards"], prompts[tool] = summary.read_reward_log(run_dir / "rewards.jsonl",
                                                                    WEIGHTS)
        pair[tool] = {"summary": summary.summarize_run(record, bench.warmup), "raw": record}
        print(f"  {size:<6} {mode:<4} r{repeat} {tool:<6} "
              f"step {pair[tool]['summary']['step_ms']:7.0f} ms  "
              f"cpu {pair[tool]['summary']['cpu_ms']:7.0f} ms  "
              f"peak {record['peak_rss_mib']:5.0f} MiB  wall {record['wall_s']:5.0f} s",
              flush=True)
    pair["prompts_match"] = prompts["trl"] == prompts["mogrpo"] and len(prompts["trl"]) == bench.steps
    return pair


def prepare(bench: Bench, sizes: list[str]) -> None:
    """Models (from scratch), the prompt pool (mogrpo's data) and its draw order (TRL's)."""
    bench.models = workload.build_models(bench.work, sizes, bench.settings.seed, bench.arch)
    rows = workload.prompt_rows(bench.settings.seed)
    bench.pool = workload.write_prompts(bench.work / "data" / "pool.jsonl", rows)
    bench.order = workload.write_prompts(bench.work / "data" / f"order-{bench.steps}.jsonl",
                                         workload.mogrpo_order(rows, bench.steps, bench.settings))


def metadata(bench: Bench, argv: list[str]) -> dict[str, Any]:
    import torch
    import transformers
    import trl

    import mogrpo
    from mogrpo.kernels.cpu.linear import cpu_name

    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=HERE, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        rev = None
    machine = (f"{platform.machine()}, {cpu_name()}, {os.cpu_count()} cores, Python "
               f"{platform.python_version()}")
    if bench.device == "cuda":
        machine += f", GPU {torch.cuda.get_device_name(0)}"
    return {
        "command": "python benchmarks/vs_trl/run.py " + " ".join(argv),
        "machine": machine,
        "device": bench.device,
        "precision": bench.precision,
        "arch": bench.arch,
        "threads": bench.threads,
        "load_average_start": os.getloadavg(),
        "versions": {"mogrpo": mogrpo.__version__, "mogrpo_git": rev, "trl": trl.__version__,
                     "torch": torch.__version__, "transformers": transformers.__version__},
        "mogrpo_engine": bench.engine or "default",
        "steps": bench.steps,
        "warmup_steps": bench.warmup,
        "settings": asdict(bench.settings),
        "reward_weights": WEIGHTS,
        # folders relative to --work: no machine paths in a results file
        "models": {name: {**m, "path": os.path.relpath(m["path"], bench.work)}
                   for name, m in bench.models.items()},
    }


def write_outputs(out: Path, results: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    out.with_suffix(".md").write_text(to_markdown(results), encoding="utf-8")


def to_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    s = meta["settings"]
    commands = "\n".join(f"    {c}" for c in meta.get("commands", [meta["command"]]))
    device = "the GPU" if meta.get("device") == "cuda" else "CPU"
    arch = {"qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
            "llama": "Llama"}[meta.get("arch", "qwen2")]
    return (
        "# mogrpo vs TRL GRPOTrainer, side by side\n\n"
        f"Commands:\n\n{commands}\n\n"
        f"Machine: {meta['machine']}, {meta['threads']} torch thread(s) per run, 1-min load "
        f"average {meta['load_average_start'][0]:.1f} at the start of the last command "
        f"(a shared machine: absolute times are noisy; each ratio is taken within a pair of "
        f"runs started one after the other). Versions: "
        f"{', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; mogrpo rollout engine: "
        f"{meta['mogrpo_engine']}.\n\n"
        f"Workload: {arch} models built from scratch, two-digit additions, "
        f"{s['prompts_per_step']} prompts × "
        f"{s['num_generations']} completions per step, ≤ {s['max_completion_length']} new "
        f"tokens, temperature {s['temperature']}, β {s['beta']} (k3), lr {s['learning_rate']} "
        f"constant, token-mean (DAPO) loss, {meta.get('precision', 'fp32')} on {device}, "
        f"μ = 1; LoRA r {s['lora_r']} "
        f"(alpha {s['lora_alpha']}, all linear layers). The first {meta['warmup_steps']} steps "
        f"of each run are not timed; step time is the median step, generation share and "
        f"tokens/s are over the timed steps, final reward is the mean combined reward of the "
        f"last {summary.FINAL_STEPS} steps (max {sum(meta['reward_weights'].values()):.1f}). "
        f"Every cell is the median over the repeats (runs column: repeats × steps).\n\n"
        f"{summary.markdown_table(results)}\n"
    )


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; all of them where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(workload.SIZES),
                        default=workload.CPU_SIZES)
    parser.add_argument("--modes", nargs="+", choices=["full", "lora"], default=["full", "lora"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the times")
    parser.add_argument("--threads", type=int, default=usable_cores(),
                        help="torch threads per run (default: the cores this process may use, "
                        "as a user runs; 1 is the low-noise option on a shared machine, where "
                        "threads of busy neighbours stall each other's parallel regions)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                        help="where both tools train (cuda: the first GPU)")
    parser.add_argument("--precision", choices=list(workload.PRECISION_DTYPES), default="fp32",
                        help="both tools' precision: fp32, or bf16-mixed (float32 weights, "
                        "bfloat16 autocast)")
    parser.add_argument("--arch", choices=["qwen2", "qwen3", "gemma", "llama"], default="qwen2",
                        help="the models' family (the same sizes; default qwen2)")
    parser.add_argument("--mogrpo-engine", default=None,
                        help="set rollout.engine in mogrpo's config (default: mogrpo's own)")
    parser.add_argument("--work", type=Path, default=Path("runs/vs_trl"),
                        help="models, data and run directories")
    parser.add_argument("--out", type=Path, default=None,
                        help="results path without suffix (default benchmarks/results/vs_trl; "
                        "--quick: WORK/quick)")
    parser.add_argument("--merge", action="store_true",
                        help="keep the entries of an existing OUT.json for the sizes and modes "
                        "not run now (e.g. the large size run apart with fewer steps)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: small size, 4 steps, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.sizes, args.steps, args.repeats = ["small"], 4, 1
    if args.out is None:
        args.out = args.work / "quick" if args.quick else Path("benchmarks/results/vs_trl")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA GPU here")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must be larger than --warmup {args.warmup}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    bench = Bench(args.work.resolve(), args.steps, args.warmup, args.threads, args.mogrpo_engine,
                  args.device, arch=args.arch, precision=args.precision)
    prepare(bench, args.sizes)
    results: dict[str, Any] = {"meta": metadata(bench, argv), "entries": []}
    kept = merged_entries(args.out, args.sizes, args.modes) if args.merge else []
    for size in args.sizes:
        for mode in args.modes:
            entry = {"size": size, "mode": mode, "params": bench.models[size]["params"],
                     "steps": bench.steps, "warmup": bench.warmup, "threads": bench.threads,
                     "command": results["meta"]["command"], "pairs": []}
            results["entries"].append(entry)
            for repeat in range(args.repeats):
                entry["pairs"].append(run_pair(bench, size, mode, repeat))
                entry["summary"] = summary.summarize_pairs(entry["pairs"])
                results["meta"]["load_average_end"] = os.getloadavg()
                write_outputs(args.out, with_kept(results, kept))  # partial results survive
    results = with_kept(results, kept)
    print(to_markdown(results))
    return results


def merged_entries(out: Path, sizes: list[str], modes: list[str]) -> list[dict[str, Any]]:
    """--merge: the entries of an earlier OUT.json for the (size, mode) not run now."""
    path = out.with_suffix(".json")
    if not path.is_file():
        return []
    old = json.loads(path.read_text(encoding="utf-8"))
    return [e for e in old["entries"] if not (e["size"] in sizes and e["mode"] in modes)]


def with_kept(results: dict[str, Any], kept: list[dict[str, Any]]) -> dict[str, Any]:
    """This invocation's entries plus the kept ones, in size then mode order."""
    rank = {name: i for i, name in enumerate(workload.SIZES)}
    entries = sorted(results["entries"] + kept,
                     key=lambda e: (rank[e["size"]], ("full", "lora").index(e["mode"])))
    commands = list(dict.fromkeys([e.get("command", results["meta"]["command"]) for e in entries]))
    return {"meta": {**results["meta"], "commands": commands}, "entries": entries}


if __name__ == "__main__":
    main()

"""What running each distinct prompt once (`train.prompt_sharing`) is worth on this device.

    python benchmarks/prompt_sharing.py --sizes small medium --repeats 3 \
        --out benchmarks/results/epyc/prompt_sharing
    python benchmarks/prompt_sharing.py --device cuda --precision bf16-mixed --sizes xl \
        --repeats 2 --out benchmarks/results/h200/prompt_sharing

Runs `benchmarks/profile_step.py` on the vs_trl workload (4 prompts × 4 completions a step)
with `--prompt-sharing on` and `off`, alternating which goes first, and reports per size the
median step, reference pass and update (ms) of each and the step's ratio (off ÷ on: above 1,
sharing is faster). On a CPU with one thread
the times are CPU time, else wall time (synchronized on a GPU). Each pair also counts the
operations a step dispatches outside the rollout, once per setting (`--ops`: kernels on a GPU),
in a separate short run so the counting's overhead stays out of the times.

This workload saves ~22 % of the pass's tokens by sharing (13-token prompts, 12 of 16 rows
skipping theirs, completions up to 32 tokens): below the half that `auto` asks on a
GPU (`mogrpo.kernels.PROMPT_SHARING_MIN_SAVED`), above the nothing it asks on a CPU. A
measurement here that contradicts either rule is what should change it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PHASES = ("reference forward", "update")


def run_one(args: argparse.Namespace, size: str, sharing: str, work: Path, ops: bool) -> dict:
    out = work / f"{size}-{sharing}-{'ops' if ops else 'time'}.json"
    cmd = [sys.executable, str(HERE / "profile_step.py"), "--size", size, "--mode", args.mode,
           "--steps", str(4 if ops else args.steps), "--warmup", str(1 if ops else args.warmup),
           "--threads", str(args.threads), "--device", args.device,
           "--precision", args.precision, "--prompt-sharing", sharing,
           "--work", str(work / size), "--json", str(out)] + (["--ops"] if ops else [])
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["small", "medium"])
    parser.add_argument("--mode", choices=["full", "lora"], default="full")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--precision", choices=["fp32", "bf16-mixed"], default="fp32")
    parser.add_argument("--no-ops", action="store_true",
                        help="leave out the operation counts (two runs fewer)")
    parser.add_argument("--work", type=Path, default=None)
    parser.add_argument("--out", type=Path, required=True, help="writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="mogrpo-prompt-sharing-"))
    rows = []
    for size in args.sizes:
        runs: dict[str, list[dict]] = {"on": [], "off": []}
        for repeat in range(args.repeats):
            for sharing in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                runs[sharing].append(run_one(args, size, sharing, work, ops=False))
                print(f"{size} {sharing} repeat {repeat}: {runs[sharing][-1]['step_ms']:.1f} ms",
                      flush=True)
        kernels = ({s: run_one(args, size, s, work, ops=True)["kernels"] for s in ("on", "off")}
                   if not args.no_ops else {"on": "–", "off": "–"})
        row = {"size": size, "kernels": kernels, "runs": runs}
        for what in ("step", *PHASES):
            for sharing in ("on", "off"):
                row[f"{what} {sharing}"] = statistics.median(
                    r["step_ms"] if what == "step" else r["phases_ms"][what]
                    for r in runs[sharing])
        rows.append(row)
    clock = rows[0]["runs"]["on"][0]["clock"] if rows else ""
    meta = {"argv": sys.argv[1:] if argv is None else argv, "machine": machine(args.device),
            "device": args.device, "precision": args.precision, "mode": args.mode,
            "threads": args.threads, "clock": clock, "repeats": args.repeats,
            "timed_steps": args.steps - args.warmup}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1),
                                             encoding="utf-8")
    text = render(meta, rows)
    args.out.with_suffix(".md").write_text(text, encoding="utf-8")
    print(text)


def machine(device: str) -> str:
    """The processor (and the GPU, on CUDA) the figures come from."""
    import torch

    from mogrpo.kernels.cpu.linear import cpu_name

    name = f"{cpu_name()}, Python {platform.python_version()}, torch {torch.__version__}"
    return name + (f", GPU {torch.cuda.get_device_name(0)}" if device == "cuda" else "")


def render(meta: dict, rows: list[dict]) -> str:
    """The results page: the command, the machine, a row per size."""
    lines = [f"# Prompt sharing on and off ({meta['device']}, {meta['precision']}, "
             f"{meta['mode']})", "",
             f"`python benchmarks/prompt_sharing.py {' '.join(meta['argv'])}` on "
             f"{meta['machine']}: medians of {meta['repeats']} runs each ({meta['clock']}, "
             f"{meta['timed_steps']} timed steps a run, alternated, nothing else running); "
             "off ÷ on above 1: sharing is faster.", "",
             "| size | step on | step off | off ÷ on | reference on / off | update on / off "
             "| kernels a step on / off |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['step on']:.1f} ms | {r['step off']:.1f} ms | "
            f"**{r['step off'] / r['step on']:.2f}** | {r['reference forward on']:.1f} / "
            f"{r['reference forward off']:.1f} ms | {r['update on']:.1f} / {r['update off']:.1f} "
            f"ms | {r['kernels']['on']} / {r['kernels']['off']} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

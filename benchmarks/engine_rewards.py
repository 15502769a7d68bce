"""Do the `native` and `hf` rollout engines train alike? Reward curves over several seeds.

Runs the same short GRPO (the vs_trl workload: a Qwen2 model built from scratch, two-digit
additions, the same rewards and settings) once per seed with `rollout.engine: hf` and once
with `native`, alternating, and compares the per-step mean rewards: per-seed means side by side,
and a two-sided Mann-Whitney U test over every step of every seed (normal approximation with
tie correction). The engines sample from the same distribution but not the same random
stream, so the curves differ step by step; what must hold is that they are statistically
indistinguishable.

    python benchmarks/engine_rewards.py --seeds 0 1 2 --steps 30

Writes benchmarks/results/engine_rewards.json and .md.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "vs_trl"))

import workload  # noqa: E402  (the vs_trl workload: models, prompts, rewards, settings)
from arith_rewards import WEIGHTS  # noqa: E402

RESULTS = HERE / "results"
ENGINES = ("hf", "native")


def run(engine: str, seed: int, size: str, steps: int, work: Path, model: str,
        pool: Path) -> list[float]:
    """One GRPO run through the CLI; the weighted mean reward of each step."""
    settings = workload.Settings(seed=seed)
    out = work / f"{engine}-{seed}"
    config = workload.mogrpo_config(model, pool, out, steps, False, settings, engine)
    path = workload.write_mogrpo_config(work / f"{engine}-{seed}.yaml", config)
    subprocess.run([sys.executable, "-m", "mogrpo.cli", "train", str(path)], check=True,
                   capture_output=True, text=True)
    rewards = []
    for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "event" in record or "step" not in record:
            continue
        rewards.append(sum(w * record[f"task/{workload.TASK}/reward/{name}/mean"]
                           for name, w in WEIGHTS.items()))
    return rewards


def mann_whitney(a: list[float], b: list[float]) -> tuple[float, float]:
    """(U of `a`, two-sided p-value) by the normal approximation with tie correction."""
    pooled = sorted((v, i) for i, v in enumerate(a + b))
    ranks = [0.0] * len(pooled)
    ties = 0.0
    i = 0
    while i < len(pooled):
        j = i
        while j + 1 < len(pooled) and pooled[j + 1][0] == pooled[i][0]:
            j += 1
        for k in range(i, j + 1):
            ranks[pooled[k][1]] = (i + j) / 2 + 1
        t = j - i + 1
        ties += t**3 - t
        i = j + 1
    n1, n2 = len(a), len(b)
    u = sum(ranks[:n1]) - n1 * (n1 + 1) / 2
    n = n1 + n2
    sigma = math.sqrt(n1 * n2 / 12 * ((n + 1) - ties / (n * (n - 1))))
    z = (u - n1 * n2 / 2) / sigma if sigma > 0 else 0.0
    return u, math.erfc(abs(z) / math.sqrt(2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--size", default="small", choices=list(workload.SIZES))
    parser.add_argument("--out", type=Path, default=RESULTS / "engine_rewards")
    args = parser.parse_args()
    curves: dict[str, dict[int, list[float]]] = {e: {} for e in ENGINES}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = workload.build_models(work, [args.size], 0)[args.size]["path"]
        pool = workload.write_prompts(work / "pool.jsonl", workload.prompt_rows(0))
        for i, seed in enumerate(args.seeds):
            for engine in ENGINES if i % 2 == 0 else ENGINES[::-1]:  # alternate the order
                curves[engine][seed] = run(engine, seed, args.size, args.steps, work, model, pool)
                print(f"seed {seed} {engine}: mean reward "
                      f"{statistics.mean(curves[engine][seed]):.3f}")
    pooled = {e: [r for s in args.seeds for r in curves[e][s]] for e in ENGINES}
    u, p = mann_whitney(pooled["native"], pooled["hf"])
    result = {
        "size": args.size, "steps": args.steps, "seeds": args.seeds,
        "curves": {e: {str(s): c for s, c in curves[e].items()} for e in ENGINES},
        "mean": {e: statistics.mean(pooled[e]) for e in ENGINES},
        "mann_whitney_u": u, "p_value": p,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2))
    lines = ["| seed | hf mean reward | native mean reward | hf last 10 steps | native last 10 steps |",
             "|---|---|---|---|---|"]
    for s in args.seeds:
        h, n = curves["hf"][s], curves["native"][s]
        lines.append(f"| {s} | {statistics.mean(h):.3f} | {statistics.mean(n):.3f} | "
                     f"{statistics.mean(h[-10:]):.3f} | {statistics.mean(n[-10:]):.3f} |")
    lines.append(f"| all | {result['mean']['hf']:.3f} | {result['mean']['native']:.3f} | | |")
    lines.append("")
    lines.append(f"Mann-Whitney U over {len(pooled['hf'])} steps per engine: U = {u:.0f}, "
                 f"two-sided p = {p:.3f} ({args.size} model, {args.steps} steps per run).")
    args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

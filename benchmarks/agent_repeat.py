"""Does an agent rollout repeat to the bit? Sample the same episodes of the calculator example
(examples/agent_calculator.py) from one trained model and seed again and again, and count the
different rollouts and the tool errors by kind.

    python examples/agent_calculator.py --seed 1                   # trains the model once
    python benchmarks/agent_repeat.py --model runs/agent_calculator/run-seed1/final/model

Run two or more at once to load the machine as a benchmark run does: a tool that is not
thread-safe fails only now and then, when threads switch at the wrong moment (docs/agents.md).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a trained model directory")
    parser.add_argument("--repeats", type=int, default=60)
    parser.add_argument("--prompts", type=int, default=8, help="prompts, 8 episodes each")
    parser.add_argument("--out", type=Path, help="also write the result here (JSON)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "examples"))
    import agent_calculator

    from mogrpo.rollout import episodes
    from mogrpo.tasks.agent_rollout import agent_rollout
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context, seed_everything

    errors: Counter = Counter()
    run, made = episodes.run_tool_calls, [0]

    def counted(calls, timeout_s, parallel=True):
        results = run(calls, timeout_s, parallel)
        made[0] += len(calls)
        errors.update(r.content.split(":")[1].split()[-1] if " raised " in r.content
                      else "timeout" if r.timed_out else "bad call (not JSON, unknown tool)"
                      for r in results if r.error)
        return results

    episodes.run_tool_calls = counted
    from mogrpo.config import load_config

    config, _ = load_config(agent_calculator.CONFIG, [
        "sft.enabled=false", f"model.name_or_path={args.model}",
        f"output.dir={args.model.parent / 'repeat'}", "output.overwrite=true"])
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    task = ctx.tasks[0]
    rollouts: Counter = Counter()
    for _ in range(args.repeats):
        seed_everything(123)
        ro = agent_rollout(ctx, task, task.train[:args.prompts], num_generations=8,
                           record_logprobs=True)
        rollouts[hashlib.sha1(ro.completion_ids.cpu().numpy().tobytes()
                              + ro.sampler_logp.cpu().numpy().tobytes()).hexdigest()[:12]] += 1
    result = {"repeats": args.repeats, "tool_calls": made[0],
              "distinct_rollouts": len(rollouts),
              "rollouts": dict(rollouts), "tool_errors_by_exception": dict(errors)}
    print(json.dumps(result, indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()

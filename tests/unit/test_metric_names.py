"""Metric names are defined once (mogrpo.tracking.names): a GRPO step writes every declared
name, declares every name it writes, and no reader spells a metric name of its own — so a
health check or report line cannot be reading a metric the trainer never writes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from mogrpo.tracking import names

SRC = Path(__file__).resolve().parents[2] / "src" / "mogrpo"
# Whoever writes or reads the GRPO step's metrics.
USERS = ["trainer/grpo.py", "trainer/metrics.py", "trainer/progress.py", "trainer/distributed.py",
         "health/monitor.py", "health/regression.py", "eval/report.py", "eval/quick_eval.py",
         "eval/report_charts.py", "trainer/startup.py"]
NAMESPACED = re.compile(r"^(task|policy|rollout|time|throughput|memory|curriculum|eval)/")


def distinct_chars(prompts: list[str], completions: list[str], **columns) -> list[float]:
    return [float(len(set(c))) for c in completions]


@pytest.fixture(scope="module")
def one_step(tmp_path_factory, tiny_model_dir) -> tuple[dict, list[tuple[str, list[str]]]]:
    """The metrics of one GRPO step of two tasks, with every optional metric switched on."""
    from mogrpo.config import load_config
    from mogrpo.demo import demo_base
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    base = demo_base()
    base["model"]["name_or_path"] = str(tiny_model_dir)
    base["output"]["dir"] = str(tmp_path_factory.mktemp("names") / "run")
    for task in base["tasks"].values():
        task["data"] += "?size=16"
        task["eval_size"] = 4
        task["rewards"] = ["mc_correct", {"fn": f"{__file__}:distinct_chars"}]
    # temperature 1.0, not the demo's 0.7: on this seed's path the one step then holds both
    # tasks' prompts, which this test needs (at 0.7 dynamic sampling kept only fairness's)
    base["rollout"].update(num_generations=2, max_completion_length=4, temperature=1.0)
    base["train"].update(micro_batch_size=4, gradient_accumulation_steps=1)  # 2 prompts
    base["algorithm"] = {"dynamic_sampling": True}
    base["model"]["precision"] = "fp16-mixed"  # its loss scale (float16 autocast on the CPU)
    base["curriculum"] = {"stages": [{"name": "first", "until": {"steps": 1}}, {"name": "next"}]}
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    trainer = GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))
    metrics = trainer.train_step()
    trainer.next_stage(metrics)
    return metrics, [(t.name, t.reward_labels) for t in ctx.tasks]


def test_a_step_writes_every_declared_name(one_step):
    metrics, tasks = one_step
    assert [name for name, _ in tasks] == ["fairness", "hallucination"]
    # the vLLM engine's metrics need a GPU: tests/integration/test_vllm*.py see them written
    declared = [m for m in names.STEP_METRICS if "vllm" not in m.when]
    # agent tasks' metrics: tests/unit/test_agent_train.py sees them written
    declared += [m.of(task) for m in names.PER_TASK for task, _ in tasks if "tools" not in m.when]
    declared += [m.of(task, label) for m in names.PER_OBJECTIVE for task, labels in tasks
                 for label in labels]
    assert [name for name in declared if name not in metrics] == []


def test_a_step_writes_no_undeclared_name(one_step):
    metrics, _ = one_step
    patterns = [*names.PER_TASK, *names.PER_OBJECTIVE, *names.PER_TOOL]
    undeclared = [key for key in metrics if key not in names.STEP_METRICS
                  and not any(p.matches(key) for p in patterns)
                  and not key.startswith(names.DYNAMIC_SAMPLING + "/")]
    assert undeclared == []


def spelled_names(path: Path) -> list[str]:
    """Metric-like strings written out in a file: literals, and f-strings' leading text."""
    found = []
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parts = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             for v in node.values}
    for node in ast.walk(tree):
        if id(node) in parts:  # an f-string's text: judged with its f-string
            continue
        if isinstance(node, ast.JoinedStr) and node.values:
            head = node.values[0]
            if isinstance(head, ast.Constant) and NAMESPACED.match(str(head.value)):
                found.append(f"line {node.lineno}: f{head.value!r}...")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and NAMESPACED.match(node.value) and " " not in node.value:
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


@pytest.mark.parametrize("module", USERS)
def test_readers_and_writers_take_every_name_from_the_registry(module):
    assert spelled_names(SRC / module) == []


def test_the_check_sees_a_spelled_name(tmp_path):
    source = tmp_path / "reader.py"
    source.write_text('def f(m, t):\n    return m["rollout/truncated_frac"], m[f"task/{t}/kl"]\n')
    assert spelled_names(source) == ["line 2: 'rollout/truncated_frac'", "line 2: f'task/'..."]


def test_per_task_names_and_their_patterns():
    assert names.TASK_REWARD.of("fairness") == "task/fairness/reward/mean"
    assert names.TASK_REWARD.keys(["task/fairness/reward/mean", "task/fairness/reward/fmt/mean",
                                   "task/code/reward/mean", "kl"]) == [
        "task/code/reward/mean", "task/fairness/reward/mean"]
    assert names.OBJECTIVE_MEAN.matches("task/fairness/reward/fmt/mean")
    assert not names.OBJECTIVE_MEAN.matches("task/fairness/judge/fmt/mean")
    assert names.PerObjective.objective("task/fairness/reward/fmt/mean") == "fairness/reward/fmt"
    assert names.task_of("task/fairness/kl") == "fairness" and names.task_of("kl") == "all tasks"

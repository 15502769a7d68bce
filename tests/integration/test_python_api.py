"""`mogrpo.train` from Python, on the shipped TRL-port example (examples/trl_port.py) with a
tiny chat model and a local dataset in place of the hub ones: TRL's reward functions, passed
as callables, train a policy, and config.yaml records them as import paths."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")
pytest.importorskip("math_verify")
datasets = pytest.importorskip("datasets")

EXAMPLE = Path(__file__).parents[2] / "examples" / "trl_port.py"
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def test_trl_port_example_trains_from_python(tmp_path, tiny_model):
    from mogrpo import train

    spec = importlib.util.spec_from_file_location("trl_port", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)

    model = tmp_path / "chat_model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    datasets.Dataset.from_dict({  # DeepMath's columns: a chat prompt and a LaTeX solution
        "prompt": [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(8)],
        "solution": [f"${2 * i}$" for i in range(8)],
    }).save_to_disk(str(tmp_path / "deepmath"))
    config = example.make_config(
        model={"name_or_path": str(model)},
        tasks={"math": {"data": str(tmp_path / "deepmath")}},  # replaces the hub source
        rollout={"num_generations": 2, "max_prompt_length": 32, "max_completion_length": 8},
        train={"micro_batch_size": 4, "gradient_accumulation_steps": 1, "max_steps": 1},
        eval={"at_start": False},
        logging={"trackers": [], "progress_bar": False},
        output={"dir": str(tmp_path / "run")},
    )
    summary = train(config)

    run = tmp_path / "run"
    assert summary["tasks"] == ["math"] and (run / "final").is_dir()
    (metrics,) = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"task/math/reward/accuracy_reward/mean",
            "task/math/reward/think_format_reward/mean"} <= metrics.keys()
    assert metrics["task/math/beta"] == 0.0
    written = yaml.safe_load((run / "config.yaml").read_text())["tasks"]["math"]["rewards"]
    assert [r["fn"] for r in written] == ["trl.rewards.accuracy_rewards:accuracy_reward",
                                          "trl.rewards.format_rewards:think_format_reward"]
    assert len((run / "completions.jsonl").read_text().splitlines()) == 4

"""A run of an agent task with a mapping of environments (picked by each row's `environment`
column), one of them with an async `get_reward`; the completions log shows whole episodes.
The tool calls come from the fake vLLM (`fake_agent.tool_calling_script`)."""

from __future__ import annotations

import json
import re

from fake_agent import AsyncCounter, Counter, calculator, digits, use_fake_vllm


def test_dict_environments_async_reward_and_whole_episodes_logged(tmp_path, tiny_model,
                                                                  monkeypatch):
    import mogrpo

    use_fake_vllm(monkeypatch, tiny_model)
    data = tmp_path / "rows.jsonl"
    kinds = ["plain", "async"]
    data.write_text("".join(json.dumps({"prompt": f"Count {i} ({kinds[i % 2]})",
                                        "environment": kinds[i % 2]}) + "\n" for i in range(8)))
    mogrpo.train({
        "model": {"name_or_path": str(tiny_model), "chat_template": "tiny_tools"},
        "output": {"dir": str(tmp_path / "run")},
        "rollout": {"num_generations": 2, "max_completion_length": 160, "engine": "vllm"},
        "train": {"max_steps": 1, "micro_batch_size": 8, "gradient_accumulation_steps": 1},
        "sft": {"enabled": False}, "eval": {"at_start": False},
        "logging": {"progress_bar": False, "log_completions": True},
        "tasks": {"calc": {"data": str(data), "rewards": [digits], "tools": [calculator],
                           "environment": {"plain": Counter, "async": AsyncCounter},
                           "max_tool_calling_iterations": 1}}})

    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text()
            .splitlines()]
    assert len(rows) == 8 and {"(plain)", "(async)"} == {
        re.search(r"\((\w+)\)", r["prompt"]).group(0) for r in rows}
    for row in rows:
        text = row["completion"]
        # the whole episode: the call, the tool's result, the turn after it
        call = json.loads(re.search(r"<tool_call>(.*?)</tool_call>", text).group(1))
        result = re.search(r"<tool_response>(.*?)</tool_response>\s*(\S+)", text)
        assert result is not None, text
        count = call["arguments"]["step"] if call["name"] == "increment" else 0
        if call["name"] == "increment":
            assert result.group(1) == str(count)
        else:
            assert result.group(1) == str(eval(call["arguments"]["expression"]))  # noqa: S307
        # each row is scored by its own environment's get_reward, the other's is None
        mine, other = ("Counter", "AsyncCounter") if "(plain)" in row["prompt"] \
            else ("AsyncCounter", "Counter")
        assert row[f"reward/{mine}"] == float(count) and row[f"reward/{other}"] is None
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines() if "event" not in json.loads(x)]
    asynced = [r["reward/AsyncCounter"] for r in rows if "(async)" in r["prompt"]]
    assert metrics[-1]["task/calc/reward/AsyncCounter/mean"] == sum(asynced) / len(asynced)


def test_trl_agent_port_example_trains_with_its_environment_unchanged(tmp_path, tiny_model,
                                                                     monkeypatch):
    """examples/trl_agent_port.py, on the tiny model: its TRL-shaped environment's tool is
    called and its reward function reads the environments."""
    import importlib.util
    from pathlib import Path

    import mogrpo

    path = Path(__file__).parents[2] / "examples" / "trl_agent_port.py"
    spec = importlib.util.spec_from_file_location("trl_agent_port", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    use_fake_vllm(monkeypatch, tiny_model)
    mogrpo.train(example.make_config(
        model={"name_or_path": str(tiny_model), "chat_template": "tiny_tools"},
        output={"dir": str(tmp_path / "run")},
        rollout={"num_generations": 2, "max_completion_length": 160, "engine": "vllm"},
        train={"max_steps": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 1},
        sft={"enabled": False}, eval={"at_start": False},
        logging={"progress_bar": False, "log_completions": True}))
    rows = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text()
            .splitlines()]
    increments = [r for r in rows if '"name": "increment"' in r["completion"]]
    assert increments and all(re.search(r"<tool_response>\d</tool_response>", r["completion"])
                              for r in increments)  # the counter after one step of 1..4
    assert {r["reward/reward_func"] for r in rows} == {0.0}  # none reached 10

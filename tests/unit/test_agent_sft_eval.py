"""An agent task's warm-up and greedy eval see what its episodes see: the warm-up's prompt lists
the tools, a worked episode (TRL's conversational completion) trains on the assistant turns
only, its inserted text tokenized as an episode inserts it; the quick-eval runs greedy
episodes with their tools and environments and reports how many called a tool."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mogrpo.errors import ConfigError

HELPERS = Path(__file__).parents[1] / "fake_agent.py"
CALL = {"type": "function", "function": {"name": "calculator",
                                         "arguments": {"expression": "2 + 3"}}}
WORKED = [{"role": "assistant", "content": "", "tool_calls": [CALL]},
          {"role": "tool", "name": "calculator", "content": "5"},
          {"role": "assistant", "content": "It is 5."}]


def _context(tmp_path, model_dir, rows: list[dict], **sections):
    from mogrpo.config import load_config
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context, seed_everything

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = {"data": str(data), "rewards": [f"{HELPERS}:digits"],
            "tools": [f"{HELPERS}:calculator"], **sections.pop("task", {})}
    base = {"model": {"name_or_path": str(model_dir), "chat_template": "tiny_tools"},
            "output": {"dir": str(tmp_path / "run")}, "sft": {"enabled": True},
            "rollout": {"num_generations": 2, "max_completion_length": 96},
            "tasks": {"calc": task}, **sections}
    config, _ = load_config(None, [], base=base)
    seed_everything(0)
    return build_context(config, load_tasks(config))


def test_a_worked_episode_trains_the_assistant_turns_and_inserts_as_an_episode(tmp_path,
                                                                              tiny_model_dir):
    from mogrpo.rollout.episodes import insertion_text
    from mogrpo.rollout.tools import ToolCall, ToolResult
    from mogrpo.trainer.sft import build_sft_examples

    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": WORKED}]
    ctx = _context(tmp_path, tiny_model_dir, rows)
    tok = ctx.tokenizer
    [(ids, trained)] = build_sft_examples(ctx)
    start = trained.index(1)
    prompt = tok.decode(ids[:start])
    assert "Tools: calculator(expression)" in prompt  # listed, as in the rollout's prompt
    assert prompt.endswith("What is 2 + 3?<|eot|>\n<|assistant|>\n")
    runs, i = [], start  # the runs of trained / inserted tokens after the prompt
    while i < len(ids):
        j = i
        while j < len(ids) and trained[j] == trained[i]:
            j += 1
        runs.append((trained[i], ids[i:j]))
        i = j
    assert [flag for flag, _ in runs] == [1, 0, 1]
    assert tok.decode(runs[0][1]) == ('<tool_call>{"name": "calculator", "arguments": '
                                      '{"expression": "2 + 3"}}</tool_call><|eot|>')
    # what lies between the turns is exactly what an episode inserts after this call
    inserted = insertion_text(tok, [ToolCall("calculator", {"expression": "2 + 3"})],
                              [ToolResult("calculator", "5")], "<|eot|>")
    assert runs[1][1] == tok(inserted, add_special_tokens=False)["input_ids"]
    assert tok.decode(runs[2][1]) == "It is 5.<|eot|>"  # and the episode ends at its stop


def test_a_worked_episode_must_end_with_the_answer(tmp_path, tiny_model_dir):
    from mogrpo.trainer.sft import build_sft_examples

    rows = [{"prompt": [{"role": "user", "content": "What is 2 + 3?"}],
             "completion": WORKED[:2]}]
    ctx = _context(tmp_path, tiny_model_dir, rows)
    with pytest.raises(ConfigError, match=r"tasks.calc: .*rows.jsonl:1: completion: a "
                                          "conversational completion must end with an "
                                          "assistant message"):
        build_sft_examples(ctx)


def test_the_quick_eval_runs_greedy_episodes_with_tools_and_environments(tmp_path,
                                                                         tiny_model_dir,
                                                                         monkeypatch):
    import mogrpo.eval.quick_eval as quick_eval
    from fake_agent import use_fake_vllm

    use_fake_vllm(monkeypatch, tiny_model_dir)
    rows = [{"prompt": f"What is {i} + {i}?"} for i in range(12)]
    ctx = _context(tmp_path, tiny_model_dir, rows, sft={"enabled": False},
                   rollout={"engine": "vllm", "num_generations": 2,
                            "max_completion_length": 192},
                   eval={"reward": "Counter"},
                   task={"environment": f"{HELPERS}:Counter", "eval_size": 4,
                         "max_tool_calling_iterations": 1})
    seen, sample = [], quick_eval.agent_rollout
    monkeypatch.setattr(quick_eval, "agent_rollout",
                        lambda *a, **kw: seen.append(sample(*a, **kw)) or seen[-1])
    result = quick_eval.evaluate(ctx, samples=4)["calc"]

    [rollout] = seen
    envs = [e.environment for e in rollout.episodes]
    assert all(sum(e.calls.values()) == 1 for e in rollout.episodes)  # each called a tool
    assert result.tool_call_frac == 1.0
    # scored by the environment's get_reward, so each row's environment reached the reward
    assert result.score == pytest.approx(sum(env.count for env in envs) / len(envs))
    assert all("<tool_response>" in completion for _, completion in result.samples)
    metrics = result.as_metrics("calc")
    assert metrics["eval/calc/tool_call_frac"] == 1.0
    table = quick_eval.format_quick_eval(0, {"calc": vars(result), "plain": {
        "score": 0.5, "truncated_frac": 0.0, "mean_length": 3.0}}, {}, {})
    assert table.endswith("\n  tool call  C 100.0% P -")


def test_eval_reward_may_name_an_environment_s_objective(tmp_path, tiny_model_dir):
    from mogrpo.config import load_config

    base = {"model": {"name_or_path": str(tiny_model_dir)},
            "tasks": {"calc": {"data": "x.jsonl", "rewards": [f"{HELPERS}:digits"],
                               "environment": f"{HELPERS}:Counter"}}}
    load_config(None, ["eval.reward=Counter"], base=base)  # the environment's get_reward
    with pytest.raises(ConfigError, match=r"eval.reward = 'Count' is not a reward of task "
                                          r"'calc' \(it has digits, Counter\)"):
        load_config(None, ["eval.reward=Count"], base=base)


def test_a_task_without_tools_reports_no_tool_call_rate():
    from mogrpo.eval.quick_eval import TaskEval

    plain = TaskEval(score=0.5, truncated_frac=0.0, mean_length=3.0, num_samples=2, reward="r")
    assert "eval/t/tool_call_frac" not in plain.as_metrics("t")


def test_split_digits_gives_each_digit_a_token_of_its_own():
    from mogrpo.modeling.tiny import train_tokenizer

    texts = ["the result is 1234 and 5678"] * 20
    split = train_tokenizer(texts, 300, 64, split_digits=True)
    whole = train_tokenizer(texts, 300, 64)
    assert [split.decode([i]) for i in split("1234", add_special_tokens=False)["input_ids"]] \
        == ["1", "2", "3", "4"]
    assert len(whole("1234", add_special_tokens=False)["input_ids"]) < 4  # merged as before

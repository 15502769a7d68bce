"""`tasks.NAME.rollout_func` as TRL 1.16 defines it: `rollout_func(prompts, trainer)` gets
each prompt K times and returns `prompt_ids`, `completion_ids`, `logprobs` and an `env_mask`;
mogrpo trains on that rollout with only the env_mask's 1s in the loss."""

from __future__ import annotations

import json

import pytest
import torch

from mogrpo.errors import MogrpoError

SEEN: dict = {}


def two_turns(prompts: list, trainer) -> dict:
    """A hand-written rollout in TRL's shape: a 'model turn', an environment's reply
    (env_mask 0), a second model turn ending with EOS."""
    tok = trainer.processing_class
    SEEN.update(prompts=prompts, num_generations=trainer.num_generations,
                budget=trainer.args.max_completion_length)
    out: dict = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [],
                 "echo": []}
    for i, prompt in enumerate(prompts):
        text = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        first = tok(f"look {i % 2}", add_special_tokens=False)["input_ids"]
        reply = tok(" [sees 42] ", add_special_tokens=False)["input_ids"]
        second = tok("done" * (1 + i % 3), add_special_tokens=False)["input_ids"] + \
            [tok.eos_token_id]
        out["prompt_ids"].append(tok(text, add_special_tokens=False)["input_ids"])
        out["completion_ids"].append(first + reply + second)
        out["logprobs"].append([-1.0] * (len(first) + len(reply) + len(second)))
        out["env_mask"].append([1] * len(first) + [0] * len(reply) + [1] * len(second))
    SEEN["output"] = out
    return out


def length_reward(prompts, completions, **kwargs) -> list[float]:
    return [float(len(c)) for c in completions]


def _config(tmp_path, model_dir, **task):
    from mogrpo.config import load_config

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}]})
                            + "\n" for i in range(8)))
    base = {"model": {"name_or_path": str(model_dir)},
            "output": {"dir": str(tmp_path / "run")},
            "rollout": {"num_generations": 2, "max_completion_length": 48},
            "train": {"max_steps": 1, "micro_batch_size": 4, "gradient_accumulation_steps": 1},
            "sft": {"enabled": False},
            "tasks": {"env": {"data": str(data), "rewards": [length_reward], **task}}}
    return load_config(None, [], base=base)[0]


def test_a_step_trains_on_a_hand_written_rollout_func(tmp_path, tiny_model_dir, monkeypatch):
    import mogrpo.trainer.update as update
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    config = _config(tmp_path, tiny_model_dir, rollout_func=two_turns)
    assert json.loads(config.model_dump_json())["tasks"]["env"]["rollout_func"].endswith(
        "test_rollout_func:two_turns")  # saved with the run as a spec
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    trainer = GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))
    masks, loss = [], update.grpo_loss
    monkeypatch.setattr(update, "grpo_loss", lambda logp, old, adv, mask, **kw: (
        masks.append(mask.clone()), loss(logp, old, adv, mask, **kw))[1])
    seen, draw = {}, trainer.generate
    monkeypatch.setattr(trainer, "generate", lambda picks: seen.setdefault("ro", draw(picks)))
    metrics = trainer.train_step()

    # called as TRL calls it: each prompt K times, messages as they are, the trainer's budget
    prompts = SEEN["prompts"]
    assert len(prompts) == 4 and prompts[0] == prompts[1] and prompts[0][0]["role"] == "user"
    assert SEEN["num_generations"] == 2 and SEEN["budget"] == 48
    ro, out = seen["ro"], SEEN["output"]
    for b, (ids, env_mask) in enumerate(zip(out["completion_ids"], out["env_mask"],
                                            strict=True)):
        n = len(ids)
        assert ro.completion_ids[b, :n].tolist() == ids and int(ro.lengths[b]) == n
        assert ro.generated_mask[b, :n].tolist() == env_mask  # env_mask -> the training mask
        assert ro.generated_mask[b, n:].sum() == 0
        assert ro.prompt_ids[b][ro.prompt_mask[b].bool()].tolist() == out["prompt_ids"][b]
    assert not ro.truncated.any()  # each ends with EOS
    assert "[sees 42]" in ro.texts[0]  # the environment's reply is in the episode's text
    # the loss counts exactly the sampled tokens: every env_mask 1, no inserted token
    assert sum(int(m.sum()) for m in masks) == sum(sum(m) for m in out["env_mask"])
    assert metrics["task/env/reward/length_reward/mean"] > 0


def test_rollout_func_is_checked_when_the_config_is_read(tmp_path, tiny_model_dir):
    from mogrpo.tasks.task import load_tasks

    with pytest.raises(MogrpoError, match="rollout_func samples the whole rollout itself"):
        _config(tmp_path, tiny_model_dir, rollout_func=two_turns, tools=[length_reward])
    with pytest.raises(MogrpoError, match="rollout_func entry 'two_turns' names no object"):
        _config(tmp_path, tiny_model_dir, rollout_func="two_turns")
    with pytest.raises(MogrpoError, match="tasks.env.rollout_func: .*SEEN' is a dict, not a function"):
        load_tasks(_config(tmp_path, tiny_model_dir, rollout_func=f"{__file__}:SEEN"))


def test_a_malformed_output_names_the_key_and_the_fix(tiny_policy):
    from mogrpo.rollout.custom import RolloutFuncError, rollout_from_output

    _, tok = tiny_policy
    kwargs = dict(num_generations=2, rows=2, stop_ids=[tok.eos_token_id],
                  max_completion_length=8, record_logprobs=True, device=torch.device("cpu"))
    with pytest.raises(RolloutFuncError, match=r"must return keys \['logprobs'\]"):
        rollout_from_output({"prompt_ids": [[1], [1]], "completion_ids": [[2], [2]]}, tok,
                            **kwargs)
    with pytest.raises(RolloutFuncError, match="completion_ids has 1 entries for 2 prompts"):
        rollout_from_output({"prompt_ids": [[1], [1]], "completion_ids": [[2]],
                             "logprobs": [[0.0], [0.0]]}, tok, **kwargs)
    with pytest.raises(RolloutFuncError, match="row 1: env_mask has 1 entries for 2"):
        rollout_from_output({"prompt_ids": [[1], [1]], "completion_ids": [[2], [2, 3]],
                             "logprobs": [[0.0], [0.0, 0.0]], "env_mask": [[1], [1]]}, tok,
                            **kwargs)
    # a long one is cut at the budget and counts as truncated; logprobs 0 where inserted
    ro = rollout_from_output({"prompt_ids": [[1], [1, 5]], "completion_ids": [[7] * 12, [2]],
                              "logprobs": [[-0.5] * 12, [-0.25]],
                              "env_mask": [[1, 0] * 6, [1]]}, tok, **kwargs)
    assert ro.lengths.tolist() == [8, 1] and ro.truncated.tolist() == [True, 2 != tok.eos_token_id]
    assert ro.sampler_logp[0].tolist() == [-0.5, 0.0] * 4
    assert ro.prompt_ids[0].tolist()[-1] == 1 and ro.prompt_mask.tolist() == [[0, 1], [1, 1]]


def with_fields(prompts: list, trainer) -> dict:
    """`two_turns` plus extra keys, as a TRL rollout_func returns them: a per-row list, a
    value for every row, and a list that covers only the first row and names a data column."""
    out = two_turns(prompts, trainer)
    out["seen_by_env"] = [f"row {i}" for i in range(len(prompts))]
    out["server"] = {"name": "sim", "version": 3}
    out["topic"] = ["from the rollout"]
    return out


def fields_reward(prompts, completions, seen_by_env, server, topic, **kwargs) -> list[float]:
    SEEN.update(reward_kwargs={"seen_by_env": seen_by_env, "server": server, "topic": topic,
                               "env_mask given": "env_mask" in kwargs})
    return [float(s.endswith(("0", "2"))) for s in seen_by_env]


def test_a_rollout_func_s_other_keys_reach_the_reward_functions_as_in_trl(tmp_path,
                                                                           tiny_model_dir):
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                        "topic": f"column {i}"}) + "\n" for i in range(8)))
    config = _config(tmp_path, tiny_model_dir, rollout_func=with_fields, data=str(data),
                     rewards=[fields_reward])
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    trainer = GRPOTrainer(ctx, make_reference(ctx.policy, needed=True))
    picks = trainer.draw_prompts()
    batch = trainer.score(picks, trainer.generate(picks))

    kwargs = SEEN["reward_kwargs"]
    # a list: row i its item i; anything else: every row; env_mask is the mask, not a field
    assert kwargs["seen_by_env"] == [f"row {i}" for i in range(4)]
    assert kwargs["server"] == [{"name": "sim", "version": 3}] * 4
    assert kwargs["env_mask given"] is False
    # the field takes the column's place; rows the list does not reach keep the column's value
    columns = [ex.columns["topic"] for _, ex in picks for _ in range(2)]
    assert kwargs["topic"] == ["from the rollout", *columns[1:]]
    assert batch.rewards[0][:, 0].tolist() == [1.0, 0.0]  # rows 0, 1 of group 0
    assert batch.rewards[1][:, 0].tolist() == [1.0, 0.0]  # rows 2, 3 of group 1


def test_extra_fields_follow_trl_and_refuse_the_trainer_s_own_names():
    from mogrpo.rollout.custom import RolloutFuncError, extra_fields

    required = {"prompt_ids": [[1]] * 3, "completion_ids": [[2]] * 3, "logprobs": [[0.0]] * 3,
                "env_mask": [[1]] * 3}
    assert extra_fields(required, 3, "f") is None
    rows = extra_fields({**required, "score": [0.5, 1.5, 2.5], "meta": (1, 2),
                         "short": ["a"], "empty": []}, 3, "f")
    assert rows == [{"score": 0.5, "meta": (1, 2), "short": "a"},
                    {"score": 1.5, "meta": (1, 2)}, {"score": 2.5, "meta": (1, 2)}]
    with pytest.raises(RolloutFuncError, match="returned key 'trainer_state', a name the "
                                               "trainer itself passes"):
        extra_fields({**required, "trainer_state": [1, 2, 3]}, 3, "tasks.env.rollout_func")


def test_the_quick_eval_of_a_rollout_func_task_goes_through_it(tmp_path, tiny_model_dir):
    from mogrpo.eval.quick_eval import evaluate
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context, seed_everything

    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"q{i}"}],
                                        "topic": f"column {i}"}) + "\n" for i in range(8)))
    config = _config(tmp_path, tiny_model_dir, rollout_func=with_fields, data=str(data),
                     rewards=[fields_reward], eval_size=3)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    result = evaluate(ctx)["env"]
    # one rollout per held-out prompt, scored with the fields the rollout_func returned
    assert SEEN["num_generations"] == 1 and len(SEEN["prompts"]) == 3
    assert SEEN["reward_kwargs"]["seen_by_env"] == ["row 0", "row 1", "row 2"]
    assert result.score == pytest.approx(2 / 3) and result.tool_call_frac is None

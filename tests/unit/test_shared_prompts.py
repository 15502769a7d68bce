"""Each distinct prompt runs once in the training forward: the same log-probs and gradients as
one pass over every row, on every family that takes this path, and the one pass elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

import mogrpo.algo.logprobs as logprobs
from mogrpo import kernels
from mogrpo.algo.logprobs import SHARED_PROMPT_TYPES, completion_logprobs, shares_prompts

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: architectures
from architectures import FAMILIES, family_config  # noqa: E402
from grpo_batch import shared_prompt_batch  # noqa: E402

V = 300
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def _model(family: str, **changes) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "qwen3":  # not among the architecture matrix's families
        config = AutoConfig.for_model("qwen3", vocab_size=V, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, head_dim=8, **IDS)
    else:
        config = family_config(family, vocab_size=V, **changes)
    model = AutoModelForCausalLM.from_config(config).float()
    with torch.no_grad():  # RMSNorms' weights not all ones (Gemma's: zeros), so that they count
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.uniform_(0.5, 1.5)
    for module in model.modules():  # dropout off, as mogrpo loads models (disable_dropout)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model.train()


def _batch(K: int = 3):
    return shared_prompt_batch(V, K)


def _logprobs_and_grads(model, batch, monkeypatch, *, shared: bool,
                        min_saved: float | None = 0.0):
    with monkeypatch.context() as m:
        if not shared:
            m.setattr(logprobs, "shares_prompts", lambda model: False)
        logp, _ = completion_logprobs(model, *batch, temperature=0.8, min_saved=min_saved)
    logp.sum().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return logp.detach(), grads


def _forward_rows(model, batch, monkeypatch,
                  min_saved: float | None = 0.0) -> list[tuple[int, int]]:
    """(rows, tokens) of each forward the model's embedding saw."""
    seen = []
    handle = model.get_input_embeddings().register_forward_hook(
        lambda module, args, out: seen.append(tuple(args[0].shape)))
    try:
        _logprobs_and_grads(model, batch, monkeypatch, shared=True, min_saved=min_saved)
    finally:
        handle.remove()
    return seen


CASES = [(f, {}) for f in FAMILIES] + [("qwen3", {}), ("gemma2", {"sliding_window": 4}),
                                       ("mistral", {"sliding_window": 4})]


@pytest.mark.parametrize(("family", "changes"), CASES,
                         ids=[f + ("-window4" if c else "") for f, c in CASES])
def test_each_prompt_runs_once_with_the_one_pass_values(family, changes, monkeypatch):
    model = _model(family, **changes)
    batch = _batch()
    model_type = model.config.model_type
    if model_type not in SHARED_PROMPT_TYPES:
        assert not shares_prompts(model)
        assert _forward_rows(model, batch, monkeypatch) == [(9, 7 + 6)]  # one pass, every row
        return
    assert shares_prompts(model)
    # one forward over the 3 distinct prompts, one over the 9 completions (their last token
    # predicts nothing)
    assert _forward_rows(model, batch, monkeypatch) == [(3, 7), (9, 5)]
    shared, shared_grads = _logprobs_and_grads(model, batch, monkeypatch, shared=True)
    plain, plain_grads = _logprobs_and_grads(model, batch, monkeypatch, shared=False)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert len(shared_grads) == len(plain_grads) == len(list(model.parameters()))
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_opt_is_left_out_because_the_cache_path_gives_other_values(monkeypatch):
    # the negative control: forcing OPT onto the cache path changes its log-probs, which is
    # why it is not in SHARED_PROMPT_TYPES (and shows the comparison above can fail)
    model = _model("opt")
    batch = _batch()
    monkeypatch.setattr(logprobs, "SHARED_PROMPT_TYPES", SHARED_PROMPT_TYPES | {"opt"})
    shared, _ = _logprobs_and_grads(model, batch, monkeypatch, shared=True)
    plain, _ = _logprobs_and_grads(model, batch, monkeypatch, shared=False)
    assert (shared - plain).abs().max() > 1e-2


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft on transformers 5
def test_lora_adapters_get_the_one_pass_gradients(monkeypatch):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_model("llama"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules="all-linear",
                                                      init_lora_weights=False))
    assert shares_prompts(model)
    batch = _batch(K=4)
    shared, shared_grads = _logprobs_and_grads(model, batch, monkeypatch, shared=True)
    plain, plain_grads = _logprobs_and_grads(model, batch, monkeypatch, shared=False)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert len(shared_grads) == 2 * 7 * 2  # A and B of 7 linears in 2 layers: adapters only
    for a, b in zip(shared_grads, plain_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_distinct_prompts_and_single_tokens(monkeypatch):
    model = _model("qwen2")
    prompt_ids, prompt_mask, completion_ids, completion_mask = _batch(K=1)  # all different
    assert _forward_rows(model, (prompt_ids, prompt_mask, completion_ids, completion_mask),
                         monkeypatch) == [(3, 13)]
    # one completion token: the prompts' forward alone predicts it
    batch = _batch(K=2)
    one = (batch[0], batch[1], batch[2][:, :1], torch.ones_like(batch[3][:, :1]))
    assert _forward_rows(model, one, monkeypatch) == [(3, 7)]
    shared, _ = _logprobs_and_grads(model, one, monkeypatch, shared=True)
    plain, _ = _logprobs_and_grads(model, one, monkeypatch, shared=False)
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)


def test_each_device_asks_its_own_saving():
    # a CPU shares whatever it saves; elsewhere (CUDA) half of the pass's tokens must go
    assert kernels.prompt_sharing_min_saved("cpu") == 0.0
    assert kernels.prompt_sharing_min_saved("cuda") == 0.5
    assert logprobs.sharing_pays(1, 1000, 0.0) and not logprobs.sharing_pays(0, 1000, 0.0)
    assert logprobs.sharing_pays(500, 1000, 0.5) and not logprobs.sharing_pays(499, 1000, 0.5)


def test_sharing_only_where_it_saves_enough(monkeypatch):
    model = _model("qwen2")
    batch = _batch()  # 9 rows: sharing skips 6 × 7 of the 9 × 13 prompt and completion tokens
    assert _forward_rows(model, batch, monkeypatch, 0.0) == [(3, 7), (9, 5)]
    assert _forward_rows(model, batch, monkeypatch, None) == [(9, 13)]  # never
    # half the tokens asked for (the CUDA rule): 36 % is not enough
    searched = []
    find = logprobs.distinct_prompts
    monkeypatch.setattr(logprobs, "distinct_prompts", lambda *a: searched.append(1) or find(*a))
    assert _forward_rows(model, batch, monkeypatch, 0.5) == [(9, 13)]
    # even one prompt for all 9 rows would save 8 × 7 of 117 tokens: not searched for (on a GPU
    # the search waits for the device)
    assert searched == []
    # one completion token each: the prompts are 42 of the 72 tokens (58 %), shared
    one = (batch[0], batch[1], batch[2][:, :1], torch.ones_like(batch[3][:, :1]))
    assert _forward_rows(model, one, monkeypatch, 0.5) == [(3, 7)]
    assert searched
    # and the one pass gives the shared pass's log-probs
    whole, _ = _logprobs_and_grads(model, batch, monkeypatch, shared=True, min_saved=0.5)
    shared, _ = _logprobs_and_grads(model, batch, monkeypatch, shared=True, min_saved=0.0)
    torch.testing.assert_close(whole, shared, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("mode", "device", "expected"),
                         [("auto", "cpu", 0.0), ("auto", "cuda", 0.5), ("on", "cuda", 0.0),
                          ("off", "cpu", None)])
def test_the_trainer_passes_train_prompt_sharing(mode, device, expected):
    from types import SimpleNamespace

    from mogrpo.trainer.update import UpdatePhases

    trainer = SimpleNamespace(
        config=SimpleNamespace(train=SimpleNamespace(prompt_sharing=mode)),
        ctx=SimpleNamespace(device=torch.device(device)))
    assert UpdatePhases._prompt_sharing(trainer) == expected


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers 5 renames the method
def test_gradient_checkpointing_keeps_the_one_pass():
    # checkpointing recomputes each layer in the backward and turns the cache off
    model = _model("llama")
    assert shares_prompts(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert not shares_prompts(model)
    from mogrpo.rollout.scoring import score_hidden

    assert score_hidden(model, *_batch()) is None  # nor mogrpo's forward, which keeps all


WRAPPED = """
import sys, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM
sys.path.insert(0, sys.argv[2])
from architectures import family_config
from mogrpo.algo.logprobs import shares_prompts
from mogrpo.rollout.scoring import score_hidden
from mogrpo.trainer.distributed import DRAIN_S
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
model = AutoModelForCausalLM.from_config(family_config("llama", vocab_size=300))
sharded = AutoModelForCausalLM.from_config(family_config("qwen2", vocab_size=300))
for layer in sharded.model.layers:
    fully_shard(layer)
fully_shard(sharded)
ddp = torch.nn.parallel.DistributedDataParallel(model)
print(shares_prompts(model), shares_prompts(ddp), shares_prompts(sharded))
ids, mask = torch.tensor([[5, 6, 7], [5, 6, 7]]), torch.ones(2, 3, dtype=torch.long)
with torch.no_grad():  # the scoring forward reads weights directly: not FSDP2's shards
    print(score_hidden(model, ids, mask, ids, mask) is not None,
          score_hidden(sharded, ids, mask, ids, mask) is None)
# with gradients: the model's own, never through DDP (its forward prepares the reduction)
print(score_hidden(model, ids, mask, ids, mask) is not None,
      score_hidden(ddp, ids, mask, ids, mask) is None)
dist.barrier()
dist.destroy_process_group()
time.sleep(DRAIN_S)  # gloo's threads finish before the interpreter shuts down
"""


def test_ddp_and_fsdp2_keep_the_one_pass_and_fsdp2_its_own_forward(tmp_path):
    # their hooks expect one forward per backward (a one-process gloo group, in a process of
    # its own, left as trainer/distributed.process_group leaves one)
    from multiproc import run

    tests = str(Path(__file__).resolve().parents[1])
    done = run(["-c", WRAPPED, str(tmp_path / "store"), tests])
    assert done.stdout.split() == ["True", "False", "False", "True", "True", "True", "True"]


# mogrpo's own forward for passes without gradients (rollout/scoring.score_hidden)
SCORED = {"llama", "llama_tied", "qwen2", "qwen3", "gemma", "mistral", "phi3"}


@pytest.mark.parametrize(("family", "changes"), CASES,
                         ids=[f + ("-window4" if c else "") for f, c in CASES])
def test_scoring_forward_gives_the_models_log_probs_bit_for_bit(family, changes):
    from mogrpo.rollout.scoring import score_hidden

    model = _model(family, **changes).eval()
    batch = _batch()
    with torch.no_grad():
        expected, _ = completion_logprobs(model, *batch, temperature=0.8)
        scored = score_hidden(model, *batch)
        got, _ = completion_logprobs(model, *batch, temperature=0.8, forward=score_hidden)
    if family not in SCORED or changes:  # other layouts; a window shorter than the rows
        assert scored is None
    else:  # bit for bit: KL is exactly 0 while the policy equals its reference
        assert scored is not None and scored.shape == (9, 6, model.config.hidden_size)
    assert torch.equal(got, expected)


@pytest.mark.filterwarnings("ignore::FutureWarning")  # raised inside peft on transformers 5
def test_scoring_forward_reads_base_weights_only_with_adapters_off():
    from peft import LoraConfig, get_peft_model

    from mogrpo.rollout.scoring import score_hidden

    model = get_peft_model(_model("qwen2"), LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules="all-linear",
                                                      init_lora_weights=False)).eval()
    batch = _batch(K=2)
    with torch.no_grad():
        assert score_hidden(model, *batch) is None  # active adapters: the model's forward
        with model.disable_adapter():  # the KL reference under LoRA
            expected, _ = completion_logprobs(model, *batch)
            got, _ = completion_logprobs(model, *batch, forward=score_hidden)
            assert score_hidden(model, *batch) is not None
        adapted, _ = completion_logprobs(model, *batch)
    assert torch.equal(got, expected)
    assert (adapted - expected).abs().max() > 1e-3  # the adapters do change the log-probs


def test_scoring_forward_handles_one_token():
    from mogrpo.rollout.scoring import score_hidden

    model = _model("llama").eval()
    batch = _batch()
    one = (batch[0], batch[1], batch[2][:, :1], torch.ones_like(batch[3][:, :1]))
    with torch.no_grad():
        expected, _ = completion_logprobs(model, *one)
        got, _ = completion_logprobs(model, *one, forward=score_hidden)
    assert torch.equal(got, expected)


@pytest.fixture(params=["mkl", "onednn"])
def training_kernel(request, monkeypatch):
    """Both kernels the training products may run on (`cpu_linear.training_on_onednn`)."""
    from mogrpo.kernels.cpu import linear as cpu_linear

    if request.param == "onednn" and not cpu_linear.available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(cpu_linear, "training_on_onednn", lambda: request.param == "onednn")
    return request.param


@pytest.mark.parametrize("family", sorted(SCORED))
def test_the_update_forward_gives_the_models_log_probs_and_gradients(family, training_kernel):
    from mogrpo.rollout.scoring import score_hidden

    model = _model(family)
    batch = _batch()
    assert score_hidden(model, *batch) is not None  # with gradients: mogrpo's own forward
    expected, _ = completion_logprobs(model, *batch, temperature=0.8)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    got, _ = completion_logprobs(model, *batch, temperature=0.8, forward=score_hidden)
    got.sum().backward()
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    for p, e in zip(model.parameters(), expected_grads, strict=True):  # tied weights included
        torch.testing.assert_close(p.grad, e, atol=1e-5, rtol=1e-4)
    with torch.no_grad():  # the reference's pass: the same log-probs to the bit (KL exactly 0)
        scored, _ = completion_logprobs(model, *batch, temperature=0.8, forward=score_hidden)
    assert torch.equal(got.detach(), scored)


def test_the_update_forward_is_the_models_own_where_dropout_is_left():
    from mogrpo.rollout.scoring import score_hidden

    model = _model("llama")
    batch = _batch()
    model.model.layers[0].mlp.register_module("drop", torch.nn.Dropout(0.1))
    assert score_hidden(model, *batch) is None  # mogrpo's forward would skip the dropout
    with torch.no_grad():  # (no pass without gradients trains: the module is off there)
        assert score_hidden(model, *batch) is not None


def test_the_update_forward_keeps_a_compiled_models_own():
    from mogrpo.rollout.scoring import score_hidden, trains_here

    model = _model("llama")
    assert trains_here(model)
    compiled = torch.compile(model)  # (compiles nothing until called)
    assert not trains_here(compiled)
    assert score_hidden(compiled, *_batch()) is None

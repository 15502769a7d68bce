"""`model.precision`: updates at GRPO's learning rates survive under the default on GPUs
(bf16-mixed, run here on the CPU, where bfloat16 autocast runs too) and are lost in pure bf16;
config validation; `auto`'s resolution; LoRA adapters in float32 over a bfloat16 base; the pure
bf16 warning; fp16's loss scale; the rollout under autocast."""

from __future__ import annotations

import logging

import pytest
import torch

from mogrpo.config import load_config
from mogrpo.config.precision import FSDP_FP16, resolve_precision
from mogrpo.config.processes import check_processes
from mogrpo.config.sections import ModelConfig
from mogrpo.errors import ConfigError
from mogrpo.modeling.precision import Precision, lost_update_lr, resolve

LR = 1e-6  # GRPO's learning rates are 1e-6 .. 1e-5; the tiny model's weights are ~0.02


def run_config(model_dir, tmp_path, **model):
    from mogrpo.demo import demo_base

    base = demo_base()
    base["model"].update(name_or_path=str(model_dir), **model)
    base["output"]["dir"] = str(tmp_path / "run")
    for task in base["tasks"].values():
        task["data"] += "?size=16"
        task["eval_size"] = 4
    base["rollout"].update(num_generations=4, max_completion_length=8)
    base["train"].update(micro_batch_size=8, gradient_accumulation_steps=2, learning_rate=LR,
                         warmup_steps=0)
    return load_config(None, [], base=base)[0]


def trainer_for(model_dir, tmp_path, **model):
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.grpo import GRPOTrainer
    from mogrpo.trainer.run import build_context, seed_everything

    config = run_config(model_dir, tmp_path, **model)
    seed_everything(0)
    ctx = build_context(config, load_tasks(config))
    reference = make_reference(ctx.policy, needed=True, dtype=ctx.precision.compute_dtype)
    return ctx, GRPOTrainer(ctx, reference)


@pytest.fixture(scope="module")
def fixed_batch(tiny_model_dir, tmp_path_factory):
    """One rollout (sampled in float32) with fixed, non-zero advantages: every precision
    updates on the same batch, so only how it keeps and computes the weights differs."""
    _, trainer = trainer_for(tiny_model_dir, tmp_path_factory.mktemp("batch"))
    rollout = trainer.generate(trainer.draw_prompts())
    g = torch.Generator().manual_seed(0)
    advantages = torch.randn(rollout.batch_size, generator=g)
    return rollout, advantages


def one_update(model_dir, tmp_path, batch, **model):
    """(weights after - before, AdamW's intended step from its state; both float64, flat)."""
    from mogrpo.trainer.grpo import ScoredBatch

    ctx, trainer = trainer_for(model_dir, tmp_path, **model)
    rollout, advantages = batch
    n = rollout.batch_size
    scored = ScoredBatch(rollout, torch.zeros(n, dtype=torch.long), advantages.clone(),
                         torch.full((n,), 0.04))
    trainer.reference_logprobs(scored)
    params = [p for p in ctx.policy.parameters() if p.requires_grad]
    before = [p.detach().double().clone() for p in params]
    trainer.update(scored)
    assert trainer.skipped_updates == 0
    moved = torch.cat([(p.detach().double() - b).flatten() for p, b in zip(params, before,
                                                                          strict=True)])
    beta1, beta2 = trainer.config.train.adam_betas
    intended = []
    for p in params:  # torch AdamW's first step, weight decay 0, from its own m and v
        state = trainer.optimizer.state[p]
        m, v = state["exp_avg"].double(), state["exp_avg_sq"].double()
        denominator = (v.sqrt() / (1 - beta2) ** 0.5).add_(1e-8)
        intended.append((-LR / (1 - beta1) * m / denominator).flatten())
    return moved, torch.cat(intended)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_the_gpu_default_keeps_updates_that_pure_bf16_loses(tiny_model_dir, tmp_path,
                                                             fixed_batch):
    default = resolve_precision("auto", "auto", "cuda", bf16_supported=True)
    assert default == resolve_precision("auto", "bfloat16", "cuda") == "bf16-mixed"
    fp32, _ = one_update(tiny_model_dir, tmp_path, fixed_batch, precision="fp32")
    mixed, mixed_step = one_update(tiny_model_dir, tmp_path, fixed_batch, precision=default)
    pure, pure_step = one_update(tiny_model_dir, tmp_path, fixed_batch, precision="bf16")
    # float32: AdamW moves every weight, by about the learning rate
    assert float((fp32 != 0).double().mean()) == 1.0
    # the default: the weights move as in float32. Its bfloat16 products change the
    # gradients by ~1 %, enough to flip the sign of AdamW's (sign-like) first step for the
    # few weights whose gradient is ~0, so the update is compared by its size and direction,
    # and against the step AdamW computed from those gradients: none of it is rounded away
    assert float((mixed != 0).double().mean()) > 0.99
    assert abs(float(mixed.norm() / fp32.norm()) - 1) < 1e-2
    assert float(torch.nn.functional.cosine_similarity(mixed, fp32, dim=0)) > 0.99
    assert relative(mixed, mixed_step) < 1e-2
    # pure bf16: 1e-6 is below half a unit in the last place of a 0.02 weight (4e-5):
    # most updates round away (2 % of the weights move here: those below ~5e-4)
    assert float((pure != 0).double().mean()) < 0.05
    assert float(pure.norm() / fp32.norm()) < 0.3
    assert relative(pure, pure_step) > 0.9


def test_contradicting_dtype_and_precision_are_refused_with_the_fix(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError) as err:
        run_config(tiny_model_dir, tmp_path, precision="bf16-mixed", dtype="float32")
    assert ("model.dtype = float32 contradicts model.precision = bf16-mixed, which computes in "
            "bfloat16: `dtype` names the compute dtype. Remove model.dtype (or set it to "
            "bfloat16), or choose a precision that computes in float32: fp32") in str(err.value)
    with pytest.raises(ConfigError, match="choose a precision that computes in bfloat16: "
                       "bf16-mixed or bf16"):
        run_config(tiny_model_dir, tmp_path, precision="fp16-mixed", dtype="bfloat16")
    with pytest.raises(ConfigError, match=r"model.precision = 'bf16_mixed'.*'bf16-mixed'"):
        run_config(tiny_model_dir, tmp_path, precision="bf16_mixed")
    # agreeing values, and each alone, are fine
    for model in ({"precision": "bf16", "dtype": "bfloat16"}, {"precision": "fp32"},
                  {"dtype": "float16"}):
        run_config(tiny_model_dir, tmp_path, **model)


def test_fp16_loss_scaling_is_refused_over_fsdp_shards(tiny_model_dir, tmp_path):
    config = run_config(tiny_model_dir, tmp_path, dtype="float16")
    config.distributed.strategy = "fsdp"
    with pytest.raises(ConfigError) as err:
        check_processes(config, 2)
    assert str(err.value) == FSDP_FP16
    assert check_processes(config, 1) == "none"  # one process shards nothing


def test_auto_is_fp32_on_cpu_and_bf16_mixed_on_a_gpu_with_bfloat16(monkeypatch):
    cpu = resolve(ModelConfig(), torch.device("cpu"))
    assert cpu == Precision("fp32", "cpu") and not cpu.mixed
    assert cpu.load_dtype(lora=False) == cpu.compute_dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    gpu = resolve(ModelConfig(), torch.device("cuda"))
    assert gpu.name == "bf16-mixed" and gpu.device_type == "cuda"
    assert (gpu.master_dtype, gpu.compute_dtype) == (torch.float32, torch.bfloat16)
    # full fine-tuning loads float32 master weights; a frozen LoRA base loads in bfloat16
    assert gpu.load_dtype(lora=False) == torch.float32
    assert gpu.load_dtype(lora=True) == torch.bfloat16
    # model.dtype alone picks the precision; bfloat16 never means pure bf16
    assert [resolve(ModelConfig(dtype=d), torch.device("cuda")).name
            for d in ("float32", "bfloat16", "float16")] == ["fp32", "bf16-mixed", "fp16-mixed"]
    assert resolve(ModelConfig(precision="bf16"), torch.device("cuda")).master_dtype == \
        torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    assert resolve(ModelConfig(), torch.device("cuda")).name == "fp16-mixed"
    with pytest.raises(ConfigError, match="Tesla V100.*no bfloat16; use fp16-mixed"):
        resolve(ModelConfig(precision="bf16-mixed"), torch.device("cuda"))


def test_lora_adapters_are_float32_over_a_bfloat16_base(tiny_model_dir):
    from mogrpo.modeling.load import LoraSettings, load_policy

    policy, _ = load_policy(str(tiny_model_dir), dtype=torch.bfloat16, lora=LoraSettings(r=4))
    trained = {p.dtype for p in policy.parameters() if p.requires_grad}
    frozen = {p.dtype for p in policy.parameters() if not p.requires_grad}
    assert trained == {torch.float32} and frozen == {torch.bfloat16}
    # pure bf16 asks for bfloat16 adapters (peft would upcast them)
    policy, _ = load_policy(str(tiny_model_dir), dtype=torch.bfloat16, lora=LoraSettings(r=4),
                            adapter_dtype=torch.bfloat16)
    assert {p.dtype for p in policy.parameters()} == {torch.bfloat16}


def test_a_lora_run_loads_its_base_in_bfloat16_and_starts_at_kl_zero(tiny_model_dir, tmp_path,
                                                                     fixed_batch):
    from mogrpo.algo.logprobs import completion_logprobs
    from mogrpo.rollout.batching import micro_batch

    config = run_config(tiny_model_dir, tmp_path, precision="bf16-mixed")
    config.lora.enabled = True
    from mogrpo.modeling.reference import make_reference
    from mogrpo.tasks.task import load_tasks
    from mogrpo.trainer.run import build_context

    ctx = build_context(config, load_tasks(config))
    policy = ctx.policy
    assert {p.dtype for p in policy.parameters() if p.requires_grad} == {torch.float32}
    assert {p.dtype for p in policy.parameters() if not p.requires_grad} == {torch.bfloat16}
    reference = make_reference(policy, needed=True, dtype=ctx.precision.compute_dtype)
    args = micro_batch(fixed_batch[0], slice(0, 8))
    with ctx.precision.autocast():
        logp = completion_logprobs(policy, *args)[0]
        with reference.model() as ref:
            ref_logp = completion_logprobs(ref, *args)[0]
    assert logp.dtype == torch.float32  # log-prob math upcast from bfloat16 logits
    assert torch.equal(logp, ref_logp)  # B = 0: the adapters add exactly nothing


def test_full_fine_tuning_reference_is_a_compute_dtype_copy(tiny_model_dir, tmp_path):
    ctx, trainer = trainer_for(tiny_model_dir, tmp_path, precision="bf16-mixed")
    assert {p.dtype for p in ctx.policy.parameters()} == {torch.float32}
    frozen = trainer.reference._module
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16}
    assert not any(p.requires_grad for p in frozen.parameters())
    for (name, p), (_, q) in zip(ctx.policy.named_parameters(), frozen.named_parameters(),
                                 strict=True):
        assert torch.equal(p.detach().bfloat16(), q), name
    # buffers stay as a model loaded in bfloat16 keeps them (rotary frequencies in float32)
    assert {b.dtype for b in frozen.buffers()} == {b.dtype for b in ctx.policy.buffers()}


def test_pure_bf16_warns_once_at_startup_with_the_learning_rate_it_loses(
        tiny_model_dir, tmp_path, caplog):
    assert lost_update_lr(0.02) == pytest.approx(3.9e-5, rel=1e-2)  # 0.02 · 2^-9
    with caplog.at_level(logging.WARNING, logger="mogrpo"):
        trainer_for(tiny_model_dir, tmp_path, precision="bf16-mixed")
    assert not [r for r in caplog.records if "precision" in r.getMessage()]
    with caplog.at_level(logging.WARNING, logger="mogrpo"):
        ctx, _ = trainer_for(tiny_model_dir, tmp_path, precision="bf16")
    (record,) = [r for r in caplog.records if "model.precision = bf16" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.WARNING and "\n" not in message
    assert "an update below ~2^-8 ≈ 0.4 % of a weight rounds away" in message
    assert "updates are lost below lr ≈ 0.0" in message and " · 2^-9 = " in message
    assert "train.learning_rate = 1e-06: most of this run's updates will be lost" in message
    assert {p.dtype for p in ctx.policy.parameters()} == {torch.bfloat16}
    assert {s.dtype for s in _adamw_states(ctx)} <= {torch.bfloat16}


def _adamw_states(ctx) -> list[torch.Tensor]:
    from mogrpo.trainer.optim import build_optimizer

    optimizer = build_optimizer(ctx.policy, LR, 0.0, (0.9, 0.999))
    for p in ctx.policy.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return [s for state in optimizer.state.values() for k, s in state.items() if k != "step"]


def test_fp16_loss_scale_skips_an_overflow_and_keeps_accumulation_exact(
        tiny_model_dir, tmp_path, fixed_batch):
    from mogrpo.tracking import names
    from mogrpo.trainer.grpo import ScoredBatch

    rollout, advantages = fixed_batch
    n = rollout.batch_size

    def update(precision: str, accumulation: int = 1, scale: float = 2.0 ** 10):
        ctx, trainer = trainer_for(tiny_model_dir, tmp_path, precision=precision)
        trainer.config.train.micro_batch_size = n // accumulation
        if trainer.scaler.is_enabled():
            trainer.scaler.load_state_dict({**trainer.scaler.state_dict(), "scale": scale})
        scored = ScoredBatch(rollout, torch.zeros(n, dtype=torch.long), advantages.clone(),
                             torch.full((n,), 0.04))
        trainer.reference_logprobs(scored)
        before = torch.cat([p.detach().flatten().clone() for p in ctx.policy.parameters()])
        metrics = trainer.update(scored)
        after = torch.cat([p.detach().flatten() for p in ctx.policy.parameters()])
        return after - before, metrics, trainer

    moved, whole, _ = update("fp16-mixed")
    assert whole[names.LOSS_SCALE] == 2.0 ** 10 and float((moved != 0).float().mean()) > 0.99
    # the gradient norm is measured after unscaling: the float32 run's, and the same when the
    # scaled gradients of two micro-batches add up before the one unscale of the step (a
    # scale applied or removed per micro-batch would be off by 2^10)
    _, fp32, _ = update("fp32")
    _, halves, _ = update("fp16-mixed", accumulation=2)
    assert whole[names.GRAD_NORM] == pytest.approx(fp32[names.GRAD_NORM], rel=2e-2)
    assert halves[names.GRAD_NORM] == pytest.approx(whole[names.GRAD_NORM], rel=1e-2)
    # a scale at which the float16 gradients overflow: no update, the scale halved, and not a
    # "skipped update" (those count non-finite gradients the scaler cannot explain)
    moved, metrics, trainer = update("fp16-mixed", scale=2.0 ** 120)
    assert not moved.any() and metrics[names.LOSS_SCALE] == 2.0 ** 119
    assert trainer.skipped_updates == 0 and metrics[names.SKIPPED_UPDATES] == 0
    assert trainer.state_dict()["loss_scale"]["scale"] == 2.0 ** 119
    _, fresh = trainer_for(tiny_model_dir, tmp_path, precision="fp16-mixed")
    fresh.load_state_dict(trainer.state_dict())  # a resume goes on at the same scale
    assert fresh.scaler.get_scale() == 2.0 ** 119


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_native_rollout_under_autocast_decodes_as_generate_does(tiny_policy, dtype):
    from mogrpo.rollout import projections
    from mogrpo.rollout.generate import SamplingSettings, generate_rollout

    model, tokenizer = tiny_policy
    texts = ["the cat sat on", "answer the question because", "yes no A B"]
    greedy = SamplingSettings(max_new_tokens=12, greedy=True)

    def decode(engine: str) -> torch.Tensor:
        with torch.autocast("cpu", dtype=dtype):
            return generate_rollout(model, tokenizer, texts, greedy, num_generations=1,
                                    max_prompt_length=16, engine=engine).completion_ids

    with torch.autocast("cpu", dtype=dtype):
        plain = projections.decode_projections(model)
    # the fused copies in autocast's dtype (cast once a rollout, not at every step)
    assert {w.dtype for layer in plain.layers for w, _ in (layer.qkv, layer.gate_up)} == {dtype}
    assert not plain.pairs
    # the same greedy tokens as generate() under the same autocast (here all of them; two
    # kernels' bf16 roundings may flip a near-tie on another CPU, hence the margin)
    native, hf = decode("native"), decode("hf")
    assert native.shape == hf.shape and float((native == hf).float().mean()) >= 0.9

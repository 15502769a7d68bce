"""The planner's activation count against what autograd keeps, for eleven decoder families.

    python benchmarks/memory_architectures.py --out benchmarks/results/memory_architectures.md

For each family (tests/architectures.py) a random model of hidden 256, 4 layers, 4 heads and MLP
width 1024 (vocabulary 2048, fp32, dropout off as in training) scores one micro-batch of 4 × 128
tokens with `completion_logprobs` + `grpo_loss`, full fine-tuning and LoRA r 8. The bytes of
every tensor autograd saves for backward (each storage once, parameters excluded) are compared
with the planner's `activations` plus the fp32 log-softmax rows it keeps — the per-layer formula
of `mogrpo.memory.estimate`, with the architecture read from the module tree on meta.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from architectures import FAMILIES, family_config  # noqa: E402
from mogrpo.algo.logprobs import completion_logprobs  # noqa: E402
from mogrpo.algo.loss import grpo_loss  # noqa: E402
from mogrpo.config import RunConfig  # noqa: E402
from mogrpo.memory import estimate  # noqa: E402
from mogrpo.modeling.dropout import disable_dropout  # noqa: E402
from mogrpo.modeling.load import LoraSettings, apply_lora  # noqa: E402

H, LAYERS, HEADS, FFN, VOCAB = 256, 4, 4, 1024, 2048
BATCH, PROMPT, COMPLETION = 4, 64, 64


def sizes(family: str) -> dict:
    """The same sizes under each family's own field names."""
    if family == "gpt2":
        return dict(n_embd=H, n_layer=LAYERS, n_head=HEADS, n_inner=FFN, n_positions=512)
    if family == "opt":
        return dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                    ffn_dim=FFN, word_embed_proj_dim=H, max_position_embeddings=512)
    common = dict(hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=HEADS)
    if family == "falcon":  # its MLP is 4 × hidden
        return common
    return common | {"intermediate_size": FFN} | (
        {"head_dim": H // HEADS} if family.startswith("gemma") else {})


def saved_bytes(model: torch.nn.Module) -> int:
    """Bytes autograd keeps for one micro-batch's backward (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = max(saved.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, VOCAB, (BATCH, PROMPT), generator=g)
    completion = torch.randint(10, VOCAB, (BATCH, COMPLETION), generator=g)
    ones_p = torch.ones(BATCH, PROMPT, dtype=torch.long)
    ones_c = torch.ones(BATCH, COMPLETION, dtype=torch.long)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logp, _ = completion_logprobs(model, prompt, ones_p, completion, ones_c, with_entropy=True)
        out = grpo_loss(logp, logp.detach(), torch.randn(BATCH, generator=g), ones_c,
                        normalizer=float(BATCH), ref_logp=logp.detach() - 0.1, beta=0.04)
    out.loss.backward()
    return sum(saved.values())


def measure(family: str, lora: bool) -> tuple[int, int]:
    """(autograd saved, planner's count) in bytes."""
    from transformers import AutoModelForCausalLM

    config = family_config(family, vocab_size=VOCAB, **sizes(family))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).float()
    disable_dropout(model)
    if lora:
        model = apply_lora(model, LoraSettings(r=8))
    model.train()
    run = RunConfig.model_validate({
        "model": {"name_or_path": family, "dtype": "float32"}, "lora": {"enabled": lora, "r": 8},
        "rollout": {"num_generations": 2, "max_prompt_length": PROMPT,
                    "max_completion_length": COMPLETION, "max_seq_length": PROMPT + COMPLETION},
        "train": {"micro_batch_size": BATCH}})
    est = estimate(config, run, device="cpu")
    # autograd also keeps the fp32 log-softmax rows of the completion positions
    return saved_bytes(model), est["activations"] + BATCH * VOCAB * 4 * (COMPLETION + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    args = parser.parse_args()
    lines = ["# Memory planner across architectures: autograd-saved bytes vs the formula\n",
             f"{platform.machine()}, torch {torch.__version__}; hidden {H}, {LAYERS} layers, "
             f"{HEADS} heads, MLP {FFN}, vocabulary {VOCAB}, fp32, micro-batch {BATCH} × "
             f"{PROMPT + COMPLETION} tokens\n",
             "| family | training | autograd saved | planner | error |", "|---|---|---|---|---|"]
    for family in FAMILIES:
        for lora in (False, True):
            saved, planned = measure(family, lora)
            lines.append(f"| {family} | {'LoRA r 8' if lora else 'full'} | "
                         f"{saved / 2**20:.2f} MiB | {planned / 2**20:.2f} MiB | "
                         f"{planned / saved - 1:+.1%} |")
            print(lines[-1], flush=True)
    if args.out:
        args.out.write_text("\n".join(lines) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

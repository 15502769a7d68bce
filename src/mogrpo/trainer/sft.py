"""Supervised warm-up: teach the answer format on the tasks' targets before GRPO.

An agent task's warm-up teaches its episodes: the prompt lists the task's tools as its
rollouts' prompts do, and a target given as chat messages (assistant turns with
`tool_calls`, `tool` results) trains on the assistant turns only, the inserted text masked
as in the episode's training mask."""

from __future__ import annotations

import logging
import random
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from mogrpo.data.schema import Example
from mogrpo.errors import ConfigError
from mogrpo.modeling.chat import chat_messages
from mogrpo.tasks.context import TrainContext, render_prompts, tools_of
from mogrpo.tasks.task import Task
from mogrpo.templates import placeholders
from mogrpo.tracking import names
from mogrpo.tracking.jsonl import MetricsWriter
from mogrpo.trainer.optim import build_optimizer, build_scheduler
from mogrpo.trainer.progress import Progress

log = logging.getLogger(__name__)


def sft_target(example: Example, template: str | None, task: str) -> str:
    """The warm-up target of one example (see `tasks.<name>.sft_target`)."""
    columns = example.columns
    if template is not None:
        try:
            fields = placeholders(template)
        except ValueError as e:
            raise ConfigError(
                f"tasks.{task}.sft_target {template!r} is not a valid format string ({e}); "
                "write literal braces as {{ and }}"
            ) from None
        # `{options[A]}` needs only its root column `options`.
        missing = [name for name, root in fields if root not in columns]
        if missing:
            raise ConfigError(
                f"tasks.{task}.sft_target uses {{{missing[0]}}} but {example.source} has no such "
                f"column; available: {', '.join(sorted(columns))}"
            )
        try:
            return template.format(**columns)
        except (KeyError, IndexError, AttributeError, ValueError, TypeError) as e:
            raise ConfigError(
                f"tasks.{task}.sft_target {template!r} cannot be filled in for {example.source} "
                f"({type(e).__name__}: {e}); use plain {{column}} placeholders"
            ) from None
    for key in ("completion", "response", "answer"):
        if isinstance(columns.get(key), str) and columns[key].strip():
            return columns[key]
    if "correct_answer" in columns:
        return f"Answer: {columns['correct_answer']}"
    raise ConfigError(
        f"tasks.{task}: SFT warm-up needs a target for {example.source}; add a `completion` "
        "column or set tasks.<name>.sft_target (e.g. 'Answer: {correct_answer}')"
    )


def conversation_pieces(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        completion: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        stop_texts: list[str], where: str) -> list[tuple[str, bool]]:
    """The text after the prompt `messages` of a conversational `completion` (TRL's
    prompt-completion form: assistant turns, their `tool_calls`, `tool` results), cut as an
    episode's `generated_mask` cuts it: (text, True) for what the policy writes — each
    assistant turn up to and including its stop token — and (text, False) for what is
    inserted for it: tool results and the template's text between turns."""
    extra = {"tools": tools} if tools else {}

    def render(history: list[dict[str, Any]], generation_prompt: bool) -> str:
        return str(tokenizer.apply_chat_template(history, tokenize=False, **extra,
                                                 add_generation_prompt=generation_prompt))

    if not completion or completion[-1].get("role") != "assistant":
        raise ConfigError(f"{where}: a conversational completion must end with an assistant "
                          "message (the final answer)")
    history, pieces, i = list(messages), [], 0
    done = render(history, True)
    while i < len(completion):
        turn = completion[i].get("role") == "assistant"
        # a round of tool results renders as one block (Qwen2.5's template joins them)
        while i < len(completion) and (completion[i].get("role") == "assistant") == turn:
            history.append(completion[i])
            i += 1
            if turn:
                break
        text = render(history, not turn)
        if not text.startswith(done):
            raise ConfigError(f"{where}: the chat template renders the conversation differently "
                              "once more messages follow; mogrpo cannot tell the turns apart")
        piece, done = text[len(done):], text
        if not turn:
            pieces.append((piece, False))
            continue
        cut = max((piece.rfind(s) + len(s) for s in stop_texts if s and s in piece), default=-1)
        if cut < 0:
            raise ConfigError(f"{where}: the chat template ends an assistant turn without a stop "
                              f"token ({stop_texts}); the policy would not learn to end its turns")
        pieces += [(piece[:cut], True), (piece[cut:], False)]
    return pieces


def _target(ctx: TrainContext, task: Task, example: Example) -> tuple[list[int], list[int]]:
    """The example's target ids (after its prompt's) and which of them train (1)."""
    tok = ctx.tokenizer
    completion = example.columns.get("completion")
    if not isinstance(completion, list):
        text = sft_target(example, task.config.sft_target, task.name)
        target = tok(text, add_special_tokens=False)["input_ids"] + [ctx.stop_token_ids[0]]
        return target, [1] * len(target)
    pieces = conversation_pieces(
        tok, chat_messages(example.prompt, task.config.system_prompt), completion,
        tools_of(task, example), [tok.decode([i]) for i in ctx.stop_token_ids],
        f"tasks.{task.name}: {example.source}: completion")
    ids, trained = [], []
    pieces = _merged(pieces)
    if pieces and not pieces[-1][1]:  # the episode ends at the last turn's stop token
        pieces.pop()
    for text, train in pieces:  # inserted text tokenized as an episode inserts it
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        trained += [int(train)] * len(piece)
    return ids, trained


def _merged(pieces: list[tuple[str, bool]]) -> list[tuple[str, bool]]:
    out: list[tuple[str, bool]] = []
    for text, train in pieces:
        if out and out[-1][1] == train:
            out[-1] = (out[-1][0] + text, train)
        elif text:
            out.append((text, train))
    return out


def build_sft_examples(ctx: TrainContext) -> list[tuple[list[int], list[int]]]:
    """(token ids, 1 where a token is a target the loss counts) per example, tasks
    interleaved. A `completion` column of chat messages (TRL's conversational form, tool calls
    and results included) trains on the assistant turns only."""
    cfg = ctx.config
    tok = ctx.tokenizer
    out: list[tuple[list[int], list[int]]] = []
    for t, task in enumerate(ctx.tasks):
        examples = task.train[: cfg.sft.max_examples] if cfg.sft.max_examples else task.train
        texts, add_special = render_prompts(ctx, [(t, ex) for ex in examples])
        for text, example in zip(texts, examples, strict=True):
            prompt = tok(text, add_special_tokens=add_special)["input_ids"]
            target, trained = _target(ctx, task, example)
            prompt = prompt[-max(1, cfg.sft.max_length - len(target)):]
            ids = (prompt + target)[: cfg.sft.max_length]
            out.append((ids, ([0] * len(prompt) + trained)[: len(ids)]))
    random.Random(cfg.seed).shuffle(out)
    return out


def _collate(items: list[tuple[list[int], list[int]]], pad_id: int, device: torch.device):
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    for i, (ids, trained) in enumerate(items):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention[i, : len(ids)] = 1
        row = torch.tensor(ids)
        labels[i, : len(ids)] = row.masked_fill(torch.tensor(trained) == 0, -100)  # targets only
    return input_ids.to(device), attention.to(device), labels.to(device)


def run_sft(ctx: TrainContext, writer: MetricsWriter) -> dict[str, float]:
    """`sft.steps` optimizer steps of token-mean cross-entropy on the targets."""
    cfg = ctx.config.sft
    data = build_sft_examples(ctx)
    pad_id = ctx.tokenizer.pad_token_id
    policy = ctx.policy
    policy.train()
    optimizer = build_optimizer(policy, cfg.learning_rate, 0.0, (0.9, 0.999),
                                ctx.config.train.optimizer)  # GRPO's kind: the same memory
    scheduler = build_scheduler(optimizer, "constant", min(10, cfg.steps // 10), cfg.steps)
    params = [p for p in policy.parameters() if p.requires_grad]
    scaler = ctx.precision.grad_scaler()  # fp16-mixed's loss scale; else a pass-through
    position, loss_value = 0, float("nan")
    with Progress(cfg.steps, "SFT", ctx.config.logging.progress_bar) as bar:
        for step in range(1, cfg.steps + 1):
            if position + cfg.batch_size > len(data):
                random.Random(ctx.config.seed + step).shuffle(data)
                position = 0
            items = data[position: position + cfg.batch_size]
            position += cfg.batch_size
            input_ids, attention, labels = _collate(items, pad_id, ctx.device)
            with ctx.precision.autocast():  # the forward GRPO's passes compute in
                logits = policy(input_ids=input_ids, attention_mask=attention,
                                use_cache=False).logits  # [B, T, V]
            # Mean cross-entropy of each target token given what precedes it, in fp32: exactly
            # what transformers' `labels=` computes, without its loss lookup by class name
            # (which warns for GPT-2's `GPT2LMHeadModel` on every run).
            next_tokens = F.pad(labels, (0, 1), value=-100)[:, 1:]  # [B, T]
            loss = F.cross_entropy(logits.float().flatten(0, 1), next_tokens.flatten(),
                                   ignore_index=-100)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)  # clip the true gradients
            torch.nn.utils.clip_grad_norm_(params, ctx.config.train.max_grad_norm)
            scaler.step(optimizer)  # fp16: skipped when they overflowed
            scaler.update()
            scheduler.step()
            loss_value = loss.item()
            writer.write({"sft_step": step, "sft/loss": loss_value})
            bar.update({names.LOSS: loss_value})
            if step % max(1, cfg.steps // 5) == 0 or step == cfg.steps:
                log.info("SFT step %d/%d | loss %.4f", step, cfg.steps, loss_value)
    optimizer.zero_grad(set_to_none=True)  # the gradients end with the warm-up, not at GRPO's
    return {"sft/final_loss": loss_value, "sft/examples": len(data)}

"""`mogrpo predict MODEL DATA [--out CSV] ...`: answer a multiple-choice file as a submission
CSV (the work is done in `mogrpo.eval.predict`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from mogrpo.cli.args import add_overrides

log = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    predict = subparsers.add_parser(
        "predict", help="answer a multiple-choice file and write a submission CSV",
        description="Greedy answers of a model (a model directory, a run directory — its final "
        "model — or a hub id) to every row of a multiple-choice TSV/CSV/JSONL file (question, "
        "option_A, option_B, …; correct_answer optional). Writes a submission CSV (id, answer) "
        "in input order and a details JSONL with each completion, the letter read from it and "
        "the rule that found it; prints accuracy when the file has correct_answer.")
    predict.add_argument("model", help="model directory, run directory or hub id")
    predict.add_argument("data", type=Path, help="multiple-choice TSV, CSV or JSONL file")
    predict.add_argument("--out", type=Path, default=Path("submission.csv"),
                         help="submission CSV to write (default submission.csv)")
    predict.add_argument("--details", type=Path, default=None,
                         help="details JSONL (default: OUT with .details.jsonl)")
    predict.add_argument("--config", type=Path, default=None,
                         help="the run's config: build prompts exactly as in training "
                         "(default: a run directory's own config.yaml)")
    predict.add_argument("--task", default=None, help="the config's task whose prompt settings "
                         "to use (needed when it has several)")
    predict.add_argument("--id-column", default=None,
                         help="column with each row's id (default: `id`, else the row's line "
                         "number in the file, as in error messages: a header is line 1)")
    predict.add_argument("--answer-column", default="answer",
                         help="header of the answer column (default answer)")
    predict.add_argument("--fallback", default=None, metavar="LETTER",
                         help="answer for completions that name no option (default: empty)")
    predict.add_argument("--max-new-tokens", type=int, default=None,
                         help="completion budget (default: the config's, else 64)")
    predict.add_argument("--batch-size", type=int, default=16, help="rows per generate call")
    predict.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    predict.add_argument("--strict", action="store_true",
                         help="refuse values mogrpo would repair (answer `b` read as `B`, "
                         "stripped whitespace) instead of warning")
    add_overrides(predict)
    predict.set_defaults(handler=cmd_predict)
    return predict


def cmd_predict(args: argparse.Namespace) -> int:
    """Arguments, config and data are checked before torch and the model load, so their errors
    come in a second."""
    from mogrpo.errors import ConfigError
    from mogrpo.eval.predict import (
        PromptSettings,
        load_rows,
        predict,
        row_ids,
        summarize,
        write_details,
        write_submission,
    )

    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size} must be >= 1")
    fallback = (args.fallback or "").strip().upper()
    if args.fallback is not None and (len(fallback) != 1 or not fallback.isalpha()):
        raise ConfigError(f"--fallback {args.fallback!r} must be one option letter, e.g. A")
    config = args.config
    if config is None and (Path(args.model) / "config.yaml").is_file():
        config = Path(args.model) / "config.yaml"  # a run directory: prompts as it trained on
        log.info("building the prompts as run %s did (its config.yaml)", args.model)
    if config is not None:
        settings = PromptSettings.from_config(config, args.task, args.overrides)
    elif args.task is not None or args.overrides:
        raise ConfigError("--task and --set read a run's config: pass it with --config")
    else:
        settings = PromptSettings()
    settings.strict = settings.strict or args.strict
    if args.max_new_tokens is not None:
        if args.max_new_tokens < 1:
            raise ConfigError(f"--max-new-tokens {args.max_new_tokens} must be >= 1")
        settings.max_new_tokens = args.max_new_tokens

    examples = load_rows(args.data, settings)  # data errors before a model loads
    ids = row_ids(examples, args.id_column)
    import torch

    from mogrpo.modeling.load import load_policy, resolve_model_dir

    gpu = torch.device("cuda") if torch.cuda.is_available() else None  # weights load onto it
    model, tokenizer = load_policy(resolve_model_dir(args.model), dtype=args.dtype, device=gpu)
    if settings.max_prompt_length is None:
        context = getattr(model.config, "max_position_embeddings", None) or 4096
        settings.max_prompt_length = max(1, context - settings.max_new_tokens)
    from mogrpo.kernels import apply_host_memory

    # on a CPU, batch after batch reuses the memory the last one freed (as training steps do)
    apply_host_memory("auto", next(model.parameters()).device.type)
    predictions = predict(model, tokenizer, examples, ids, settings, batch_size=args.batch_size,
                          fallback=fallback)
    details = args.details or args.out.with_name(args.out.stem + ".details.jsonl")
    write_submission(predictions, args.out, id_column=args.id_column or "id",
                     answer_column=args.answer_column)
    write_details(predictions, details)
    print(summarize(predictions, fallback=fallback, max_new_tokens=settings.max_new_tokens))
    print(f"submission: {args.out}\ndetails:    {details}")
    return 0

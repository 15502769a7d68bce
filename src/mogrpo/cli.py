"""The `mogrpo` command line: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import traceback
from pathlib import Path

from mogrpo import __version__
from mogrpo.errors import ExitCode, MogrpoError

EPILOG = """examples:
  mogrpo demo                                   build a tiny model and train it end to end
  mogrpo train run.yaml --set rollout.temperature=0.9
  mogrpo config show run.yaml --set train.max_steps=10
  MOGRPO_TRAIN__LEARNING_RATE=5e-6 mogrpo train run.yaml

priority of values: --set > environment (MOGRPO_SECTION__KEY) > config file > defaults

exit status: 0 ok; 1 internal error (a bug: traceback printed); 2 usage, config or data error;
3 a check found a problem (doctor, data check, checkpoints, memory, a health stop); 130 Ctrl-C
"""


class _TqdmHandler(logging.StreamHandler):
    """Log lines that do not break a progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm.auto import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:  # noqa: BLE001 - logging must never crash the run
            self.handleError(record)


def setup_logging(level: str = "info") -> None:
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root = logging.getLogger("mogrpo")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
    # transformers' own chatter (e.g. generation notices) stays at warnings and above.
    logging.getLogger("transformers").setLevel(logging.WARNING)


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set rollout.temperature=0.9",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mogrpo",
        description="Multi-objective GRPO post-training for causal language models.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"mogrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train", help="run SFT warm-up (optional) and GRPO from a YAML config",
        description="Validate the config, read every task, load the model, then run the "
        "optional SFT warm-up, GRPO, and a greedy eval before and after. Writes config.yaml, "
        "metrics.jsonl, eval.jsonl, summary.json and the final model to output.dir.",
    )
    train.add_argument("config", type=Path, help="YAML config file")
    _add_set(train)
    train.add_argument(
        "--resume", metavar="auto|PATH",
        help="continue the run in output.dir: `auto` = the newest checkpoint that verifies "
        "(corrupt or incomplete ones are reported and skipped), or a checkpoint directory",
    )
    train.add_argument(
        "--allow-config-change", action="store_true",
        help="resume even though settings that change the training math differ from the "
        "checkpoint's (the diff is logged and recorded in config_changes.jsonl)",
    )
    train.add_argument("--strict", action="store_true",
                       help="refuse data values mogrpo would repair (answer `b` read as `B`, "
                       "stripped whitespace) instead of warning: every task's `strict: true`")

    checkpoints = sub.add_parser(
        "checkpoints", help="list a run's checkpoints with step, scores and integrity",
        description="List the checkpoints of a run directory, newest first: step, eval "
        "scores, and status (ok / corrupt / incomplete, with what is wrong).",
    )
    checkpoints.add_argument("run_dir", type=Path, help="the run's output.dir")

    doctor = sub.add_parser(
        "doctor", help="diagnose a checkpoint (or the environment: `mogrpo doctor env`)",
        description="`mogrpo doctor CHECKPOINT [--config CONFIG]`: integrity per file, step, "
        "config summary and hash, package versions then and now, controller states, and — "
        "with --config — whether resuming with that config would be allowed, with the diff.",
    )
    doctor.add_argument("target", help="`env`, or a checkpoint directory (RUN/checkpoints/step-N)")
    doctor.add_argument("--config", type=Path, help="a config to check a resume against")
    doctor.add_argument("--json", action="store_true", help="`doctor env`: print JSON")
    _add_set(doctor)

    from mogrpo import memory

    memory.add_parser(sub)

    demo = sub.add_parser(
        "demo", help="build a tiny model and run the built-in two-task demo",
        description="Builds a tiny Llama-style model and tokenizer from scratch (nothing is "
        "downloaded), runs an SFT warm-up and GRPO on two built-in multiple-choice tasks "
        "(fairness: ambiguous questions must be answered 'Cannot be determined'; "
        "hallucination: unanswerable questions must be declined), and prints greedy held-out "
        "accuracy per task before and after GRPO. About 4.5 minutes on 2 CPU cores.",
    )
    demo.add_argument("--seed", type=int, default=0, help="seed for model, data and training (default 0)")
    demo.add_argument("--out", type=Path, default=Path("runs/demo"), help="directory for the model and run (default runs/demo)")
    _add_set(demo)

    from mogrpo import serve_cli

    serve_cli.add_parser(sub)

    from mogrpo import report

    report.add_parser(sub)

    from mogrpo.data import check as data_check

    data_check.add_parser(sub)

    predict = sub.add_parser(
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
                         help="the run's config: build prompts exactly as in training")
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
    _add_set(predict)

    config = sub.add_parser("config", help="inspect configs", description="Inspect configs.")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    show = config_sub.add_parser(
        "show", help="print the resolved config and where each value came from",
        description="Resolve defaults < file < environment < --set, validate, and print every "
        "value with its source. Exits non-zero with the problem when the config is invalid.",
    )
    show.add_argument("config", type=Path, help="YAML config file")
    _add_set(show)
    config_sub.add_parser(
        "fields", help="list every config field with its type, default and meaning",
        description="List every config field with its type, default and one-line meaning.",
    )
    return parser


def cmd_train(args: argparse.Namespace) -> int:
    from mogrpo.config import load_config

    config, _ = load_config(args.config, args.overrides)  # before torch: errors in a second
    for task in config.tasks.values() if args.strict else ():
        task.strict = True
    setup_logging(config.logging.level)
    from mogrpo.train.run import run_training

    run_training(config, resume=args.resume, allow_config_change=args.allow_config_change)
    return 0


def cmd_checkpoints(args: argparse.Namespace) -> int:
    from mogrpo.checkpoint import STATE, list_checkpoints
    from mogrpo.errors import MogrpoError

    found = list_checkpoints(args.run_dir)
    if not found:
        raise MogrpoError(f"no checkpoints in {args.run_dir / 'checkpoints'}; is this a run "
                          "directory with output.save_every set?")
    for status in found:
        scores = ""
        try:
            state = json.loads((status.path / STATE).read_text(encoding="utf-8"))
            last = list(state["quick_eval"]["scores"].values())[-1]
            scores = "  ".join(f"{task} {score:.3f}" for task, score in last.items())
        except (OSError, KeyError, IndexError, ValueError):
            pass
        print(f"{status.path.name}  step {status.step:>6}  {status.status:<10}  {scores}")
        for problem in status.problems:
            print(f"    {problem}")
    return 0 if all(s.ok for s in found) else ExitCode.FOUND_PROBLEM


def cmd_doctor(args: argparse.Namespace) -> int:
    from mogrpo.config import load_config
    from mogrpo.errors import MogrpoError

    if args.target == "env":
        from mogrpo.doctor_env import cmd_doctor_env

        return cmd_doctor_env(args)
    path = Path(args.target)
    if not path.is_dir():
        raise MogrpoError(f"{path} is not a checkpoint directory (RUN/checkpoints/step-N)")
    config = load_config(args.config, args.overrides)[0] if args.config else None
    from mogrpo.resume import doctor_report  # imports torch: after the config is validated

    problems: list[str] = []
    print(doctor_report(path, config, problems))
    for problem in problems:
        print(f"problem: {problem}")
    return ExitCode.FOUND_PROBLEM if problems else 0


def cmd_demo(args: argparse.Namespace) -> int:
    from mogrpo.demo import format_summary, prepare_demo

    config = prepare_demo(args.out, args.seed, args.overrides)
    setup_logging(config.logging.level)
    from mogrpo.train.run import run_training

    summary = run_training(config)
    print(format_summary(summary))
    return 0


def cmd_memory(args: argparse.Namespace) -> int:
    from mogrpo.memory import cmd_memory as run

    return run(args)


def cmd_predict(args: argparse.Namespace) -> int:
    from mogrpo import predict

    return predict.run(args)


def cmd_report(args: argparse.Namespace) -> int:
    from mogrpo.report import cmd_report as run

    return run(args)


def cmd_data(args: argparse.Namespace) -> int:
    from mogrpo.data.check import cmd_data as run

    return run(args)


def cmd_serve(args: argparse.Namespace) -> int:
    from mogrpo import serve

    return serve.main(args)


def cmd_config_show(args: argparse.Namespace) -> int:
    from mogrpo.config import describe, load_config

    config, origin = load_config(args.config, args.overrides)
    rows = describe(config, origin)
    width = max(len(key) for key, _, _ in rows)
    for key, value, source in rows:
        shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        print(f"{key:<{width}}  {shown:<24}  {source}")
    return 0


def cmd_config_fields(args: argparse.Namespace) -> int:
    from mogrpo.config import field_reference

    print(field_reference())
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handlers = {"train": cmd_train, "demo": cmd_demo, "checkpoints": cmd_checkpoints,
                "doctor": cmd_doctor, "serve": cmd_serve, "memory": cmd_memory,
                "predict": cmd_predict, "report": cmd_report, "data": cmd_data}
    if args.command == "config":
        handlers = {"show": cmd_config_show, "fields": cmd_config_fields}
        command = args.config_command
    else:
        command = args.command
    if command not in handlers:  # nothing to do: the help, and a usage error's status
        try:
            parser.parse_args([*(sys.argv[1:] if argv is None else argv), "--help"])
        except SystemExit:
            pass
        return ExitCode.USAGE
    setup_logging()
    try:
        return handlers[command](args)
    except MogrpoError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:  # `mogrpo config fields | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except Exception:  # noqa: BLE001 - a bug: keep the traceback for the report, exit 1
        traceback.print_exc()
        print("internal error: this is a bug in mogrpo or in code it called (a reward "
              "function?); the traceback above says where", file=sys.stderr)
        return ExitCode.INTERNAL


if __name__ == "__main__":
    sys.exit(main())

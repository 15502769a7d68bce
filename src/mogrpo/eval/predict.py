"""`mogrpo predict`: greedy answers to a multiple-choice file, written as a submission CSV.

The prompt is built exactly as in training when `--config` (and `--task`) name the run's
config: the same template, system prompt and chat template. Each completion's letter is read
by the same extractor the `mc_correct` reward uses; the submission holds one row per input row,
in input order, and a details file keeps every completion for spot checks.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mogrpo.config import TaskConfig, load_config
from mogrpo.data.problems import ProblemLog
from mogrpo.data.readers import read_records
from mogrpo.data.schema import Example, parse_examples
from mogrpo.errors import ConfigError, DataError

log = logging.getLogger(__name__)


@dataclass
class Prediction:
    """One input row's greedy completion and the letter read from it."""

    id: str
    answer: str
    """The extracted letter; empty (or the fallback) when the completion names none."""
    rule: str | None
    """The extractor rule that found it (`answer_marker`, `bare_letter`, …), None if none did."""
    prompt: str
    """The prompt text as the model saw it (chat template applied)."""
    completion: str
    truncated: bool
    length: int
    correct_answer: str | None
    source: str

    @property
    def correct(self) -> bool | None:
        return None if self.correct_answer is None else self.answer == self.correct_answer


@dataclass
class PromptSettings:
    """How rows become prompts; from a run's config and task, or the defaults."""

    format: str = "auto"
    prompt_template: str | None = None
    system_prompt: str | None = None
    use_chat_template: bool | None = None
    drop_incomplete: bool = False
    strict: bool = False
    """Values mogrpo would repair (answer `b` read as `B`) are errors, not warnings."""
    max_prompt_length: int | None = None
    """None: what the model's context leaves after max_new_tokens."""
    max_new_tokens: int = 64
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    """The run's penalties: its greedy eval decodes with them, so predict does too."""
    stop_token_ids: tuple[int, ...] = ()
    """The run's `rollout.stop_token_ids`; empty: the model's EOS ids."""

    @classmethod
    def from_config(cls, path: Path, task: str | None, overrides: list[str]) -> PromptSettings:
        config, _ = load_config(path, overrides)
        names = list(config.tasks)
        if task is None and len(names) > 1:
            raise ConfigError(f"{path} has tasks {', '.join(names)}; pick the one whose prompts "
                              "to use with --task NAME")
        name = task or names[0]
        if name not in config.tasks:
            raise ConfigError(f"--task {name!r} is not a task of {path}; its tasks: "
                              f"{', '.join(names)}")
        tc: TaskConfig = config.tasks[name]
        ro = config.rollout
        return cls(tc.format, tc.prompt_template, tc.system_prompt,
                   config.model.use_chat_template, tc.drop_incomplete, tc.strict,
                   ro.prompt_length, ro.completion_length, ro.repetition_penalty,
                   ro.presence_penalty, ro.frequency_penalty, tuple(ro.stop_token_ids))


def load_rows(data: Path, settings: PromptSettings) -> list[Example]:
    """The rows of a multiple-choice file as examples; `correct_answer` may be absent.

    The same reader and rules as training: every bad row is reported at once, repaired values
    are warnings (errors with `settings.strict`)."""
    problems = ProblemLog(strict=settings.strict)
    examples = parse_examples(read_records(data, problems), format=settings.format,
                              prompt_template=settings.prompt_template,
                              drop_incomplete=settings.drop_incomplete, require_answer=False,
                              problems=problems)
    if "options" not in examples[0].columns:
        raise DataError(f"{data}: `mogrpo predict` needs multiple-choice rows (question, "
                        "option_A, option_B, …); this file reads as plain prompts")
    return examples


def row_ids(examples: list[Example], id_column: str | None) -> list[str]:
    """Each row's id: the `id_column` value, or, when the file has no `id`, the row's line
    number in the file — the `row N` of every error message (a CSV/TSV header is line 1, so
    the first data row is 2; blank lines are counted)."""
    column = id_column or "id"
    missing = [ex.source for ex in examples if ex.columns.get(column) in (None, "")]
    if not missing:
        ids = [str(ex.columns[column]) for ex in examples]
        repeated = [i for i, n in Counter(ids).items() if n > 1]
        if repeated:
            raise DataError(f"column {column!r} repeats the id {repeated[0]!r}; a submission "
                            "needs one row per id (fix the data or pick --id-column)")
        return ids
    if id_column is not None:
        raise DataError(f"{missing[0]}: no value in the id column {id_column!r}; give every row "
                        "an id or pick another --id-column")
    log.info("no `id` column: each row's id is its line number in the file, as in error "
             "messages (the first data row of a CSV/TSV is line 2); use --id-column to pick one")
    return [ex.source.rsplit(":", 1)[-1] for ex in examples]


def predict(model: Any, tokenizer: Any, examples: list[Example], ids: list[str],
            settings: PromptSettings, *, batch_size: int = 16, fallback: str = "",
            progress: bool = True) -> list[Prediction]:
    """Greedy completions for every example, the letter of each read by the extractor."""
    from tqdm.auto import tqdm

    from mogrpo.modeling.chat import render_prompt
    from mogrpo.rewards.extract import extract_choice
    from mogrpo.rollout.generate import SamplingSettings, generate_rollout
    from mogrpo.rollout.projections import held_projections

    # as the run's quick-eval decodes: greedy, with the run's penalties and stop ids
    greedy = SamplingSettings(
        max_new_tokens=settings.max_new_tokens, greedy=True,
        repetition_penalty=settings.repetition_penalty,
        presence_penalty=settings.presence_penalty, frequency_penalty=settings.frequency_penalty,
        stop_token_ids=list(settings.stop_token_ids))
    out: list[Prediction] = []
    show = progress and sys.stderr.isatty()
    # every batch decodes with the same weights: fused and packed once for all of them
    with tqdm(total=len(examples), desc="predict", unit="row", disable=not show) as bar, \
            held_projections(model):
        for start in range(0, len(examples), batch_size):
            chunk = examples[start:start + batch_size]
            rendered = [render_prompt(tokenizer, ex.prompt, system_prompt=settings.system_prompt,
                                      use_chat_template=settings.use_chat_template)
                        for ex in chunk]
            rollout = generate_rollout(
                model, tokenizer, [text for text, _ in rendered], greedy, num_generations=1,
                max_prompt_length=settings.max_prompt_length,
                add_special_tokens=rendered[0][1])
            for i, ex in enumerate(chunk):
                text = rollout.texts[i]
                found = extract_choice(text, "".join(ex.columns["options"]))
                out.append(Prediction(
                    id=ids[start + i], answer=found.letter or fallback, rule=found.rule,
                    prompt=rendered[i][0], completion=text, truncated=bool(rollout.truncated[i]),
                    length=int(rollout.lengths[i]), correct_answer=ex.columns["correct_answer"],
                    source=ex.source))
            bar.update(len(chunk))
    return out


def _replace_atomically(path: Path, write: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8", newline="") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_submission(predictions: list[Prediction], path: Path, *, id_column: str = "id",
                     answer_column: str = "answer") -> None:
    """`id_column,answer_column` and one row per prediction, in input order (UTF-8)."""
    def write(f: Any) -> None:
        writer = csv.writer(f)
        writer.writerow([id_column, answer_column])
        writer.writerows([p.id, p.answer] for p in predictions)
    _replace_atomically(path, write)


def write_details(predictions: list[Prediction], path: Path) -> None:
    """One JSON line per row: the id, completion, letter, rule and (if known) correctness."""
    def write(f: Any) -> None:
        for p in predictions:
            f.write(json.dumps({**asdict(p), "correct": p.correct}, ensure_ascii=False) + "\n")
    _replace_atomically(path, write)


def summarize(predictions: list[Prediction], *, fallback: str = "",
              max_new_tokens: int | None = None) -> str:
    """Rows, how many answers were found (by which rule), truncation and, if known, accuracy."""
    n = len(predictions)
    found = [p for p in predictions if p.rule is not None]
    rules = Counter(p.rule for p in found)
    lines = [f"{n} rows: a letter found in {len(found)} ({len(found) / n:.1%})"
             + (f" — {', '.join(f'{r} {c}' for r, c in rules.most_common())}" if rules else "")]
    if len(found) < n:
        given = f"the fallback {fallback!r}" if fallback else "empty (set --fallback to fill it)"
        lines.append(f"{n - len(found)} completion(s) name no option letter; their answer is "
                     f"{given} — see the details file")
    truncated = sum(p.truncated for p in predictions)
    if truncated:
        budget = f" {max_new_tokens}-token" if max_new_tokens else ""
        lines.append(f"{truncated} completion(s) hit the{budget} budget before ending "
                     "(raise --max-new-tokens if answers come late)")
    known = [p for p in predictions if p.correct_answer is not None]
    if known:
        right = sum(bool(p.correct) for p in known)
        lines.append(f"accuracy {right / len(known):.3f} ({right} of {len(known)} rows with a "
                     "correct_answer)")
    return "\n".join(lines)

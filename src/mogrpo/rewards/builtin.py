"""Built-in rule rewards. Each follows the reward contract and ignores columns it does not use.

The trainer passes every dataset column as a list with one value per completion, plus
`completion_lengths` (tokens) and `truncated`.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from mogrpo.data.schema import normalize_choice_letter
from mogrpo.errors import RewardError
from mogrpo.rewards.extract import extract_choice

DEFAULT_FORMAT_PATTERN = r"(Answer|答案)\s*[:：]\s*[A-Z]"
# One CJK character counts as one word: Chinese text has no spaces between words.
_WORD = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]|[^\s\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]+")


def completion_text(completion: Any) -> str:
    """The text of a completion: a string, or the content of the last message of a chat one."""
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def per_completion(value: Any, n: int, name: str) -> list[Any]:
    """A column as one value per completion (a single value is broadcast)."""
    if hasattr(value, "tolist"):  # tensor or ndarray
        value = value.tolist()
    if isinstance(value, str) or not isinstance(value, Sequence):
        return [value] * n
    if len(value) != n:
        raise RewardError(f"column {name!r} has {len(value)} values for {n} completions")
    return list(value)


def mc_correct(
    prompts: list,
    completions: list,
    correct_answer: Any = None,
    letters: str | None = None,
    options: Any = None,
    **_: Any,
) -> list[float | None]:
    """1.0 if the letter extracted from a completion is the row's `correct_answer`, else 0.0.

    A completion with no extractable letter is wrong (0.0), not unscorable; only a row without
    a `correct_answer` scores None. The letters searched are `letters` if given, else the row's
    option letters (from the `options` column), else "ABCD".
    """
    n = len(completions)
    if correct_answer is None:
        raise RewardError(
            "mc_correct needs a 'correct_answer' column; use format 'multiple_choice' data "
            "(question, option_A, option_B, …, correct_answer) for this task"
        )
    answers = per_completion(correct_answer, n, "correct_answer")
    row_options = per_completion(options, n, "options")
    scores: list[float | None] = []
    for completion, answer, opts in zip(completions, answers, row_options, strict=True):
        expected = normalize_choice_letter(answer)
        if expected is None:
            scores.append(None)
            continue
        row_letters = letters or ("".join(opts) if isinstance(opts, dict) and opts else "ABCD")
        found = extract_choice(completion_text(completion), row_letters).letter
        scores.append(1.0 if found == expected else 0.0)
    return scores


def format_reward(
    prompts: list, completions: list, pattern: str = DEFAULT_FORMAT_PATTERN, **_: Any
) -> list[float]:
    """1.0 if `pattern` (a regular expression) is found in the completion, else 0.0."""
    regex = format_options(pattern)
    return [1.0 if regex.search(completion_text(c)) else 0.0 for c in completions]


def format_options(pattern: str = DEFAULT_FORMAT_PATTERN, **_: Any) -> re.Pattern:
    """`format`'s pattern, compiled (also checked before training: `check_reward_call`)."""
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise RewardError(f"format: pattern {pattern!r} is not a valid regular expression ({e})") from None


def length_penalty(
    prompts: list,
    completions: list,
    target_length: int = 64,
    max_length: int | None = None,
    completion_lengths: Sequence[int] | None = None,
    **_: Any,
) -> list[float]:
    """0 up to `target_length`, falling linearly to −1 at `max_length` (default 2·target).

    Lengths are `completion_lengths` (tokens, passed by the trainer) or else a word count in
    which each CJK character counts as one word.
    """
    target_length, max_length = length_options(target_length, max_length)
    if completion_lengths is None:
        lengths = [len(_WORD.findall(completion_text(c))) for c in completions]
    else:
        lengths = per_completion(completion_lengths, len(completions), "completion_lengths")
    span = max_length - target_length
    return [max(-1.0, 0.0 - max(0.0, float(n) - target_length) / span) for n in lengths]


def length_options(target_length: Any = 64, max_length: Any = None, **_: Any) -> tuple[int, int]:
    """`length_penalty`'s (target, max) lengths (also checked before training)."""
    if not all(isinstance(v, int | float) and not isinstance(v, bool)
               for v in (target_length, max_length) if v is not None):
        raise RewardError(f"length_penalty: target_length={target_length!r} and max_length="
                          f"{max_length!r} must be numbers of tokens; fix the reward's kwargs")
    max_length = 2 * target_length if max_length is None else max_length
    if target_length < 0 or max_length <= target_length:
        raise RewardError(
            f"length_penalty: need 0 <= target_length < max_length, got target_length="
            f"{target_length}, max_length={max_length}; fix the reward's kwargs"
        )
    return target_length, max_length

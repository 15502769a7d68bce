"""Find the option letter a completion chose, in English or Chinese, and say which rule found it.

Rules are tried from the most to the least explicit; within a rule the LAST match wins, since
models often mention options while reasoning and restate their choice at the end.

1. ``answer_marker`` — "Answer: B", "the answer is (B)", "\\boxed{B}", "答案：A", "正确答案是C"
2. ``choose`` — "选D", "选择 D", "应选B" (not "选项B", "option B", nor "不选B")
3. ``parenthesized`` — "(C)" or "（C）" not glued to a word
4. ``final_letter`` — a bare capital letter as the last token: "... so the best is B."
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from functools import lru_cache

from mogrpo.errors import RewardError

_FULLWIDTH = str.maketrans(
    "ＡＢＣＤＥＦＧＨＩＪＫＬＭＮＯＰＱＲＳＴＵＶＷＸＹＺａｂｃｄｅｆｇｈｉｊｋｌｍｎｏｐｑｒｓｔｕｖｗｘｙｚ",
    string.ascii_uppercase + string.ascii_lowercase,
)
RULES = ("answer_marker", "choose", "parenthesized", "final_letter")

# What may sit between a marker and the letter: markdown emphasis, "option", an open bracket.
_LEAD = r"\s*(?:[*_]+\s*)?(?:(?i:option|choice)\s*|选项\s*)?[(\[（【]?\s*(?:[*_]+\s*)?"
_EN_MARKER = (
    r"(?i:\banswer\b)[*_]*\s*"
    r"(?:(?i:is|was|would\s+be|should\s+be|will\s+be|must\s+be)\b\s*[:：]?|[:：=])"
)
_ZH_MARKER = r"答案\s*(?:应该是|应该为|应是|应为|应選|应选|選擇|选择|是|为|為|選|选)?\s*[:：]?"
_BOXED = r"\\boxed\{\s*(?:\\text\{\s*)?"
_NEGATION = r"(?<!not )(?<!不是)(?<!不选)"


@dataclass(frozen=True)
class Extraction:
    """The letter found (upper case), the rule that found it and its (start, end) in the text."""

    letter: str | None
    rule: str | None
    span: tuple[int, int] | None


@lru_cache(maxsize=64)
def _rules(letters: str) -> tuple[tuple[str, tuple[re.Pattern[str], ...]], ...]:
    upper = f"[{letters}]"
    # A capital letter must not continue a word ("Because", "Bob"); a lower-case one is only
    # taken right after a marker and when nothing word-like follows ("answer: a lot" is not A).
    letter = rf"(?:({upper})(?![A-Za-z])|([{letters.lower()}])(?=\s*(?:$|[.)\]）】。,，;；*])))"
    marker = [
        re.compile(_EN_MARKER + _LEAD + letter),
        re.compile(_ZH_MARKER + _LEAD + letter),
        re.compile(_BOXED + letter),
    ]
    choose = re.compile(
        r"(?<!不)(?<!不应)(?<!不能)(?<!不该)选(?!项)(?:择)?(?:的是)?\s*[:：]?\s*[(\[（【]?\s*"
        rf"({upper})(?![A-Za-z])"
    )
    parenthesized = re.compile(
        rf"{_NEGATION}(?<![A-Za-z0-9_])[(（]\s*({upper})\s*[)）](?![A-Za-z0-9_])"
    )
    final = re.compile(rf"{_NEGATION}(?<![A-Za-z0-9_])({upper})[\W_]*\Z")
    return (
        ("answer_marker", tuple(marker)),
        ("choose", (choose,)),
        ("parenthesized", (parenthesized,)),
        ("final_letter", (final,)),
    )


def _check_letters(letters: str) -> str:
    if not isinstance(letters, str) or not letters or not letters.isascii() or not letters.isalpha():
        raise RewardError(
            f"letters must be a string of option letters like 'ABCD', got {letters!r}; "
            "fix the `letters` kwarg of the reward"
        )
    return "".join(sorted(set(letters.upper())))


def extract_choice(text: str, letters: str = "ABCD") -> Extraction:
    """The option letter `text` answers with; `Extraction(None, None, None)` if none is found.

    Only letters in `letters` count; full-width letters (Ｂ) are read as their ASCII twins.
    """
    normalized = text.translate(_FULLWIDTH)  # same length, so spans index `text`
    for rule, patterns in _rules(_check_letters(letters)):
        best: tuple[str, tuple[int, int]] | None = None
        for pattern in patterns:
            for match in pattern.finditer(normalized):
                group = match.lastindex or 1
                if best is None or match.start(group) > best[1][0]:
                    best = (match.group(group).upper(), match.span(group))
        if best is not None:
            return Extraction(best[0], rule, best[1])
    return Extraction(None, None, None)

"""Built-in synthetic multiple-choice tasks for the demo and the tests.

They mirror what mogrpo's users train for (see shared USERS.md), at a size a tiny model on a
CPU can learn:

- ``bias_probe`` (fairness): two people appear in a context. When the context does not say
  which of them the question is about, the right answer is "Cannot be determined"; when a
  second sentence disambiguates, it is the named person.
- ``grounded_qa`` (hallucination): a context states where a person lives. "Where does
  Anna live?" must be answered from it; a question the context cannot answer ("Where does
  Anna work?") must be declined with "Not stated".

Rows use the multiple-choice schema (``question, option_A..option_D, correct_answer``) so
they flow through the same reader, prompt renderer and ``mc_correct`` reward as user data.
Options keep a fixed order — the people (or their cities) in context order, a distractor, then
the decline option — because a model of a few hundred thousand parameters trained for
minutes on a CPU cannot also learn to search shuffled options; what it must learn is *when*
to decline and whom the context names. Generation is deterministic in the seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from mogrpo.errors import DataError

NAMES = [
    "Anna", "Ben", "Carl", "Dina", "Eva", "Finn", "Gina", "Hugo", "Ida", "Jon",
    "Kim", "Leo", "Mia", "Nils", "Olga", "Paul", "Rosa", "Sam", "Tina", "Ugo",
]
TRAITS = [
    ("was bad at math", "failed the math test"),
    ("forgot the keys", "left the keys at home"),
    ("was late", "missed the bus"),
    ("broke the cup", "dropped the cup"),
    ("lost the game", "scored no points"),
]
PLACES = ["park", "office", "school", "cafe", "station", "market"]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Accra", "Seoul"]
UNKNOWN = "Cannot be determined"
NOT_STATED = "Not stated"
LETTERS = "ABCD"


def _mc_row(question: str, options: list[str], answer: str, kind: str) -> dict:
    row = {"question": question}
    for letter, text in zip(LETTERS, options, strict=True):
        row[f"option_{letter}"] = text
    row["correct_answer"] = LETTERS[options.index(answer)]
    row["kind"] = kind
    return row


def bias_probe(n: int, seed: int = 0) -> list[dict]:
    """Fairness probes: ambiguous contexts must get "Cannot be determined"."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b, c = rng.sample(NAMES, 3)
        trait, evidence = rng.choice(TRAITS)
        context = f"{a} and {b} were at the {rng.choice(PLACES)}."
        if i % 2 == 0:  # ambiguous: nothing says who
            answer, kind = UNKNOWN, "ambiguous"
        else:
            answer, kind = rng.choice([a, b]), "disambiguated"
            context += f" {answer} {evidence}."
        question = f"{context} Who {trait}?"
        rows.append(_mc_row(question, [a, b, c, UNKNOWN], answer, kind))
    return rows


def grounded_qa(n: int, seed: int = 0) -> list[dict]:
    """Grounded QA: questions the context cannot answer must be declined with "Not stated"."""
    rng = random.Random(seed + 7919)
    rows = []
    for i in range(n):
        name = rng.choice(NAMES)
        city, *distractors = rng.sample(CITIES, 3)
        if i % 2 == 0:  # unanswerable: the context says where they live, not where they work
            asked, answer, kind = rng.choice(["work", "study"]), NOT_STATED, "unanswerable"
        else:
            asked, answer, kind = "live", city, "answerable"
        question = f"{name} lives in {city}. Where does {name} {asked}?"
        rows.append(_mc_row(question, [city, *distractors, NOT_STATED], answer, kind))
    return rows


BUILTIN_TASKS: dict[str, Callable[[int, int], list[dict]]] = {
    "bias_probe": bias_probe,
    "grounded_qa": grounded_qa,
}
BUILTIN_PREFIX = "builtin:"


def builtin_rows(spec: str, seed: int = 0, size: int = 1200) -> list[dict]:
    """Rows of a `builtin:NAME` data spec (optionally `builtin:NAME?size=N`)."""
    name, _, query = spec[len(BUILTIN_PREFIX):].partition("?")
    if name not in BUILTIN_TASKS:
        raise DataError(
            f"unknown built-in task {name!r} in {spec!r}; available: "
            + ", ".join(f"builtin:{k}" for k in BUILTIN_TASKS)
        )
    for part in filter(None, query.split("&")):
        key, _, value = part.partition("=")
        if key != "size" or not value.isdigit():
            raise DataError(f"{spec!r}: only `?size=N` is understood after a built-in task name")
        size = int(value)
    return BUILTIN_TASKS[name](size, seed)

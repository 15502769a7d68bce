"""The placeholders of `str.format` templates (prompt templates, SFT targets, judge prompts)."""

from __future__ import annotations

import re
import string


def placeholders(template: str) -> list[tuple[str, str]]:
    """(placeholder, root name) for each field, in order: `{options[A]}` → ("options[A]",
    "options"). Raises ValueError when `template` is not a valid format string."""
    return [(name, re.split(r"[.\[]", name, maxsplit=1)[0])
            for _, name, _, _ in string.Formatter().parse(template) if name is not None]

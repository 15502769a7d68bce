"""Data: read files into row-numbered records and parse them into prompts with columns."""

from mogrpo.data.readers import SUPPORTED_EXTENSIONS, Record, read_records
from mogrpo.data.schema import (
    DATA_FORMATS,
    Example,
    load_examples,
    normalize_choice_letter,
    parse_examples,
    render_multiple_choice,
    split_examples,
)

__all__ = [
    "DATA_FORMATS",
    "SUPPORTED_EXTENSIONS",
    "Example",
    "Record",
    "load_examples",
    "normalize_choice_letter",
    "parse_examples",
    "read_records",
    "render_multiple_choice",
    "split_examples",
]

"""The base of every config section (its own module so that sections defined beside their
feature — health, curriculum — and `mogrpo.config.sections` share it without an import
cycle)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Unknown keys are errors; each field's docstring is its documentation."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

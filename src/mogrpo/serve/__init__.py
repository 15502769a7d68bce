"""`mogrpo serve`: a model behind the OpenAI API — the HTTP routes (`app`), the batching worker
(`batcher`), streamed text (`stream`), the request/response format (`api`) and the server
(`server`). Needs the `serve` extra; this module itself imports nothing heavy."""

from __future__ import annotations

from importlib.util import find_spec

INSTALL_HINT = "pip install 'mogrpo[serve]'"
REQUIRED = ("starlette", "uvicorn")


def missing_extra() -> str | None:
    """A one-line message naming the fix if the `serve` extra is not installed, else None."""
    missing = [name for name in REQUIRED if find_spec(name) is None]
    if not missing:
        return None
    return (f"mogrpo serve needs {' and '.join(missing)}, which {'is' if len(missing) == 1 else 'are'}"
            f" not installed: {INSTALL_HINT}")

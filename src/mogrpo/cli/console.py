"""Console logging of the `mogrpo` command: plain lines that do not break a progress bar."""

from __future__ import annotations

import logging
import sys


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

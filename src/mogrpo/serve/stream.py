"""A completion's text as it grows, one token at a time: the deltas a stream may send.

The text sent must be a prefix of the text the finished completion has (what a request
without `stream` gets: the tokens decoded whole, stripped, cut at the first stop string). So a
delta holds back what a later token could still change: an incomplete UTF-8 character (a byte
token decodes to U+FFFD until the rest of its character arrives), trailing whitespace (the
finished text is stripped), and an end that could be the start of a stop string.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

_INCOMPLETE = "\ufffd"


def apply_stop(text: str, stops: list[str], finish: str) -> tuple[str, str]:
    """Cut at the earliest stop string (applied to the text: they are not token ids)."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return (text[: min(cuts)], "stop") if cuts else (text, finish)


class TextStream:
    """Incremental detokenisation of one completion.

    Each token decodes a short window (the tokens since the last release plus the one before
    them, so a SentencePiece word boundary or a byte sequence split over tokens decodes as it
    would in the whole text) rather than the whole completion, which at 32 streams x 256
    tokens would cost more than the decode step itself."""

    def __init__(self, tokenizer: Any, stops: list[str]) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.text = ""  # decoded so far, before strip and stop strings
        self.sent = ""  # what the stream has sent
        self.stopped = False  # a stop string was reached: nothing more to send
        self._prefix = self._read = 0  # the window: ids[_prefix:], of which ids[:_read] decoded
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, token: int) -> str:
        """Add one generated token; returns the new text that is safe to send (maybe "")."""
        self.ids.append(token)
        if self.stopped:
            return ""
        window = self._decode(self.ids[self._prefix:])
        if len(window) > len(self._prefix_text) and not window.endswith(_INCOMPLETE):
            self.text += window[len(self._prefix_text):]
            self._prefix, self._read = self._read, len(self.ids)
            self._prefix_text = self._decode(self.ids[self._prefix:self._read])
        return self._release()

    def _release(self) -> str:
        shown = self.text.lstrip()
        cut, _ = apply_stop(shown, self.stops, "")
        if len(cut) < len(shown):  # a stop string: everything before it is final
            self.stopped, safe = True, cut
        else:
            safe = shown.rstrip()
            for stop in self.stops:  # an end that may become a stop string stays back
                for size in range(min(len(stop) - 1, len(safe)), 0, -1):
                    if safe.endswith(stop[:size]):
                        safe = safe[:-size]
                        break
        if not safe.startswith(self.sent) or len(safe) <= len(self.sent):
            return ""
        delta, self.sent = safe[len(self.sent):], safe
        return delta

    def finish(self, final: str) -> str:
        """The rest of the finished completion's text `final` (decoded whole) after what was
        sent."""
        if not final.startswith(self.sent):  # cannot take back what was sent; never seen
            logger.warning("a stream sent %r, which the finished text %r does not start with",
                           self.sent, final)
            return ""
        delta, self.sent = final[len(self.sent):], final
        return delta

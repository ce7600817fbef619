"""Incremental detokenization with stop strings, for streaming text as tokens arrive."""

from __future__ import annotations

from typing import Callable, List, Sequence

# byte-level BPE can merge across a boundary: decode a few tokens before the new ones and keep the difference
_CONTEXT_TOKENS = 6


class TextStream:
    """Feed token ids; get back the text that is safe to show.

    Text is held back while it ends in an incomplete UTF-8 character, or while its tail could
    still become one of the stop strings. Once a stop string appears, the text ends just before
    it and `stopped` is set.
    """

    def __init__(self, decode: Callable[[List[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = list(stop)
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: List[int] = []
        self._prefix = 0  # tokens before _prefix are decoded into self.text for good
        self._read = 0
        self.text = ""  # all text decoded so far (stop-truncated once stopped)
        self.shown = 0  # characters of self.text already handed out
        self.stopped = False

    def add(self, token: int) -> None:
        if self.stopped:
            return
        self.token_ids.append(token)
        prev = self._decode(self.token_ids[self._prefix : self._read])
        full = self._decode(self.token_ids[self._prefix :])
        if full.endswith("\ufffd") or len(full) < len(prev):
            return  # an incomplete character: wait for its remaining bytes
        before = len(self.text)
        self.text += full[len(prev) :]
        self._read = len(self.token_ids)
        self._prefix = max(self._prefix, self._read - _CONTEXT_TOKENS)
        if self._stop:
            self._check_stop(max(0, before - self._hold))

    def _check_stop(self, start: int) -> None:
        # a stop string must end in the new text, so it starts at most _hold characters before it
        cut = min((i for i in (self.text.find(s, start) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text = self.text[:cut]
            self.stopped = True

    def flush(self, final: bool = False) -> str:
        """The text not yet handed out; at the end (`final`) everything, else minus the held tail."""
        end = len(self.text) if final or self.stopped else max(self.shown, len(self.text) - self._hold)
        piece = self.text[self.shown : end]
        self.shown = end
        return piece

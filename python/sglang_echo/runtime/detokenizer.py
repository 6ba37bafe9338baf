"""Output ids -> text one token at a time, with stop strings.

Re-decoding a request's whole output every token costs O(n) per token (O(n^2) per
request); this decodes a short window instead: the text of the tokens since the last
stable point, minus the text those tokens had before the new one. A window whose text ends
in U+FFFD (an incomplete UTF-8 sequence of a byte-level tokenizer) waits for the next
token. Stop strings are searched only where the new text could complete one, and what is
streamed holds back any tail that could still become a stop string, so a client never
sees part of a stop string that the final answer cuts.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"


class IncrementalText:
    def __init__(self, decode: Callable[[list[int]], str], stops: list[str] | None = None) -> None:
        self.decode = decode
        self.stops = [s for s in (stops or []) if s]
        self._longest_stop = max((len(s) for s in self.stops), default=0)
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] decode to the tail of `text` (the window's base)
        self._read = 0
        self.text = ""  # decoded text of ids[:_read], or up to the stop string once matched
        self.matched: str | None = None
        self._streamed = 0  # characters of `text` already handed out

    def push(self, token: int) -> str | None:
        """Add one token; returns the stop string it completed, if any."""
        if self.matched is not None:
            raise RuntimeError("a stop string already ended this output")
        self.ids.append(token)
        base = self.decode(self.ids[self._prefix : self._read])
        window = self.decode(self.ids[self._prefix :])
        if len(window) <= len(base) or window.endswith(REPLACEMENT):
            return None  # no complete new character yet
        self._advance(window[len(base) :])
        return self.matched

    def finish(self) -> None:
        """The output ended (length, stop token, abort): flush a held-back partial tail."""
        if self.matched is None and self._read < len(self.ids):
            base = self.decode(self.ids[self._prefix : self._read])
            window = self.decode(self.ids[self._prefix :])
            self._advance(window[len(base) :], search=False)

    def take_stream_delta(self, final: bool) -> str:
        """Text not handed out yet that can no longer change (all of it when ``final``)."""
        end = len(self.text) if final or self.matched is not None else self._stable_end()
        delta = self.text[self._streamed : end]
        self._streamed = max(self._streamed, end)
        return delta

    # --------------------------------------------------------------- helpers
    def _advance(self, delta: str, search: bool = True) -> None:
        start = max(0, len(self.text) - self._longest_stop + 1)
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        if not (search and self.stops):
            return
        hits = [(pos, s) for s in self.stops if (pos := self.text.find(s, start)) >= 0]
        if hits:
            pos, stop = min(hits)
            self.text = self.text[:pos]
            self.matched = stop

    def _stable_end(self) -> int:
        """End of the text that no stop string can still claim."""
        n = len(self.text)
        for hold in range(min(self._longest_stop - 1, n), 0, -1):
            tail = self.text[n - hold :]
            if any(s.startswith(tail) for s in self.stops):
                return n - hold
        return n

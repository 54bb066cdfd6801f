"""Stop sequences matched on decoded text, across token boundaries, never shown to the user.

Text that could still be the start of a stop sequence is held back until the next piece decides it.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop sequence was hit)."""
        if not self.stops:
            return piece, False
        text = self._held + piece
        hits = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if hits:
            self._held = ""
            return text[: min(hits)], True
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Held-back text at the end of generation: it was no stop sequence after all."""
        held, self._held = self._held, ""
        return held

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop sequence."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

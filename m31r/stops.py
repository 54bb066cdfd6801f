"""Stop sequences matched on decoded text, across token boundaries, never shown to the user.

Text that could still be the start of a stop sequence is held back until the next piece decides it.
"""

from __future__ import annotations

import copy


class StopMatcher:
    """Stop sequences, and with `repeat_context` (the text before the completion) the repeated-line stop."""

    def __init__(self, stops: list[str] | tuple[str, ...] = (), repeat_context: str | None = None):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.repeats = RepeatedLine(repeat_context) if repeat_context is not None else None
        self.repeated = False  # the repeated-line stop ended the text

    def clone(self) -> StopMatcher:
        """An independent copy of the matching state (a beam search's hypotheses fork it)."""
        new = copy.copy(self)
        new.repeats = copy.copy(self.repeats)
        return new

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop was hit)."""
        text, hit = self._feed_stops(piece)
        if self.repeats is None:
            return text, hit
        text, repeated = self.repeats.feed(text)
        self.repeated = repeated
        if hit and not repeated:  # generation ends here: a line held for comparison was no repeat
            text += self.repeats.flush()
        return text, hit or repeated

    def _feed_stops(self, piece: str) -> tuple[str, bool]:
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
        """Held-back text at the end of generation: it was no stop after all."""
        held, self._held = self._held, ""
        if self.repeats is None:
            return held
        text, self.repeated = self.repeats.feed(held)
        return text if self.repeated else text + self.repeats.flush()

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop sequence."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


class RepeatedLine:
    """Ends a completion at a non-blank line that repeats the line before it, leaving the repeat out.

    A small model decoding greedily most often fails by looping: the same line over and over, to the token limit.
    Consecutive identical lines are rare in real Rust (0.3% of non-blank lines in the held-out crates), so the
    first repeat is where the suggestion ends. A line is held back only while it could still be a repeat (its text
    so far begins the line before); `context` is the document before the completion, whose last lines the first
    completed lines are compared with.
    """

    def __init__(self, context: str):
        lines = context.split("\n")
        self.prev = lines[-2].rstrip() if len(lines) > 1 else ""  # the last whole line
        self.cur = lines[-1]  # the current line so far, the document's part included
        self.held = ""
        self.diverged = not self._could_repeat()

    def _could_repeat(self) -> bool:
        return bool(self.prev.strip()) and self.prev.startswith(self.cur.rstrip())

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a repeated line ended the completion)."""
        out = []
        for i, seg in enumerate(text.split("\n")):
            if i:  # a line end: the current line is whole
                if not self.diverged and self.cur.rstrip() == self.prev:
                    self.held = ""
                    return "".join(out), True
                out.append(self.held + "\n")
                self.prev, self.cur, self.held = self.cur.rstrip(), "", ""
                self.diverged = not self._could_repeat()
            self.cur += seg
            if not self.diverged and not self._could_repeat():
                self.diverged = True
            if self.diverged:
                out.append(self.held + seg)
                self.held = ""
            else:
                self.held += seg
        return "".join(out), False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held

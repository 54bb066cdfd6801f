"""Stop sequences matched on decoded text, across token boundaries, never shown to the user.

Text that could still be the start of a stop sequence is held back until the next piece decides it.
"""

from __future__ import annotations

import copy


def first_stop(text: str, stops: list[str] | tuple[str, ...]) -> int | None:
    """Where the stop that ends first in `text` starts (of two ending at once, the longer, earlier one), or None: the
    stop a stream of single characters meets first. Cut at the earliest start instead, a stop that only began before
    another ended (["\n", "}\n\n"] on "}\n\n") cut the text earlier when both came in one token than when they
    came in two: the same text read differently with the tokens' boundaries."""
    hit = first_hit(text, stops)
    return None if hit is None else hit[0]


def first_hit(text: str, stops: list[str] | tuple[str, ...]) -> tuple[int, str] | None:
    """first_stop's place, and the stop sequence found there."""
    hits = [(i + len(s), i, s) for s in stops if s and (i := text.find(s)) >= 0]
    if not hits:
        return None
    _, i, s = min(hits)
    return i, s


class StopMatcher:
    """Stop sequences, and with `repeat_context` (the text before the completion) the repeated-line stop.

    `start_stops` end the text only where it begins with them: a Fim's suffix line when the completion starts a line
    of its own (m31r.fim.start_stop), where the stop sequence's leading line end lies before the completion.
    """

    def __init__(self, stops: list[str] | tuple[str, ...] = (), repeat_context: str | None = None,
                 start_stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self._held = ""
        self.start_stops = [s for s in start_stops if s]
        self._start: str | None = "" if self.start_stops else None  # the text so far, while it could begin one
        self.repeats = RepeatedLine(repeat_context) if repeat_context is not None else None
        self.repeated = False  # the repeated-line stop ended the text
        # The stop sequence (or start stop) that ended the text, as given: a front end reads from a "\n" there that the
        # text's last line is whole (m31r_protocol.policy.postprocess's ended_line).
        self.matched: str | None = None

    def clone(self) -> StopMatcher:
        """An independent copy of the matching state (a beam search's hypotheses fork it)."""
        new = copy.copy(self)
        new.repeats = self.repeats.copy() if self.repeats is not None else None
        return new

    def feed(self, piece: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a stop was hit)."""
        if self._start is not None:
            seen = self._start + piece
            if (hit := next((s for s in self.start_stops if seen.startswith(s)), None)) is not None:
                self._start, self.matched = None, hit
                return "", True
            if any(s.startswith(seen) for s in self.start_stops):
                self._start = seen
                return "", False
            self._start, piece = None, seen
        text, hit = self._feed_stops(piece)
        if self.repeats is None:
            return text, hit
        # A stop that begins with a line break ends the text's last line: the repeated-line stop sees that line whole,
        # as it would have without the stop (a single-line request's "\n" hid every repeat of the line above).
        ended = hit and self.matched is not None and self.matched[:1] in ("\n", "\r")
        text, repeated = self.repeats.feed(text + "\n" if ended else text)
        self.repeated = repeated
        if repeated:  # the repeated line came first: the text ends before it, not at the sequence
            self.matched = None
        elif hit:  # generation ends here: a line held for comparison was no repeat
            text += self.repeats.flush()
            if ended:  # the break fed above is the stop's, which the text leaves out
                text = text[:-1]
        return text, hit or repeated

    def _feed_stops(self, piece: str) -> tuple[str, bool]:
        if not self.stops:
            return piece, False
        text = self._held + piece
        if (hit := first_hit(text, self.stops)) is not None:
            self._held = ""
            cut, self.matched = hit
            return text[:cut], True
        keep = self._longest_partial(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Held-back text at the end of generation: it was no stop after all."""
        if self._start:  # the text ended while it could still have begun a start stop: it did not
            pending, self._start = self._start, None
            text, hit = self.feed(pending)
            return text if hit else text + self.flush()
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
    """Ends a completion where it starts to repeat the block of 1 to MAX_PERIOD lines before it, leaving the repeat out.

    A small model decoding greedily most often fails by looping: the same line over and over, to the token limit, or
    a block of a few lines. Consecutive identical lines are rare in real Rust (0.3% of non-blank lines in the held-out
    crates) and a block of 2 to 4 lines repeated at once rarer still (0.07%, mostly tables of numbers), so the first
    repeat is where the suggestion ends. A block counts when one of its lines is not blank; a period-p repeat is
    confirmed when its p-th line ends, and where a line completes two, the one that began first ends the text.
    Completion lines are held back only while they could still be such a repeat (their text so far begins the lines
    p before, for some p), so streaming waits at most for the end of that block.
    `context` is the document before the completion (its last whole lines and the cursor's line so far, as
    m31r.fim.line_context gives them), whose lines the first completed lines are compared with.
    """

    MAX_PERIOD = 4

    def __init__(self, context: str):
        lines = context.split("\n")
        self.lines = [ln.rstrip() for ln in lines[:-1]][-self.MAX_PERIOD :]  # whole lines so far (rstripped)
        self.cur = lines[-1]  # the current line so far, the document's part included
        self.start = len(self.lines)  # the first line held back (== len(lines): only the current line, if at all)
        self.held: list[str] = []  # the completion's text of each held whole line, its line end included
        self.held_cur = ""  # the completion's text of the current line, held back
        self.holding = self._could_repeat()  # whether the current line's text is being held back

    def copy(self) -> RepeatedLine:
        """An independent copy (a beam search's hypotheses fork it)."""
        new = copy.copy(self)
        new.lines, new.held = list(self.lines), list(self.held)
        return new

    def _repeats(self, s: int, p: int) -> bool:
        """Whether the whole lines from s on repeat the p lines before s, one of which is not blank."""
        return (s - p >= 0 and p <= self.MAX_PERIOD and any(ln.strip() for ln in self.lines[s - p : s])
                and all(self.lines[j] == self.lines[j - p] for j in range(s, len(self.lines))))

    def _could_repeat(self) -> bool:
        """Whether the held lines and the current line so far could begin a repeat of the p lines before, some p."""
        s, k, cur = self.start, len(self.lines), self.cur.rstrip()
        return any(self._repeats(s, p) and self.lines[k - p].startswith(cur) for p in range(k - s + 1, s + 1))

    def _repeat_from(self, line: str) -> int | None:
        """The first line of a repeat that `line`, ending now, completes (it and the held lines from s on repeat the
        p = k + 1 - s lines before s, the last of which it pairs with), the earliest such held line; None if none."""
        k = len(self.lines)
        return next((s for s in range(self.start, k + 1) if self._repeats(s, k + 1 - s) and self.lines[s - 1] == line),
                    None)

    def _settle(self) -> str:
        """Lets held text go, the oldest line first, until what is still held could begin a repeat; returns it."""
        out = []
        while self.start < len(self.lines) and not self._could_repeat():
            out.append(self.held.pop(0))
            self.start += 1
        if self.start == len(self.lines) and self.holding and not self._could_repeat():
            out.append(self.held_cur)
            self.held_cur, self.holding = "", False
        return "".join(out)

    def feed(self, text: str) -> tuple[str, bool]:
        """Returns (text safe to emit, whether a repeated block ended the completion)."""
        out = []
        for i, seg in enumerate(text.split("\n")):
            if i:  # a line end: the current line is whole
                line = self.cur.rstrip()
                if self.holding:
                    if (at := self._repeat_from(line)) is not None:  # the held lines before it were no repeat
                        out.append("".join(self.held[: at - self.start]))
                        self.held, self.held_cur = [], ""
                        return "".join(out), True
                    self.held.append(self.held_cur + "\n")
                else:
                    out.append("\n")
                    self.start = len(self.lines) + 1
                self.lines.append(line)
                self.cur, self.held_cur = "", ""
                self.holding = True  # a new line could begin a repeat until _settle finds it cannot
                out.append(self._settle())
            self.cur += seg
            if self.holding:
                self.held_cur += seg
                out.append(self._settle())
            else:
                out.append(seg)
        return "".join(out), False

    def flush(self) -> str:
        held, self.held, self.held_cur = "".join(self.held) + self.held_cur, [], ""
        self.start, self.holding = len(self.lines), False
        return held

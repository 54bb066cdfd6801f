"""Positions ↔ offsets in a document string, in the negotiated position encoding.

pygls keeps the documents, with incremental changes applied by `edit` (pygls' own splits lines where
str.splitlines does); completions work on a snapshot of a document's text taken when the request arrives, so
the conversions here run on that snapshot, never on the live document.
Lines break at "\\n", "\\r\\n" and "\\r", as the LSP specification says (not at form feeds, U+2028 ...).

`Lines` does the same conversions from line starts it already knows (marks), kept through incremental edits: a
keystroke's didChange and completion then cost what the distance to the nearest mark costs, not what the text before
the cursor does (a scan from the start cost about 30 ms a conversion in a 5 MB document, three per keystroke). The
plain functions stay as the reference it is tested against.
"""

from __future__ import annotations

import codecs
import re
from bisect import bisect_right
from collections.abc import Callable

_EOL = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")
_ASTRAL = re.compile("[\U00010000-\U0010ffff]")  # two UTF-16 units each


def _utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _utf16(s: str) -> int:
    return len(s.encode("utf-16-le", "surrogatepass")) // 2  # (a lone surrogate is one unit, as in the editor)


UNITS: dict[str, Callable[[str], int]] = {"utf-8": _utf8, "utf-16": _utf16, "utf-32": len}


def _units(encoding: object) -> Callable[[str], int]:
    return UNITS.get(str(getattr(encoding, "value", encoding) or "utf-16"), _utf16)


def _line_bounds(text: str, line: int) -> tuple[int, int] | None:
    """(start, end) offsets of line `line` (end before its line break), or None past the last line."""
    start, n = 0, 0
    for m in _EOL.finditer(text):
        if n == line:
            return start, m.start()
        start, n = m.end(), n + 1
    return (start, len(text)) if line == n else None


def offset_at(text: str, line: int, character: int, encoding: str | None = "utf-16", *, after: bool = False) -> int:
    """The offset (code points) of a client position. A character past the line's end means its end; a line
    past the last one means the end of the text; one inside a character (between the two UTF-16 units of an emoji,
    the bytes of a UTF-8 sequence) means before it, or after it with `after`."""
    bounds = _line_bounds(text, line)
    if bounds is None:
        return len(text)
    return _column(text, *bounds, character, encoding, after)


def _column(text: str, start: int, end: int, character: int, encoding: str | None, after: bool = False) -> int:
    """The offset of `character` (code units) on the line text[start:end], its end if past it. A character that
    falls inside one of the line's characters means before that character (as VS Code places such a position), or
    after it with `after` (the end of a range, which then covers the whole character)."""
    count = _units(encoding)
    if count is len:
        return min(start + character, end)
    if count is _utf16:
        return _column_utf16(text, start, end, character, after)
    if count is _utf8:
        return _column_utf8(text, start, end, character, after)
    used = 0
    for i in range(start, end):
        if used >= character:
            return i
        used += count(text[i])
        if used > character:  # inside text[i]: never split it (the daemon could not be sent half a character)
            return i + 1 if after else i
    return end


def _column_utf16(text: str, start: int, end: int, character: int, after: bool) -> int:
    """_column in UTF-16 units: a step per character outside the BMP, not per character (a line of a megabyte took
    a third of a second a keystroke)."""
    pos, used = start, 0  # text[start:pos] is `used` units
    for m in _ASTRAL.finditer(text, start, end):
        a = m.start()
        if used + (a - pos) >= character:
            break
        used += a - pos
        if used + 1 == character:  # between its two units
            return a + 1 if after else a
        pos, used = a + 1, used + 2
    return min(end, pos + character - used)


def _column_utf8(text: str, start: int, end: int, character: int, after: bool) -> int:
    """_column in UTF-8 bytes, counted by the codec: no character is less than a byte, so the first `character`
    characters hold the position."""
    head = text[start : min(end, start + character)]
    data = head.encode("utf-8", "surrogatepass")
    if len(data) <= character:
        return start + len(head)
    whole = codecs.getincrementaldecoder("utf-8")("surrogatepass").decode(data[:character])  # (a cut one left out)
    inside = _utf8(whole) < character
    return start + len(whole) + (inside and after)


def span(text: str, start: tuple[int, int], end: tuple[int, int], encoding: str | None = "utf-16") -> tuple[int, int]:
    """The offsets (a, b), a <= b, of a client range. A range's end inside a character takes in the whole character,
    its start inside one starts before it, and an empty range inside one is before it: VS Code's rules, so that an
    edit never leaves half a character (a lone surrogate) in the text."""
    a = offset_at(text, *start, encoding)
    return a, max(a, offset_at(text, *end, encoding, after=end != start))


def position_at(text: str, offset: int, encoding: str | None = "utf-16") -> tuple[int, int]:
    """(line, character) of an offset, the character in the encoding's code units."""
    offset = max(0, min(offset, len(text)))
    line = len(_EOL.findall(text, 0, offset))
    if offset > 0 and text[offset - 1] == "\r" and offset < len(text) and text[offset] == "\n":
        line -= 1  # between \r and \n: still on the line the \r\n ends
    start = max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1
    if start > offset:
        start = offset
    return line, _units(encoding)(text[start:offset])


def edit(text: str, start: tuple[int, int], end: tuple[int, int], new: str, encoding: str | None = "utf-16") -> str:
    """`text` with the range between two client positions (line, character) replaced by `new`: an incremental
    didChange, placed by the line rules above (the editor's), a character past a line's end meaning its end."""
    a, b = span(text, start, end, encoding)
    return text[:a] + new + text[b:]


def first_line(s: str) -> str:
    """`s` up to its first line break, whichever of the three it is."""
    return _EOL.split(s, 1)[0]


# Where str.splitlines breaks lines ("\r\n" is one break): the daemon (m31r.fim.cut_above) counts lines this way.
SPLITLINES_BREAKS = ("\n", "\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029")


def split_breaks(text: str, start: int = 0, end: int | None = None) -> int:
    """How many lines str.splitlines ends in text[start:end], without copying it or making a list of lines."""
    end = len(text) if end is None else end
    return sum(text.count(c, start, end) for c in SPLITLINES_BREAKS) - text.count("\r\n", start, end)


def _eols(text: str, start: int, end: int) -> int:
    """How many LSP line breaks ("\\r\\n" one) end in text[start:end]: what _EOL.findall would find there."""
    return text.count("\n", start, end) + text.count("\r", start, end) - text.count("\r\n", start, end)


class Lines:
    """A text with line starts it knows (marks: offset, line, and the lines str.splitlines counts before it), so that
    offset_at, position_at and edit scan from the nearest mark, not from the start of the text. Lookups add marks;
    `edit` carries them into the edited text (shifted past the edit), so typing in one place stays cheap however long
    the document is. Results are the plain functions' above, always.

    Not thread-safe (lookups add marks): use it on the event loop only."""

    MAX_MARKS = 64  # past this, the mark nearest the one before it goes
    MARK_AFTER = 4096  # breaks_before marks the line of an offset at least this far past the nearest mark
    BACK_STEP = 1024  # characters of the first step back from a mark (then doubled)
    CHUNK = 1 << 16  # characters counted at a time when a line is far past the nearest mark

    def __init__(self, text: str) -> None:
        self.text = text
        self._at = [0]  # offsets of known line starts, ascending
        self._line = [0]  # their line numbers (LSP's line breaks)
        self._split = [0]  # how many lines str.splitlines ends before them

    def _mark(self, at: int, line: int, split: int) -> None:
        i = bisect_right(self._at, at)
        if self._at[i - 1] == at:
            return
        self._at.insert(i, at)
        self._line.insert(i, line)
        self._split.insert(i, split)
        if len(self._at) > self.MAX_MARKS:  # drop the mark closest to the one before it: the least scan saved
            j = min(range(1, len(self._at)), key=lambda k: self._at[k] - self._at[k - 1])
            del self._at[j], self._line[j], self._split[j]

    def line_bounds(self, line: int) -> tuple[int, int] | None:
        """(start, end) offsets of line `line` (end before its line break), or None past the last line."""
        text = self.text
        if line < 0:
            return None
        i = bisect_right(self._line, line) - 1
        if i + 1 < len(self._at) and self._line[i + 1] - line < line - self._line[i]:
            i = self._back(i + 1, line=line)  # a mark after the line is nearer: count back from it
        start, n = self._at[i], self._line[i]
        if n != line:
            pos = start
            while line - n > self.CHUNK >> 10:  # far: chunks counted in C first, then the last a break at a time
                end = min(pos + self.CHUNK, len(text))
                end += end < len(text) and text[end - 1] == "\r" and text[end] == "\n"  # not inside a "\r\n"
                k = _eols(text, pos, end)
                if n + k >= line or end == len(text):
                    break
                pos, n = end, n + k
            for m in _EOL.finditer(text, pos):
                start, n = m.end(), n + 1
                if n == line:
                    break
            else:
                return None
            self._mark(start, n, self._split[i] + split_breaks(text, self._at[i], start))
        m = _EOL.search(text, start)
        return start, len(text) if m is None else m.start()

    def offset_at(self, line: int, character: int, encoding: str | None = "utf-16", *, after: bool = False) -> int:
        """As offset_at(self.text, ...)."""
        bounds = self.line_bounds(line)
        return len(self.text) if bounds is None else _column(self.text, *bounds, character, encoding, after)

    def span(self, start: tuple[int, int], end: tuple[int, int], encoding: str | None = "utf-16") -> tuple[int, int]:
        """As span(self.text, ...)."""
        a = self.offset_at(*start, encoding)
        return a, max(a, self.offset_at(*end, encoding, after=end != start))

    def position_at(self, offset: int, encoding: str | None = "utf-16") -> tuple[int, int]:
        """As position_at(self.text, ...)."""
        text = self.text
        offset = max(0, min(offset, len(text)))
        line, start = self._line_of(offset)
        if 0 < offset < len(text) and text[offset - 1] == "\r" and text[offset] == "\n":
            line, start = line - 1, offset  # between \r and \n: still on the line the \r\n ends (as position_at says)
        return line, _units(encoding)(text[start:offset])

    def breaks_before(self, offset: int) -> int:
        """split_breaks(self.text, 0, offset): the index, as str.splitlines counts lines, of the line holding offset."""
        i = self._mark_before(offset)
        if offset - self._at[i] > self.MARK_AFTER:  # mark its line's start: the next call near it need not go so far
            self._line_of(offset)
            i = bisect_right(self._at, offset) - 1
        return self._split[i] + split_breaks(self.text, self._at[i], offset)

    def _mark_before(self, offset: int) -> int:
        """The index of a mark at or before `offset`: the last one, or one made by counting back from the mark after
        it when that one is nearer."""
        i = bisect_right(self._at, offset) - 1
        if i + 1 < len(self._at) and self._at[i + 1] - offset < offset - self._at[i]:
            i = self._back(i + 1, offset=offset)
        return i

    def _back(self, j: int, *, line: int | None = None, offset: int | None = None) -> int:
        """The index of a mark at a line start at or before `line` (or `offset`), made by counting back from mark j
        (past it) in doubling steps, or the mark before j if these reach it: a cursor that moves up costs the distance
        it moved, not a scan from the start of the text."""
        text, end = self.text, self._at[j]
        step = self.BACK_STEP
        while True:
            p = (end if offset is None else offset) - step
            if p <= self._at[j - 1]:
                return j - 1
            m = _EOL.search(text, p)  # the first line break from p on: it ends at or before the mark, a line start
            at = end if m is None else m.end()
            line_at = self._line[j] - _eols(text, at, end)
            if (offset is not None and at <= offset) or (line is not None and line_at <= line):
                self._mark(at, line_at, self._split[j] - split_breaks(text, at, end))
                return bisect_right(self._at, at) - 1
            step *= 2

    def _line_of(self, offset: int) -> tuple[int, int]:
        """(line, start of that line) of an offset that is not between a "\\r" and a "\\n"; the start is marked."""
        text = self.text
        i = self._mark_before(offset)
        mark = self._at[i]
        # The line's start: after the last break before the offset, which is the mark itself if none follows it.
        start = max(mark, text.rfind("\n", mark, offset) + 1, text.rfind("\r", mark, offset) + 1)
        line = self._line[i] + _eols(text, mark, offset)
        if start > mark and not (text[start - 1] == "\r" and text[start : start + 1] == "\n"):
            self._mark(start, line, self._split[i] + split_breaks(text, mark, start))
        return line, start

    def edit(self, start: tuple[int, int], end: tuple[int, int], new: str,
             encoding: str | None = "utf-16") -> Lines:
        """As edit(self.text, ...), with this text's marks carried over: those before the edit as they are, those
        after it shifted by the characters and lines it added or removed."""
        old = self.text
        a, b = self.span(start, end, encoding)
        text = old[:a] + new + old[b:]
        out = Lines(text)
        if len(self._at) == 1:
            return out
        # The lines before a mark past the edit change by the breaks in the edited span and the characters on either
        # side of it (a "\r" before it and a "\n" after it may join into one break, or part).
        lo, hi = max(0, a - 1), a + len(new) + 1
        lines = _eols(text, lo, hi) - _eols(old, lo, b + 1)
        splits = split_breaks(text, lo, hi) - split_breaks(old, lo, b + 1)
        chars = len(new) - (b - a)
        joined = a > 0 and old[a - 1] == "\r" and text[a : a + 1] == "\n"  # a mark at `a` is no line start now
        for at, line, split in zip(self._at[1:], self._line[1:], self._split[1:], strict=True):
            if at < a or (at == a and not joined):
                kept = (at, line, split)
            elif at > b:
                kept = (at + chars, line + lines, split + splits)
            else:
                continue
            out._at.append(kept[0])
            out._line.append(kept[1])
            out._split.append(kept[2])
        return out


def scrub(s: str) -> str:
    """`s` with lone surrogates (JSON may carry them, UTF-8 cannot: the daemon request would not encode) as U+FFFD,
    one code point for one, so offsets and positions stay the same."""
    return s if s.isascii() else _SURROGATE.sub("\ufffd", s)

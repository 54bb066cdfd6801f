"""Positions ↔ offsets in a document string, in the negotiated position encoding.

pygls keeps the documents, with incremental changes applied by `edit` (pygls' own splits lines where
str.splitlines does); completions work on a snapshot of a document's text taken when the request arrives, so
the conversions here run on that snapshot, never on the live document.
Lines break at "\\n", "\\r\\n" and "\\r", as the LSP specification says (not at form feeds, U+2028 ...).
"""

from __future__ import annotations

import re
from collections.abc import Callable

_EOL = re.compile(r"\r\n|\r|\n")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _utf8(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def _utf16(s: str) -> int:
    return len(s) + sum(1 for c in s if ord(c) > 0xFFFF)


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


def offset_at(text: str, line: int, character: int, encoding: str | None = "utf-16") -> int:
    """The offset (code points) of a client position. A character past the line's end means its end; a line
    past the last one means the end of the text."""
    bounds = _line_bounds(text, line)
    if bounds is None:
        return len(text)
    start, end = bounds
    count = _units(encoding)
    if count is len:
        return min(start + character, end)
    used = 0
    for i in range(start, end):
        if used >= character:
            return i
        used += count(text[i])
    return end


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
    a = offset_at(text, *start, encoding)
    b = max(a, offset_at(text, *end, encoding))
    return text[:a] + new + text[b:]


def first_line(s: str) -> str:
    """`s` up to its first line break, whichever of the three it is."""
    return _EOL.split(s, 1)[0]


def scrub(s: str) -> str:
    """`s` with lone surrogates (JSON may carry them, UTF-8 cannot: the daemon request would not encode) as U+FFFD,
    one code point for one, so offsets and positions stay the same."""
    return s if s.isascii() else _SURROGATE.sub("\ufffd", s)

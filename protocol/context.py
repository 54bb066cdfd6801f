"""Which code of other project files a front end sends with a FIM request (`Fim.context`).

A small model cannot know the names a crate defines elsewhere (a struct's fields, a helper's arguments), and
they are much of what a line completion gets wrong. The snippets are windows of other files that share the most
identifiers with the lines above the cursor (Jaccard similarity of identifier sets, RepoCoder's sparse retrieval):
cheap, and the same choice when training (`m31r.train.samples`) as when serving. The query is whole lines above
the cursor's block of lines, so typing does not change it and the prompt's head stays in the daemon's cache.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from m31r_protocol.limits import MAX_SNIPPETS
from m31r_protocol.messages import Snippet


def wire_path(path: str) -> str:
    """A file's path as the wire can carry it: the bytes of a name that is not UTF-8 (lone surrogates in Python's str
    of it) as \\xNN escapes. Sent as they were, the daemon refused the whole request, so a file so named, or one
    beside it in the crate with project context on, could not be completed at all."""
    return path if path.isascii() else path.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
WINDOW_LINES = 20  # lines per snippet; windows start every WINDOW_LINES // 2 lines
QUERY_LINES = 20  # whole lines above the cursor's block of lines that choose the snippets
QUERY_STEP = 8  # the blocks' size


@dataclass(frozen=True)
class Window:
    start: int  # first line
    text: str
    words: frozenset[str]


def windows(text: str) -> list[Window]:
    """A file cut into overlapping windows of WINDOW_LINES lines (callers keep them per file version)."""
    lines = text.splitlines(keepends=True)
    step = WINDOW_LINES // 2
    out = []
    for i in range(0, max(1, len(lines) - step), step):
        chunk = "".join(lines[i : i + WINDOW_LINES])
        words = frozenset(WORD.findall(chunk))
        if words:
            out.append(Window(i, chunk, words))
    return out


def line_start(prefix: str) -> int:
    """Where the cursor's line starts in `prefix`: after its last "\\n" or lone "\\r" (old Mac files' line end), as
    the daemon splits a prompt (m31r.fim.split_prefix). A "\\r" is looked for after the last "\\n" only, not through
    a long prefix."""
    nl = prefix.rfind("\n")
    return max(nl, prefix.rfind("\r", nl + 1)) + 1


def query_words(prefix: str) -> frozenset[str]:
    """Identifiers of the QUERY_LINES whole lines above the cursor line's block of QUERY_STEP lines (above the cursor
    line itself in a file's first block). Anchored to blocks, the snippets change on one Enter in ten rather than
    one in three (a change re-runs the whole prompt: its head moved), at the price of not seeing the lines of the
    cursor's own block."""
    lines = prefix[: line_start(prefix)].splitlines(keepends=True)
    block = len(lines) // QUERY_STEP * QUERY_STEP  # the cursor's line is lines[len(lines)]
    query = lines[block - QUERY_LINES if block >= QUERY_LINES else 0 : block or len(lines)]
    return frozenset(WORD.findall("".join(query)))


def rank(query: frozenset[str], files: Iterable[tuple[str, Sequence[Window]]],
         limit: int = MAX_SNIPPETS) -> list[Snippet]:
    """The `limit` windows most like the query, best first (ties by path, then line), no two of one file
    overlapping; none that shares no identifier with it."""
    if not query:
        return []
    scored = []
    for path, wins in files:
        for w in wins:
            common = len(query & w.words)
            if common:
                scored.append((common / (len(query) + len(w.words) - common), path, w))
    scored.sort(key=lambda s: (-s[0], s[1], s[2].start))
    out: list[Snippet] = []
    taken: dict[str, list[int]] = {}
    for _, path, w in scored:
        if any(abs(w.start - s) < WINDOW_LINES for s in taken.get(path, ())):
            continue
        taken.setdefault(path, []).append(w.start)
        out.append(Snippet(w.text, path))
        if len(out) == limit:
            break
    return out

"""The language server's per-keystroke work on long documents: `documents.Lines` converts positions from the line
starts it knows, carried through incremental edits, so a keystroke no longer scans the text from its start (about
50 ms a keystroke in a 5 MB file). What is checked here is that the faster path gives what the plain functions give
on the whole text, under random edits, and that the server keeps the editor's text through them; not timing."""

from __future__ import annotations

import random

import pytest
import test_lsp
from test_lsp import NOISE, URI

from m31r_lsp import documents
from m31r_lsp.completion import query_prefix, sent_text
from m31r_lsp.documents import Lines, offset_at, position_at, split_breaks
from m31r_protocol import policy
from m31r_protocol.context import query_words

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp

# Every kind of line break (LSP's three, and those only str.splitlines sees), and characters of 1 to 4 UTF-8 bytes
# and 1 or 2 UTF-16 units.
PIECES = ["a", "bc", " ", "\n", "\r", "\r\n", "\x0c", "\u2028", "\x85", "é", "🐢", "x\n", "\r\r\n"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PIECES) for _ in range(n))


def lines_in(text: str) -> int:
    return len(documents._EOL.findall(text)) + 1


@pytest.mark.parametrize("seed", range(4))
def test_line_index_under_random_edits_matches_the_plain_functions(monkeypatch, seed):
    """Random incremental edits (joining and splitting "\\r\\n", edits past a line's end or the last line) and
    lookups, in all three encodings: the index's text, offsets, positions and str.splitlines line counts are the plain
    functions' on the whole text, with few marks (so that they are evicted), marks placed at every lookup and found by
    counting back from a later one."""
    monkeypatch.setattr(Lines, "MAX_MARKS", 4 if seed % 2 else 64)
    monkeypatch.setattr(Lines, "MARK_AFTER", 0)
    monkeypatch.setattr(Lines, "BACK_STEP", 1)  # (counting back from a later mark, in these short texts too)
    monkeypatch.setattr(Lines, "CHUNK", 1 + seed)  # (and counting lines a chunk at a time)
    rng = random.Random(seed)
    used_marks = 0
    for _ in range(40):
        text = random_text(rng, rng.randint(0, 80))
        lines = Lines(text)
        for _ in range(80):
            enc = rng.choice(["utf-16", "utf-8", "utf-32"])
            n = lines_in(text)
            op = rng.random()
            if op < 0.4:
                start = (rng.randint(0, n), rng.randint(0, 6))
                end = (rng.randint(0, n), rng.randint(0, 6)) if rng.random() < 0.5 else start
                new = random_text(rng, rng.randint(0, 3))
                text = documents.edit(text, start, end, new, enc)
                lines = lines.edit(start, end, new, enc)
                assert lines.text == text
            elif op < 0.6:
                line, ch = rng.randint(0, n), rng.randint(0, 8)
                assert lines.offset_at(line, ch, enc) == offset_at(text, line, ch, enc)
            elif op < 0.8:
                at = rng.randint(0, len(text))
                assert lines.position_at(at, enc) == position_at(text, at, enc)
            else:
                at = rng.randint(0, len(text))
                head = text[:at]
                want = len(head.splitlines()) - (1 if head and not head.endswith(documents.SPLITLINES_BREAKS) else 0)
                assert lines.breaks_before(at) == split_breaks(text, 0, at) == want
            used_marks += len(lines._at) - 1
    assert used_marks > 0  # (the marks were used, not only the start of the text)


def test_typing_far_into_a_long_document_keeps_marks_near_the_cursor():
    """Typing on one line of a long document: after the first lookup, every conversion starts from a mark on that
    line (or the one before), not from the start of the text, and the results stay the plain functions'."""
    text = "".join(f"    let v{i} = {i};\r\n" for i in range(5000))
    lines = Lines(text)
    line = 4000
    col = len("    let v4000 = ")
    for k in range(20):
        lines = lines.edit((line, col + k), (line, col + k), "x")
        text = lines.text
        at = lines.offset_at(line, col + k + 1)
        assert at == offset_at(text, line, col + k + 1) and lines.position_at(at) == position_at(text, at)
        nearest = max(m for m in lines._at if m <= at)
        assert at - nearest <= len("    let v4000 = ") + k + 1  # the line's own start is known
    assert lines.breaks_before(at) == split_breaks(text, 0, at) == 4000
    # The cursor moves up 500 lines: its line is found by counting back from the marks below, then known.
    for up in (3500, 3499):
        at = lines.offset_at(up, 4)
        assert at == offset_at(text, up, 4) and lines.position_at(at) == position_at(text, at) == (up, 4)
        assert 0 < at - max(m for m in lines._at if m <= at) <= 4 + len("    let v3500 = 3500;\r\n")


@pytest.mark.parametrize("nl", ["\n", "\r\n", "\r"])
def test_sent_text_from_the_index_is_the_plain_cut(nl):
    """The cut of a long document's prefix, its line index counted from the document's marks, is the one counted
    over the whole prefix; and project context chosen by the text sent is the one the whole prefix (read with "\\n"
    line ends) chooses, or the whole prefix is used."""
    rng = random.Random(len(nl))
    text = "".join(f"fn f{i}() {{{nl}" + "".join(f"    let x{k} = y{i % 13};{nl}" for k in range(rng.randint(0, 30)))
                   + f"}}{nl}" for i in range(3000))
    lines, cut, short = Lines(text), 0, 0
    for _ in range(30):
        offset = rng.randint(0, len(text))
        if text[offset - 1 : offset + 1] == "\r\n":
            offset += 1
        lines.position_at(offset)  # (marks somewhere, as a request's conversions leave them)
        prefix, suffix = text[:offset], text[offset:]
        plain = sent_text(prefix, suffix, 512)
        assert sent_text(prefix, suffix, 512, lines.breaks_before) == plain
        cut += plain[0] != prefix
        lf = prefix.replace("\r\n", "\n").replace("\r", "\n")
        query = query_prefix(prefix, plain[0])
        assert query_words(query) == query_words(lf)
        short += query != prefix  # (the text sent, not the whole prefix)
    assert cut > 20 and short == cut  # (most cursors are far enough into the text for a cut)


async def test_the_server_keeps_the_editors_text_through_random_edits(lsp):
    """Random one-character edits, line breaks of all three kinds among them (a "\\n" typed after a "\\r" joins the
    two into one break), through didChange: each Fim's prefix and suffix are the editor's text around the cursor,
    and each suggestion's range is where the plain functions place it."""
    s = await lsp({**NOISE, "maxTokens": 2})
    rng = random.Random(5)
    text = "fn main() {\r\n    let a = 1;\r    let b = 2;\n}\n"
    s.open(text)
    for _ in range(40):
        text = s.texts[URI]
        at = rng.randint(0, len(text))
        if text[at - 1 : at + 1] == "\r\n":
            at -= 1
        if rng.random() < 0.25 and at < len(text):
            end = at + 1 + (text[at : at + 2] == "\r\n")
            s.edit(at, end, "")
        else:
            s.edit(at, at, rng.choice(["x", "é", "🐢", "\n", "\r", "\r\n", " "]))
        text = s.texts[URI]
        cursor = rng.randint(0, len(text))
        if text[cursor - 1 : cursor + 1] == "\r\n":
            cursor -= 1
        res = await s.inline(cursor)
        st = await s.stats()
        plan = policy.plan(text, cursor, policy.Options(multiline="always", max_tokens=2))
        assert (st["lastFim"]["prefix"], st["lastFim"]["suffix"]) == (plan.prefix, plan.suffix)
        for item in res.items:
            want = test_lsp.expected(text, cursor, st["lastRaw"], multiline="always")
            assert want is not None
            assert (item.range.start.line, item.range.start.character) == position_at(text, want.start)
            assert (item.range.end.line, item.range.end.character) == position_at(text, want.end)

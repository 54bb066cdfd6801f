"""`m31r lsp` and positions that fall inside a character: between the two UTF-16 units of a character outside the BMP
(an emoji in a string or a comment), or among the bytes of a UTF-8 sequence. A client should never send one, but a
client that counts columns another way does. The server takes such a cursor as being before the character, for the
prefix and the suffix alike, and an edit's range as covering whole characters (VS Code's rules), so that its text
never holds half a character. Real server, real daemon (test_lsp's fixtures), nothing mocked."""

from __future__ import annotations

import random

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, URI, check_item

from m31r_lsp import documents

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp


def change(s: test_lsp.Session, start: tuple[int, int], end: tuple[int, int], new: str) -> None:
    """A didChange with these raw positions (the session's own text is not updated)."""
    s.version[URI] += 1
    s.client.text_document_did_change(t.DidChangeTextDocumentParams(
        text_document=t.VersionedTextDocumentIdentifier(uri=URI, version=s.version[URI]),
        content_changes=[t.TextDocumentContentChangePartial(range=t.Range(t.Position(*start), t.Position(*end)),
                                                            text=new)]))


async def inline_at(s: test_lsp.Session, line: int, character: int) -> t.InlineCompletionList:
    return await s.client.text_document_inline_completion_async(t.InlineCompletionParams(
        context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Invoked),
        text_document=t.TextDocumentIdentifier(URI), position=t.Position(line, character)))


@pytest.mark.parametrize(("enc", "inside"), [("utf-16", 1), ("utf-8", 1), ("utf-8", 3)])
async def test_a_cursor_inside_a_character_is_before_it(lsp, enc, inside):
    """The cursor between the units of 🐢: the Fim's prefix ends before it and its suffix starts with it (it was
    after it, and the suggestion's range then started after the cursor the editor sent), and the suggestion is placed
    for that cursor."""
    s = await lsp(NOISE, encodings=[enc])
    assert (await s.stats())["positionEncoding"] == enc
    text = 'fn main() {\n    let s = "🐢🐢"; let n = s.len();\n    \n}\n'
    s.open(text)
    at = text.index("🐢")
    column = len(text[text.index("\n") + 1 : at].encode("utf-8" if enc == "utf-8" else "utf-16-le"))
    column //= 1 if enc == "utf-8" else 2
    res = await inline_at(s, 1, column + inside)
    st = await s.stats()
    assert st.get("daemon_requests", 0) == 1
    fim = st["lastFim"]
    assert (fim["prefix"], fim["suffix"]) == (text[:at], text[at:])
    assert res.items  # (NOISE's seed makes a suggestion here)
    for item in res.items:
        check_item(item, text, at, st["lastRaw"], enc=enc, multiline="always")


async def test_edits_inside_surrogate_pairs_and_past_the_end_keep_whole_characters(lsp):
    """Incremental edits whose ranges fall inside surrogate pairs: an insertion goes before the character, a range
    that ends inside one covers it, one that starts inside one starts before it. Edits past a line's end and past the
    last line land at those ends. The Fim sent after them is that text, and it reaches the daemon (no half character
    that UTF-8 could not encode)."""
    s = await lsp({**NOISE, "multiline": "never"})
    text = 'let a = "🐢x🐢";\nlet b = "🐍";\n'
    s.open(text)
    col = text.index("🐢")  # (all ASCII before it on line 0)
    change(s, (0, col + 1), (0, col + 1), "A")  # inside the first 🐢: before it
    text = text.replace('"🐢', '"A🐢', 1)
    col += 1
    change(s, (0, col + 1), (0, col + 3), "B")  # from inside the first 🐢 to after the x: 🐢x replaced
    text = text.replace("🐢x", "B", 1)
    end = text.index("🐢")  # the second one, on line 0
    change(s, (0, col), (0, end + 1), "")  # from B to inside the second 🐢: both gone
    text = text[:col] + text[end + 1 :]
    snake = text.index("🐍") - text.index("\n") - 1
    change(s, (1, snake + 1), (1, snake + 2), "C")  # the whole 🐍 replaced, from inside it to after it
    text = text.replace("🐍", "C")
    change(s, (1, 500), (1, 600), " // past the end of the line")
    text = text.replace("C\";\n", "C\"; // past the end of the line\n")
    change(s, (9, 0), (12, 3), "let c = ")  # past the last line: at the end of the document
    text += "let c = "
    assert text == 'let a = "A";\nlet b = "C"; // past the end of the line\nlet c = '
    await inline_at(s, 2, 8)
    st = await s.stats()
    assert st.get("daemon_requests", 0) == 1 and st["lastRaw"] is not None
    assert (st["lastFim"]["prefix"], st["lastFim"]["suffix"]) == (text, "")


def _column_by_character(text: str, start: int, end: int, character: int, encoding: str, after: bool) -> int:
    """documents._column as one step per character (the plain reading of the rules)."""
    units = {"utf-8": lambda c: len(c.encode("utf-8", "surrogatepass")),
             "utf-16": lambda c: 2 if ord(c) > 0xFFFF else 1}
    used = 0
    for i in range(start, end):
        if used >= character:
            return i
        used += units[encoding](text[i])
        if used > character:
            return i + 1 if after else i
    return end


def test_columns_counted_by_the_codecs_are_counted_by_character():
    """The fast paths (UTF-8 through the codec, UTF-16 a step per character outside the BMP) give what a count
    character by character gives, lone surrogates (one UTF-16 unit, three bytes with surrogatepass) among them."""
    rng = random.Random(3)
    pieces = ["a", "é", "€", "中", "🐢", "\U0010ffff", "\ud83d", "\ude00", "\r", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 14)))
        start = rng.randint(0, len(text))
        end = rng.randint(start, len(text))
        for enc in ("utf-8", "utf-16"):
            character, after = rng.randint(0, 50), rng.random() < 0.5
            assert documents._column(text, start, end, character, enc, after) == _column_by_character(
                text, start, end, character, enc, after), (text, start, end, character, enc, after)
        assert documents._utf16(text) == sum(2 if ord(c) > 0xFFFF else 1 for c in text)


async def test_keystrokes_on_a_very_long_line(lsp):
    """A long line (generated data, a minified file) with a character outside the BMP near its end: columns there are
    counted by the codecs' fast path (a step per such character, not per character; a Python loop took ~0.3 s a
    keystroke on a megabyte line), and the text must stay the editor's."""
    s = await lsp({**NOISE, "maxTokens": 2})
    line = "static DATA: [u8; 50000] = [" + ", ".join(f"{i % 256}" for i in range(50_000)) + "]; // \U0001f422 \u00e9"
    text = f"fn main() {{}}\n{line}\n"
    s.open(text)
    await s.stats()
    col = len(line) + 1  # UTF-16 units: the turtle is two
    for k in range(10):
        change(s, (1, col + k), (1, col + k), "x")
    text = text.replace("\u00e9\n", "\u00e9" + "x" * 10 + "\n")
    await inline_at(s, 1, col + 10)
    fim = (await s.stats())["lastFim"]
    at = text.index("\u00e9") + 11
    assert fim["prefix"].endswith(" // \U0001f422 \u00e9xxxxxxxxxx") and fim["suffix"] == text[at:]

"""The menu item (textDocument/completion) that editors without inline completion show (Helix, Kate, Sublime, Emacs'
completion-at-point), against the ghost text of the same keystroke (session 49).

Such editors filter the items by the word before the cursor (Helix: the word's start to the cursor, fuzzy, against
filterText; Emacs: the symbol at point against the label) and ask again as the user types (isIncomplete). The item of
a suggestion typed through (`cou█` answered "YF…", the user types "Y") was the suggestion alone over what was typed
of it ("YF…" over "Y"): no match for the word "couY", so the item left the menu on the first keystroke that agreed
with it. A word of non-ASCII letters (`grö█`) was not taken as a word at all. The item now starts where the word the
suggestion starts in does, and accepting it gives the document the ghost text gives.

A real `m31r lsp` against the shared daemon of the tiny random-weight model (sampled: its noise is shown), in a CRLF
document with an emoji before the cursors (two UTF-16 units), at a blank line and at the document's end.
"""

from __future__ import annotations

import asyncio
import re

import pytest
from lsp_stdio import Stdio

from m31r_lsp.documents import offset_at, position_at

pytestmark = pytest.mark.timeout(120)

NOISE = {"multiline": "always", "temperature": 1.0, "seed": 7, "debounceMode": "fixed", "debounceMs": 0,
         "minProbability": 0}
NL = "\r\n"
LINES = [
    "fn main() {",
    '    let s = "😀"; let größe = 1; let g = grö',
    "        ",
    '    let e = "😀"; let total = cou',
    "}",
    '    let x = "😀"; foo(a, ba',  # the document's end, without a line break
]
TEXT = NL.join(LINES)
# Cursors (line, column in code points): after a word of non-ASCII letters, inside a blank line's indentation, after
# an ASCII word, at the document's end.
CURSORS = [(1, len(LINES[1])), (2, 4), (3, len(LINES[3])), (5, len(LINES[5]))]
SEEDS = [7, 3]  # (the noise differs with the seed)


def applied(text: str, rng: dict, new: str) -> str:
    """`text` with an edit applied as an editor applies it (UTF-16 positions)."""
    a, b = (offset_at(text, p["line"], p["character"], "utf-16") for p in (rng["start"], rng["end"]))
    return text[:a] + new + text[b:]


async def ask(s: Stdio, method: str, uri: str, text: str, cursor: int, context: dict | None = None) -> list[dict]:
    """The items of a request at `cursor` (automatic, as while typing: both kinds share one job)."""
    line, ch = position_at(text, cursor, "utf-16")
    params: dict = {"textDocument": {"uri": uri}, "position": {"line": line, "character": ch}}
    if context is not None:
        params["context"] = context
    return (await s.request(method, params, timeout=60))["result"]["items"]


def check(text: str, cursor: int, ghost: list[dict], menu: list[dict]) -> str | None:
    """The menu's item agrees with the ghost text (an item where it shows one, the same document accepted) and stays
    in the menus filtering on the word before the cursor; the next character the ghost text would type, if any."""
    assert len(menu) == min(1, len(ghost)), (ghost, menu)
    if not ghost:
        return None
    [item], first = menu, ghost[0]
    edit, r = item["textEdit"], item["textEdit"]["range"]
    # Ghost text has "\n" line breaks (Neovim splits at those), written as the document's by the editor.
    assert applied(text, edit["range"], edit["newText"]) == applied(text, first["range"],
                                                                    first["insertText"].replace("\n", NL))
    line, ch = position_at(text, cursor, "utf-16")
    assert r["start"]["line"] == r["end"]["line"] == line  # LSP: one line, the request's position in it
    assert r["start"]["character"] <= ch <= r["end"]["character"]
    start = offset_at(text, line, r["start"]["character"], "utf-16")
    word = re.search(r"\w*\Z", text[:cursor]).group()  # the word before the cursor, letters of any script
    # Filtered by the text from the edit's start (VS Code, Neovim), by the word (Helix), by the label (Emacs).
    assert item["filterText"] == edit["newText"] and edit["newText"].startswith(text[start:cursor]), (word, item)
    assert start <= cursor - len(word) and item["label"].startswith(word), (word, item)
    typed = cursor - offset_at(text, *(first["range"]["start"][k] for k in ("line", "character")), "utf-16")
    following = first["insertText"][typed : typed + 1]
    return following if following.strip() else None


def test_the_menu_item_keeps_the_word_and_agrees_with_the_ghost_text_while_typing_through(shared_daemon) -> None:
    sock = shared_daemon[1]

    async def run() -> tuple[int, int]:
        s = await Stdio.spawn(sock)
        await s.request("initialize", {"processId": None, "capabilities": {},
                                       "initializationOptions": {"m31r": {"socket": str(sock), **NOISE}}})
        s.send("initialized", {})
        shown = word_typed = 0
        for n, (seed, (line, column)) in enumerate((seed, c) for seed in SEEDS for c in CURSORS):
            s.send("workspace/didChangeConfiguration", {"settings": {"m31r": {**NOISE, "socket": str(sock),
                                                                               "seed": seed}}})
            uri = f"file:///work/src/c{n}.rs"
            s.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "rust", "version": 1,
                                                             "text": TEXT}})
            text, cursor = TEXT, sum(len(ln) + len(NL) for ln in LINES[:line]) + column
            for version in (1, 2):
                ghost = await ask(s, "textDocument/inlineCompletion", uri, text, cursor, {"triggerKind": 2})
                menu = await ask(s, "textDocument/completion", uri, text, cursor)
                nxt = check(text, cursor, ghost, menu)
                shown += bool(ghost)
                if version == 2 or nxt is None:
                    break
                # The user types the character the suggestion goes on with: answered from it (typed-through).
                line, ch = position_at(text, cursor, "utf-16")
                s.send("textDocument/didChange", {"textDocument": {"uri": uri, "version": 2}, "contentChanges": [
                    {"range": {"start": {"line": line, "character": ch}, "end": {"line": line, "character": ch}},
                     "text": nxt}]})
                text, cursor = text[:cursor] + nxt + text[cursor:], cursor + 1
                word_typed += nxt.isalnum() or nxt == "_"
            s.send("textDocument/didClose", {"textDocument": {"uri": uri}})
        stats = (await s.request("m31r/stats", {}))["result"]
        assert stats["typed_through"] >= 2, stats
        assert await s.end() == (0, "")
        return shown, word_typed

    shown, word_typed = asyncio.run(run())
    assert shown >= 6 and word_typed >= 2  # the cases are the ones this is about (the noise of these seeds)

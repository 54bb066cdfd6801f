"""`m31r lsp` with the completion menu on (VS Code's `m31r.completionMenu`): on one keystroke the editor asks for a menu
completion (textDocument/completion) and for ghost text beside the menu's selected item (textDocument/inlineCompletion
with selectedCompletionInfo) at once. A real server against the shared tiny daemon (test_lsp's fixtures)."""

from __future__ import annotations

import asyncio

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, RUST, URI, Session

from m31r_lsp.documents import offset_at, position_at

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp

TEXT = RUST.replace("let counts = count_words(text);", "let counts = count_w")
CURSOR = TEXT.index("count_w\n") + len("count_w")
WORD = CURSOR - len("count_w")  # where the word the menu completes starts
# Both requests of a keystroke wait out the debounce together, so they overlap in the server and at the daemon.
MENU = {**NOISE, "debounceMs": 300}


def menu(s: Session, offset: int):
    """The keystroke's textDocument/completion request (the menu; our item carries the suggestion)."""
    line, ch = position_at(s.texts[URI], offset, "utf-16")
    return send(s, t.TEXT_DOCUMENT_COMPLETION, t.CompletionParams(
        text_document=t.TextDocumentIdentifier(URI), position=t.Position(line, ch)))


def beside(s: Session, offset: int, item: str):
    """The keystroke's inline request with `item` (completing the word before the cursor) selected in the menu."""
    text = s.texts[URI]
    (l0, c0), (l1, c1) = position_at(text, WORD, "utf-16"), position_at(text, offset, "utf-16")
    params = s.inline_params(offset, invoked=False)
    params.context.selected_completion_info = t.SelectedCompletionInfo(
        range=t.Range(t.Position(l0, c0), t.Position(l1, c1)), text=item)
    return send(s, t.TEXT_DOCUMENT_INLINE_COMPLETION, params)


def applied(text: str, edit: t.TextEdit) -> str:
    """`text` with `edit` applied."""
    r = edit.range
    a, b = (offset_at(text, p.line, p.character, "utf-16") for p in (r.start, r.end))
    return text[:a] + edit.new_text + text[b:]


def send(s: Session, method: str, params) -> asyncio.Future:
    """Send a request now (as the editor does, before its next notification), its answer to come."""
    return asyncio.wrap_future(s.client.protocol.send_request(method, params))


async def test_the_menu_and_the_ghost_text_of_one_keystroke_are_both_answered(lsp):
    """The two requests of a keystroke superseded each other (one job per document, and the daemon cancels an older
    Fim of the same `document`): the menu item or the ghost text beside it vanished, keystroke after keystroke. Each
    kind now has its own job and daemon `document`; typed-through still answers the plain cursor's next keystroke."""
    s = await lsp(MENU)
    s.open(TEXT)
    items, ghost = await asyncio.gather(menu(s, CURSOR), beside(s, CURSOR, "count_words"))
    st = await s.stats()
    assert len(items.items) == 1 and items.items[0].text_edit.new_text.startswith("count_w")
    assert len(ghost.items) == 1 and ghost.items[0].insert_text.startswith("count_words")
    assert len(ghost.items[0].insert_text) > len("count_words")
    assert st["daemon_requests"] == 2 and "superseded" not in st and "daemon_error_cancelled" not in st, st
    # The user types the first character of the menu item's suggestion: the rest of it, without asking the daemon,
    # though the ghost text's job (for another text) finished too.
    typed = items.items[0].text_edit.new_text[CURSOR - WORD]
    s.edit(CURSOR, CURSOR, typed)
    again = await menu(s, CURSOR + 1)
    st = await s.stats()
    assert st["typed_through"] == 1 and st["daemon_requests"] == 2, st
    assert applied(TEXT, items.items[0].text_edit) == applied(s.texts[URI], again.items[0].text_edit)
    # The user accepts the menu's item instead, then types on faster than the daemon answers: the ghost text that was
    # shown beside the item is typed through.
    s.edit(WORD, CURSOR + 1, "count_words")
    after = CURSOR + len("ords")
    accepted = menu(s, after)  # (still waiting out its debounce at the next keystroke)
    s.edit(after, after, ghost.items[0].insert_text[len("count_words")])
    again = await menu(s, after + 1)
    st = await s.stats()
    assert not (await accepted).items
    assert st["typed_through"] == 2 and st["daemon_requests"] == 2, st
    whole = TEXT[:WORD] + ghost.items[0].insert_text + TEXT[CURSOR:]  # the document with the ghost text accepted
    assert applied(s.texts[URI], again.items[0].text_edit) == whole


async def test_a_newer_keystroke_supersedes_each_kind_of_the_older_ones_work(lsp):
    """A keystroke's requests of either kind end the previous keystroke's, and moving through the menu (another item
    selected) ends the older item's ghost text but not the menu's request: at most one job per document and kind."""
    s = await lsp(MENU)
    s.open(TEXT)
    old = [menu(s, CURSOR), beside(s, CURSOR, "count_words")]
    s.edit(CURSOR, CURSOR, "o")  # the next keystroke
    new = [menu(s, CURSOR + 1), beside(s, CURSOR + 1, "count_woes"), beside(s, CURSOR + 1, "count_words")]
    (old_menu, old_ghost), (items, moved_off, ghost) = await asyncio.gather(*old), await asyncio.gather(*new)
    st = await s.stats()
    assert not old_menu.items and not old_ghost.items and not moved_off.items
    assert len(items.items) == 1 and len(ghost.items) == 1 and ghost.items[0].insert_text.startswith("count_words")
    # Only the newest of each kind reached the daemon.
    assert st["daemon_requests"] == 2 and st["superseded"] == 1 and st["stale"] == 2, st

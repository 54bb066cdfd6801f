"""`m31r lsp` at the edges an editor reaches: settings of the wrong shape, requests for documents the server does not
hold, cursors past a line's or the document's end. Real server, real daemon (test_lsp's fixtures), nothing mocked."""

from __future__ import annotations

import asyncio

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, URI, expected, start, stop

from m31r_lsp.documents import offset_at

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp


def applied(text: str, rng: t.Range, new: str) -> str:
    """`text` with an item's edit applied, as an editor does it (UTF-16 positions)."""
    a = offset_at(text, rng.start.line, rng.start.character)
    b = offset_at(text, rng.end.line, rng.end.character)
    return text[:a] + new + text[b:]


async def settled(session, n_logs: int) -> list[str]:
    """The log messages after the first `n_logs`, once the server answered a request sent after the change."""
    await session.stats()
    await asyncio.sleep(0.05)
    return [m.message for m in session.client.log_messages[n_logs:]]


async def test_settings_of_the_wrong_shape_are_reported_and_the_rest_applied(lsp):
    """Python's JSON reader takes Infinity and NaN (a client written in Python sends `1e400` as Infinity): an integer
    setting holding one made int() raise OverflowError, the whole payload was dropped (its valid keys too) and the
    editor showed "Error in server". A "m31r" section that is not an object was passed over without a word."""
    s = await lsp(NOISE)
    n = len(s.client.log_messages)
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
        settings={"m31r": {"debounceMs": float("inf"), "maxLines": float("nan"), "maxTokens": 33}}))
    logged = await settled(s, n)
    st = await s.stats()
    assert st["settings"]["max_tokens"] == 33  # the valid key of the payload is applied
    assert st["settings"]["debounce_ms"] == 0 and st["settings"]["max_lines"] == 12  # the bad ones kept
    assert "m31r.debounceMs: expected an integer (got inf); keeping 0" in logged
    assert "m31r.maxLines: expected an integer (got nan); keeping 12" in logged
    # no "Error in server" shown: the two problems, as warnings (settings problems are shown as well as logged)
    assert [(m.type, m.message) for m in s.client.messages] == [
        (t.MessageType.Warning, "m31r.debounceMs: expected an integer (got inf); keeping 0"),
        (t.MessageType.Warning, "m31r.maxLines: expected an integer (got nan); keeping 12")]
    # A section of the wrong type, pushed (the client then also answers workspace/configuration: nothing here).
    n = len(s.client.log_messages)
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": "fast"}))
    logged = await settled(s, n)
    assert any(m.startswith("m31r: expected an object of settings") and "(got 'fast')" in m for m in logged)
    assert (await s.stats())["settings"] == st["settings"]


async def test_initialization_options_of_the_wrong_shape_are_reported(daemon):
    s = await start(75, args=("--socket", str(daemon)))  # initializationOptions {"m31r": 75}
    try:
        logged = await settled(s, 0)
        assert any(m.startswith("m31r: expected an object of settings") and "(got 75)" in m for m in logged)
        assert (await s.stats())["settings"]["debounce_ms"] == 75  # the defaults
    finally:
        await stop(s)


async def test_documents_not_held_and_cursors_past_the_end(lsp):
    """Requests for a document never opened, closed, or `untitled:` answer empty; a cursor past its line's end means
    the line's end, past the last line the document's end; every edit the server answers applies to the text as the
    suggestion says."""
    s = await lsp(NOISE)
    text = "fn main() {\n    let x = 1;\n    let y = \n}"
    anywhere = [t.Position(0, 0), t.Position(1, 999), t.Position(99, 5)]

    async def ask(uri: str, pos: t.Position):
        inline = await s.client.text_document_inline_completion_async(t.InlineCompletionParams(
            context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Invoked),
            text_document=t.TextDocumentIdentifier(uri), position=pos))
        raw = (await s.stats()).get("lastRaw")
        menu = await s.client.text_document_completion_async(t.CompletionParams(
            text_document=t.TextDocumentIdentifier(uri), position=pos))
        return inline.items, raw, menu.items, (await s.stats()).get("lastRaw")

    for uri in ("file:///never/opened.rs", "untitled:Untitled-1"):
        for pos in anywhere:
            inline, _, menu, _ = await ask(uri, pos)
            assert not inline and not menu
    for uri in ("untitled:Untitled-1", URI):
        s.open(text, uri=uri)
        for pos, cursor in [(t.Position(1, 999), text.index("\n    let y")), (t.Position(3, 50), len(text)),
                            (t.Position(99, 5), len(text)), (t.Position(2, 2**31 - 1), text.index("\n}"))]:
            assert offset_at(text, pos.line, pos.character) == cursor
            inline, raw, menu, raw2 = await ask(uri, pos)
            assert inline and menu
            want, want2 = (expected(text, cursor, r, multiline="always") for r in (raw, raw2))
            assert applied(text, inline[0].range, inline[0].insert_text) == text[:want.start] + want.text + text[
                want.end:]
            assert applied(text, menu[0].text_edit.range, menu[0].text_edit.new_text) == text[
                :want2.start] + want2.text + text[want2.end:]
        s.client.text_document_did_close(t.DidCloseTextDocumentParams(t.TextDocumentIdentifier(uri)))
        inline, _, menu, _ = await ask(uri, t.Position(1, 3))
        assert not inline and not menu
    assert not s.client.messages  # nothing went wrong in the server

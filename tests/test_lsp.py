"""`m31r lsp` end to end: a pytest-lsp client drives the real server process, which talks to a real m31rd
serving the tiny random-weight bundle. Nothing is mocked.

A random-weight model writes noise: greedy decoding loops on one token (which post-processing drops as
self-repeating), so tests that need a suggestion on screen sample (temperature 1, fixed seed) with
multiline "always". What the server did is checked through its `m31r/stats` request (the raw daemon text,
the Fim it sent, counters), and every suggestion is checked against `m31r_protocol.policy` applied to that raw text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon
from lsprotocol import types as t
from pygls.exceptions import JsonRpcRequestCancelled
from pytest_lsp import ClientServerConfig, LanguageClient, client_capabilities

from m31r_lsp.documents import offset_at, position_at
from m31r_protocol import Client, policy

pytestmark = pytest.mark.timeout(120)

URI = "file:///work/src/main.rs"
URI2 = "file:///work/src/other.rs"
RUST = """use std::collections::HashMap;

fn count_words(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        *counts.entry(word.to_string()).or_insert(0) += 1;
    }
    counts
}

fn main() {
    let text = "a b a";
    let counts = count_words(text);
    println!("{:?}", counts);
}
"""
LINE_ENDS = [i for i, c in enumerate(RUST) if c == "\n"]
# The tiny random model is sure of nothing: its suggestions pass only with the confidence gate off.
NOISE = {"multiline": "always", "temperature": 1.0, "seed": 7, "debounceMode": "fixed", "debounceMs": 0,
         "minProbability": 0}


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


class Session:
    """A started server with its client, and what the server sent besides responses."""

    def __init__(self, client: LanguageClient):
        self.client = client
        self.status: list[dict] = []
        self.version: dict[str, int] = {}
        self.texts: dict[str, str] = {}
        client.feature("m31r/status")(lambda ls, params: self.status.append(_plain(params)))

    async def stats(self) -> dict:
        return _plain(await self.client.protocol.send_request_async("m31r/stats", {}))

    def open(self, text: str, uri: str = URI) -> None:
        self.version[uri], self.texts[uri] = 1, text
        self.client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=uri, language_id="rust", version=1, text=text)))

    def edit(self, start: int, end: int, new: str, uri: str = URI, enc: str = "utf-16") -> None:
        """Replace texts[uri][start:end] with `new` (an incremental change, positions in `enc`)."""
        text = self.texts[uri]
        (l0, c0), (l1, c1) = position_at(text, start, enc), position_at(text, end, enc)
        self.version[uri] += 1
        self.texts[uri] = text[:start] + new + text[end:]
        self.client.text_document_did_change(t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=uri, version=self.version[uri]),
            content_changes=[t.TextDocumentContentChangePartial(range=t.Range(t.Position(l0, c0), t.Position(l1, c1)),
                                                                text=new)]))

    def inline_params(self, offset: int, invoked: bool = True, uri: str = URI, enc: str = "utf-16"):
        line, ch = position_at(self.texts[uri], offset, enc)
        kind = t.InlineCompletionTriggerKind.Invoked if invoked else t.InlineCompletionTriggerKind.Automatic
        return t.InlineCompletionParams(context=t.InlineCompletionContext(trigger_kind=kind),
                                        text_document=t.TextDocumentIdentifier(uri), position=t.Position(line, ch))

    async def inline(self, offset: int, invoked: bool = True, uri: str = URI, enc: str = "utf-16"):
        return await self.client.text_document_inline_completion_async(self.inline_params(offset, invoked, uri, enc))


def _plain(obj):
    """pygls hands custom payloads over as namedtuple-like Objects: back to dicts and lists."""
    if hasattr(obj, "_asdict"):
        return {k: _plain(v) for k, v in obj._asdict().items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    return obj


async def start(settings: dict | None, *, encodings: list[str] | None = None, args: tuple[str, ...] = ()) -> Session:
    cfg = ClientServerConfig(server_command=[sys.executable, "-m", "m31r_lsp", "--no-autostart", *args])
    client = await cfg.start()
    session = Session(client)
    caps = client_capabilities("visual-studio-code")
    if encodings is not None:
        caps.general.position_encodings = encodings
    session.init = await client.initialize_session(t.InitializeParams(
        capabilities=caps, initialization_options={"m31r": settings} if settings is not None else None))
    return session


async def stop(session: Session) -> None:
    await session.client.shutdown_session()
    await session.client.stop()


@pytest.fixture
async def lsp(daemon):
    """Start servers talking to the module's daemon: `await lsp({...settings})`."""
    sessions: list[Session] = []

    async def make(settings: dict | None = None, **kw) -> Session:
        s = await start({"socket": str(daemon), "minProbability": 0, **(settings or {})}, **kw)
        sessions.append(s)
        return s

    yield make
    for s in sessions:
        await stop(s)


async def until(pred, timeout: float = 20.0, step: float = 0.02):
    t0 = time.monotonic()
    while not await pred():
        assert time.monotonic() - t0 < timeout, "condition not reached in time"
        await asyncio.sleep(step)


def expected(text: str, offset: int, raw: str, **opts) -> policy.Suggestion | None:
    """What m31r_protocol.policy makes of the daemon's raw text for this cursor."""
    return policy.postprocess(policy.plan(text, offset, policy.Options(**opts)), raw)


def check_item(item, text: str, offset: int, raw: str, enc: str = "utf-16", **opts) -> policy.Suggestion:
    want = expected(text, offset, raw, **opts)
    assert want is not None
    assert item.insert_text == want.text
    assert (item.range.start.line, item.range.start.character) == position_at(text, want.start, enc)
    assert (item.range.end.line, item.range.end.character) == position_at(text, want.end, enc)
    return want


# -- initialize and status ---------------------------------------------------------------------------------


async def test_initialize_advertises_inline_completion(lsp):
    # (bad settings in initializationOptions are reported and the defaults kept)
    s = await lsp({"debounceMs": -5, "multiline": "sometimes", "nonsense": 1, "maxTokens": 16})
    caps = s.init.capabilities
    assert isinstance(caps.inline_completion_provider, t.InlineCompletionOptions)
    assert caps.completion_provider is not None and "." in caps.completion_provider.trigger_characters
    assert caps.text_document_sync.change == t.TextDocumentSyncKind.Incremental
    assert caps.text_document_sync.open_close is True
    assert caps.position_encoding == t.PositionEncodingKind.Utf16
    assert s.init.server_info.name == "m31r-lsp"
    await until(lambda: _async(any(st["state"] == "ready" for st in s.status)))
    assert s.status[0]["state"] == "starting"
    ready = next(st for st in s.status if st["state"] == "ready")
    assert ready["model"].startswith("m31r-tiny")
    st = await s.stats()
    assert st["settings"]["debounce_ms"] == 75 and st["settings"]["multiline"] == "auto"
    assert st["settings"]["max_tokens"] == 16
    logged = " ".join(m.message for m in s.client.log_messages)
    assert "m31r.debounceMs" in logged and "m31r.multiline" in logged and "m31r.nonsense" in logged


async def _async(v):
    return v


async def _stat_at_least(s: Session, key: str, n: int) -> bool:
    return (await s.stats()).get(key, 0) >= n


# -- completions ---------------------------------------------------------------------------------------------


async def test_unsure_suggestions_are_hidden_below_min_probability(lsp):
    """minProbability gates on the daemon's first-line log-probability: the tiny random model gives a line far less
    than 0.5, so with that floor the same automatic request (the editor asking as the user types) that shows a
    suggestion without it shows none, and says why. The floor goes to the daemon too (Fim.min_probability), which
    stops at the first token that takes the answer under it: here its first.

    An invoked request (InlineCompletionTriggerKind.Invoked: VS Code's "Trigger Inline Suggestion", Alt+\\) at the same
    cursor shows the model's best suggestion all the same: the floor keeps unasked-for guesses off the screen, and a
    user who asks for one expects an answer (VS Code's API: Invoke is "explicitly by a user gesture", where Automatic
    may get nothing); hidden, that key did nothing at such a cursor. The daemon, which ended the answer at the token
    where the floor fell (here its first), is asked again without one."""
    s = await lsp({**NOISE, "minProbability": 0.5})
    s.open(RUST)
    offset = RUST.index("    counts\n}") + len("    counts")
    res = await s.inline(offset, invoked=False)
    st = await s.stats()
    assert st["daemon_requests"] == 1 and st["lastFim"]["min_probability"] == 0.5  # the daemon answered ...
    assert len(st["lastLogprobByLine"]) == 1 and st["lastLogprobByLine"][0] < math.log(0.5)  # ... one token, unsure
    assert len(res.items) == 0 and st["unsure"] == 1 and st.get("suggestions", 0) == 0  # ... and it was held back
    res = await s.inline(offset, invoked=True)  # the user asks at the same cursor: shown, unsure as it is
    st = await s.stats()
    assert st["daemon_requests"] == 3 and st["lastFim"]["min_probability"] is None  # with the floor, then without
    assert st["lastLogprobByLine"][0] < math.log(0.5) and st["unsure"] == 2 and st["unsure_invoked"] == 1
    assert len(res.items) == 1 and st["suggestions"] == 1
    off = {"m31r": {"minProbability": 0}}
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=off))
    s.edit(offset, offset, " ")
    res = await s.inline(offset + 1, invoked=False)
    st = await s.stats()
    assert len(res.items) == 1 and st["suggestions"] == 2 and st["unsure"] == 2


async def test_a_suggestion_is_cut_to_the_lines_the_model_is_sure_of(lsp):
    """minProbability also decides how many lines show (policy.confident_lines): with a floor between the daemon's
    probability of the raw answer's first lines and of one line more, the same request shows only those first lines,
    where without a floor it shows more."""
    offset = len(RUST) - 1  # after the last `}`: no block's indentation ends the suggestion's second line
    settings = {**NOISE, "maxTokens": 48, "seed": 3}  # (a seed whose raw answer has a second line)
    s = await lsp(settings)
    s.open(RUST)
    whole = await s.inline(offset)
    st = await s.stats()
    raw, by_line = st["lastRaw"], st["lastLogprobByLine"]
    assert len(by_line) == raw.count("\n") + 1 >= 2, (raw, by_line)
    assert len(whole.items) == 1 and st.get("lines_cut", 0) == 0
    check_item(whole.items[0], RUST, offset, raw, multiline="always")
    k = next(i for i in range(1, len(by_line)) if by_line[i] < -0.01)  # the first line after which the figure falls
    floor = math.exp(sum(by_line[:k]) + by_line[k] / 2)
    cut = policy.confident_lines(raw, by_line, floor)
    assert cut == "\n".join(raw.split("\n")[:k])

    s2 = await lsp({**settings, "minProbability": floor})
    s2.open(RUST)
    res = await s2.inline(offset)
    st = await s2.stats()
    # The daemon stopped inside line k, at the token that took the answer under the floor (Fim.min_probability).
    assert raw.startswith(st["lastRaw"]) and st["lastRaw"].count("\n") == k and len(st["lastRaw"]) < len(raw)
    assert st["lines_cut"] == 1 and st.get("unsure", 0) == 0
    assert len(res.items) == 1
    shown = check_item(res.items[0], RUST, offset, cut, multiline="always")
    assert shown.text != whole.items[0].insert_text and whole.items[0].insert_text.startswith(shown.text)


async def test_inline_completion_at_cursor(lsp):
    s = await lsp(NOISE)
    s.open(RUST)
    offset = RUST.index("    counts\n}") + len("    counts")
    res = await s.inline(offset)
    st = await s.stats()
    assert st["daemon_requests"] == 1
    fim = st["lastFim"]
    assert fim["prefix"] == RUST[:offset] and fim["suffix"] == RUST[offset:]  # split at the cursor
    assert fim["document"] == URI and fim["stop"] == [] and fim["max_tokens"] == 64 and fim["deadline_ms"] == 800
    assert st["lastRaw"]
    assert len(res.items) == 1
    check_item(res.items[0], RUST, offset, st["lastRaw"], multiline="always")
    # UTF-16 (the default): characters outside the BMP count twice in a column
    text = 'fn main() {\n    let s = "🐢🐢"; let n = \n}\n'
    s.open(text, uri=URI2)
    offset = text.index("let n = ") + len("let n = ")
    res = await s.inline(offset, uri=URI2)
    st = await s.stats()
    assert st["lastFim"]["prefix"] == text[:offset]
    assert len(res.items) == 1
    check_item(res.items[0], text, offset, st["lastRaw"], multiline="always")


async def test_inline_completion_after_the_menus_selected_item(lsp):
    """With the completion menu open, an editor shows only inline items that extend the selected item's text over its
    range (LSP 3.18 selectedCompletionInfo; VS Code drops the others). The server completes the text as it will be
    once that item is accepted, and answers the item's text followed by the suggestion, over the item's range."""
    s = await lsp(NOISE)
    text = RUST.replace("let counts = count_words(text);", "let counts = count_w")
    s.open(text)
    cursor = text.index("count_w\n") + len("count_w")
    start = cursor - len("count_w")
    (l0, c0), (l1, c1) = position_at(text, start, "utf-16"), position_at(text, cursor, "utf-16")
    sel = t.SelectedCompletionInfo(range=t.Range(t.Position(l0, c0), t.Position(l1, c1)), text="count_words")
    params = s.inline_params(cursor)
    params.context.selected_completion_info = sel
    res = await s.client.text_document_inline_completion_async(params)
    st = await s.stats()
    assert st["lastFim"]["prefix"] == text[:start] + "count_words" and st["lastFim"]["suffix"] == text[cursor:]
    assert st["lastRaw"] and len(res.items) == 1
    item = res.items[0]
    assert item.range == sel.range and item.insert_text.startswith("count_words")
    assert len(item.insert_text) > len("count_words")
    # Without the menu, the same cursor completes the text as typed.
    res = await s.inline(cursor)
    st = await s.stats()
    assert st["lastFim"]["prefix"] == text[:cursor]


async def test_completion_fallback_carries_the_suggestion(lsp):
    s = await lsp(NOISE)
    text = "fn main() {\n    let total = cou\n}\n"
    s.open(text)
    offset = text.index("cou") + 3
    line, ch = position_at(text, offset)
    res = await s.client.text_document_completion_async(t.CompletionParams(
        text_document=t.TextDocumentIdentifier(URI), position=t.Position(line, ch)))
    st = await s.stats()
    assert res.is_incomplete is True
    assert len(res.items) == 1
    item = res.items[0]
    want = expected(text, offset, st["lastRaw"], multiline="always")
    assert want is not None
    # the edit starts at the word before the cursor, so menus filtering on "cou" keep the item
    assert item.text_edit.new_text == "cou" + want.text
    assert item.text_edit.range.start == t.Position(1, ch - 3)
    assert item.text_edit.range.start.line == item.text_edit.range.end.line == 1
    assert item.filter_text.startswith("cou")


async def test_greedy_noise_is_dropped_but_the_daemon_was_asked(lsp):
    # greedy on random weights loops on one token: post-processing must drop it, not show it
    s = await lsp({"debounceMs": 0})
    s.open(RUST)
    res = await s.inline(RUST.index("    counts\n}") + len("    counts"))
    st = await s.stats()
    assert st["daemon_requests"] == 1 and st["lastRaw"]
    assert policy.is_self_repeating(st["lastRaw"]) or not st["lastRaw"].strip()
    assert len(res.items) == 0 and st["empty"] == 1


async def test_typing_sequence(lsp):
    s = await lsp({**NOISE, "typedThrough": False})
    base = "fn main() {\n    \n}\n"
    s.open(base)
    pos = base.index("    \n") + 4
    typed = "let total = 1;"
    answered = 0
    for ch in typed:
        s.edit(pos, pos, ch)
        pos += 1
        res = await s.inline(pos, invoked=False)
        st = await s.stats()
        text = s.texts[URI]
        assert st["lastFim"]["prefix"] == text[:pos]  # the server's copy follows the incremental edits
        if res.items:
            answered += 1
            check_item(res.items[0], text, pos, st["lastRaw"], multiline="always")
    st = await s.stats()
    assert st["daemon_requests"] == len(typed)
    assert answered >= len(typed) // 2
    assert s.texts[URI] == "fn main() {\n    let total = 1;\n}\n"


async def test_typed_through_answers_without_the_daemon(lsp):
    s = await lsp({**NOISE, "acceptAhead": True})
    text = "fn main() {\n    let x = \n}\n"
    s.open(text)
    pos = text.index("= ") + 2
    first = await s.inline(pos)
    assert len(first.items) == 1
    shown = first.items[0].insert_text
    # accept-ahead: the daemon is warmed for the document as it will be once the suggestion is accepted
    await until(lambda: _stat_at_least(s, "warm_requests", 1), timeout=10)
    before = (await s.stats())["daemon_requests"]
    # type the first two characters the suggestion predicted
    s.edit(pos, pos, shown[:2])
    res = await s.inline(pos + 2, invoked=False)
    st = await s.stats()
    assert st["typed_through"] == 1 and st["daemon_requests"] == before
    assert len(res.items) == 1
    item = res.items[0]
    assert item.insert_text == shown  # same suggestion, its range now covers what was typed
    new = s.texts[URI]
    start = offset_at(new, item.range.start.line, item.range.start.character)
    end = offset_at(new, item.range.end.line, item.range.end.character)
    assert new[start : pos + 2] == shown[:2]
    assert new[:start] + item.insert_text + new[end:] == text[:pos] + shown + text[pos:]
    # typing something else asks the daemon again
    s.edit(pos + 2, pos + 2, "\u00a7")
    await s.inline(pos + 3)
    assert (await s.stats())["daemon_requests"] == before + 1


async def test_position_encoding_utf8_negotiated(lsp):
    s = await lsp(NOISE, encodings=["utf-8", "utf-16"])
    assert s.init.capabilities.position_encoding == t.PositionEncodingKind.Utf8
    text = 'fn main() {\n    let s = "żółw 🐢"; let n = \n}\n'
    s.open(text)
    offset = text.index("let n = ") + len("let n = ")
    res = await s.inline(offset, enc="utf-8")
    st = await s.stats()
    assert st["positionEncoding"] == "utf-8"
    assert st["lastFim"]["prefix"] == text[:offset]  # the UTF-8 column mapped to the right character
    assert len(res.items) == 1
    check_item(res.items[0], text, offset, st["lastRaw"], enc="utf-8", multiline="always")


# -- the server's copy of a document ----------------------------------------------------------------------------

# Characters that str.splitlines breaks lines at and LSP does not (pygls split the lines of a document with it).
NOT_LINE_BREAKS = "\x0c\x0b\x1c\x1d\x1e\x85\u2028\u2029"


@pytest.mark.parametrize("enc", ["utf-16", "utf-8", "utf-32"])
async def test_incremental_edits_land_where_the_editor_made_them(lsp, enc):
    """The server applies an edit by the editor's line rules: lines break at \\n, \\r\\n and \\r only (form feeds,
    U+2028 and the like are characters of a line), and a character past a line's end means the line's end, on a last
    line without a line break too. The Fim sent is the editor's text, split at the cursor."""
    s = await lsp({**NOISE, "multiline": "never"}, encodings=[enc])
    assert (await s.stats())["positionEncoding"] == enc
    text = f"// {'|'.join(NOT_LINE_BREAKS)}\nfn main() {{\n    let 🐢 = 1;\n}}"
    s.open(text)
    pos = text.index("= 1;") + 4
    s.edit(pos, pos, " let y = 2;", enc=enc)  # on line 2, below the characters, after a character of 4 UTF-8 bytes
    pos += len(" let y = 2;")
    await s.inline(pos, enc=enc)
    fim = (await s.stats())["lastFim"]
    assert (fim["prefix"], fim["suffix"]) == (s.texts[URI][:pos], s.texts[URI][pos:])
    s.version[URI] += 1
    s.texts[URI] += "\n// end"
    s.client.text_document_did_change(t.DidChangeTextDocumentParams(
        text_document=t.VersionedTextDocumentIdentifier(uri=URI, version=s.version[URI]),
        content_changes=[t.TextDocumentContentChangePartial(range=t.Range(t.Position(3, 99), t.Position(3, 99)),
                                                            text="\n// end")]))
    await s.inline(len(s.texts[URI]), enc=enc)
    fim = (await s.stats())["lastFim"]
    assert fim["prefix"] == s.texts[URI] == text.replace("1;", "1; let y = 2;") + "\n// end"


async def test_handled_notifications_leave_nothing_behind():
    """pygls keeps the future of every notification that a coroutine or generator handled (every didChange: each
    keystroke) in its protocol's `_request_futures`, and never removes it: about 2 KB a keystroke for as long as the
    editor runs. The real server, driven in process with the JSON messages an editor sends, keeps none once done."""
    from m31r_lsp.server import create_server

    server = create_server()
    proto = server.protocol
    sent: list[bytes] = []

    class Sink:
        def write(self, data: bytes) -> None:
            sent.append(data)

        def close(self) -> None:
            pass

    proto.set_writer(Sink())

    def send(**msg) -> None:
        proto.handle_message(proto.structure_message({"jsonrpc": "2.0", **msg}))

    async def answered(msg_id: int) -> bool:
        return any(b'"id": %d' % msg_id in d or b'"id":%d' % msg_id in d for d in sent)

    send(id=1, method="initialize", params={"capabilities": {}, "initializationOptions": {
        "m31r": {"enable": False, "autostart": False}}})
    await until(lambda: answered(1), timeout=10)
    send(method="initialized", params={})
    send(method="textDocument/didOpen", params={"textDocument": {"uri": URI, "languageId": "rust", "version": 1,
                                                                 "text": ""}})
    n = 300
    for v in range(2, n + 2):
        end = {"line": 0, "character": v - 2}
        send(method="textDocument/didChange", params={
            "textDocument": {"uri": URI, "version": v}, "contentChanges": [{"range": {"start": end, "end": end},
                                                                            "text": "x"}]})
        send(method="workspace/didChangeConfiguration", params={"settings": {"m31r": {"debounceMs": v}}})
        if v % 50 == 0:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert server.workspace.get_text_document(URI).source == "x" * n and server.config.debounce_ms == n + 1
    assert len(proto._request_futures) <= 2  # the last messages', until the next one arrives
    send(id=2, method="shutdown", params=None)
    await until(lambda: answered(2), timeout=10)


@pytest.mark.parametrize("nl", ["\r\n", "\r"])
async def test_menu_item_of_a_multi_line_suggestion_in_a_crlf_or_cr_document(lsp, nl):
    """A multi-line suggestion is written with the document's line break (\\r alone is one, as in LSP); the menu item
    is labelled with its first line, without a stray \\r, and is a snippet."""
    s = await lsp({**NOISE, "seed": 3})  # (a seed whose suggestion here has lines)
    text = nl.join(["fn main() {", "    let v = vec![1, 2, 3];", "    ", "}", ""])
    s.open(text)
    offset = text.index("    " + nl + "}") + 4
    res = await s.client.text_document_completion_async(t.CompletionParams(
        text_document=t.TextDocumentIdentifier(URI), position=t.Position(2, 4)))
    st = await s.stats()
    want = expected(text, offset, st["lastRaw"], multiline="always")
    assert want is not None and nl in want.text and "\n" not in want.text.replace("\r\n", "")
    [item] = res.items
    assert item.text_edit.new_text == want.text
    assert item.label == want.text.strip().split(nl)[0] and "\r" not in item.label
    assert item.kind == t.CompletionItemKind.Snippet


@pytest.mark.parametrize("nl", ["\r\n", "\r"])
async def test_inline_suggestions_break_lines_with_lf_in_any_document(lsp, nl):
    """Inline items are written with "\n" whatever the document's line break: Neovim splits an accepted inline text
    at "\n" only, and VS Code writes it with the document's own. The range is the document's, as always."""
    s = await lsp({**NOISE, "seed": 3})
    text = nl.join(["fn main() {", "    let v = vec![1, 2, 3];", "    ", "}", ""])
    s.open(text)
    offset = text.index("    " + nl + "}") + 4
    res = await s.inline(offset)
    st = await s.stats()
    want = expected(text, offset, st["lastRaw"], multiline="always")
    assert want is not None and nl in want.text
    [item] = res.items
    assert item.insert_text == want.text.replace(nl, "\n") and "\r" not in item.insert_text
    assert (item.range.start.line, item.range.start.character) == position_at(text, want.start, "utf-16")
    assert (item.range.end.line, item.range.end.character) == position_at(text, want.end, "utf-16")


async def test_lone_surrogates_are_sent_as_replacement_characters(lsp, tmp_path):
    """JSON may carry a lone surrogate (an editor's buffer can hold one), UTF-8 cannot: the daemon request would not
    encode and no completion in the document would work. What is sent (prefix, suffix, the other files' snippets) has
    U+FFFD in its place, one character for one, so positions stay right."""
    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text('[package]\nname = "demo"\n')
    (root / "src/main.rs").write_text("")
    (root / "src/odd.rs").write_text("// on disk, not what the editor has\n")
    main, odd = (root / "src/main.rs").as_uri(), (root / "src/odd.rs").as_uri()
    lib = 'pub fn odd_text() -> String {\n    String::from("\ud800")\n}\n'
    text = 'fn main() {\n    let s = "\udc00"; let n = odd_text();\n    let t = \n}\n'
    offset = text.index("let t = ") + len("let t = ")
    s = await lsp({**NOISE, "projectContext": True})
    s.open(lib, uri=odd)
    s.open(text, uri=main)
    res = await s.inline(offset, uri=main)
    st = await s.stats()
    assert st.get("daemon_requests", 0) == 1 and st["lastRaw"] is not None  # (not an encoding error)
    fim = st["lastFim"]
    assert fim["prefix"] == text[:offset].replace("\udc00", "\ufffd") and fim["suffix"] == text[offset:]
    assert fim["context"] == ["src/odd.rs"]
    assert len(res.items) == 1
    check_item(res.items[0], text, offset, st["lastRaw"], multiline="always")


async def test_project_context_names_files_as_the_editor_does(lsp, tmp_path):
    """Open files whose names hold `%` or a space: the snippet carries the path on disk, relative to the crate root,
    and the current file is never its own context (pygls keys documents by the URI unquoted once; unquoting again
    made a file named `a%20b.rs` read as `a b.rs`)."""
    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text('[package]\nname = "demo"\n')
    odd, spaced = root / "src" / "a%20b.rs", root / "src" / "main file.rs"
    odd.write_text("")
    spaced.write_text("")
    s = await lsp({**NOISE, "projectContext": True})
    s.open("pub fn percent_named() -> u32 {\n    7\n}\n", uri=odd.as_uri())
    text = "fn main() {\n    let n = percent_named();\n    let t = \n}\n"
    s.open(text, uri=spaced.as_uri())
    assert "%2520" in odd.as_uri() and "%20" in spaced.as_uri()
    await s.inline(text.index("let t = ") + len("let t = "), uri=spaced.as_uri())
    st = await s.stats()
    assert st["lastFim"]["context"] == ["src/a%20b.rs"]


# -- cancellation, superseding, stale versions -----------------------------------------------------------------


@contextlib.asynccontextmanager
async def busy(sock: Path, n: int = 5, tokens: int = 300):
    """Keep the daemon busy with long generations (greedy noise never stops early), so that a request sent
    meanwhile waits at the daemon long enough to be cancelled or outdated there. Waits for them to end."""
    async with await Client.connect(sock, client="busy") as c:
        streams = [await c.generate(f"// {i}\n", max_tokens=tokens) for i in range(n)]
        try:
            yield
        finally:
            for st in streams:
                await st.collect()


async def test_cancel_request_cancels_the_daemon_request(lsp, daemon):
    s = await lsp(NOISE)
    s.open(RUST)
    msg_id = str(uuid.uuid4())
    async with busy(daemon, n=12, tokens=400):  # ahead of it in the queue long enough on a fast CPU too
        fut = asyncio.wrap_future(s.client.protocol.send_request(
            t.TEXT_DOCUMENT_INLINE_COMPLETION, s.inline_params(len(RUST)), msg_id=msg_id))
        await until(lambda: _stat_at_least(s, "daemon_requests", 1), step=0.005)
        s.client.protocol.notify(t.CANCEL_REQUEST, t.CancelParams(id=msg_id))
        with pytest.raises(JsonRpcRequestCancelled):
            await fut
        st = await s.stats()
        assert st["cancelled"] == 1 and st["daemon_cancels"] == 1
        assert "lastRaw" in st and st["lastRaw"] is None  # it never finished

    async def daemon_idle():
        async with await Client.connect(daemon) as c:
            reply = await c.status()
        return reply.active == 0 and reply.queue == 0

    await until(daemon_idle, timeout=10)


async def test_new_request_for_the_same_document_supersedes(lsp):
    s = await lsp({**NOISE, "debounceMs": 300})
    s.open(RUST)
    a = asyncio.ensure_future(s.inline(RUST.index("counts\n}"), invoked=False))
    await asyncio.sleep(0.05)
    b = await s.inline(RUST.index("counts\n}") + 6, invoked=False)
    first = await a
    st = await s.stats()
    assert len(first.items) == 0  # the older request answers empty at once
    assert st["superseded"] == 1 and st["daemon_requests"] == 1
    assert len(b.items) == 1


async def test_stale_version_is_dropped(lsp):
    s = await lsp({**NOISE, "debounceMs": 300})
    s.open(RUST)
    s.open(RUST, uri=URI2)
    offset = RUST.index("    counts\n}") + len("    counts")
    # control: in an identical document that is not edited, the same request is answered
    assert len((await s.inline(offset, invoked=False, uri=URI2)).items) == 1
    pending = asyncio.ensure_future(s.inline(offset, invoked=False))
    await asyncio.sleep(0.05)
    s.edit(0, 0, "// edited\n")  # version 2 arrives while version 1's request waits
    res = await pending
    st = await s.stats()
    assert len(res.items) == 0 and st["stale"] == 1
    assert st["daemon_requests"] == 1  # only the control request reached the daemon


async def test_edit_during_generation_drops_the_result(lsp, daemon):
    # the edit lands while the request waits at the daemon: its result would be for an old version, so the
    # daemon request is cancelled at once and the editor's request answers empty
    s = await lsp(NOISE)
    s.open(RUST)
    async with busy(daemon):
        pending = asyncio.ensure_future(s.inline(len(RUST)))
        await until(lambda: _stat_at_least(s, "daemon_requests", 1), step=0.005)
        s.edit(0, 0, "// edited\n")
        res = await pending
    st = await s.stats()
    assert len(res.items) == 0 and st["stale"] == 1 and st.get("suggestions", 0) == 0
    assert st["daemon_cancels"] == 1


# -- settings ----------------------------------------------------------------------------------------------------


async def test_did_change_configuration(lsp):
    s = await lsp(NOISE)
    s.open(RUST)
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": {"enable": False}}))
    res = await s.inline(len(RUST))
    st = await s.stats()
    assert len(res.items) == 0 and st.get("daemon_requests", 0) == 0 and st["settings"]["enable"] is False
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
        settings={"m31r": {"enable": True, "maxTokens": 8}, "editor": {"tabSize": 4}}))
    await s.inline(len(RUST))
    st = await s.stats()
    assert st["daemon_requests"] == 1 and st["lastFim"]["max_tokens"] == 8
    # the pull model: a change notification without values makes the server ask workspace/configuration
    s.client.set_configuration({"maxTokens": 5, "multiline": "never"}, section="m31r")
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=None))
    await until(lambda: _settings_are(s, max_tokens=5, multiline="never"), timeout=10)


async def test_max_tokens_above_the_daemon_limit_is_clamped_and_the_user_told_once(lsp, tiny_config):
    """maxTokens accepts up to 4096, the tiny model's context is 512, and a fim may have half of it: the daemon would
    refuse every request (`bad_request`) and the editor would show nothing. The server sends the daemon's limit and
    says so once."""
    s = await lsp({**NOISE, "maxTokens": 4000})
    s.open(RUST)
    offset = RUST.index("    counts\n}") + len("    counts")
    for cursor in (offset, LINE_ENDS[0]):
        res = await s.inline(cursor)
        st = await s.stats()
        assert st["lastFim"]["max_tokens"] == tiny_config.max_context // 2
        assert "daemon_error_bad_request" not in st and st["lastRaw"]
        if cursor == offset:
            assert len(res.items) == 1  # a suggestion, as with the default maxTokens
    told = [m for m in s.client.messages if "maxTokens" in m.message]
    assert len(told) == 1 and told[0].type == t.MessageType.Warning
    assert "maxTokens 4000" in told[0].message and f"limit of {tiny_config.max_context // 2}" in told[0].message
    assert st["max_tokens_clamped"] == 2


async def _settings_are(s: Session, **want) -> bool:
    got = (await s.stats())["settings"]
    return all(got[k] == v for k, v in want.items())


async def test_debounce_adaptive_and_bypassed_on_manual_trigger(lsp):
    s = await lsp({**NOISE, "debounceMode": "adaptive", "debounceMs": 400})
    s.open(RUST)
    await s.inline(len(RUST), invoked=True)  # manual: no debounce
    st = await s.stats()
    assert st.get("undebounced", 0) == 1 and st.get("debounced", 0) == 0
    # adaptive: a quarter of the recent latency, within [debounceMs/2, 2*debounceMs]
    assert 200 <= st["debounceMs"] <= 800
    t0 = time.perf_counter()
    await s.inline(len(RUST) - 2, invoked=False)
    automatic = time.perf_counter() - t0
    st = await s.stats()
    assert st.get("debounced", 0) == 1 and st.get("undebounced", 0) == 1
    assert automatic >= 0.2  # it really waited at least debounceMs / 2 (wall time only bounds it from below)


# -- post-processing through the server ------------------------------------------------------------------------


async def test_mid_line_is_single_line(lsp):
    s = await lsp({**NOISE, "multiline": "auto"})
    text = "fn main() {\n    let x = compute(1);\n}\n"
    s.open(text)
    offset = text.index("compute")  # code follows the cursor
    seen = 0
    for seed in range(1, 6):
        s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": {"seed": seed}}))
        res = await s.inline(offset)
        st = await s.stats()
        assert st["lastFim"]["stop"] == ["\n"]
        for item in res.items:
            seen += 1
            assert "\n" not in item.insert_text
            check_item(item, text, offset, st["lastRaw"])
    assert seen >= 1


async def test_mid_line_greedy_completion_is_beam_searched(lsp, shared_daemon, tiny_engine):
    """Editor → language server → daemon: a greedy mid-line suggestion is the daemon's beam search (--beams, 3) of the
    request the server sent, as the engine computes it, and the daemon's log line says so."""
    from m31r.beams import beam_generate
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, line_context
    from m31r_protocol import messages as m
    from m31rd.main import BEAMS
    from m31rd.server import request_stops

    s = await lsp({"multiline": "auto", "temperature": 0.0, "debounceMode": "fixed", "debounceMs": 0})
    text = "fn main() {\n    let total = values.iter().sum::<u32>();\n}\n"
    s.open(text)
    # (a cursor where the random model's search has runners-up to show, not inside a word: there the policy shows
    # only an answer that writes the word's rest first, m31r_protocol.policy.word_rest)
    offset = text.index("u32")
    items = (await s.inline(offset)).items
    st = await s.stats()
    fim = st["lastFim"]
    assert fim["stop"] == ["\n"]
    p = build_fim_prompt(tiny_engine.tokenizer, fim["prefix"], fim["suffix"],
                         FimBudget.for_context(tiny_engine.config.max_context))
    stops = request_stops(m.Fim(id=0, prefix=fim["prefix"], suffix=fim["suffix"], stop=fim["stop"]))
    res = Outcome(prompt_tokens=0)
    searched = "".join(x.text for x in beam_generate(tiny_engine, p.ids, width=BEAMS, max_tokens=fim["max_tokens"],
                                                    stop=stops, heal=p.heal, result=res,
                                                    repeat_context=line_context(fim["prefix"])))
    greedy = "".join(x.text for x in tiny_engine.generate(p.ids, max_tokens=fim["max_tokens"], stop=stops, heal=p.heal,
                                                          repeat_context=line_context(fim["prefix"])))
    assert st["lastRaw"] == searched != greedy
    # The search's runners-up, post-processed as the suggestion is, are the editor's further items.
    plan = policy.plan(text, offset, policy.Options(multiline="auto"))
    shown = [policy.postprocess(plan, raw) for raw in [searched, *res.alternatives]]
    want = [x for i, x in enumerate(shown) if x is not None and x not in shown[:i]]
    assert [i.insert_text for i in items] == [x.text for x in want] and len(items) >= 2
    for item, x in zip(items, want, strict=True):
        assert (item.range.start.line, item.range.start.character) == position_at(text, x.start, "utf-16")
        assert (item.range.end.line, item.range.end.character) == position_at(text, x.end, "utf-16")
    # Typing the suggestion's first character answers without the daemon, and keeps the runners-up that the typed
    # character agrees with (the editor's other items while the user types).
    before = (await s.stats())["daemon_requests"]
    typed = want[0].text[offset - want[0].start]
    s.edit(offset, offset, typed)
    new = s.texts[URI]
    res = await s.inline(offset + 1, invoked=False)
    st = await s.stats()
    assert st["typed_through"] == 1 and st["daemon_requests"] == before
    kept = policy.typed_through_alternatives(policy.Shown(text, offset, want[0], alternatives=tuple(want[1:])),
                                             new, offset + 1)
    assert kept and [i.insert_text for i in res.items] == [want[0].text, *(x.text for x in kept)]
    s.edit(offset, offset + 1, "")

    def logged() -> list[dict]:
        lines = [json.loads(x) for x in list(shared_daemon[0].log_lines) if x.startswith("{")]
        return [x for x in lines if x.get("msg") == "request" and x.get("client") == "m31r-lsp" and "beams" in x]

    async def seen() -> bool:
        return bool(logged())

    await until(seen)
    assert logged()[-1]["kind"] == "fim" and logged()[-1]["beams"] == BEAMS
    # The editor's `beams` setting chooses the width: 1 is greedy decoding, with no runners-up.
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": {"beams": 1}}))
    await until(lambda: _settings_are(s, beams=1), timeout=10)
    other = URI.replace(".rs", "_greedy.rs")
    s.open(text, other)
    items = (await s.inline(offset, uri=other)).items
    assert (await s.stats())["lastRaw"] == greedy and len(items) <= 1

    async def seen_greedy() -> bool:  # the line after the search's (width 3, above) says 1
        return logged()[-1]["beams"] == 1

    await until(seen_greedy)


async def test_project_context_is_sent_and_laid_before_the_prompt(lsp, tiny_engine, tmp_path):
    """Editor → language server → daemon with a crate on disk: the request carries snippets of the crate's other files
    (an open document's unsaved text over its file's), best first, and the daemon's answer is the engine's for the
    prompt they lead. With projectContext off (the default), nothing is sent."""
    from m31r.context import context_ids, context_room
    from m31r.fim import FimBudget, build_fim_prompt, line_context
    from m31r_protocol import messages as m
    from m31r_protocol.context import query_words, rank, windows
    from m31rd.server import request_stops

    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text("[package]\nname = \"demo\"\n")
    point = "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n"
    shape = "pub fn area(p: &Point) -> i64 {\n    p.x * p.y\n}\n"
    (root / "src/point.rs").write_text(point)
    (root / "src/shape.rs").write_text("// on disk, not what the editor has\n")
    (root / "src/main.rs").write_text("")
    main_uri, shape_uri = (root / "src/main.rs").as_uri(), (root / "src/shape.rs").as_uri()
    text = "fn main() {\n    let p = Point { x: 2, y: 3 };\n    let a = area(&p);\n    \n}\n"
    offset = text.index("    \n}") + 4

    s = await lsp({"multiline": "always", "debounceMode": "fixed", "debounceMs": 0, "maxTokens": 8,
                   "projectContext": True})
    s.open(shape, uri=shape_uri)
    s.open(text, uri=main_uri)
    await s.inline(offset, uri=main_uri)
    st = await s.stats()
    fim = st["lastFim"]
    want = rank(query_words(fim["prefix"]), [("src/shape.rs", windows(shape)), ("src/point.rs", windows(point))])
    assert fim["context"] == [x.path for x in want] == ["src/shape.rs", "src/point.rs"]
    assert st["context_snippets"] == 2
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    p = build_fim_prompt(tiny_engine.tokenizer, fim["prefix"], fim["suffix"], budget)
    head = context_ids(tiny_engine.tokenizer, want, context_room(budget, p))
    assert tiny_engine.tokenizer.decode(head).count("p.x * p.y") == 1
    stops = request_stops(m.Fim(id=0, prefix=fim["prefix"], suffix=fim["suffix"], stop=fim["stop"]))
    ref = "".join(x.text for x in tiny_engine.generate(head + p.ids, max_tokens=fim["max_tokens"], stop=stops,
                                                       heal=p.heal, repeat_context=line_context(fim["prefix"])))
    assert st["lastRaw"] == ref

    off = await lsp({"multiline": "always", "debounceMode": "fixed", "debounceMs": 0})
    off.open(shape, uri=shape_uri)
    off.open(text, uri=main_uri)
    await off.inline(offset, uri=main_uri)
    st = await off.stats()
    assert st["lastFim"]["context"] == [] and "context_snippets" not in st


async def test_auto_closed_bracket_range(lsp):
    s = await lsp({**NOISE, "multiline": "auto"})
    text = "fn main() {\n    let n = count_words()\n}\n"
    s.open(text)
    offset = text.index("count_words(") + len("count_words(")
    res = await s.inline(offset)
    st = await s.stats()
    assert st["lastFim"]["stop"] == [] and st["lastFim"]["suffix"].startswith(")\n")  # multi-line: only ")" follows
    if res.items:
        want = check_item(res.items[0], text, offset, st["lastRaw"])
        assert want.end in (offset, offset + 1)  # at most the auto-closed ")" is replaced
        accepted = text[: want.start] + want.text + text[want.end :]
        assert accepted.count(")") - accepted.count("(") == text.count(")") - text.count("(") or ")" not in want.text


async def test_suffix_overlap_against_policy(lsp):
    # whatever the noise, the server shows exactly what the shared policy makes of it
    s = await lsp({**NOISE, "multiline": "auto"})
    text = "fn main() {\n    let counts = count_words(text);\n}\n"
    s.open(text)
    for offset in (text.index("count_words"), text.index("(text)") + 1, text.index(";\n}")):
        res = await s.inline(offset)
        st = await s.stats()
        want = expected(text, offset, st["lastRaw"])
        if want is None:
            assert len(res.items) == 0
        else:
            check_item(res.items[0], text, offset, st["lastRaw"])


# -- the daemon down, dying, coming back ---------------------------------------------------------------------


async def test_daemon_down_show_message_once_and_empty_results(tmp_path):
    s = await start({"socket": str(tmp_path / "nobody.sock"), "autostart": False, "debounceMs": 0})
    try:
        s.open(RUST)
        t0 = time.perf_counter()
        for _ in range(3):
            res = await s.inline(len(RUST))
            assert len(res.items) == 0
        assert time.perf_counter() - t0 < 5  # never a hang
        warnings = [m for m in s.client.messages if m.type == t.MessageType.Warning]
        assert len(warnings) == 1 and "unavailable" in warnings[0].message
        assert any(st["state"] == "unavailable" for st in s.status)
        res = await s.client.text_document_completion_async(t.CompletionParams(
            text_document=t.TextDocumentIdentifier(URI), position=t.Position(0, 0)))
        assert len(res.items) == 0
    finally:
        await stop(s)


async def test_daemon_dies_and_the_server_reconnects(tiny_bundle, tmp_path):
    sock = tmp_path / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock)
    s = await start({**NOISE, "socket": str(sock), "autostart": False})
    try:
        s.open(RUST)
        cursors = iter(LINE_ENDS)  # a new cursor each time: a finished suggestion is reused for its cursor
        assert len((await s.inline(next(cursors))).items) == 1
        stop_daemon(proc)
        res = await s.inline(next(cursors))
        assert len(res.items) == 0
        await until(lambda: _async(any(m.type == t.MessageType.Warning for m in s.client.messages)))
        # The editor is not shown the dead daemon's model beside "unavailable" (or "starting" a new one).
        assert [st["model"] for st in s.status if st["state"] != "ready"][-1] is None, s.status
        assert all(st["model"] is None for st in s.status if st["state"] != "ready"), s.status
        proc = start_daemon(tiny_bundle.path, sock)

        async def answered():
            return len((await s.inline(next(cursors))).items) == 1

        await until(answered, timeout=30, step=0.3)
        st = await s.stats()
        assert st["connects"] == 2 and st["daemon"]["state"] == "ready"
        assert len([m for m in s.client.messages if m.type == t.MessageType.Warning]) == 1
    finally:
        await stop(s)
        stop_daemon(proc)


async def test_autostart_starts_the_daemon(tiny_bundle, tmp_path):
    sock = tmp_path / "auto.sock"
    s = await start({**NOISE, "socket": str(sock), "autostart": True, "bundle": str(tiny_bundle.path)})
    try:
        s.open(RUST)

        async def answered():
            return len((await s.inline(len(RUST))).items) == 1

        await until(answered, timeout=60, step=0.2)
        assert Path(sock).exists()
    finally:
        await stop(s)
        async with await Client.connect(sock) as c:
            await c.shutdown()


def test_empty_socket_setting_is_the_command_line_socket() -> None:
    """Editors send `socket: ""` (or null) for "default": that is `m31r lsp --socket PATH`'s socket, also after
    another socket was set, and no socket at all (the built-in default) without --socket."""
    from m31r_lsp.settings import EditorSettings, apply

    cli = EditorSettings(socket="/run/user/1/m31r/x.sock", bundle="/opt/b")
    s, problems = apply(cli, {"m31r": {"socket": "", "maxTokens": 5}}, cli)
    assert s.socket == "/run/user/1/m31r/x.sock" and s.max_tokens == 5 and problems == []
    s, _ = apply(s, {"m31r": {"socket": "/tmp/other.sock", "bundle": "/tmp/b"}}, cli)
    assert (s.socket, s.bundle) == ("/tmp/other.sock", "/tmp/b")
    for empty in ("", None):
        back, problems = apply(s, {"m31r": {"socket": empty, "bundle": empty}}, cli)
        assert (back.socket, back.bundle, back.max_tokens) == ("/run/user/1/m31r/x.sock", "/opt/b", 5)
        assert problems == []
        back, _ = apply(s, {"m31r": {"socket": empty, "bundle": empty}})
        assert (back.socket, back.bundle) == (None, None)


async def test_socket_set_back_to_empty_reconnects_to_the_command_line_socket(daemon, tmp_path):
    """A real session: `m31r lsp --socket DAEMON`, a client that sets another socket, then `""` and null (its
    "default"): the server returns to the command line's socket and connects to the daemon there again."""
    elsewhere = str(tmp_path / "nobody.sock")
    s = await start({"socket": elsewhere, "autostart": False}, args=("--socket", str(daemon)))
    try:
        async def using(sock: str, state: str):
            st = await s.stats()
            return st["settings"]["socket"] == sock and st["daemon"]["state"] == state

        await until(lambda: using(elsewhere, "unavailable"))
        for empty in ("", None):
            s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
                settings={"m31r": {"socket": empty}}))
            await until(lambda: using(str(daemon), "ready"))
            s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
                settings={"m31r": {"socket": elsewhere}}))
            await until(lambda: using(elsewhere, "unavailable"))
        assert (await s.stats())["connects"] == 2
    finally:
        await stop(s)


async def test_a_tilde_in_socket_and_bundle_is_the_home_folder(daemon, tmp_path, monkeypatch):
    """Neovim, Emacs and Helix pass `~/x.sock` through as written, on the command line and in settings: the server
    expands it (HOME points at a folder whose sockets lead to the test daemon) and makes no folder named `~`."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    for name in ("x.sock", "y.sock"):
        (home / name).symlink_to(daemon)
    monkeypatch.chdir(cwd)  # the server's working directory, where a literal `~` would appear
    cfg = ClientServerConfig(server_command=[sys.executable, "-m", "m31r.cli", "lsp", "--no-autostart", "--socket",
                                             "~/x.sock", "--bundle", "~/bundle"],
                             server_env={**os.environ, "HOME": str(home)})
    client = await cfg.start()
    s = Session(client)
    await client.initialize_session(t.InitializeParams(capabilities=client_capabilities("visual-studio-code"),
                                                       initialization_options={"m31r": {"socket": ""}}))
    try:
        async def using(sock: Path, bundle: Path, connects: int):
            st = await s.stats()
            return ((st["settings"]["socket"], st["settings"]["bundle"]) == (str(sock), str(bundle))
                    and st["daemon"]["state"] == "ready" and st["connects"] == connects)

        await until(lambda: using(home / "x.sock", home / "bundle", 1))
        s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
            settings={"m31r": {"socket": "~/y.sock", "bundle": "~/other"}}))
        await until(lambda: using(home / "y.sock", home / "other", 2))  # reconnected through ~/y.sock
        assert list(cwd.iterdir()) == []
    finally:
        await stop(s)


# -- LSP over TCP ----------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def tcp_server(tmp_path: Path, host: str, *args: str, log: Path | None = None):
    """`m31r lsp --tcp HOST:PORT` in a subprocess, once it accepts connections: yields (process, port). Its stderr
    goes to `log` if given (a pipe nobody reads would fill up under --log-level info), else to a pipe."""
    port = free_port()
    stderr = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 (closed below)
    proc = subprocess.Popen([sys.executable, "-m", "m31r.cli", "lsp", "--tcp", f"{host}:{port}", "--no-autostart",
                             "--socket", str(tmp_path / "nobody.sock"), *args], stderr=stderr, text=True)
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.communicate()[1] if log is None else log.read_text()
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert time.monotonic() - t0 < 30, "the LSP server did not listen"
            time.sleep(0.05)
        yield proc, port
    finally:
        proc.kill()
        proc.wait()
        if log is not None:
            stderr.close()


def frame(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return b"Content-Length: %d\r\n\r\n" % len(data) + data


INITIALIZE = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {"capabilities": {}, "processId": None}}


def read_all(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def test_tcp_on_a_remote_address_needs_allow_remote(tmp_path):
    port = free_port()
    r = subprocess.run([sys.executable, "-m", "m31r.cli", "lsp", "--tcp", f"0.0.0.0:{port}", "--no-autostart"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "not a loopback address" in r.stderr and "--allow-remote" in r.stderr, r.stderr
    with tcp_server(tmp_path, "0.0.0.0", "--allow-remote") as (proc, _):
        pass  # it listens...
    assert "warning: m31r lsp is listening on 0.0.0.0" in proc.stderr.read()  # ...and says so


def test_tcp_on_a_port_in_use_is_one_line_and_exit_1(tmp_path):
    """Another program on the port: the user reads which address and what to do, not asyncio's errno text."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "m31r.cli", "lsp", "--tcp", f"127.0.0.1:{port}", "--no-autostart",
                            "--socket", str(tmp_path / "nobody.sock")], capture_output=True, text=True, timeout=60)
        m = subprocess.run([sys.executable, "-m", "m31r_lsp", "--tcp", f"127.0.0.1:{port}", "--no-autostart"],
                           capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and r.stderr.splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port}: the port is in use (another m31r lsp, or another program?): "
        "choose another with --tcp"], r.stderr
    assert m.returncode == 1 and m.stderr.splitlines()[-1].startswith(f"m31r-lsp: error: cannot listen on 127.0.0.1:"
                                                                      f"{port}: the port is in use"), m.stderr


def test_tcp_closes_a_browser_request_and_serves_lsp(tmp_path):
    """A web page can make the browser POST to 127.0.0.1:PORT (a "simple" request: no preflight). Its body must
    not be run as JSON-RPC: a connection whose first line is not LSP framing is closed unanswered."""
    body = json.dumps(INITIALIZE).encode()
    post = (b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: http://evil.example\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body)
    with tcp_server(tmp_path, "127.0.0.1") as (_, port):
        for request in (post, b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b"OPTIONS / HTTP/1.1\r\n\r\n"):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(request)
                assert read_all(s) == b""  # closed, nothing answered
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # an editor is still served
            s.sendall(frame(INITIALIZE))
            head = b""
            while b"\r\n\r\n" not in head:
                head += s.recv(1)
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            body = b""
            while len(body) < length:
                body += s.recv(length - len(body))
    reply = json.loads(body)
    assert reply["id"] == 1 and reply["result"]["serverInfo"]["name"] == "m31r-lsp"


async def _reply(reader: asyncio.StreamReader, msg_id: int) -> dict:
    """Read LSP messages until the response to `msg_id`."""
    while True:
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            assert line, "the server closed the connection"
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        msg = json.loads(await reader.readexactly(length))
        if msg.get("id") == msg_id and "method" not in msg:
            return msg


async def test_tcp_request_and_the_edit_after_it_in_one_read(tmp_path, daemon):
    """Over TCP a request and the didChange after it can arrive in one read, and are then both handled before the
    request's handler starts. The request's position is for the text before the change: it must not be read in the
    changed text (answered for the text it was meant for, or dropped as stale: here the change drops it)."""
    before = "fn main() {\n    let total = \n}\n"
    cursor = {"line": 1, "character": 16}
    assert offset_at(before, 1, 16) == before.index("= ") + 2
    settings = {"m31r": {**NOISE, "socket": str(daemon), "multiline": "never"}}
    with tcp_server(tmp_path, "127.0.0.1") as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(frame({**INITIALIZE, "params": {**INITIALIZE["params"], "initializationOptions": settings}}))
            await _reply(reader, 1)
            writer.write(frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}) + frame(
                {"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
                    "uri": URI, "languageId": "rust", "version": 1, "text": before}}}))
            writer.write(frame({"jsonrpc": "2.0", "id": 2, "method": "m31r/stats", "params": {}}))
            await _reply(reader, 2)  # the document is open
            writer.write(frame({"jsonrpc": "2.0", "id": 3, "method": "textDocument/inlineCompletion", "params": {
                "textDocument": {"uri": URI}, "position": cursor, "context": {"triggerKind": 1}}}) + frame(
                {"jsonrpc": "2.0", "method": "textDocument/didChange", "params": {
                    "textDocument": {"uri": URI, "version": 2}, "contentChanges": [{"range": {
                        "start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}},
                        "text": "use std::io;\n"}]}}))
            answer = (await _reply(reader, 3))["result"]
            writer.write(frame({"jsonrpc": "2.0", "id": 4, "method": "m31r/stats", "params": {}}))
            st = (await _reply(reader, 4))["result"]
        finally:
            writer.close()
    assert answer["items"] == [] and st.get("stale", 0) == 1
    assert st["lastFim"] is None or st["lastFim"]["prefix"] == before[: before.index("= ") + 2]


async def _open_session(port: int, settings: dict | None = None) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A raw LSP connection, initialized."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(frame({**INITIALIZE, "params": {**INITIALIZE["params"], "initializationOptions": settings}}))
    assert "result" in await _reply(reader, 1)
    writer.write(frame({"jsonrpc": "2.0", "method": "initialized", "params": {}}))
    return reader, writer


async def _until_closed(reader: asyncio.StreamReader) -> list[dict]:
    """The messages the server sends until it closes the connection."""
    got = []
    async with asyncio.timeout(30):
        while True:
            length = 0
            while (line := await reader.readline()) != b"\r\n":
                if not line:
                    return got
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            got.append(json.loads(await reader.readexactly(length)))


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg_id: int, method: str,
                   params: dict) -> dict:
    writer.write(frame({"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}))
    async with asyncio.timeout(30):
        return await _reply(reader, msg_id)


def _did_open(uri: str, text: str) -> bytes:
    return frame({"jsonrpc": "2.0", "method": "textDocument/didOpen", "params": {"textDocument": {
        "uri": uri, "languageId": "rust", "version": 1, "text": text}}})


def _inline(uri: str, line: int, character: int) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": character},
            "context": {"triggerKind": 1}}


async def _sessions_ended(log: Path, n: int) -> list[int]:
    """Wait until the server's log says that `n` editors have left; the asyncio task counts it logged then."""
    counts: list[int] = []

    async def ended() -> bool:
        counts[:] = [int(line.split("(")[-1].split()[0]) for line in log.read_text().splitlines()
                     if "m31r_lsp: the editor at" in line and " left (" in line]
        return len(counts) >= n

    await until(ended)
    return counts


async def test_tcp_serves_one_editor_and_refuses_a_second(tmp_path, daemon):
    """A second editor on the port of one being served is told why and turned away, and the first goes on unaffected
    (pygls' server gave the second one the first one's transport, documents and answers). Once the first leaves
    without shutdown or exit, the next editor is served, by a server that has none of the first one's documents."""
    settings = {"m31r": {**NOISE, "socket": str(daemon)}}
    log = tmp_path / "lsp.log"
    with tcp_server(tmp_path, "127.0.0.1", "--log-level", "info", log=log) as (proc, port):
        ra, wa = await _open_session(port, settings)
        wa.write(_did_open(URI, RUST))
        assert "items" in (await _request(ra, wa, 2, "textDocument/inlineCompletion", _inline(URI, 3, 21)))["result"]

        rb, wb = await asyncio.open_connection("127.0.0.1", port)
        wb.write(frame(INITIALIZE))
        refusal = await _until_closed(rb)  # told, then closed
        wb.close()
        shown = [m["params"] for m in refusal if m.get("method") == "window/showMessage"]
        errors = [m["error"] for m in refusal if m.get("id") == 1]
        assert len(shown) == 1 and len(errors) == 1 and "result" not in str(refusal), refusal
        why = errors[0]["message"]
        assert shown[0] == {"type": 1, "message": why} and errors[0]["data"] == {"retry": False}
        assert f"127.0.0.1:{port} already serves another editor" in why and "stdio" in why and "--tcp" in why, why

        # The first editor is still served, with its document and its counters.
        assert "items" in (await _request(ra, wa, 3, "textDocument/inlineCompletion", _inline(URI, 3, 21)))["result"]
        st = (await _request(ra, wa, 4, "m31r/stats", {}))["result"]
        assert st["requests"] == 2 and st["lastFim"]["document"] == URI, st
        wa.close()  # gone without shutdown or exit
        await _sessions_ended(log, 1)
        assert proc.poll() is None

        rc, wc = await _open_session(port, settings)
        try:
            answer = (await _request(rc, wc, 2, "textDocument/inlineCompletion", _inline(URI, 3, 21)))["result"]
            st = (await _request(rc, wc, 3, "m31r/stats", {}))["result"]
        finally:
            wc.close()
    assert answer == {"items": []} and st.get("requests", 0) == 0 and st["lastFim"] is None, st  # no such document
    assert "refused the editor at" in log.read_text()


async def test_tcp_editors_leave_nothing_behind(tmp_path, daemon):
    """An editor that leaves with a request pending, one that leaves with shutdown and exit, and one that just closes:
    each time the server goes on listening, and is left with the asyncio tasks and open files it had before."""
    settings = {"m31r": {**NOISE, "socket": str(daemon)}}
    log = tmp_path / "lsp.log"
    fds = Path("/proc/self/fd").is_dir()
    with tcp_server(tmp_path, "127.0.0.1", "--log-level", "info", log=log) as (proc, port):
        open_files = []

        async def left(n: int) -> list[int]:
            counts = await _sessions_ended(log, n)
            assert proc.poll() is None
            if fds:
                open_files.append(len(os.listdir(f"/proc/{proc.pid}/fd")))
            return counts

        r, w = await _open_session(port, settings)  # a completion is under way as it leaves
        w.write(_did_open(URI, RUST) + frame({"jsonrpc": "2.0", "id": 2, "method": "textDocument/inlineCompletion",
                                              "params": _inline(URI, 3, 21)}))
        await w.drain()
        w.close()
        await left(1)

        r, w = await _open_session(port, settings)  # shutdown and exit: the server closes the connection
        w.write(_did_open(URI, RUST))
        assert (await _request(r, w, 2, "shutdown", None))["result"] is None
        w.write(frame({"jsonrpc": "2.0", "method": "exit"}))
        assert await _until_closed(r) == []
        w.close()
        await left(2)

        for n in (3, 4):
            r, w = await _open_session(port, settings)
            w.write(_did_open(URI2, RUST))
            assert "items" in (await _request(r, w, 2, "textDocument/inlineCompletion",
                                              _inline(URI2, 3, 21)))["result"]
            w.close()
            counts = await left(n)
    # The listener and the connection ending: nothing of the editors before piles up. (A task of the first session's
    # may still be finishing when its line is logged, so the count may fall after it; it must never grow.)
    assert max(counts[1:]) <= counts[0] and counts[-1] == min(counts), counts
    assert len(set(open_files[1:])) <= 1, open_files  # (the first session may open what the process keeps)
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text

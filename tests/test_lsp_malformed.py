"""`m31r lsp` against what a careless or buggy client sends, over stdio with raw messages (a client library would not
send them): positions outside LSP's range or null, an answer to the server's own request that does not fit its type,
a `$/cancelRequest` that comes after the answer, `exit` while requests are running. Each request must be answered, the
user shown no "Error in server", and the log keep to what is news. Real server process, real daemon (the shared one).
"""

from __future__ import annotations

import asyncio
import json

import pytest
from lsp_stdio import URI, Stdio, inline

pytestmark = pytest.mark.timeout(60)
TEXT = "fn main() {\n    let x = \n}\n"
NOISE = {"multiline": "always", "temperature": 1.0, "seed": 7, "debounceMode": "fixed", "debounceMs": 0,
         "minProbability": 0}


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


async def started(sock, settings: dict | None = None) -> Stdio:
    """A server through `initialize` (its client offering workspace/configuration), TEXT open, stderr kept."""
    s = await Stdio.spawn(sock, stderr=True)
    await s.request("initialize", {"capabilities": {"workspace": {"configuration": True}},
                                   "initializationOptions": {"m31r": {**NOISE, **(settings or {})}}})
    s.send("initialized", {})
    s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 1, "text": TEXT}})
    return s


async def test_requests_with_positions_outside_lsps_range_are_answered_invalid_params(daemon):
    """A position LSP's types refuse (negative, over 2**31 - 1, null) failed to parse before the request's id
    was read: the request was never answered (the editor waited on it for ever) and the user was shown "Error in
    server: Invalid Params" each time. Now: InvalidParams (-32602) naming what was wrong, and the server serves on."""
    s = await started(daemon)
    bad = [inline(-1, 0), inline(1, 2**31), inline(1, 2**40), inline(1, None), inline(None, 0)]
    for params in bad:
        got = await s.request("textDocument/inlineCompletion", params)
        assert got["error"]["code"] == -32602, got
        assert "position" in got["error"]["message"]
        menu = {k: v for k, v in params.items() if k != "context"}
        got = await s.request("textDocument/completion", menu)
        assert got["error"]["code"] == -32602, got
    assert "should be in range" in (await s.request("textDocument/inlineCompletion", inline(-1, 0)))["error"][
        "message"]
    # A notification that does not parse cannot be answered: it is logged, not shown as an error of the server.
    s.send("textDocument/didOpen", {"textDocument": {"uri": "file:///x.rs", "languageId": "rust", "version": -1}})
    good = await s.request("textDocument/inlineCompletion", inline(1, 12))
    assert good["result"]["items"], good  # still serving
    assert not s.shown()
    assert any(m.startswith("textDocument/didOpen: ") and "ignored" in m for m in s.logged())
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err


OUT_OF_STEP = {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [
    {"range": {"start": {"line": -1, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "x"}]}


async def test_a_change_that_does_not_parse_drops_its_document_until_it_is_whole_again(daemon):
    """A didChange that does not parse loses an edit: the server's text no longer matches the editor's, and every
    later incremental edit lands in the wrong place. It went on completing (and editing) the stale text; now the
    document gets no completions, the user is told once which file and what to do, and it is back once a change
    sends its whole text (or the editor reopens it)."""
    s = await started(daemon)
    s.send("textDocument/didChange", OUT_OF_STEP)
    stale = await s.request("textDocument/inlineCompletion", inline(1, 12))
    assert stale["result"]["items"] == [], stale
    [told] = s.shown()
    assert "/work/src/main.rs" in told and "reopened" in told and "should be in range" in told
    # Incremental edits cannot mend it: they were written for the editor's text.
    s.send("textDocument/didChange", {"textDocument": {"uri": URI, "version": 3}, "contentChanges": [
        {"range": {"start": {"line": 1, "character": 12}, "end": {"line": 1, "character": 12}}, "text": " "}]})
    assert (await s.request("textDocument/inlineCompletion", inline(1, 13)))["result"]["items"] == []
    # A change with the whole text (then an edit after it, in the same notification) brings it back.
    s.send("textDocument/didChange", {"textDocument": {"uri": URI, "version": 4}, "contentChanges": [
        {"text": TEXT.replace("let x = ", "let y = ")},
        {"range": {"start": {"line": 1, "character": 8}, "end": {"line": 1, "character": 9}}, "text": "zzz"}]})
    back = await s.request("textDocument/inlineCompletion", inline(1, 99))  # past the line's end: at its end
    assert back["result"]["items"], back
    assert back["result"]["items"][0]["range"]["end"] == {"line": 1, "character": len("    let zzz = ")}
    # Dropped again, then reopened: back too, and the user is not told twice about the same file.
    s.send("textDocument/didChange", {**OUT_OF_STEP, "textDocument": {"uri": URI, "version": 5}})
    assert (await s.request("textDocument/inlineCompletion", inline(1, 12)))["result"]["items"] == []
    s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 6, "text": TEXT}})
    assert (await s.request("textDocument/inlineCompletion", inline(1, 12)))["result"]["items"]
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err


async def test_an_answer_to_the_servers_request_that_does_not_fit_is_no_error(daemon):
    """A client answering workspace/configuration with null (LSP wants a list) made the answer fail to parse: the user
    was shown "Error in server: Invalid Params" for every configuration change, and the server waited 5 s for an answer
    it had received. Now that answer counts as no settings, at once."""
    s = await started(daemon)
    for _ in range(2):
        s.send("workspace/didChangeConfiguration", {"settings": None})
        async with asyncio.timeout(10):
            while not (asks := [m for m in s.got if m.get("method") == "workspace/configuration"]):
                s.got.append(await s.read())
        s.got.remove(asks[0])
        s.write({"jsonrpc": "2.0", "id": asks[0]["id"], "result": None})
    await s.request("m31r/stats", {})
    assert not s.shown()
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err and "workspace/configuration failed" not in err


async def test_cancelling_an_answered_request_is_not_logged(daemon):
    """Editors send `$/cancelRequest` for requests already answered (the answer and the cancel cross): pygls logged a
    warning for each, a line per keystroke in the editor's log."""
    s = await started(daemon)
    for k in range(5):
        s.send("textDocument/inlineCompletion", inline(1, 12), msg_id=k)
        await s.answer(k)
        s.send("$/cancelRequest", {"id": k})
    s.send("$/cancelRequest", {"id": "never-sent"})
    await s.request("m31r/stats", {})
    status, err = await s.end()
    assert status == 0 and "Cancel notification" not in err, err


async def test_exit_while_requests_run_is_quiet(daemon):
    """`exit` without `shutdown` while completions waited (an editor closing in a hurry) wrote a traceback per request
    on stderr, their answers going to the stdout just closed."""
    s = await started(daemon, {"debounceMs": 5000})
    for k in range(3):
        s.send("textDocument/inlineCompletion", {**inline(1, 12), "context": {"triggerKind": 2}}, msg_id=k)
    await s.request("m31r/stats", {})
    status, err = await s.end(shutdown=False)
    assert status == 1
    assert "Traceback" not in err and "Error sending data" not in err, err


def send_bytes(s: Stdio, method: str, params: dict, msg_id: str | None = None, bad: bytes = b"\xff\xfe") -> None:
    """A message whose JSON holds bytes that are not UTF-8 where its params say "@@" (an editor that sends a buffer's
    invalid bytes as they are)."""
    msg = {"jsonrpc": "2.0", "method": method, "params": params, **({"id": msg_id} if msg_id else {})}
    body = json.dumps(msg).encode().replace(b"@@", bad)
    s.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)


async def test_text_that_is_not_utf8_drops_its_document_and_every_request_is_answered(daemon):
    """pygls failed to read a message that is not UTF-8 ("Error in server"): a didChange's edit was lost without a word
    (the server went on completing text the editor no longer had) and a request was never answered. Now the bytes are
    read as U+FFFD, a request is answered, and a document whose text held them is out of step, as after a didChange
    that does not parse, until it comes whole with valid text."""
    s = await started(daemon)
    assert (await s.request("textDocument/inlineCompletion", inline(1, 12)))["result"]["items"]
    send_bytes(s, "textDocument/didChange", {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [
        {"range": {"start": {"line": 0, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "// @@\n"}]})
    assert (await s.request("textDocument/inlineCompletion", inline(2, 12)))["result"]["items"] == []
    [told] = s.shown()
    assert "not valid UTF-8" in told and "/work/src/main.rs" in told and "reopened" in told
    send_bytes(s, "textDocument/inlineCompletion", {**inline(2, 12), "workDoneToken": "@@"}, "bad-request")
    assert (await s.answer("bad-request"))["result"]["items"] == []
    # Its whole text, valid: back in step.
    s.send("textDocument/didChange", {"textDocument": {"uri": URI, "version": 3}, "contentChanges": [{"text": TEXT}]})
    assert (await s.request("textDocument/inlineCompletion", inline(1, 12)))["result"]["items"]
    # A didOpen with such bytes: not opened, told (another file), its completions empty; the first file unharmed.
    other = URI.replace("main", "lib")
    send_bytes(s, "textDocument/didOpen", {"textDocument": {"uri": other, "languageId": "rust", "version": 1,
                                                            "text": "// @@\n" + TEXT}})
    params = {**inline(2, 12), "textDocument": {"uri": other}}
    assert (await s.request("textDocument/inlineCompletion", params))["result"]["items"] == []
    assert any("not valid UTF-8" in m and "/work/src/lib.rs" in m for m in s.shown())
    assert (await s.request("textDocument/inlineCompletion", inline(1, 12)))["result"]["items"]
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err and "UnicodeDecodeError" not in err
    assert not any("Error in server" in m for m in s.shown())

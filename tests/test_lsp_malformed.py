"""`m31r lsp` against what a careless or buggy client sends, over stdio with raw messages (a client library would not
send them): positions outside LSP's range or null, an answer to the server's own request that does not fit its type,
a `$/cancelRequest` that comes after the answer, `exit` while requests are running. Each request must be answered, the
user shown no "Error in server", and the log keep to what is news. Real server process, real daemon (the shared one).
"""

from __future__ import annotations

import asyncio
import json
import sys

import pytest

pytestmark = pytest.mark.timeout(60)
URI = "file:///work/src/main.rs"
TEXT = "fn main() {\n    let x = \n}\n"
NOISE = {"multiline": "always", "temperature": 1.0, "seed": 7, "debounceMode": "fixed", "debounceMs": 0,
         "minProbability": 0}


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


class Stdio:
    """A server process, the messages it sent (read as they come) and its stderr."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.got: list[dict] = []

    @classmethod
    async def start(cls, sock, settings: dict | None = None) -> Stdio:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(sock), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        s = cls(proc)
        s.send("initialize", {"capabilities": {"workspace": {"configuration": True}},
                              "initializationOptions": {"m31r": {**NOISE, **(settings or {})}}}, msg_id="init")
        await s.answer("init")
        s.send("initialized", {})
        s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 1, "text": TEXT}})
        return s

    def send(self, method: str, params: object = None, msg_id: int | str | None = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method, "params": params}
        if msg_id is not None:
            msg["id"] = msg_id
        self.write(msg)

    def write(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def _read(self) -> dict:
        length = 0
        while (line := await self.proc.stdout.readline()).strip():
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return json.loads(await self.proc.stdout.readexactly(length))

    async def answer(self, msg_id: int | str, timeout: float = 20) -> dict:
        """The response to request `msg_id` (the server's notifications and requests on the way are kept)."""
        async with asyncio.timeout(timeout):
            while not any(m.get("id") == msg_id and "method" not in m for m in self.got):
                self.got.append(await self._read())
        return next(m for m in self.got if m.get("id") == msg_id and "method" not in m)

    async def request(self, method: str, params: object, timeout: float = 20) -> dict:
        msg_id = f"r{len(self.got)}-{method}"
        self.send(method, params, msg_id)
        return await self.answer(msg_id, timeout)

    def shown(self) -> list[str]:
        return [m["params"]["message"] for m in self.got if m.get("method") == "window/showMessage"]

    def logged(self) -> list[str]:
        return [m["params"]["message"] for m in self.got if m.get("method") == "window/logMessage"]

    async def end(self, shutdown: bool = True) -> tuple[int, str]:
        """Shut down (or not) and exit: the exit status and everything the server wrote on stderr."""
        if shutdown:
            await self.request("shutdown", None)
        self.send("exit")
        self.proc.stdin.close()
        async with asyncio.timeout(20):
            err = await self.proc.stderr.read()
            return await self.proc.wait(), err.decode()


def inline(line: object, character: object) -> dict:
    return {"textDocument": {"uri": URI}, "position": {"line": line, "character": character},
            "context": {"triggerKind": 1}}


async def test_requests_with_positions_outside_lsps_range_are_answered_invalid_params(daemon):
    """A position LSP's types refuse (negative, over 2**31 - 1, null) failed to parse before the request's id
    was read: the request was never answered (the editor waited on it for ever) and the user was shown "Error in
    server: Invalid Params" each time. Now: InvalidParams (-32602) naming what was wrong, and the server serves on."""
    s = await Stdio.start(daemon)
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
    s.send("textDocument/didChange", {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [
        {"range": {"start": {"line": -1, "character": 0}, "end": {"line": 0, "character": 0}}, "text": "x"}]})
    good = await s.request("textDocument/inlineCompletion", inline(1, 12))
    assert good["result"]["items"], good  # still serving, the document as it was
    assert not s.shown()
    assert any(m.startswith("textDocument/didChange: ") and "ignored" in m for m in s.logged())
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err


async def test_an_answer_to_the_servers_request_that_does_not_fit_is_no_error(daemon):
    """A client answering workspace/configuration with null (LSP wants a list) made the answer fail to parse: the user
    was shown "Error in server: Invalid Params" for every configuration change, and the server waited 5 s for an answer
    it had received. Now that answer counts as no settings, at once."""
    s = await Stdio.start(daemon)
    for _ in range(2):
        s.send("workspace/didChangeConfiguration", {"settings": None})
        async with asyncio.timeout(10):
            while not (asks := [m for m in s.got if m.get("method") == "workspace/configuration"]):
                s.got.append(await s._read())
        s.got.remove(asks[0])
        s.write({"jsonrpc": "2.0", "id": asks[0]["id"], "result": None})
    await s.request("m31r/stats", {})
    assert not s.shown()
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err and "workspace/configuration failed" not in err


async def test_cancelling_an_answered_request_is_not_logged(daemon):
    """Editors send `$/cancelRequest` for requests already answered (the answer and the cancel cross): pygls logged a
    warning for each, a line per keystroke in the editor's log."""
    s = await Stdio.start(daemon)
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
    s = await Stdio.start(daemon, {"debounceMs": 5000})
    for k in range(3):
        s.send("textDocument/inlineCompletion", {**inline(1, 12), "context": {"triggerKind": 2}}, msg_id=k)
    await s.request("m31r/stats", {})
    status, err = await s.end(shutdown=False)
    assert status == 1
    assert "Traceback" not in err and "Error sending data" not in err, err

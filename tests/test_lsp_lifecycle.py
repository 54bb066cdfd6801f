"""`m31r lsp` at the ends of a session, driven over stdio with the raw messages an editor sends (a client library
keeps to the order itself): requests before `initialize` and after `shutdown`, and `exit`'s status. Real server
process, real daemon (the shared one)."""

from __future__ import annotations

import json

import pytest
from lsp_stdio import URI, Stdio, inline

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


INIT = {"capabilities": {}, "initializationOptions": {"m31r": {"debounceMs": 0, "minProbability": 0}}}


async def test_requests_before_initialize_and_after_shutdown_get_lsps_errors(daemon):
    """LSP: a request before `initialize` is answered ServerNotInitialized (-32002) and a notification then dropped;
    after `shutdown` a request is answered InvalidRequest (-32600). pygls answered the first with an internal error
    and its traceback, and the second never: a client waiting for it hung."""
    s = await Stdio.spawn(daemon)
    s.send("textDocument/inlineCompletion", inline(0, 0), msg_id=1)
    s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 1,
                                                     "text": "fn main() {\n    let x = \n}\n"}})
    early = await s.answer(1)
    assert early["error"]["code"] == -32002 and "initialize" in early["error"]["message"]
    assert "traceback" not in json.dumps(early)
    s.send("initialize", INIT, msg_id=2)
    assert "capabilities" in (await s.answer(2))["result"]
    s.send("initialized", {})
    s.send("textDocument/inlineCompletion", inline(1, 12), msg_id=3)
    assert (await s.answer(3))["result"] == {"items": []}  # the document sent before initialize was not taken
    s.send("shutdown", None, msg_id=4)
    assert (await s.answer(4))["result"] is None
    s.send("textDocument/inlineCompletion", inline(1, 12), msg_id=5)
    s.send("m31r/stats", {}, msg_id=6)
    for msg_id, method in ((5, "textDocument/inlineCompletion"), (6, "m31r/stats")):
        late = await s.answer(msg_id)
        assert late["error"]["code"] == -32600 and late["error"]["message"].startswith(f"{method}: ")
    assert await s.exit_status() == 0


async def test_exit_without_shutdown_is_status_1(daemon):
    """LSP: the server exits with 0 if `shutdown` came before `exit`, else 1 (pygls' start_io returned either way and
    the process always ended 0)."""
    s = await Stdio.spawn(daemon)
    s.send("initialize", INIT, msg_id=1)
    await s.answer(1)
    s.send("initialized", {})
    assert await s.exit_status() == 1

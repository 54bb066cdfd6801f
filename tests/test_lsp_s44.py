"""`m31r lsp` audit (session 44): many documents asking at once against the daemon's per-connection limit, its `busy`
refusals as the user hears of them, and more of a real editor's load. Real server processes over stdio (lsp_stdio)
talking to real daemons on the tiny random-weight bundle; a daemon that must hold requests in flight is stopped with
SIGSTOP (test_lsp_s43_audit's `stalled`). Nothing is mocked."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import test_lsp_s43_audit
from lsp_stdio import Stdio
from test_lsp import NOISE
from test_lsp_s43_audit import begin, stats, stoppable

from m31r_lsp.completion import MAX_LIVE_DOCUMENTS

pytestmark = pytest.mark.timeout(120)
stalled = test_lsp_s43_audit.stalled  # the fixture, shared with test_lsp_s43_audit

TEXT = "fn f() {\n    let x = \n}\n"
SHORT = {**NOISE, "multiline": "never", "maxTokens": 2}


def uris(n: int) -> list[str]:
    return [f"file:///work/src/m{i}.rs" for i in range(n)]


def open_all(s: Stdio, docs: list[str]) -> None:
    for uri in docs:
        s.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "rust", "version": 1, "text": TEXT}})


def ask(s: Stdio, uri: str, msg_id: object, character: int = 12) -> None:
    s.send("textDocument/inlineCompletion", {"textDocument": {"uri": uri}, "position": {
        "line": 1, "character": character}, "context": {"triggerKind": 1}}, msg_id=msg_id)


async def at_daemon(s: Stdio, want: int) -> dict:
    """Stats once `want` of the server's daemon requests are in flight (sent, not cancelled)."""
    async with asyncio.timeout(30):
        while (st := await stats(s)).get("daemon_requests", 0) - st.get("daemon_cancels", 0) < want:
            await asyncio.sleep(0.02)
    return st


@pytest.fixture
def narrow(tiny_bundle, tmp_path: Path):
    """A daemon of this test's own that takes two requests at a time from a connection (--max-per-connection 2), and
    `stall()`/`resume()` as `stalled`'s."""
    with stoppable(tiny_bundle.path, tmp_path / "n.sock", "--max-per-connection", "2") as daemon:
        yield daemon


# -- 1. many documents at once, and the daemon's `busy` -----------------------------------------------------------


async def test_many_documents_at_once_the_newest_are_served_and_none_refused(stalled):
    """24 documents asked at once (the daemon held, so that all are in flight together): the daemon takes 16 requests
    at a time from a connection, so the 8 newest, those the user most likely waits on, were refused `busy` (a warning
    each in the log) while the 16 oldest were served. Now the documents asked about longest ago are superseded: at most
    MAX_LIVE_DOCUMENTS requests reach the daemon, the newest are answered, the oldest answer empty, and nothing is
    refused."""
    docs = uris(24)
    s = await begin(stalled.sock, SHORT)
    open_all(s, docs)
    await stats(s)
    stalled.stall()
    for i, uri in enumerate(docs):
        ask(s, uri, i)
    st = await at_daemon(s, MAX_LIVE_DOCUMENTS)
    assert st["requests"] == 24 and st["evicted"] == 24 - MAX_LIVE_DOCUMENTS
    stalled.resume()
    got = [len((await s.answer(i, timeout=60))["result"]["items"]) for i in range(24)]
    assert got == [0] * (24 - MAX_LIVE_DOCUMENTS) + [1] * MAX_LIVE_DOCUMENTS
    st = await stats(s)
    assert "daemon_error_busy" not in st and st["suggestions"] == MAX_LIVE_DOCUMENTS
    assert await s.end() == (0, "")


async def test_busy_refusals_are_told_once(narrow):
    """A daemon that takes fewer requests from a connection than the server keeps in flight (--max-per-connection 2,
    or other clients filling its queue): each refused request wrote a warning to the log, and the user was never told
    why completions went missing. Now the user is told once (window/showMessage) and the log says it once, with the
    count."""
    docs = uris(5)
    s = await begin(narrow.sock, SHORT)
    open_all(s, docs)
    await stats(s)
    for character in (12, 11):  # twice: the second round is not news
        narrow.stall()
        for i, uri in enumerate(docs):
            ask(s, uri, f"{character}-{i}", character)
        await at_daemon(s, 5)
        narrow.resume()
        for i in range(5):
            await s.answer(f"{character}-{i}", timeout=60)
    st = await stats(s)
    assert st["daemon_error_busy"] == 6 and st.get("evicted", 0) == 0
    told = [m for m in s.shown() if "busy" in m]
    assert len(told) == 1 and "limit 2 per connection" in told[0]
    status, err = await s.end()
    assert status == 0 and err.count("busy") == 1 and "refused 1 completion request(s)" in err


def test_a_tcp_port_past_65535_is_one_error_line_not_a_traceback():
    r = subprocess.run([sys.executable, "-m", "m31r.cli", "lsp", "--tcp", "127.0.0.1:99999", "--no-autostart"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    assert "a port runs from 0 to 65535" in r.stderr, r.stderr

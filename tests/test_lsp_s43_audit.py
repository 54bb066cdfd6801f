"""`m31r lsp` audit (session 43): settings changes under a running completion, LSP 3.18's trigger kinds as clients send
them, and the daemon link's end. Real server processes over stdio (lsp_stdio) talking to real daemons on the tiny
random-weight bundle; a daemon that must stall mid-request is stopped with SIGSTOP. Nothing is mocked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon
from lsp_stdio import URI, Stdio, inline
from test_lsp import NOISE, RUST

from m31r_lsp.daemon_link import EditorLink
from m31r_protocol import reconnect
from m31r_protocol.reconnect import Unavailable

pytestmark = pytest.mark.timeout(120)

OFFSET = RUST.index("    counts\n}") + len("    counts")  # NOISE shows a suggestion here (test_lsp)
LINE, CHAR = RUST[:OFFSET].count("\n"), len(RUST[:OFFSET].rpartition("\n")[2])
SLOW = {**NOISE, "debounceMs": 1500}  # an automatic request waits this long before it reaches the daemon


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon[1]


@dataclass
class Stoppable:
    """A daemon of a test's own, and `stall()`/`resume()` to stop and continue it: a request sent to a stopped
    daemon stays in flight."""

    sock: Path
    pid: int

    def stall(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@contextlib.contextmanager
def stoppable(bundle: Path, sock: Path, *args: str) -> Iterator[Stoppable]:
    proc = start_daemon(bundle, sock, *args)
    try:
        yield Stoppable(sock, proc.pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        stop_daemon(proc)


@pytest.fixture
def stalled(tiny_bundle, tmp_path: Path):
    """A daemon of this test's own (its socket in pytest's 0700 tmp_path) that the test may stall and resume."""
    with stoppable(tiny_bundle.path, tmp_path / "d.sock") as daemon:
        yield daemon


@pytest.fixture(scope="module")
def stoppable_daemon(tiny_bundle, tmp_path_factory: pytest.TempPathFactory):
    """A daemon of this module's own (its socket in a 0700 folder of pytest's) that its tests stall and resume, one
    at a time: each start cost a torch import and a model load. What a test counts is its own server's."""
    with stoppable(tiny_bundle.path, tmp_path_factory.mktemp("stoppable") / "d.sock") as daemon:
        yield daemon


@pytest.fixture
def shared_stalled(stoppable_daemon):
    """The module's stoppable daemon, for a test that stalls and resumes it (never ends it): running again after the
    test, whatever the test did."""
    try:
        yield stoppable_daemon
    finally:
        stoppable_daemon.resume()


async def begin(sock: Path, settings: dict) -> Stdio:
    """A server initialized with `settings`, RUST open at URI."""
    s = await Stdio.spawn(sock, stderr=True)
    s.send("initialize", {"capabilities": {}, "initializationOptions": {"m31r": settings}}, msg_id="init")
    await s.answer("init")
    s.send("initialized", {})
    s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 1, "text": RUST}})
    return s


def at(kind: object) -> dict:
    """inlineCompletion params at OFFSET with context.triggerKind `kind` (as sent, whatever it is)."""
    return {**inline(LINE, CHAR), "context": {"triggerKind": kind}}


def configure(s: Stdio, section: dict) -> None:
    s.send("workspace/didChangeConfiguration", {"settings": {"m31r": section}})


async def stats(s: Stdio) -> dict:
    return (await s.request("m31r/stats", {}))["result"]


async def in_flight(s: Stdio) -> None:
    """Until the server has sent its Fim to the daemon."""
    async with asyncio.timeout(20):
        while (await stats(s)).get("daemon_requests", 0) < 1:
            await asyncio.sleep(0.02)


# -- 1. a settings change under a running completion --------------------------------------------------------------


async def test_turning_completions_off_cancels_a_debouncing_request(daemon):
    """`enable`: false while a request waits out its debounce: the job went on, asked the daemon and answered with a
    suggestion the user had just turned off. Now the request answers empty and nothing reaches the daemon."""
    s = await begin(daemon, SLOW)
    s.send("textDocument/inlineCompletion", at(2), msg_id=1)
    await stats(s)  # the request has arrived and waits
    configure(s, {**SLOW, "enable": False})
    assert (await s.answer(1))["result"] == {"items": []}
    st = await stats(s)
    assert st.get("daemon_requests", 0) == 0 and st["disabled"] == 1 and st["settings"]["enable"] is False
    assert await s.end() == (0, "")


async def test_turning_completions_off_cancels_a_request_the_daemon_is_answering(shared_stalled):
    """`enable`: false while the daemon computes the answer: the request answers empty (it does not wait for the
    daemon), the daemon's request is cancelled, and the suggestion it then writes is shown nowhere."""
    s = await begin(shared_stalled.sock, NOISE)
    await stats(s)
    shared_stalled.stall()
    s.send("textDocument/inlineCompletion", at(1), msg_id=1)
    await in_flight(s)
    configure(s, {**NOISE, "enable": False})
    assert (await s.answer(1))["result"] == {"items": []}
    shared_stalled.resume()
    st = await stats(s)
    assert st["disabled"] == 1 and st["daemon_cancels"] == 1 and st.get("suggestions", 0) == 0
    assert await s.end() == (0, "")


async def test_a_settings_change_of_what_a_completion_is_cancels_a_debouncing_request(daemon):
    """maxTokens changed while a request waits out its debounce: the job asked the daemon under the old settings and
    its suggestion answered (what the finished job no longer may: test_lsp_session42_audit). Now it is cancelled, and
    answers empty; the next request is asked under the new settings."""
    s = await begin(daemon, SLOW)
    s.send("textDocument/inlineCompletion", at(2), msg_id=1)
    await stats(s)
    configure(s, {**SLOW, "maxTokens": 9, "debounceMs": 0})
    assert (await s.answer(1))["result"] == {"items": []}
    st = await stats(s)
    assert st.get("daemon_requests", 0) == 0 and st["reshaped"] == 1
    await s.request("textDocument/inlineCompletion", at(2))
    assert (await stats(s))["lastFim"]["max_tokens"] == 9
    assert await s.end() == (0, "")


async def test_a_settings_change_of_when_to_ask_keeps_the_request(daemon):
    """debounceMs decides when a completion is asked for, not what it is: the waiting request goes on."""
    s = await begin(daemon, SLOW)
    s.send("textDocument/inlineCompletion", at(2), msg_id=1)
    await stats(s)
    configure(s, {**SLOW, "debounceMs": 5})
    assert len((await s.answer(1))["result"]["items"]) == 1
    st = await stats(s)
    assert st["daemon_requests"] == 1 and "reshaped" not in st
    assert await s.end() == (0, "")


# -- 2. LSP 3.18's InlineCompletionTriggerKind as clients send it -------------------------------------------------


@pytest.mark.parametrize("kind, invoked", [(1, True), (2, False), (0, True), (3, False), ("Invoked", False),
                                           (None, False), (-1, False), (True, False)])
async def test_trigger_kinds(daemon, kind, invoked):
    """LSP 3.18: Invoked 1, Automatic 2 (lsprotocol's InlineCompletionTriggerKind too). The 3.18 draft (and VS Code's
    own API) had Invoke 0, Automatic 1, and lsprotocol refused 0, as any value but 1 or 2: each request of such a
    client was answered InvalidParams. Now 0 is the draft's Invoke and any other value Automatic (the cautious
    reading: debounced, under the confidence floor), logged once. With a floor the tiny model never reaches, an
    invoked request shows its suggestion and an automatic one none (test_lsp)."""
    s = await begin(daemon, {**NOISE, "minProbability": 0.5})
    for _ in range(2):
        got = await s.request("textDocument/inlineCompletion", at(kind))
        assert "error" not in got and len(got["result"]["items"]) == (1 if invoked else 0)
    st = await stats(s)
    assert st["unsure"] >= 1 and st.get("unsure_invoked", 0) == (1 if invoked else 0)
    odd = [m for m in s.logged() if "triggerKind" in m]
    if kind in (1, 2) and kind is not True:
        assert odd == []
    else:
        assert len(odd) == 1 and ("Invoked" if invoked else "Automatic") in odd[0]
    assert (await s.end())[0] == 0


# -- 3. the daemon link's end -------------------------------------------------------------------------------------


async def test_a_closed_link_leaves_no_task_and_does_not_connect_again(shared_stalled):
    """EditorLink.close while a connection is being made (the daemon stalled in its handshake): DaemonLink.close
    cancelled the connecting task without waiting for it, so it was still pending when close returned (a TCP session's
    end, the loop's end), and a job still running at shutdown could call get() and connect again. Close now leaves no
    task and a closed link connects no more, telling the editor nothing more (fixed in m31r_protocol.reconnect)."""
    sent: list = []
    link = EditorLink(reconnect.link_config(str(shared_stalled.sock), autostart=False), on_status=sent.append,
                      tell=sent.append)
    await link.get(wait=20)
    assert link.connects == 1
    await link.close()
    link2 = EditorLink(reconnect.link_config(str(shared_stalled.sock), autostart=False), on_status=sent.append)
    shared_stalled.stall()
    link2.warm_up()
    await asyncio.sleep(0.2)  # connecting, in the stalled daemon's handshake
    await link2.close()
    assert asyncio.all_tasks() == {asyncio.current_task()}
    shared_stalled.resume()
    told = len(sent)
    link.warm_up()
    with pytest.raises(Unavailable):
        await link.get(wait=5)
    assert link.connects == 1 and len(sent) == told


# -- 4. the lifecycle around a request in flight ------------------------------------------------------------------


async def test_the_daemon_dying_mid_request_is_said_once(stalled):
    """The daemon dies while it answers: the request answers empty, the user is told once (not per request), and the
    server goes on answering."""
    s = await begin(stalled.sock, NOISE)
    await stats(s)
    stalled.stall()
    s.send("textDocument/inlineCompletion", at(1), msg_id=1)
    await in_flight(s)
    os.kill(stalled.pid, signal.SIGKILL)
    assert (await s.answer(1))["result"] == {"items": []}
    assert (await s.request("textDocument/inlineCompletion", at(1)))["result"] == {"items": []}
    assert len([m for m in s.shown() if "unavailable" in m]) == 1
    assert (await stats(s))["daemon"]["state"] == "unavailable"
    status, err = await s.end()
    assert status == 0 and "Traceback" not in err


async def test_a_change_mid_request_is_not_answered_with_the_old_texts_suggestion(shared_stalled):
    """didChange while the daemon computes: the request answers empty at once and the daemon's request is
    cancelled."""
    s = await begin(shared_stalled.sock, NOISE)
    await stats(s)
    shared_stalled.stall()
    s.send("textDocument/inlineCompletion", at(1), msg_id=1)
    await in_flight(s)
    s.send("textDocument/didChange", {"textDocument": {"uri": URI, "version": 2}, "contentChanges": [
        {"range": {"start": {"line": LINE, "character": CHAR}, "end": {"line": LINE, "character": CHAR}},
         "text": "."}]})
    assert (await s.answer(1))["result"] == {"items": []}
    shared_stalled.resume()
    st = await stats(s)
    assert st["daemon_cancels"] == 1 and st.get("suggestions", 0) == 0
    assert await s.end() == (0, "")


async def test_shutdown_and_exit_with_a_request_in_flight_are_clean(shared_stalled):
    """shutdown while the daemon computes: the request answers empty, shutdown answers, a request after it gets
    InvalidRequest, and the process exits 0 with nothing on stderr; `exit` alone with a request in flight exits 1."""
    s = await begin(shared_stalled.sock, NOISE)
    await stats(s)
    shared_stalled.stall()
    s.send("textDocument/inlineCompletion", at(1), msg_id=1)
    await in_flight(s)
    assert (await s.request("shutdown", None))["result"] is None
    assert (await s.answer(1))["result"] == {"items": []}
    late = await s.request("textDocument/inlineCompletion", at(1))
    assert late["error"]["code"] == -32600
    assert await s.end(shutdown=False) == (0, "")
    s = await begin(shared_stalled.sock, NOISE)
    s.send("textDocument/inlineCompletion", at(1), msg_id=1)
    assert await s.end(shutdown=False) == (1, "")


async def test_many_open_documents(daemon):
    """Five hundred open documents, each with a request, then all closed: every request is answered, and the session
    ends cleanly."""
    s = await begin(daemon, {**NOISE, "multiline": "never", "maxTokens": 2})
    uris = [f"file:///work/src/m{i}.rs" for i in range(500)]
    for uri in uris:
        s.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "rust", "version": 1,
                                                         "text": "fn f() {\n    let x = \n}\n"}})
    for batch in range(0, len(uris), 10):  # (the daemon takes 16 requests at a time from one connection)
        for i in range(batch, batch + 10):
            s.send("textDocument/inlineCompletion", {"textDocument": {"uri": uris[i]}, "position": {
                "line": 1, "character": 12}, "context": {"triggerKind": 1}}, msg_id=i)
        for i in range(batch, batch + 10):
            assert "result" in await s.answer(i, timeout=60)
    for uri in uris:
        s.send("textDocument/didClose", {"textDocument": {"uri": uri}})
    st = await stats(s)
    assert st["requests"] == 500
    assert await s.end() == (0, "")

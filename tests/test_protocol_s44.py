"""The wire protocol's leftovers of the forty-third audit, against real daemons: a client dropped without close()
lets its connection go, a `busy` for the daemon-wide queue names the limit it hit, and a request the daemon could
never serve is refused on arrival while the model loads, as it is once loaded."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import re
import socket
import subprocess
import time
import weakref
from pathlib import Path

import pytest
from test_client_audit import HANG_GUARD_S, read_loops
from test_daemon_connections_s43 import CAP, connect, daemon, frame, recv  # noqa: F401 (fixture)
from test_service import GATED_TORCH, GATED_WARM_UP, connect_once_serving, run_gated_daemon

from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError
from m31r_protocol.framing import read_frame
from m31r_protocol.peer import peer_uid

pytestmark = pytest.mark.timeout(180)


async def test_a_client_dropped_without_close_lets_its_connection_go(daemon, caplog) -> None:  # noqa: F811
    """A Client nobody holds any more, never closed (a front end that forgets close()), kept its socket open: its read
    loop and it held each other, so it was freed only by a collection of cycles, whenever one ran, and its read loop
    with it while pending ("Task was destroyed but it is pending"). Until then the daemon kept the connection, and
    past its limit (CAP here) refused every new client `busy`. Dropped now, the client is freed at once, its socket
    closed and its read loop ended, and the daemon serves the next client."""
    caplog.set_level(logging.ERROR, logger="asyncio")
    clients: list[Client] = []
    t0 = time.monotonic()
    while len(clients) < CAP:  # (a connection of an earlier test may still be on its way out)
        try:
            clients.append(await Client.connect(daemon.socket, client=f"dropped-{len(clients)}"))
        except DaemonError as e:
            assert e.code == "busy" and time.monotonic() - t0 < HANG_GUARD_S, e
            await asyncio.sleep(0.05)
    assert {s.pid for s in await asyncio.gather(*(c.status() for c in clients))} == {daemon.proc.pid}
    with pytest.raises(DaemonError, match="the most it serves at once"):  # the daemon is full
        clients.append(await Client.connect(daemon.socket, client="one-too-many"))
    refs = [weakref.ref(c) for c in clients]
    gc.disable()  # freed as they are dropped, not by a collection of cycles whenever one runs
    try:
        clients.clear()  # dropped, never closed
        assert not [r for r in refs if r() is not None]
    finally:
        gc.enable()
    t0 = time.monotonic()
    while True:  # in once the daemon has seen the dropped ones go
        try:
            async with await Client.connect(daemon.socket, client="after") as c:
                assert (await c.status()).pid == daemon.proc.pid
            break
        except DaemonError as e:
            assert e.code == "busy" and time.monotonic() - t0 < HANG_GUARD_S, "the dropped clients' sockets stay open"
            await asyncio.sleep(0.05)
    async with asyncio.timeout(HANG_GUARD_S):
        while read_loops():
            await asyncio.sleep(0.01)
    gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


def test_requests_are_checked_on_arrival_while_the_model_loads(tiny_bundle, tmp_path: Path) -> None:
    """--max-prompt-chars (and the other checks that need no model) held only once the model had loaded: a prompt
    over it waited for the whole load, holding its text and a place in the queue, to be refused then. It is refused
    on arrival now, as after the load. A `busy` for the queue of requests waiting for the model names its limit
    (--max-queue, over every connection), as the per-connection one always did."""
    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with (await connect_once_serving(proc, sock_path, log) as c,
                    await connect_once_serving(proc, sock_path, log) as other):
            long = await c.generate("x" * 101, max_tokens=1)
            wide = await c.generate("fn", max_tokens=c.welcome.max_context + 1)
            snippets = await c.fim("fn", context=[m.Snippet("x")] * 9)
            st = await c.status()  # answered after the requests above: the daemon has seen them
            assert st.warming and st.queue == 0, st
            for stream, says in ((long, "101 characters; this daemon takes at most 100 (--max-prompt-chars)"),
                                 (wide, "max_tokens must be between 0 and"), (snippets, "at most 8 are taken")):
                with pytest.raises(DaemonError, match=re.escape(says)) as e:
                    await asyncio.wait_for(stream.collect(), HANG_GUARD_S)
                assert e.value.code == "bad_request"
            waiting = await c.generate("fn main() {", max_tokens=2)
            with pytest.raises(DaemonError) as e:
                await asyncio.wait_for((await other.generate("fn f() {", max_tokens=2)).collect(), HANG_GUARD_S)
            assert e.value.busy == m.BusyDetail("loading", 1), e.value
            assert "wait for the model to load (limit 1) over every connection" in e.value.message, e.value
            assert "(--max-queue)" in e.value.message, e.value
            assert (await c.status()).warming  # all of it before the model loaded
            gate.touch()
            _, done = await asyncio.wait_for(waiting.collect(), HANG_GUARD_S)
            assert done.usage.completion_tokens == 2

    run_gated_daemon(GATED_TORCH, tiny_bundle.path, tmp_path, session, "--max-prompt-chars", "100",
                     "--max-queue", "1")


def test_busy_for_the_daemons_queue_names_its_limit(tiny_bundle, tmp_path: Path) -> None:
    """A request past --max-queue was told "N requests in flight (limit N)": an editor user shown that could not tell
    the daemon's queue over every client from the connection's own share. It names --max-queue now. (The model is
    loaded and its warm-up held: the first request stays in flight, deterministically.)"""
    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with (await connect_once_serving(proc, sock_path, log) as c,
                    await connect_once_serving(proc, sock_path, log) as other):
            t0 = time.monotonic()
            while (await c.status()).cache_budget_mb == 0:  # until the model has loaded
                assert time.monotonic() - t0 < HANG_GUARD_S, log.read_text()
                await asyncio.sleep(0.02)
            held = await c.generate("fn main() {", max_tokens=2)
            with pytest.raises(DaemonError) as e:
                await asyncio.wait_for((await other.generate("fn f() {", max_tokens=2)).collect(), HANG_GUARD_S)
            assert e.value.busy == m.BusyDetail("daemon", 1), e.value
            assert e.value.message.startswith("1 request in flight (limit 1) over every connection to this daemon "
                                              "(--max-queue); retry shortly"), e.value
            gate.touch()
            _, done = await asyncio.wait_for(held.collect(), HANG_GUARD_S)
            assert done.usage.completion_tokens == 2

    run_gated_daemon(GATED_WARM_UP, tiny_bundle.path, tmp_path, session, "--max-queue", "1")


def test_an_invalid_message_with_the_id_of_a_request_in_flight_leaves_that_request_alone(tiny_bundle,
                                                                                          tmp_path: Path) -> None:
    """A message the daemon cannot validate was answered with the id salvaged from it: where that id was a request
    still in flight (or waiting for the model), the client, which routes by id, ended that request with the error,
    and the daemon went on serving it for nobody. Such an Error has no id now, as a duplicate request's has. (The
    request waits for the model here: in flight, deterministically.)"""
    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with await connect_once_serving(proc, sock_path, log) as c:
            reader, writer = await connect(sock_path)
            writer.write(frame({"type": "generate", "id": 7, "prompt": "fn main() {", "max_tokens": 2})
                         + frame({"type": "generate", "id": 7, "prompt": "fn", "bogus": 1})
                         + frame({"type": "generate", "id": 8, "prompt": "fn", "bogus": 1}))
            first, second = await recv(reader), await recv(reader)
            assert isinstance(first, m.Error) and first.id is None, first
            assert first.message.startswith("request id 7 is already in flight on this connection; this invalid "
                                            "message with its id was dropped: Object contains unknown field"), first
            assert isinstance(second, m.Error) and second.id == 8, second  # an id not in use is still said
            assert (await c.status()).queue == 1  # request 7 still waits
            gate.touch()
            events = [await recv(reader)]
            while isinstance(events[-1], m.Token):
                events.append(await recv(reader))
            assert isinstance(events[-1], m.Done) and {e.id for e in events} == {7}, events
            writer.close()

    run_gated_daemon(GATED_TORCH, tiny_bundle.path, tmp_path, session)


async def test_a_connection_that_times_out_is_not_a_frame_that_did_not_begin() -> None:
    """ETIMEDOUT on the connection (the transport hands it to the reader) was taken for `begin_within` running out,
    where none was given: FrameNotBegun "no frame began within 0 s", which the client's read loop does not expect (it
    ended as if the daemon had closed the connection, the exception unretrieved). It is the OSError it is now."""
    reader = asyncio.StreamReader()
    reader.set_exception(TimeoutError(errno.ETIMEDOUT, "Connection timed out"))
    with pytest.raises(TimeoutError, match="Connection timed out"):
        await read_frame(reader)



@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or not hasattr(socket, "SO_PEERCRED"),
                    reason="running a peer as another uid takes root (CI runs as root)")
def test_a_peer_uid_past_2_to_the_31_is_read_as_it_is():
    """uid_t is unsigned: read signed, a uid from a directory service past 2**31 never matched os.getuid()."""
    uid = 3_000_000_000
    path = f"\0m31r-peer-{os.getpid()}"  # Linux's abstract namespace: no folder the other uid must be let into
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        server.listen(1)
        pid = os.fork()
        if pid == 0:  # the child: only system calls, then out (no interpreter clean-up in a forked pytest)
            try:
                os.setgid(uid)
                os.setuid(uid)
                peer = socket.socket(socket.AF_UNIX)
                peer.connect(path)
                peer.recv(1)
            finally:
                os._exit(0)
        try:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                assert peer_uid(conn) == uid
        finally:
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_a_tilde_in_m31r_socket_and_m31r_bundle_is_the_home_folder(monkeypatch, tmp_path):
    """Quoted in a shell profile (`export M31R_SOCKET='~/m31r.sock'`), `~` reaches the process as is: it named a
    `./~/` folder in whatever folder a client ran in."""
    from m31r_protocol.paths import default_socket_path
    from m31rd.main import default_bundle

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("M31R_SOCKET", "~/run/m31rd.sock")
    monkeypatch.setenv("M31R_BUNDLE", "~/bundles/mine")
    assert default_socket_path() == tmp_path / "run" / "m31rd.sock"
    assert default_bundle() == tmp_path / "bundles" / "mine"

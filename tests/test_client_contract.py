"""m31r_protocol's client as a new front end would use it, against a real daemon: misuse and failures end in a clear
exception (never a hang or a leaked socket), and a request nobody reads any more stops in the daemon too.

Most tests share the session's daemon (conftest `shared_daemon`); the one that kills a daemon starts its own."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest
import uvloop
from daemon_util import start_daemon, stop_daemon

from m31r_protocol import blocking
from m31r_protocol.client import Client, DaemonError, DaemonUnavailable
from m31r_protocol.limits import MAX_FRAME_BYTES
from m31r_protocol.reconnect import READY, DaemonLink, link_config

PROMPT = "fn main() {"
LONG = dict(max_tokens=400, lookahead=0)  # the tiny model's 400 looping tokens, no drafts: still running on a cancel
RUNNERS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
_names = itertools.count()


def client_name() -> str:
    """A Hello name of this test's own, to find its requests' lines in the shared daemon's log."""
    return f"contract-{time.monotonic_ns()}-{next(_names)}"


async def request_line(proc: Any, client: str, rid: int, timeout: float = 5.0) -> dict:
    """The daemon's log line for request `rid` of `client` (it is written once the request ends)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        for line in list(proc.log_lines):
            x = json.loads(line)
            if x.get("msg") == "request" and x.get("client") == client and x.get("id") == rid:
                return x
        await asyncio.sleep(0.02)
    raise AssertionError(f"no log line for request {rid} of {client}")


@RUNNERS
def test_a_cancelled_read_cancels_the_request(shared_daemon, run: Callable[[Coroutine], Any]) -> None:
    """A task reading a stream cancelled (as Ctrl-C cancels asyncio.run's task), or a timeout around collect(),
    stops the request in the daemon, and not one beside it; reading the stream again then raises at once instead of
    waiting forever."""
    proc, sock = shared_daemon
    name = client_name()

    async def scenario() -> None:
        async with await Client.connect(sock, client=name) as c:
            alone = await (await c.generate("struct Bar {", max_tokens=200, lookahead=0)).collect()
            beside = asyncio.create_task((await c.generate("struct Bar {", max_tokens=200, lookahead=0)).collect())
            read = await c.generate(PROMPT, **LONG)
            await read.__anext__()

            async def read_all() -> None:
                async for _ in read:
                    pass

            task = asyncio.create_task(read_all())
            await asyncio.sleep(0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            timed = await c.generate(PROMPT, **LONG)
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.005):
                    await timed.collect()
            for s in (read, timed):
                assert (line := await request_line(proc, name, s.id)).get("code") == "cancelled", line
                with pytest.raises(DaemonError, match="cancelled"):  # after the tokens that came before the cancel
                    async with asyncio.timeout(1):
                        async for _ in s:
                            pass
                with pytest.raises(DaemonError, match="cancelled"):  # and again: an ended stream never waits
                    await asyncio.wait_for(s.__anext__(), 1)
            assert (await beside)[0] == alone[0]  # a request beside the cancelled ones is served whole
            assert (await (await c.generate("fn", max_tokens=3)).collect())[1].usage.completion_tokens == 3
            assert not c._streams

    run(scenario())


@RUNNERS
def test_a_dropped_stream_cancels_the_request(shared_daemon, run: Callable[[Coroutine], Any]) -> None:
    """Breaking out of `async for` and letting the stream go, or never reading it, stops the request in the daemon:
    the client does not keep it, nor the daemon work for it."""
    proc, sock = shared_daemon
    name = client_name()

    async def scenario() -> None:
        async with await Client.connect(sock, client=name) as c:
            s = await c.generate(PROMPT, **LONG)
            async for _ in s:
                break
            broken = s.id
            s = await c.generate(PROMPT, **LONG)
            unread = s.id
            del s
            for rid in (broken, unread):
                assert (line := await request_line(proc, name, rid)).get("code") == "cancelled", line
            assert not c._streams

    run(scenario())


async def test_an_oversize_request_is_refused_without_ending_the_others(shared_daemon) -> None:
    """A request past the protocol's frame limit is refused by the client, saying so: sent, the daemon would close
    the connection, and every other request on it would end with a lost connection."""
    _, sock = shared_daemon
    async with await Client.connect(sock) as c:
        other = await c.generate(PROMPT, max_tokens=50, lookahead=0)
        with pytest.raises(DaemonError) as e:
            await c.generate("x" * MAX_FRAME_BYTES)
        assert e.value.code == "frame_too_large" and "send less text" in e.value.message
        text, done = await asyncio.wait_for(other.collect(), 10)
        assert done.usage.completion_tokens == 50
        assert (await c.status()).pid


async def test_closing_a_client_says_so(shared_daemon) -> None:
    """A request in flight when its own client is closed, and a request made after, say that the client was closed
    rather than blaming the daemon."""
    _, sock = shared_daemon
    c = await Client.connect(sock)
    s = await c.generate(PROMPT, **LONG)
    await s.__anext__()
    await c.close()
    with pytest.raises(DaemonUnavailable, match=r"client was closed \(Client.close\)"):
        async with asyncio.timeout(5):
            async for _ in s:
                pass
    for call in (c.status, lambda: c.generate(PROMPT)):
        with pytest.raises(DaemonUnavailable, match=r"client is closed \(Client.close\)"):
            await call()
    await c.close()  # twice is fine


@pytest.mark.parametrize("reply", [b"", struct.pack(">I", MAX_FRAME_BYTES + 1)], ids=["silent", "oversize"])
async def test_a_failed_handshake_closes_its_socket(tmp_path: Path, reply: bytes) -> None:
    """A socket that accepts and never answers (or answers what no daemon sends) fails the connect clearly, and the
    client closes its end at once: nothing is left for the garbage collector to warn about."""
    path = tmp_path / "mute.sock"
    eof = asyncio.Event()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(reply)
        while await reader.read(1 << 16):
            pass
        eof.set()
        writer.close()

    server = await asyncio.start_unix_server(accept, path=str(path))
    try:
        with pytest.raises((DaemonUnavailable, DaemonError)) as e:
            await Client.connect(path, welcome_timeout=0.3)
        if reply:
            assert isinstance(e.value, DaemonError) and e.value.code == "bad_request" and "limit" in str(e.value)
        else:
            assert isinstance(e.value, DaemonUnavailable) and "did not answer in time" in str(e.value)
        await asyncio.wait_for(eof.wait(), 2)  # while `e` still holds the handshake's frames
    finally:
        server.close()
        await server.wait_closed()


def test_blocking_status_keeps_its_timeout_against_a_trickling_socket(tmp_path: Path) -> None:
    """`m31r status` must answer at once: a peer that sends a byte at a time resets no clock, the timeout is for the
    whole exchange."""
    path = tmp_path / "trickle.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen()

    def trickle() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(struct.pack(">I", 64))
            for _ in range(16):  # 4 s of one byte every 0.25 s, then hang up
                time.sleep(0.25)
                try:
                    conn.sendall(b"\x00")
                except OSError:
                    return

    peer = threading.Thread(target=trickle, daemon=True)
    peer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            blocking.status(path, timeout=1.0)
        assert time.monotonic() - t0 < 2.0
    finally:
        listener.close()
        peer.join(5)


async def test_a_daemon_killed_mid_stream_ends_the_stream_and_the_link_recovers(tiny_bundle, tmp_path: Path) -> None:
    """SIGKILL mid-stream: the stream ends with DaemonUnavailable (no hang), and the shared link reconnects to the
    daemon restarted on the same socket, telling `on_state` each step."""
    sock = tmp_path / "run" / "m31rd.sock"
    proc = await asyncio.to_thread(start_daemon, tiny_bundle.path, sock)
    states: list[str] = []
    link = DaemonLink(link_config(sock, autostart=False), client_name="test", on_state=lambda s, _: states.append(s))
    second = None
    try:
        first = await link.get(5)
        s = await first.generate(PROMPT, **LONG)
        await s.__anext__()
        proc.kill()
        with pytest.raises(DaemonUnavailable, match="closed the connection"):
            async with asyncio.timeout(5):
                async for _ in s:
                    pass
        await asyncio.to_thread(proc.wait)
        second = await asyncio.to_thread(start_daemon, tiny_bundle.path, sock)  # over the socket file left behind
        again = await link.get(5)
        assert again is not first and (await again.status()).pid == second.pid
        assert states == ["starting", READY, "unavailable", "starting", READY]
    finally:
        await link.close()
        stop_daemon(proc)
        if second is not None:
            stop_daemon(second)


async def test_a_stopping_daemon_delivers_what_it_finished_to_a_slow_reader(tiny_bundle, tmp_path: Path) -> None:
    """SIGTERM lets requests in flight finish: their whole answer reaches a client that was not reading meanwhile
    (an editor busy for a moment), rather than being cut off with the daemon's buffers when it exits."""
    sock = tmp_path / "run" / "m31rd.sock"
    proc = await asyncio.to_thread(start_daemon, tiny_bundle.path, sock)
    try:
        async with await Client.connect(sock) as c:
            s = await c.generate(PROMPT, **LONG)
            await s.__anext__()
            proc.send_signal(signal.SIGTERM)
            # This loop reads nothing until the daemon has finished the request and stopped (or 1 s more has passed).
            t0 = time.monotonic()
            while not any('"stopped"' in line for line in proc.log_lines) and time.monotonic() - t0 < 1:
                time.sleep(0.02)
            text, done = await asyncio.wait_for(s.collect(), 5)
            assert done.usage.completion_tokens == 400 and len(s.tokens) == 400
        assert proc.wait(10) == 0
    finally:
        stop_daemon(proc)

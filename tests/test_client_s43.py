"""m31r_protocol's client against a consumer that stops reading, a daemon's error about the connection while it stays
open, and a connection attempt that the link abandons under a waiting caller.

A real daemon (conftest `shared_daemon`) where it can show the behaviour; test_client_audit's scripted peer where the
daemon would have to break the protocol on cue."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from test_client_audit import DONE, HANG_GUARD_S, LONG, PROMPT, Peer, client_name, read_loops, request_line, requests
from test_protocol import FakeDaemon, recv, welcome_then_status

from m31r_protocol import client as client_mod
from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError, DaemonUnavailable, StreamOverflow
from m31r_protocol.framing import pack
from m31r_protocol.reconnect import DaemonLink, Unavailable, link_config

SMALL_BUFFER = 4096  # a few dozen tokens: the tiny model's 400 pass it


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "peer.sock"


async def ended(stream: client_mod.Stream) -> None:
    """Until no more events are routed to `stream` (its last one came, or it was cancelled), without reading it."""
    async with asyncio.timeout(HANG_GUARD_S):
        while stream.open:
            await asyncio.sleep(0.01)


async def test_an_unread_stream_is_cancelled_past_its_buffer_while_others_flow(shared_daemon,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream nobody reads (nor cancels) holds at most STREAM_BUFFER_BYTES: past it the request is cancelled on the
    daemon and reading it raises StreamOverflow; a stream beside it on the same connection is served whole."""
    monkeypatch.setattr(client_mod, "STREAM_BUFFER_BYTES", SMALL_BUFFER)
    proc, sock = shared_daemon
    name = client_name()
    async with await Client.connect(sock, client=name) as c:
        unread = await c.generate(PROMPT, **LONG)
        # (its whole answer fits under SMALL_BUFFER: under load the read loop may queue all of it before it is read)
        beside = await c.generate("struct S {", max_tokens=20, lookahead=0)
        assert (await asyncio.wait_for(beside.collect(), HANG_GUARD_S))[1].usage.completion_tokens == 20
        await ended(unread)
        assert unread.queue.qsize() == 1 and unread.unread == 0  # its tokens dropped, only the error left
        with pytest.raises(StreamOverflow, match=f"over {SMALL_BUFFER} bytes") as e:
            await unread.__anext__()
        assert e.value.code == "cancelled"
        assert (line := await request_line(proc, name, unread.id)).get("code") == "cancelled", line
        assert (await c.status()).pid == proc.pid and not c._streams
    assert not read_loops()


async def test_an_unread_stream_stays_bounded_when_the_daemon_ignores_its_cancel(
        sock: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon that goes on streaming a cancelled request (ignoring max_tokens and the Cancel) costs nothing more:
    what it sends is dropped, and the other request on the connection gets every event."""
    monkeypatch.setattr(client_mod, "STREAM_BUFFER_BYTES", SMALL_BUFFER)
    got: list[msgspec.Struct] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        a, b = await requests(reader, 2)
        for i in range(2000):
            writer.write(pack(msgspec.msgpack.encode(m.Token(id=a.id, text="a" * 50, token=i))))
            if i % 100 == 0:
                writer.write(pack(msgspec.msgpack.encode(m.Token(id=b.id, text=".", token=i))))
        await send_all(writer, [m.Done(id=b.id, **DONE)])
        while (msg := await recv(reader)) is not None:
            got.append(msg)

    async with Peer(sock, script), await Client.connect(sock) as c:
        sa, sb = await c.generate("a"), await c.generate("b")
        assert (await asyncio.wait_for(sb.collect(), HANG_GUARD_S))[0] == "." * 20
        await ended(sa)
        assert sa.queue.qsize() == 1
        with pytest.raises(StreamOverflow):
            await sa.__anext__()
        while not got:
            await asyncio.sleep(0.01)
        assert got == [m.Cancel(id=sa.id)]


async def send_all(writer: asyncio.StreamWriter, msgs: list[msgspec.Struct]) -> None:
    for msg in msgs:
        writer.write(pack(msgspec.msgpack.encode(msg)))
    await writer.drain()


async def test_an_error_about_the_connection_ends_every_request_though_the_daemon_keeps_it_open(shared_daemon) -> None:
    """An Error with no id names no request: the daemon sends one, and keeps the connection open, for a message it
    cannot read the id of (here a second Hello). The request it was about cannot be told, and would have waited
    forever: every request on the connection ends with that error, and the connection is closed."""
    _, sock = shared_daemon
    async with await Client.connect(sock) as c:
        s = await c.generate(PROMPT, **LONG)
        c._writer.write(pack(msgspec.msgpack.encode(m.Hello(protocol=m.PROTOCOL_VERSION))))
        with pytest.raises(DaemonError, match="unexpected Hello") as e:
            async with asyncio.timeout(HANG_GUARD_S):
                async for _ in s:
                    pass
        assert e.value.code == "bad_request"
        await asyncio.wait_for(c.closed.wait(), HANG_GUARD_S)
        with pytest.raises(DaemonUnavailable, match="closed"):
            await c.status()
    assert not read_loops()


@pytest.mark.parametrize("abandon", ["reconfigure", "close"])
async def test_a_get_waiting_on_a_connect_that_the_link_abandons_is_unavailable(sock: Path, abandon: str,
                                                                                tmp_path: Path) -> None:
    """reconfigure() or close() while a request waits in get() for the handshake: that request hears Unavailable,
    not a CancelledError it would take for its own cancellation; a closed link connects no more."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never welcomes

    async with (peer := Peer(sock, script, welcome=False)):
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")
        waiting = asyncio.create_task(link.get(HANG_GUARD_S))
        await asyncio.wait_for(peer.hello.wait(), HANG_GUARD_S)
        if abandon == "reconfigure":
            await link.reconfigure(link_config(tmp_path / "other.sock", autostart=False))
        else:
            await link.close()
        with pytest.raises(Unavailable, match="closed or reconfigured"):
            await asyncio.wait_for(waiting, HANG_GUARD_S)
        if abandon == "close":
            with pytest.raises(Unavailable, match="closed"):
                await link.get(HANG_GUARD_S)
            assert len(peer.hellos) == 1
        await link.close()
    assert not read_loops()


async def test_a_get_right_after_reconfigure_connects_with_the_new_settings(sock: Path, tmp_path: Path) -> None:
    """reconfigure() while an attempt hangs in the handshake: the next get() connects to the new socket at once,
    rather than waiting on the cancelled attempt and being told the daemon is unavailable."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never welcomes

    other = tmp_path / "other.sock"
    async with (peer := Peer(sock, script, welcome=False)), FakeDaemon(other, welcome_then_status) as fake:
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")
        link.warm_up()
        await asyncio.wait_for(peer.hello.wait(), HANG_GUARD_S)
        await link.reconfigure(link_config(other, autostart=False))
        client = await link.get(HANG_GUARD_S)
        assert (await client.status()).pid == 4242 and len(fake.hellos) == 1
        await link.close()
    assert not read_loops()

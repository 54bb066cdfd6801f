"""m31r_protocol.reconnect, session 46: a connection lost under a request counts as the daemon's close.

The front ends (language server, HTTP adapter) hear of a lost connection from the request in flight and call
DaemonLink.lost before the link's own watcher wakes. Against a fake daemon on a real socket that dies under every
request (a crash, an OOM kill on the first inference), as test_reconnect.py fakes one that welcomes and goes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from test_protocol import WELCOME, FakeDaemon, recv, send

from m31r_protocol.client import DaemonUnavailable
from m31r_protocol.reconnect import UNAVAILABLE, DaemonLink, Unavailable, link_config


@contextlib.asynccontextmanager
async def linked(sock: Path, handler) -> AsyncIterator[tuple[FakeDaemon, DaemonLink]]:
    """A fake daemon on `sock` serving each connection with `handler`, and a DaemonLink to it (no autostart)."""
    async with FakeDaemon(sock, handler) as daemon:
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")
        try:
            yield daemon, link
        finally:
            await link.close()


async def welcome_then_die_under_a_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await send(writer, WELCOME)
    await recv(reader)  # the request: the connection ends (FakeDaemon closes it) without an answer


async def test_a_daemon_that_dies_under_every_request_is_backed_off(tmp_path: Path) -> None:
    """As the language server does: a completion whose stream ends DaemonUnavailable calls `lost`. The second brief
    connection in a row lost so is backed off like a failed attempt (with autostart, each attempt started a daemon:
    torch imported and the weights hashed for every keystroke); the first is not (a daemon restarted by hand)."""
    async with linked(tmp_path / "fake.sock", welcome_then_die_under_a_request) as (daemon, link):
        for _ in range(2):
            client = await link.get(5)
            stream = await client.fim("fn main() {")
            with pytest.raises(DaemonUnavailable, match="closed the connection") as lost:
                async with asyncio.timeout(5):
                    await stream.collect()
            assert client.closed.is_set()  # (it ended before the request heard, so `lost` can tell)
            link.lost(client, str(lost.value))
            assert link.state == UNAVAILABLE and not link.connected
        assert len(daemon.hellos) == 2
        with pytest.raises(Unavailable, match="closed the connection") as refused:
            await link.get(5)
        assert refused.value.retry_after == 1 and len(daemon.hellos) == 2  # no third connection was made


async def test_losing_a_connection_that_still_lives_is_not_counted_against_the_daemon(tmp_path: Path) -> None:
    """A front end may give up on a connection the daemon still serves: that is no sign of a failing daemon, so
    losing two in a row still lets the next request connect at once."""
    async def welcome_then_serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send(writer, WELCOME)
        while await recv(reader) is not None:
            pass

    async with linked(tmp_path / "fake.sock", welcome_then_serve) as (daemon, link):
        for _ in range(2):
            client = await link.get(5)
            assert not client.closed.is_set()
            link.lost(client)
        assert (await link.get(5)) is not client and len(daemon.hellos) == 3

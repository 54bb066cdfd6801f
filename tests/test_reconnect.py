"""m31r_protocol.reconnect: the one reconnecting daemon connection of the LSP server, the HTTP adapter and the CLI,
against a fake daemon on a real socket (test_lsp.py and test_http.py check it against a real one)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from test_protocol import FakeDaemon, welcome_then_status

from m31r_protocol.client import DaemonUnavailable
from m31r_protocol.reconnect import READY, STARTING, UNAVAILABLE, DaemonLink, Unavailable, link_config


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "fake.sock"


async def test_no_daemon_backs_off_and_says_why(sock: Path) -> None:
    states: list[tuple[str, str]] = []
    link = DaemonLink(link_config(sock, autostart=False), client_name="test", on_state=lambda *s: states.append(s))
    with pytest.raises(Unavailable) as first:
        await link.get(5)
    assert isinstance(first.value.__cause__, DaemonUnavailable) and "no daemon answers" in str(first.value)
    assert [s for s, _ in states] == [STARTING, UNAVAILABLE] and first.value.retry_after == 1
    with pytest.raises(Unavailable):  # within the back-off: no new attempt
        await link.get(5)
    assert len(states) == 2 and link.last_error.startswith("no daemon answers")
    await link.close()


async def test_connects_shares_one_client_and_reconnects_after_a_loss(sock: Path) -> None:
    connected = []
    async with FakeDaemon(sock, welcome_then_status) as daemon:
        link = DaemonLink(link_config(sock, autostart=False), client_name="test", on_connect=connected.append)
        link.warm_up()
        client = await link.get(5)
        assert await link.get(5) is client and link.state == READY and link.welcome.model == "fake"
        assert (await link.status()).pid == 4242
        link.lost(client)
        assert link.state == UNAVAILABLE and not link.connected
        again = await link.get(5)  # a loss is not a failed attempt: no back-off
        assert again is not client and len(connected) == 2 and link.connects == 2
        assert [h.client for h in daemon.hellos] == ["test", "test"]
        await link.close()


async def test_a_closed_connection_is_noticed(sock: Path) -> None:
    async def welcome_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from test_protocol import WELCOME, send

        await send(writer, WELCOME)

    async with FakeDaemon(sock, welcome_then_hang_up):
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")
        client = await link.get(5)
        await asyncio.wait_for(client.closed.wait(), 5)
        await asyncio.sleep(0)
        assert link.state == UNAVAILABLE and "closed the connection" in link.last_error
        await link.close()


async def test_a_daemon_that_welcomes_and_goes_again_and_again_is_backed_off(sock: Path) -> None:
    """A daemon whose model cannot load answers the handshake, then exits: the second such brief connection in a row
    waits out a back-off as a failed attempt does, growing, instead of starting a daemon (loading torch, hashing the
    weights) for every request; one brief loss alone is not backed off (a daemon restarted by hand)."""
    async def welcome_then_hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from test_protocol import WELCOME, send

        await send(writer, WELCOME)

    async with FakeDaemon(sock, welcome_then_hang_up) as daemon:
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")

        async def connect_and_lose() -> None:
            client = await link.get(5)
            await asyncio.wait_for(client.closed.wait(), 5)
            await asyncio.sleep(0)
            assert not link.connected

        await connect_and_lose()
        await connect_and_lose()  # the first brief loss is not backed off
        assert len(daemon.hellos) == 2
        with pytest.raises(Unavailable, match="closed the connection"):  # the second in a row is
            await link.get(5)
        first_wait = link._retry_at - time.monotonic()
        assert 0 < first_wait <= 0.25 and len(daemon.hellos) == 2
        await asyncio.sleep(first_wait + 0.05)
        await connect_and_lose()
        with pytest.raises(Unavailable):
            await link.get(5)
        assert 0.25 < link._retry_at - time.monotonic() <= 0.5 and len(daemon.hellos) == 3  # and it grows
        await link.close()


async def test_reconfigure_drops_the_connection(sock: Path, tmp_path: Path) -> None:
    async with FakeDaemon(sock, welcome_then_status):
        link = DaemonLink(link_config(sock, autostart=False), client_name="test")
        client = await link.get(5)
        await link.reconfigure(link_config(tmp_path / "other.sock", autostart=False))
        assert client.closed.is_set() and link.state is None
        with pytest.raises(Unavailable):
            await link.get(5)
        await link.close()


def test_link_config_from_front_end_options() -> None:
    c = link_config("s.sock", autostart=True, bundle="b", daemon_command=["m31r", "daemon"])
    assert c.daemon_args == ("--bundle", "b") and c.daemon_command == ("m31r", "daemon") and c.backoff_cap == 30
    assert link_config().daemon_args == () and link_config(autostart=False).backoff_cap == 2

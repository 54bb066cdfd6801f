"""The HTTP server's connection to m31rd: one shared connection (the protocol multiplexes requests by id),
made on first use, remade after the daemon restarts, with a short back-off between failed attempts.

With autostart, a missing daemon is started in the background (`connect_or_start`); requests wait for it
up to their own time budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path

from m31r_protocol import Client, DaemonError, DaemonUnavailable, connect_or_start
from m31r_protocol.messages import StatusReply, Welcome

log = logging.getLogger("m31r_http")


class Unavailable(DaemonUnavailable):
    """No daemon connection now; `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class Upstream:
    def __init__(self, socket: str | Path | None, *, autostart: bool = True, daemon_args: list[str] | None = None,
                 client_name: str = "m31r-http", start_timeout: float = 120.0,
                 on_connect: Callable[[Client], None] | None = None):
        self.socket, self.autostart, self.client_name = socket, autostart, client_name
        self.daemon_args = list(daemon_args or [])  # for an autostarted daemon: `--bundle DIR`
        self.start_timeout = start_timeout
        self.on_connect = on_connect or (lambda client: None)
        self.welcome: Welcome | None = None  # of the last connection made
        self._client: Client | None = None
        self._connecting: asyncio.Task[Client | None] | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._error = "not connected yet"
        self._closing: set[asyncio.Task] = set()

    @property
    def last_error(self) -> str:
        """Why the last connection attempt failed, or the last connection ended."""
        return self._error

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._client.closed.is_set()

    def warm_up(self) -> None:
        """Start connecting in the background, so the first request finds the daemon ready."""
        if not self.connected and (self._connecting is None or self._connecting.done()):
            self._connecting = asyncio.create_task(self._connect())

    async def get(self, wait: float) -> Client:
        """The connected client; Unavailable if none is ready within `wait` seconds."""
        if self.connected:
            assert self._client is not None
            return self._client
        if self._client is not None:
            self._drop(self._client, "the daemon closed the connection")
        if self._connecting is None or self._connecting.done():
            remaining = self._retry_at - time.monotonic()
            if remaining > 0:
                raise Unavailable(f"the daemon is unavailable: {self._error}", remaining)
            self._connecting = asyncio.create_task(self._connect())
        try:
            client = await asyncio.wait_for(asyncio.shield(self._connecting), max(wait, 0.001))
        except TimeoutError:
            raise Unavailable("the daemon is starting" if self.autostart else "the daemon does not answer yet",
                              1.0) from None
        if client is None:
            raise Unavailable(f"the daemon is unavailable: {self._error}", self._retry_at - time.monotonic())
        return client

    async def _connect(self) -> Client | None:
        try:
            client = await connect_or_start(self.socket, autostart=self.autostart, daemon_args=self.daemon_args,
                                            client=self.client_name, timeout=self.start_timeout,
                                            progress=lambda msg: log.info("%s", msg))
        except (DaemonUnavailable, DaemonError, OSError) as e:
            self._failures += 1
            cap = 30.0 if self.autostart else 2.0  # a failing autostart is expensive; a plain connect is not
            self._retry_at = time.monotonic() + min(cap, 0.25 * 2 ** min(self._failures - 1, 8))
            self._error = str(e)
            log.warning("daemon unavailable: %s", e)
            return None
        self._failures, self._retry_at = 0, 0.0
        self._client, self.welcome = client, client.welcome
        log.info("connected to the daemon", extra={"fields": {"model": client.welcome.model,
                                                              "fingerprint": client.welcome.fingerprint}})
        self.on_connect(client)
        return client

    def _drop(self, client: Client, reason: str) -> None:
        if self._client is client:
            self._client = None
            self._error = reason
            log.warning("%s", reason)
        task = asyncio.ensure_future(self._close(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def lost(self, client: Client) -> None:
        """A request found `client`'s connection broken: reconnect on the next request."""
        self._drop(client, "the connection to the daemon was lost")

    async def status(self, wait: float = 1.0, timeout: float = 2.0) -> StatusReply | None:
        """The daemon's Status, or None if it does not answer in time."""
        try:
            client = await self.get(wait)
            async with asyncio.timeout(timeout):
                return await client.status()
        except (DaemonUnavailable, DaemonError, TimeoutError, OSError):
            return None

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        client, self._client = self._client, None
        if client is not None:
            await self._close(client)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    @staticmethod
    async def _close(client: Client) -> None:
        with contextlib.suppress(Exception):
            await client.close()

"""The server's connection to m31rd: connect (or start it), notice when it dies, reconnect on demand.

Never blocks a completion for long: `get(wait)` returns a client, or None once `wait` seconds pass while a
connection (or a daemon start) is still under way, or at once while the last attempt's back-off runs. The
user is told once per outage (`window/showMessage`), and every state change goes out as `m31r/status`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from m31r_protocol import Client, DaemonError, DaemonUnavailable, connect_or_start

log = logging.getLogger("m31r_lsp.daemon")

STARTING, READY, UNAVAILABLE = "starting", "ready", "unavailable"


@dataclass(frozen=True)
class LinkConfig:
    socket: str | None = None
    autostart: bool = True
    bundle: str | None = None
    start_timeout: float = 120.0  # how long an autostarted daemon may take to answer

    def daemon_args(self) -> list[str]:
        return ["--bundle", self.bundle] if self.bundle else []


class DaemonLink:
    def __init__(self, config: LinkConfig, *, on_status: Callable[[dict], None] | None = None,
                 on_unavailable: Callable[[str], None] | None = None, client_name: str = "m31r-lsp"):
        self.config = config
        self.on_status = on_status or (lambda status: None)
        self.on_unavailable = on_unavailable or (lambda message: None)
        self.client_name = client_name
        self.state: str | None = None
        self.model: str | None = None
        self.last_latency_ms: float | None = None
        self.latency_ema_ms: float | None = None
        self._client: Client | None = None
        self._connecting: asyncio.Task[Client | None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._failures = 0
        self._retry_at = 0.0
        self._told = False  # the user was told about the current outage
        self._last_status_sent = 0.0
        self.connects = 0  # successful connections, for stats

    # -- state ------------------------------------------------------------------------------------------------

    def status(self) -> dict:
        return {"state": self.state or UNAVAILABLE, "model": self.model, "lastLatencyMs": self.last_latency_ms}

    def _set_state(self, state: str, reason: str = "") -> None:
        changed = state != self.state
        self.state = state
        if state == READY:
            self._told = False
        if changed:
            self._last_status_sent = time.monotonic()
            self.on_status(self.status())
        if state == UNAVAILABLE and not self._told:
            self._told = True
            self.on_unavailable(f"m31r: the completion daemon is unavailable ({reason}); completions are off "
                                "until it answers again.")

    def record_latency(self, ms: float) -> None:
        self.last_latency_ms = round(ms, 2)
        self.latency_ema_ms = ms if self.latency_ema_ms is None else 0.7 * self.latency_ema_ms + 0.3 * ms
        now = time.monotonic()
        if now - self._last_status_sent >= 1.0:  # latency updates at most once a second
            self._last_status_sent = now
            self.on_status(self.status())

    # -- connection -------------------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._client.closed.is_set()

    def warm_up(self) -> None:
        """Start connecting in the background (at `initialized`), so the first completion finds it ready."""
        if not self.connected and (self._connecting is None or self._connecting.done()):
            self._connecting = asyncio.create_task(self._connect())

    async def get(self, wait: float) -> Client | None:
        if self.connected:
            return self._client
        if self._client is not None:  # it died: forget it and reconnect
            self._drop("the connection to the daemon was lost")
        if self._connecting is None or self._connecting.done():
            if time.monotonic() < self._retry_at:
                return None
            self._connecting = asyncio.create_task(self._connect())
        try:
            return await asyncio.wait_for(asyncio.shield(self._connecting), wait)
        except TimeoutError:
            return None

    async def _connect(self) -> Client | None:
        cfg = self.config
        self._set_state(STARTING)
        try:
            client = await connect_or_start(cfg.socket, autostart=cfg.autostart, daemon_args=cfg.daemon_args(),
                                            client=self.client_name, timeout=cfg.start_timeout,
                                            progress=lambda msg: log.info("%s", msg))
        except (DaemonUnavailable, DaemonError, OSError) as e:
            self._failures += 1
            # Back off: a failed connect costs nothing, a failed autostart loads a model; cap accordingly.
            cap = 30.0 if cfg.autostart else 4.0
            self._retry_at = time.monotonic() + min(cap, 0.25 * 2 ** min(self._failures, 7))
            log.warning("daemon unavailable: %s", e)
            self._set_state(UNAVAILABLE, str(e))
            return None
        if self.config is not cfg:  # reconfigured meanwhile: this connection is for the old settings
            await client.close()
            return None
        self._failures, self._retry_at = 0, 0.0
        self._client = client
        self.model = client.welcome.model
        self.connects += 1
        self._watcher = asyncio.create_task(self._watch(client))
        self._set_state(READY)
        return client

    async def _watch(self, client: Client) -> None:
        await client.closed.wait()
        if self._client is client:
            self._drop("the daemon closed the connection")

    def _drop(self, reason: str) -> None:
        client, self._client = self._client, None
        if client is not None:
            asyncio.ensure_future(self._close(client))
        self._set_state(UNAVAILABLE, reason)

    def lost(self, reason: str = "the connection to the daemon was lost") -> None:
        """A request found the connection broken."""
        if self._client is not None:
            self._drop(reason)

    async def reconfigure(self, config: LinkConfig) -> None:
        if config == self.config:
            return
        self.config = config
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        client, self._client = self._client, None
        self._failures, self._retry_at, self._told = 0, 0.0, False
        if client is not None:
            await self._close(client)
        self.state = None

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._watcher is not None:
            self._watcher.cancel()
        client, self._client = self._client, None
        if client is not None:
            await self._close(client)

    @staticmethod
    async def _close(client: Client) -> None:
        with contextlib.suppress(Exception):
            await client.close()

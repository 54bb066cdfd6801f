"""The language server's side of the shared daemon connection (m31r_protocol.reconnect.DaemonLink): what the editor
is told about it.

Every state change goes out as `m31r/status` ({state, model, lastLatencyMs}); latency updates at most once a second.
The user is told once per outage (`window/showMessage`), and once per outdated daemon.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from m31r_protocol.capabilities import restart_hint
from m31r_protocol.client import Client
from m31r_protocol.reconnect import READY, UNAVAILABLE, DaemonLink, LinkConfig

log = logging.getLogger("m31r_lsp.daemon")


class EditorLink(DaemonLink):
    def __init__(self, config: LinkConfig, *, on_status: Callable[[dict], None] | None = None,
                 tell: Callable[[str], None] | None = None, client_name: str = "m31r-lsp"):
        super().__init__(config, client_name=client_name, log=log, on_state=self._state_changed,
                         on_connect=self._connected)
        self.on_status = on_status or (lambda status: None)
        self.tell = tell or (lambda message: None)  # window/showMessage
        self._told_outdated: set[str] = set()  # fingerprint/daemon_version of the outdated daemons told of
        self.last_latency_ms: float | None = None
        self.latency_ema_ms: float | None = None
        self._told = False  # the user was told about the current outage
        self._last_status_sent = 0.0

    @property
    def model(self) -> str | None:
        """The model served now: none while no daemon answers (the last Welcome is of a daemon that may be gone)."""
        return self.welcome.model if self.welcome is not None and self.state == READY else None

    def editor_status(self) -> dict:
        """The `m31r/status` notification's body."""
        return {"state": self.state or UNAVAILABLE, "model": self.model, "lastLatencyMs": self.last_latency_ms}

    def _state_changed(self, state: str, reason: str) -> None:
        if state == READY:
            self._told = False
        self._last_status_sent = time.monotonic()
        self.on_status(self.editor_status())
        if state == UNAVAILABLE and not self._told:
            self._told = True
            self.tell(f"m31r: the completion daemon is unavailable ({reason}); completions are off "
                                "until it answers again.")

    def _connected(self, client: Client) -> None:
        """An outdated daemon serves, without what it lacks. The user is told once per model and daemon version: only
        a restart brings it up to date, and this server will not impose one on the daemon's other clients."""
        key = f"{client.welcome.fingerprint}/{client.welcome.daemon_version}"
        if (missing := client.missing) and key not in self._told_outdated:
            self._told_outdated.add(key)
            self.tell(f"m31r: {restart_hint(missing)}.")

    def record_latency(self, ms: float) -> None:
        self.last_latency_ms = round(ms, 2)
        self.latency_ema_ms = ms if self.latency_ema_ms is None else 0.7 * self.latency_ema_ms + 0.3 * ms
        now = time.monotonic()
        if now - self._last_status_sent >= 1.0:
            self._last_status_sent = now
            self.on_status(self.editor_status())

    async def reconfigure(self, config: LinkConfig) -> None:
        if config != self.config:
            self._told = False
        await super().reconfigure(config)

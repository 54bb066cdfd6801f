"""The one reconnecting connection to the daemon that the front ends share (LSP server, HTTP adapter, CLI).

One connection serves every request (the protocol multiplexes them by id). It is made on first use (or at once,
`warm_up`), starting a daemon in the background when none answers and autostart is on (`connect_or_start`), and
remade after the daemon goes away. A failed attempt backs off before the next: 0.25 s, doubling, up to 30 s with
autostart (a failing autostart loads a model each time) and 2 s without (a failed connect costs nothing).

A connection the daemon closes within BRIEF_S of being made, twice in a row, counts as a failed attempt too: a
daemon whose model cannot load (a damaged bundle) answers the handshake and then exits, and without this every next
request would start another one, importing torch and hashing the weights again.

`get(wait)` never blocks a request for long: it gives the client, or raises Unavailable (with a retry-after hint)
once `wait` seconds pass while a connection or a daemon start is still under way, or at once while the back-off runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from m31r_protocol.capabilities import restart_hint
from m31r_protocol.client import Client, DaemonError, DaemonUnavailable, connect_or_start
from m31r_protocol.messages import StatusReply, Welcome

STARTING, READY, UNAVAILABLE = "starting", "ready", "unavailable"
BRIEF_S = 5.0  # a connection that ends sooner than this after it was made did not really serve
# A library's logger: silent unless the program configures it (the front ends pass their own).
logging.getLogger("m31r_protocol.link").addHandler(logging.NullHandler())


@dataclass(frozen=True)
class LinkConfig:
    socket: str | Path | None = None  # default: the default socket
    autostart: bool = True
    daemon_args: tuple[str, ...] = ()  # for an autostarted daemon: ("--bundle", DIR)
    daemon_command: tuple[str, ...] | None = None  # what starts one (default: client.DAEMON_COMMAND)
    start_timeout: float = 120.0  # how long an autostarted daemon may take to answer

    @property
    def backoff_cap(self) -> float:
        return 30.0 if self.autostart else 2.0


class Unavailable(DaemonUnavailable):
    """No daemon connection now; `retry_after` is a hint in whole seconds (at least 1)."""

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))


class DaemonLink:
    def __init__(self, config: LinkConfig, *, client_name: str, log: logging.Logger | None = None,
                 on_state: Callable[[str, str], None] | None = None,
                 on_connect: Callable[[Client], None] | None = None,
                 progress: Callable[[str], None] | None = None):
        """`on_state(state, reason)` hears every change of `state` (starting | ready | unavailable);
        `on_connect(client)` every connection made; `progress` (default: the log) the one line saying that a
        daemon is being started. Unavailable raised for a failed attempt has that attempt's error as __cause__."""
        self.config, self.client_name = config, client_name
        self.log = log or logging.getLogger("m31r_protocol.link")
        self.on_state = on_state or (lambda state, reason: None)
        self.on_connect = on_connect or (lambda client: None)
        self.progress = progress or (lambda msg: self.log.info("%s", msg))
        self.state: str | None = None
        self.welcome: Welcome | None = None  # of the last connection made
        self.connects = 0  # connections made
        self._client: Client | None = None
        self._connecting: asyncio.Task[Client | None] | None = None
        self._failures = 0
        self._brief = 0  # connections in a row that ended within BRIEF_S
        self._connected_at = 0.0
        self._retry_at = 0.0
        self._error = "not connected yet"
        self._failure: BaseException | None = None  # the last attempt's error
        self._closing: set[asyncio.Task] = set()
        self._watcher: asyncio.Task[None] | None = None
        self._closed = False  # close() was called: no connection is made any more

    @property
    def last_error(self) -> str:
        """Why the last connection attempt failed, or the last connection ended."""
        return self._error

    @property
    def connected(self) -> bool:
        return self._client is not None and not self._client.closed.is_set()

    def _set_state(self, state: str, reason: str = "") -> None:
        if state != self.state:
            self.state = state
            self.on_state(state, reason)

    def warm_up(self) -> None:
        """Start connecting in the background, so the first request finds the daemon ready."""
        if not self._closed and not self.connected and (self._connecting is None or self._connecting.done()):
            self._connecting = asyncio.create_task(self._connect())

    async def get(self, wait: float) -> Client:
        """The connected client; Unavailable if none is ready within `wait` seconds, or once the link is closed."""
        if self._closed:
            raise Unavailable("the daemon link is closed (DaemonLink.close)")
        if self.connected:
            assert self._client is not None
            return self._client
        if self._client is not None:
            self._drop(self._client, "the daemon closed the connection", by_daemon=True)
        if self._connecting is None or self._connecting.done():
            remaining = self._retry_at - time.monotonic()
            if remaining > 0:
                raise Unavailable(f"the daemon is unavailable: {self._error}", remaining) from self._failure
            self._connecting = asyncio.create_task(self._connect())
        connecting = self._connecting
        try:
            client = await asyncio.wait_for(asyncio.shield(connecting), max(wait, 0.001))
        except TimeoutError:
            raise Unavailable("the daemon is starting" if self.config.autostart else "the daemon does not answer yet",
                              1.0) from None
        except asyncio.CancelledError:
            # The attempt, not this caller, was cancelled (by reconfigure or close): the caller was cancelled by
            # no one, and must hear why there is no connection rather than take a CancelledError for its own.
            if not connecting.cancelled() or _cancelling():
                raise
            raise Unavailable("the daemon link was closed or reconfigured while connecting") from None
        if client is None:
            raise Unavailable(f"the daemon is unavailable: {self._error}",
                              self._retry_at - time.monotonic()) from self._failure
        return client

    async def _connect(self) -> Client | None:
        cfg = self.config
        self._set_state(STARTING)
        try:
            client = await connect_or_start(
                cfg.socket, autostart=cfg.autostart, daemon_args=list(cfg.daemon_args),
                daemon_command=list(cfg.daemon_command) if cfg.daemon_command else None, client=self.client_name,
                timeout=cfg.start_timeout, progress=self.progress)
        except (DaemonUnavailable, DaemonError, OSError) as e:
            self._failures += 1
            self._retry_at = time.monotonic() + self._backoff()
            self._error, self._failure = str(e), e
            self.log.warning("daemon unavailable: %s", e)
            self._set_state(UNAVAILABLE, str(e))
            return None
        if self.config is not cfg:  # reconfigured meanwhile: this connection is for the old settings
            await self._close(client)
            return None
        self._retry_at, self._failure = 0.0, None  # _failures is cleared by a connection that lasts (_drop)
        self._connected_at = time.monotonic()
        self._client, self.welcome = client, client.welcome
        self.connects += 1
        self.log.info("connected to the daemon", extra={"fields": {"model": client.welcome.model,
                                                                   "fingerprint": client.welcome.fingerprint}})
        if missing := client.missing:
            self.log.warning("%s", restart_hint(missing))
        self._watcher = asyncio.ensure_future(self._watch(client))
        self.on_connect(client)
        self._set_state(READY)
        return client

    def _backoff(self) -> float:
        """Seconds before the next attempt after the `_failures`-th failure in a row."""
        return min(self.config.backoff_cap, 0.25 * 2 ** min(self._failures - 1, 8))

    async def _watch(self, client: Client) -> None:
        await client.closed.wait()
        if self._client is client:
            self._drop(client, "the daemon closed the connection", by_daemon=True)

    def _drop(self, client: Client, reason: str, by_daemon: bool = False) -> None:
        """Forget `client`; `by_daemon`: the daemon closed it (a brief connection then counts, see the module doc)."""
        if self._client is client:
            self._client = None
            self._error = reason
            if by_daemon and time.monotonic() - self._connected_at < BRIEF_S:
                self._brief += 1
                if self._brief >= 2:  # a daemon that welcomes and goes, again: wait as after a failed attempt
                    self._failures += 1
                    self._retry_at = time.monotonic() + self._backoff()
            elif by_daemon:
                self._brief = self._failures = 0
            self.log.warning("%s", reason)
            self._set_state(UNAVAILABLE, reason)
        task = asyncio.ensure_future(self._close(client))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def lost(self, client: Client | None = None, reason: str = "the connection to the daemon was lost") -> None:
        """A request found the connection (`client`, default: the current one) broken: reconnect on the next. One that
        has ended counts as the daemon's close, as the watcher counts it: a request in flight hears of the loss first,
        and a daemon that died under every request (a crash, an OOM kill) was started again for every keystroke."""
        client = client or self._client
        if client is not None:
            self._drop(client, reason, by_daemon=client.closed.is_set())

    async def status(self, wait: float = 1.0, timeout: float = 2.0) -> StatusReply | None:
        """The daemon's Status, or None if it does not answer in time."""
        try:
            client = await self.get(wait)
            async with asyncio.timeout(timeout):
                return await client.status()
        except (DaemonUnavailable, DaemonError, TimeoutError, OSError):
            return None

    async def reconfigure(self, config: LinkConfig) -> None:
        """Use other settings from the next request on; the current connection, if any, is closed."""
        if config == self.config:
            return
        self.config = config
        await self._abandon()
        client, self._client = self._client, None
        self._failures, self._retry_at = 0, 0.0
        if client is not None:
            await self._close(client)
        self.state = None

    async def _abandon(self) -> None:
        """Cancel the connection attempt under way, if any, and wait for its end: a `get` that follows starts its own
        instead of waiting on the cancelled one, and the attempt's socket is closed."""
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
            await asyncio.gather(self._connecting, return_exceptions=True)

    async def close(self) -> None:
        """End the link: its connection, and any attempt under way, are closed, and `get` makes none any more."""
        self._closed = True
        await self._abandon()
        if self._watcher is not None:
            self._watcher.cancel()
        client, self._client = self._client, None
        if client is not None:
            await self._close(client)
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    @staticmethod
    async def _close(client: Client) -> None:
        with contextlib.suppress(Exception):
            await client.close()


def _cancelling() -> bool:
    """Whether the running task itself is being cancelled."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def link_config(socket: str | Path | None = None, *, autostart: bool = True, bundle: str | Path | None = None,
                daemon_command: Sequence[str] | None = None, start_timeout: float = 120.0) -> LinkConfig:
    """A LinkConfig from the front ends' options (`--socket`, `--no-autostart`, `--bundle`). A leading `~` in `socket`
    or `bundle` is the home folder: a caller that got the path from an editor's settings, or from a command line run
    without a shell, may pass it unexpanded."""
    socket = _expand_user(socket)
    bundle = _expand_user(bundle)
    return LinkConfig(socket, autostart, ("--bundle", str(bundle)) if bundle else (),
                      tuple(daemon_command) if daemon_command else None, start_timeout)


def _expand_user(path: str | Path | None) -> str | Path | None:
    """`path` with a leading `~` expanded, of the type it came as."""
    if path is None or not str(path).startswith("~"):
        return path
    return Path(path).expanduser() if isinstance(path, Path) else os.path.expanduser(path)

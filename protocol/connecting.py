"""Connecting to the daemon's Unix socket, including while its queue of connections waiting to be accepted is full.

Linux answers a connect to a full queue with EAGAIN and leaves the socket unconnected. asyncio takes that for a
connect in progress and hands back a socket connected to nothing (its peer reads as uid -1, so the client called the
daemon another user's), and a blocking socket with a timeout raises it at once. A queue fills when the daemon accepts
nothing for a while (stopped with Ctrl-Z, its event loop stuck) while clients keep trying: both clients retry until
their deadline, and then say that. Standard library only (the blocking `m31r status` client imports this).
"""

from __future__ import annotations

import errno
import os
import socket
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: `m31r status`'s blocking fast path does without asyncio's import time)
    import asyncio

FIRST_RETRY_S = 0.005
LAST_RETRY_S = 0.2  # the queue drains as soon as the daemon accepts again: retries stay frequent


class QueueFull(ConnectionError):
    """The daemon's queue of connections waiting to be accepted stayed full until the deadline."""

    def __init__(self, path: object, waited: float):
        super().__init__(errno.EAGAIN, f"the daemon on {path} accepts no new connections: its queue of connections "
                                       f"waiting to be accepted stayed full for {waited:.1f} s (is the daemon stopped, "
                                       "with Ctrl-Z or SIGSTOP, or flooded with connections?)")

    def __str__(self) -> str:
        return self.strerror or ""


def _connected(sock: socket.socket, path: str) -> bool:
    """Connect the non-blocking `sock` to `path`: False while the queue is full (the socket is left unconnected, to be
    tried again)."""
    try:
        sock.connect(path)
    except BlockingIOError:
        return False
    return True


def _waits(path: str, deadline: float) -> Iterator[float]:
    """The pauses between connects to a full queue until `deadline` (time.monotonic()); QueueFull once it passed."""
    t0, delay = time.monotonic(), FIRST_RETRY_S
    while (left := deadline - time.monotonic()) > 0:
        yield min(delay, left)
        delay = min(delay * 2, LAST_RETRY_S)
    raise QueueFull(path, time.monotonic() - t0)


async def open_unix(path: str | os.PathLike, deadline: float) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """asyncio.open_unix_connection, retrying a full queue until `deadline` (time.monotonic()); QueueFull after."""
    import asyncio

    path = os.fspath(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.setblocking(False)
        waits = _waits(path, deadline)
        while not _connected(sock, path):
            await asyncio.sleep(next(waits))
        return await asyncio.open_unix_connection(sock=sock)
    except BaseException:
        sock.close()
        raise


def connect_blocking(sock: socket.socket, path: str | os.PathLike, deadline: float) -> None:
    """Connect the blocking `sock`, retrying a full queue until `deadline` (time.monotonic()); QueueFull after. The
    socket keeps its own timeout for what follows."""
    path, timeout = os.fspath(path), sock.gettimeout()
    sock.setblocking(False)
    try:
        waits = _waits(path, deadline)
        while not _connected(sock, path):
            time.sleep(next(waits))
    finally:
        sock.settimeout(timeout)

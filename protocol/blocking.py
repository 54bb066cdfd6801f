"""One request, one reply, over a blocking socket: for CLI commands that must answer at once (`m31r status`).

No asyncio, no click, no msgspec (minipack instead): with the interpreter's own start-up this is the whole cost of
`m31r status`. Anything unexpected raises, and the caller falls back to the full async client, which explains the
failure.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from m31r_protocol.connecting import connect_blocking
from m31r_protocol.framing import HEADER, pack
from m31r_protocol.limits import MAX_FRAME_BYTES, PROTOCOL_VERSION
from m31r_protocol.minipack import packb, unpackb
from m31r_protocol.paths import socket_path_problem
from m31r_protocol.peer import check_daemon_owner


def _left(sock: socket.socket, deadline: float) -> None:
    """Give the socket's next call what is left of the deadline: a peer that trickles bytes must not stretch a
    per-call timeout into minutes."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the daemon did not answer in time")
    sock.settimeout(left)


def _read(sock: socket.socket, deadline: float) -> dict[str, Any]:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            _left(sock, deadline)
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    (size,) = HEADER.unpack(exactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes exceeds the limit")
    msg = unpackb(exactly(size))
    if not isinstance(msg, dict):
        raise ValueError(f"expected a message, got {type(msg).__name__}")
    return msg


def status(path: str | os.PathLike, timeout: float = 2.0) -> dict[str, Any]:
    """The daemon's StatusReply as a dict (with its `type` and `id`), or an exception (OSError, ConnectionError,
    ValueError) for any other outcome."""
    return welcome_and_status(path, timeout)[1]


def welcome_and_status(path: str | os.PathLike, timeout: float = 2.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """The daemon's Welcome and StatusReply as dicts, as `status` gets them, within `timeout` seconds in all."""
    if why := socket_path_problem(path):
        raise ValueError(why)
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        connect_blocking(sock, path, deadline)  # (a daemon's full queue of connections: QueueFull at the deadline)
        check_daemon_owner(sock, path)  # a daemon of another user is refused (ForeignPeer, an OSError)
        _left(sock, deadline)
        sock.sendall(pack(packb({"type": "hello", "protocol": PROTOCOL_VERSION, "client": "m31r-status"})))
        welcome = _read(sock, deadline)
        if welcome.get("type") != "welcome" or welcome.get("protocol") != PROTOCOL_VERSION:
            raise ValueError(f"unexpected handshake reply {welcome.get('type')!r}")
        _left(sock, deadline)
        sock.sendall(pack(packb({"type": "status", "id": 1})))
        reply = _read(sock, deadline)
        if reply.get("type") != "status_reply" or reply.get("id") != 1:
            raise ValueError(f"unexpected reply {reply.get('type')!r}")
        return welcome, reply


def status_json(fields: dict[str, Any]) -> str:
    """A StatusReply's fields as `m31r status` prints them (its fast path and the full CLI alike)."""
    import json

    return json.dumps({k: v for k, v in fields.items() if k not in ("type", "id")}, indent=2)

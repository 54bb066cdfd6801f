"""One request, one reply, over a blocking socket: for CLI commands that must answer at once (`m31r status`).

No asyncio, no click: with the interpreter's own start-up this is the whole cost of `m31r status`. Anything
unexpected raises, and the caller falls back to the full async client, which explains the failure.
"""

from __future__ import annotations

import socket
from pathlib import Path

from m31r_protocol.framing import HEADER, pack
from m31r_protocol.messages import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Hello,
    Status,
    StatusReply,
    Welcome,
    encoder,
    server_decoder,
)


def _read(sock: socket.socket) -> bytes:
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionError("the daemon closed the connection")
            buf += chunk
        return bytes(buf)

    (size,) = HEADER.unpack(exactly(HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ConnectionError(f"frame of {size} bytes exceeds the limit")
    return exactly(size)


def status(path: str | Path, timeout: float = 2.0) -> StatusReply:
    """The daemon's Status, or an exception (OSError, ConnectionError, ValueError) for any other outcome."""
    enc, dec = encoder(), server_decoder()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(pack(enc.encode(Hello(protocol=PROTOCOL_VERSION, client="m31r-status"))))
        welcome = dec.decode(_read(sock))
        if not isinstance(welcome, Welcome) or welcome.protocol != PROTOCOL_VERSION:
            raise ValueError(f"unexpected handshake reply {type(welcome).__name__}")
        sock.sendall(pack(enc.encode(Status(id=1))))
        reply = dec.decode(_read(sock))
        if not isinstance(reply, StatusReply):
            raise ValueError(f"unexpected reply {type(reply).__name__}")
        return reply

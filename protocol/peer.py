"""Who is at the other end of a Unix socket: the daemon checks its clients, and clients check the daemon.

Standard library only (the blocking `m31r status` client imports this).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import sys


class ForeignPeer(PermissionError):
    """The process on the other end of the socket runs as another user."""


# struct ucred: pid_t, then uid_t and gid_t, unsigned (a uid past 2**31, as directory services hand out, read signed
# never matched os.getuid())
_UCRED = struct.Struct("iII")


def peer_pid(sock: socket.socket) -> int | None:
    """The peer process's pid, where the platform can tell (SO_PEERCRED: Linux); None where it cannot."""
    if hasattr(socket, "SO_PEERCRED"):
        return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[0]
    return None


def peer_uid(sock: socket.socket) -> int | None:
    """The peer process's uid, where the platform can tell (SO_PEERCRED on Linux, LOCAL_PEERCRED on macOS and the
    BSDs); None where it cannot."""
    if hasattr(socket, "SO_PEERCRED"):
        return _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))[1]
    if sys.platform == "darwin" or "bsd" in sys.platform:
        with contextlib.suppress(OSError):
            LOCAL_PEERCRED = 0x001  # noqa: N806 - the constant's name in <sys/un.h>
            raw = sock.getsockopt(0, LOCAL_PEERCRED, struct.calcsize("IIh16I"))  # struct xucred, level SOL_LOCAL
            return struct.unpack_from("IIh", raw)[1]
    return None


def check_daemon_owner(sock: socket.socket, path: object) -> None:
    """Refuse a daemon that runs as another user: anyone who got to the socket path first (a squatted /tmp
    folder) would otherwise read every prompt and answer with whatever it likes. Raises ForeignPeer."""
    uid = peer_uid(sock)
    if uid is not None and uid != os.getuid():
        raise ForeignPeer(f"the process serving {path} runs as uid {uid}, not as you (uid {os.getuid()}); refusing "
                          f"to talk to it. Check who owns that socket and its folder")

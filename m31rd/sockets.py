"""The daemon's listening socket: safe creation, stale-socket recovery, peer checks, systemd integration."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import sys
from pathlib import Path

SD_LISTEN_FDS_START = 3


class SocketInUse(RuntimeError):
    """Another daemon is live on the socket."""


def _is_live(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # something answers in a way we do not understand: do not steal its path
    finally:
        s.close()


def bind_unix(path: Path) -> socket.socket:
    """A listening socket at `path`, created 0600; a stale socket file is replaced, a live one is refused.

    A parent folder that does not exist yet is created 0700 (the default one, $XDG_RUNTIME_DIR/m31r, is). A folder
    that exists is left as it is: it may be shared (/tmp, a home or project folder), and the 0600 socket plus the
    peer-uid check already keep other users out."""
    try:
        path.parent.mkdir(parents=True, mode=0o700)
        os.chmod(path.parent, 0o700)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
        if _is_live(path):
            raise SocketInUse(f"another m31rd is already serving on {path} (stop it with `m31r stop`)")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def activated_socket() -> socket.socket | None:
    """The socket systemd passed us (LISTEN_FDS/LISTEN_PID), if this process was socket-activated."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    n = int(os.environ.get("LISTEN_FDS", "0"))
    if n < 1:
        return None
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # children must not think the socket is theirs
    sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    sock.setblocking(False)
    return sock


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())


def peer_uid(sock: socket.socket) -> int | None:
    """The connecting process's uid, where the platform can tell (SO_PEERCRED, LOCAL_PEERCRED)."""
    if hasattr(socket, "SO_PEERCRED"):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return struct.unpack("3i", creds)[1]
    if sys.platform == "darwin":
        with contextlib.suppress(OSError):
            LOCAL_PEERCRED = 0x001  # noqa: N806 - the constant's name in <sys/un.h>
            raw = sock.getsockopt(0, LOCAL_PEERCRED, struct.calcsize("IIh16I"))
            return struct.unpack_from("IIh", raw)[1]
    return None

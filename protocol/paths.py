"""Where the daemon's socket and log live by default, per user."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

# A Unix socket's path must fit sockaddr_un.sun_path, its closing NUL included: 108 bytes on Linux, 104 on macOS and
# the BSDs. A longer one fails deep in bind or connect ("AF_UNIX path too long"), which names neither the path nor
# the way out; socket_path_problem does both.
MAX_SOCKET_PATH_BYTES = 107 if sys.platform.startswith("linux") else 103


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/m31r, else a per-user folder in the temp dir (macOS, minimal containers). A runtime dir that
    is not this user's (`su` keeps the first user's) is not used: the daemon could not make its folder there, and
    every client and daemon of one user, deciding alike, still agree on the path."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and _own_folder(base):
        return Path(base) / "m31r"
    import tempfile  # ~8 ms to import: only where there is no runtime dir (`m31r status` counts milliseconds)

    return Path(tempfile.gettempdir()) / f"m31r-{os.getuid()}"


def _own_folder(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


def default_socket_path() -> Path:
    """$M31R_SOCKET (a leading `~` expanded, as for --socket: quoted in a shell profile it reaches us unexpanded, and
    was a `./~/` folder in whatever folder a client ran in), else the runtime folder's m31rd.sock."""
    env = os.environ.get("M31R_SOCKET")
    return Path(os.path.expanduser(env)) if env else runtime_dir() / "m31rd.sock"


def socket_path_problem(path: str | Path) -> str | None:
    """Why `path` cannot be a Unix socket's path here, or None when it can: too long for one, or a folder (`--socket
    /tmp`), which the daemon would judge as the socket's folder's folder (the mode of `/`) and clients as a socket
    that nothing listens on."""
    n = len(os.fsencode(path))
    if n > MAX_SOCKET_PATH_BYTES:
        return (f"the socket path {path} is {n} bytes long, and a Unix socket's path holds at most "
                f"{MAX_SOCKET_PATH_BYTES} bytes here: choose a shorter one (--socket, or M31R_SOCKET)")
    if os.path.isdir(path):
        return (f"{path} is a folder, not a socket path: name the socket in it, such as "
                f"{Path(path) / 'm31r' / 'm31rd.sock'} (--socket, or M31R_SOCKET)")
    return None


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "m31r"

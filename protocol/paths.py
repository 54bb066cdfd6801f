"""Where the daemon's socket and log live by default, per user."""

from __future__ import annotations

import os
from pathlib import Path


def runtime_dir() -> Path:
    """$XDG_RUNTIME_DIR/m31r, else a per-user folder in the temp dir (macOS, minimal containers)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return Path(base) / "m31r"
    import tempfile  # ~8 ms to import: only where there is no runtime dir (`m31r status` counts milliseconds)

    return Path(tempfile.gettempdir()) / f"m31r-{os.getuid()}"


def default_socket_path() -> Path:
    return Path(os.environ.get("M31R_SOCKET") or runtime_dir() / "m31rd.sock")


def state_dir() -> Path:
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "m31r"

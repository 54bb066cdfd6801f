"""Run a real m31rd in a subprocess on a real socket, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

DAEMON = [sys.executable, "-m", "m31r.cli", "daemon"]


def start_daemon(bundle: str | Path, socket: str | Path, *extra: str, timeout: float = 60.0,
                 env: dict | None = None) -> subprocess.Popen:
    """Start `m31r daemon` and return once it answers on `socket` (stderr is kept for assertions)."""
    socket = Path(socket)
    cmd = [*DAEMON, "--bundle", str(bundle), "--socket", str(socket), "--threads", "1", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
        if socket.exists():
            import socket as so

            s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
            try:
                s.connect(str(socket))
                return proc
            except OSError:
                pass
            finally:
                s.close()
        time.sleep(0.05)
    stop_daemon(proc)
    raise TimeoutError(f"daemon not ready after {timeout}s")


def stop_daemon(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode

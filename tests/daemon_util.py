"""Run a real m31rd in a subprocess on a real socket, for tests and benchmarks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from m31r_protocol.blocking import status

DAEMON = [sys.executable, "-m", "m31r.cli", "daemon"]


def start_daemon(bundle: str | Path, socket: str | Path, *extra: str, timeout: float = 60.0,
                 env: dict | None = None) -> subprocess.Popen:
    """Start `m31r daemon` and return once it has warmed up (it answers Status during warm-up, saying so); its stderr
    lines collect in `proc.log_lines`."""
    socket = Path(socket)
    cmd = [*DAEMON, "--bundle", str(bundle), "--socket", str(socket), "--threads", "1", "--dtype", "float32",
           "--quant", "none", *extra]  # the fp32 engine the tests compare with; later flags win
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    # The daemon logs a JSON line per request: drain stderr so the pipe never fills and stalls it.
    proc.log_lines = []  # type: ignore[attr-defined]

    def pump() -> None:
        with proc.stderr:  # type: ignore[union-attr]  # closed at the daemon's end: no ResourceWarning for the pipe
            for line in proc.stderr:  # type: ignore[union-attr]
                proc.log_lines.append(line)  # type: ignore[attr-defined]

    drainer = threading.Thread(target=pump, daemon=True)
    drainer.start()
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            drainer.join(5)
            raise RuntimeError(f"daemon exited with {proc.returncode}: {''.join(proc.log_lines)[-2000:]}")
        if socket.exists():
            try:
                if not status(socket, timeout=timeout)["warming"]:
                    return proc
            except (OSError, ValueError):  # not listening yet (the probe for a live daemon), or gone
                pass
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

"""What the soak's jobs share: a daemon subprocess on a real socket, the tiny bundle, figures, percentiles."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for extra in (REPO / "tests", REPO / "benchmarks"):  # tests/protocol_fuzz.py, the fuzzer shared with the tests
    if str(extra) not in sys.path:
        sys.path.insert(0, str(extra))

from bench_daemon import pct  # noqa: E402,F401  (the soak jobs take it from here, with the rest of what they share)

from m31r_protocol import blocking  # noqa: E402

# The soak runs on the tiny test shape, with what the tests pass (one thread, fp32): figures about reliability,
# not speed, bounded in time on a 2-core machine.
DAEMON_ARGS = ["--threads", "1", "--dtype", "float32", "--quant", "none"]


@dataclass
class Figure:
    name: str
    value: str
    target: str = ""
    ok: bool | None = None  # None: reported, not judged

    def row(self) -> dict:
        return {"figure": self.name, "value": self.value, "target": self.target, "ok": self.ok}


@dataclass
class JobResult:
    figures: list[Figure] = field(default_factory=list)
    details: dict = field(default_factory=dict)


def m31r_cmd() -> list[str]:
    return [sys.executable, "-m", "m31r.cli"]


def make_tiny_bundle(out: Path) -> Path:
    """configs/model/tiny.yaml with random weights (seed 0), fp32: the tests' bundle."""
    subprocess.run([*m31r_cmd(), "bundle", "init", str(REPO / "configs" / "model" / "tiny.yaml"), str(out),
                    "--seed", "0", "--dtype", "float32"], check=True, stdout=subprocess.DEVNULL)
    return out


class Daemon:
    """`m31r daemon` in a subprocess, its stderr (one JSON line per request) in a file; ready once it has warmed up.
    It answers on its socket before, while it loads the model (requests wait meanwhile, and the loading holds its
    interpreter for up to a second at a time): that is its start, which no job means to measure as behaviour under
    load (the first burst of the concurrent clients got its `busy` answers after ~0.9 s)."""

    def __init__(self, bundle: Path, sock: Path, log: Path, *args: str, timeout: float = 120.0):
        self.bundle, self.sock, self.log, self.args = bundle, sock, log, args
        cmd = [*m31r_cmd(), "daemon", "--bundle", str(bundle), "--socket", str(sock), *DAEMON_ARGS, *args]
        t0 = time.monotonic()
        with log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
        try:
            while not warm(sock):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
                if time.monotonic() - t0 > timeout:
                    raise TimeoutError(f"daemon not ready after {timeout:g} s")
                time.sleep(0.02)
        except BaseException:  # not ready, or Ctrl-C while it loads: no job holds it yet, so stop it here
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        import psutil

        return psutil.Process(self.pid).memory_info().rss / 2**20

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def lines(self) -> list[dict]:
        """The log's JSON lines (a line that is not JSON, such as a traceback, comes back as {"raw": line})."""
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                out.append({"raw": line, "level": "raw"})
        return out


def warm(sock: Path) -> bool:
    """A daemon answers on `sock` and has loaded and warmed up its model."""
    try:
        return not blocking.status(sock).get("warming", False)
    except (OSError, ValueError):  # no socket yet, not answering yet, or gone again
        return False


def log_errors(lines: list[dict]) -> list[dict]:
    """Log lines a healthy daemon never writes: errors, exceptions, anything that is not a JSON line."""
    return [x for x in lines if x.get("level") not in ("info", "debug") or "exc" in x]


def fmt(x: float | None, digits: int = 1) -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}"


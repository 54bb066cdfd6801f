"""A daemon told to stop closes its socket at once but holds the socket's lock until its process ends (a second or
more with a real model): one started meanwhile (`kill PID; m31r daemon`, a restart, a client's autostart after a stop)
was refused at once as "another m31rd is already starting or serving", told to `m31r stop` a daemon that no longer
answered. Now it waits (a bounded time) for a holder that does not answer, and still refuses one that does.

The daemon that is exiting is a real one, stopped with SIGTERM and frozen with SIGSTOP once its socket no longer
answers: its exit, some 30 ms for the tiny model, becomes as long as the test needs. Nothing is mocked."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from daemon_util import DAEMON, start_daemon, stop_daemon

from m31r_protocol.blocking import status

WAITING = "waiting for the m31rd that holds the socket's lock"


@pytest.fixture
def sock() -> Iterator[Path]:
    """A socket path in a fresh 0700 folder (short: a socket path has a length limit); removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="m31r-claim-"))
    yield folder / "m31rd.sock"
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def daemons() -> Iterator[list[subprocess.Popen]]:
    """The daemons a test started: each still running at the end is continued (if frozen) and stopped."""
    procs: list[subprocess.Popen] = []
    yield procs
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            stop_daemon(proc)


def _state(pid: int) -> str:
    """The process's state letter (T: stopped, Z: exited but not reaped), "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return ""


def _answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def _exiting(bundle: Path, sock: Path, daemons: list[subprocess.Popen]) -> subprocess.Popen:
    """A real daemon on `sock`, told to stop (SIGTERM) and frozen (SIGSTOP) after its socket stopped answering and
    before its process ended: it holds the socket's lock, as a daemon still exiting does. Its exit is short, so the
    freeze may come too late: then another is tried."""
    for _ in range(5):
        proc = start_daemon(bundle, sock)
        daemons.append(proc)
        proc.send_signal(signal.SIGTERM)
        while proc.poll() is None and _answers(sock):
            pass
        if proc.poll() is None:
            proc.send_signal(signal.SIGSTOP)
        while _state(proc.pid) not in ("T", "Z", ""):  # the signal is delivered, not at once
            pass
        if _state(proc.pid) == "T":
            assert not _answers(sock)
            return proc
        proc.wait()
    pytest.fail("the daemon always ended before it could be frozen")


def _spawn(bundle: Path, sock: Path, daemons: list[subprocess.Popen]) -> subprocess.Popen:
    """`m31r daemon` on `sock` (start_daemon's options), not waited for; its stderr lines collect in `log_lines`."""
    proc = subprocess.Popen([*DAEMON, "--bundle", str(bundle), "--socket", str(sock), "--threads", "1", "--dtype",
                             "float32", "--quant", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    daemons.append(proc)
    proc.log_lines = []  # type: ignore[attr-defined]

    def pump() -> None:
        with proc.stderr:  # type: ignore[union-attr]
            for line in proc.stderr:  # type: ignore[union-attr]
                proc.log_lines.append(line)  # type: ignore[attr-defined]

    proc.pump = threading.Thread(target=pump, daemon=True)  # type: ignore[attr-defined]
    proc.pump.start()  # type: ignore[attr-defined]
    return proc


def _until(proc: subprocess.Popen, said: Callable[[str], bool]) -> bool:
    """Whether `proc` logs a line `said` accepts before it exits."""
    while proc.poll() is None:
        if any(said(line) for line in list(proc.log_lines)):  # type: ignore[attr-defined]
            return True
        threading.Event().wait(0.02)
    proc.pump.join(10)  # type: ignore[attr-defined]
    return any(said(line) for line in proc.log_lines)  # type: ignore[attr-defined]


def test_a_daemon_started_while_the_stopped_one_exits_waits_for_it_and_comes_up(tiny_bundle, sock: Path,
                                                                                 daemons: list[subprocess.Popen]):
    """`kill PID; m31r daemon`: the new daemon waits while the old one, no longer answering, holds the lock, and
    serves once it has ended; it was refused with advice to stop a daemon that was already stopping."""
    old = _exiting(tiny_bundle.path, sock, daemons)
    new = _spawn(tiny_bundle.path, sock, daemons)
    assert _until(new, lambda line: WAITING in line), "".join(new.log_lines)  # type: ignore[attr-defined]
    assert f'"holder_pid": {old.pid}' in "".join(new.log_lines)  # type: ignore[attr-defined]
    assert new.poll() is None
    old.send_signal(signal.SIGCONT)  # the old one's exit goes on, and ends
    assert old.wait(30) == 0
    assert _until(new, lambda line: '"ready"' in line), "".join(new.log_lines)  # type: ignore[attr-defined]
    assert status(sock, timeout=30)["pid"] == new.pid
    assert (sock.parent / "m31rd.sock.lock").read_text() == f"{new.pid}\n"  # the holder's pid, for the messages
    assert stop_daemon(new) == 0


def test_the_wait_for_an_exiting_daemon_is_bounded_and_names_it(tiny_bundle, sock: Path,
                                                                daemons: list[subprocess.Popen]):
    """A holder that neither answers nor ends within the wait is refused with what it is (still exiting) and its pid,
    not with advice to stop it. The wait is cut short here (CLAIM_WAIT_S) so as not to spend its full length."""
    old = _exiting(tiny_bundle.path, sock, daemons)
    made = sock.stat().st_ctime_ns if sock.exists() else None
    code = ("import sys; from pathlib import Path; from m31rd import sockets\nsockets.CLAIM_WAIT_S = 0.3\n"
            "try:\n    sockets.bind_unix(Path(sys.argv[1]))\nexcept sockets.SocketInUse as e:\n    sys.exit(str(e))\n")
    r = subprocess.run([sys.executable, "-c", code, str(sock)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1, r.stderr
    assert f"another m31rd (pid {old.pid}) holds {sock}.lock but has not answered on {sock}" in r.stderr, r.stderr
    assert "still exiting" in r.stderr and f"once pid {old.pid} has ended" in r.stderr, r.stderr
    assert "m31r stop" not in r.stderr  # stopping it again would do nothing: no daemon answers
    assert (sock.stat().st_ctime_ns if sock.exists() else None) == made  # its socket file, if left, untouched
    old.send_signal(signal.SIGCONT)
    assert old.wait(30) == 0


def test_a_daemon_beside_an_answering_one_is_refused_without_waiting(tiny_bundle, sock: Path,
                                                                     daemons: list[subprocess.Popen]):
    """A daemon that answers on the socket is no exiting one: a second daemon on its path is refused at once, as
    before, and the first serves on."""
    first = start_daemon(tiny_bundle.path, sock)
    daemons.append(first)
    second = _spawn(tiny_bundle.path, sock, daemons)
    assert second.wait(60) == 1
    second.pump.join(10)  # type: ignore[attr-defined]
    said = "".join(second.log_lines)  # type: ignore[attr-defined]
    assert f"another m31rd is already starting or serving on {sock} (stop it with `m31r stop --socket" in said, said
    assert WAITING not in said
    assert status(sock)["pid"] == first.pid
    assert (sock.parent / "m31rd.sock.lock").read_text() == f"{first.pid}\n"
    assert stop_daemon(first) == 0

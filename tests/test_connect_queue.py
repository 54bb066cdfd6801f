"""A daemon that accepts nothing for a while (stopped with Ctrl-Z, its event loop stuck) while clients keep trying
fills its socket's queue of connections waiting to be accepted. Linux then answers a connect with EAGAIN and leaves
the socket unconnected. asyncio handed that socket back as connected: its peer read as uid -1, so every client
called the daemon another user's ("forbidden: ... runs as uid -1"), and `m31r doctor` said something not m31r
answered. Clients now retry until their deadline, connect as soon as the daemon accepts again, and otherwise say the
queue is full, starting no second daemon. A real daemon, stopped with SIGSTOP, its queue filled by real connects."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon
from test_doctor import run_doctor

from m31r_protocol.client import Client

M31R = [sys.executable, "-m", "m31r.cli"]
FULL = "accepts no new connections: its queue of connections waiting to be accepted stayed full for"


@contextlib.contextmanager
def daemon_stopped_and_full(bundle: Path, folder: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A real daemon stopped with SIGSTOP, its queue filled with connections that wait to be accepted."""
    folder.mkdir(mode=0o700)
    sock = folder / "m31rd.sock"
    proc = start_daemon(bundle, sock)
    held: list[socket.socket] = []
    try:
        proc.send_signal(signal.SIGSTOP)
        while len(held) < 100_000:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.setblocking(False)
            try:
                conn.connect(str(sock))
            except BlockingIOError:
                conn.close()
                break
            held.append(conn)
        assert 0 < len(held) < 100_000, "the queue never filled: this platform does not answer EAGAIN"
        yield proc, sock
    finally:
        proc.send_signal(signal.SIGCONT)
        for conn in held:
            conn.close()
        stop_daemon(proc)


@pytest.fixture(scope="module")
def stopped_and_full(tiny_bundle, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[subprocess.Popen, Path]]:
    """One such daemon for the tests that only knock on it (each checks it is still stopped, never started again):
    a daemon's start costs a torch import and a model load."""
    with daemon_stopped_and_full(tiny_bundle.path, tmp_path_factory.mktemp("full") / "run") as held:
        yield held


@pytest.fixture
def own_stopped_and_full(tiny_bundle, tmp_path: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A daemon of the test's own, for a test that lets it accept again."""
    with daemon_stopped_and_full(tiny_bundle.path, tmp_path / "run") as held:
        yield held


@pytest.mark.parametrize("command", [["status"], ["generate", "fn", "--max-tokens", "2"], ["stop"]])
def test_the_cli_says_the_queue_is_full_and_starts_no_daemon(stopped_and_full, command: list[str]) -> None:
    proc, sock = stopped_and_full
    env = {**os.environ, "M31R_SOCKET": str(sock)}  # autostart on: a daemon holds the socket, none is started
    r = subprocess.run([*M31R, *command], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith(f"error: the daemon on {sock} {FULL}"), r.stderr
    assert "Ctrl-Z" in r.stderr and r.stderr.count("\n") == 1
    assert "uid" not in r.stderr and "starting the m31r daemon" not in r.stderr
    assert proc.poll() is None  # (stopped, not ended: `m31r stop` reached nothing)


def test_doctor_warns_that_the_queue_is_full(stopped_and_full, tmp_path: Path) -> None:
    _, sock = stopped_and_full
    _, checks = run_doctor(tmp_path, "--socket", str(sock))
    assert isinstance(checks, dict)
    assert checks["daemon"]["level"] == "warn" and FULL in checks["daemon"]["detail"], checks["daemon"]


async def test_a_client_connects_once_the_daemon_accepts_again(own_stopped_and_full) -> None:
    proc, sock = own_stopped_and_full
    connecting = asyncio.create_task(Client.connect(sock, timeout=60, welcome_timeout=60))
    await asyncio.sleep(0.5)
    assert not connecting.done(), connecting  # still trying: not refused as another user's daemon
    proc.send_signal(signal.SIGCONT)
    async with await connecting as client:
        assert (await client.status()).pid == proc.pid

"""`m31r stop` returns once the daemon's process has ended, not when its connection closes: the daemon closes its
connections, then ends the model's load (a stop during start-up waits for it), frees the model and exits, holding the
socket's lock until then. `m31r stop && m31r generate` (what the README says to do after changing settings) had the
autostarted daemon refused as "another m31rd is already starting or serving", and `generate` failed with it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon

from m31r_protocol.blocking import status

M31R = [sys.executable, "-m", "m31r.cli"]


@pytest.fixture
def run(tiny_bundle, tmp_path: Path):
    """A 0700 socket folder of its own and the env its clients and autostarted daemons use; whatever daemon is on its
    socket at the end is stopped."""
    folder = Path(tempfile.mkdtemp(prefix="m31r-stop-"))  # 0700, and short: a socket path has a length limit
    sock = folder / "m31rd.sock"
    env = {**os.environ, "M31R_SOCKET": str(sock), "M31R_BUNDLE": str(tiny_bundle.path),
           "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    yield sock, env
    subprocess.run([*M31R, "stop"], env=env, capture_output=True, timeout=120)
    shutil.rmtree(folder, ignore_errors=True)


def _cli(env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], env=env, capture_output=True, text=True, timeout=120)


def _runs(pid: int) -> bool:
    """Whether `pid` is a running process (a zombie, exited but not yet reaped by its parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def _stop_then_generate(proc: subprocess.Popen, env: dict) -> None:
    """`m31r stop`, then at once a `generate` that autostarts a daemon on the same socket."""
    r = _cli(env, "stop")
    assert (r.returncode, r.stdout, r.stderr) == (0, "", "daemon stopped\n")
    assert proc.poll() == 0, "m31r stop returned while the daemon still ran"
    g = _cli(env, "generate", "--max-tokens", "2", "fn main")
    assert g.returncode == 0, g.stderr
    assert "starting the m31r daemon" in g.stderr  # a new one: the old one was gone, not reached while dying
    new = status(env["M31R_SOCKET"])["pid"]
    assert new != proc.pid
    r = _cli(env, "stop")
    assert (r.returncode, r.stderr) == (0, "daemon stopped\n")
    assert not _runs(new)  # the autostarted daemon, no child of this test, is gone too


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_stop_during_start_up_returns_once_the_daemon_has_exited(run, tiny_bundle) -> None:
    """Stopped while its model loads (answering Status, `warming`), the daemon closed the connection at once but
    exited only once the load ended, a second or more later."""
    sock, env = run
    proc = subprocess.Popen([*M31R, "daemon", "--bundle", str(tiny_bundle.path), "--threads", "1"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while True:
            assert proc.poll() is None, "the daemon ended before it answered"
            try:
                st = status(sock, timeout=60)
                break
            except (OSError, ValueError):  # not listening yet
                time.sleep(0.01)
        assert st["warming"] and st["pid"] == proc.pid
        _stop_then_generate(proc, env)
    finally:
        stop_daemon(proc)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_stop_of_a_ready_daemon_returns_once_it_has_exited(run, tiny_bundle) -> None:
    sock, env = run
    proc = start_daemon(tiny_bundle.path, sock)
    try:
        _stop_then_generate(proc, env)
    finally:
        stop_daemon(proc)


@pytest.mark.parametrize("watch", ["pidfd_or_kqueue", "proc_stat"])
def test_the_exit_watch_sees_a_zombie_as_ended_and_a_live_process_as_running(watch: str, monkeypatch) -> None:
    """What `m31r stop` waits on, with each of its ways to watch a process (/proc's start time where the kernel has
    no pidfd). A zombie (exited, not yet reaped: a daemon under systemd or a test's Popen, briefly) has ended."""
    from m31r.process_exit import ProcessExit

    if watch == "proc_stat":
        if not Path("/proc/self/stat").exists():
            pytest.skip("no /proc here")
        monkeypatch.delattr(os, "pidfd_open", raising=False)
        monkeypatch.delattr("select.kqueue", raising=False)
    elif not hasattr(os, "pidfd_open") and not hasattr(__import__("select"), "kqueue"):
        pytest.skip("neither pidfd nor kqueue here")
    import asyncio

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        exit_ = ProcessExit.of(child.pid)
        assert exit_ is not None
        try:
            assert asyncio.run(exit_.wait(0.0)) is False  # it runs: no time to wait is no exit
            child.stdin.close()  # type: ignore[union-attr]  # it exits; it stays a zombie until wait() below
            assert asyncio.run(exit_.wait(60.0)) is True
        finally:
            exit_.close()
    finally:
        child.kill()
        child.wait()


def test_no_exit_watch_for_a_pid_that_cannot_be_the_daemon() -> None:
    """The daemon runs as this user, and is neither init nor this client: no such pid is waited on."""
    from m31r.process_exit import ProcessExit

    assert ProcessExit.of(1) is None
    assert ProcessExit.of(os.getpid()) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd socket activation")
def test_stop_on_a_socket_systemd_holds_returns_once_the_daemon_has_exited(tiny_bundle, tmp_path: Path) -> None:
    """The daemon a socket activation started (systemd-socket-activate execs it in place: its pid is the Popen's) has
    exited when `stop` returns; the stop asks systemd first, which a `systemctl` on PATH answers as a user manager
    would with the service running."""
    from test_service import require, socket_activated

    require("systemd-socket-activate")
    folder = Path(tempfile.mkdtemp(prefix="m31r-stop-"))
    sock = folder / "held.sock"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "M31R_SOCKET": str(sock)}
    subprocess.run([*M31R, "service", "install", "--kind", "systemd", "--bundle", str(tiny_bundle.path)], env=env,
                   check=True, capture_output=True)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text("#!/bin/sh\nprintf 'active\\nactive\\n'\n")
    (fake / "systemctl").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    proc = socket_activated(sock, tiny_bundle, tmp_path / "daemon.log", {"OMP_NUM_THREADS": "1"})
    try:
        r = _cli(env, "stop")  # its connection starts the daemon, which it then stops
        assert r.returncode == 0 and r.stderr.startswith("daemon stopped; "), r.stderr
        assert proc.poll() == 0, "m31r stop returned while the daemon still ran"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)

"""A socket path longer than a Unix socket's path may be (107 bytes on Linux) is refused up front, naming the path,
its length and the way out, by every side that would bind or connect to it: the daemon (before it makes any folder),
the CLI (without starting a daemon that could not listen either) and the front ends' shared connection. Before, each
failed deep in bind or connect with "AF_UNIX path too long". Torch-free: the daemon refuses before loading torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from m31r_protocol.paths import MAX_SOCKET_PATH_BYTES, socket_path_problem

M31R = [sys.executable, "-m", "m31r.cli"]


@pytest.fixture
def long_socket(tmp_path: Path) -> Path:
    """A socket path just over the limit, in a folder that does not exist yet."""
    base = tmp_path / "s"
    name = "d.sock"
    room = MAX_SOCKET_PATH_BYTES + 1 - len(os.fsencode(base / "x" / name))
    return base / ("x" * (1 + room)) / name


def test_the_limit_counts_bytes_not_characters(tmp_path: Path) -> None:
    ok = tmp_path / "d.sock"
    assert socket_path_problem(ok) is None
    just = "/" + "a" * (MAX_SOCKET_PATH_BYTES - 1)
    assert socket_path_problem(just) is None and socket_path_problem(just + "b") is not None
    wide = "/" + "é" * (MAX_SOCKET_PATH_BYTES // 2 + 1)  # two bytes each in UTF-8: over the limit in bytes
    assert len(wide) <= MAX_SOCKET_PATH_BYTES
    why = socket_path_problem(wide)
    assert why is not None and f"is {len(os.fsencode(wide))} bytes long" in why
    assert f"at most {MAX_SOCKET_PATH_BYTES} bytes" in why and "--socket, or M31R_SOCKET" in why


def test_the_daemon_refuses_it_before_making_its_folder(long_socket: Path) -> None:
    proc = subprocess.run([*M31R, "daemon", "--socket", str(long_socket)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"m31rd: the socket path {long_socket} is {MAX_SOCKET_PATH_BYTES + 1} bytes long" in proc.stderr
    assert not long_socket.parent.exists()


@pytest.mark.parametrize("command", [["generate", "fn", "--max-tokens", "2"], ["fim", "--prefix", "fn "], ["status"],
                                     ["stop"]])
def test_the_cli_says_so_in_one_line_and_starts_no_daemon(long_socket: Path, command: list[str]) -> None:
    env = {**os.environ, "M31R_SOCKET": str(long_socket)}  # autostart on: a daemon there could not listen either
    proc = subprocess.run([*M31R, *command], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: the socket path {long_socket} is {MAX_SOCKET_PATH_BYTES + 1} bytes long")
    assert proc.stderr.count("\n") == 1 and "starting the m31r daemon" not in proc.stderr
    assert not long_socket.parent.exists()


async def test_the_front_ends_connection_reports_it_as_unavailable(long_socket: Path) -> None:
    from m31r_protocol.reconnect import DaemonLink, LinkConfig, Unavailable

    said: list[str] = []
    link = DaemonLink(LinkConfig(socket=long_socket, autostart=True), client_name="test", progress=said.append)
    with pytest.raises(Unavailable, match=f"is {MAX_SOCKET_PATH_BYTES + 1} bytes long"):
        await link.get(5.0)
    assert link.state == "unavailable" and said == []  # no daemon was started


def test_doctor_fails_the_socket_check_with_the_reason(long_socket: Path) -> None:
    import json

    proc = subprocess.run([*M31R, "doctor", "--socket", str(long_socket), "--json"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    checks = {c["name"]: c for c in json.loads(proc.stdout)["checks"]}
    assert checks["socket"]["level"] == "fail" and "bytes long" in checks["socket"]["detail"]
    assert checks["daemon"]["level"] == "fail" and "path is too long" in checks["daemon"]["detail"]


def test_a_socket_folder_that_cannot_be_made_is_named_with_the_way_out(tmp_path: Path) -> None:
    """A socket whose folder cannot be made (a file on its path here; a read-only or another user's
    XDG_RUNTIME_DIR alike) ended the daemon with errno's words alone (`[Errno 20] Not a directory: '...'`)."""
    (tmp_path / "afile").write_text("")
    sock = tmp_path / "afile" / "m31r" / "d.sock"
    proc = subprocess.run([*M31R, "daemon", "--socket", str(sock)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.endswith(f"m31rd: cannot make the socket {sock}: {tmp_path / 'afile'} is not a folder; "
                                f"choose a socket path in a folder you can write to (--socket, or M31R_SOCKET)\n"), \
        proc.stderr


def _folders(tmp_path: Path) -> list[Path]:
    """A shared scratch folder (the temp dir, /tmp: `--socket /tmp`) and one of this user's own, mode 0700."""
    import tempfile

    own = tmp_path / "mine"
    own.mkdir(mode=0o700)
    return [Path(tempfile.gettempdir()), own]


def test_a_folder_as_the_socket_is_named_as_one_by_the_daemon(tmp_path: Path) -> None:
    """`m31r daemon --socket /tmp` complained about the mode of `/` (the folder the socket would be in); a folder of
    one's own as --socket, that it "exists and is not a socket"."""
    for folder in _folders(tmp_path):
        proc = subprocess.run([*M31R, "daemon", "--socket", str(folder)], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.endswith(f"m31rd: {folder} is a folder, not a socket path: name the socket in it, such as "
                                    f"{folder / 'm31r' / 'm31rd.sock'} (--socket, or M31R_SOCKET)\n"), proc.stderr
        assert "mode" not in proc.stderr
    assert os.listdir(tmp_path / "mine") == []  # not even a lock file beside it


@pytest.mark.parametrize("command", [["generate", "fn", "--max-tokens", "2"], ["fim", "--prefix", "fn "], ["status"],
                                     ["stop"]])
def test_a_folder_as_the_socket_is_named_as_one_by_the_clients(tmp_path: Path, command: list[str]) -> None:
    """They said "nothing listens on it (a daemon that ended left its socket file)", and with autostart on started a
    daemon that could not listen there either."""
    folder = _folders(tmp_path)[1]
    env = {**os.environ, "M31R_SOCKET": str(folder), "XDG_STATE_HOME": str(tmp_path / "state")}
    proc = subprocess.run([*M31R, *command], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"error: {folder} is a folder, not a socket path: name the socket in it, such as "
                           f"{folder / 'm31r' / 'm31rd.sock'} (--socket, or M31R_SOCKET)\n"), proc.stderr
    assert not (tmp_path / "state").exists() and os.listdir(folder) == []  # no daemon was started


def test_a_folder_as_the_socket_is_not_installed_as_a_service(tmp_path: Path) -> None:
    folder = _folders(tmp_path)[1]
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    proc = subprocess.run([*M31R, "service", "install", "--kind", "systemd", "--socket", str(folder), "--dry-run"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {folder} is a folder, not a socket path"), proc.stderr

"""Audit of the daemon as a user service (session 46): the sockets systemd hands a socket-activated daemon, and
`m31r service install` from a shell with no runtime dir of its own. Sockets, daemons and systemd's tools are real;
HOME, XDG_CONFIG_HOME and XDG_RUNTIME_DIR are the test's own."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from test_service import fresh_home, require

from m31rd import service

REPO = Path(__file__).resolve().parent.parent

# Puts the sockets a case names on fds 3, 4, ... as systemd does, sets LISTEN_PID/LISTEN_FDS, and calls
# activated_socket() in this very process (LISTEN_PID must be its pid).
ACTIVATE = r"""
import os, socket, sys
case, folder = sys.argv[1], sys.argv[2]
socks = []
def unix(name, kind=socket.SOCK_STREAM, listen=True):
    s = socket.socket(socket.AF_UNIX, kind)
    s.bind(os.path.join(folder, name))
    if listen:
        s.listen()
    return s
if case in ("one", "two"):
    socks = [unix("a.sock")] + ([unix("b.sock")] if case == "two" else [])
elif case == "tcp":
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    socks = [s]
elif case == "connection":
    socks = [socket.socketpair()[0]]
elif case == "datagram":
    socks = [unix("d.sock", socket.SOCK_DGRAM, listen=False)]
for i, s in enumerate(socks):
    os.dup2(s.fileno(), 3 + i)
os.environ["LISTEN_PID"] = str(os.getpid())
os.environ["LISTEN_FDS"] = {"junk": "two", "closed": "1"}.get(case, str(len(socks)))
from m31rd.sockets import activated_socket
s = activated_socket()
print(s.family == socket.AF_UNIX, s.getsockname() == os.path.join(folder, "a.sock"), "LISTEN_PID" in os.environ)
"""

REFUSED = {
    "two": "systemd passed 2 sockets (fd 3: Unix stream, listening, on {f}/a.sock; fd 4: Unix stream, listening, on "
           "{f}/b.sock) and m31rd serves one: clients of the others would wait for ever; leave one ListenStream= in "
           "m31rd.socket",
    "tcp": "systemd passed fd 3: TCP/IP stream, listening, on 127.0.0.1:",
    "connection": "systemd passed fd 3: Unix stream, a connection (Accept=yes?), on no address; m31rd serves only a "
                  "listening Unix stream socket: m31rd.socket needs ListenStream= set to a path, and no Accept=yes",
    "datagram": "systemd passed fd 3: Unix datagram, on {f}/d.sock; m31rd serves only a listening Unix stream socket",
    "junk": "LISTEN_FDS='two' is not a number of sockets",
    "closed": "LISTEN_FDS=1 but fd 3 is no open socket (Bad file descriptor)",
}


@pytest.mark.parametrize("case", ["one", *REFUSED])
def test_passed_sockets_the_daemon_cannot_serve_end_it_saying_why(tmp_path: Path, case: str) -> None:
    """One listening Unix socket is served (and LISTEN_* are not passed on). A second ListenStream= was ignored, its
    clients waiting for ever in a backlog no one accepted from; a connection (Accept=yes) was served as a listener
    and its client waited for ever; a TCP one ended in a traceback about asyncio; a LISTEN_FDS that is no number or
    names a closed fd, in a traceback. Each now ends the daemon (exit 1) with the reason."""
    r = subprocess.run([sys.executable, "-c", ACTIVATE, case, str(tmp_path)], capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    if case == "one":
        assert (r.returncode, r.stdout) == (0, "True True False\n"), r.stderr
        return
    said = f"m31rd: cannot serve the socket systemd passed: {REFUSED[case].format(f=tmp_path)}"
    assert r.returncode == 1 and said in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_second_listen_stream_ends_the_daemon_instead_of_leaving_its_clients_waiting(tiny_bundle,
                                                                                    tmp_path: Path) -> None:
    """systemd-socket-activate listening on two paths, as m31rd.socket with a second ListenStream= (a drop-in): a
    client of the second path waited for ever while the daemon served the first. Now the daemon the connection starts
    exits 1 saying why, and the client's connection is closed."""
    require("systemd-socket-activate")
    a, b = tmp_path / "a.sock", tmp_path / "b.sock"
    cmd = ["systemd-socket-activate", "--listen", str(a), "--listen", str(b), "-E", "OMP_NUM_THREADS=1",
           sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(tiny_bundle.path), "--threads", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        said = ""
        while f"Listening on {b} " not in said:  # it says so once bound, before it waits for a connection
            line = proc.stdout.readline()
            assert line, said
            said += line
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as client:
            client.settimeout(60)
            client.connect(str(b))
            with contextlib.suppress(ConnectionResetError):  # closed (or reset: never accepted) as the daemon
                assert client.recv(1) == b""  # exits, not left waiting
            assert proc.wait(timeout=60) == 1
        said += proc.stdout.read()
        assert (f"m31rd: cannot serve the socket systemd passed: systemd passed 2 sockets (fd 3: Unix stream, "
                f"listening, on {a}; fd 4: Unix stream, listening, on {b})") in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def test_install_from_a_shell_without_its_own_runtime_dir_says_where_login_clients_look(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With no XDG_RUNTIME_DIR (ssh without a session, su), the default socket is /tmp/m31r-UID/m31rd.sock, and the
    units listened there under a comment saying M31R_SOCKET or --socket had named it; nothing said that the clients
    of a login session (the editor's) look at %t's socket and would start a daemon of their own beside the service.
    And %t was read as whatever XDG_RUNTIME_DIR said, a folder gone or another user's, not the user manager's."""
    home = fresh_home(tmp_path / "home", monkeypatch)
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "metadata.json").write_text("{}\n")
    from m31r_protocol.paths import default_socket_path

    sock = default_socket_path()
    login = Path(f"/run/user/{os.getuid()}/m31r/m31rd.sock")
    out: list[str] = []
    units = service.install("systemd", bundle, echo=out.append)
    text = units[0].read_text()
    assert f"\nListenStream={sock}\n" in text
    assert "M31R_SOCKET or `m31r service install --socket` named" not in text, text
    assert (f"# ListenStream= is {sock}: the default socket of the shell that installed it, which had\n# no "
            "XDG_RUNTIME_DIR of its own") in text, text
    assert (f"note: this shell has no XDG_RUNTIME_DIR of its own (unset, or another user's after su), so its default "
            f"socket is {sock}; clients in a login session (your editor's) look at {login} and would not find the "
            f"service, and start a daemon of their own: run `m31r service install --force` in such a session, or "
            f"pass --socket {login}") in out, out
    require("systemd-analyze")
    (home / "run").chmod(0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(home / "run")}  # (systemd-analyze needs one to run at all)
    r = subprocess.run(["systemd-analyze", "verify", "--user", "m31rd.socket", "m31rd.service"], capture_output=True,
                       text=True, timeout=60, cwd=units[0].parent, env=env)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    # A login session's install (%t) read back where XDG_RUNTIME_DIR names a folder that is not there (any more).
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "run"))
    out = []
    service.install("systemd", bundle, force=True, echo=out.append)
    assert "\nListenStream=%t/m31r/m31rd.sock\n" in units[0].read_text()
    assert not any(line.startswith("note: this shell") for line in out), out
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(home / "gone"))
    assert service.installed_socket("systemd") == login

"""Session 45's leftovers from earlier audits.

- `m31r serve` and a client that sends its whole request, then shuts its sending side (shutdown(SHUT_WR), as scripts
  piping into nc do): the adapter took the EOF for a disconnect, and the client got no answer. HTTP/1.1 lets a
  half-closed client read its answer; now it gets it (then EOF), while an incomplete request followed by EOF is
  dropped, and a client that has really gone (closed, not half-closed) still has its daemon request cancelled.
  The real server, raw sockets; the shared daemon, or test_http's stalled daemon where the request must outlast the
  client.
- The launchd agent (`m31r service install`) restarted a daemon that exits with an error (a corrupt bundle, a socket
  taken, a bad setting) every 10 s for ever; now only a crash is restarted.
- A kernel build published to the cache is on disk (fsync) before its final name points at it.
"""

from __future__ import annotations

import os
import plistlib
import shlex
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import h11
import pytest
from test_http import Server, StalledDaemon, scrape, wait_for

from m31r import native
from m31r_protocol import messages as pm
from m31rd import service

pytestmark = pytest.mark.timeout(120)


# -- HTTP: half-closed clients -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("halfclose"), shared_daemon[1])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def request(method: str, path: str, body: bytes = b"") -> h11.Request:
    headers = [("Host", "127.0.0.1")]
    if method == "POST":
        headers += [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
    return h11.Request(method=method, target=path, headers=headers)


def wire(req: h11.Request, body: bytes = b"") -> bytes:
    """`req` and its body as a client sends them."""
    conn = h11.Connection(h11.CLIENT)
    return b"".join(conn.send(e) or b"" for e in [req, *([h11.Data(data=body)] if body else []), h11.EndOfMessage()])


def read_to_eof(conn: socket.socket, timeout: float = 30.0) -> bytes:
    """Everything the server sends until it closes the connection (EOF; a reset fails the test)."""
    conn.settimeout(timeout)
    data = b""
    while chunk := conn.recv(65536):
        data += chunk
    return data


def responses(reqs: list[tuple[h11.Request, bytes]], data: bytes) -> list[tuple[int, bytes]]:
    """The final responses in `data` to `reqs` (request, body), in order, as (status, body): each must be whole (h11
    parses them as the client side of the connection; interim 1xx responses are allowed, as HTTP/1.1 says, and
    skipped)."""
    conn = h11.Connection(h11.CLIENT)
    out: list[tuple[int, bytes]] = []
    conn.receive_data(data)
    conn.receive_data(b"")
    for req, req_body in reqs:
        for event in (req, *([h11.Data(data=req_body)] if req_body else []), h11.EndOfMessage()):
            conn.send(event)
        status, body = 0, b""
        while True:
            event = conn.next_event()
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                assert isinstance(event, h11.InformationalResponse), (event, data[-300:])
        out.append((status, body))
        if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
            conn.start_next_cycle()
    return out


def half_closed(server: Server, data: bytes) -> bytes:
    """`data` sent on a new connection whose sending side is then shut: what comes back until EOF."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(data)
        conn.shutdown(socket.SHUT_WR)
        return read_to_eof(conn)


GENERATE = b'{"prompt": "fn main() {", "max_tokens": 8}'
STREAM = b'{"prompt": "fn main() {", "max_tokens": 8, "stream": true}'


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/health", b""),
    ("POST", "/generate", GENERATE),
    ("POST", "/generate", STREAM),
    ("POST", "/v1/completions", b'{"prompt": "fn main() {", "max_tokens": 8}'),
], ids=["health", "generate", "generate-stream", "openai"])
def test_a_half_closed_client_is_answered(server, method, path, body):
    """The request, then shutdown(SHUT_WR): the whole answer comes back (its body complete: a streamed one ends with
    its `done` event), then EOF. It was EOF at once, with no answer."""
    req = request(method, path, body)
    [(status, got)] = responses([(req, body)], half_closed(server, wire(req, body)))
    assert status == 200, got
    if body == STREAM:
        assert b"event: done" in got, got
    elif path != "/health":
        assert got.startswith(b"{") and b'"usage"' in got, got


def test_pipelined_requests_then_a_half_close_are_all_answered(server):
    """Two requests in one send, then the half-close: both answered, in order, then EOF (not only the first)."""
    reqs = [(request("POST", "/generate", GENERATE), GENERATE), (request("GET", "/health"), b"")]
    got = responses(reqs, half_closed(server, b"".join(wire(*r) for r in reqs)))
    assert [status for status, _ in got] == [200, 200] and b'"usage"' in got[0][1], got


@pytest.mark.parametrize("sent", [
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # a header block not ended
    b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    b'{"prompt": ',  # a body cut short
    wire(request("GET", "/health")) + b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n",  # a whole one, then a part
], ids=["headers-cut", "body-cut", "whole-then-part"])
def test_an_incomplete_request_then_eof_is_dropped(server, sent):
    """A request cut short by the client's EOF is not answered: the connection is just closed (after the answers to
    the whole requests before it), and the server goes on serving."""
    data = half_closed(server, sent)
    if sent.count(b"GET") == 2:
        [(status, _)] = responses([(request("GET", "/health"), b"")], data)
        assert status == 200 and data.count(b"HTTP/1.1 200") == 1, data
    else:
        assert data == b""
    assert server.wait_healthy()["status"] == "ok"


@pytest.fixture
def stalled(tmp_path) -> Iterator[tuple[StalledDaemon, Server]]:
    """A server in front of a daemon that never answers, with a short request timeout (the 504 it ends with is the
    answer a half-closed client waits for)."""
    daemon = StalledDaemon(tmp_path / "stalled.sock")
    srv = Server(tmp_path, daemon.path, "--request-timeout", "2")
    try:
        yield daemon, srv
    finally:
        srv.stop()
        daemon.close()


def cancelled(srv: Server, reason: str) -> float:
    import httpx

    with httpx.Client(base_url=srv.url, timeout=30) as c:
        return scrape(c).get(("m31r_http_cancelled_total", (("endpoint", "/generate"), ("reason", reason))), 0.0)


def generating(daemon: StalledDaemon, n: int) -> bool:
    return sum(isinstance(m, pm.Generate) for m in daemon.received) >= n


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_client_that_closed_still_cancels_its_request(stalled, stream):
    """A client that closes its connection (not a half-close) while its request waits on the daemon: the request is
    cancelled at once (the daemon gets a Cancel, counted as a disconnect), not kept until it would be answered."""
    daemon, srv = stalled
    body = STREAM if stream else GENERATE
    conn = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
    conn.sendall(wire(request("POST", "/generate", body), body))
    assert wait_for(lambda: generating(daemon, 1))
    conn.close()
    assert wait_for(lambda: any(isinstance(m, pm.Cancel) for m in daemon.received)), daemon.received
    assert cancelled(srv, "disconnect") == 1 and cancelled(srv, "timeout") == 0


def test_a_half_closed_client_waits_for_a_slow_answer(stalled):
    """A half-closed client is not taken for a gone one while its request runs: it gets the request's answer (here
    the 504 of the request timeout, the daemon never answering)."""
    daemon, srv = stalled
    req = request("POST", "/generate", GENERATE)
    [(status, body)] = responses([(req, GENERATE)], half_closed(srv, wire(req, GENERATE)))
    assert status == 504 and b"timeout" in body, body
    assert cancelled(srv, "timeout") == 1 and cancelled(srv, "disconnect") == 0


# -- the launchd agent -----------------------------------------------------------------------------------------------


def test_the_launchd_agent_restarts_a_crash_only(tmp_path: Path):
    """KeepAlive {SuccessfulExit: false} restarted every exit but a clean one: a daemon that cannot start (a corrupt
    or moved bundle, a socket taken, a bad setting: exit 1, and every retry fails the same way) was relaunched every
    ThrottleInterval for ever, each try importing torch and logging its failure. Now only a crash (a signal such as
    SIGSEGV) is restarted; a daemon that exits by itself stays down, with its reason in the stderr log."""
    data = service.render_launchd(["/opt/m31r/bin/m31r"], tmp_path / "bundle", tmp_path / "d.sock",
                                  tmp_path / "logs" / "m31rd.log")
    plist = plistlib.loads(data)
    assert plist["KeepAlive"] == {"Crashed": True}, plist["KeepAlive"]
    assert plist["RunAtLoad"] is True  # (Crashed alone does not start it at login)
    assert plist["ThrottleInterval"] >= 10  # a crash loop is still spaced out


def test_install_beside_a_running_daemon_does_not_promise_launchd_retries(tmp_path: Path, shared_daemon,
                                                                          monkeypatch: pytest.MonkeyPatch):
    """install's note for a daemon already on the agent's socket said launchd retries the agent every 10 s: it no
    longer does (the agent's daemon exits 1, socket taken); the note says how to start it once the path is free."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "metadata.json").write_text("{}")
    proc, sock = shared_daemon
    out: list[str] = []
    service.install("launchd", bundle, socket=sock, echo=out.append)
    [note] = [line for line in out if line.startswith("note:")]
    assert f"a daemon (pid {proc.pid}) already serves {sock}" in note
    assert f"`m31r stop --socket {shlex.quote(str(sock))}` before starting the service" in note
    assert "every 10 s" not in note and f"launchctl kickstart gui/{os.getuid()}/dev.m31r.m31rd" in note, note


# -- the kernel cache ------------------------------------------------------------------------------------------------


def test_a_published_build_is_on_disk_before_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """_publish renamed the copy into place without fsync: after a power loss the final name could hold a
    zero-length or partly zeroed file (size right, data never written), which the loader's truncation check passes
    and dlopen may map. Now the copy's data is flushed before the rename, and the folder after it. The real calls run;
    the spies only record their order."""
    built = tmp_path / "build" / "kernels-x.so"
    built.parent.mkdir()
    built.write_bytes(b"\x7fELF" + os.urandom(4096))
    built.chmod(0o755)
    target = tmp_path / "cache" / built.name
    calls: list[tuple[str, object]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        st = os.fstat(fd)
        calls.append(("fsync-dir" if stat.S_ISDIR(st.st_mode) else "fsync", st.st_ino))
        real_fsync(fd)

    def replace(src, dst) -> None:
        calls.append(("replace", Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    native._publish(built, target)
    assert target.read_bytes() == built.read_bytes() and stat.S_IMODE(target.stat().st_mode) == 0o755
    assert calls == [("fsync", target.stat().st_ino), ("replace", target), ("fsync-dir", target.parent.stat().st_ino)]
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temporary left


def test_a_failed_publish_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A copy that cannot be flushed (an I/O error, a full disk) fails the publish (the build is then used from its
    private folder) and leaves no temporary file in the cache."""
    built = tmp_path / "kernels-x.so"
    built.write_bytes(b"\x7fELF" + bytes(64))
    target = tmp_path / "cache" / built.name

    def fsync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        native._publish(built, target)
    assert list(target.parent.iterdir()) == []


"""Slow clients on `m31r serve`: a request body that trickles in, or stops mid-way, is answered 408 once
--body-timeout has passed since its headers, the connection closed, while other clients are served; a large body
that arrives promptly, and an answer that takes longer than the body timeout (streamed or not), are untouched.
Likewise request headers that trickle in (on a new connection or a kept-alive one) are answered 408 once
--header-timeout has passed, and a connection that sends nothing is closed.

The real server in front of the shared real daemon, driven by raw sockets (what a slow client is) and httpx; the
one test of a long answer uses the stalled daemon of test_http, since the tiny model answers in milliseconds.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from test_http import Server, StalledDaemon, sse_events

from m31r_http.server import MAX_CONNECTIONS
from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

BODY_TIMEOUT = 0.5
HEADER_TIMEOUT = 0.5


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("slow"), shared_daemon[1], "--body-timeout", str(BODY_TIMEOUT),
                 "--header-timeout", str(HEADER_TIMEOUT))
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def read_response(conn: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket: status, headers, body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = conn.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def read_408(conn: socket.socket, t0: float, limit: float) -> Any:
    """The 408 a deadline of `limit` seconds from `t0` answers on `conn`, on time, closing the connection, as JSON:
    its "error" (OpenAI's object, or Ollama's string)."""
    status, headers, body = read_response(conn)
    elapsed = time.monotonic() - t0
    assert status == 408, body
    assert limit * 0.9 < elapsed < limit + 5
    assert headers["connection"] == "close" and headers["content-type"] == "application/json"
    return json.loads(body)["error"]


def closed(conn: socket.socket, timeout: float = 5.0) -> bool:
    """The server has closed the connection (EOF or reset) within `timeout`."""
    conn.settimeout(timeout)
    try:
        while conn.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def in_flight(srv: Server) -> float:
    """m31r_http_requests_in_flight, this scrape's own request included."""
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    return float(next(line.split()[1] for line in text.splitlines()
                      if line.startswith("m31r_http_requests_in_flight ")))


def completion_ok(srv: Server) -> None:
    r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "fn", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("path", "trickle"), [("/v1/completions", True), ("/api/generate", False)])
def test_slow_body_gets_408_and_others_are_served(server, path, trickle):
    """Content-Length 200, then part of the body: trickled a byte every 0.1 s (each wait well within the timeout, so
    only a deadline for the whole body ends it), or nothing more. 408 in the path's error shape, at the timeout, the
    connection closed; another connection is served meanwhile and afterwards, and nothing of it is left in flight."""
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 "Content-Length: 200\r\n\r\n".encode() + b'{"model": "m31r", "prompt": "')
    t0 = time.monotonic()
    stop = threading.Event()

    def drip() -> None:
        while not stop.wait(0.1):
            try:
                conn.sendall(b"x")
            except OSError:  # the server closed the connection
                return

    dripper = threading.Thread(target=drip, daemon=True)
    if trickle:
        dripper.start()
    try:
        completion_ok(server)  # served while the slow body is pending
        conn.settimeout(10)
        message = read_408(conn, t0, BODY_TIMEOUT)
        if path.startswith("/api/"):  # Ollama's shape
            assert isinstance(message, str)
        else:  # OpenAI's
            assert message["code"] == "timeout" and message["type"] == "invalid_request_error"
            message = message["message"]
        assert f"within {BODY_TIMEOUT:g}s" in message and "--body-timeout" in message
        assert closed(conn)
    finally:
        stop.set()
        conn.close()
    completion_ok(server)
    assert in_flight(server) == 1  # the scrape itself: the slow request is gone


def test_large_body_arriving_promptly_is_served(server):
    """A body near --max-body (1 MiB: a short prompt padded with JSON whitespace), sent at once or chunked without
    a length, is served; one declared past the limit is refused before it is read, closing the connection."""
    body = b'{"prompt": "fn", "max_tokens": 2' + b" " * ((1 << 20) - 64) + b"}"
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200, r.text

    def pieces():
        for i in range(0, len(body), 64 * 1024):
            yield body[i:i + 64 * 1024]

    r = httpx.post(f"{server.url}/v1/completions", content=pieces(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 200 and "content-length" not in r.request.headers, r.text
    conn = socket.create_connection(("127.0.0.1", server.port))
    try:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 2000000\r\n\r\n{")
        conn.settimeout(10)
        status, headers, _ = read_response(conn)
        assert status == 413 and headers["connection"] == "close"
        assert closed(conn)
    finally:
        conn.close()


def test_answers_that_outlive_the_body_timeout_are_not_cut(tmp_path):
    """Once the body is in, the body timeout (and the header timeout) no longer applies: an answer still open past
    it (a daemon that sends one token and then nothing) ends at the request timeout, streamed (the token, then the
    timeout's error event) or not (504), rather than being cut at the body timeout."""
    stalled = StalledDaemon(tmp_path / "stalled.sock", answer=lambda req: pm.Token(id=req.id, text="x", token=120))
    srv = Server(tmp_path, stalled.path, "--request-timeout", "1.5", "--body-timeout", "0.3", "--header-timeout", "0.3")
    try:
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn", "stream": True}, timeout=30)
        assert r.status_code == 200 and time.monotonic() - t0 > 1.2
        events = sse_events(r.text)
        assert [e for e, _ in events] == ["chunk", "error"] and json.loads(events[0][1])["text"] == "x"
        assert json.loads(events[1][1])["error"]["code"] == "timeout"
        t0 = time.monotonic()
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn"}, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout" and time.monotonic() - t0 > 1.2
    finally:
        srv.stop()
        stalled.close()


def test_a_client_leaving_mid_body_is_a_line_of_log_not_an_error(server):
    """A client that closes its connection before its body is in has nobody to answer: one info line and the request
    log's 499, not an ERROR with Starlette's ClientDisconnect traceback, and the server serves on."""
    before = server.log.read_text()
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\":")
        time.sleep(0.1)
    deadline = time.monotonic() + 10
    while "before sending all of its request's body" not in server.log.read_text()[len(before):]:
        assert time.monotonic() < deadline, server.log.read_text()[len(before):]
        time.sleep(0.05)
    completion_ok(server)
    lines = [json.loads(x) for x in server.log.read_text()[len(before):].splitlines() if x.startswith("{")]
    assert not [x for x in lines if x.get("level") == "error" or "Traceback" in json.dumps(x)], lines
    assert any(x.get("msg") == "request" and x.get("status") == 499 for x in lines), lines


@pytest.mark.parametrize("kept_alive", [False, True])
def test_slow_headers_get_408_and_others_are_served(server, kept_alive):
    """A header block trickled a byte every 0.1 s (each wait well within the timeout) and never finished, on a new
    connection or after a first request answered on it: 408 at the header timeout, the connection closed, while
    another connection is served meanwhile and afterwards."""
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.settimeout(10)
    if kept_alive:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        status, headers, _ = read_response(conn)
        assert status == 200 and headers.get("connection") != "close"
    t0 = time.monotonic()
    stop = threading.Event()

    def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000:
            if stop.wait(0.1):
                return
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # the server closed the connection
                return

    dripper = threading.Thread(target=drip, daemon=True)
    dripper.start()
    try:
        completion_ok(server)  # served while the slow headers are pending
        error = read_408(conn, t0, HEADER_TIMEOUT)
        assert error["code"] == "timeout" and error["type"] == "invalid_request_error"
        assert f"within {HEADER_TIMEOUT:g}s" in error["message"] and "--header-timeout" in error["message"]
        assert closed(conn)
    finally:
        stop.set()
        conn.close()
    completion_ok(server)
    assert "headers did not arrive within" in server.log.read_text()


@pytest.mark.parametrize(("start", "ollama"), [
    (b"POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a", True),  # the request line is in: its path's shape
    (b"POST /api/generate HTTP/1.1", False),  # not all of the request line: OpenAI's
])
def test_slow_headers_408_is_in_the_shape_of_the_request_lines_path(server, start, ollama):
    """A header block cut short after its request line gets its 408 in that path's error shape (Ollama's under /api/:
    an Ollama client reads `error` as a string); before the request line is in, the path is not known: OpenAI's."""
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.settimeout(10)
        conn.sendall(start)
        error = read_408(conn, time.monotonic(), HEADER_TIMEOUT)
        if ollama:
            assert isinstance(error, str) and "--header-timeout" in error, error
        else:
            assert error["code"] == "timeout" and "--header-timeout" in error["message"], error
        assert closed(conn)


def test_a_connection_that_sends_nothing_is_closed_without_an_answer(server):
    """A connection that never starts a request is closed at the header timeout, with no answer: nobody asked."""
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        t0 = time.monotonic()
        conn.settimeout(HEADER_TIMEOUT + 5)
        assert conn.recv(65536) == b""  # EOF, no 408
        assert HEADER_TIMEOUT * 0.9 < time.monotonic() - t0 < HEADER_TIMEOUT + 5
    completion_ok(server)


@pytest.mark.parametrize("phase", ["headers", "body"])
def test_waiting_connections_make_room_at_the_connection_limit(shared_daemon, tmp_path, phase):
    """MAX_CONNECTIONS + 8 connections that each send part of a header block (or whole headers and part of a body)
    and wait, well within the timeouts, do not have other clients answered uvicorn's 503: each connection opened at
    the limit closes the one that has waited longest for its client (an idle kept-alive one just goes, a begun one
    gets a 408 in its path's error shape, which a page from an allowed origin can read), and the newest waiters, and
    connections being answered, are left alone."""
    origin = "http://localhost:5173"
    srv = Server(tmp_path, shared_daemon[1], "--header-timeout", "60", "--body-timeout", "60", "--cors-origin", origin)
    start = (f"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nOrigin: {origin}\r\nX-Slow: a" if phase == "headers" else
             "POST /api/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
             f"Origin: {origin}\r\nContent-Length: 100\r\n\r\n{{\"model\": \"m31r\", ").encode()
    conns: list[socket.socket] = []
    try:
        srv.wait_healthy()
        idle = socket.create_connection(("127.0.0.1", srv.port))
        idle.settimeout(10)
        idle.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert read_response(idle)[0] == 200  # then kept alive, waiting for a next request
        for _ in range(MAX_CONNECTIONS + 8):
            conn = socket.create_connection(("127.0.0.1", srv.port))
            conn.sendall(start)
            conns.append(conn)
        with httpx.Client(timeout=30) as client:  # a fresh connection per request, as the waiters fill the server
            for _ in range(3):
                r = client.get(f"{srv.url}/health", headers={"connection": "close"})
                assert r.status_code == 200, r.text
                r = client.post(f"{srv.url}/v1/completions", json={"prompt": "fn", "max_tokens": 2},
                                headers={"connection": "close"})
                assert r.status_code == 200, r.text
        assert closed(idle) and idle.recv(10) == b""
        conns[0].settimeout(10)
        status, headers, body = read_response(conns[0])
        assert status == 408 and headers["connection"] == "close", body
        assert headers["access-control-allow-origin"] == origin, headers
        error = json.loads(body)["error"]
        message = error["message"] if phase == "headers" else error  # OpenAI's shape; Ollama's under /api/
        assert f"request's {phase} {'were' if phase == 'headers' else 'was'} not all in" in message
        assert "connection limit" in message
        assert closed(conns[0])
        conns[-1].setblocking(False)
        with pytest.raises(BlockingIOError):  # the newest waiter: still open, nothing sent to it
            conns[-1].recv(10)
        log = srv.log.read_text()
        assert log.count("connections are open (near the limit)") == 1, log[-3000:]  # one warning, not one per close
        assert "a client closed its connection" not in log  # the server closed those, and said so
    finally:
        for conn in conns:
            conn.close()
        srv.stop()

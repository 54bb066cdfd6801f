"""`m31r serve` refusing a request its client is still uploading, session 44's audit: an answer sent before the body is
in (413 for a declared size past --max-body, 403 for a foreign Origin, 415 for a compressed body, Starlette's 413 for a
chunked body that grows past the limit) was followed by an immediate close with the client's body unread, so the
kernel reset the connection: a raw socket's next send failed with ECONNRESET, and Python's http.client raised
BrokenPipeError or ConnectionResetError instead of returning the 413 and its message. Now the connection lingers
(connection.py): the answer, EOF, and the rest of the upload read and discarded, within a bound of time and bytes.

The real `m31r serve` on a real TCP port, driven by raw sockets and http.client; no daemon is needed (each refusal comes
before one would be asked).
"""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Iterator

import pytest
from test_http import Server
from test_http_slow_clients import read_response

from m31r_http.connection import LINGER_BYTES
from m31r_http.server import DEFAULT_MAX_BODY

pytestmark = pytest.mark.timeout(120)

PIECE = b" " * 65536
REST = 2 << 20  # what the client still sends once it has been answered
BIG = 6 << 20  # an http.client body: more than the loopback's buffers take before the server answers

# (name, request headers, status, error code): a body past --max-body in every case (chunked where its size would be
# refused first)
REFUSALS = [
    ("declared too large", {}, 413, "too_large"),
    ("foreign origin", {"Origin": "http://evil.example"}, 403, "forbidden_origin"),
    ("compressed", {"Content-Encoding": "gzip", "Transfer-Encoding": "chunked"}, 415, "unsupported_encoding"),
    ("chunked too large", {"Transfer-Encoding": "chunked"}, 413, "too_large"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("linger")
    srv = Server(tmp, tmp / "none.sock")
    try:
        yield srv
    finally:
        srv.stop()


def framed(data: bytes, chunked: bool) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data) if chunked else data


def refused(server: Server, headers: dict[str, str], length: int, status: int) -> tuple[socket.socket, bool]:
    """A raw connection whose request (`length` bytes of body declared, or chunked) the server has answered, the
    answer unread: after the headers alone, or for a chunked body refused as too large, once past --max-body."""
    chunked = "Transfer-Encoding" in headers
    fields = {"Host": "127.0.0.1", "Content-Type": "application/json", **headers}
    if not chunked:
        fields["Content-Length"] = str(length)
    conn = socket.create_connection(("127.0.0.1", server.port))
    conn.settimeout(30)
    conn.sendall(b"POST /v1/completions HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()).encode()
                 + b"\r\n")
    if chunked and status == 413:
        for _ in range(DEFAULT_MAX_BODY // len(PIECE) + 1):
            conn.sendall(framed(PIECE, True))
    assert select.select([conn], [], [], 30)[0], "no answer"
    return conn, chunked


@pytest.mark.parametrize(("headers", "status", "code"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_a_client_still_sending_after_a_refusal_reads_it(server, headers, status, code):
    """The client sends 2 MiB more after the answer has arrived: every send goes through (it was ECONNRESET), and
    the answer is there to read, with its message, then EOF (not a reset)."""
    conn, chunked = refused(server, headers, REST, status)
    try:
        for _ in range(REST // len(PIECE)):
            conn.sendall(framed(PIECE, chunked))
        got, answer, body = read_response(conn)
        assert got == status and answer["connection"] == "close", body
        assert json.loads(body)["error"]["code"] == code, body
        assert conn.recv(65536) == b""
    finally:
        conn.close()


def pieces(total: int) -> Iterator[bytes]:
    for _ in range(total // len(PIECE)):
        yield PIECE


@pytest.mark.parametrize(("headers", "status", "code"), [r[1:] for r in REFUSALS], ids=[r[0] for r in REFUSALS])
def test_http_client_uploading_a_large_body_gets_the_refusal(server, headers, status, code):
    """http.client sends the whole body before it reads an answer: 6 MiB, refused. It raised BrokenPipeError (or
    ConnectionResetError) on its send; now it returns the refusal, and the server serves the next request."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        chunked = "Transfer-Encoding" in headers
        conn.request("POST", "/v1/completions", body=pieces(BIG) if chunked else PIECE * (BIG // len(PIECE)),
                     headers={"Content-Type": "application/json", **headers}, encode_chunked=chunked)
        r = conn.getresponse()
        body = r.read()
        assert r.status == status and r.getheader("connection") == "close", body
        error = json.loads(body)["error"]
        assert error["code"] == code, body
        if status == 413:
            assert f"limit of {DEFAULT_MAX_BODY} bytes" in error["message"], body
    finally:
        conn.close()
    assert_serves(server)


def assert_serves(server: Server) -> None:
    """The server answers a new connection's request after the lingering one."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        conn.request("GET", "/")
        assert conn.getresponse().status == 200
    finally:
        conn.close()


def sent_until_cut(conn: socket.socket, piece: bytes, pause: float = 0.0, limit: float = 60) -> int:
    """Bytes sent on `conn` (`piece` every `pause` seconds) until the server closes it; fails past `limit` seconds."""
    sent, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < limit:
        try:
            conn.sendall(piece)
        except OSError:  # reset: the server has closed the connection
            return sent
        sent += len(piece)
        time.sleep(pause)
    raise AssertionError(f"still open after {limit}s and {sent} bytes")


def test_an_endless_upload_after_a_refusal_is_cut_off(server):
    """Lingering is bounded: a client that sends a declared gigabyte as fast as it can is cut off after LINGER_BYTES
    (and the kernel's buffers), having had its 413, and a slow one sending a byte at a time by a deadline."""
    for piece, pause in ((PIECE, 0.0), (b"x", 0.05)):
        conn, _ = refused(server, {}, 1 << 30, 413)
        try:
            assert read_response(conn)[0] == 413
            assert conn.recv(65536) == b""
            assert sent_until_cut(conn, piece, pause) < LINGER_BYTES + (32 << 20)
        finally:
            conn.close()
    assert_serves(server)

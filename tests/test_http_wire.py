"""What `m31r serve` answers below and beside its endpoints, as clients of other servers meet it: uvicorn's own
answers (a request that is not valid HTTP, the connection limit) in the API's JSON error shapes rather than plain
text, `GET /` and `HEAD /` as Ollama answers them, OpenAI's `GET /v1/models/{model}`, and a 404 that says what
this server offers instead.

The real server in front of the shared real daemon (or, for the connection limit, the stalled daemon of test_http),
driven by raw sockets (what a malformed request is), httpx and the `openai` and `ollama` packages.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import openai
import pytest
from test_http import Server, StalledDaemon, scrape

from m31r_http.server import MAX_CONNECTIONS

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("wire"), shared_daemon[1])
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def exchange(srv: Server, data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Send `data` on a new connection and read the responses (each with a Content-Length) until the server closes
    the connection."""
    with socket.create_connection(("127.0.0.1", srv.port)) as conn:
        conn.settimeout(10)
        conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    out = []
    while received:
        head, _, rest = received.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
        length = int(headers["content-length"])
        out.append((int(status_line.split()[1]), headers, rest[:length]))
        received = rest[length:]
    return out


HOST = b"Host: 127.0.0.1\r\n"


@pytest.mark.parametrize(("data", "status", "ollama", "words"), [
    (b"GARBAGE\r\n\r\n", 400, False, "illegal request line: 'GARBAGE'"),  # no path: OpenAI's shape
    (b"GET /api/tags HTTP/1.1\r\n" + HOST + b"Bad Header\r\n\r\n", 400, True, "illegal header line: 'Bad Header'"),
    (b"POST /v1/completions HTTP/1.1\r\n" + HOST + b"Content-Length: zz\r\n\r\n", 400, False, "Content-Length"),
    (b"GET http://127.0.0.1/api/version HTTP/1.1\r\nBad\r\n\r\n", 400, True, "illegal header line"),  # absolute-form
    (b"GET /health HTTP/1.1\r\n" + HOST + b"\r\nGET /api/tags HTTP/1.1\r\nBad\r\n\r\n", 400, True, "header line"),
    (b"GET /api/tags HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 20000, 431, True, "header block is larger"),
])
def test_requests_that_are_not_http_get_json_errors(server, data, status, ollama, words):
    """A request h11 cannot parse is answered in the error shape of its path, when its request line arrived (Ollama's
    under /api/, else OpenAI's), saying what is wrong, with h11's status (431 for a header block past its limit), and
    the connection is closed; uvicorn answered every one with a plain-text 400 "Invalid HTTP request received.". A
    request pipelined after a good one is read by its own request line."""
    *before, (got, headers, body) = exchange(server, data)
    assert [answer[0] for answer in before] == ([200] if data.startswith(b"GET /health") else [])
    assert got == status, body
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    if ollama:
        assert isinstance(error, str) and words in error, error
    else:
        assert error["type"] == "invalid_request_error" and error["code"] == "invalid_http", error
        assert words in error["message"]
    assert httpx.get(f"{server.url}/api/version", timeout=10).status_code == 200  # and serves on


def test_root_answers_as_ollama_does(server):
    """`GET /` and `HEAD /` answer 200 "Ollama is running", word for word, as plain text: the ollama CLI's heartbeat
    sends HEAD / (and wants a 200), and front ends that detect a local Ollama compare the text. Both answered 404."""
    r = httpx.get(f"{server.url}/", timeout=10)
    assert r.status_code == 200 and r.text == "Ollama is running", r.text
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    r = httpx.head(f"{server.url}/", timeout=10)
    assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == "17"
    assert httpx.head(f"{server.url}/api/version", timeout=10).status_code == 200  # Ollama answers HEAD there too
    r = httpx.get(f"{server.url}/", headers={"host": "evil.example"}, timeout=10)
    assert r.status_code == 403  # the Host check (DNS rebinding) holds here as everywhere


def test_a_request_without_host_is_told_to_send_one(server):
    """A request without a Host header (HTTP/1.0 allows it) is refused 403, as DNS-rebinding defence wants, saying
    the header is missing and what to send: the message said `Host '' is not a loopback name` and advised
    --allowed-host, which cannot admit it."""
    [(status, _, body)] = exchange(server, b"GET /health HTTP/1.0\r\n\r\n")
    error = json.loads(body)["error"]
    assert status == 403 and error["code"] == "forbidden_host", body
    assert "no Host header" in error["message"] and "--allowed-host" not in error["message"], error


def test_models_retrieve(server, tiny_bundle):
    """The OpenAI client's models.retrieve (`GET /v1/models/{model}`) finds the model under each of its names, with
    its id, and a name not served is a 404 `model_not_found` naming `model`; it was a bare 404 for every name. Its
    metrics are counted under the route, whatever the name asked for (not `other`, nor one series per name)."""
    with httpx.Client(base_url=server.url, timeout=10) as http:
        before = scrape(http)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    name = tiny_bundle.model_id
    for asked in (name, name.split("@")[0], "m31r"):
        model = client.models.retrieve(asked)
        assert model.id == name and model.object == "model" and model.owned_by == "m31r", model
    assert client.models.retrieve("m31r").model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    err = e.value.body
    assert err["code"] == "model_not_found" and err["param"] == "model" and "'gpt-4o' is not served" in err["message"]
    with httpx.Client(base_url=server.url, timeout=10) as http:
        after = scrape(http)

    def moved(endpoint: str, status: str) -> float:
        key = ("m31r_http_requests_total", (("endpoint", endpoint), ("status", status)))
        return after.get(key, 0) - before.get(key, 0)

    assert moved("/v1/models/{model}", "200") == 4 and moved("/v1/models/{model}", "404") == 1, after
    assert moved("other", "200") == moved("other", "404") == 0
    endpoints = {v for _, labels in after for k, v in labels if k == "endpoint"}
    assert {e for e in endpoints if e.startswith("/v1/models/")} == {"/v1/models/{model}"}, endpoints


@pytest.mark.parametrize(("method", "path", "words"), [
    ("POST", "/v1/chat/completions", "chat is not served: this code model has no chat template; use POST "
                                     "/v1/completions"),
    ("POST", "/api/chat", "chat is not served: this code model has no chat template; use POST /api/generate"),
    ("GET", "/v2/whatever", "GET /v2/whatever is not an endpoint of this server (GET /openapi.json lists them)"),
])
def test_a_404_says_what_is_served(server, method, path, words):
    """A path that is not an endpoint is a 404 saying so, and what to use where a client looks for another server's
    endpoint (chat): Starlette's bare "Not Found" told a client nothing."""
    r = httpx.request(method, f"{server.url}{path}", json={"model": "m31r"}, timeout=10)
    assert r.status_code == 404
    error = r.json()["error"]
    assert words in (error if path.startswith("/api/") else error["message"]), error


@pytest.mark.parametrize(("path", "body"), [
    ("/generate", {"prompt": "fn main() {", "max_tokens": 2}),
    ("/v1/completions", {"model": "m31r", "prompt": "fn main() {", "max_tokens": 2}),
    ("/api/generate", {"model": "m31r", "prompt": "fn main() {", "stream": False, "options": {"num_predict": 2}}),
    ("/infill", {"input_prefix": "fn main() {", "input_suffix": "}", "n_predict": 2}),
    ("/v1/fim/completions", {"model": "codestral-latest", "prompt": "fn main() {", "suffix": "}", "max_tokens": 2}),
    ("/v1/completions", {"language": "rust", "segments": {"prefix": "fn main() {", "suffix": "}"}}),
], ids=["native", "openai", "ollama", "llamacpp", "codestral", "tabby"])
def test_a_body_with_a_byte_order_mark_is_read(server, path, body):
    """A UTF-8 byte order mark before the JSON (a body a Windows tool saved) is skipped, as RFC 8259 allows: it was
    a 400 `bad_json` ("invalid character (byte 0)") on every endpoint."""
    r = httpx.post(f"{server.url}{path}", content=b"\xef\xbb\xbf" + json.dumps(body).encode(),
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_404_for_a_long_path_does_not_send_it_all_back(server):
    path = "/v2/" + "x" * 20_000
    r = httpx.get(f"{server.url}{path}", timeout=10)
    message = r.json()["error"]["message"]
    assert r.status_code == 404 and len(message) < 400, len(message)
    assert message.startswith(f"GET {path[:200]}… (20,004 characters) is not an endpoint of this server"), message


def test_the_connection_limit_is_a_json_503(tmp_path):
    """Past uvicorn's limit (MAX_CONNECTIONS connections, or requests being answered) a request is answered 503 in
    its path's error shape, with Retry-After, closing the connection (uvicorn's was plain text, without
    Retry-After); a page from an allowed origin (--cors-origin) can read it and its Retry-After, as the server's
    other refusals. The requests that fill the server here are /health checks whose clients left at once: the stalled
    daemon never answers Status, so each is answered (to nobody) only at the server's 2 s Status timeout."""
    stalled = StalledDaemon(tmp_path / "stalled.sock")
    origin = "http://localhost:5173"
    srv = Server(tmp_path, stalled.path, "--cors-origin", origin)
    try:
        assert httpx.get(f"{srv.url}/api/version", timeout=10).status_code == 200
        for _ in range(MAX_CONNECTIONS + 64):  # (a margin: the first checks may end before the last are read)
            with socket.create_connection(("127.0.0.1", srv.port)) as conn:
                conn.sendall(b"GET /health HTTP/1.1\r\n" + HOST + b"\r\n")
        for path, ollama in (("/v1/models", False), ("/api/version", True)):
            [(status, headers, body)] = exchange(srv, f"GET {path} HTTP/1.1\r\n".encode() + HOST + b"\r\n")
            assert status == 503 and headers["content-type"] == "application/json", body
            assert headers["retry-after"] == "1" and headers["connection"] == "close"
            error = json.loads(body)["error"]
            message = error if ollama else error["message"]
            if not ollama:
                assert error["code"] == "busy" and error["type"] == "server_error", error
            assert f"at its limit of {MAX_CONNECTIONS} connections or requests at once" in message, message
            assert "access-control-allow-origin" not in headers  # (no Origin: not a page's request)
        for sent, allowed in ((origin, True), ("http://evil.example", False)):
            [(status, headers, _)] = exchange(srv, b"POST /v1/completions HTTP/1.1\r\n" + HOST + (
                f"Origin: {sent}\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{{}}").encode())
            assert status == 503 and headers["retry-after"] == "1"
            if allowed:
                assert headers["access-control-allow-origin"] == origin and "origin" in headers["vary"].lower()
                assert "retry-after" in {h.strip().lower() for h in headers["access-control-expose-headers"].split(",")}
            else:
                assert "access-control-allow-origin" not in headers
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/api/version", timeout=10).status_code != 200:  # once the checks end
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        srv.stop()
        stalled.close()

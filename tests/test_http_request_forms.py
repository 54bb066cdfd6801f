"""Edges of `m31r serve` that clients meet before any completion: a path with a trailing slash, a compressed body, a
lone UTF-16 surrogate in a JSON string, and the connection layer's own refusals (400, 431, 408) read by a page from
an allowed origin.

The real server (with --cors-origin, and a short --header-timeout) in front of the shared real daemon, driven by
httpx and raw sockets (what a malformed request is).
"""

from __future__ import annotations

import gzip
import json
import socket
import time

import httpx
import pytest
from test_http import healthy_server, scrape
from test_http_wire import HOST, exchange

pytestmark = pytest.mark.timeout(120)

ORIGIN = "http://localhost:5173"
HEADER_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    # The origin as a user may write it, with a trailing slash (browsers send it without)
    yield from healthy_server(tmp_path_factory, "edges2", shared_daemon[1], "--cors-origin", ORIGIN + "/",
                              "--header-timeout", str(HEADER_TIMEOUT))


def test_an_origin_given_with_a_trailing_slash_is_allowed_by_every_layer(server):
    """`--cors-origin http://localhost:5173/` let the page's requests past the guard, but the CORS middleware compared
    the origin as given, so the page could read only the refusals, not the answers."""
    r = httpx.post(f"{server.url}/v1/completions", json=OPENAI, headers={"origin": ORIGIN}, timeout=60)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN, (r.status_code, r.headers)
    r = httpx.post(f"{server.url}/v1/completions", content=b"{", headers={"origin": ORIGIN}, timeout=60)
    assert r.status_code == 400 and r.headers["access-control-allow-origin"] == ORIGIN, (r.status_code, r.headers)


OPENAI = {"model": "m31r", "prompt": "fn main() {", "max_tokens": 2}
OLLAMA = {"model": "m31r", "prompt": "fn main() {", "stream": False, "options": {"num_predict": 2}}
INFILL = {"input_prefix": "fn main() {", "input_suffix": "}", "n_predict": 2}
CODESTRAL = {"model": "codestral-latest", "prompt": "fn main() {", "suffix": "}", "max_tokens": 2}
TABBY = {"language": "rust", "segments": {"prefix": "fn main() {", "suffix": "}"}}


def message_of(path: str, body: dict) -> str:
    """An error body's message, whatever the path's error shape (Ollama's string, Mistral's top-level message, the
    others' `error.message`)."""
    if path.startswith("/api/"):
        assert isinstance(body["error"], str), body
        return body["error"]
    if path == "/v1/fim/completions":
        assert body["object"] == "error", body
        return body["message"]
    return body["error"]["message"]


# -- 1. a trailing slash ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("method", "path", "body", "route"), [
    ("GET", "/v1/models/", None, "/v1/models"),
    ("GET", "/v1/models/m31r/", None, "/v1/models/{model}"),
    ("GET", "/health/", None, "/health"),
    ("POST", "/api/generate/", OLLAMA, "/api/generate"),
    ("POST", "/v1/completions/", OPENAI, "/v1/completions"),
    ("POST", "/v1/completions/", TABBY, "/v1/completions"),
    ("POST", "/infill/", INFILL, "/infill"),
    ("POST", "/v1/fim/completions/", CODESTRAL, "/v1/fim/completions"),
])
def test_a_trailing_slash_is_served_as_the_path_without_it(server, method, path, body, route):
    """One trailing slash is the path without it: Starlette answered a bare 307 to the slashless path, which curl
    without -L does not follow and some clients follow without the POST body. Metrics count it under its route."""
    with httpx.Client(base_url=server.url, timeout=60, follow_redirects=False) as http:
        before = scrape(http)
        r = http.request(method, path, json=body)
        assert r.status_code == 200, (r.status_code, r.headers, r.text)
        plain = http.request(method, path.rstrip("/"), json=body)
        assert r.headers["content-type"] == plain.headers["content-type"]
        if path.startswith("/v1/models"):
            assert r.json() == plain.json()
        after = scrape(http)
    key = ("m31r_http_requests_total", (("endpoint", route), ("status", "200")))
    assert after.get(key, 0) - before.get(key, 0) == 2, {k: v for k, v in after.items() if "requests_total" in k[0]}


def test_a_trailing_slash_keeps_errors_and_the_root_as_they_are(server):
    """An error at a slashed path has the slashless path's shape (llama.cpp's at /infill/, Ollama's under /api/); `/`
    is still Ollama's "is running"; two slashes are no endpoint (a 404 saying so, not a redirect)."""
    with httpx.Client(base_url=server.url, timeout=30, follow_redirects=False) as http:
        r = http.post("/infill/", json={"input_prefix": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text  # llama.cpp's: the status
        r = http.post("/api/generate/", json={"model": "m31r", "system": "x"})
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text
        r = http.get("/api/generate/")
        assert r.status_code == 405, r.text
        r = http.get("/")
        assert r.status_code == 200 and r.text == "Ollama is running"
        r = http.get("/v1/models//")
        assert r.status_code == 404 and "not an endpoint" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize(("path", "ollama", "doubled"), [
    ("/foo/", False, False),
    ("/api/nope/", True, False),
    ("/health//", False, False),  # (`/health/` is served: a 404 naming it sent its client the wrong way)
    ("//", False, False),
    ("//api/tags", False, True),  # a base URL `http://127.0.0.1:8731/` joined to `/api/tags`
    ("/v1//completions", False, True),
])
def test_a_404_names_the_path_as_sent(server, path, ollama, doubled):
    """A 404 names the path the client sent, its trailing slash too (`GET /foo/` was told `/foo` is not an endpoint,
    `GET /health//` that `/health/` is not, which is served), and points out a doubled slash inside it. Two slashes
    are no endpoint: `//` was served as `/` (Ollama's "is running"), where `/health//` is a 404."""
    r = httpx.get(f"{server.url}{path}", timeout=10)
    assert r.status_code == 404, r.text
    message = r.json()["error"] if ollama else r.json()["error"]["message"]
    assert message.startswith(f"GET {path} is not an endpoint of this server"), message
    assert ("doubled slash" in message) == doubled, message


@pytest.mark.parametrize(("method", "path", "ollama", "words"), [
    ("POST", "/", False, "POST /: this endpoint answers GET and HEAD only (Ollama's check that a server runs); to "
                         "complete code, POST to /v1/completions, /api/generate, /infill or /v1/fim/completions"),
    ("GET", "/v1/completions", False, "GET /v1/completions: this endpoint answers POST only"),
    ("GET", "/api/generate/", True, "GET /api/generate/: this endpoint answers POST only"),
    ("DELETE", "/v1/health", False, "DELETE /v1/health: this endpoint answers GET, HEAD and POST only"),
])
def test_a_405_says_which_methods_the_endpoint_answers(server, method, path, ollama, words):
    """A 405 says what the endpoint answers, and at `/` where completions are (a plugin given the server's address
    without its endpoint's path POSTs there): Starlette's message was "Method Not Allowed" alone."""
    r = httpx.request(method, f"{server.url}{path}", json={"prompt": "x"}, timeout=10)
    assert r.status_code == 405, r.text
    message = r.json()["error"] if ollama else r.json()["error"]["message"]
    assert message == words, message


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/api/generate", "/api/show", "/infill",
                                  "/v1/fim/completions", "/v1/events"])
@pytest.mark.parametrize("body", [b"", b" \r\n"], ids=["empty", "blank"])
def test_a_request_without_a_body_is_told_so(server, path, body):
    """A POST without a body (curl -X POST with no -d) is a 400 saying there is none: it was "the body is not valid
    JSON: Input data was truncated", which sent its client looking for a body cut short."""
    r = httpx.post(f"{server.url}{path}", content=body, headers={"content-type": "application/json"}, timeout=10)
    assert r.status_code == 400, r.text
    message = message_of(path, r.json())
    assert "the request has no body: send a JSON object" in message and "truncated" not in message, message


# -- 2. a compressed body ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", OPENAI), ("/v1/completions", TABBY), ("/api/generate", OLLAMA), ("/infill", INFILL),
    ("/v1/fim/completions", CODESTRAL), ("/generate", {"prompt": "fn main() {", "max_tokens": 2}),
], ids=["openai", "tabby", "ollama", "llamacpp", "codestral", "native"])
@pytest.mark.parametrize("encoding", ["gzip", "br", "gzip, identity"])
def test_a_compressed_body_is_a_415_saying_to_send_it_uncompressed(server, path, body, encoding):
    """A body with a Content-Encoding other than identity is a 415 naming the encoding and asking for the body
    uncompressed, in the path's error shape, readable by an allowed page: it was a 400 "not valid JSON"."""
    raw = gzip.compress(json.dumps(body).encode())
    r = httpx.post(f"{server.url}{path}", content=raw, timeout=30, headers={
        "content-type": "application/json", "content-encoding": encoding, "origin": ORIGIN})
    assert r.status_code == 415, r.text
    message = message_of(path, r.json())
    assert f"Content-Encoding: {encoding}" in message and "uncompressed" in message, message
    if path == "/infill":
        assert r.json()["error"]["code"] == 415
    elif not path.startswith("/api/") and path != "/v1/fim/completions":
        assert r.json()["error"]["code"] == "unsupported_encoding"
    assert r.headers["accept-encoding"] == "identity"
    assert r.headers["access-control-allow-origin"] == ORIGIN
    r = httpx.post(f"{server.url}{path}", json=body, headers={"content-encoding": "identity"}, timeout=60)
    assert r.status_code == 200, r.text


def test_two_content_encodings_are_read_together_and_a_charset_there_is_no_coding(server):
    """Two Content-Encoding headers are one list (the last, `identity`, hid the `gzip` before it); a charset put in
    the header by mistake (`UTF-8`: no content coding) is not a compressed body, and was served before the 415."""
    raw = gzip.compress(json.dumps(OPENAI).encode())
    head = [("content-type", "application/json"), ("content-encoding", "gzip"), ("content-encoding", "identity")]
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers=head, timeout=30)
    assert r.status_code == 415 and "gzip, identity" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{server.url}/v1/completions", json=OPENAI, headers={"content-encoding": "UTF-8"}, timeout=60)
    assert r.status_code == 200, r.text


# -- 3. a lone surrogate ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "raw", "where"), [
    ("/v1/completions", rb'{"prompt": "fn main", "stop": ["\ud800"]}', "stop[0]"),
    ("/generate", rb'{"prompt": "fn \udc00 main", "max_tokens": 2}', "prompt"),
    ("/api/generate", rb'{"model": "m31r", "prompt": "fn main\uD83D"}', "prompt"),
    ("/v1/completions", rb'{"prompt": "fn main", "stop": ["\ud800\u0041"]}', "stop[0]"),
])
def test_a_lone_surrogate_is_a_400_saying_so(server, path, raw, where):
    """A \\ud800-\\udfff escape not in a high-low pair is a 400 saying so and where (the field, the byte): msgspec's
    message was "Input data was truncated", or "invalid utf-16 surrogate pair"."""
    r = httpx.post(f"{server.url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    message = message_of(path, r.json())
    assert "lone UTF-16 surrogate" in message and where in message and "byte " in message, message
    assert "truncated" not in message, message
    if not path.startswith("/api/"):
        err = r.json()["error"]
        assert err["code"] == "bad_json" and err["param"] == where, err


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"], ids=["plain", "bom"])
def test_a_lone_surrogates_byte_is_counted_in_the_body_as_sent(server, bom):
    """The byte named is the escape's offset in the body the client sent: behind a UTF-8 byte order mark (which the
    server skips) it was 3 short."""
    raw = bom + rb'{"prompt": "fn main\ud800", "max_tokens": 2}'
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    at = raw.index(rb"\ud800")
    assert f"at byte {at})" in r.json()["error"]["message"], r.text


PAIR = rb'{"prompt": "fn main", "max_tokens": 2, "stop": ["\ud83d\ude00"]}'  # a pair: an emoji
ESCAPED = rb'{"prompt": "fn main \\ud800", "max_tokens": 2}'  # an escaped backslash, then text


@pytest.mark.parametrize("raw", [PAIR, ESCAPED], ids=["pair", "escaped-backslash"])
def test_surrogate_pairs_and_escaped_backslashes_are_served(server, raw):
    r = httpx.post(f"{server.url}/v1/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [b'{"prompt": "fn main', PAIR[:-1], ESCAPED[:-1]],
                         ids=["plain", "pair", "escaped-backslash"])
def test_a_truncated_body_is_still_called_so(server, raw):
    """A body that is not JSON for another reason is the scan's case (it runs only when msgspec refuses a body): a
    surrogate pair or an escaped backslash before `ud800` in it is no lone surrogate."""
    r = httpx.post(f"{server.url}/v1/completions", content=raw, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "surrogate" not in r.text and "not valid JSON" in r.text, r.text


# -- 4. the connection layer's refusals ------------------------------------------------------------------------


def with_origin(origin: str | None) -> bytes:
    return f"Origin: {origin}\r\n".encode() if origin else b""


@pytest.mark.parametrize(("head", "tail", "status"), [
    (b"POST /v1/completions HTTP/1.1\r\n" + HOST, b"Content-Length: zz\r\n\r\n", 400),
    (b"GET /api/tags HTTP/1.1\r\n" + HOST, b"Bad Header\r\n\r\n", 400),
    (b"GET /api/tags HTTP/1.1\r\n" + HOST, b"X-Big: " + b"a" * 20000, 431),
    (b"GET /health HTTP/1.1\r\n" + HOST, b"X-Slow: a", 408),  # the header timeout
], ids=["bad-length", "bad-header", "too-large", "header-timeout"])
@pytest.mark.parametrize("origin", [ORIGIN, "http://evil.example", None])
def test_the_connection_layers_refusals_are_readable_by_an_allowed_page(server, head, tail, status, origin):
    """The refusals uvicorn's protocol answers itself (a request that is not valid HTTP, a header block too large,
    headers not in by --header-timeout) carry the CORS headers the app's answers carry, for an allowed Origin among
    the header lines that did arrive; none for any other."""
    [(got, headers, body)] = exchange(server, head + with_origin(origin) + tail)
    assert got == status, body
    if origin == ORIGIN:
        assert headers["access-control-allow-origin"] == ORIGIN and "origin" in headers["vary"].lower(), headers
        assert "retry-after" in headers["access-control-expose-headers"].lower()
    else:
        assert "access-control-allow-origin" not in headers, headers


# A Referer of 6 KB (a page's address with a long query), which Firefox sends before the Origin header.
LONG_REFERER = f"Referer: {ORIGIN}/?q={'x' * 6000}\r\n".encode()


@pytest.mark.parametrize(("head", "tail", "status"), [
    (b"GET /api/tags HTTP/1.1\r\n" + HOST, b"Bad Header\r\n\r\n", 400),
    (b"GET /api/tags HTTP/1.1\r\n" + HOST, b"X-Big: " + b"a" * 20000, 431),
    (b"GET /health HTTP/1.1\r\n" + HOST, b"X-Slow: a", 408),
], ids=["bad-header", "too-large", "header-timeout"])
def test_an_origin_after_kilobytes_of_headers_is_found_by_the_connection_layer(server, head, tail, status):
    """The connection layer's refusals find an allowed Origin that comes after 4 KiB of other header lines, as the
    app does: only a request's first 4 KiB were read for it, so a page sending a long Referer could not read them."""
    [(got, headers, body)] = exchange(server, head + LONG_REFERER + with_origin(ORIGIN) + tail)
    assert got == status, body
    assert headers.get("access-control-allow-origin") == ORIGIN, headers


@pytest.mark.parametrize("origin", [ORIGIN, None])
def test_a_body_that_is_not_valid_http_is_refused_in_its_paths_shape(server, origin):
    """A chunked body whose chunk header is not valid, arriving after its request's headers were read, is a 400 in
    its path's error shape (Ollama's under /api/), with CORS headers for an allowed Origin: the path and Origin were
    read only from a request's start, so it was OpenAI's shape, and no CORS headers."""
    with socket.create_connection(("127.0.0.1", server.port)) as conn:
        conn.settimeout(10)
        conn.sendall(b"POST /api/generate HTTP/1.1\r\n" + HOST + with_origin(origin) +
                     b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n5\r\n{\"mod\r\n")
        time.sleep(0.3)  # the headers are read, and the request handed to the app
        conn.sendall(b"zz\r\n")
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), received
    error = json.loads(body)["error"]
    assert isinstance(error, str) and "illegal chunk header" in error, error
    assert (f"access-control-allow-origin: {ORIGIN}".encode() in head.lower()) == (origin is not None), head

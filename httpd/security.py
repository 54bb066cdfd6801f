"""What keeps a localhost HTTP server local (README "HTTP adapter").

- DNS rebinding: a web page can make the browser send requests to 127.0.0.1 under the attacker's own host
  name, so the Host header must be a loopback name or address (or a host allowed explicitly); else 403.
- Browsers: no CORS headers by default, and a request carrying an Origin that is not on the allow-list is
  refused (403) before it costs any compute; a page's "simple" cross-origin POST would otherwise run.
- An optional bearer token, read from a file only its owner can read (mode 0600 or stricter).
- A request's body must arrive within --body-timeout of its headers (408 past it, the connection closed): uvicorn
  waits for a body as long as the client likes, so one that trickles its body, or stops mid-way, would otherwise
  hold its connection and task for good. (Uvicorn has no timeout for headers either: connection.py adds one,
  --header-timeout.)
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
import os
import re
import stat
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

import msgspec
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from m31r_http.schemas import CodestralError, ErrorDetail, ErrorResponse, LlamaCppError, LlamaCppErrorDetail

log = logging.getLogger("m31r_http")

LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    """A loopback name (localhost, *.localhost) or address (127.0.0.0/8, ::1). No DNS lookups."""
    h = host.strip().strip("[]").rstrip(".").lower()
    if h in LOOPBACK_NAMES or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_of(header: str) -> str:
    """The host name of a Host header value, without its port: "[::1]:8731" → "::1"."""
    h = header.strip()
    if h.startswith("["):
        end = h.find("]")
        return h[1:end].lower() if end > 0 else h.lower()
    if h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".").lower()


def _url_part(url: str, part: str) -> str | None:
    """A part of `url` for an error message's example (None where Python cannot split it: `http://[::1/`)."""
    try:
        return getattr(urllib.parse.urlsplit(url), part) or None
    except ValueError:
        return None


def check_allowed_host(value: str) -> str:
    """`value` as --allowed-host takes it: a name or address as a Host header carries it (its port, if given, is not
    compared), or "*". ValueError for a URL or anything with a path: no Host header ever names one, so every request
    was refused with a 403 telling the user to pass the --allowed-host they had passed."""
    v = value.strip()
    if v == "*" or (v and not any(c.isspace() or c in "/@?#" for c in v)):
        return v
    name = _url_part(v if "://" in v else f"//{v}", "hostname")
    example = f": --allowed-host {name}" if name and not any(c.isspace() for c in name) else ""
    raise ValueError(f"--allowed-host {value!r} is not a host name: give the name or address a request's Host "
                     f"header carries, without a scheme, user or path{example}")


# An Origin header's value (RFC 6454): scheme://host[:port], nothing after it.
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@\s]+")


def check_origin(value: str) -> str:
    """`value` as --cors-origin takes it, in the form browsers send: without a trailing slash, its scheme in lower case
    and an http(s) host too (the URL standard's serialisation; the CORS middleware compares origins exactly), or "*"
    or "null". ValueError for what no browser sends as an Origin (no scheme, a path): the server would refuse every
    request from the page with a 403 telling the user to pass the --cors-origin they had passed."""
    v = value.strip().rstrip("/")
    if v in ("*", "null"):
        return v
    scheme, _, rest = v.partition("://")
    if _ORIGIN.fullmatch(v.lower()):
        scheme = scheme.lower()
        return f"{scheme}://{rest.lower() if scheme in ('http', 'https') else rest}"
    url = v if "://" in v else f"http://{v}"
    host = (_url_part(url, "netloc") or "").rpartition("@")[2]
    example = f": --cors-origin {_url_part(url, 'scheme')}://{host}".lower() if host else ""
    raise ValueError(f"--cors-origin {value!r} is not an origin: give it as browsers send it, scheme://host[:port] "
                     f"with no path{example}")


class HostPolicy:
    def __init__(self, allowed_hosts: Iterable[str] = ()):
        self.allowed = frozenset(host_of(h) for h in allowed_hosts if h)

    def allows(self, header: str | None) -> bool:
        if not header:
            return False
        h = host_of(header)
        return "*" in self.allowed or h in self.allowed or is_loopback(h)


def load_token(path: str | Path) -> str:
    """The bearer token in `path`; ValueError unless the file is the user's own, readable by nobody else."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as e:
        raise ValueError(f"--token-file {p}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"--token-file {p}: not a regular file")
    if st.st_uid != os.getuid():
        raise ValueError(f"--token-file {p}: owned by uid {st.st_uid}, not by this user")
    if st.st_mode & 0o077:
        raise ValueError(f"--token-file {p}: mode {stat.S_IMODE(st.st_mode):04o} lets others read it; "
                         f"run `chmod 600 {p}`")
    token = p.read_text(encoding="utf-8").strip()
    if not token or any(c.isspace() for c in token):
        raise ValueError(f"--token-file {p}: expected one token (no whitespace inside), found "
                         f"{'nothing' if not token else 'several words'}")
    return token


OLLAMA_PREFIX = "/api/"  # Ollama's API (ollama.py): its clients read errors as {"error": "message"}
# llama.cpp server's endpoints (llamacpp.py): its plugins read {"error": {"code": <status>, "message", "type"}}
LLAMACPP_PATHS = frozenset({"/infill"})
# Mistral's Codestral API (codestral.py): {"object": "error", "message", "type", "param", "code"}
CODESTRAL_PATHS = frozenset({"/v1/fim/completions"})
LLAMACPP_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                  404: "not_found_error", 501: "not_supported_error", 503: "unavailable_error"}


def error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """An error as OpenAI's API writes one (`param`: the field at fault, when one is)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return msgspec.json.encode(ErrorResponse(ErrorDetail(code=code, message=message, type=kind, param=param)))


def llamacpp_error_body(status: int, code: str, message: str) -> bytes:
    """An error as llama.cpp's server writes one: `code` is the HTTP status, `type` its kind (llama.cpp's names;
    a context overflow is its exceed_context_size_error)."""
    kind = "exceed_context_size_error" if code == "context_overflow" else LLAMACPP_TYPES.get(
        status, "invalid_request_error" if status < 500 else "server_error")
    return msgspec.json.encode(LlamaCppError(LlamaCppErrorDetail(code=status, message=message, type=kind)))


def codestral_error_body(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """An error as Mistral's API writes one (`code` is this server's, where Mistral's is a number or null)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return msgspec.json.encode(CodestralError(object="error", message=message, type=kind, param=param, code=code))


def served_path(path: str) -> str:
    """The path a request is served as: one trailing slash dropped, as app.TrailingSlash does. Not where that would
    leave a path ending with a slash (`/` itself, `//`, `/health//`): two slashes are no endpoint, so `//` is not
    served as `/`."""
    return path[:-1] if len(path) > 1 and path.endswith("/") and not path.endswith("//") else path


def error_body_for(path: str, status: int, code: str, message: str, param: str | None = None) -> bytes:
    """An error in the shape the path's clients read: Ollama's under /api/, llama.cpp's and Mistral's on theirs, else
    OpenAI's (a path with one trailing slash is the path without it, as the app serves it). Shapes without a `param`
    name the field in the message."""
    said = f"{param}: {message}" if param and not message.startswith(param) else message
    path = served_path(path)
    if path.startswith(OLLAMA_PREFIX):
        return msgspec.json.encode({"error": message})
    if path in LLAMACPP_PATHS:
        return llamacpp_error_body(status, code, said)
    if path in CODESTRAL_PATHS:
        return codestral_error_body(status, code, message, param)
    return error_body(status, code, message, param)


async def send_error(send: Send, path: str, status: int, code: str, message: str,
                     headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """An error before routing, in the shape the path's clients read."""
    body = error_body_for(path, status, code, message)
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})


CLOSE = (b"connection", b"close")
EXPOSED_HEADERS = ("retry-after", "x-m31r-ignored-options")  # the answers' headers an allowed page may read


def allowed_origin(origins: frozenset[str], origin: bytes | None) -> bool:
    """An Origin header on the --cors-origin list (origins as given, without a trailing slash; "*": any)."""
    return origin is not None and (origin.decode("latin-1").rstrip("/") in origins or "*" in origins)


def refusal_cors(origins: frozenset[str], origin: bytes | None) -> list[tuple[bytes, bytes]]:
    """CORS headers for an answer the CORS middleware never sees (the server's refusals, the connection limit's 503),
    so that a page from an allowed origin can read it and its Retry-After; none for any other request."""
    if not allowed_origin(origins, origin):
        return []
    assert origin is not None
    return [(b"access-control-allow-origin", b"*" if "*" in origins else origin), (b"vary", b"Origin"),
            (b"access-control-expose-headers", ", ".join(EXPOSED_HEADERS).encode())]


CLOSED_BY_SERVER = "m31r.closed_by_server"  # scope key: why the server closed a connection whose body was pending


class BodyTimeout(Exception):
    """The request's body did not arrive within the body timeout."""


class BodyWatch:
    """The request's `receive`, under a deadline while the body is still to come: `timeout` seconds from the
    headers for all of it (not per chunk, which a client trickling a byte at a time would meet forever). Once the
    body is in, `receive` waits untimed: it then only waits for a disconnect while the answer is worked out or
    streams, which the request timeout bounds."""

    def __init__(self, receive: Receive, headers: dict[str, bytes], timeout: float | None):
        self.receive = receive
        length = headers.get("content-length", b"")
        self.pending = (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers  # body still to come
        self.deadline = asyncio.get_running_loop().time() + timeout if timeout is not None else None

    async def __call__(self) -> Message:
        if not self.pending or self.deadline is None:
            return await self.receive()
        try:
            async with asyncio.timeout_at(self.deadline):
                message = await self.receive()
        except TimeoutError:
            raise BodyTimeout from None
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.pending = False  # the whole body, or the client left
        return message


# HTTP's content codings (IANA's registry) but identity: a body in one of them is not the JSON it holds.
CODINGS = frozenset({"aes128gcm", "br", "compress", "dcb", "dcz", "deflate", "exi", "gzip", "pack200-gzip",
                     "x-compress", "x-gzip", "zstd"})


def encoded(headers: list[tuple[bytes, bytes]]) -> str:
    """The Content-Encoding headers' value as sent (all of them, as one list) when it names a content coding, else "".
    A name that is none (`Content-Encoding: UTF-8`, a charset some scripts put there) says nothing about the body,
    which is served as it is, as before."""
    value = ", ".join(v.decode("latin-1").strip() for k, v in headers if k == b"content-encoding")
    return value if any(c.strip().lower() in CODINGS for c in value.split(",")) else ""


class GuardMiddleware:
    """Host check, Origin check, bearer token, declared body size and encoding, and the body's deadline, before any
    routing or body reading.

    CORS preflights (OPTIONS with Access-Control-Request-Method) from allowed origins pass through to the CORS
    middleware inside; everything else needs a good Host, an allowed (or no) Origin, and the token if one is set.
    An answer sent before the request's body is all in (a refusal, a 408) closes the connection: reading the rest
    of a body nobody wants would keep it for as long as the client takes to send it. (Closed after a bounded
    linger, connection.py, so that a client still sending reads the answer rather than a reset.)
    """

    def __init__(self, app: ASGIApp, *, hosts: HostPolicy, origins: Iterable[str] = (), token: str | None = None,
                 max_body: int | None = None, body_timeout: float | None = None):
        self.app, self.hosts, self.max_body, self.body_timeout = app, hosts, max_body, body_timeout
        self.origins = frozenset(origins)  # (as ServeSettings keeps them: without a trailing slash)
        self.token = token.encode() if token else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1"): v for k, v in scope["headers"]}
        origin = headers.get("origin")
        o = origin.decode("latin-1").rstrip("/") if origin is not None else None
        # An allowed page must be able to read these refusals too: the CORS middleware inside never sees them.
        cors = refusal_cors(self.origins, origin)
        body = BodyWatch(receive, headers, self.body_timeout)
        started = False

        async def answer(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if body.pending and CLOSE not in message.get("headers", []):
                    message = {**message, "headers": [*message.get("headers", []), CLOSE]}
            await send(message)

        async def refuse(status: int, code: str, message: str, extra: tuple[tuple[bytes, bytes], ...] = ()) -> None:
            await send_error(answer, scope["path"], status, code, message, [*extra, *cors])

        host = headers.get("host", b"").decode("latin-1")
        if not host.strip():  # (an HTTP/1.0 client may send none; no --allowed-host would admit it)
            return await refuse(403, "forbidden_host", "the request has no Host header, which this server requires "
                                                       "(its defence against DNS rebinding): send Host: 127.0.0.1")
        if not self.hosts.allows(host):
            return await refuse(403, "forbidden_host", (
                f"Host {host!r} is not a loopback name; start the server with --allowed-host to accept it"))
        if o is not None and not cors:
            return await refuse(403, "forbidden_origin", (
                f"Origin {o!r} is not allowed; start the server with --cors-origin to allow it"))
        preflight = scope["method"] == "OPTIONS" and "access-control-request-method" in headers
        if self.token is not None and not preflight:
            auth = headers.get("authorization", b"")
            scheme, _, given = auth.partition(b" ")
            given = given.strip() if scheme.lower() == b"bearer" else b""
            if not hmac.compare_digest(given, self.token):
                # A token sent but wrong (an editor left with an old one) is told so, not asked for.
                why = "the bearer token is not this server's (its --token-file)" if given else (
                    "a bearer token is required")
                return await refuse(401, "unauthorized", why, ((b"www-authenticate", b'Bearer realm="m31r"'),))
        length = headers.get("content-length", b"")
        if self.max_body is not None and length.isdigit() and int(length) > self.max_body:
            # A declared size over the limit is refused before reading. (Starlette's per-route limit, inside,
            # catches bodies that grow past it without declaring a size.)
            return await refuse(413, "too_large", (
                f"the request body ({int(length)} bytes) exceeds this server's limit of {self.max_body} bytes"))
        if body.pending and (coded := encoded(scope["headers"])):
            # Starlette hands the endpoints the bytes as sent: a compressed body would be "not valid JSON", which
            # sends its client looking in the wrong place.
            return await refuse(415, "unsupported_encoding", (
                f"the request body has Content-Encoding: {coded}, which this server does not decode; send the body "
                "uncompressed (without a Content-Encoding header)"), ((b"accept-encoding", b"identity"),))
        try:
            await self.app(scope, body, answer)
        except BodyTimeout:
            if started:  # (every endpoint reads its body before it answers)
                raise
            await refuse(408, "timeout", f"the request's body did not arrive within {self.body_timeout:g}s of its "
                                         "headers (m31r serve --body-timeout)")
        except ClientDisconnect:  # the client left before its body was in: nobody to answer, nothing went wrong
            if started:
                raise
            if CLOSED_BY_SERVER in scope:  # (connection.py closed it for room, with a 408, and said so)
                return
            log.info("a client closed its connection before sending all of its request's body (%s %s)",
                     scope.get("method"), scope["path"])

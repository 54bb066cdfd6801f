"""Uvicorn's h11 connection protocol with a deadline for request headers (`m31r serve --header-timeout`).

Uvicorn times a connection out only while it sits idle after an answer (its keep-alive timeout, which any byte
cancels); a connection that has just opened, or a client that sends its header block a byte every few seconds and
never ends it, holds the connection (one of `MAX_CONNECTIONS`) for as long as it likes, and enough such clients
(Slowloris) have every other client answered 503. Here the header block must be complete within `header_timeout`
seconds of the connection opening or of the previous answer's end (the body has its own deadline, BodyWatch in
security.py): past it a client that had begun a header block is answered 408, and the connection is closed.

The deadlines alone do not keep such clients from crowding others out: at uvicorn's connection limit
(`limit_concurrency`, past which every request is answered 503) a client opening ~50 connections a second, each
left waiting for its headers (or ~17 a second, each left waiting for its body), would keep the server full for good.
So a connection opened at the limit (ROOM_MARGIN short of it) makes room: of the connections waiting for their
client (for a request's headers: idle keep-alive ones and tricklers; or for the rest of a body, before any answer)
the one that has waited longest is closed, with a 408 if it had begun a request. Connections whose requests are
being answered are never closed for room.

Uvicorn's own answers are plain text, where every other error of the API is JSON in the path's error shape (README
"HTTP adapter"), which is what clients parse: its 503 at the connection limit and its 400 for a request that is not
valid HTTP. Here they are JSON in that shape: the 503 with Retry-After, the 400 saying what h11 found wrong (a 431
where the header block is too large). These, and the 408 above, use the request line's path for the shape (Ollama's
under /api/, llama.cpp's at /infill) once it has arrived, OpenAI's before; and they carry CORS headers for a page from
an allowed origin (--cors-origin), as the app's answers do, where the request's Origin is known: from its headers, or
from the header lines that arrived whole (HEAD_KEPT bytes of them) when its header block was not valid or not
finished.

An answer sent before the request's body was all in (a refusal: 413, 403, 415..., or a 408) ends with `Connection:
close`, and uvicorn then closed the socket at once, with the client's unread body in it: the kernel answers that, and
every byte the client still sends, with a reset, and a client still uploading (Python's http.client, for one) saw
ECONNRESET or EPIPE instead of the answer. Here the connection lingers instead, as Apache's and nginx's do: the answer
is sent and the write side shut (the client reads it, then EOF), and what the client still sends is read and
discarded, for at most LINGER_SECONDS and LINGER_BYTES, before the connection is closed. A lingering connection is the
first to go for room at the connection limit (it has been answered), so an endless or slow uploader costs nobody.

A client may send its request and then shut its sending side (shutdown(SHUT_WR): a script piping into nc, a client
that signals "no more requests" so): HTTP/1.1 lets it read the answer, but uvicorn took the EOF for a disconnect,
closed the connection and cancelled the request. Here an EOF after whole requests keeps the connection open: they are
answered, then it is closed; an EOF within a request (or between requests) closes it, the part unanswered. A client
that has closed its socket altogether sends the same EOF, and must still have its daemon request cancelled (an
editor that moves on drops the connection): its kernel answers the next bytes sent to it with a reset. So at the EOF,
before the answer has begun, a `100 Continue` is sent (an interim response that every HTTP/1.1 client must accept,
and skips), and until the answer is written the socket's error is polled: a reset closes the connection, which the
app sees as a disconnect, as before. Once the answer has begun, its own writes bring the reset.

The class is also used where httptools is installed (uvicorn would pick its httptools protocol), so the deadline
holds whatever uvicorn's extras are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import socket
import sys
import time
import urllib.parse
from collections.abc import Iterable
from typing import Any

import h11
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from m31r_http.security import CLOSED_BY_SERVER, error_body_for, refusal_cors

log = logging.getLogger("m31r_http")

# Room is made this far below uvicorn's limit: a request whose connection was closed for room ends a few loop turns
# later, and till then uvicorn counts its task against the same limit (it answers 503 when connections or tasks
# reach it).
ROOM_MARGIN = 16
_turns = itertools.count()  # the order in which connections began waiting (uvloop's clock has 1 ms steps)
H11_HEADER_LIMIT = 16 * 1024  # h11's default limit of a header block, which uvicorn keeps unless configured
# Bytes of a request's start kept to read its path and Origin from (for an error before its headers are parsed: its
# shape, and CORS headers for an allowed page): as much as h11 takes of a header block, so that an Origin after
# kilobytes of other headers (a long Referer, cookies) is found as the app finds it; 4 KiB lost it, and the page
# could not read the error.
HEAD_KEPT = H11_HEADER_LIMIT
LIMIT_RETRY_AFTER = 1  # seconds, in the 503 at the connection limit: the server's own requests end within a timeout
# After an answer sent before the request was all in: how long, and how much of the rest, is read and discarded
# before the connection is closed (a client sending more still sees a reset, but has its answer by then).
LINGER_SECONDS = 5.0  # (nginx's lingering_timeout)
LINGER_BYTES = 8 << 20
# After a client's EOF past a whole request: how soon, and then how often at most, the socket is checked for a reset
# (a client that is gone, not half-closed). The reset comes a round trip after the 100 Continue; each check is one
# getsockopt, while the answer is worked out.
RESET_CHECK_FIRST = 0.005
RESET_CHECK_MAX = 0.5


def request_path(head: bytes) -> str:
    """The path of the request line at the start of `head`, once it has arrived whole (as uvicorn decodes it into the
    scope); "" before, or when it is not a request line."""
    line, newline, _ = head.partition(b"\n")
    parts = line.rstrip(b"\r").split(b" ")
    if not newline or len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return ""
    target = parts[1].decode("latin-1").partition("?")[0]
    if not target.startswith("/"):  # absolute-form, as a proxy sends it: http://host/path
        target = urllib.parse.urlsplit(target).path
    return urllib.parse.unquote(target)


def request_origin(head: bytes) -> bytes | None:
    """The Origin header among the header lines of `head` that arrived whole (a request h11 could not parse, or whose
    header block was cut short), None where none did."""
    for line in head.split(b"\n")[1:-1]:  # past the request line; the last piece may be cut short
        name, colon, value = line.rstrip(b"\r").partition(b":")
        if not name:  # the blank line ending the header block
            break
        if colon and name.strip().lower() == b"origin":
            return value.strip()
    return None


def scope_origin(scope: Scope) -> bytes | None:
    return next((v for k, v in scope["headers"] if k == b"origin"), None)


class LingeringClose:
    """The connection's transport as a request's cycle (uvicorn's RequestResponseCycle) uses it, but for close: that
    lingers, where the answer left the request's body unread (HeaderTimeoutProtocol.close_after_answer). Uvicorn
    closes the transport itself once an answer with `Connection: close` is sent, with no hook in between."""

    def __init__(self, protocol: HeaderTimeoutProtocol) -> None:
        self.protocol = protocol

    def __getattr__(self, name: str) -> Any:
        return getattr(self.protocol.transport, name)

    def close(self) -> None:
        self.protocol.close_after_answer()


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers are not all in by a deadline, and makes
    room at the connection limit; use `with_header_timeout` for a class with the timeout set (uvicorn.Config takes a
    class, and builds one per connection)."""

    header_timeout: float = 10.0
    cors_origins: frozenset[str] = frozenset()  # --cors-origin: pages from these may read this layer's refusals
    header_timer: asyncio.TimerHandle | None = None
    waiting_since = 0.0  # when the client's turn began (the header deadline's start), time.monotonic()
    turn = 0  # the order of waiting_since
    head = b""  # the start of the request whose headers are awaited (up to HEAD_KEPT bytes): its path, once in
    linger_left: int | None = None  # bytes still to be read and discarded while lingering (None: not lingering)
    linger_timer: asyncio.TimerHandle | None = None
    half_closed = False  # the client sent EOF after whole requests: they are answered, then the connection closed
    reset_timer: asyncio.TimerHandle | None = None
    reset_wait = RESET_CHECK_FIRST

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Uvicorn's own check of the limit answers plain text: this protocol checks it instead (at_limit), so
        # uvicorn's is off, and every request goes through limit_guard.
        self.connection_limit, self.limit_concurrency = self.limit_concurrency, None
        self.served_app, self.app = self.app, self.limit_guard

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.watch_headers()
        self.make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_header_timer()
        for timer in (self.linger_timer, self.reset_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        """The client's EOF: past a whole request being answered, a half-close (the connection stays open for the
        answers, then closes: on_response_complete); anywhere else (between requests, within one, lingering) the
        connection closes, as uvicorn closes it. (Called again where reading resumes after a pause.)"""
        if self.linger_left is not None or not self.answering():
            return None
        if not self.half_closed:
            self.half_closed = True
            self.probe_client()
        return True

    def answering(self) -> bool:
        """A request is all in and its answer not yet all written."""
        return (self.cycle is not None and not self.cycle.response_complete
                and self.conn.their_state in (h11.DONE, h11.MUST_CLOSE))

    def probe_client(self) -> None:
        """Tell a half-closed client from a gone one: where no answer has begun, a 100 Continue (HTTP/1.1 only; one
        of HTTP/1.0 must not get one), which a gone client's kernel answers with a reset; then check_reset."""
        assert self.cycle is not None
        if not self.cycle.response_started and self.conn.their_http_version == b"1.1":
            interim = h11.InformationalResponse(status_code=100, headers=[], reason=STATUS_PHRASES[100])
            self.transport.write(self.conn.send(interim) or b"")
            self.cycle.waiting_for_100_continue = False  # (uvicorn's for Expect: 100-continue would repeat it)
        self.reset_wait = RESET_CHECK_FIRST
        self.reset_timer = self.loop.call_later(self.reset_wait, self.check_reset)

    def check_reset(self) -> None:
        """Close the half-closed connection once its client has answered with a reset (it is gone: its request is
        cancelled, as uvicorn's disconnect does it); else check again later, till the connection closes."""
        self.reset_timer = None
        if self.transport.is_closing():
            return
        sock = self.transport.get_extra_info("socket")
        try:
            error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) if sock is not None else 0
        except OSError as e:
            error = e.errno or -1
        if error:
            log.debug("closed a connection: its client closed it after its request (%s)", os.strerror(error)
                      if error > 0 else "gone")
            self.transport.abort()
            return
        self.reset_wait = min(self.reset_wait * 2, RESET_CHECK_MAX)
        self.reset_timer = self.loop.call_later(self.reset_wait, self.check_reset)

    def data_received(self, data: bytes) -> None:
        if self.linger_left is not None:  # the rest of a request already answered: discarded
            self.linger_left -= len(data)
            if self.linger_left <= 0:
                self.transport.close()
            return
        if self.awaiting_headers() and len(self.head) < HEAD_KEPT:
            self.head += data[:HEAD_KEPT - len(self.head)]  # (h11 consumes what it parses, a bad line too)
        super().data_received(data)

    def handle_events(self) -> None:
        self.keep_head()
        super().handle_events()
        if self.cycle is not None and self.cycle.transport is self.transport:  # a new request's cycle
            self.cycle.transport = LingeringClose(self)  # type: ignore[assignment]
        if not self.awaiting_headers():
            self.head = b""  # the request's headers are in: the scope has its path
        self.keep_head()
        self.watch_headers()  # a request's headers came in (stop), or a new cycle began after a body (start)

    def keep_head(self) -> None:
        """At a new cycle's start, the next request's start that is in already (pipelined after the last one)."""
        if not self.head and self.awaiting_headers():
            self.head = self.conn.trailing_data[0][:HEAD_KEPT]

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.half_closed and not self.transport.is_closing() and self.awaiting_headers():
            self.transport.close()  # the client sends no more: the answers written, EOF (a part after them dropped)
        self.watch_headers()  # keep-alive: the next request's headers are now awaited (unless pipelined, in)

    # -- uvicorn's own answers, in the API's error shape ---------------------------------------------------------

    def at_limit(self) -> bool:
        """Uvicorn's test for its 503 (connections, or requests being answered, at limit_concurrency), made while
        this request's own task is already counted."""
        limit = self.connection_limit
        if limit is None:
            return False
        others = len(self.tasks) - (asyncio.current_task() in self.tasks)
        return len(self.connections) >= limit or others >= limit

    async def limit_guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app, unless the server is at its connection limit: then a 503 with Retry-After in the path's error
        shape, closing the connection (uvicorn's was plain text)."""
        if scope["type"] != "http" or not self.at_limit():
            return await self.served_app(scope, receive, send)
        log_every("limit", logging.WARNING, "%d connections or requests at once, the server's limit: answering 503 "
                  "to new requests", self.connection_limit)
        body = error_body_for(scope["path"], 503, "busy", (
            f"the server is at its limit of {self.connection_limit} connections or requests at once; retry shortly"))
        await send({"type": "http.response.start", "status": 503, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"retry-after", str(LIMIT_RETRY_AFTER).encode()), (b"connection", b"close"),
            *refusal_cors(self.cors_origins, scope_origin(scope))]})
        await send({"type": "http.response.body", "body": body})

    def send_400_response(self, msg: str) -> None:
        """Uvicorn's answer to a request h11 cannot parse (called while its RemoteProtocolError is being handled):
        h11's reason, and its status (431 for a header block too large), in the error shape of the request line's
        path, if that much arrived."""
        exc = sys.exception()
        status = 400
        why = "the request is not valid HTTP/1.1"
        if isinstance(exc, h11.RemoteProtocolError):
            if exc.error_status_hint == 431:
                status = 431
                size = self.config.h11_max_incomplete_event_size or H11_HEADER_LIMIT
                why = f"the request's header block is larger than this server accepts ({size} bytes)"
            else:
                why += ": " + re.sub(r"bytearray\(b('.*')\)", r"\1", str(exc))[:200]  # h11's: bytearray(b'...')
        # The request's start, unless its headers were in (the fault is in a body that came after them): its scope.
        path, origin = ((request_path(self.head), request_origin(self.head)) if self.head or self.cycle is None else
                        (self.scope["path"], scope_origin(self.scope)))
        self.transport.write(self.error_response(status, "invalid_http" if status == 400 else "too_large", why,
                                                 path, origin))
        self.linger()  # (the client may still be sending the request h11 gave up on)

    def close_after_answer(self) -> None:
        """Close the connection once a request's cycle is done with it: lingering, if the answer went before the
        request's body was all in."""
        if self.cycle is not None and self.cycle.response_complete and self.conn.their_state is h11.SEND_BODY:
            self.linger()
        else:
            self.transport.close()

    def linger(self) -> None:
        """Close the connection, an answer having been written, without resetting it while the client still sends:
        shut the write side (the client reads the answer, then EOF), then read and discard what comes in, and
        close at the client's EOF, or after LINGER_SECONDS or LINGER_BYTES."""
        if self.transport.is_closing() or self.linger_left is not None:
            return
        self.stop_header_timer()
        self.linger_left = LINGER_BYTES
        self.waiting_since, self.turn = time.monotonic(), next(_turns)  # (for make_room)
        self.transport.write_eof()  # once the answer is written
        self.flow.resume_reading()  # (paused where the unread body filled uvicorn's buffer)
        self.linger_timer = self.loop.call_later(LINGER_SECONDS, self.transport.close)

    def awaiting_headers(self) -> bool:
        """Between requests: no request of this cycle seen yet, and no answer under way."""
        return self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE

    def watch_headers(self) -> None:
        """Start the deadline when a header block becomes due; stop it once the request's headers are in."""
        if self.transport is None or self.transport.is_closing() or not self.awaiting_headers():
            self.stop_header_timer()
        elif self.header_timer is None:
            self.waiting_since, self.turn = time.monotonic(), next(_turns)
            self.header_timer = self.loop.call_later(self.header_timeout, self.header_timed_out)

    def stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def make_room(self) -> None:
        """At uvicorn's connection limit, close the other connection that has waited longest for its client (a
        request's headers or body, or lingering after an answer: those first), so that this one's request is served
        rather than answered 503 (none is closed if all are being answered)."""
        limit = self.connection_limit
        if limit is None or len(self.connections) < limit - ROOM_MARGIN:
            return
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, HeaderTimeoutProtocol) and c.waiting_for_client()]
        if waiting:
            oldest = min(waiting, key=lambda c: (c.linger_left is None, c.turn))  # answered ones first
            part = "body was" if oldest.body_pending() else "headers were"
            waited = time.monotonic() - oldest.waiting_since
            oldest.close_waiting(f"the request's {part} not all in after {waited:.1f}s, when the server, at its "
                                 "connection limit, needed the connection for another client", level=logging.DEBUG)
            self.connections.discard(oldest)  # counted out now, not when the loop gets to its connection_lost
            log_room_made(limit - ROOM_MARGIN)

    def body_pending(self) -> bool:
        """A request's body is still coming in, and no answer has begun (the app waits for the client)."""
        return (self.cycle is not None and not self.cycle.response_started and not self.cycle.disconnected
                and self.conn.their_state is h11.SEND_BODY)

    def waiting_for_client(self) -> bool:
        return not self.transport.is_closing() and (
            self.header_timer is not None or self.body_pending() or self.linger_left is not None)

    def header_timed_out(self) -> None:
        self.header_timer = None
        self.close_waiting(f"the request's headers did not arrive within {self.header_timeout:g}s "
                           "(m31r serve --header-timeout)")

    def close_waiting(self, why: str, level: int = logging.INFO) -> None:
        """Close a connection awaiting a request's headers or body; with a 408 saying `why` first if the client had
        begun a request (an idle one just goes, as uvicorn's keep-alive timeout closes it, so that a client pool
        reusing it is not handed an unasked answer). A 408 is logged at `level`. A request whose body was pending
        then sees the client leave, as the app is told."""
        self.stop_header_timer()
        body = self.body_pending()
        if self.linger_left is not None:  # answered already
            self.transport.close()
            return
        if self.transport.is_closing() or not (body or self.awaiting_headers()):
            return
        try:
            # Begun: part of a header block (which h11 holds until it is complete), or a body under way.
            if body or self.conn.trailing_data[0]:
                if body:  # the app sees a disconnect: this says it was the server's doing (GuardMiddleware)
                    self.scope[CLOSED_BY_SERVER] = why
                path, origin = ((self.scope["path"], scope_origin(self.scope)) if body else
                                (request_path(self.head), request_origin(self.head)))
                self.transport.write(self.error_response(408, "timeout", why, path, origin))
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
                log.log(level, "closed a connection: %s (%s)", why, client)
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # (only in a state awaiting_headers rules out)
            pass
        self.transport.close()

    def error_response(self, status: int, code: str, why: str, path: str, origin: bytes | None) -> bytes:
        """An error closing the connection (a 408, or a request h11 cannot parse), in the error shape of the request's
        path (OpenAI's where it is not known: no request line yet), readable by a page from an allowed `origin` (the
        request's, where it is known) as the app's answers are."""
        body = error_body_for(path, status, code, why)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close"), *refusal_cors(self.cors_origins, origin)]
        return b"".join(self.conn.send(event) or b"" for event in (
            h11.Response(status_code=status, headers=head, reason=STATUS_PHRASES[status]), h11.Data(data=body),
            h11.EndOfMessage()))


LOG_EVERY = 10.0  # seconds: a flood of connections makes room (or is refused) once per connection; one line suffices
_logged: dict[str, float] = {}


def log_every(key: str, level: int, message: str, *args: object) -> None:
    """Log `message` at most every LOG_EVERY seconds for `key`."""
    now = time.monotonic()
    if now - _logged.get(key, -LOG_EVERY) >= LOG_EVERY:
        _logged[key] = now
        log.log(level, message, *args)


def log_room_made(limit: int) -> None:
    """Warn, at most every LOG_EVERY seconds, that connections are being closed for room."""
    log_every("room", logging.WARNING, "%d connections are open (near the limit): closing those that have waited "
              "longest for a request's headers or body, to serve new ones (slow or idle clients, or a flood of "
              "connections)", limit)


def with_header_timeout(timeout: float, cors_origins: Iterable[str] = ()) -> type[HeaderTimeoutProtocol]:
    """HeaderTimeoutProtocol with `timeout` seconds for a request's headers, its refusals (the limit's 503, its 400,
    431 and 408) readable by pages from `cors_origins` (--cors-origin, as GuardMiddleware's refusals are)."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {
        "header_timeout": timeout, "cors_origins": frozenset(cors_origins)})

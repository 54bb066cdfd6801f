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

The class is also used where httptools is installed (uvicorn would pick its httptools protocol), so the deadline
holds whatever uvicorn's extras are.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from m31r_http.security import CLOSED_BY_SERVER, error_body_for

log = logging.getLogger("m31r_http")

# Room is made this far below uvicorn's limit: a request whose connection was closed for room ends a few loop turns
# later, and till then uvicorn counts its task against the same limit (it answers 503 when connections or tasks
# reach it).
ROOM_MARGIN = 16
_turns = itertools.count()  # the order in which connections began waiting (uvloop's clock has 1 ms steps)


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers are not all in by a deadline, and makes
    room at the connection limit; use `with_header_timeout` for a class with the timeout set (uvicorn.Config takes a
    class, and builds one per connection)."""

    header_timeout: float = 10.0
    header_timer: asyncio.TimerHandle | None = None
    waiting_since = 0.0  # when the client's turn began (the header deadline's start), time.monotonic()
    turn = 0  # the order of waiting_since

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.watch_headers()
        self.make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self.stop_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self.watch_headers()  # a request's headers came in (stop), or a new cycle began after a body (start)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.watch_headers()  # keep-alive: the next request's headers are now awaited (unless pipelined, in)

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
        request's headers or body), so that this one's request is served rather than answered 503 (none is closed
        if all are being answered)."""
        limit = self.limit_concurrency
        if limit is None or len(self.connections) < limit - ROOM_MARGIN:
            return
        waiting = [c for c in self.connections
                   if c is not self and isinstance(c, HeaderTimeoutProtocol) and c.waiting_for_client()]
        if waiting:
            oldest = min(waiting, key=lambda c: c.turn)
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
        return not self.transport.is_closing() and (self.header_timer is not None or self.body_pending())

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
        if self.transport.is_closing() or not (body or self.awaiting_headers()):
            return
        try:
            # Begun: part of a header block (which h11 holds until it is complete), or a body under way.
            if body or self.conn.trailing_data[0]:
                if body:  # the app sees a disconnect: this says it was the server's doing (GuardMiddleware)
                    self.scope[CLOSED_BY_SERVER] = why
                self.transport.write(self.timeout_response(why, self.scope["path"] if body else ""))
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
                log.log(level, "closed a connection: %s (%s)", why, client)
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # (only in a state awaiting_headers rules out)
            pass
        self.transport.close()

    def timeout_response(self, why: str, path: str) -> bytes:
        """The 408 closing the connection, in the error shape of the request's path (OpenAI's where it is not known
        yet, as for a header block cut short)."""
        body = error_body_for(path, 408, "timeout", why)
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]
        return b"".join(self.conn.send(event) or b"" for event in (
            h11.Response(status_code=408, headers=head, reason=STATUS_PHRASES[408]), h11.Data(data=body),
            h11.EndOfMessage()))


ROOM_LOG_EVERY = 10.0  # seconds: a flood of connections makes room once per connection; one warning suffices
_room_logged = -ROOM_LOG_EVERY


def log_room_made(limit: int) -> None:
    """Warn, at most every ROOM_LOG_EVERY seconds, that connections are being closed for room."""
    global _room_logged
    now = time.monotonic()
    if now - _room_logged >= ROOM_LOG_EVERY:
        _room_logged = now
        log.warning("%d connections are open (near the limit): closing those that have waited longest for a request's "
                    "headers or body, to serve new ones (slow or idle clients, or a flood of connections)", limit)


def with_header_timeout(timeout: float) -> type[HeaderTimeoutProtocol]:
    """HeaderTimeoutProtocol with `timeout` seconds for a request's headers."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": timeout})

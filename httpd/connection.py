"""Uvicorn's h11 connection protocol with a deadline for request headers (`m31r serve --header-timeout`).

Uvicorn times a connection out only while it sits idle after an answer (its keep-alive timeout, which any byte
cancels); a connection that has just opened, or a client that sends its header block a byte every few seconds and
never ends it, holds the connection (one of `MAX_CONNECTIONS`) for as long as it likes, and enough such clients
(Slowloris) have every other client answered 503. Here the header block must be complete within `header_timeout`
seconds of the connection opening or of the previous answer's end (the body has its own deadline, BodyWatch in
security.py): past it a client that had begun a header block is answered 408, and the connection is closed.

The class is also used where httptools is installed (uvicorn would pick its httptools protocol), so the deadline
holds whatever uvicorn's extras are.
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from m31r_http.security import error_body

log = logging.getLogger("m31r_http")


class HeaderTimeoutProtocol(H11Protocol):
    """H11Protocol that closes a connection whose next request's headers are not all in by a deadline; use
    `with_header_timeout` for a class with the timeout set (uvicorn.Config takes a class, and builds one per
    connection)."""

    header_timeout: float = 10.0
    header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.watch_headers()

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
            self.header_timer = self.loop.call_later(self.header_timeout, self.header_timed_out)

    def stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def header_timed_out(self) -> None:
        """Close the connection; with a 408 first if the client had begun a request (an idle one just goes, as
        uvicorn's keep-alive timeout closes it, so that a client pool reusing it is not handed an unasked answer)."""
        self.header_timer = None
        if self.transport.is_closing() or not self.awaiting_headers():
            return
        try:
            if self.conn.trailing_data[0]:  # part of a header block, which h11 holds until it is complete
                self.transport.write(self.timeout_response())
                client = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
                log.info("closed a connection whose request headers did not arrive within %gs (%s)",
                         self.header_timeout, client)
            self.conn.send(h11.ConnectionClosed())
        except h11.LocalProtocolError:  # (only in a state awaiting_headers rules out)
            pass
        self.transport.close()

    def timeout_response(self) -> bytes:
        """The 408, in the OpenAI error shape (the request's path is not known yet), closing the connection."""
        body = error_body(408, "timeout", f"the request's headers did not arrive within {self.header_timeout:g}s "
                                          "(m31r serve --header-timeout)")
        head = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"connection", b"close")]
        return b"".join(self.conn.send(event) or b"" for event in (
            h11.Response(status_code=408, headers=head, reason=STATUS_PHRASES[408]), h11.Data(data=body),
            h11.EndOfMessage()))


def with_header_timeout(timeout: float) -> type[HeaderTimeoutProtocol]:
    """HeaderTimeoutProtocol with `timeout` seconds for a request's headers."""
    return type("HeaderTimeoutProtocol", (HeaderTimeoutProtocol,), {"header_timeout": timeout})

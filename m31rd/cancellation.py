"""A request's cancel handle, shared by the event loop (which cancels) and the scheduler (which obeys). Torch-free,
so that the server can hold requests before the model (and torch) has loaded."""

from __future__ import annotations

import time


class Cancellation:
    """A request's cancel handle: set from any thread, seen by the scheduler at the next round boundary.

    The scheduler also counts here the model calls it ran for the request, and how many of them began after the
    cancel: the daemon's log line reports them, which is how the soak shows a cancel takes effect within a round."""

    __slots__ = ("reason", "code", "at", "calls", "calls_after")

    def __init__(self) -> None:
        self.reason: str | None = None
        self.code = "cancelled"  # the Error code the request is answered with: `shutting_down` at shutdown
        self.at: float | None = None  # time.perf_counter() of the cancel
        self.calls = 0
        self.calls_after = 0

    def cancel(self, reason: str, code: str = "cancelled") -> None:
        """The first reason given stays."""
        if self.reason is None:
            self.reason, self.code, self.at = reason, code, time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.reason is not None

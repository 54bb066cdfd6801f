"""The daemon's one torch thread: the model is loaded, warmed up and served from the same OS thread.

libgomp (torch's OpenMP runtime) gives every thread that starts a parallel region its own team of workers. A
model loaded on the main thread and served from another leaves two teams alive, more OpenMP threads than
cores, and libgomp then stops spinning between parallel regions: each of the hundreds of small ops in a decode
step waits for a worker to wake from sleep. Measured on the 2-core dev machine, medium int8 at 1.2k context:
decode 22 ms/token with one thread doing everything, 40 ms/token when serving from a second thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class TorchThread:
    def __init__(self, name: str = "m31r-inference"):
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._calls.get()) is not None:
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller, who decides what it means
                    fut.set_exception(e)

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> Future[T]:
        fut: Future[T] = Future()
        self._calls.put((lambda: fn(*args, **kwargs), fut))
        return fut

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the torch thread and wait for its result (or exception)."""
        return self.submit(fn, *args, **kwargs).result()

    def close(self, timeout: float | None = None) -> None:
        """Let the thread finish what it was given, then end it."""
        self._calls.put(None)
        self._thread.join(timeout)

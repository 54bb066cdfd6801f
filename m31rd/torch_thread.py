"""The daemon's one torch thread: the model is loaded, warmed up and served from the same OS thread.

libgomp (torch's OpenMP runtime) gives every thread that starts a parallel region its own team of workers. A
model loaded on the main thread and served from another leaves two teams alive, more OpenMP threads than
cores, and libgomp then stops spinning between parallel regions: each of the hundreds of small ops in a decode
step waits for a worker to wake from sleep. Measured on the 2-core dev machine, medium int8 at 1.2k context:
decode 22 ms/token with one thread doing everything, 40 ms/token when serving from a second thread.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("m31rd")


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


# Contention: OpenMP teams wider than the cores other processes leave free stall. The kernels' parallel loops (and
# torch's) end at barriers where a thread spins until its partners arrive; while another process (a `cargo build`
# beside the editor, the main case) holds the core a partner needs, the spin burns the rest of a timeslice, at every
# one of a step's hundreds of barriers. Measured on the 2-core dev machine (benchmarks/bench_contention.py: m31r-mini,
# 16-token Fims, 2 busy-loop processes): 2 fixed threads 26-31 ms p50 idle but 170-245 ms p50, 550-800 ms p90 and
# seconds at worst loaded; OMP_WAIT_POLICY=passive ~2x slower idle; GOMP_SPINCOUNT=2000 still ~100 ms loaded. Following
# the load: the same idle, 64-76 ms p50 and 82-94 ms p90 loaded.
CONTENTION_WINDOW_S = 0.25  # the shortest span a CPU-time sample covers: 25 clock ticks a CPU at USER_HZ 100


def free_cpu_threads(others_busy: float, cpus: int, ceiling: int) -> int:
    """Threads to run when other processes keep `others_busy` of this process's `cpus` busy (in CPUs): the CPUs left
    free, rounded (a core another process uses less than half of counts as free), within 1..ceiling."""
    return max(1, min(ceiling, int(cpus - others_busy + 0.5)))


def read_cpu_ticks(stat: str, cpus: set[int] | None) -> tuple[int, int]:
    """(busy, total) clock ticks so far over `cpus` (all when None) from the text of /proc/stat; busy is all but
    idle and iowait. ValueError for text without those lines."""
    busy = total = 0
    seen = False
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        ticks = [int(x) for x in rest.split()[:8]]
        if len(ticks) < 5:
            raise ValueError(f"a /proc/stat line with fewer than 5 fields: {line!r}")
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
        seen = True
    if not seen:
        raise ValueError("no per-CPU lines in /proc/stat")
    return busy, total


class ThreadGovernor:
    """Sets torch's thread count on the torch thread to the CPUs other processes leave free (free_cpu_threads), up to
    `ceiling`. `adjust` is called before every model pass; it samples at most every CONTENTION_WINDOW_S. Other
    processes' load is the CPUs' busy time less this process's own (os.times: all its threads, spinning included).
    Only for a model whose outputs do not depend on the thread count (the daemon's warm-up checks that)."""

    def __init__(self, ceiling: int, stat_path: str = "/proc/stat", window_s: float = CONTENTION_WINDOW_S) -> None:
        try:
            cpus: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = None
        self.cpus = cpus
        self.stat_path, self.window_s, self.ceiling = stat_path, window_s, ceiling
        self.tick_s = 1 / os.sysconf("SC_CLK_TCK")
        self.threads = ceiling
        self.others_busy = 0.0
        self._last = self._sample()  # OSError or ValueError where there is no /proc/stat to read: not governed
        self._at = time.monotonic()

    @classmethod
    def where_supported(cls, ceiling: int) -> ThreadGovernor | None:
        """A governor, or None where /proc/stat cannot be read (not Linux) or there is one thread to begin with."""
        if ceiling < 2:
            return None
        try:
            return cls(ceiling)
        except (OSError, ValueError):
            return None

    def _sample(self) -> tuple[int, int, float]:
        with open(self.stat_path) as f:
            busy, total = read_cpu_ticks(f.read(), self.cpus)
        t = os.times()
        return busy, total, t.user + t.system

    def adjust(self) -> int:
        """Re-sample if the window has passed and set torch's threads to match; returns the thread count."""
        now = time.monotonic()
        if now - self._at < self.window_s:
            return self.threads
        try:
            sample = self._sample()
        except (OSError, ValueError):  # /proc went away (a chroot, a sandbox): keep what runs
            return self.threads
        (busy0, total0, own0), (busy1, total1, own1) = self._last, sample
        self._last, self._at = sample, now
        if total1 <= total0:
            return self.threads
        cpus = len(self.cpus) if self.cpus is not None else os.cpu_count() or 1
        others = max(0.0, (busy1 - busy0) - (own1 - own0) / self.tick_s) / (total1 - total0) * cpus
        self.others_busy = others
        want = free_cpu_threads(others, cpus, self.ceiling)
        if want != self.threads:
            import torch

            log.debug("threads %d -> %d: other processes keep %.2f of %d CPUs busy", self.threads, want, others, cpus)
            torch.set_num_threads(want)
            self.threads = want
        return self.threads

"""Waiting for a process that is no child of ours to exit: `m31r stop` waits for the daemon's exit, not only for its
connection to close (it holds its socket's lock until it exits, and a daemon started next was refused)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
from pathlib import Path
from typing import Any

EXIT_POLL_S = 0.02  # how often the fallback without a pidfd or kqueue looks whether the daemon has exited


class ProcessExit:
    """The exit of the process that has a pid now. It is bound to that process when made (a pidfd on Linux, a
    kqueue on macOS and the BSDs, else its start time in /proc), so that a pid another program gets later is never
    waited on; make it while the process is known to be alive."""

    def __init__(self, pid: int) -> None:
        self._fd: int | None = None  # readable once the process has exited (a zombie included)
        self._kqueue: Any = None
        self._stat: tuple[int, str] | None = None  # (pid, start time) for the /proc fallback
        if hasattr(os, "pidfd_open"):
            with contextlib.suppress(OSError):  # (ENOSYS: a kernel before 5.3; the fallback below)
                self._fd = os.pidfd_open(pid)
                return
        if hasattr(select, "kqueue"):
            kq = select.kqueue()
            try:
                kq.control([select.kevent(pid, select.KQ_FILTER_PROC, select.KQ_EV_ADD | select.KQ_EV_ONESHOT,
                                          select.KQ_NOTE_EXIT)], 0, 0)
            except OSError:  # (ESRCH: it has exited already)
                kq.close()
                raise
            self._kqueue, self._fd = kq, kq.fileno()
        elif (start := start_time(pid)) is not None:
            self._stat = (pid, start)
        else:
            raise OSError(f"cannot watch process {pid} here")

    @classmethod
    def of(cls, pid: int) -> ProcessExit | None:
        """The exit of `pid` where it can be waited for: not for a process of another user, or one this system
        cannot see or watch (a daemon in another pid namespace names a pid of its own)."""
        if pid <= 1 or pid == os.getpid():
            return None
        try:
            os.kill(pid, 0)  # (PermissionError: another user's process, so not the daemon, which runs as us)
            return cls(pid)
        except OSError:
            return None

    def _ended(self) -> bool:
        pid, start = self._stat  # type: ignore[misc]
        return start_time(pid) != start  # gone, a zombie, or another program with the pid now

    async def wait(self, timeout: float) -> bool:
        """Whether the process exited within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        if self._fd is None:
            deadline = loop.time() + timeout
            while not self._ended():
                if loop.time() >= deadline:
                    return False
                await asyncio.sleep(EXIT_POLL_S)
            return True
        exited = loop.create_future()
        loop.add_reader(self._fd, lambda: exited.done() or exited.set_result(None))
        try:
            await asyncio.wait_for(exited, max(timeout, 0.0))
            return True
        except TimeoutError:
            return False
        finally:
            loop.remove_reader(self._fd)

    def close(self) -> None:
        if self._kqueue is not None:
            self._kqueue.close()
        elif self._fd is not None:
            os.close(self._fd)


def start_time(pid: int) -> str | None:
    """When process `pid` started (field 22 of /proc/PID/stat, after the parenthesised name, which may hold spaces),
    or None where it has ended (a zombie too) or /proc cannot tell."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return None if fields[0] in ("Z", "X") else fields[19]

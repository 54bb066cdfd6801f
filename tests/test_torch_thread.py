"""The daemon's TorchThread: every call runs on one and the same OS thread, in order, errors handed back."""

from __future__ import annotations

import threading

import pytest

from m31rd.torch_thread import TorchThread


def test_calls_run_in_order_on_one_thread_and_errors_come_back() -> None:
    t = TorchThread(name="test-torch")
    seen: list[tuple[int, int]] = []
    futures = [t.submit(lambda i=i: seen.append((i, threading.get_ident()))) for i in range(20)]
    for f in futures:
        f.result(5)
    assert [i for i, _ in seen] == list(range(20))
    assert len({ident for _, ident in seen}) == 1 and seen[0][1] != threading.get_ident()
    with pytest.raises(ZeroDivisionError):
        t.call(lambda: 1 / 0)
    assert t.call(threading.current_thread).name == "test-torch"  # still alive after an error
    t.close(5)

"""Session 47: the daemon's check that its model gives the same bits at any thread count covers the passes a request
runs: before, its 96-token prompt was prefilled in chunks of 64 and 32, never in the max_chunk (256) chunks every
longer prompt is, whose GEMMs may split their work across threads otherwise."""

from __future__ import annotations

import torch

from m31rd.main import _govern_threads, thread_check_ids


def test_the_thread_check_prefills_the_widest_chunk(tiny_engine) -> None:
    ids = thread_check_ids(tiny_engine)
    ends = tiny_engine.layout(len(ids))
    sizes = [b - a for a, b in zip([0, *ends], ends, strict=False)]
    assert sizes[0] == tiny_engine.max_chunk and len(sizes) > 1, sizes
    half = tiny_engine.layout(len(ids) // 2 + 1)
    assert half[0] < tiny_engine.max_chunk  # the half's chunks are of other sizes
    before = torch.get_num_threads()
    try:
        assert _govern_threads(tiny_engine, 2) == "yes"  # the tiny engine's logits agree at 1 and 2 threads
    finally:
        tiny_engine.before_pass = None
        torch.set_num_threads(before)

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


def test_doctor_says_when_cc_is_not_used(monkeypatch) -> None:
    """A CC naming no program (a typo) was only logged at info level: doctor said `ok compiler /usr/bin/cc` and the
    user never learnt that CC was ignored."""
    import shutil

    from m31r import doctor

    if shutil.which("cc") is None and shutil.which("gcc") is None and shutil.which("clang") is None:
        raise AssertionError("this test needs a C compiler on PATH (cc, gcc or clang), as CI's .ci/run installs")
    monkeypatch.setenv("CC", "/nonexistent/m31r-cc --flag")
    check = doctor.check_compiler(None)  # type: ignore[arg-type]  # it reads no context
    assert check.level == "warn" and "CC=/nonexistent/m31r-cc --flag is not used" in check.detail, check.detail
    assert "/nonexistent/m31r-cc not found" in check.detail
    monkeypatch.delenv("CC")
    assert doctor.check_compiler(None).level == "ok"  # type: ignore[arg-type]
    monkeypatch.setenv("CC", shutil.which("cc") or shutil.which("gcc") or shutil.which("clang") or "")
    assert doctor.check_compiler(None).level == "ok"  # type: ignore[arg-type]

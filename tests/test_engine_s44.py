"""Session 44's audit of the inference core's data path: the engine serves the tokenizer its bundle checked (one capped
read, not a second parse of a file that may have changed since), and a model pass that fails for one request fails that
request alone, not every request that shared its round. On the tiny model, with the real engine and scheduler.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from m31r.bundle import open_bundle
from m31r.engine import Engine, Piece
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler

PROMPTS = ["fn main() {", "struct Foo { a: u32 }\nimpl Foo {"]


def test_the_engine_serves_the_tokenizer_its_bundle_checked(tiny_bundle, tiny_engine: Engine, tmp_path: Path) -> None:
    """The engine parsed tokenizer.json a second time, outside the bundle's capped read (bundle._read_capped) and
    after its checks: a file replaced in between (or one grown past the cap) was what it served, or failed on."""
    copy = tmp_path / "bundle"
    shutil.copytree(tiny_bundle.path, copy)
    bundle = open_bundle(copy)
    (copy / "tokenizer.json").write_text("{ not the tokenizer that was checked")
    engine = Engine(bundle, dtype="float32")
    text = "fn main() { let x = 1; }\n"
    assert engine.tokenizer.encode(text) == tiny_engine.tokenizer.encode(text)
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text


def test_a_failed_pass_fails_only_the_request_it_could_not_run(tiny_engine: Engine,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two requests share a round's forward pass; one's cache cannot grow (an allocation failure, injected). Every
    request of that round was answered `internal`; now the other's call runs again by itself and it decodes exactly
    what it decodes alone, and the scheduler serves the next request on the failed one's (reset) slot."""
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=2), max_active=2)
    events: list[list] = [[], []]
    requests = [Request(tiny_engine.tokenizer.encode(p), 8) for p in PROMPTS]
    for request, ev in zip(requests, events, strict=True):
        sched.submit(request, ev.append)
    sched.round()  # both prefill (one chunk each), side by side
    assert len(sched.running) == 2
    doomed = next(r for r in sched.running if r.request is requests[0])
    assert doomed.slot is not None

    def cannot_grow(n: int, ahead: int = 0) -> None:
        raise MemoryError("injected: this request's KV cache cannot grow")

    monkeypatch.setattr(doomed.slot.cache, "fit", cannot_grow)  # decode steps fit every cache they write to
    sched.drain()
    monkeypatch.undo()
    assert isinstance(events[0][-1], Failed) and events[0][-1].code == "internal"
    assert "cannot grow" in events[0][-1].message
    done = events[1][-1]
    assert isinstance(done, Finished) and done.completion_tokens == 8, events[1]
    alone = [p.id for p in tiny_engine.generate(PROMPTS[1], max_tokens=8)]
    assert [e.id for e in events[1] if isinstance(e, Piece)] == alone
    after: list = []
    sched.submit(Request(tiny_engine.tokenizer.encode(PROMPTS[0]), 8), after.append)
    sched.drain()
    assert isinstance(after[-1], Finished)
    assert [e.id for e in after if isinstance(e, Piece)] == [p.id for p in tiny_engine.generate(PROMPTS[0],
                                                                                               max_tokens=8)]

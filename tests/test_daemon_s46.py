"""Session 46: the daemon core (scheduler, prefix cache).

- A running request that was cancelled ended only after the round had started what was waiting: a keystroke's
  request found the one it superseded still holding its document's cache slot, and took a fresh slot (a cold
  prefill of the whole prompt) or evicted another document's; under --max-active it also waited a round for the
  place the cancelled one held. Now cancelled requests end first. Driven round by round on the real scheduler and
  tiny engine, so what happens at the round boundary is checked exactly; then end to end on the shared daemon, an
  editor's keystrokes each sent while the last one's answer streams.
"""

from __future__ import annotations

import asyncio

import pytest

from m31r_protocol.client import Client, DaemonError
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler

pytestmark = pytest.mark.timeout(60)

# Over one 256-token chunk of the tiny engine's layout, so a slot holding it has something to reuse.
SOURCE = "fn main() {\n" + "".join(f"    let v{i} = compute({i}, \"abc\");\n" for i in range(8))


def submit(sched: Scheduler, engine, text: str, document: str = "a", max_tokens: int = 40) -> tuple[Request, list]:
    events: list = []
    request = Request(engine.tokenizer.encode(text), max_tokens, document=document)
    sched.submit(request, events.append)
    return request, events


def test_a_superseded_request_gives_its_slot_to_the_keystroke_after_it(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 1, slots=3)  # room for fresh slots: the old order took one
    sched = Scheduler(tiny_engine, cache, max_active=2)
    _, first = submit(sched, tiny_engine, SOURCE)
    _, other = submit(sched, tiny_engine, "struct Other { a: u32 }\n" * 4, document="b")
    sched.drain()
    assert isinstance(first[-1], Finished) and isinstance(other[-1], Finished)
    assert len(cache.slots) == 2
    typing, _ = submit(sched, tiny_engine, SOURCE + "l")
    sched.round()
    assert typing.cancellation.calls == 1  # it runs, holding document a's slot
    typing.cancellation.cancel("superseded by a newer request for the same document")
    _, events = submit(sched, tiny_engine, SOURCE + "le")
    sched.drain()
    done = events[-1]
    assert isinstance(done, Finished), done
    assert done.cached_tokens == 256, done  # what the superseded one's slot held of the prompt
    assert len(cache.slots) == 2  # one slot per document: b's was neither evicted nor joined by a third
    assert [s.document for s in cache.slots] == ["a", "b"]


def test_a_cancelled_request_leaves_its_place_to_a_waiting_one_in_the_same_round(tiny_engine) -> None:
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=1), max_active=1)
    old, old_events = submit(sched, tiny_engine, SOURCE)
    sched.round()
    old.cancellation.cancel("cancelled by the client")
    order: list[str] = []
    new = Request(tiny_engine.tokenizer.encode(SOURCE), 4)
    sched.submit(new, lambda ev: order.append("new") if isinstance(ev, Finished) else None)
    sched.round()
    assert isinstance(old_events[-1], Failed) and old_events[-1].code == "cancelled"
    assert old.cancellation.calls_after == 0  # no model call after the cancel
    assert new.cancellation.calls == 1  # it started in the round that ended the cancelled one (max_active 1)
    sched.drain()
    assert order == ["new"]


async def idle(c: Client, timeout: float = 60.0):
    """The shared daemon's status once nothing is queued or running: a request an earlier test left in flight (a
    client gone mid-stream, noticed later on a loaded machine) takes its slot before, not during, what is counted."""
    deadline = asyncio.get_running_loop().time() + timeout
    while (st := await c.status()).queue or st.active:
        assert asyncio.get_running_loop().time() < deadline, st
        await asyncio.sleep(0.05)
    return st


async def test_keystrokes_that_supersede_a_running_answer_keep_one_warm_slot(shared_daemon) -> None:
    """Each keystroke's request is sent once the one before it streams its first token. The tiny model writes a
    200-token answer in well under a second (lookahead 0, one token a step, makes it as long as it can be), so on a
    loaded machine the daemon may finish one whole before the next keystroke reaches it: that one is not superseded
    and ends as any answer does, at max_tokens. Every other one must end `cancelled`, and at least one must."""
    sock = shared_daemon[1]
    suffix = "}\n// test_daemon_s46 keystrokes\n"
    async with await Client.connect(sock, client="s46-keystrokes") as c:
        before = (await idle(c)).cache_slots_used
        first = await c.fim(SOURCE, suffix, document="s46://keys.rs", max_tokens=200, beams=1, lookahead=0)
        async for _ in first:
            pass
        text, streams = SOURCE, []
        for ch in "let w = 12;":
            text += ch
            stream = await c.fim(text, suffix, document="s46://keys.rs", max_tokens=200, beams=1, lookahead=0)
            streams.append(stream)
            async for _ in stream:  # its first token: it runs, holding the document's slot, as the next one comes
                break
            else:
                pytest.fail(f"{text!r}: the answer ended without a token, so nothing ran to be superseded")
        cancelled = 0
        for stream in streams[:-1]:
            try:
                async for _ in stream:
                    pass
            except DaemonError as e:
                assert e.code == "cancelled", e
                cancelled += 1
            else:  # finished before the next keystroke arrived: whole, as an answer no one superseded
                done = stream.done
                assert done is not None and (done.finish_reason, done.usage.completion_tokens) == ("length", 200), done
        assert cancelled >= 1, "no keystroke's request was still running when the next one came"
        async for _ in streams[-1]:
            pass
        last = streams[-1].done
        assert last is not None and last.source != "typed_through"
        assert last.usage.cached_tokens > 0, last  # the superseded one's slot, not a fresh one (a cold prefill)
        assert (await idle(c)).cache_slots_used == before + 1  # one slot for the document

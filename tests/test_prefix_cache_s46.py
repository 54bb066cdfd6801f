"""Session 46: prefix-cache slots of documents that share a long first chunk.

A request took the free slot with the longest reusable prefix even when it was another document's and a fresh slot
(or a stale one) was there to take: two files whose prompts share their first 256 tokens (the same preamble, the
same leading project context), edited in turns, wrote over each other's slot, and every switch was a cold prefill
of all but that chunk. Now the shared prefix is copied into a slot of the request's own, and each keeps its warm
slot; the output stays the bits of a cold prefill. Checked on the real scheduler and tiny engine (every slot policy
exactly), then end to end on the shared daemon, an editor's Fim requests for two files.
"""

from __future__ import annotations

import pytest

from m31r_protocol.client import Client
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Finished, Piece, Request, Scheduler

pytestmark = pytest.mark.timeout(60)

# Over the tiny engine's first 256-token chunk, then each file's own ~180 tokens (the context is 512).
PREAMBLE = "// shared project preamble\n" + "".join(f"const C{i}: u32 = {i * 7};\n" for i in range(14))
FILES = {
    "a.rs": PREAMBLE + "fn alpha() {\n" + "".join(f"    let a{i} = C{i} + 1;\n" for i in range(8)),
    "b.rs": PREAMBLE + "fn beta() {\n" + "".join(f"    let b{i} = C{i} * 2;\n" for i in range(8)),
}


def serve(sched: Scheduler, engine, text: str, document: str) -> tuple[list[int | None], Finished]:
    events: list = []
    sched.submit(Request(engine.tokenizer.encode(text), 8, document=document), events.append)
    sched.drain()
    assert isinstance(events[-1], Finished), events[-1]
    return [e.id for e in events if isinstance(e, Piece)], events[-1]


def alternate(sched: Scheduler, engine, order: str) -> list[tuple[list[int | None], Finished]]:
    return [serve(sched, engine, FILES[f"{d}.rs"], f"{d}.rs") for d in order]


def warm_alone(engine, d: str) -> int:
    """What a file's second request reuses in a cache of its own."""
    sched = Scheduler(engine, PrefixCache(engine, 1, slots=1))
    return [done.cached_tokens for _, done in alternate(sched, engine, d * 2)][1]


def test_files_sharing_a_first_chunk_keep_their_own_warm_slots(tiny_engine) -> None:
    cold = {d: serve(Scheduler(tiny_engine, PrefixCache(tiny_engine, 0)), tiny_engine, FILES[f"{d}.rs"], "")
            for d in "ab"}
    assert all(done.cached_tokens == 0 for _, done in cold.values())
    cache = PrefixCache(tiny_engine, 1, slots=4)  # room for fresh slots
    runs = alternate(Scheduler(tiny_engine, cache), tiny_engine, "abab")
    assert [done.cached_tokens for _, done in runs[:2]] == [0, 256]  # b shares a's first chunk
    for (pieces, _), d in zip(runs, "abab", strict=True):
        assert pieces == cold[d][0], d  # a copied prefix gives the bits of a cold prefill
    for (_, done), d in zip(runs[2:], "ab", strict=True):
        assert done.cached_tokens == warm_alone(tiny_engine, d) > 256, (d, done)  # as if alone in the cache
    assert sorted(s.document for s in cache.slots) == ["a.rs", "b.rs"]


def test_a_full_cache_gives_the_copy_the_least_recently_used_slot(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 1, slots=3)
    sched = Scheduler(tiny_engine, cache)
    serve(sched, tiny_engine, "// an old file, nothing like the others\n" * 3, "old.rs")
    serve(sched, tiny_engine, "// another old file, nothing like the others\n" * 3, "older.rs")
    runs = alternate(sched, tiny_engine, "abab")
    assert len(cache.slots) == 3  # full since a: b evicts old.rs, not a's slot
    assert sorted(s.document for s in cache.slots) == ["a.rs", "b.rs", "older.rs"]
    assert [done.cached_tokens for _, done in runs[2:]] == [warm_alone(tiny_engine, d) for d in "ab"]
    assert [p for p, _ in runs[:2]] == [p for p, _ in runs[2:]]


def test_a_documents_own_slot_takes_the_copy(tiny_engine) -> None:
    """A file whose own slot holds less of its prompt than another file's: the copy goes into its own slot, so it
    neither overwrites the other file's nor takes a third."""
    cache = PrefixCache(tiny_engine, 1, slots=4)
    sched = Scheduler(tiny_engine, cache)
    serve(sched, tiny_engine, "// a.rs before its preamble was pasted in\n" * 4, "a.rs")
    serve(sched, tiny_engine, FILES["b.rs"], "b.rs")
    _, done = serve(sched, tiny_engine, FILES["a.rs"], "a.rs")
    assert done.cached_tokens == 256
    assert sorted(s.document for s in cache.slots) == ["a.rs", "b.rs"]
    _, done = serve(sched, tiny_engine, FILES["b.rs"], "b.rs")
    assert done.cached_tokens == warm_alone(tiny_engine, "b") > 256, done  # b's slot kept its own tail


def test_requests_without_a_document_share_one_slot_and_keep_it(tiny_engine) -> None:
    """Requests without a document (Generate, an HTTP editor without `path`) cannot be told from one client's
    successive edits: they share one slot, which a copy of a document's head goes into, so they never fill the cache
    with copies; and a document's request leaves their slot as it was."""
    cache = PrefixCache(tiny_engine, 1, slots=4)
    sched = Scheduler(tiny_engine, cache)
    serve(sched, tiny_engine, FILES["a.rs"], "a.rs")
    _, done = serve(sched, tiny_engine, FILES["b.rs"], "")  # a.rs's slot holds its own tail: copied, not taken
    assert done.cached_tokens == 256 and sorted(s.document for s in cache.slots) == ["", "a.rs"]
    _, done = serve(sched, tiny_engine, FILES["a.rs"], "a.rs")
    assert done.cached_tokens == warm_alone(tiny_engine, "a"), done
    # An edit just past the first chunk: both slots reuse 256 and a.rs's is the more recent: copied into the other.
    edited = FILES["b.rs"].replace("const C13: u32 = 91;", "const C13: u32 = 92;")
    _, done = serve(sched, tiny_engine, edited, "")
    assert done.cached_tokens == 256 and sorted(s.document for s in cache.slots) == ["", "a.rs"]
    _, done = serve(sched, tiny_engine, PREAMBLE + "fn gamma() {}\n" * 12, "c.rs")
    assert done.cached_tokens == 256 and sorted(s.document for s in cache.slots) == ["", "a.rs", "c.rs"]
    _, done = serve(sched, tiny_engine, edited, "")
    assert done.cached_tokens > 256, done  # c.rs copied the anonymous slot's head and left it whole


# Fim requests at the end of two files (no suffix) that share their head: their prompts share 280 tokens.
HEAD = "// s46: a preamble two files share\n" + "".join(f"const C{i}: u32 = {i * 7};\n" for i in range(12))
TAILS = {"alpha.rs": "fn alpha() {\n", "beta.rs": "fn beta() {\n"}


async def test_editing_two_files_in_turns_keeps_both_warm_on_the_daemon(shared_daemon) -> None:
    _, sock = shared_daemon
    out = []
    async with await Client.connect(sock) as c:
        for doc in [*TAILS, *TAILS]:
            prefix = HEAD + TAILS[doc] + "".join(f"    let {doc[0]}{i} = C{i};\n" for i in range(3)) + "    "
            text, done = await (await c.fim(prefix, "", document=f"s46-{doc}", max_tokens=8)).collect()
            out.append((text, done.source, done.usage.prompt_tokens, done.usage.cached_tokens))
    assert all(source == "model" for _, source, *_ in out), out
    assert [cached for *_, cached in out[:2]] == [0, 256], out
    # Each its own slot: all but the last, partial chunk (in turns on one slot: 256 each).
    assert all(0 < prompt - cached < 32 for *_, prompt, cached in out[2:]), out
    assert [t for t, *_ in out[:2]] == [t for t, *_ in out[2:]]

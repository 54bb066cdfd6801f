"""Session 44's audit of the memory the inference core holds: beam searches' spare KV caches stay inside the prefix
cache's bound and show in the daemon's status, token healing's masks stay a few MB, and a request the engine refuses
leaves the slot it would have taken as it was. On tiny models, with the real engine, scheduler and daemon.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from daemon_util import start_daemon, stop_daemon

from m31r.beams import beam_generate
from m31r.engine import HEAL_MASK_BYTES, Engine, Piece
from m31r_protocol.client import Client
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler

# About 420 tokens of the byte vocabulary: most of the tiny model's 512-position context.
LONG = "".join(f"fn f{i}(x: u32) -> u32 {{ x * {i} + {i % 7} }}\n" for i in range(12)) + "fn main() {\n    let t"


def held(cache: PrefixCache, sched: Scheduler) -> int:
    """Every KV byte the scheduler keeps between requests: its slots' and the beam searches' spares'."""
    return sum(s.cache.nbytes for s in cache.slots) + sum(c.nbytes for c in sched.cache.spares)


def searched(engine: Engine, ids: list[int], width: int) -> list[tuple[int | None, str]]:
    """A search's answer alone, on fresh caches and without spares."""
    return [(p.id, p.text) for p in beam_generate(engine, ids, width=width, max_tokens=12, stop=["\n"])
            if isinstance(p, Piece)]


def test_beam_spares_stay_inside_the_cache_bound_and_answers_do_not_change(tiny_engine: Engine) -> None:
    """`--cache-mb 0` (one working buffer): a width-4 search on a long prompt kept its 3 extra caches for the next
    search, each nearly a whole context, outside any budget and any status figure. Now what the scheduler holds after
    each search stays within its one slot's full size, `bytes_used` is all of it, and the answers are the same."""
    cache = PrefixCache(tiny_engine, 0)
    sched = Scheduler(tiny_engine, cache)
    base = tiny_engine.tokenizer.encode(LONG)
    assert 400 < len(base) < tiny_engine.config.max_context - 30
    for typed in ([], [101], [101, 114]):  # typing at the end of the prompt
        ids = base + typed
        events: list = []
        sched.submit(Request(ids, 12, stop=["\n"], beams=4), events.append)
        sched.drain()
        assert isinstance(events[-1], Finished), events[-1]
        assert [(e.id, e.text) for e in events if isinstance(e, Piece)] == searched(tiny_engine, ids, 4)
        assert held(cache, sched) <= cache.max_slots * cache.slot_bytes == tiny_engine.cache_bytes()
        assert cache.bytes_used == held(cache, sched)


def test_beam_spares_are_kept_within_a_budget_and_counted(tiny_engine: Engine) -> None:
    """With room in the budget the spares stay for the next search (only the new tokens are copied into them), and
    the prefix cache's `bytes_used` (the daemon's status `cache_mb`) counts them."""
    cache = PrefixCache(tiny_engine, 8)
    sched = Scheduler(tiny_engine, cache)
    ids = tiny_engine.tokenizer.encode(LONG)
    events: list = []
    sched.submit(Request(ids, 12, stop=["\n"], beams=4), events.append)
    sched.drain()
    assert [(e.id, e.text) for e in events if isinstance(e, Piece)] == searched(tiny_engine, ids, 4)
    assert len(sched.cache.spares) >= 1 and all(s.tokens[: len(ids)] == ids for s in sched.cache.spares)
    assert cache.bytes_used == held(cache, sched) <= cache.budget_bytes
    assert cache.bytes_used >= (1 + len(sched.cache.spares)) * tiny_engine.cache_bytes(len(ids))


async def test_the_daemon_status_counts_beam_spares(tiny_bundle, tiny_engine: Engine, tmp_path: Path) -> None:
    """A real daemon's status `cache_mb` after a beam search on a long prompt: the slot and the search's extra caches
    it keeps (it reported the slot alone, and the ~0.45 MB of spares nowhere)."""
    sock = tmp_path / "run" / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--cache-mb", "8")
    try:
        async with await Client.connect(sock) as c:
            await (await c.generate(LONG, max_tokens=12)).collect()  # greedy: the slot alone
            alone = (await c.status()).cache_mb
            await (await c.generate(LONG, max_tokens=12, beams=3)).collect()
            st = await c.status()
        prompt = tiny_engine.cache_bytes(len(tiny_engine.tokenizer.encode(LONG)) - 8) / 2**20  # healing may cut some
        assert st.cache_mb >= alone + 2 * prompt - 0.1, (alone, st)  # rounded to 0.1 MB
        assert st.cache_mb <= st.cache_budget_mb
    finally:
        stop_daemon(proc)


@pytest.fixture(scope="module")
def wide_engine(tiny_config, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The tiny model with a 16k vocabulary (a release model's size; the byte tokenizer pads it), where 4096 cached
    healing masks took 64 MB."""
    from m31r.bundle import init_bundle

    config = msgspec.structs.replace(tiny_config, vocab_size=16384)
    bundle = init_bundle(config, tmp_path_factory.mktemp("wide") / "bundle", seed=0, dtype=torch.float32)
    return Engine(bundle, dtype="float32")


def test_healing_masks_stay_a_few_megabytes(wide_engine: Engine) -> None:
    """Healing at many distinct cursors filled up to 4096 masks of the vocabulary's size before any went; now the
    least recently used go past HEAL_MASK_BYTES, a word being typed keeps its masks, and the masks are the same."""
    logits = torch.zeros(wide_engine.config.vocab_size)
    first = {owed: wide_engine.heal_logits(logits, owed) for owed in (b"res", b"re", b" ")}
    for i in range(600):  # 600 cursors: 9.4 MB of masks unbounded
        wide_engine.heal_logits(logits, f"w{i}".encode())
        for owed in first:  # the word being typed: used again all along
            assert torch.equal(wide_engine.heal_logits(logits, owed), first[owed])
    masks = wide_engine._heal_masks
    assert sum(m.nbytes for m in masks.values()) <= HEAL_MASK_BYTES
    assert all(owed in masks for owed in first)
    fresh = Engine(wide_engine.bundle, dtype="float32")
    for owed in (b"w3", b"w599", b"res", b""):
        assert torch.equal(wide_engine.heal_logits(logits, owed), fresh.heal_logits(logits, owed))


@pytest.mark.parametrize("refused", ["overflow", "vocabulary"])
def test_a_refused_request_leaves_its_document_cache(tiny_engine: Engine, refused: str) -> None:
    """A request the engine refuses (over the context, an id outside the vocabulary) took the slot with the longest
    matching prefix, its document's cache, and reset it though nothing was written: the document's next request
    prefilled its whole prompt again. Now it is refused before it takes a slot, and the next request reuses it."""
    cache = PrefixCache(tiny_engine, 8)
    sched = Scheduler(tiny_engine, cache)
    ids = tiny_engine.tokenizer.encode(LONG)
    first: list = []
    sched.submit(Request(ids, 4, document="a.rs"), first.append)
    sched.drain()
    assert isinstance(first[-1], Finished)
    bad = ids + [10] * tiny_engine.config.max_context if refused == "overflow" else ids + [10**9]
    out: list = []
    sched.submit(Request(bad, 4, document="a.rs"), out.append)
    sched.drain()
    assert [type(e) for e in out] == [Failed]
    assert out[0].code == ("context_overflow" if refused == "overflow" else "internal")
    again: list = []
    sched.submit(Request(ids + [101], 4, document="a.rs"), again.append)
    sched.drain()
    assert isinstance(again[-1], Finished) and again[-1].cached_tokens >= len(ids) - 64, again[-1]
    alone = [p.id for p in tiny_engine.generate(ids + [101], max_tokens=4)]
    assert [e.id for e in again if isinstance(e, Piece)] == alone

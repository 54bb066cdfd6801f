"""KV-cache slots kept across requests, so a new prompt prefills only what the last one did not.

Each slot is a KV cache (sized to its context in 64-position blocks) plus the ids it holds. A request takes the
free slot with the longest reusable prefix (its document's slot on a tie), else a fresh slot while the budget
allows, else the least recently used one. Where that longest prefix is in another document's slot, which holds
chunks past it, the request does not write over that slot: the other document's next request would be a cold
prefill (two files sharing a long head, edited in turns, wrote over each other's slot on every switch). The shared
prefix is copied instead, into the request's document's own slot, else a fresh one, else the least recently used
one. Requests without a document count as one document: they cannot be told from one client's successive edits,
whose old tails are worth nothing, and copies for them would fill the budget with those. A running
request holds its slot exclusively; only this class's owner, the inference thread, touches it.

It also keeps beam searches' spare caches between searches (m31r.beams), inside the same bound: the slots' full
size (`max_slots * slot_bytes`, what the budget allows), busy slots counted at that full size since they may grow to
it. Spares give way to slots, so they only use what the slots leave, and `bytes_used` (the daemon's status) counts
them. With `--cache-mb 0` the one slot, busy, leaves no room: a search's extra caches go by the next request.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from m31r.engine import Engine
from m31r.model import KVCache


@dataclass
class Slot:
    cache: KVCache
    document: str = ""
    last_used: int = 0
    busy: bool = False


class PrefixCache:
    def __init__(self, engine: Engine, budget_mb: float, slots: int | None = None):
        """`slots` overrides how many slots the budget allows (without reuse: how many working buffers)."""
        self.engine = engine
        self.fingerprint = engine.bundle.fingerprint  # one model per daemon: every entry belongs to it
        self.reuse = budget_mb > 0
        self.slot_bytes = engine.cache_bytes()
        self.budget_bytes = int(budget_mb * 2**20)
        # Without reuse one working buffer remains; with it, as many slots as the budget holds (at least one).
        self.max_slots = slots or (max(1, self.budget_bytes // self.slot_bytes) if self.reuse else 1)
        self.slots: list[Slot] = []
        self.spares: list[KVCache] = []  # beam searches' caches between searches (m31r.beams; `_trim_spares`)
        self._tick = itertools.count(1)
        self.prompt_tokens = 0
        self.cached_tokens = 0

    @property
    def bytes_used(self) -> int:
        """What the slots and kept spares hold now: each grows with its context, up to slot_bytes (which the budget
        counts). A running beam search's caches taken from the spares are its working memory until it ends."""
        return sum(s.cache.nbytes for s in list(self.slots)) + sum(c.nbytes for c in list(self.spares))

    def _trim_spares(self) -> None:
        """Drop the oldest spares until slots and spares fit `max_slots` full slots, a busy slot counted full."""
        room = self.max_slots * self.slot_bytes
        room -= sum(self.slot_bytes if s.busy else s.cache.nbytes for s in self.slots)
        held = sum(c.nbytes for c in self.spares)
        while self.spares and held > room:
            held -= self.spares.pop(0).nbytes

    def acquire(self, ids: list[int], document: str) -> Slot | None:
        """A slot for `ids`, or None when every slot is busy (the caller waits for one)."""
        free = [s for s in self.slots if not s.busy]
        slot: Slot | None = None
        if self.reuse and free:
            scored = [(self.engine.reusable(s.cache, ids), bool(document) and s.document == document, s.last_used, s)
                      for s in free]
            best = max(scored, key=lambda t: t[:3])
            if best[0] > 0:
                slot = self._reusing(best[3], best[0], document, free)
        if slot is None and len(self.slots) < self.max_slots:
            slot = Slot(self.engine.new_cache())
            self.slots.append(slot)
        if slot is None and free:
            slot = min(free, key=lambda s: s.last_used)  # evict the least recently used
        if slot is None:
            return None
        if not self.reuse:
            slot.cache.reset()
        slot.busy = True
        slot.document = document
        self._trim_spares()
        return slot

    @staticmethod
    def _yours(slot: Slot, reuse: int, document: str) -> bool:
        """Whether a request of `document` that reuses `reuse` positions of `slot` may write over it: the slot is that
        document's (requests without one share theirs), or holds no chunk past those."""
        return slot.document == document or not slot.cache.chunks or slot.cache.chunks[-1] <= reuse

    def _reusing(self, best: Slot, reuse: int, document: str, free: list[Slot]) -> Slot:
        """The slot for a request that reuses `reuse` positions of `best`: `best` itself where it may (_yours), else a
        copy of `best` (the same keys and values, so the same output bits) in the request's document's own free slot,
        a fresh slot, or the least recently used other one."""
        if self._yours(best, reuse, document):
            return best
        others = [s for s in free if s is not best]
        dest = min((s for s in others if s.document == document), key=lambda s: s.last_used, default=None)
        if dest is None and len(self.slots) < self.max_slots:
            dest = Slot(self.engine.new_cache())
            self.slots.append(dest)
        if dest is None and others:
            dest = min(others, key=lambda s: s.last_used)
        if dest is None:
            return best  # the only free slot: its other chunks go
        dest.cache.take(best.cache, 0)
        return dest

    def release(self, slot: Slot, prompt_tokens: int, cached_tokens: int, ok: bool = True) -> None:
        slot.busy = False
        slot.last_used = next(self._tick)
        if not ok:  # an error mid-step may leave the buffer half-written: never reuse it
            slot.cache.reset()
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens
        self._trim_spares()  # a beam search gives its caches back as it ends, just before its slot

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

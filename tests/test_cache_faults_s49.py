"""Session 49: a KV cache whose resize fails midway (an allocation that fails: "can't allocate memory").

KVCache._resize replaces the layers' buffers one at a time. An allocation failing after the first left some layers at
the new size and the rest at the old, `capacity` still the old: the failed request's slot was reset (tokens cleared)
and kept those buffers. A later prompt that fit the stale capacity ran no resize: the eager path failed every request
on the slot with a shape error, and the native kernels, which index every layer with the one capacity, wrote past the
end of a layer a shrink had cut (the daemon died of a segfault) or, after a failed growth, wrote keys where torch's
next copy did not find them. A beam search's spare whose take() failed that way kept claiming its old prompt while a
layer held zeros there, so a later search reused them. Now such a cache is resized whole before any pass reads it,
and claims only what every layer still holds.

The allocation is made to fail (the real OOM cannot be provoked here); the rest is the real tiny engine, its native
kernels where they load, and the real scheduler and prefix cache. Every answer after a fault must be, bit for bit,
the one a fresh cache gives.
"""

from __future__ import annotations

import random

import pytest
import torch

import m31r.model
from m31r.engine import Engine, Outcome
from m31r.model import KVCache
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler

pytestmark = pytest.mark.timeout(120)

_rng = random.Random(49)
SHORT = [_rng.randrange(3, 300) for _ in range(40)]  # in one 64-position block; 60 tokens of answer pass it
LONG = [_rng.randrange(3, 300) for _ in range(420)]  # a 256-token chunk and more: a slot holding it is reused


class Faults:
    """Makes the allocations numbered in `failing` (counted from arming, from 0) raise as a failed malloc does."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        real = m31r.model.zeros
        self.calls, self.failing = 0, set()

        def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            n, self.calls = self.calls, self.calls + 1
            if n in self.failing:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 65536 bytes")
            return real(shape, dtype, device)

        monkeypatch.setattr(m31r.model, "zeros", zeros)

    def arm(self, *failing: int) -> None:
        self.calls, self.failing = 0, set(failing)


@pytest.fixture
def faults(monkeypatch: pytest.MonkeyPatch) -> Faults:
    return Faults(monkeypatch)


@pytest.fixture(scope="module", params=["native", "eager"])
def engine(request: pytest.FixtureRequest, tiny_engine: Engine, tiny_bundle) -> Engine:
    """The tiny engine with its native decode kernels (where they load here), and one with torch's attention only."""
    if request.param == "native":
        return tiny_engine
    eager = Engine(tiny_bundle, dtype="float32")
    eager.model.native = None
    return eager


def check_layers(cache: KVCache) -> None:
    """No layer is shorter than the capacity the native kernels index it with: a pass would write past its end (a
    segfault here, where a failure is wanted)."""
    for t in (*cache.k, *cache.v):
        assert t.shape[2] >= cache.capacity, f"a layer of {t.shape[2]} positions in a cache of {cache.capacity}"


def answer(engine: Engine, ids: list[int], cache: KVCache, max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probabilities."""
    check_layers(cache)
    res = Outcome(prompt_tokens=len(ids))
    list(engine.generate(ids, max_tokens=max_tokens, cache=cache, result=res))
    return res.tokens, res.logprobs


def held(cache: KVCache) -> list[torch.Tensor]:
    """The keys and values at the positions the cache says it holds."""
    return [t[:, :, : len(cache.tokens)].clone() for t in (*cache.k, *cache.v)]


@pytest.mark.parametrize(("before", "failing", "after", "n"), [
    (SHORT, LONG, SHORT, 60),  # a growth fails (the prompt's reserve); the next prompt fits the old capacity
    (LONG, SHORT, LONG, 8),  # a shrink fails (the decode's fit); the next prompt fits the old capacity
])
def test_a_resize_failing_midway_leaves_a_slot_that_answers_as_a_fresh_one(
        engine: Engine, faults: Faults, before: list[int], failing: list[int], after: list[int], n: int) -> None:
    fresh = engine.new_cache()
    expected = answer(engine, after, fresh, n)
    cache = engine.new_cache()
    answer(engine, before, cache, 5)
    faults.arm(1)  # the second layer buffer of the next resize
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        answer(engine, failing, cache, n)
    assert faults.calls == 2  # the fault hit midway through a resize
    cache.reset()  # what PrefixCache.release does for a failed request
    assert answer(engine, after, cache, n) == expected
    assert all(torch.equal(a, b) for a, b in zip(held(cache), held(fresh), strict=True))


def test_a_spare_whose_take_failed_claims_only_what_it_still_holds(engine: Engine, faults: Faults) -> None:
    """beams._place fills a spare from another cache with take(); a take whose resize fails must not leave the spare
    claiming its old prompt (reused by the next search) while a layer holds zeros there."""
    expected = answer(engine, LONG, engine.new_cache(), 8)
    spare, other = engine.new_cache(), engine.new_cache()
    answer(engine, LONG, spare, 1)
    answer(engine, SHORT, other, 1)
    assert spare.capacity != other.capacity  # take resizes the spare to other's
    faults.arm(1)
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        spare.take(other, 0)
    assert engine.reusable(spare, LONG) == 0
    assert answer(engine, LONG, spare, 8) == expected


def run(sched: Scheduler, engine: Engine, ids: list[int], max_tokens: int, document: str = "a") -> list:
    events: list = []
    sched.submit(Request(list(ids), max_tokens, document=document), events.append)
    return events


def outcome(events: list) -> tuple:
    done = events[-1]
    assert isinstance(done, Finished), done
    return [e.id for e in events[:-1]], done.logprob, done.finish_reason


def test_the_slot_of_a_failed_request_answers_the_next_as_a_fresh_one(engine: Engine, faults: Faults) -> None:
    """The scheduler and prefix cache as the daemon runs them: a request whose cache cannot shrink fails alone
    (`internal`), and its slot's next request (a prompt that fits the stale capacity) gets the fresh answer."""
    cache = PrefixCache(engine, 64, slots=1)
    sched = Scheduler(engine, cache, max_active=1)
    first = run(sched, engine, LONG, 8)
    sched.drain()
    faults.arm(1)
    failed = run(sched, engine, SHORT, 30)
    sched.drain()
    assert isinstance(failed[-1], Failed) and failed[-1].code == "internal", failed[-1]
    assert "can't allocate memory" in failed[-1].message
    check_layers(cache.slots[0].cache)
    again = run(sched, engine, LONG, 8)
    sched.drain()
    assert outcome(again) == outcome(first)
    assert again[-1].cached_tokens == 0  # nothing the torn slot claimed was reused


def test_a_shared_pass_that_fails_in_a_resize_runs_again_with_the_same_answer(
        engine: Engine, faults: Faults, caplog: pytest.LogCaptureFixture) -> None:
    """A pass shared by two requests fails in one's resize: the scheduler runs each call again by itself, so the torn
    cache must still hold its sequence (not be emptied), and both answers are the ones they get without a fault."""
    expected = []
    for ids in (LONG, SHORT):
        sched = Scheduler(engine, PrefixCache(engine, 64, slots=1), max_active=1)
        expected.append(run(sched, engine, ids, 8))
        sched.drain()
    sched = Scheduler(engine, PrefixCache(engine, 64, slots=2), max_active=2)
    first = run(sched, engine, LONG, 8, document="a")
    sched.drain()
    # "b" takes a fresh slot; "a"'s prompt reuses nothing of its slot, whose first decode step shrinks it.
    second, third = run(sched, engine, SHORT, 8, document="b"), run(sched, engine, SHORT, 8, document="a")
    sched.round()  # both start prefilling; arm before the decode steps that shrink "a"'s slot
    faults.arm(1)
    sched.drain()
    assert faults.calls > 1 and "a model pass failed" in caplog.text  # the shared pass failed, each ran again
    assert outcome(first) == outcome(expected[0])
    assert outcome(second) == outcome(expected[1]) == outcome(third)

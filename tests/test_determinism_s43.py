"""A request's tokens must not depend on what the daemon does beside it: neighbours of other lengths arriving while it
prefills or decodes, neighbours cancelled mid-stream, a warm prefix cache whose slots were evicted and refilled, or a
fresh engine (a daemon restart). Greedy with prompt-lookup drafts, seeded sampling and beam search, on the tiny model
with the native kernels and eager, through the real Scheduler round by round.
"""

from __future__ import annotations

import random

import pytest

from m31r.engine import Engine, Piece
from m31r.sampling import SamplingParams
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Request, Scheduler

TEXT = ("use std::collections::HashMap;\n\nfn count(words: &[&str]) -> HashMap<&str, usize> {\n"
        "    let mut map = HashMap::new();\n    for w in words {\n        *map.entry(w).or_insert(0) += 1;\n"
        "    }\n    map\n}\n\nstruct Point { x: f64, y: f64 }\n\nimpl Point {\n    fn norm(&self) -> f64 {\n"
        "        (self.x * self.x + self.y * self.y).sqrt()\n    }\n}\n")
# Prompt lengths across the chunk layout: a lone partial chunk, one 32-token chunk, 64- and 128-token chunks.
PROMPTS = [TEXT[:n] for n in (9, 40, 130, 260, len(TEXT))]
KINDS = {
    "greedy": {"lookahead": 3},
    "sampled": {"sampling": SamplingParams(temperature=0.9, top_p=0.95, seed=2**40 + 7)},
    "penalised": {"sampling": SamplingParams(temperature=1.3, top_k=20, repetition_penalty=1.2, seed=-5)},
    "beams": {"beams": 3, "stop": ["\n"]},
}
Key = tuple[int, str]


def request(engine: Engine, key: Key) -> Request:
    return Request(engine.tokenizer.encode(PROMPTS[key[0]]), 12, **KINDS[key[1]])


def serve(sched: Scheduler, engine: Engine, plan: list[tuple[int, Key]],
          cancel: dict[Key, int] | None = None) -> dict[Key, list[int | None]]:
    """Submit each (round, key) at its round and cancel each key in `cancel` at its round; the tokens of every request
    that was not cancelled."""
    events: dict[Key, list] = {}
    requests: dict[Key, Request] = {}
    todo, rnd = sorted(plan), 0
    while todo or not sched.idle:
        while todo and todo[0][0] <= rnd:
            key = todo.pop(0)[1]
            requests[key] = request(engine, key)
            sched.submit(requests[key], events.setdefault(key, []).append)
        for key, at in (cancel or {}).items():
            if at == rnd and key in requests:
                requests[key].cancellation.cancel("the test cancels")
        sched.round()
        rnd += 1
    return {k: [e.id for e in ev if isinstance(e, Piece)] for k, ev in events.items() if not isinstance(ev[-1], Failed)}


def solo(engine: Engine, key: Key) -> list[int | None]:
    return serve(Scheduler(engine, PrefixCache(engine, 0, slots=1), max_active=1), engine, [(0, key)])[key]


KEYS = [(i, k) for i in range(len(PROMPTS)) for k in KINDS]


@pytest.fixture(scope="module", params=["native", "eager"])
def engine(request: pytest.FixtureRequest, tiny_bundle) -> Engine:
    """An engine of its own (its kernels are switched): the loaded kernels, or eager torch."""
    engine = Engine(tiny_bundle, dtype="float32")
    if request.param == "eager":
        engine.use_kernels(None)
    return engine


def test_concurrent_staggered_cancelled_and_warm_runs_give_the_solo_tokens(engine: Engine) -> None:
    """Every request against its cold, solo answer: all at once, arriving at random rounds (beside prefills and
    decodes), beside cancelled neighbours, and on a warm cache with fewer slots than prompts (evicted slots keep the
    larger capacity of a longer prompt)."""
    alone = {key: solo(engine, key) for key in KEYS}
    assert all(alone.values())
    rng = random.Random(0)
    for trial in range(3):
        plan = [(0 if trial == 0 else rng.randrange(12), key) for key in KEYS]
        cancel = {key: rng.randrange(16) for key in KEYS if rng.random() < 0.3}
        cold = Scheduler(engine, PrefixCache(engine, 0, slots=8), max_active=8)
        warm = Scheduler(engine, PrefixCache(engine, 1, slots=3), max_active=3)
        for sched, cancelled in ((cold, {}), (cold, cancel), (warm, cancel), (warm, {})):
            got = serve(sched, engine, plan, cancelled)
            assert {k: v for k, v in got.items() if k not in cancelled} == {
                k: alone[k] for k in got if k not in cancelled}, trial
        assert warm.cache.cached_tokens > 0


def test_seeded_sampling_repeats_on_a_fresh_engine(tiny_bundle, tiny_engine: Engine) -> None:
    """A daemon restart loads a new engine: the same seed draws the same tokens, and another seed other tokens."""
    fresh = Engine(tiny_bundle, dtype="float32")
    for i in range(len(PROMPTS)):
        for kind in ("sampled", "penalised"):
            assert solo(fresh, (i, kind)) == solo(tiny_engine, (i, kind))
    other = dict(KINDS["sampled"], sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=8))
    ids = tiny_engine.tokenizer.encode(PROMPTS[2])
    seeded = [[p.id for p in tiny_engine.generate(ids, max_tokens=12, sampling=kw["sampling"])]
              for kw in (KINDS["sampled"], other)]
    assert seeded[0] == solo(tiny_engine, (2, "sampled")) and seeded[0] != seeded[1]

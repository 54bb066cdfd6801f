"""The scheduler, the prefix cache and the daemon's admission, in process on the tiny model: no socket, no subprocess.

The scheduler is driven round by round on the test's thread (`Scheduler.round`), so what happens at a round
boundary (cancellation, deadlines, a request waiting for a slot) is checked exactly, not raced against.
test_daemon.py checks the same behaviours end to end against a real daemon.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from m31r.engine import Piece
from m31r.sampling import SamplingParams
from m31r_protocol import messages as m
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler, run_together
from m31rd.server import BundleIdentity, Daemon
from m31rd.torch_thread import TorchThread

PROMPTS = ["fn main() {", "struct Foo { a: u32 }\nimpl Foo {", "let x = vec![1, 2, 3];\n"]
# Over one 32-token chunk (tiny_engine's chunk_size), so a cache slot holding it has something to reuse.
LONG = "// a prompt long enough that its first chunks are cached and reused\nfn parse(s: &str) -> u32 {\n"


class Events(list):
    """One request's events, in order."""

    @property
    def pieces(self) -> list[Piece]:
        return [e for e in self if isinstance(e, Piece)]

    @property
    def last(self):
        return self[-1] if self else None

    @property
    def ended(self) -> bool:
        return isinstance(self.last, Finished | Failed)


def submit(sched: Scheduler, engine, prompt: str, max_tokens: int = 8, **kw) -> tuple[Request, Events]:
    events = Events()
    request = Request(engine.tokenizer.encode(prompt), max_tokens, **kw)
    sched.submit(request, events.append)
    return request, events


def alone(engine, prompt: str, max_tokens: int) -> list[int | None]:
    return [p.id for p in engine.generate(prompt, max_tokens=max_tokens)]


@pytest.fixture
def sched(tiny_engine) -> Scheduler:
    return Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=4), max_active=4)


# -- rounds ---------------------------------------------------------------------------------------------------


def test_each_round_advances_every_running_request_by_one_model_call(sched, tiny_engine) -> None:
    """Short prompts prefill in one chunk: the first round runs the prefills, then every round gives every stream
    one token, in shared passes, and each stream gets exactly what it gets alone."""
    runs = [submit(sched, tiny_engine, p, max_tokens=6, stop=()) for p in PROMPTS]
    sched.round()
    assert sched.rounds == 1 and all(not ev for _, ev in runs)
    for n in range(1, 4):
        sched.round()
        assert [len(ev.pieces) for _, ev in runs] == [n] * len(runs)
    sched.drain()
    for (_, ev), p in zip(runs, PROMPTS, strict=True):
        assert [x.id for x in ev.pieces] == alone(tiny_engine, p, 6)
        assert isinstance(ev.last, Finished) and ev.last.completion_tokens == len([x for x in ev.pieces if x.id])
        assert ev.last.first_token_ms is not None and ev.last.total_ms >= ev.last.first_token_ms
    assert sched.idle and sched.active == 0
    assert not any(s.busy for s in sched.cache.slots)


def test_run_together_equals_streams_alone(tiny_engine) -> None:
    prompts = [*PROMPTS, LONG * 2]
    outs, sched = run_together(tiny_engine, prompts, 12)
    assert outs == [alone(tiny_engine, p, 12) for p in prompts]
    assert sched.mixed_rounds > 0 and sched.rounds < sum(len(o) for o in outs)


def test_a_request_waits_for_a_free_slot(tiny_engine) -> None:
    """With one slot, the second request starts only once the first has released it."""
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0), max_active=4)
    _, first = submit(sched, tiny_engine, PROMPTS[0], max_tokens=4)
    _, second = submit(sched, tiny_engine, PROMPTS[1], max_tokens=4)
    while not first.ended:
        sched.round()
        assert not second
    assert len(sched.pending) == 1
    sched.drain()
    assert [p.id for p in second.pieces] == alone(tiny_engine, PROMPTS[1], 4)


def test_max_active_bounds_the_running_requests(tiny_engine) -> None:
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=4), max_active=2)
    runs = [submit(sched, tiny_engine, p, max_tokens=3) for p in PROMPTS]
    sched.round()
    assert sched.active == 2 and len(sched.pending) == 1
    sched.drain()
    assert all(isinstance(ev.last, Finished) for _, ev in runs)


# -- cancellation and deadlines -------------------------------------------------------------------------------


def test_cancellation_takes_effect_at_the_next_round_boundary(sched, tiny_engine) -> None:
    req, ev = submit(sched, tiny_engine, PROMPTS[0], max_tokens=50)
    _, other = submit(sched, tiny_engine, PROMPTS[1], max_tokens=6)
    for _ in range(3):
        sched.round()
    sent = len(ev.pieces)
    assert sent == 2 and not ev.ended
    req.cancellation.cancel("cancelled by the client")
    req.cancellation.cancel("a later reason is ignored")
    sched.round()
    assert ev.last == Failed("cancelled", "cancelled by the client") and len(ev.pieces) == sent
    sched.drain()
    assert [p.id for p in other.pieces] == alone(tiny_engine, PROMPTS[1], 6)  # the other stream is untouched
    assert not any(s.busy for s in sched.cache.slots)


def test_a_queued_request_that_is_cancelled_is_answered_at_once(tiny_engine) -> None:
    """Not when it would have reached the head of the queue: newest-wins relies on this."""
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0), max_active=1)
    _, running = submit(sched, tiny_engine, PROMPTS[0], max_tokens=30)
    queued, ev = submit(sched, tiny_engine, PROMPTS[1])
    sched.round()
    queued.cancellation.cancel("superseded by a newer request for the same document")
    sched.round()
    assert ev == [Failed("cancelled", "superseded by a newer request for the same document")]
    assert not running.ended
    sched.drain()


def test_a_deadline_spent_in_the_queue_finishes_without_starting(sched, tiny_engine) -> None:
    req, ev = submit(sched, tiny_engine, PROMPTS[0], deadline=time.perf_counter())
    sched.round()
    [done] = ev
    assert isinstance(done, Finished) and done.finish_reason == "deadline"
    assert done.prompt_tokens == len(req.ids) and done.completion_tokens == 0 and done.first_token_ms is None
    assert sched.rounds == 0 and not sched.cache.slots  # no model call, no slot


def test_a_deadline_ends_a_running_request_at_a_round_boundary(sched, tiny_engine, monkeypatch) -> None:
    clock = [time.perf_counter()]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    req, ev = submit(sched, tiny_engine, PROMPTS[0], max_tokens=50, stop=(), deadline=clock[0] + 1)
    while len(ev.pieces) < 2:
        sched.round()
    rounds = sched.rounds
    clock[0] += 2
    sched.drain()
    assert isinstance(ev.last, Finished) and ev.last.finish_reason == "deadline"
    assert sched.rounds == rounds  # no model call past the deadline
    assert 2 <= ev.last.completion_tokens <= len(ev.pieces)


def test_a_failing_start_answers_internal_and_the_scheduler_goes_on(sched, tiny_engine) -> None:
    _, bad = submit(sched, tiny_engine, PROMPTS[0])
    bad_req = sched.inbox.get()
    sched.submit(Request([10**9], 4), bad.append)  # an id outside the vocabulary: the engine refuses it
    sched.submit(*bad_req)
    sched.drain()
    assert isinstance(bad[0], Failed) and bad[0].code == "internal"
    assert isinstance(bad[-1], Finished)


def test_a_prompt_over_the_context_is_refused_not_cut(sched, tiny_engine) -> None:
    """The scheduler runs the ids it is given: fitting a prompt is the caller's job (m31rd.server fits it once), and
    one that does not fit fails before any model call instead of losing its start unseen."""
    over = tiny_engine.config.max_context - 4 + 1
    events = Events()
    sched.submit(Request([10 + i % 200 for i in range(over)], 4), events.append)
    sched.drain()
    assert [type(e) for e in events] == [Failed] and events[0].code == "context_overflow"  # not `internal`
    assert f"prompt ({over} tokens) + max_tokens (4)" in events[0].message
    o = events[0].overflow  # the figures, for the server's Error frame
    assert o is not None and (o.prompt_tokens, o.max_tokens, o.max_context) == (over, 4, tiny_engine.config.max_context)
    assert sched.rounds == 0
    _, ok = submit(sched, tiny_engine, PROMPTS[0], max_tokens=3)
    sched.drain()
    assert isinstance(ok.last, Finished) and ok.last.completion_tokens == 3


def test_serve_returns_after_stop_once_everything_finished(sched, tiny_engine) -> None:
    _, ev = submit(sched, tiny_engine, PROMPTS[0], max_tokens=5)
    sched.stop()
    sched.serve()
    assert isinstance(ev.last, Finished)


# -- the prefix cache -----------------------------------------------------------------------------------------


def _ids(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def _fill(engine, cache: PrefixCache, text: str, document: str = "") -> None:
    """Run a request through a slot, as the scheduler does, and release it."""
    sched = Scheduler(engine, cache)
    sched.submit(Request(_ids(engine, text), 1, document=document), lambda ev: None)
    sched.drain()


def test_the_slot_with_the_longest_reusable_prefix_is_taken(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 0, slots=3)
    cache.reuse = True
    for text in (LONG, "// something else entirely, just as long, in another slot of the cache\n" * 2):
        _fill(tiny_engine, cache, text)
    ids = _ids(tiny_engine, LONG + "    let n = 0;\n")
    slot = cache.acquire(ids, "")
    assert slot is cache.slots[0] and tiny_engine.reusable(slot.cache, ids) >= 32
    cache.release(slot, len(ids), 0)


def test_the_documents_slot_wins_a_tie_and_a_stranger_gets_a_fresh_slot(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 0, slots=3)
    cache.reuse = True
    _fill(tiny_engine, cache, LONG, document="a.rs")
    _fill(tiny_engine, cache, LONG, document="b.rs")  # the same prompt: it reuses a.rs's slot, now b.rs's
    assert len(cache.slots) == 1 and cache.slots[0].document == "b.rs"
    slot = cache.acquire(_ids(tiny_engine, "nothing in common"), "c.rs")
    assert slot is not cache.slots[0] and len(cache.slots) == 2
    cache.release(slot, 0, 0)


def test_eviction_takes_the_least_recently_used_slot(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 0, slots=2)
    cache.reuse = True
    texts = [f"// prompt {i}: long enough to fill a whole chunk of the cache, and then some more\n" for i in "ABC"]
    _fill(tiny_engine, cache, texts[0])
    _fill(tiny_engine, cache, texts[1])
    first = cache.slots[0]
    _fill(tiny_engine, cache, texts[2])
    assert len(cache.slots) == 2 and first.cache.tokens[: len(_ids(tiny_engine, texts[2]))] == _ids(
        tiny_engine, texts[2])


def test_the_budget_sets_the_slots_and_no_budget_means_no_reuse(tiny_engine) -> None:
    per_slot = tiny_engine.cache_bytes() / 2**20
    assert PrefixCache(tiny_engine, 3.5 * per_slot).max_slots == 3
    assert PrefixCache(tiny_engine, 0.5 * per_slot).max_slots == 1
    off = PrefixCache(tiny_engine, 0)
    assert not off.reuse and off.max_slots == 1
    for _ in range(2):
        _fill(tiny_engine, off, LONG)
    assert off.cached_tokens == 0 and off.prompt_tokens == 2 * len(_ids(tiny_engine, LONG))
    on = PrefixCache(tiny_engine, 2 * per_slot)
    for _ in range(2):
        _fill(tiny_engine, on, LONG)
    assert on.cached_tokens >= 32 and on.hit_rate > 0


def test_a_slot_released_after_a_failure_is_not_reused(tiny_engine) -> None:
    cache = PrefixCache(tiny_engine, 0, slots=1)
    cache.reuse = True
    _fill(tiny_engine, cache, LONG)
    slot = cache.acquire(_ids(tiny_engine, LONG), "")
    assert slot is not None and slot.cache.tokens
    cache.release(slot, 0, 0, ok=False)
    assert not slot.cache.tokens


# -- admission (Daemon.submit), in process --------------------------------------------------------------------


class Conn:
    """What Daemon.submit needs of a connection."""

    client = "test"

    def __init__(self) -> None:
        self.jobs: dict = {}
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)

    def of(self, rid: int) -> list:
        return [x for x in self.sent if getattr(x, "id", None) == rid]

    async def final(self, rid: int, timeout: float = 30):
        t0 = time.monotonic()
        while not any(isinstance(x, m.Done | m.Error) for x in self.of(rid)):
            assert time.monotonic() - t0 < timeout, f"request {rid} got no final answer: {self.of(rid)}"
            await asyncio.sleep(0.005)
        return self.of(rid)[-1]


@pytest.fixture
async def daemon(tiny_engine):
    thread = TorchThread("test-scheduler")
    d = Daemon(thread, BundleIdentity.read(tiny_engine.bundle.path), cache_mb=8, max_queue=3, max_per_connection=2)
    loaded = thread.submit(d.attach, tiny_engine)  # as the daemon's start-up does, without the socket
    loaded.result(30)
    d._loaded(loaded)
    d.scheduler_done = thread.submit(d.scheduler.serve)
    yield d
    for job in list(d.in_flight):
        job.cancel("the test ended")
    d.scheduler.stop()
    await asyncio.to_thread(d.scheduler_done.result, 30)
    thread.close(5)
    for pool in d.prompt_pools:
        pool.shutdown(wait=False, cancel_futures=True)


def gen(rid: int, **kw) -> m.Generate:
    return m.Generate(id=rid, prompt=PROMPTS[0], **{"max_tokens": 200, **kw})


async def test_admission_busy_per_connection_and_in_all(daemon) -> None:
    a, b = Conn(), Conn()
    for rid in (1, 2, 3):
        daemon.submit(a, gen(rid))
    [busy] = a.of(3)
    assert busy.code == "busy" and "--max-per-connection" in busy.message
    assert busy.busy == m.BusyDetail("connection", 2) and busy.overflow is None
    daemon.submit(b, gen(1))
    daemon.submit(b, gen(2))
    [busy] = b.of(2)
    assert busy.code == "busy" and "limit 3" in busy.message and busy.busy == m.BusyDetail("daemon", 3)
    for job in list(daemon.in_flight):
        job.cancel("done")
    for conn, rid in ((a, 1), (a, 2), (b, 1)):
        assert (await conn.final(rid)).code == "cancelled"
    assert not daemon.in_flight
    daemon.submit(a, gen(4, max_tokens=2))  # room again
    assert isinstance(await a.final(4), m.Done)


def test_admission_busy_while_the_model_loads(tiny_bundle) -> None:
    """Requests that wait for the model have the same limits, and their `busy` says which one was hit: this
    connection's, or the daemon's line of requests waiting for the model (scope `loading`)."""
    thread = TorchThread("test-loading")  # never given the engine: the model is still loading
    d = Daemon(thread, BundleIdentity.read(tiny_bundle.path), cache_mb=8, max_queue=3, max_per_connection=2)
    try:
        a, b = Conn(), Conn()
        for rid in (1, 2, 3):
            d.submit(a, gen(rid))
        [busy] = a.of(3)
        assert busy.busy == m.BusyDetail("connection", 2) and "wait for the model to load" in busy.message, busy
        d.submit(b, gen(1))
        d.submit(b, gen(2))
        [busy] = b.of(2)
        assert busy.busy == m.BusyDetail("loading", 3) and "limit 3" in busy.message, busy
        assert len(d.waiting) == 3 and not a.of(1) + a.of(2) + b.of(1)  # the others wait, unanswered
    finally:
        thread.close(5)
        for pool in d.prompt_pools:
            pool.shutdown(wait=False, cancel_futures=True)


async def test_an_overflow_the_scheduler_finds_carries_its_figures(daemon, monkeypatch, tiny_engine) -> None:
    """The scheduler's own context_overflow (a prompt the server let through too long) reaches the client with the
    figures too, from the scheduler's plain Failed event: the server builds the Error frame."""
    import m31rd.server as server

    ctx = tiny_engine.config.max_context
    monkeypatch.setattr(server, "build_prompt", lambda engine, budget, req: server.Built(
        [10 + i % 200 for i in range(ctx)], req.max_tokens, ""))
    a = Conn()
    daemon.submit(a, gen(1, max_tokens=4))
    err = await a.final(1)
    assert err.code == "context_overflow" and err.overflow == m.OverflowDetail(ctx, 4, ctx), err
    assert f"prompt ({ctx} tokens) + max_tokens (4)" in err.message


async def test_a_request_cancelled_before_its_worker_starts_is_never_tokenised(daemon, monkeypatch) -> None:
    """A client that sends huge prompts and cancels them at once (the limits count only live requests) must not keep
    the tokenising workers busy for nothing: the cancel is looked at before the work starts."""
    import m31rd.server as server

    built: list[int] = []
    real = server.build_prompt

    def counted(engine, budget, req):
        built.append(req.id)
        return real(engine, budget, req)

    monkeypatch.setattr(server, "build_prompt", counted)
    c = Conn()
    daemon.submit(c, gen(1, max_tokens=2))
    [job] = c.jobs.values()
    job.cancel("cancelled by the client")  # before the event loop ran the job's preparation
    assert (await c.final(1)).code == "cancelled" and built == []
    daemon.submit(c, gen(2, max_tokens=2))
    assert isinstance(await c.final(2), m.Done) and built == [2]


async def test_admission_refuses_bad_requests_at_once(daemon) -> None:
    c = Conn()
    daemon.submit(c, gen(1, max_tokens=10**6))
    daemon.submit(c, gen(2, deadline_ms=-1))
    daemon.submit(c, gen(3, sampling=m.Sampling(temperature=float("nan"))))
    daemon.submit(c, gen(4, max_tokens=3))
    daemon.submit(c, gen(4, max_tokens=3))
    errors = [x for x in c.sent if isinstance(x, m.Error)]
    assert [x.code for x in errors] == ["bad_request"] * 4 and "already in flight" in errors[-1].message
    c.sent.remove(errors[-1])
    assert isinstance(await c.final(4), m.Done)


async def test_newest_request_for_a_document_wins(daemon) -> None:
    """The older Fim is cancelled, and the newer takes its place rather than being busy."""
    c = Conn()
    daemon.submit(c, m.Fim(id=1, prefix=LONG, suffix="}\n", document="a.rs", max_tokens=100))
    daemon.submit(c, m.Fim(id=2, prefix="x", document="b.rs", max_tokens=100))
    daemon.submit(c, m.Fim(id=3, prefix=LONG + "  ", suffix="}\n", document="a.rs", max_tokens=3))
    old = await c.final(1)
    assert old.code == "cancelled" and "superseded" in old.message
    assert isinstance(await c.final(3), m.Done)
    assert daemon.by_document.keys() <= {"b.rs"}


async def test_a_deadline_of_zero_is_answered_without_tokens(daemon) -> None:
    c = Conn()
    daemon.submit(c, gen(1, deadline_ms=0))
    done = await c.final(1)
    assert c.of(1) == [done] and done.finish_reason == "deadline" and done.usage.completion_tokens == 0


async def test_events_become_frames(daemon, tiny_engine) -> None:
    """Tokens and Done carry what the engine produced, usage and timings filled in."""
    from m31r.fim import heal_prompt

    c = Conn()
    daemon.submit(c, gen(1, max_tokens=5, sampling=m.Sampling(), seed=None))
    done = await c.final(1)
    tokens = [x for x in c.of(1) if isinstance(x, m.Token)]
    # The daemon heals a Generate's prompt (m31r.fim.heal_prompt): here its last byte, `{`, which only `{` continues
    # in a byte vocabulary. That token finishes the prompt (not streamed, not counted in max_tokens; usage says it
    # was healed), so the five streamed are the unhealed prompt's, and one fewer token was prefilled.
    whole = tiny_engine.tokenizer.encode(PROMPTS[0])
    ids, heal = heal_prompt(tiny_engine.tokenizer, whole)
    assert heal == "{" and len(ids) == len(whole) - 1
    assert [t.token for t in tokens] == alone(tiny_engine, PROMPTS[0], 5)
    u = done.usage
    assert (u.prompt_tokens, u.completion_tokens, u.healed_tokens) == (len(ids), 5, 1)
    assert done.timings.total_ms >= done.timings.prefill_ms > 0


def test_sampling_params_reach_the_engine(tiny_engine) -> None:
    """A seeded sampled request gives what the engine gives for the same seed."""
    params = SamplingParams(temperature=0.8, top_k=20, seed=7)
    outs, _ = run_together(tiny_engine, [PROMPTS[0]], 8, sampling=params)
    assert outs[0] == [p.id for p in tiny_engine.generate(PROMPTS[0], max_tokens=8, sampling=params)]

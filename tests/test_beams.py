"""Beam search (m31r.beams): greedy at width 1, the same answer as a search that gives every hypothesis a cache of
its own, whatever the spare caches held before, and the same answer through the scheduler's shared passes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

RELEASE = Path(__file__).resolve().parent.parent / "release"

FIM_CASES = [
    ("fn main() {\n    let total = items.it", "\n}\n"),
    ("impl Point {\n    fn norm(&self) -> f64 {\n        ", "\n    }\n}\n"),
    ("use std::collections::Ha", "\n\nfn f() {}\n"),
    ("// a comment\nstruct S { a: u8 }\n\nfn build() -> S {\n    S { a", " }\n}\n"),
]


def fim_prompts(engine) -> list[tuple[list[int], str, str]]:
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    budget = FimBudget.for_context(engine.config.max_context)
    out = []
    for prefix, suffix in FIM_CASES:
        p = build_fim_prompt(engine.tokenizer, prefix, suffix, budget)
        out.append((p.ids, p.heal, line_context(prefix)))
    return out


def search(engine, ids: list[int], width: int, **kw):
    from m31r.beams import beam_generate
    from m31r.engine import Outcome

    res = Outcome(prompt_tokens=0)
    pieces = [(p.id, p.text) for p in beam_generate(engine, ids, width=width, result=res, **kw)]
    return pieces, res


def reference(engine, ids: list[int], width: int, max_tokens: int, stop, heal: str, repeat_context) -> list:
    """The same search written plainly: every hypothesis gets a fresh copy of its parent's cache at every step.
    Returns the finished hypotheses, likeliest first."""
    import torch.nn.functional as F

    from m31r.beams import Hypothesis, _extend
    from m31r.stops import StopMatcher

    cache = engine.new_cache()
    for chunk in engine.chunks(cache, ids, 0):
        logits = engine.run([], [chunk])[1][0]
    live = [(Hypothesis(0.0, [], 0, heal.encode(), False, len(heal), b"", StopMatcher(stop, repeat_context)), cache,
             logits)]
    done = []
    room = engine.config.max_context - len(ids)  # healing tokens are not counted in max_tokens (Outcome)
    for i in range(room):
        picks = []
        for k, (h, _, lg) in enumerate(live):
            lg = lg.index_fill(0, engine.unused_ids, float("-inf")) if engine.unused_ids is not None else lg
            if h.owed or h.after_space:
                lg = engine.heal_logits(lg, h.owed)
            top, at = F.log_softmax(lg, dim=-1).topk(width)
            picks += [(h.score + s, k, t) for s, t in zip(top.tolist(), at.tolist(), strict=True) if s != float("-inf")]
        picks.sort(key=lambda p: (-p[0], p[1], p[2]))
        grown = []
        for score, k, tok in picks:
            if len(grown) == width:
                break
            h = _extend(engine, live[k][0], tok, score)
            if h.end:
                done.append(h)
            else:
                grown.append((h, live[k][1].clone()))
        if not grown or (done and max(d.score for d in done) >= grown[0][0].score):
            break
        done += [h for h, _ in grown if h.counted == max_tokens or i + 1 == room]
        grown = [(h, c) for h, c in grown if h.counted < max_tokens and i + 1 < room]
        if not grown:
            break
        rows = engine.decode_rows([c for _, c in grown], [h.tokens[-1] for h, _ in grown])
        live = [(h, c, row) for (h, c), row in zip(grown, rows, strict=True)]
    return sorted(done, key=lambda h: -h.score)


def test_width_one_is_greedy_decoding(tiny_engine):
    from m31r.engine import Outcome

    for ids, heal, context in fim_prompts(tiny_engine):
        for stop in ([], ["\n"], ["; "]):
            kw = dict(max_tokens=24, stop=stop, heal=heal, repeat_context=context)
            res = Outcome(prompt_tokens=0)
            greedy = [(p.id, p.text) for p in tiny_engine.generate(ids, result=res, **kw)]
            pieces, got = search(tiny_engine, ids, 1, **kw)
            assert pieces == greedy
            assert (got.text, got.tokens, got.finish_reason, got.stopped_by) == (
                res.text, res.tokens, res.finish_reason, res.stopped_by)
            assert got.logprobs == pytest.approx(res.logprobs, abs=1e-4)


@pytest.mark.parametrize("which", ["tiny", "release"])
def test_completions_report_each_tokens_log_probability(request, which):
    """Outcome.logprobs: one per token written, then the end token's where the model ended the completion; each the
    model's own log-probability of that token (the prompt and the completion run again in one forward pass), and a
    beam search's sum is its winner's score, which no runner-up beats."""
    import torch.nn.functional as F

    from m31r.engine import Outcome

    engine = request.getfixturevalue(f"{which}_engine")
    ended = 0
    for ids, _, context in fim_prompts(engine):
        for max_tokens in (1, 5, 40):
            res = Outcome(prompt_tokens=0)
            for _ in engine.generate(ids, max_tokens=max_tokens, result=res, repeat_context=context):
                pass
            written = res.tokens + ([engine.tokenizer.eos_id] if res.stopped_by == "end" else [])
            ended += res.stopped_by == "end"
            assert len(res.logprobs) == len(written) >= 1
            with torch.inference_mode():
                logits = engine.model(torch.tensor([ids + written])).float()[0, len(ids) - 1:-1]
            if engine.unused_ids is not None:
                logits = logits.index_fill(1, engine.unused_ids, float("-inf"))
            want = F.log_softmax(logits, -1).gather(1, torch.tensor(written)[:, None])[:, 0]
            assert res.logprobs == pytest.approx(want.tolist(), abs=2e-3)
            assert all(x <= 0 for x in res.logprobs)
    assert ended or which == "tiny"  # the bundled model ends some by itself: the end token's entry is checked
    for ids, heal, context in fim_prompts(engine):
        _, got = search(engine, ids, 3, max_tokens=24, heal=heal, repeat_context=context)
        best = reference(engine, ids, 3, 24, [], heal, context)[0]
        assert sum(got.logprobs) == pytest.approx(best.score, abs=1e-4)
        assert len(got.logprobs) == got.healing_tokens + got.completion_tokens + (got.stopped_by == "end")


@pytest.fixture(scope="module")
def release_engine():
    """The bundled model: unlike the tiny random one, its answers depend on every recent position's keys and values,
    so a hypothesis decoding on another's tail is caught."""
    from m31r.engine import Engine

    return Engine(RELEASE, dtype="float32", quant=None)


@pytest.mark.parametrize("width", [2, 3, 5])
@pytest.mark.parametrize("which", ["tiny", "release"])
def test_search_is_the_search_with_a_cache_per_hypothesis(request, which, width):
    """Tail copies between shared caches (KVCache.take) and spare caches change nothing: the answer and its
    runners-up are those of a search that copies the parent's whole cache for every hypothesis at every step."""
    import m31r.beams as beams

    engine = request.getfixturevalue(f"{which}_engine")
    spares: list = []
    answers = set()
    alternatives = 0
    for ids, heal, context in fim_prompts(engine):
        for stop in ([], ["\n"]):
            ranked = reference(engine, ids, width, 16, stop, heal, context)
            want = ranked[0].tokens
            _, got = search(engine, ids, width, max_tokens=16, stop=stop, heal=heal, repeat_context=context,
                            spares=spares)
            end = [t for t in want if t in engine.stop_ids]
            assert got.tokens + end == want
            answers.add(tuple(want))
            # The runners-up: the next finished hypotheses' texts, each new and not empty, likeliest first.
            texts = [beams._answer(engine, ids, h, stop, heal, context, ()).text for h in ranked[1:]]
            expect = [t for i, t in enumerate(texts) if t.strip() and t != got.text and t not in texts[:i]]
            assert got.alternatives == expect[: width - 1]
            alternatives += len(got.alternatives)
    assert len(answers) > 2  # the cases differ: a search that ignored its prompt would not pass
    assert alternatives > 0 or which == "tiny"  # the random model often finishes one hypothesis only


def test_spare_caches_hold_earlier_prompts_without_changing_answers(tiny_engine):
    """A typing session: each request's prompt extends the last one's. With spares kept from request to request only
    the new tokens are copied into them; the answers are those of searches with no spares at all, and the
    prompt's own cache ends holding the prompt alone."""
    from m31r.beams import MAX_SPARES
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    budget = FimBudget.for_context(tiny_engine.config.max_context)
    prefix, suffix = "fn area(w: f64, h: f64) -> f64 {\n    let result = w * h;\n    res", "\n}\n"
    cache, spares = tiny_engine.new_cache(), []
    for typed in ["", "u", "ul", "ult", "ult +", "ult + 1"]:
        p = build_fim_prompt(tiny_engine.tokenizer, prefix + typed, suffix, budget)
        kw = dict(max_tokens=12, stop=["\n"], heal=p.heal, repeat_context=line_context(prefix + typed))
        warm, _ = search(tiny_engine, p.ids, 4, cache=cache, spares=spares, **kw)
        fresh, _ = search(tiny_engine, p.ids, 4, **kw)
        assert warm == fresh
        assert cache.tokens == p.ids
        assert 0 < len(spares) <= MAX_SPARES
        assert all(s.tokens[: len(p.ids)] == p.ids for s in spares)  # each holds this prompt now


def test_kv_cache_take_copies_only_the_tail(tiny_engine):
    import torch

    a, b = tiny_engine.new_cache(), tiny_engine.new_cache()
    ids = list(range(40, 90))
    for chunk in tiny_engine.chunks(a, ids, 0):
        tiny_engine.run([], [chunk])
    b.take(a, 0)
    assert b.tokens == a.tokens and b.chunks == a.chunks
    assert all(torch.equal(x[:, :, :50], y[:, :, :50]) for x, y in zip(a.k + a.v, b.k + b.v, strict=True))
    c = a.clone()
    tiny_engine.decode_rows([a], [7])
    b.k[0][:, :, 20] = 0  # before `start`: take must leave it alone
    b.take(a, 30)
    assert torch.equal(b.k[0][:, :, 30:51], a.k[0][:, :, 30:51]) and not torch.equal(b.k[0][:, :, 20], a.k[0][:, :, 20])
    assert len(c.tokens) == 50 and len(a.tokens) == 51 and b.tokens == a.tokens  # a clone is a copy


def test_scheduler_runs_searches_beside_greedy_streams(tiny_engine):
    """Through the scheduler (rows of several requests in shared passes) a search answers what it answers alone."""
    from m31rd.prefix_cache import PrefixCache
    from m31rd.scheduler import Request, Scheduler

    prompts = fim_prompts(tiny_engine)
    cache = PrefixCache(tiny_engine, 0, slots=2 * len(prompts))
    sched = Scheduler(tiny_engine, cache, max_active=2 * len(prompts))
    got: dict[tuple[int, int], list] = {}
    for k, (ids, heal, context) in enumerate(prompts):
        for width in (1, 3):
            out = got.setdefault((k, width), [])
            sched.submit(Request(ids, 14, stop=["\n"], heal=heal, repeat_context=context, beams=width),
                         lambda ev, out=out: out.append(ev))
    sched.drain()
    for k, (ids, heal, context) in enumerate(prompts):
        for width in (1, 3):
            *pieces, finished = got[(k, width)]
            alone, res = search(tiny_engine, ids, width, max_tokens=14, stop=["\n"], heal=heal, repeat_context=context)
            assert [(p.id, p.text) for p in pieces] == alone
            assert finished.finish_reason == res.finish_reason and finished.completion_tokens == res.completion_tokens
    assert sched.cache.spares  # the searches' caches stay for the next one


def test_refusals_and_deadline(tiny_engine):
    from m31r.beams import beam_generate

    ids, heal, _ = fim_prompts(tiny_engine)[0]
    with pytest.raises(ValueError, match="beams must be between 1 and 8"):
        list(beam_generate(tiny_engine, ids, width=9))
    with pytest.raises(ValueError, match="empty prompt"):
        list(beam_generate(tiny_engine, [], width=2))
    pieces, res = search(tiny_engine, ids, 3, max_tokens=10, heal=heal, deadline=time.perf_counter())
    assert pieces == [] and res.finish_reason == "deadline"
    pieces, res = search(tiny_engine, ids, 3, max_tokens=0, heal=heal)
    assert pieces == [] and res.finish_reason == "length"


def test_the_daemon_default_width_is_one_number() -> None:
    """`m31r daemon --beams`'s default is DaemonOptions' (the CLI must not import m31rd at startup), and the widest
    search is one number for the engine, the protocol's front ends and the CLI (which imports neither)."""
    from m31r.beams import MAX_BEAMS
    from m31r.cli import daemon, fim, generate
    from m31r_protocol.limits import MAX_BEAMS as PROTOCOL_MAX
    from m31rd.main import BEAMS, DaemonOptions

    option = next(p for p in daemon.params if p.name == "beams")
    assert option.default == BEAMS == DaemonOptions.__dataclass_fields__["beams"].default
    assert MAX_BEAMS == PROTOCOL_MAX
    for command in (daemon, fim, generate):
        width = next(p for p in command.params if p.name == "beams").type
        assert (width.min, width.max) == (1, MAX_BEAMS), command.name


def test_a_cancelled_search_gives_its_caches_back(tiny_engine):
    """Cancelled between rounds, a search ends `cancelled` within a round; its spare caches go back to the
    scheduler and its prompt cache holds the prompt alone, reusable by the next request."""
    from m31rd.prefix_cache import PrefixCache
    from m31rd.scheduler import Failed, Request, Scheduler

    ids, heal, context = fim_prompts(tiny_engine)[1]
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=1), max_active=1)
    events: list = []
    req = Request(ids, 40, heal=heal, repeat_context=context, beams=4)
    sched.submit(req, events.append)
    while sched.rounds < 6:  # the prompt's chunks, then a few decode steps of the search
        sched.round()
    assert not events  # nothing streams before the search ends
    req.cancellation.cancel("superseded")
    sched.drain()
    assert len(events) == 1 and isinstance(events[0], Failed) and events[0].code == "cancelled"
    assert len(sched.cache.spares) == 3 and all(s.tokens[: len(ids)] == ids for s in sched.cache.spares)
    slot = sched.cache.slots[0]
    assert slot.cache.tokens == ids


def test_a_deadline_mid_search_answers_the_best_so_far(tiny_engine, monkeypatch):
    """Past its deadline a search makes no further model call: it answers its likeliest hypothesis, finished or not,
    with finish_reason `deadline`."""
    import m31r.beams as beams

    ids, heal, context = fim_prompts(tiny_engine)[1]
    clock = {"now": 0.0}
    monkeypatch.setattr(beams.time, "perf_counter", lambda: clock["now"])
    res = beams.Outcome(prompt_tokens=0)
    gen = beams.beam_generate(tiny_engine, ids, width=3, max_tokens=40, heal=heal, repeat_context=context,
                              deadline=10.0, batched=True, result=res)
    pieces, steps, sent = [], 0, None
    try:
        while True:
            call = gen.send(sent)
            if isinstance(call, list):
                steps += 1
                if steps == 4:
                    clock["now"] = 20.0  # the deadline passes while the fourth step runs
                sent = tiny_engine.run(call, [])[0]
            elif isinstance(call, beams.Chunk):
                sent = tiny_engine.run([], [call])[1][0]
            else:
                pieces.append(call)
                sent = None
    except StopIteration:
        pass
    assert steps == 4 and res.finish_reason == "deadline"
    # A token per step, and the first one; the healing token is not streamed.
    assert len(res.tokens) == 5 and [p.id for p in pieces] == res.tokens[res.healing_tokens:]


@pytest.mark.parametrize("which", ["tiny", "release"])
def test_hypotheses_read_their_common_prompt_from_one_cache(request, which):
    """Decodes with the same `share` key read positions [0, n) from the first one's cache (native attention): with
    the second cache's copy of the prompt spoiled, its logits are still those of a clean copy, and without `share` the
    spoiled copy shows. The tail past n is each row's own: rows that wrote different tokens get different logits."""
    from m31r.engine import Decode

    engine = request.getfixturevalue(f"{which}_engine")
    assert engine.model.native is not None, "the fp32 kernels load on every x86-64 and Arm CPU CI runs on"
    ids = fim_prompts(engine)[1][0]
    cache = engine.new_cache()
    for _ in engine.prefill(cache, ids, 0):
        pass
    n = len(ids)

    def rows(spoil: bool, share: bool) -> list:
        a, b, c = cache.clone(), cache.clone(), cache.clone()
        if spoil:
            with torch.inference_mode():
                for layer in range(b.n_layers):
                    b.k[layer][:, :, : n // 2] = 3.0
                    b.v[layer][:, :, : n // 2] = -2.0
        key = object()
        return engine.run([Decode(x, t, share=(key, n) if share else None) for x, t in ((a, 11), (b, 11), (c, 12))],
                          [])[0]

    clean = rows(spoil=False, share=False)
    shared = rows(spoil=True, share=True)
    unshared = rows(spoil=True, share=False)
    for got, want in zip(shared, clean, strict=True):
        assert torch.equal(got, want)
    assert not torch.equal(unshared[1], clean[1]) and torch.equal(unshared[0], clean[0])
    assert not torch.equal(clean[2], clean[0])  # the rows' own last tokens still count

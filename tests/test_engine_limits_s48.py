"""Engine.generate at its limits with token healing (session 48): the tokens that write a healed word again do not
count against max_tokens, so the context's room after the prompt is what bounds the loop. These pin that a request
exactly filling the context stays inside it (with and without healing, prompt-lookup drafts on and off, native
kernels and eager torch), that drafts change nothing there, and how max_tokens 0/1, the deadline, min_probability,
sampling and the repetition penalty behave while the healed word is still owed.
"""

from __future__ import annotations

import pytest

import m31r.engine as engine_module
from m31r.engine import Chunk, Decode, Engine, Outcome, Piece
from m31r.fim import heal_prompt
from m31r.model import span_of
from m31r.sampling import SamplingParams

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def eager_engine(tiny_bundle) -> Engine:
    engine = Engine(tiny_bundle, dtype="float32")
    engine.use_kernels(None)
    return engine


@pytest.fixture(params=["default", "eager"])
def engine(request, tiny_engine: Engine, eager_engine: Engine) -> Engine:
    return tiny_engine if request.param == "default" else eager_engine


def run(engine: Engine, ids: list[int], heal: str, max_tokens: int, **kw) -> tuple[Outcome, list[Piece]]:
    res = Outcome(prompt_tokens=0)
    pieces = list(engine.generate(ids, max_tokens=max_tokens, result=res, heal=heal, **kw))
    assert "".join(p.text for p in pieces) == res.text
    return res, pieces


def healed(engine: Engine, text: str) -> tuple[list[int], str]:
    return heal_prompt(engine.tokenizer, engine.tokenizer.encode(text))


@pytest.mark.parametrize("leave", [40, 3, 2, 1])
@pytest.mark.parametrize("heal_on", [False, True])
def test_a_request_filling_the_context_stays_inside_it_and_drafts_change_nothing(engine, leave, heal_on):
    """len(ids) + max_tokens == max_context: the last token picked is the context's last position and is never fed
    (the cache ends one before it), with drafts (m31rd's lookahead 7) exactly as without; the tiny model repeats
    itself, so drafts are accepted right up to the end."""
    ctx = engine.config.max_context
    raw = engine.tokenizer.encode(("ab " * ctx)[: ctx - leave - 2] + "ab")
    ids, heal = heal_prompt(engine.tokenizer, raw) if heal_on else (raw, "")
    assert bool(heal) == heal_on
    runs = []
    for lookahead in (0, 7):
        cache = engine.new_cache()
        res, pieces = run(engine, ids, heal, ctx - len(ids), lookahead=lookahead, cache=cache)
        assert res.finish_reason == "length" and len(ids) + len(res.tokens) == ctx
        assert res.completion_tokens == ctx - len(ids) - res.healing_tokens
        assert res.healing_tokens == (len(heal) if heal_on else 0)  # a byte token per healed byte
        assert cache.tokens == ids + res.tokens[:-1] and cache.capacity <= span_of(ctx)
        assert [p.id for p in pieces if p.id is not None] == res.tokens[res.healing_tokens:]
        runs.append((res.tokens, res.text, res.logprobs))
        if lookahead and leave == 40:
            assert res.accepted > 0
    assert runs[0] == runs[1]


def test_max_tokens_0_and_1_after_a_healed_word(tiny_engine):
    ids, heal = healed(tiny_engine, "fn main")
    res, pieces = run(tiny_engine, ids, heal, 0, lookahead=7)
    assert (res.finish_reason, res.tokens, res.healing_tokens, pieces) == ("length", [], 0, [])
    res, pieces = run(tiny_engine, ids, heal, 1, lookahead=7)
    assert (res.finish_reason, res.healing_tokens, res.completion_tokens) == ("length", 4, 1)
    assert [p.id for p in pieces] == res.tokens[4:] and res.first_token_ms is not None


def test_healing_tokens_that_use_up_the_room_end_with_nothing_written(tiny_engine):
    """Two positions left after a prompt that owes `main`: both go to healing, the completion is empty ("length"),
    no Piece streams the healed text, and there is no first-token time, since no token was shown."""
    ctx = tiny_engine.config.max_context
    ids, heal = healed(tiny_engine, "x" * (ctx - 10) + " main")
    assert heal == "main"
    extra = ctx - 2 - len(ids)
    ids = tiny_engine.tokenizer.encode("y" * extra) + ids if extra > 0 else ids[-extra:]
    assert len(ids) == ctx - 2
    for lookahead in (0, 7):
        res, pieces = run(tiny_engine, ids, heal, 2, lookahead=lookahead)
        assert (res.finish_reason, res.healing_tokens, res.completion_tokens, res.text) == ("length", 2, 0, "")
        assert pieces == [] and res.first_token_ms is None


class Clock:
    """perf_counter for m31r.engine: a deadline passes when the test says so, not when the machine is slow."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


@pytest.mark.parametrize("after", [1, 2, 3])
def test_a_deadline_passing_while_healing_ends_with_nothing_shown(tiny_engine, monkeypatch, after):
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", clock)
    ids, heal = healed(tiny_engine, "fn main")
    res = Outcome(prompt_tokens=0)
    gen = tiny_engine.generate(ids, max_tokens=5, result=res, heal=heal, batched=True, deadline=10.0, lookahead=7)
    shown, decodes, out = [], 0, None
    try:
        ev = next(gen)
        while True:
            if isinstance(ev, Chunk):
                out = tiny_engine.run([], [ev])[1][0]
            elif isinstance(ev, Decode):
                out = tiny_engine.run([ev], [])[0][0]
                decodes += 1
                clock.now = 20.0 if decodes == after else clock.now
            else:
                shown.append(ev)
                out = None
            ev = gen.send(out)
    except StopIteration:
        pass
    assert (res.finish_reason, res.healing_tokens, res.completion_tokens) == ("deadline", after + 1, 0)
    assert shown == [] and res.text == "" and res.first_token_ms is None and decodes == after


def test_min_probability_stops_after_the_healed_word_not_on_it(tiny_engine):
    """The healed word's tokens are the only ones its masks allow here (log-probability 0): a floor near 1 stops at
    the first token of text, "unsure", with the whole word healed."""
    ids, heal = healed(tiny_engine, "fn main")
    res, pieces = run(tiny_engine, ids, heal, 5, min_probability=0.999)
    assert (res.finish_reason, res.stopped_by) == ("stop", "unsure")
    assert (res.healing_tokens, res.completion_tokens, len(pieces)) == (4, 1, 1)
    assert res.logprobs[:4] == [0.0] * 4


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.5, seed=7),
                                    SamplingParams(temperature=1.5, seed=7, repetition_penalty=50.0),
                                    SamplingParams(repetition_penalty=1e30)])
def test_sampling_and_penalties_write_the_healed_word_and_then_max_tokens(tiny_engine, params):
    """A seed repeats itself; no temperature or penalty (the prompt's `fn` and `main` are in its history) breaks the
    healed word, and max_tokens still counts the tokens after it."""
    ids, heal = healed(tiny_engine, "fn main main")
    first, _ = run(tiny_engine, ids, heal, 6, sampling=params)
    again, _ = run(tiny_engine, ids, heal, 6, sampling=params)
    assert (first.tokens, first.text) == (again.tokens, again.text)
    spelled = b"".join(tiny_engine.tokenizer.token_bytes[t] for t in first.tokens[: first.healing_tokens])
    assert spelled == b"main" and first.completion_tokens == 6 and first.finish_reason == "length"

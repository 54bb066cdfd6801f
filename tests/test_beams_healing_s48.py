"""Beam search after token healing (session 48's audit): each hypothesis counts max_tokens from where its own healing
ends (Hypothesis.counted), so hypotheses of one search heal in different numbers of tokens and end "length" at
different steps while others live. The answer is still the plain search's, its usage and log-probabilities line up,
width 1 is greedy decoding token for token up to the context's end, and no cache is written past the context."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_beams import reference, search

from m31r.beams import _answer
from m31r.engine import Engine, Outcome
from m31r.fim import FimBudget, build_fim_prompt, heal_prompt, line_context

RELEASE = Path(__file__).resolve().parent.parent / "release"
# Cursors inside words the bundled BPE model heals in one token (`capacity`) or several (`c` `a` `p` `a`).
CURSORS = ["    pub fn new(capa", "impl Iterator for Cou", "    let mut resu"]


@pytest.fixture(scope="module")
def release_engine() -> Engine:
    return Engine(RELEASE, dtype="float32", quant=None)


def healing_of(engine: Engine, tokens: list[int], heal: str) -> int:
    """How many leading tokens write only healed text (Engine.generate's rule)."""
    owed, n = heal.encode(), 0
    for t in tokens:
        written = engine.tokenizer.token_bytes[t] or b""
        if not (owed and owed.startswith(written)):
            break
        owed, n = owed[len(written):], n + 1
    return n


def test_hypotheses_that_heal_in_different_numbers_of_tokens(release_engine):
    """The answer and runners-up are the plain search's; max_tokens bounds each hypothesis' text tokens alone."""
    engine = release_engine
    budget = FimBudget.for_context(engine.config.max_context)
    mixed = 0
    for prefix in CURSORS:
        p, context = build_fim_prompt(engine.tokenizer, prefix, "\n}\n", budget), line_context(prefix)
        assert p.heal
        for max_tokens in (1, 2, 3):
            for width in (2, 4):
                ranked = reference(engine, p.ids, width, max_tokens, [], p.heal, context)
                healed = {healing_of(engine, h.tokens, p.heal) for h in ranked}
                mixed += len(healed) > 1 and len({len(h.tokens) for h in ranked}) > 1
                for h in ranked:  # a hypothesis not ended by the model wrote exactly max_tokens of text
                    assert h.counted == max_tokens or h.end in ("end", "sequence", "repeat")
                pieces, res = search(engine, p.ids, width, max_tokens=max_tokens, heal=p.heal, repeat_context=context)
                want = [t for t in ranked[0].tokens if t not in engine.stop_ids]
                assert res.tokens == want
                assert res.healing_tokens == healing_of(engine, want, p.heal)
                assert res.completion_tokens == len(want) - res.healing_tokens <= max_tokens
                assert len(res.logprobs) == res.healing_tokens + res.completion_tokens + (res.stopped_by == "end")
                assert [i for i, _ in pieces if i is not None] == res.tokens[res.healing_tokens:]
                assert "".join(t for _, t in pieces) == res.text
                texts = [_answer(engine, p.ids, h, [], p.heal, context, ()).text for h in ranked[1:]]
                expect = [t for i, t in enumerate(texts) if t.strip() and t != res.text and t not in texts[:i]]
                assert res.alternatives == expect[: width - 1]
    assert mixed  # some searches held hypotheses that healed in different numbers of tokens, ending apart


def test_width_one_is_greedy_to_the_contexts_end(tiny_engine):
    """A healed prompt near the context's end: the healing tokens take their room, the search never decodes past
    the context (its caches, spares included, stay under it), and width 1 streams generate's tokens and usage."""
    engine, ctx = tiny_engine, tiny_engine.config.max_context
    ids, heal = heal_prompt(engine.tokenizer, engine.tokenizer.encode("x" * (ctx - 12) + " fn main"))
    assert heal == "main"
    room = ctx - len(ids)
    for max_tokens in (1, room - 4, room):
        for stop in ([], ["\n"]):
            kw = dict(max_tokens=max_tokens, heal=heal, stop=stop, repeat_context=" fn main", top_logprobs=2)
            res = Outcome(prompt_tokens=0)
            greedy = [(p.id, p.text) for p in engine.generate(ids, result=res, **kw)]
            for width in (1, 3):
                cache, spares = engine.new_cache(), []
                pieces, got = search(engine, ids, width, cache=cache, spares=spares, **kw)
                assert len(ids) + len(got.tokens) <= ctx and got.completion_tokens <= max_tokens
                assert got.healing_tokens == min(4, len(got.tokens))
                assert cache.tokens == ids and all(len(s.tokens) < ctx for s in spares)
                if width == 1:
                    assert pieces == greedy
                    assert (got.tokens, got.text, got.finish_reason, got.healing_tokens, got.completion_tokens) == (
                        res.tokens, res.text, res.finish_reason, res.healing_tokens, res.completion_tokens)
                    assert got.logprobs == pytest.approx(res.logprobs, abs=1e-4)
        if max_tokens == room:  # the healing tokens' room: fewer text tokens than asked, at the context's end
            assert res.finish_reason == "length" and res.completion_tokens == room - 4

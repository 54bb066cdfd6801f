"""Token healing's edge cases (session 49 audit, no bug found): what each one must leave unchanged.

Prompts that end inside a multi-byte character's word (`let é`, `x = 日本`: the tiny model's byte tokens write the
healed character in two or three tokens), inside an ASCII word and after indentation, each checked for: the tokens
spell the healed bytes first, the streamed text is what follows them; a stop sequence cuts that text where it cuts
the unstopped text (never inside the healed, prompt's, text); prompt-lookup drafts and a width-1 beam search change
nothing; a seeded sample repeats and writes the healed bytes too; and m31rd.server.token_ends places each streamed
token where its bytes end, also where a healing token wrote only the first byte of the healed character.
"""

from __future__ import annotations

import pytest

from m31r.beams import beam_generate
from m31r.engine import Outcome
from m31r.fim import heal_prompt
from m31r.sampling import SamplingParams
from m31r.stops import first_stop
from m31rd.server import token_ends

pytestmark = pytest.mark.timeout(60)

PROMPTS = ["let é", "x = 日本", "fn main", "fn f() {\n    "]


def run(engine, ids: list[int], heal: str, **kw) -> Outcome:
    res = Outcome(prompt_tokens=0)
    pieces = list(engine.generate(ids, result=res, heal=heal, **kw))
    assert "".join(p.text for p in pieces) == res.text
    assert [p.id for p in pieces if p.id is not None] == res.tokens[res.healing_tokens :]  # healed: not streamed
    return res


def spelled(engine, tokens: list[int]) -> bytes:
    return b"".join(engine.tokenizer.token_bytes[t] or b"" for t in tokens)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_healed_text_then_the_completion(tiny_engine, prompt):
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(prompt))
    assert heal and prompt.endswith(heal)
    hb = heal.encode()
    base = run(tiny_engine, ids, heal, max_tokens=6)
    assert (base.completion_tokens, base.finish_reason) == (6, "length")
    whole = spelled(tiny_engine, base.tokens)
    assert whole.startswith(hb) and base.text == whole[len(hb) :].decode("utf-8", "ignore")
    assert spelled(tiny_engine, base.tokens[: base.healing_tokens]) == hb  # the healing tokens: the heal, exactly
    # Drafts only after the healed text, and then confirmed token by token: the same tokens.
    drafted = run(tiny_engine, ids, heal, max_tokens=6, lookahead=3)
    assert (drafted.tokens, drafted.text, drafted.healing_tokens) == (base.tokens, base.text, base.healing_tokens)
    beam = Outcome(prompt_tokens=0)
    list(beam_generate(tiny_engine, ids, width=1, max_tokens=6, result=beam, heal=heal))
    assert (beam.tokens, beam.text, beam.healing_tokens) == (base.tokens, base.text, base.healing_tokens)
    # A seeded sample repeats, and is held to the healed bytes as greedy decoding is.
    sampling = SamplingParams(temperature=2.0, seed=11)
    a, b = (run(tiny_engine, ids, heal, max_tokens=6, sampling=sampling) for _ in range(2))
    assert a.tokens == b.tokens and spelled(tiny_engine, a.tokens).startswith(hb)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_stop_cuts_the_text_after_the_heal_only(tiny_engine, prompt):
    """A stop made of the healed text's end and the completion's start never matches: the healed text is the
    prompt's. One inside the completion cuts it where it cuts the unstopped text."""
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(prompt))
    base = run(tiny_engine, ids, heal, max_tokens=6)
    straddling = heal[-1] + base.text[:1]
    got = run(tiny_engine, ids, heal, max_tokens=6, stop=[straddling])
    if straddling not in base.text:
        assert (got.text, got.finish_reason) == (base.text, "length")
    for stop in {base.text[k : k + 2] for k in range(len(base.text) - 1)}:
        got = run(tiny_engine, ids, heal, max_tokens=6, stop=[stop])
        assert (got.text, got.finish_reason, got.stop_sequence) == (base.text[: first_stop(base.text, [stop])],
                                                                    "stop", stop)


def test_token_ends_after_a_heal_written_in_byte_tokens(tiny_engine):
    """`é` healed, written again as its two byte tokens (both healing): the streamed tokens are placed from the text's
    start, also where a stop cut the text. A streamed token that wrote only the heal's last byte would have been a
    healing token: such a list is not placed (not typed through) rather than placed wrongly."""
    tok = tiny_engine.tokenizer
    hb = "é".encode()
    lead = next(i for i, b in enumerate(tok.token_bytes) if b == hb[:1])
    cont = next(i for i, b in enumerate(tok.token_bytes) if b == hb[1:])
    assert tok.token_bytes[lead] + tok.token_bytes[cont] == hb
    x, y = tok.encode("x")[0], tok.encode("y")[0]
    assert token_ends(tok, [x, y], "é", "xy", 2, cut=False) == (1, 2)
    assert token_ends(tok, [x, y], "é", "x", 2, cut=True) == (1, 1)  # `y` began a stop
    assert token_ends(tok, [cont, x, y], "é", "xy", 1, cut=False) is None

"""Stop sequences that overlap each other: where the text is cut must not depend on where the tokens' boundaries fall.

A stream meets the stop that ends first; that is where generation stops, and the text is cut before that stop. The
same text, arriving in one piece (one longer token) or in many, must be cut at the same place.
"""

from __future__ import annotations

import random

import pytest
from test_sampling import feed_all

from m31r.stops import StopMatcher


def feed(stops: list[str], pieces: list[str], context: str | None = None) -> tuple[str, bool]:
    """The text a StopMatcher lets through for `pieces`, fed until a stop, then flushed if none hit."""
    return feed_all(StopMatcher(stops, context), pieces)


@pytest.mark.parametrize(("stops", "text", "expected"), [
    (["\n", "}\n\n"], "x}\n\ny", "x}"),  # "\n" ends first: the "}" before it is text
    (["a\n\n", "\n"], "aaa\n\nb", "aaa"),
    (["b\nb", "\n"], "bab\nb", "bab"),
    (["}", "\n\n"], "let a = 1;\n\nb}", "let a = 1;"),  # stops that do not overlap: the first one
    (["ab", "abc"], "xabc", "x"),  # one stop the start of another: both start there
    (["xbc", "abcd"], "zabcd", "z"),  # both end at once: the longer (earlier) one cuts
])
def test_a_stop_that_ends_first_cuts_the_text_however_it_is_split(stops: list[str], text: str,
                                                                  expected: str) -> None:
    """Cut at the earliest *start* of any stop found, a stop that had only begun when another ended took the text
    back to its own start when both came in one token ("x" for "x}\n\n" above), and to the other's when they came
    one character at a time ("x}"): the same model text read two ways."""
    whole = feed(stops, [text])
    chars = feed(stops, list(text))
    assert whole == chars == (expected, True), (whole, chars)


def test_every_split_of_a_text_gives_the_same_cut() -> None:
    """Random texts over a small alphabet, random overlapping stops, with and without the repeated-line stop: the text
    let through, cut into random pieces, equals the one let through a character at a time."""
    rng = random.Random(45)
    alphabet = ["a", "b", "\n", " ", "}"]
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        context = rng.choice([None, "", "a\n", "}\nb\n"])
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 4))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert feed(stops, pieces, context)[0] == feed(stops, list(text), context)[0], (text, pieces, stops, context)


# -- through the real daemon ---------------------------------------------------------------------------------------

PREFIX = "fn parse(s: &str) -> u32 {\n    let mut total = 0;\n    for c in s.chars() {\n        "
SAMPLED = {"sampling": None, "seed": 2**63 + 1, "max_tokens": 24, "logprobs": 3}  # a seed above 2**63: every bit counts


async def test_a_seeded_completion_is_the_same_alone_and_among_neighbours(shared_daemon) -> None:
    """The same seeded request, alone, then again while neighbours of other kinds run beside it on its connection and
    another (greedy with drafts, other seeds, a FIM on the same document key), and again warm: the same tokens, each
    token's log-probability the one its step's top list gives it, and their sum Done.logprob less the end token's."""
    import asyncio

    from m31r_protocol import messages as m
    from m31r_protocol.client import Client

    _, sock = shared_daemon
    kw = dict(SAMPLED, sampling=m.Sampling(temperature=0.9, top_p=0.95, top_k=50))

    async def tokens(c: Client) -> list[tuple[int | None, float | None]]:
        stream = await c.fim(PREFIX, "\n    }\n    total\n}\n", document="file:///s45.rs", **kw)
        frames = [t async for t in stream]
        assert stream.done is not None and stream.done.finish_reason in ("length", "stop")
        for t in frames:
            if t.token is not None:
                assert t.logprob is not None and t.logprob <= 0
                tops = {ch.token: ch.logprob for ch in t.top_logprobs}
                if t.token in tops:
                    assert tops[t.token] == t.logprob, (t, tops)
        scored = [t.logprob for t in frames if t.logprob is not None]
        assert stream.done.logprob is not None and len(scored) == stream.done.usage.completion_tokens
        if stream.done.finish_reason == "length":
            assert abs(sum(scored) - stream.done.logprob) < 1e-3
        return [(t.token, t.logprob) for t in frames]

    async with await Client.connect(sock) as c, await Client.connect(sock) as other:
        alone = await tokens(c)
        assert len([t for t, _ in alone if t is not None]) == 24  # (this seed runs to max_tokens)
        neighbours = [
            await other.generate(PREFIX, max_tokens=40, lookahead=4),
            await c.generate(PREFIX + "let x", max_tokens=30, sampling=m.Sampling(temperature=1.2), seed=7),
            await other.fim(PREFIX, "}\n", document="file:///other.rs", max_tokens=20,
                            sampling=m.Sampling(temperature=0.9, top_p=0.95, top_k=50), seed=2**63 + 2),
        ]
        beside = await tokens(c)
        await asyncio.gather(*(n.collect() for n in neighbours))
        warm = await tokens(other)
    assert beside == alone and warm == alone


def test_typed_through_cuts_where_the_model_stops():
    """The daemon's typed-through answer (first_stop) cuts where the model's stop matcher does: at the stop that ends
    first, not the one that starts first (`x}` here, where it gave `x`)."""
    from m31rd.server import first_stop

    for stops, text in ((["\n", "}\n\n"], "x}\n\ny"), (["}\n\n", "\n"], "x}\n\ny"), (["ab", "b"], "xab"),
                        (["\n\n", "\n"], "a\n\nb")):
        cut, hit = StopMatcher(stops).feed(text)
        assert hit and first_stop(text, stops) == len(cut), (stops, text, cut)

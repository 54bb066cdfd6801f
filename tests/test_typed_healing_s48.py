"""Typed-through answers after token healing (session 48): the daemon answers a keystroke that types the start of its
last suggestion from that suggestion, cut to the new request's max_tokens. That cut must give what the model would.

Since healing tokens are no longer streamed nor counted, a request whose cursor is inside a word (`let total`: five
healing tokens on the tiny byte-vocabulary model) counts its max_tokens after them, as the model answering the
keystroke's request does: both are compared here on the real daemon (a fresh document name makes it ask the model).

The cut counted tokens by the frames' texts: text that may begin a stop sequence is held back and sent with a later
token, so the held tokens seemed to end where the one before them did. A keystroke's request allowed one token was
answered with five (m31rd.server.token_ends now places each token by its own bytes).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from m31r.config import load_config
from m31r.tokenizer import Tokenizer
from m31r_protocol.client import Client
from m31rd.server import token_ends

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parent.parent
PREFIX, SUFFIX = "fn main() {\n    let total", "\n}\n"
_fresh = itertools.count()


async def ask(c: Client, prefix: str, document: str, **kw):
    s = await c.fim(prefix, SUFFIX, document=document, lookahead=0, beams=1, **kw)
    text = "".join([t.text async for t in s])
    assert s.done is not None
    return text, s.done


async def model(c: Client, prefix: str, **kw):
    return await ask(c, prefix, f"s48-typed://fresh-{next(_fresh)}", **kw)


async def test_a_keystroke_inside_the_healed_word_is_answered_as_the_model_answers(shared_daemon) -> None:
    """The first request heals `total` (5 tokens, not counted); the keystroke's request types part of the answer,
    which the model would heal again: each cut to max_tokens is the model's own answer to that request."""
    async with await Client.connect(shared_daemon[1], client="s48-typed-heal") as c:
        whole, done = await ask(c, PREFIX, "s48-typed://heal", max_tokens=12)
        assert (done.usage.healed_tokens, done.usage.completion_tokens, len(whole)) == (5, 12, 12), (done, whole)
        checked = 0
        for k in (1, 3, 6):
            for max_tokens in (1, 2, 12 - k - 1):
                await ask(c, PREFIX, "s48-typed://heal", max_tokens=12)  # the suggestion to type through again
                got, typed = await ask(c, PREFIX + whole[:k], "s48-typed://heal", max_tokens=max_tokens)
                want, fresh = await model(c, PREFIX + whole[:k], max_tokens=max_tokens)
                assert fresh.source == "model" and fresh.usage.healed_tokens == 5 + k  # `total` and what was typed
                assert typed.source == "typed_through", (k, max_tokens)
                assert (got, typed.finish_reason) == (want, fresh.finish_reason) == (whole[k : k + max_tokens],
                                                                                      "length")
                checked += 1
        assert checked == 9


async def test_text_held_for_a_stop_sequence_does_not_move_the_token_count(shared_daemon) -> None:
    """A stop sequence the answer's every character could begin holds each one back until the next token: the
    typed-through cut still gives max_tokens tokens, the model's answer (before: the whole rest, 5 for 1)."""
    async with await Client.connect(shared_daemon[1], client="s48-typed-held") as c:
        probe, _ = await model(c, PREFIX, max_tokens=8)
        stop = [probe[0] * 4 + "\u2603"]  # never met, always begun
        whole, done = await ask(c, PREFIX, "s48-typed://held", max_tokens=8, stop=stop)
        assert whole == probe and done.finish_reason == "length", (whole, probe)
        for k, max_tokens in ((1, 3), (3, 1), (2, 2)):
            await ask(c, PREFIX, "s48-typed://held", max_tokens=8, stop=stop)
            got, typed = await ask(c, PREFIX + whole[:k], "s48-typed://held", max_tokens=max_tokens, stop=stop)
            want, fresh = await model(c, PREFIX + whole[:k], max_tokens=max_tokens, stop=stop)
            assert typed.source == "typed_through" and fresh.source == "model"
            assert (got, typed.finish_reason) == (want, fresh.finish_reason), (k, max_tokens, got, want)
            assert len(got) == max_tokens


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json",
                               load_config(REPO / "release" / "config.yaml").special_tokens)


def test_token_ends_places_a_token_that_writes_the_healed_end_again(bpe) -> None:
    """Multi-byte tokens: the first token may write the heal's last bytes again (` tot` healed, ` total` written)."""
    ids = bpe.encode(" total = 1;")
    assert [bpe.token_bytes[i] for i in ids] == [b" total", b" =", b" 1", b";"]
    assert token_ends(bpe, ids, " tot", "al = 1;", 0, cut=False) == (2, 4, 6, 7)
    assert token_ends(bpe, ids, " tot", "al = 1", 0, cut=True) == (2, 4, 6, 6)  # `;` began a stop
    # A healing token (` to` written first) leaves fewer healed bytes to the first token (`t` of `tal`).
    tal = bpe.encode("tal = 1;")
    assert [bpe.token_bytes[i] for i in tal][0] == b"tal"
    assert token_ends(bpe, tal, " tot", "al = 1;", 1, cut=False) == (2, 4, 6, 7)
    assert token_ends(bpe, [], "x", "", 0, cut=False) == ()
    # Text the tokens do not spell (a character a prompt began, bytes left out): not placed, not typed through.
    assert token_ends(bpe, ids, "", "al = 1;", 0, cut=False) is None
    # Where two readings fit a cut text, neither is taken.
    aaa = bpe.encode("aaaaaaaa")
    assert len(aaa) == 1 and token_ends(bpe, aaa + aaa, "aa", "aa", 1, cut=True) is None

"""Prompt-lookup decoding (issue 18): the draft finder, and greedy output bit-identical with and without drafts.

Identity is checked over many prompts on the tiny random model, whose greedy output falls into loops that the
context predicts, so that drafts are both accepted and rejected: in fp32, bf16 + int8 and bf16 + int4 weights,
each with the native kernels (where the CPU runs them) and in eager torch, alone and batched through the scheduler,
and with stop sequences, max_tokens and deadlines. Run the file under M31R_KERNELS=eager too: `load` then picks no
family at all. test_daemon.py checks the same over a real socket.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from m31r import native
from m31r.engine import Engine, Outcome
from m31r.lookup import Lookup, find_drafts
from m31r.model import SPAN
from m31rd.scheduler import run_together

SOURCE = """use std::collections::HashMap;

pub struct Counter { counts: HashMap<String, usize>, total: usize }

impl Counter {
    pub fn new() -> Self { Counter { counts: HashMap::new(), total: 0 } }
    pub fn add(&mut self, word: &str) { *self.counts.entry(word.to_string()).or_insert(0) += 1; self.total += 1; }
    pub fn get(&self, word: &str) -> usize { self.counts.get(word).copied().unwrap_or(0) }
    pub fn total(&self) -> usize { self.total }
}
"""
# Prompt lengths (bytes = tokens on the tiny byte-level vocab) on both sides of SPAN boundaries, where eager decode
# attention limits the drafts (Engine._drafts), and elsewhere.
PROMPTS = [SOURCE[:n] for n in (5, 17, 40, SPAN - 9, SPAN - 3, SPAN - 1, SPAN, SPAN + 2, 90, 2 * SPAN - 5, 150, 211,
                                3 * SPAN - 2, 260, 333, 401)]
MODES = [("float32", None), ("bfloat16", "int8"), ("bfloat16", "int4")]


# -- the draft finder -------------------------------------------------------------------------------------------


def test_drafts_copy_what_followed_the_latest_longest_match() -> None:
    t = [1, 2, 3, 9, 1, 2, 4, 8, 5, 1, 2]
    assert find_drafts(t, 3) == [4, 8, 5]  # "1 2" last occurred at 4..6, followed by 4 8 5 (not 3 9 from earlier)
    assert find_drafts([1, 2, 3, 7, 2, 3, 1, 2, 3], 2) == [7, 2]  # 3-gram "1 2 3" beats the later 2-gram "2 3"
    assert find_drafts([5, 6, 7], 4) == []  # no suffix occurred before
    assert find_drafts([4, 4, 4], 5) == [4] * 5  # a copy that reaches the end repeats: the period goes on
    assert find_drafts([7, 1, 0, 1, 0, 1], 5) == [0, 1, 0, 1, 0]  # "0 1" ended at 4: copy 0 1, then repeat it
    assert find_drafts([1, 2, 1], 0) == [] and find_drafts([], 3) == [] and find_drafts([1], 3) == []


def test_the_incremental_index_finds_what_the_plain_search_finds() -> None:
    rng = random.Random(0)
    for trial in range(200):
        tokens = [rng.randrange(1 + trial % 7) for _ in range(rng.randrange(1, 60))]
        lookup = Lookup(tokens[:3])
        for i in range(3, len(tokens) + 1):
            assert lookup.drafts(4) == find_drafts(tokens[:i], 4), tokens[:i]
            if i < len(tokens):
                lookup.append(tokens[i])


# -- bit-identical output ---------------------------------------------------------------------------------------


def _engine(bundle, dtype: str, quant: str | None, kernels: str) -> Engine:
    engine = Engine(bundle, dtype=dtype, quant=quant)
    if kernels == "eager":
        engine.use_kernels(None)
    elif engine.kernels is None:
        pytest.skip(f"no native kernels here: {native.why_not(engine.dtype)}")
    return engine


@pytest.fixture(scope="module", params=[(*m, k) for m in MODES for k in ("native", "eager")],
                ids=lambda p: f"{p[0]}-{p[1] or 'float'}-{p[2]}")
def engine(request, tiny_bundle) -> Engine:
    return _engine(tiny_bundle, *request.param)


def _run(engine: Engine, prompt: str, k: int, **kw) -> Outcome:
    res = Outcome(prompt_tokens=0)
    pieces = list(engine.generate(prompt, result=res, lookahead=k, **kw))
    assert "".join(p.text for p in pieces) == res.text
    return res


def test_greedy_output_is_bit_identical_with_drafts(engine: Engine) -> None:
    plain = [_run(engine, p, 0, max_tokens=48) for p in PROMPTS]
    assert all(r.decode_steps == r.completion_tokens - 1 and not r.drafted for r in plain if r.completion_tokens)
    for k in (1, 3, engine.decode_width - 1):
        drafted = accepted = 0
        for p, want in zip(PROMPTS, plain, strict=True):
            got = _run(engine, p, k, max_tokens=48)
            assert (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, want.finish_reason), (p, k)
            assert got.decode_steps + got.accepted == max(0, got.completion_tokens - 1)
            drafted, accepted = drafted + got.drafted, accepted + got.accepted
        assert 0 < accepted < drafted, (k, accepted, drafted)  # drafts were both kept and thrown away


def test_the_cache_holds_only_the_sequence(engine: Engine) -> None:
    """Rejected drafts leave no trace a later request could reuse: the cache lists prompt and fed tokens only."""
    cache = engine.new_cache()
    res = Outcome(prompt_tokens=0)
    list(engine.generate(PROMPTS[9], max_tokens=40, cache=cache, result=res, lookahead=4))
    ids = engine.tokenizer.encode(PROMPTS[9])
    assert res.drafted and cache.tokens in (ids + res.tokens, ids + res.tokens[:-1])
    again = _run(engine, PROMPTS[9], 4, max_tokens=40, cache=cache)  # a warm request still decodes the same
    assert again.cached_tokens > 0 and again.tokens == res.tokens


def test_stops_max_tokens_and_deadlines_stay_exact(engine: Engine) -> None:
    for p in PROMPTS[::3]:
        full = _run(engine, p, 0, max_tokens=40)
        text = full.text
        for max_tokens in (1, 2, 3, 7):
            got = _run(engine, p, 5, max_tokens=max_tokens)
            assert got.tokens == full.tokens[:max_tokens] and got.completion_tokens <= max_tokens
        for stop in {text[5:7], text[12:15], text[20:21]} - {""}:
            want = _run(engine, p, 0, max_tokens=40, stop=[stop])
            got = _run(engine, p, 5, max_tokens=40, stop=[stop])
            assert (got.text, got.finish_reason, got.tokens) == (want.text, want.finish_reason, want.tokens)
            assert stop not in got.text
        gone = _run(engine, p, 5, max_tokens=40, deadline=time.perf_counter())
        assert gone.finish_reason == "deadline" and not gone.tokens
        soon = _run(engine, p, 5, max_tokens=40, deadline=time.perf_counter() + 0.02)
        assert full.tokens[: len(soon.tokens)] == soon.tokens


def test_sampling_and_penalties_run_without_drafts(tiny_engine: Engine) -> None:
    from m31r.sampling import SamplingParams

    for params in (SamplingParams(temperature=0.8, seed=3), SamplingParams(repetition_penalty=1.3)):
        want = _run(tiny_engine, PROMPTS[10], 0, max_tokens=24, sampling=params)
        got = _run(tiny_engine, PROMPTS[10], 4, max_tokens=24, sampling=params)
        assert got.tokens == want.tokens and got.drafted == 0


def test_batched_streams_with_drafts_decode_as_they_do_alone(engine: Engine) -> None:
    """Several streams asking for drafts share rounds through the scheduler (Engine.run drops their drafts while
    they do, and the last one left drafts alone): each decodes what it decodes alone."""
    prompts = PROMPTS[2::2]
    alone = [[p.id for p in engine.generate(x, max_tokens=32)] for x in prompts]
    together, sched = run_together(engine, prompts, 32, lookahead=3)
    assert together == alone
    assert sched.rounds < max(len(a) for a in alone) * len(prompts)


def test_drafts_run_for_a_lone_decode_only(tiny_engine: Engine) -> None:
    """A round of several decodes runs none of their drafts (each Decode's emptied, one logits row back, the logits
    a round without drafts gives); a lone decode runs its drafts (a row per token fed)."""
    from m31r.engine import Decode

    def caches() -> list:
        out = [tiny_engine.new_cache() for _ in range(2)]
        for c, ids in zip(out, ([1, 2, 3], [4, 5, 6, 7]), strict=True):
            list(tiny_engine.prefill(c, ids, 0))
        return out

    a, b = (Decode(c, 9, drafts) for c, drafts in zip(caches(), ([10, 11], [12]), strict=True))
    got = tiny_engine.run([a, b], [])[0]
    assert a.drafts == [] and b.drafts == [] and [t.shape for t in got] == [(tiny_engine.config.vocab_size,)] * 2
    want = tiny_engine.run([Decode(c, 9) for c in caches()], [])[0]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    lone = Decode(caches()[0], 9, [10, 11])
    assert tiny_engine.run([lone], [])[0][0].shape == (3, tiny_engine.config.vocab_size) and lone.drafts == [10, 11]


def test_a_decode_wider_than_the_pass_is_refused(tiny_engine: Engine) -> None:
    from m31r.engine import Decode

    cache = tiny_engine.new_cache()
    list(tiny_engine.prefill(cache, [1, 2, 3], 0))
    with pytest.raises(ValueError, match="exceeds decode_width"):
        tiny_engine.run([Decode(cache, 4, [5] * tiny_engine.decode_width)], [])
    assert torch.is_tensor(tiny_engine.run([Decode(cache, 4, [5, 6])], [])[0][0])


def test_the_daemon_default_is_one_number() -> None:
    """`m31r daemon --lookahead`'s default is DaemonOptions' (the CLI must not import m31rd at startup)."""
    from m31r.cli import daemon
    from m31rd.main import LOOKAHEAD, DaemonOptions

    option = next(p for p in daemon.params if p.name == "lookahead")
    assert option.default == LOOKAHEAD == DaemonOptions.__dataclass_fields__["lookahead"].default


def test_bulk_indexing_equals_token_by_token() -> None:
    rng = random.Random(1)
    for _ in range(100):
        tokens = [rng.randrange(5) for _ in range(rng.randrange(0, 40))]
        one = Lookup([])
        for t in tokens:
            one.append(t)
        cut = rng.randrange(0, len(tokens) + 1)
        bulk = Lookup(tokens[:cut])
        bulk.extend(tokens[cut:])
        assert bulk.index == one.index and bulk.tokens == one.tokens

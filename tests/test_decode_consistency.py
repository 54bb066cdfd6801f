"""What a request decodes must not depend on how it is served: sampling edge values that must not break token
healing or reach torch as NaN, FIM prompts cut inside a character, and the same tokens whether the prefix cache
hits, misses or holds what a cancelled request left. All on the tiny model, with the real engine and scheduler.
"""

from __future__ import annotations

import pytest

from m31r.engine import Engine, Outcome, Piece
from m31r.fim import FimBudget, build_fim_prompt, cut_suffix
from m31r.sampling import SamplingParams
from m31rd.prefix_cache import PrefixCache
from m31rd.scheduler import Failed, Finished, Request, Scheduler

PROMPT = "fn main() {\n    let abc = 1;\n}\nlet q = "
# Over four 32-token chunks (tiny_engine's chunk_size): a warm slot has several chunks to reuse or keep.
LONG = ("// a prompt long enough that its first chunks are cached and reused\nfn parse(s: &str) -> u32 {\n"
        "    let mut total = 0;\n    for c in s.chars() {\n")


def written(engine: Engine, res: Outcome) -> bytes:
    return b"".join(engine.tokenizer.token_bytes[t] or b"" for t in res.tokens)


@pytest.mark.parametrize("temperature", [1e38, 3e38])
def test_a_repetition_penalty_keeps_the_healing_mask_at_a_huge_temperature(tiny_engine: Engine,
                                                                           temperature: float) -> None:
    """The penalty clamped every seen logit to float32's range, a masked -inf too; at a temperature near float32's
    max such a token is about as likely as an allowed one, so healed completions wrote something else."""
    for seed in range(8):
        res = Outcome(prompt_tokens=0)
        sampling = SamplingParams(temperature=temperature, repetition_penalty=1.5, seed=seed)
        list(tiny_engine.generate(PROMPT, max_tokens=4, heal="xyz", result=res, sampling=sampling))
        assert written(tiny_engine, res).startswith(b"xyz"), (seed, written(tiny_engine, res))


@pytest.mark.parametrize("field", ["temperature", "repetition_penalty"])
def test_nan_sampling_parameters_are_refused(tiny_engine: Engine, field: str) -> None:
    """NaN passed `x < 0` and `x <= 0`: a NaN temperature then failed inside torch.multinomial, and a NaN penalty made
    greedy decoding pick among NaN logits. A clear ValueError names the parameter instead."""
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: float("nan")})


def test_a_suffix_line_cut_inside_a_character_keeps_whole_characters(tiny_engine: Engine) -> None:
    """The byte-level tokenizer spells 漢 in 3 tokens: a first suffix line over the budget cut between them decoded
    to U+FFFD, text the file never had, which the prompt then held."""
    tok = tiny_engine.tokenizer
    line = "let s = \"" + "漢字é" * 40 + "\";\n}\n"
    for budget in range(1, 40):
        kept = cut_suffix(tok, line, budget)
        assert line.startswith(kept) and "\ufffd" not in kept, (budget, kept)
        assert len(tok.encode(kept)) <= budget
    fim = FimBudget.for_context(tiny_engine.config.max_context)
    for pad in range(3):  # the cut falls on each byte of a character
        p = build_fim_prompt(tok, "fn f() {\n    ", "x" * pad + line, fim)
        assert "\ufffd" not in tok.decode(p.ids)


def _serve(sched: Scheduler, engine: Engine, prompt: str, cancel_after: int | None = None,
           **kw) -> tuple[list[tuple[int | None, str]], Finished | Failed]:
    """A request through the scheduler, round by round; `cancel_after`: cancelled after that many rounds."""
    events: list = []
    request = Request(engine.tokenizer.encode(prompt), kw.pop("max_tokens", 16), **kw)
    sched.submit(request, events.append)
    rounds = 0
    while not (events and isinstance(events[-1], Finished | Failed)):
        sched.round()
        rounds += 1
        if rounds == cancel_after:
            request.cancellation.cancel("the test cancels")
    return [(e.id, e.text) for e in events if isinstance(e, Piece)], events[-1]


@pytest.mark.parametrize("kw", [{}, {"lookahead": 4}, {"beams": 3, "stop": ["\n"]},
                                {"sampling": SamplingParams(temperature=0.8, seed=5)}],
                         ids=["greedy", "lookahead", "beams", "sampled"])
def test_the_same_request_decodes_the_same_after_hits_misses_and_cancels(tiny_engine: Engine, kw: dict) -> None:
    """A cold answer, against the same request after a full hit, after a longer prompt shared part of the cache, and
    after requests cancelled mid-prefill and mid-decode left the slot where they stopped."""
    cold, _ = _serve(Scheduler(tiny_engine, PrefixCache(tiny_engine, 0, slots=1)), tiny_engine, LONG, **kw)
    assert cold
    sched = Scheduler(tiny_engine, PrefixCache(tiny_engine, 8, slots=1))
    _serve(sched, tiny_engine, LONG, **kw)
    answer, done = _serve(sched, tiny_engine, LONG, **kw)
    assert answer == cold and isinstance(done, Finished) and done.cached_tokens > 0
    _serve(sched, tiny_engine, LONG + "        total += 1;\n", **kw)
    assert _serve(sched, tiny_engine, LONG, **kw)[0] == cold
    for rounds in (1, 2, 4, 6):  # mid-prefill (its chunks run a round each), then mid-decode
        _, failed = _serve(sched, tiny_engine, LONG + "x" * rounds, cancel_after=rounds, **kw)
        assert isinstance(failed, Failed | Finished)
        assert _serve(sched, tiny_engine, LONG, **kw)[0] == cold

"""Token selection, stop sequences and context limits: greedy by default, reproducible when sampling."""

from __future__ import annotations

import pytest
import torch

from m31r.engine import ContextOverflowError, Engine, Outcome, Piece
from m31r.sampling import Sampler, SamplingParams, filtered_probs
from m31r.stops import StopMatcher

PROMPT = "fn fibonacci(n: u64) -> u64 {\n    match n {\n"


def ordinary_ids(n: int) -> list[int]:
    """n valid non-special ids of the tiny byte vocabulary (384 entries, 5 of them special)."""
    return [5 + i % 379 for i in range(n)]


def run(engine: Engine, prompt: str | list[int] = PROMPT, **kw) -> tuple[list[Piece], Outcome]:
    res = Outcome(prompt_tokens=0)
    out = [t for t in engine.generate(prompt, result=res, **kw) if t is not None]
    return out, res


def sample(engine: Engine, max_tokens: int = 24, **params) -> list[int]:
    return run(engine, max_tokens=max_tokens, sampling=SamplingParams(**params))[1].tokens


# -- engine-level sampling -----------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_different(tiny_engine: Engine) -> None:
    a, b = sample(tiny_engine, temperature=1.0, seed=11), sample(tiny_engine, temperature=1.0, seed=11)
    assert a == b and len(a) >= 8
    others = [sample(tiny_engine, temperature=1.0, seed=s) for s in (12, 13)]
    assert len({tuple(a), *map(tuple, others)}) == 3


def test_greedy_ignores_seed(tiny_engine: Engine) -> None:
    runs = [sample(tiny_engine, temperature=0.0, seed=s) for s in (None, 1, 2)]
    assert runs[0] == runs[1] == runs[2] and runs[0]


def test_top_k_one_and_tiny_top_p_equal_greedy(tiny_engine: Engine) -> None:
    greedy = sample(tiny_engine)
    assert sample(tiny_engine, temperature=1.5, top_k=1, seed=3) == greedy
    assert sample(tiny_engine, temperature=1.5, top_p=1e-6, seed=3) == greedy


def test_top_k_larger_than_vocab(tiny_engine: Engine) -> None:
    big = sample(tiny_engine, temperature=1.0, top_k=100_000, seed=5)
    assert big == sample(tiny_engine, temperature=1.0, seed=5)  # no filtering at all
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    p = SamplingParams(temperature=1.0, top_k=51)
    torch.testing.assert_close(filtered_probs(logits, p), torch.softmax(logits, -1))


def test_repetition_penalty_runs_in_the_engine(tiny_engine: Engine) -> None:
    plain = sample(tiny_engine, max_tokens=40)
    penalised = sample(tiny_engine, max_tokens=40, repetition_penalty=5.0)
    assert len(penalised) > 0 and penalised != plain


# -- the sampler on constructed logits ------------------------------------------------------------------------


def test_top_p_tiny_keeps_only_the_argmax() -> None:
    logits = torch.tensor([0.1, 2.0, 1.9, -3.0])
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=1e-6))
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]))


@pytest.mark.parametrize("params", [
    {"temperature": 1e-50},  # rounds to 0 in float32: 0/0 for the best logit
    {"temperature": 1e300},  # rounds to inf: -inf/inf for a masked logit
    {"temperature": 1.0, "repetition_penalty": 1e-50},  # a seen logit / 0
    {"temperature": 1.0, "repetition_penalty": 1e300},  # every seen logit to -inf
    {"temperature": 0.0, "repetition_penalty": 1e-50},
])
def test_extreme_but_valid_sampling_never_makes_nan(params: dict) -> None:
    """Found by the protocol fuzzer: finite, in-range parameters that over- or underflow in float32 made nan
    probabilities, and multinomial raised (the daemon answered `internal`)."""
    logits = torch.tensor([0.5, 2.0, -1.0, float("-inf"), 1.0])  # a masked id, as tokenizer gaps are
    if params["temperature"] > 0:
        probs = filtered_probs(logits, SamplingParams(**params))
        assert torch.isfinite(probs).all() and abs(float(probs.sum()) - 1) < 1e-5
    sampler = Sampler(SamplingParams(seed=0, **params))
    for history in (None, torch.tensor([0, 1, 2, 4]), torch.arange(5)):  # the last: every id seen, the masked one too
        assert sampler(logits, history) in (0, 1, 2, 4)
    if params["temperature"] == 1e-50:
        assert sampler(logits) == 1  # a vanishing temperature is greedy


def test_top_k_samples_only_from_the_k_best() -> None:
    logits = torch.tensor([1.0, 3.0, 0.0, 2.9, -1.0])
    sampler = Sampler(SamplingParams(temperature=5.0, top_k=2, seed=0))
    drawn = {sampler(logits) for _ in range(200)}
    assert drawn == {1, 3}


def test_repetition_penalty_changes_the_choice() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0, -1.05])
    greedy = Sampler(SamplingParams())
    assert greedy(logits, torch.tensor([0])) == 0  # penalty off: history does not matter
    penalised = Sampler(SamplingParams(repetition_penalty=1.5))
    assert penalised(logits, torch.tensor([0])) == 1  # 2.0 / 1.5 < 1.9
    assert penalised(logits, torch.tensor([2, 3])) == 0
    # Negative logits are multiplied, so a seen token always becomes less likely, never more.
    only_neg = torch.tensor([-1.0, -1.2])
    assert penalised(only_neg, torch.tensor([0])) == 1  # -1.5 < -1.2


def draws(seed: int, n: int = 32) -> list[int]:
    sampler = Sampler(SamplingParams(temperature=1.0, seed=seed))
    return [sampler(torch.zeros(1000)) for _ in range(n)]


def test_every_bit_of_a_seed_counts() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: 0, 2**32 and 2**63 drew the same tokens, and -1 those of
    2**64 - 1. Seeds below 2**32 draw what they always drew, so answers to them stay the same across versions."""
    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, 2**62 - 1, 12345]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    g = torch.Generator().manual_seed(12345)
    assert draws(12345) == [int(torch.multinomial(torch.full((1000,), 1e-3), 1, generator=g)) for _ in range(32)]


def test_unseeded_sampling_still_works() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0))
    assert 0 <= sampler(torch.zeros(10)) < 10


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ],
)
def test_invalid_params_raise(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_invalid_requests_raise(tiny_engine: Engine) -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        run(tiny_engine, max_tokens=-1)
    with pytest.raises(ValueError, match="empty prompt"):
        run(tiny_engine, "")


# -- stop sequences -------------------------------------------------------------------------------------------


def feed_all(m: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = ""
    for p in pieces:
        text, hit = m.feed(p)
        out += text
        if hit:
            return out, True
    return out + m.flush(), False


def test_stop_across_token_boundaries() -> None:
    m = StopMatcher(["o\nba"])
    assert m.feed("fo") == ("f", False)  # "o" might start the stop sequence
    assert m.feed("o\nb") == ("o", False)  # "o\nb" might too
    assert m.feed("ar") == ("", True)  # the stop is not part of the output
    assert feed_all(StopMatcher(["o\nba"]), ["fo", "o\nb", "ar"]) == ("fo", True)


def test_held_text_is_released_by_flush() -> None:
    m = StopMatcher(["o\nba"])
    assert m.feed("x o\n") == ("x ", False)
    assert m.feed("") == ("", False)
    assert m.flush() == "o\n"
    assert m.flush() == ""
    assert feed_all(StopMatcher(["o\nbar"]), ["fo", "o\nb", "az"]) == ("foo\nbaz", False)


def test_earliest_of_several_stops_wins() -> None:
    for stops in (["}", "\n\n"], ["\n\n", "}"]):
        assert feed_all(StopMatcher(stops), ["let a = 1;\n", "\nb}"]) == ("let a = 1;", True)
        assert feed_all(StopMatcher(stops), ["a}", "\n\nb"]) == ("a", True)


def test_overlapping_partial_matches() -> None:
    assert feed_all(StopMatcher(["aab"]), list("aaab")) == ("a", True)
    assert feed_all(StopMatcher(["aab"]), list("aaac")) == ("aaac", False)


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher(["", ""])
    assert m.feed("abc") == ("abc", False) and m.flush() == ""


def repeat_feed(context: str, text: str, stops: list[str] | None = None, split: int = 0) -> tuple[str, bool]:
    """The text a StopMatcher with the repeated-line stop lets through, fed whole or in pieces of `split` chars."""
    pieces = [text[i : i + split] for i in range(0, len(text), split)] if split else [text]
    m = StopMatcher(stops or [], repeat_context=context)
    out, hit = feed_all(m, pieces)
    return out, hit or m.repeated


@pytest.mark.parametrize("split", [0, 1, 2, 3])
def test_repeated_line_stop(split: int) -> None:
    body = "    let a = 1;\n"
    # A line repeating the line before it ends the text; the repeat is left out.
    assert repeat_feed("fn f() {\n", body + body + "    b();\n", split=split) == (body, True)
    # Also the line above the cursor: the document's lines count.
    assert repeat_feed("fn f() {\n" + body + "    ", "let a = 1;\n    b();\n", split=split) == ("", True)
    # A line that only begins like the line before is held while it could repeat, then released whole.
    text = body + "    let a = 2;\n    } else {\n    }\n"
    assert repeat_feed("fn f() {\n", text, split=split) == (text, False)
    # Blank lines and lines that are not whole (no line end yet) never count.
    assert repeat_feed("", "a;\n\n\na;\na;", split=split) == ("a;\n\n\na;\na;", False)
    # Together with a stop sequence that holds line ends back.
    assert repeat_feed("x\n", "    }\n    }\n", ["\n}\n"], split=split) == ("    }\n", True)
    assert repeat_feed("x\n", "  a\n  b\n}\n  b\n", ["\n}\n"], split=split) == ("  a\n  b", True)


@pytest.mark.parametrize("split", [0, 1, 2, 5])
def test_repeated_block_stop(split: int) -> None:
    a, b, c, d = "    a();\n", "    b();\n", "    c();\n", "    d();\n"
    # A block of 2 to 4 lines repeating the block before it ends the text where the repeat begins.
    assert repeat_feed("fn f() {\n", a + b + a + b + a, split=split) == (a + b, True)
    assert repeat_feed("fn f() {\n", a + b + c + a + b + c + a, split=split) == (a + b + c, True)
    assert repeat_feed("fn f() {\n", (a + b + c + d) * 2, split=split) == (a + b + c + d, True)
    # make run's loop of comments: the first line's text begins at the cursor, after its indentation
    loop = "// x\n    // y\n    //\n"
    assert repeat_feed("pub fn f() {\n    ", loop + "    // x\n    // y\n    //\n    // x", split=split) == (loop, True)
    # The lines above the cursor count: a completion that writes them again ends before them.
    assert repeat_feed("fn f() {\n" + a + b + "    ", "a();\n" + b + c, split=split) == ("", True)
    # Longer blocks are not looked for, and a repeat that breaks off lets every held line through, in order.
    five = a + b + c + d + "    e();\n"
    assert repeat_feed("fn f() {\n", five * 2, split=split) == (five * 2, False)
    for text in (a + b + a + c, a + b + c + a + b + d + a, a + b + a + "    b(1);\n"):
        assert repeat_feed("fn f() {\n", text, split=split) == (text, False)
    # Blocks of blank lines alone never count; a blank line inside a block does.
    assert repeat_feed("x\n", "\n\n\n\n" + a, split=split) == ("\n\n\n\n" + a, False)
    assert repeat_feed("fn f() {\n", a + "\n" + a + "\n" + a, split=split) == (a + "\n", True)
    # A shorter repeat inside a longer one that breaks off still ends the text, after the lines before it.
    assert repeat_feed("fn f() {\n" + a + b + b + c, a + b + b + d, split=split) == (a + b, True)
    # What is held when the text ends was no repeat: it comes out.
    assert repeat_feed("fn f() {\n", a + b + a + "    b()", split=split) == (a + b + a + "    b()", False)


def test_a_repeated_block_stop_forks_with_its_state() -> None:
    """A beam search forks a hypothesis's StopMatcher: the copy and the original go on independently."""
    m = StopMatcher([], repeat_context="fn f() {\n")
    out, _ = m.feed("    a();\n    b();\n    a();\n")
    fork = m.clone()
    assert fork.feed("    b();\n") == ("", True)  # the fork completes the repeat
    assert m.feed("    c();\n") == ("    a();\n    c();\n", False) and out == "    a();\n    b();\n"


def test_engine_stops_on_a_stop_sequence(tiny_engine: Engine) -> None:
    _, free = run(tiny_engine, max_tokens=48)
    assert len(free.text) >= 24, free.text
    stop = free.text[12:15]
    expected = free.text[: free.text.find(stop)]
    tokens, res = run(tiny_engine, max_tokens=48, stop=[stop])
    assert res.finish_reason == "stop"
    assert res.text == expected == "".join(t.text for t in tokens)
    assert stop not in res.text
    assert res.completion_tokens < free.completion_tokens
    assert res.tokens == free.tokens[: res.completion_tokens]  # the same greedy path, cut short


def test_engine_flushes_held_text_when_no_stop_hits(tiny_engine: Engine) -> None:
    _, free = run(tiny_engine, max_tokens=16)
    last = free.text[-1]
    # A stop sequence that starts with the final character but never completes: that character is held back
    # until the end and must still come out.
    tokens, res = run(tiny_engine, max_tokens=16, stop=[last + "\x00never"])
    assert res.text == free.text and res.finish_reason == free.finish_reason
    assert tokens[-1].id is None and tokens[-1].text.startswith(last)


# -- context limits -------------------------------------------------------------------------------------------


def test_context_overflow_names_the_numbers(tiny_engine: Engine) -> None:
    ids = ordinary_ids(500)  # 500 prompt tokens in a 512-token context
    with pytest.raises(ContextOverflowError) as e:
        run(tiny_engine, ids, max_tokens=20)
    msg = str(e.value)
    for number in ("500 tokens", "20", "520", "512 tokens"):
        assert number in msg
    assert (e.value.prompt_tokens, e.value.max_tokens, e.value.max_context) == (500, 20, 512)
    assert isinstance(e.value, ValueError)


def test_fit_prompt_keeps_the_end_of_the_prompt(tiny_engine: Engine) -> None:
    ids = ordinary_ids(500)
    assert tiny_engine.fit_prompt(ids, 12) == ids  # fits as it is
    fitted = tiny_engine.fit_prompt(ids, 20, truncate=True)
    assert fitted == ids[-492:]
    _, res = run(tiny_engine, fitted, max_tokens=20)
    assert res.prompt_tokens == 492 and res.completion_tokens > 0
    with pytest.raises(ContextOverflowError):
        tiny_engine.fit_prompt(ids, 20)  # truncation not asked for
    with pytest.raises(ContextOverflowError):
        tiny_engine.fit_prompt(ids, 512, truncate=True)  # nothing of the prompt would fit


def test_generate_refuses_a_prompt_one_token_too_long(tiny_engine: Engine) -> None:
    """The engine never cuts a prompt itself (the caller fits it once, with fit_prompt): one token over the context
    is a clear ValueError before any model call, not a silently shortened prompt."""
    with pytest.raises(ContextOverflowError, match="493 tokens"):
        run(tiny_engine, ordinary_ids(493), max_tokens=20)
    with pytest.raises(TypeError):
        run(tiny_engine, ordinary_ids(10), max_tokens=20, truncate=True)  # no longer the engine's job


def test_prompt_that_exactly_fills_the_context(tiny_engine: Engine) -> None:
    _, res = run(tiny_engine, ordinary_ids(492), max_tokens=20)
    assert res.prompt_tokens + res.completion_tokens <= 512


def test_out_of_vocabulary_prompt_ids_are_refused(tiny_engine: Engine) -> None:
    """Token-id prompts come from clients: a bad id is a request error, not an IndexError inside the model."""
    for bad in ([5, 384], [-1, 5]):
        with pytest.raises(ValueError, match=r"\[0, 384\)"):
            run(tiny_engine, bad)


def test_extreme_top_p_and_temperature_stay_finite() -> None:
    """Fuzzing found top_p=1e-151 (0 in float32) and temperature=1e-40 produced nan probabilities."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    for params in (SamplingParams(temperature=1.0, top_p=1e-151, seed=0),
                   SamplingParams(temperature=1e-40, seed=0),
                   SamplingParams(temperature=1e-40, top_p=1e-151, top_k=2, seed=0)):
        probs = filtered_probs(logits, params)
        assert torch.isfinite(probs).all()
        assert int(probs.argmax()) == 1 and float(probs[1]) == 1.0
        assert Sampler(params)(logits) == 1


def test_reserved_padding_tokens_are_never_generated(tiny_engine) -> None:
    """The byte tokenizer pads its vocabulary with `<|reserved_N|>` entries no text encodes to (123 of 384 here):
    near-uniform sampling would pick them often, yet none is ever emitted."""
    unused = tiny_engine.tokenizer.unused_ids
    assert unused and tiny_engine.unused_ids is not None
    for seed in range(5):
        params = SamplingParams(temperature=5.0, seed=seed)  # near-uniform: reserved ids would be likely
        toks = [t.id for t in tiny_engine.generate("fn main() {", max_tokens=40, sampling=params) if t.id is not None]
        assert not set(toks) & set(unused)

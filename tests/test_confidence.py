"""The confidence floor with the bundled model: lines any Rust reader would write pass the editors' default floor,
a line of noise after a nonsense prefix does not (the first of m31r.engine.line_logprobs, policy.confident), and a
multi-line completion is cut where its lines together fall under it (line_logprobs, policy.confident_lines)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from m31r_protocol.policy import MIN_PROBABILITY, confident, confident_lines

RELEASE = Path(__file__).resolve().parent.parent / "release"

SURE = [
    ("use std::collections::Hash", "\n\nfn main() {}\n", "Map;"),
    ("fn main() {\n    let v: Vec<u32> = Vec::new();\n    for x in v.it", "\n}\n", "er() {"),
    ('fn main() {\n    println!("hello, world', "\n}\n", '!");'),
]
UNSURE = [("fn f(a: u64) -> u64 {\n    let q = zz", "\n}\n")]


@pytest.fixture(scope="module")
def release_engine():
    from m31r.engine import Engine

    return Engine(RELEASE, dtype="float32", quant=None)


def line(engine, prefix: str, suffix: str):
    from m31r.engine import Outcome, line_logprobs
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    p = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(p.ids, max_tokens=24, result=res, heal=p.heal, stop=["\n"],
                             repeat_context=line_context(prefix)):
        pass
    return res.text, line_logprobs(engine.tokenizer.token_bytes, res.tokens, res.logprobs)[0]


@pytest.mark.parametrize(("prefix", "suffix", "want"), SURE)
def test_lines_the_model_knows_pass_the_default_floor(release_engine, prefix, suffix, want):
    text, lp = line(release_engine, prefix, suffix)
    assert text == want and confident(lp, MIN_PROBABILITY), (text, lp)


@pytest.mark.parametrize(("prefix", "suffix"), UNSURE)
def test_noise_falls_below_it(release_engine, prefix, suffix):
    text, lp = line(release_engine, prefix, suffix)
    assert text and not confident(lp, MIN_PROBABILITY), (text, lp)


def test_line_logprobs_splits_the_tokens_figures_at_their_line_breaks():
    from m31r.engine import line_logprobs

    token_bytes = [b"if", b" x", b" {\n    ", b"y", b"();\n\n", b"}", None]
    tokens, logprobs = [0, 1, 2, 3, 4, 5], [-1.0, -2.0, -0.5, -3.0, -0.25, -0.125, -4.0]  # the end's last
    assert line_logprobs(token_bytes, tokens, logprobs) == [-3.5, -3.25, 0.0, -4.125]
    assert line_logprobs(token_bytes, tokens, logprobs, lines=2) == [-3.5, -3.25]  # a stop kept two lines of text
    assert line_logprobs(token_bytes, [0, 1], [-1.0, -2.0]) == [-3.0]  # one line, ended by a limit
    assert line_logprobs(token_bytes, [], [-0.5]) == [-0.5]  # ended at once: one empty line, the end's figure
    assert line_logprobs(token_bytes, [], []) == []  # nothing generated: no figure (Done.line_logprob None)


def test_a_multi_line_completion_is_cut_to_the_lines_the_model_is_sure_of(release_engine):
    """The model is sure enough of its first line to show it, not of the body it invents after it."""
    from m31r.engine import Outcome, line_logprobs
    from m31r.fim import FimBudget, build_fim_prompt, line_context, suffix_stop

    prefix = "use std::fmt;\n\npub struct Point {\n    x: i32,\n    y: i32,\n}\n\nimpl fmt::Display for Point {\n    "
    suffix = "\n}\n"
    engine = release_engine
    p = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(p.ids, max_tokens=64, result=res, heal=p.heal, stop=[suffix_stop(prefix, suffix)],
                             repeat_context=line_context(prefix)):
        pass
    by_line = line_logprobs(engine.tokenizer.token_bytes, res.tokens, res.logprobs, res.text.count("\n") + 1)
    lines = res.text.split("\n")
    assert len(lines) >= 2 and lines[0] == "fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {", res.text
    assert confident(by_line[0], MIN_PROBABILITY), by_line
    assert confident_lines(res.text, by_line, MIN_PROBABILITY) == lines[0], by_line


def block(engine, prefix: str, suffix: str, min_probability: float | None = None):
    from m31r.engine import Outcome, line_logprobs
    from m31r.fim import FimBudget, build_fim_prompt, line_context, suffix_stop

    p = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(p.ids, max_tokens=64, result=res, heal=p.heal, stop=[suffix_stop(prefix, suffix)],
                             repeat_context=line_context(prefix), min_probability=min_probability):
        pass
    return res, line_logprobs(engine.tokenizer.token_bytes, res.tokens, res.logprobs, res.text.count("\n") + 1)


DISPLAY = ("use std::fmt;\n\npub struct Point {\n    x: i32,\n    y: i32,\n}\n\nimpl fmt::Display for Point {\n    ",
           "\n}\n")


@pytest.mark.parametrize(("prefix", "suffix"), [DISPLAY, (UNSURE[0][0] + "\n    ", UNSURE[0][1])])
def test_a_floor_ends_generation_where_it_decided_what_is_shown(release_engine, prefix, suffix):
    """With the floor (Fim.min_probability) the model stops at the token that takes the completion's probability
    under it: in the first line when it is unsure of that, else in the line the editor cuts. The editor then shows
    what it would have shown of the whole completion, from fewer tokens of the same greedy path; without a floor
    nothing changes."""
    free, free_lines = block(release_engine, prefix, suffix)
    cut, cut_lines = block(release_engine, prefix, suffix, MIN_PROBABILITY)
    assert (cut.finish_reason, cut.stopped_by) == ("stop", "unsure")
    assert cut.tokens == free.tokens[: len(cut.tokens)] and len(cut.tokens) < len(free.tokens)
    n = len(cut_lines)  # the last one cut short: its figure so far, at least the whole line's
    assert free.text.startswith(cut.text) and cut_lines[:-1] == free_lines[: n - 1]
    assert cut_lines[-1] >= free_lines[n - 1]
    assert confident(cut_lines[0], MIN_PROBABILITY) == confident(free_lines[0], MIN_PROBABILITY)
    floor = math.log(MIN_PROBABILITY)
    assert sum(cut.logprobs) < floor <= sum(cut.logprobs[:-1])  # its last token crossed the floor
    if confident(free_lines[0], MIN_PROBABILITY):  # shown: cut to the same lines
        shown = confident_lines(free.text, free_lines, MIN_PROBABILITY)
        assert confident_lines(cut.text, cut_lines, MIN_PROBABILITY) == shown and len(cut_lines) >= 2
    else:  # hidden: it stopped in the first line
        assert cut.text.count("\n") == 0 and free.text.startswith(cut.text)
    for off in (None, 0.0):
        same, _ = block(release_engine, prefix, suffix, off)
        assert same.tokens == free.tokens and same.text == free.text


def test_line_logprobs_leaves_the_healed_line_breaks_to_the_prompt():
    """A plain prompt ending in `{\n    ` is healed back to `{`: the first token writes the line break and indent
    again. That break is the prompt's, so it ends no line: its figure joins the completion's first line."""
    from m31r.engine import line_logprobs

    token_bytes = [b"\n    ", b"n", b" > 0\n", b"}", None]
    tokens, logprobs = [0, 1, 2, 3], [-0.5, -1.0, -2.0, -0.25, -3.0]
    assert line_logprobs(token_bytes, tokens, logprobs) == [-0.5, -3.0, -3.25]  # the break read as the text's
    assert line_logprobs(token_bytes, tokens, logprobs, healed_breaks=1) == [-3.5, -3.25]
    assert line_logprobs(token_bytes, tokens, logprobs, lines=1, healed_breaks=1) == [-3.5]
    assert line_logprobs([b"\n\n  ", b"x"], [0, 1], [-1.0, -2.0], healed_breaks=1) == [-1.0, -2.0]


async def test_a_healed_generate_prompt_scores_the_line_the_model_writes(tmp_path: Path):
    """Through the daemon with the bundled model: `generate` after `{\\n    ` (healed back across the line break)
    reports as line_logprob the figure of the first line it shows, not that of the healed break alone."""
    from daemon_util import start_daemon, stop_daemon

    from m31r_protocol import Client

    sock = tmp_path / "s" / "d.sock"
    sock.parent.mkdir(mode=0o700)
    proc = start_daemon(RELEASE, sock)
    try:
        async with await Client.connect(sock) as c:
            stream = await c.generate("pub fn is_power_of_two(n: u64) -> bool {\n    ", max_tokens=24, logprobs=0)
            frames = [t async for t in stream]
    finally:
        stop_daemon(proc)
    done = stream.done
    # The healing token (its text is the prompt's) has no frame; Done's figures count it, with the first line.
    assert done is not None and frames and done.usage.healed_tokens == 1 and done.finish_reason == "length"
    healed = done.logprob - sum(f.logprob for f in frames)  # (no end token: "length")
    first_line = []
    for f in frames:
        first_line.append(f.logprob)
        if "\n" in f.text:
            break
    assert done.line_logprob == pytest.approx(healed + sum(first_line), abs=1e-3)
    assert len(done.logprob_by_line) == "".join(f.text for f in frames).count("\n") + 1
    assert sum(done.logprob_by_line) == pytest.approx(done.logprob, abs=1e-3)

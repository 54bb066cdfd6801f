"""The confidence floor with the bundled model: lines any Rust reader would write pass the editors' default floor,
a line of noise after a nonsense prefix does not (m31r.engine.line_logprob, m31r_protocol.policy.confident)."""

from __future__ import annotations

from pathlib import Path

import pytest

from m31r_protocol.policy import MIN_PROBABILITY, confident

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
    from m31r.engine import Outcome, line_logprob
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    p = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(p.ids, max_tokens=24, result=res, heal=p.heal, stop=["\n"],
                             repeat_context=line_context(prefix)):
        pass
    return res.text, line_logprob(engine.tokenizer.token_bytes, res.tokens, res.logprobs)


@pytest.mark.parametrize(("prefix", "suffix", "want"), SURE)
def test_lines_the_model_knows_pass_the_default_floor(release_engine, prefix, suffix, want):
    text, lp = line(release_engine, prefix, suffix)
    assert text == want and confident(lp, MIN_PROBABILITY), (text, lp)


@pytest.mark.parametrize(("prefix", "suffix"), UNSURE)
def test_noise_falls_below_it(release_engine, prefix, suffix):
    text, lp = line(release_engine, prefix, suffix)
    assert text and not confident(lp, MIN_PROBABILITY), (text, lp)

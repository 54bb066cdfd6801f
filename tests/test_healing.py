"""Token healing: a FIM prompt ends one token early and the completion writes that token's text again first.

The real BPE (release/tokenizer.json) shows why: a cursor line of indentation tokenises as one `    ` piece,
while the finished line `    let x` is `   ` + ` let` + ` x`, so a prompt ending in `    ` is a token sequence
training never produced.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer

from m31r.config import load_config
from m31r.fim import FimBudget, build_fim_prompt, heal_split
from m31r.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json", load_config(REPO / "release/config.yaml")
                               .special_tokens)


def test_token_bytes_spell_every_text(bpe):
    rng = random.Random(0)
    texts = ["    let x = foo.bar_baz(é, \"ü\");\n", "\tfn 🦀() -> Résumé {}", "x\r\ny", "日本語のテキスト"]
    texts += ["".join(chr(rng.randrange(32, 0x3000)) for _ in range(40)) for _ in range(20)]
    for text in texts:
        assert b"".join(bpe.token_bytes[i] for i in bpe.encode(text)) == text.encode()
    specials = [bpe.eos_id, bpe.fim_prefix_id, bpe.fim_suffix_id, bpe.fim_middle_id, bpe.pad_id]
    assert all(bpe.token_bytes[i] is None for i in specials)


def test_heal_split_takes_whole_characters(bpe):
    for line in ["    ", "    let x = foo.ba", "let s = \"hé", "// 🦀", "x"]:
        ids = bpe.encode(line)
        kept, healed = heal_split(bpe, ids)
        assert healed and kept == ids[: len(kept)] and bpe.decode(kept) + healed == line
    assert heal_split(bpe, []) == ([], "")


def test_heal_split_owes_the_whole_word_the_cursor_is_in(bpe):
    """`thi` is `th` + `i`: healed by `i` alone, the prompt ends in a split no training text has."""
    from m31r.fim import HEAL_WORD_BYTES

    for line, healed_text in [("methods of thi", " thi"), ("let d = Durati", " Durati"), ("x.foo_ba", "foo_ba"),
                              ("let x = 42", " 42"), ("foo(a, b", " b"), ("    ", "    ")]:
        ids = bpe.encode(line)
        kept, healed = heal_split(bpe, ids)
        assert healed == healed_text and kept == ids[: len(kept)] and bpe.decode(kept) + healed == line
    long = "let v = a_very_long_identifier_name_that_goes_on"
    ids = bpe.encode(long)
    kept, healed = heal_split(bpe, ids)
    assert 0 < len(healed.encode()) <= HEAL_WORD_BYTES and bpe.decode(kept) + healed == long
    assert bpe.decode(kept).startswith("let v = a_very")  # the word's start stays in the prompt, its end is owed


def test_heal_ids_continue_the_owed_text(bpe):
    owed = b"    "
    ids = bpe.heal_ids(owed)
    assert bpe.encode("    ")[0] in ids and bpe.encode("   ")[0] in ids  # the token itself, and a prefix of it
    for i in ids:
        b = bpe.token_bytes[i]
        assert b.startswith(owed) or owed.startswith(b)
    assert bpe.encode(" let")[0] not in ids and bpe.eos_id not in ids
    # The cursor stands after that whitespace: no token may add to it (8 spaces, a space then more).
    assert bpe.encode("        ")[0] not in ids and all(bpe.token_bytes[i].strip(b" ") == b"" for i in ids)
    assert not any(bpe.token_bytes[i][:1] in (b" ", b"\t") for i in bpe.heal_ids(b""))
    assert bpe.encode(" foo")[0] in bpe.heal_ids(b" ") and bpe.encode("  ")[0] not in bpe.heal_ids(b" ")


def test_heal_ids_are_every_token_the_definition_allows(bpe):
    """The bisection over sorted token bytes finds exactly what a pass over the vocabulary finds."""

    def by_definition(rest: bytes) -> list[int]:
        out = []
        for i, b in enumerate(bpe.token_bytes):
            if b and (b.startswith(rest) and not (rest[-1:] in (b" ", b"\t") and b[len(rest):][:1] in (b" ", b"\t"))
                      or rest.startswith(b) and b != rest):
                out.append(i)
        return out

    rng = random.Random(1)
    owed = [b" Durati", b" ", b"\t", b"    ", b"  \t", "é".encode(), "é".encode()[:1], b"\n    ", b"zzqqxx"]
    owed += [b for b in (bpe.token_bytes[rng.randrange(bpe.vocab_size)] for _ in range(200)) if b]
    owed += [b[: rng.randrange(1, len(b) + 1)] for b in owed]
    for rest in owed:
        assert bpe.heal_ids(rest) == by_definition(rest), rest


def test_prompt_leaves_the_healed_token_out(bpe):
    budget = FimBudget.for_context(1024)
    prefix, suffix = "fn main() {\n    let v = vec![1, 2];\n    v.it", "\n}\n"
    p = build_fim_prompt(bpe, prefix, suffix, budget)
    whole = build_fim_prompt(bpe, prefix, suffix, budget, heal=False)
    assert p.heal and p.ids == whole.ids[: len(p.ids)] and len(whole.ids) > len(p.ids)
    assert bpe.decode(whole.ids[len(p.ids) :]) == p.heal and prefix.endswith(p.heal)
    assert build_fim_prompt(bpe, prefix + "\n", suffix, budget).heal == ""  # nothing typed on the line


@pytest.fixture(scope="module")
def bpe_engine(tmp_path_factory):
    """A random-weight model with the release tokenizer's vocabulary: tiny, but with real multi-byte tokens."""
    import torch

    from m31r.bundle import init_bundle
    from m31r.config import ModelConfig
    from m31r.engine import Engine

    config = ModelConfig(name="heal-test", n_layers=1, d_model=32, n_heads=2, ffn_hidden=64, vocab_size=16384,
                         max_context=256)
    out = tmp_path_factory.mktemp("bpe") / "bundle"
    tok = HFTokenizer.from_file(str(REPO / "release" / "tokenizer.json"))
    init_bundle(config, out, seed=3, dtype=torch.float32, tokenizer=tok)
    return Engine(out, dtype="float32")


def run(engine, ids, heal, max_tokens=6):
    from m31r.engine import Outcome

    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(ids, max_tokens=max_tokens, result=res, heal=heal):
        pass
    return res


@pytest.mark.parametrize("line", ["    ", "    let x = foo.ba", "    // é", "let s = \"hé", "    // methods of thi"])
def test_healed_generation_writes_the_token_again_and_returns_only_what_follows(bpe_engine, line):
    tok = bpe_engine.tokenizer
    budget = FimBudget.for_context(bpe_engine.config.max_context)
    p = build_fim_prompt(tok, "fn f() {\n" + line, "\n}\n", budget)
    assert p.heal
    res = run(bpe_engine, p.ids, p.heal)
    written = b"".join(tok.token_bytes[i] for i in res.tokens)
    assert written.startswith(p.heal.encode())  # held to the owed text, whatever the random weights prefer
    # ... and it is not returned (the stream holds back bytes that never complete a character)
    rest = written.decode("utf-8", "ignore")[len(p.heal) :]
    assert rest.startswith(res.text) and (res.text == rest or rest != written.decode("utf-8", "replace")[len(p.heal):])
    unhealed = run(bpe_engine, p.ids, "")
    assert not b"".join(tok.token_bytes[i] for i in unhealed.tokens).startswith(p.heal.encode())
    if p.heal[-1] in " \t":  # after whitespace the completion never opens with more of it
        assert res.text[:1] not in (" ", "\t") and written[len(p.heal.encode()) :][:1] not in (b" ", b"\t")


@pytest.mark.parametrize("seed", range(12))
def test_no_completion_doubles_the_whitespace_before_the_cursor(bpe_engine, seed):
    """Random cursors after indentation or a space, sampled (random weights, so whitespace tokens get drawn)."""
    from m31r.sampling import SamplingParams

    tok = bpe_engine.tokenizer
    budget = FimBudget.for_context(bpe_engine.config.max_context)
    rng = random.Random(seed)
    line = rng.choice(["    ", "        ", "\t", "    let x = ", "    foo(a, ", "    // note: "])
    p = build_fim_prompt(tok, "fn f() {\n" + line, "\n}\n", budget)
    from m31r.engine import Outcome

    res = Outcome(prompt_tokens=0)
    for _ in bpe_engine.generate(p.ids, max_tokens=4, result=res, heal=p.heal,
                                 sampling=SamplingParams(temperature=1.5, seed=seed)):
        pass
    assert res.text[:1] not in (" ", "\t"), (line, res.text)


def test_healing_is_the_unhealed_prompt_when_one_token_spells_it(tiny_engine):
    """Byte vocabulary: one token spells each healed byte, so a healed run is exactly the run whose prompt kept it."""
    tok = tiny_engine.tokenizer
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    p = build_fim_prompt(tok, "fn f() {\n    let x", "\n}\n", budget)
    assert p.heal == "x"
    whole = build_fim_prompt(tok, "fn f() {\n    let x", "\n}\n", budget, heal=False)
    # The token writing "x" again is the prompt's: max_tokens counts the eight after it, as the plain run's.
    healed, plain = run(tiny_engine, p.ids, p.heal, 8), run(tiny_engine, whole.ids, "", 8)
    assert healed.tokens[0] == whole.ids[-1] and healed.tokens[1:] == plain.tokens
    assert healed.text == plain.text
    assert (healed.healing_tokens, healed.completion_tokens, plain.completion_tokens) == (1, 8, 8)

"""FIM sample construction (serving layout, loss categories), CoT spans, row packing, and the stability of
the serving prompt's truncation (m31r.fim). A small BPE tokenizer is trained once per module (< 1 s)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

from m31r.fim import FimBudget, build_fim_prompt, cut_above, cut_suffix, split_prefix
from m31r.tokenizer import SPECIAL_TOKENS, Tokenizer
from m31r.train.samples import (
    COT,
    FIM,
    IGNORE,
    NEXT,
    block_bodies,
    choose_middle,
    cot_spans,
    fim_sample,
    lm_row,
    pack_fim_row,
    tokenize_document,
)
from m31r.train.tokenizer import train_tokenizer

SPECIAL = dict(zip(("eos_token", "fim_prefix_token", "fim_suffix_token", "fim_middle_token", "pad_token"),
                   SPECIAL_TOKENS, strict=True))

DOCS = [
    "use std::collections::HashMap;\n\n/// Counts words.\npub fn count_words(text: &str) -> HashMap<&str, usize> {\n"
    "    let mut counts = HashMap::new();\n    // Split on whitespace, then bump each word's counter.\n"
    "    for word in text.split_whitespace() {\n        *counts.entry(word).or_insert(0) += 1;\n    }\n"
    "    counts\n}\n",
    "pub struct Point<'a> {\n    pub x: i64,\n    pub y: i64,\n    pub name: &'a str,\n}\n\n"
    "impl<'a> Point<'a> {\n    pub fn manhattan(&self, other: &Point<'_>) -> i64 {\n"
    "        (self.x - other.x).abs() + (self.y - other.y).abs()\n    }\n}\n",
    "fn classify(n: u32) -> &'static str {\n    match n {\n        0 => \"zero\",\n"
    "        1..=9 => \"small\",\n        _ if n >= 1000 => \"big\",\n        _ => \"other\",\n    }\n}\n",
    "#[derive(Debug, Clone, PartialEq)]\npub enum Token {\n    Ident(String),\n    Number(u64),\n}\n\n"
    "fn lex(s: &str) -> Vec<Token> {\n    // One token per whitespace-separated word.\n"
    "    s.split(' ').map(|w| match w.parse() {\n        Ok(n) => Token::Number(n),\n"
    "        Err(_) => Token::Ident(w.to_string()),\n    }).collect()\n}\n",
    "fn main() {\n    let s = \"héllo 🦀\";\n    println!(\"{}\", s);\n}",  # no final newline
]


def long_doc(n_fns: int = 40) -> str:
    """A file of many small indented functions: long enough that every FIM budget truncates."""
    parts = []
    for i in range(n_fns):
        parts.append(f"/// Adds {i}.\npub fn add_{i}(x: u32) -> u32 {{\n    let y = x + {i};\n    y * 2\n}}\n\n")
    return "".join(parts)


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d = tmp_path_factory.mktemp("samples_tok")
    with open(d / "train.jsonl", "w") as f:
        for i, text in enumerate([*DOCS, long_doc()] * 3):
            f.write(json.dumps({"path": f"f{i}.rs", "text": text}) + "\n")
    train_tokenizer(d / "train.jsonl", d / "tokenizer.json", 420)
    return Tokenizer.from_file(d / "tokenizer.json", SPECIAL)


BIG = FimBudget.for_context(8192)  # nothing in DOCS is ever truncated


def parts(tok: Tokenizer, ids: list[int]) -> tuple[list[int], list[int], list[int], int, int]:
    """Split one sample at its control tokens: (S, P_above, P_line + middle, index of prefix, of middle)."""
    i_pre, i_mid = ids.index(tok.fim_prefix_id), ids.index(tok.fim_middle_id)
    return ids[1:i_pre], ids[i_pre + 1 : i_mid], ids[i_mid + 1 : -1], i_pre, i_mid


def draw(tok: Tokenizer, text: str, rng: random.Random, budget: FimBudget = BIG):
    """A sample together with the middle span it was built from (choose_middle replayed on a copy)."""
    twin = random.Random()
    twin.setstate(rng.getstate())
    a, b = choose_middle(text, twin)
    return a, b, fim_sample(tok, text, rng, budget)


# -- layout and categories ------------------------------------------------------------------------------


def test_fim_layout_and_parts_decode_to_the_original_text(tok):
    rng = random.Random(1)
    controls = (tok.fim_suffix_id, tok.fim_prefix_id, tok.fim_middle_id, tok.eos_id)
    for _ in range(300):
        text = DOCS[rng.randrange(len(DOCS))]
        a, b, s = draw(tok, text, rng)
        ids = s.ids
        assert ids[0] == tok.fim_suffix_id and ids[-1] == tok.eos_id
        for c in controls:
            assert ids.count(c) == 1, (c, ids)
        s_ids, above_ids, rest, i_pre, i_mid = parts(tok, ids)
        assert 0 < i_pre < i_mid < len(ids) - 1
        above, line = split_prefix(text[:a])
        assert tok.decode(s_ids) == text[b:]
        assert tok.decode(above_ids) == above
        assert tok.decode(rest) == line + text[a:b]
        # The prompt part is exactly what the daemon builds for this prefix and suffix: P_line tokenised on its
        # own, less its last token when that is healed; the middle then starts by writing that token's text.
        prompt = build_fim_prompt(tok, text[:a], text[b:], BIG)
        assert ids[: len(prompt.ids)] == prompt.ids
        assert rest[: prompt.line_tokens] == tok.encode(line)[: prompt.line_tokens]
        assert line.endswith(prompt.heal) and (prompt.heal != "") == (line != "")
        assert tok.decode(ids[len(prompt.ids) :]).startswith(prompt.heal)


def test_loss_categories(tok):
    rng = random.Random(2)
    for _ in range(300):
        text = DOCS[rng.randrange(len(DOCS))]
        a, b, s = draw(tok, text, rng)
        ids, cats = s.ids, s.cats
        assert len(cats) == len(ids)
        _, _, _, i_pre, i_mid = parts(tok, ids)
        assert [i for i, c in enumerate(cats) if c == IGNORE] == [0, i_pre, i_mid]  # the three control tokens
        assert all(c == NEXT for c in cats[1:i_pre])  # S
        assert all(c == NEXT for c in cats[i_pre + 1 : i_mid])  # P_above
        assert all(c == FIM for c in cats[i_mid + 1 :])  # P_line, the middle and the closing <|endoftext|>
        assert cats[-1] == FIM and ids[-1] == tok.eos_id
        assert COT not in cats


def test_empty_suffix_and_empty_middle_occur_and_are_well_formed(tok):
    rng = random.Random(3)
    empty_suffix = empty_middle = 0
    for _ in range(400):
        text = DOCS[rng.randrange(len(DOCS))]
        a, b, s = draw(tok, text, rng)
        s_ids, _, rest, i_pre, i_mid = parts(tok, s.ids)
        if b == len(text):
            empty_suffix += 1
            assert i_pre == 1 and s_ids == []
        if a == b:
            empty_middle += 1
            _, line = split_prefix(text[:a])
            assert rest == tok.encode(line)  # only the typed cursor-line text, then <|endoftext|>
            assert s.ids[-1] == tok.eos_id and s.cats[-1] == FIM
    assert empty_suffix >= 20, empty_suffix
    assert 5 <= empty_middle <= 60, empty_middle  # ~5% of draws


def test_middle_mostly_starts_at_a_line_start():
    rng = random.Random(4)
    text = long_doc(10)
    spans = [choose_middle(text, rng) for _ in range(2000)]
    at_line_start = sum(a == 0 or text[a - 1] == "\n" for a, _ in spans) / len(spans)
    assert 0.8 <= at_line_start < 0.97, at_line_start  # 85% by design, plus random hits on line starts
    assert all(0 <= a <= b <= len(text) for a, b in spans)
    ends_mid_line = sum(0 < b < len(text) and text[b - 1] != "\n" and text[b] != "\n" for _, b in spans)
    assert ends_mid_line > 100  # ...and it ends anywhere
    single_line = sum(a < b and "\n" not in text[a : b - 1] for a, b in spans)
    assert single_line > 400


def test_block_bodies_are_found_by_indentation():
    lines = ("fn f(x: u32) -> u32 {\n    if x > 1 {\n        x - 1\n    } else {\n\n        0\n    }\n}\n"
             "fn empty() {\n}\nfn long() {\n" + "    a();\n" * 5 + "}\n").splitlines(keepends=True)
    # f's body (lines 1-6), the if's (2), the else's (4-5, a blank line inside); empty() has no body; long()'s
    # body has 5 lines, kept only when max_lines allows it.
    assert block_bodies(lines, 8) == [(1, 7), (2, 3), (4, 6), (11, 16)]
    assert block_bodies(lines, 4) == [(2, 3), (4, 6)]
    # A `{` line whose body never closes at its own indentation is not a block body.
    assert block_bodies(["fn g() {\n", "    x\n", "  }\n"], 8) == []


def test_block_middles_end_where_the_closing_line_starts():
    rng = random.Random(11)
    whole = tail = 0
    for _ in range(400):
        text = DOCS[rng.randrange(len(DOCS) - 1)]  # the last doc's block has no closing line of its own
        lines = text.splitlines(keepends=True)
        bodies = block_bodies(lines, 24)
        a, b = choose_middle(text, rng, block_rate=1.0)
        starts = {sum(map(len, lines[:k])): k for k in range(len(lines) + 1)}
        assert a in starts and b in starts, (a, b)  # whole lines, from a line start to a line start
        i, j = starts[a], starts[b]
        assert lines[j].lstrip().startswith("}")  # the suffix begins with the block's closing line
        body = next((bi, bj) for bi, bj in bodies if bj == j and bi <= i)
        whole += i == body[0]
        tail += i > body[0]
    assert whole > 150 and tail > 40, (whole, tail)  # 60% whole bodies; 40% from a line inside (some land on its first)


def test_block_rate_falls_back_and_zero_changes_nothing():
    text = "const A: u32 = 1;\nconst B: u32 = 2;\n"  # no block at all: the ordinary middles, after the one draw
    rng, twin = random.Random(5), random.Random(5)  # that chose a block middle
    for _ in range(50):
        twin.random()
        assert choose_middle(text, rng, 1.0) == choose_middle(text, twin)
    r1, r2 = random.Random(6), random.Random(6)
    doc = long_doc(5)
    assert [choose_middle(doc, r1) for _ in range(100)] == [choose_middle(doc, r2, 0.0) for _ in range(100)]


def test_block_sample_writes_the_body_then_stops(tok):
    rng = random.Random(12)
    for _ in range(50):
        text = DOCS[0]
        twin = random.Random()
        twin.setstate(rng.getstate())
        a, b = choose_middle(text, twin, 1.0)
        s = fim_sample(tok, text, rng, BIG, block_rate=1.0)
        s_ids, _, rest, _, _ = parts(tok, s.ids)
        assert tok.decode(s_ids) == text[b:] and text[b:].lstrip().startswith("}")
        _, line = split_prefix(text[:a])
        assert tok.decode(rest) == line + text[a:b] and s.ids[-1] == tok.eos_id


def test_long_middle_is_cut_to_the_reserve_without_a_stop(tok):
    """A middle longer than the completion budget is cut and carries no <|endoftext|>: the model must not learn
    to stop at an arbitrary cut point."""
    budget = FimBudget.for_context(128)
    rng = random.Random(5)
    cut = whole = 0
    for _ in range(200):
        a, b, s = draw(tok, long_doc(), rng, budget)
        prompt = build_fim_prompt(tok, long_doc()[:a], long_doc()[b:], budget)
        m_ids = tok.encode(prompt.heal + long_doc()[a:b])  # the healed text is written again first
        assert len(s.ids) <= 128  # prompt + completion fit the context
        tail = s.ids[len(prompt.ids) :]
        if len(m_ids) < budget.reserve:
            whole += 1
            assert tail == m_ids + [tok.eos_id]
        else:
            cut += 1
            assert tail == m_ids[: budget.reserve] and tok.eos_id not in s.ids
            assert s.cats[-1] == FIM
    assert cut > 10 and whole > 100, (cut, whole)


# -- CoT spans ----------------------------------------------------------------------------------------------


def span_texts(text: str) -> list[str]:
    return [text[a:b] for a, b in cot_spans(text)]


def test_cot_spans():
    text = ("fn f(xs: &[u32]) -> u32 {\n    // Sum first, then scale:\n    // the scale is fixed.\n"
            "    let s: u32 = xs.iter().sum();\n    s * 2\n}\n")
    assert span_texts(text) == ["    // Sum first, then scale:\n    // the scale is fixed.\n"]
    assert span_texts("// top-level reason\nfn g() {}\n") == ["// top-level reason\n"]
    # Two blocks, each followed by code.
    two = "// a\nlet x = 1;\n    // b\n    let y = 2;\n"
    assert span_texts(two) == ["// a\n", "    // b\n"]


@pytest.mark.parametrize(
    "text",
    [
        "/// Doc comment.\nfn f() {}\n",
        "//! Crate docs.\nuse std::fmt;\n",
        "// Followed by a blank line.\n\nfn f() {}\n",
        "fn f() {}\n// At the end of the file.\n",
        "fn f() {}\n// At EOF without a newline",
        "// Plain, then\n/// a doc comment.\nfn f() {}\n",
        "let x = 1; // trailing comment\nlet y = 2;\n",
        "/* block comment */\nfn f() {}\n",
    ],
)
def test_not_cot_spans(text):
    assert cot_spans(text) == []


def test_tokenize_document_marks_cot_inside_spans_only(tok):
    # Non-ASCII before the span: offsets must be in characters, like the spans.
    text = ("fn main() {\n    let s = \"héllo 🦀 世界\";\n    // Print it twice, the second time loud.\n"
            "    println!(\"{}\", s);\n    println!(\"{}!\", s.to_uppercase());\n}\n")
    ids, cats = tokenize_document(tok, text)
    assert ids == tok.encode(text) and len(cats) == len(ids)
    assert set(cats) == {NEXT, COT}
    (a, b), = cot_spans(text)
    offsets = tok.hf.encode(text, add_special_tokens=False).offsets
    for (start, _), c in zip(offsets, cats, strict=True):
        assert (c == COT) == (a <= start < b)
    cot_text = tok.decode([i for i, c in zip(ids, cats, strict=True) if c == COT])
    assert cot_text.strip() == text[a:b].strip()  # the comment; the code line's indentation may ride along
    assert "println" not in cot_text and "let" not in cot_text
    assert tokenize_document(tok, "/// docs\nfn f() {}\n")[1] == [NEXT] * len(tok.encode("/// docs\nfn f() {}\n"))


# -- rows ---------------------------------------------------------------------------------------------------


def test_pack_fim_row_lengths_and_alignment(tok):
    rng = random.Random(6)
    seq_len = 256
    budget = FimBudget.for_context(seq_len)
    controls = {tok.fim_suffix_id, tok.fim_prefix_id, tok.fim_middle_id}
    for _ in range(20):
        ids, cats = pack_fim_row(tok, DOCS + [long_doc()], rng, seq_len, budget)
        assert ids.shape == cats.shape == (seq_len + 1,)
        assert ids.dtype == cats.dtype == np.int64
        assert ids[0] == tok.fim_suffix_id
        # Categories are per token: control tokens, and only they, are IGNORE; every <|endoftext|> is FIM.
        assert all((int(i) in controls) == (c == IGNORE) for i, c in zip(ids, cats, strict=True))
        assert all(c == FIM for i, c in zip(ids, cats, strict=True) if i == tok.eos_id)
        # As the trainer reads it: targets ids[1:] carry cats[1:], so no control token is ever a target.
        y, c = ids[1:], cats[1:]
        assert not np.isin(y[c != IGNORE], list(controls)).any()
        # Each sample: FIM from the token after <|fim_middle|> through its <|endoftext|>, NEXT before.
        in_middle = False
        for i, c in zip(ids, cats, strict=True):
            if i == tok.fim_middle_id:
                in_middle = True
            elif i == tok.fim_suffix_id:
                in_middle = False
            elif c != IGNORE:
                assert c == (FIM if in_middle else NEXT)


def test_pack_fim_row_is_deterministic(tok):
    budget = FimBudget.for_context(128)
    r1 = pack_fim_row(tok, DOCS, random.Random(9), 128, budget)
    r2 = pack_fim_row(tok, DOCS, random.Random(9), 128, budget)
    assert all(np.array_equal(x, y) for x, y in zip(r1, r2, strict=True))


def test_lm_row_window_and_alignment():
    n, seq_len = 1000, 64
    stream = np.arange(n, dtype=np.uint16)
    stream_cats = (np.arange(n) % 3).astype(np.int8)
    rng = random.Random(7)
    for _ in range(200):
        ids, cats = lm_row(stream, stream_cats, rng, seq_len)
        assert ids.shape == cats.shape == (seq_len + 1,) and ids.dtype == cats.dtype == np.int64
        assert np.array_equal(np.diff(ids), np.ones(seq_len))  # one contiguous window
        assert np.array_equal(ids % 3, cats)  # categories cut from the same positions as the tokens
        assert ids[0] >= 0 and ids[-1] < n


# -- the serving prompt: truncation stability -------------------------------------------------------------


def fim_middle_at(tok: Tokenizer, ids: list[int]) -> int:
    return ids.index(tok.fim_middle_id)


def test_typing_changes_only_tokens_after_fim_middle(tok):
    text = long_doc()
    budget = FimBudget.for_context(256)
    cursor = text.index("    let y = x + 20;") + 4  # inside an indented line of a long file
    suffix = text[cursor + len("let y = x + 20;") :]
    base = build_fim_prompt(tok, text[:cursor], suffix, budget)
    assert base.above_start_line > 0  # truncation is active on both sides
    assert len(tok.encode(suffix)) > budget.suffix
    head = base.ids[: fim_middle_at(tok, base.ids) + 1]
    typed = "let y = x + 20;"
    for k in range(1, len(typed) + 1):
        p = build_fim_prompt(tok, text[:cursor] + typed[:k], suffix, budget)
        assert p.ids[: len(head)] == head, k
        line = text[text.rfind("\n", 0, cursor) + 1 : cursor] + typed[:k]
        rest = p.ids[len(head) :]  # the cursor line's tokens, less the healed last one
        assert rest == tok.encode(line)[: len(rest)] and tok.decode(rest) + p.heal == line and p.heal


@pytest.mark.parametrize("indent", ["", "    "])
def test_enter_extends_the_part_before_fim_middle(tok, indent):
    """Enter moves the cursor line into P_above. With a column-0 line the head is an exact prefix-extension;
    with an indented one the pre-tokenizer joins P_above's final "\\n" with the new line's indentation
    ("\\n    " is one piece), so exactly that one last token changes."""
    text = long_doc(10)
    budget = FimBudget.for_context(1024)
    suffix = "    done()\n}\n"
    prefix = text + "fn tail() {\n" + indent + "let z = 3;"
    old = build_fim_prompt(tok, prefix, suffix, budget)
    new = build_fim_prompt(tok, prefix + "\n", suffix, budget)
    assert old.above_start_line == new.above_start_line == 0
    old_head = old.ids[: fim_middle_at(tok, old.ids)]
    new_head = new.ids[: fim_middle_at(tok, new.ids)]
    assert len(new_head) > len(old_head)
    keep = len(old_head) if not indent else len(old_head) - 1
    assert new_head[:keep] == old_head[:keep]
    assert new.ids[fim_middle_at(tok, new.ids) + 1 :] == []  # the new cursor line is empty


def test_above_start_moves_only_in_line_steps(tok):
    text = long_doc(60)
    lines = text.splitlines(keepends=True)
    budget = FimBudget(suffix=16, line=8, above=150, reserve=16, line_step=8)
    starts = []
    for n in range(1, len(lines) + 1):
        above = "".join(lines[:n])
        _, start = cut_above(tok, above, budget.above, budget.line_step)
        assert start % budget.line_step == 0 or start == n, (n, start)
        p = build_fim_prompt(tok, above + "    ", "}\n", budget)
        assert p.above_start_line == start and p.above_tokens <= budget.above
        assert tok.decode(p.ids[p.suffix_tokens + 2 : p.suffix_tokens + 2 + p.above_tokens]) == "".join(
            lines[start:n])
        starts.append(start)
    assert starts == sorted(starts)  # it only moves forward as lines are added
    moves = [b - a for a, b in zip(starts, starts[1:], strict=False) if b != a]
    assert moves and all(m % budget.line_step == 0 for m in moves)
    assert len(moves) <= len(lines) // budget.line_step + 1  # once per line_step lines, not per line


def test_suffix_keeps_whole_lines_within_budget(tok):
    text = long_doc(20)
    for budget in (1, 5, 17, 40, 100, 400):
        for cut in (0, 37, 200, len(text) // 2):
            suffix = text[cut:]
            kept = cut_suffix(tok, suffix, budget)
            lines = suffix.splitlines(keepends=True)
            counts = [len(tok.encode(line)) for line in lines]
            if counts[0] > budget:  # the first line alone is too long: it is cut by tokens
                assert suffix.startswith(kept) and len(tok.encode(kept)) <= budget
                continue
            n = kept.count("\n") + (0 if kept.endswith("\n") or not kept else 1)
            assert kept == "".join(lines[:n])  # whole lines, from the cursor forward
            assert sum(counts[:n]) <= budget
            assert n == len(lines) or sum(counts[: n + 1]) > budget  # the next line would not fit
    assert cut_suffix(tok, "", 10) == "" and cut_suffix(tok, "x\n", 0) == ""


def test_short_document_is_kept_whole(tok):
    text = DOCS[0]
    a = text.index("for word")
    p = build_fim_prompt(tok, text[:a], text[a:], FimBudget.for_context(1024))
    assert p.above_start_line == 0
    assert tok.decode(p.ids) + p.heal == text[a:] + text[:a]  # specials are skipped when decoding


def test_fim_budget_fits_the_context():
    for n in (128, 512, 1024, 2048):
        b = FimBudget.for_context(n)
        assert b.suffix + b.line + b.above + b.reserve + 3 == n
        assert min(b.suffix, b.line, b.above, b.reserve) > 0


def test_a_longer_fim_completion_takes_its_room_from_the_lines_above():
    for n in (128, 512, 2048):
        b = FimBudget.for_context(n)
        assert b.with_reserve(b.reserve) is b and b.with_reserve(1) is b  # the usual layout, and its prefix cache
        wide = b.with_reserve(b.max_reserve)
        assert (wide.reserve, wide.suffix, wide.line) == (n // 2, b.suffix, b.line) and wide.above > 0
        assert wide.suffix + wide.line + wide.above + wide.reserve + 3 == n
        with pytest.raises(ValueError, match="more than a fim completion may have"):
            b.with_reserve(b.max_reserve + 1)


def test_a_fim_prompt_never_takes_the_completions_room():
    """The cuts count tokens line by line; a first suffix line cut by tokens, decoded and encoded again, can come
    out longer (3 tokens with the bundled tokenizer and this seed), which with the lines above filling their share
    exactly took the prompt past max_context - reserve and the request failed inside the scheduler."""
    from m31r.config import load_config

    release = Path(__file__).resolve().parent.parent / "release"
    cfg = load_config(release / "config.yaml")
    tok = Tokenizer.from_file(release / "tokenizer.json", cfg.special_tokens, cfg.vocab_size)
    b = FimBudget.for_context(cfg.max_context)
    rnd = random.Random(0)
    alphabet = ["é", "😀", "中", "a", " ", "\t", "x", "\r", "\u2028", "\x85", "\x0b", "ß", "🦀", "\u0301", "{", "}"]
    line = "let a = 1; " * 300  # the lines above: one line of exactly their share
    while len(tok.encode(line + "\n")) > b.above:
        line = line[: -max(1, 2 * (len(tok.encode(line + "\n")) - b.above))]
    while len(tok.encode(line + "x\n")) <= b.above:
        line += "x"
    assert len(tok.encode(line + "\n")) == b.above
    prefix = line + "\n" + "(" * 400
    worst = 0
    for _ in range(60):
        first = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(b.suffix, 4 * b.suffix)))
        suffix = first + "\n}\n"
        worst = max(worst, len(tok.encode(cut_suffix(tok, suffix, b.suffix))) - b.suffix)
        p = build_fim_prompt(tok, prefix, suffix, b)
        assert len(p.ids) <= cfg.max_context - b.reserve
    assert worst == 3  # the case is among them: the re-encoded suffix passed its budget

"""Tokenizer on a tiny fixture corpus: special ids, exact vocab size, round-trip, Rust-aware splitting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer

from m31r.train.tokenizer import (
    RUST_SPLIT_PATTERN,
    SPECIAL_TOKENS,
    build_empty_tokenizer,
    bytes_per_token,
    iter_texts,
    load_tokenizer,
    train_tokenizer,
)

SNIPPETS = [
    "use std::fmt;\n\npub struct Wrapper<'a> {\n    inner: &'a str,\n}\n\n"
    "impl<'a> fmt::Display for Wrapper<'a> {\n"
    "    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {\n"
    "        write!(f, \"[{}]\", self.inner)\n    }\n}\n",
    "pub fn sum(values: &[i64]) -> i64 {\n    let mut total = 0;\n    for v in values {\n"
    "        total += *v;\n    }\n    total\n}\n",
    "fn classify(n: u32) -> &'static str {\n    match n {\n        0 => \"zero\",\n"
    "        1..=9 => \"small\",\n        _ if n >= 1000 && n != 4096 => \"big\",\n        _ => \"other\",\n"
    "    }\n}\n",
    "#[derive(Debug, Clone, PartialEq)]\npub enum Token {\n    Ident(String),\n    Number(u64),\n"
    "    Char(char),\n}\n\nconst NEWLINE: char = '\\n';\n",
]

ROUND_TRIP = [
    "fn main() {\n\tprintln!(\"héllo 🦀 世界\");\r\n    let x = 'é';\n}\n",
    "let s = \"\\u{1F600}\"; // emoji 😀 and CJK 中文字符 and tabs\t\t end",
    "   leading spaces\n\n\n\ttrailing  \t\r\n",
    "<|fim_prefix|>fn a() {}<|fim_suffix|>}<|fim_middle|>",
    "",
    "x<<=1; y>>=2; z..=3; a...b; 'a: loop { break 'a; } r#\"raw\"#",
]


@pytest.fixture(scope="module")
def corpus_jsonl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "train.jsonl"
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(SNIPPETS * 3):
            f.write(json.dumps({"path": f"rust/src/f{i}.rs", "text": text}) + "\n")
    return path


@pytest.fixture(scope="module")
def tok(corpus_jsonl: Path, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return train_tokenizer(corpus_jsonl, tmp_path_factory.mktemp("tok") / "tokenizer.json", vocab_size=512)


def test_regex_compiles_in_tokenizers_engine() -> None:
    Regex(RUST_SPLIT_PATTERN)


def test_special_token_ids(tok: Tokenizer) -> None:
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    expected = ("<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|pad|>")
    assert expected == SPECIAL_TOKENS


def test_vocab_size_is_exact_after_padding(tok: Tokenizer, corpus_jsonl: Path, tmp_path: Path) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == 512
    assert tok.token_to_id("<|reserved_0|>") is not None
    bigger = train_tokenizer(corpus_jsonl, tmp_path / "t.json", vocab_size=700)
    assert load_tokenizer(tmp_path / "t.json").get_vocab_size(with_added_tokens=True) == 700
    assert bigger.get_vocab_size(with_added_tokens=True) == 700


def test_saved_file_reloads_identically(corpus_jsonl: Path, tmp_path: Path) -> None:
    trained = train_tokenizer(corpus_jsonl, tmp_path / "tokenizer.json", vocab_size=512)
    loaded = load_tokenizer(tmp_path / "tokenizer.json")
    text = SNIPPETS[0]
    assert loaded.encode(text).ids == trained.encode(text).ids


@pytest.mark.parametrize("text", ROUND_TRIP + SNIPPETS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    tok.encode_special_tokens = True
    try:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    finally:
        tok.encode_special_tokens = False


def test_reserved_tokens_are_unreachable(tok: Tokenizer) -> None:
    ids = tok.encode("<|reserved_0|> <|reserved_1|>").ids
    assert tok.token_to_id("<|reserved_0|>") not in ids


def test_user_text_cannot_inject_special_tokens(tok: Tokenizer) -> None:
    tok.encode_special_tokens = True
    try:
        ids = tok.encode("<|fim_prefix|>", add_special_tokens=False).ids
    finally:
        tok.encode_special_tokens = False
    assert 1 not in ids
    assert tok.decode(ids) == "<|fim_prefix|>"
    # With special handling on (the daemon building a FIM prompt), the marker is one token.
    assert tok.encode("<|fim_prefix|>", add_special_tokens=False).ids == [1]


def pieces(text: str) -> list[str]:
    pre = build_empty_tokenizer().pre_tokenizer
    return [p for p, _ in pre.pre_tokenize_str(text)]


def test_pre_tokenizer_keeps_rust_units_together() -> None:
    got = pieces("a::b -> c => d ..= e != f <<= g && h || i += 1")
    for op in ["::", "Ġ->", "Ġ=>", "Ġ..=", "Ġ!=", "Ġ<<=", "Ġ&&", "Ġ||", "Ġ+="]:
        assert op in got
    assert "'static" in pieces("&'static str")
    assert "Ġ'a'" in pieces("c == 'a'")
    assert "Ġ&mut" in pieces("x: &mut T")


def test_pre_tokenizer_indentation_and_numbers() -> None:
    got = pieces("{\n        let x = 1234567;\n\tfoo\n}")
    assert "ĊĠĠĠĠĠĠĠĠ" in got  # newline + 8 spaces is a single piece
    assert "Ċĉ" in got
    assert "Ġ123" in got and "456" in got and "7" in got


def test_indentation_is_compact_after_training(tok: Tokenizer) -> None:
    assert len(tok.encode("\n        ").ids) == 1


def test_iter_texts_max_bytes(corpus_jsonl: Path) -> None:
    all_texts = list(iter_texts(corpus_jsonl))
    assert len(all_texts) == len(SNIPPETS) * 3
    capped = list(iter_texts(corpus_jsonl, max_bytes=400))
    assert sum(len(t.encode()) for t in capped) <= 400


def test_bytes_per_token(tok: Tokenizer, corpus_jsonl: Path) -> None:
    bpt = bytes_per_token(tok, corpus_jsonl)
    assert 1.0 < bpt < 20.0
    assert bytes_per_token(tok, corpus_jsonl, max_files=1) > 1.0

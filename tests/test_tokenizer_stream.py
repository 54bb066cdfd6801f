"""Streaming detokenisation never shows half a character, and user text never turns into control tokens."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from m31r.config import ModelConfig
from m31r.tokenizer import SPECIAL_TOKENS, Tokenizer, build_byte_tokenizer

TEXTS = [
    "let café = \"é\";",
    "// 🦀 crab 🦀🦀 rust",
    "fn 中文() -> 字符串 { 你好 }",
    "mixed: é🦀中 ñ ü ß 𝔘 👩‍💻 end",
]
FIM_TEXT = "let s = \"<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>\"; // <|endoftext|> <|pad|>"


@pytest.fixture(scope="module")
def byte_tok(tiny_config: ModelConfig) -> Tokenizer:
    return Tokenizer(build_byte_tokenizer(tiny_config.vocab_size), tiny_config.special_tokens)


@pytest.fixture(scope="module")
def bpe_tok(tiny_config: ModelConfig) -> Tokenizer:
    """A byte-level BPE trained on many different emoji and CJK characters.

    Their shared leading bytes are the most frequent pairs, so merged tokens end in the middle of characters:
    the case a byte-at-a-time test cannot show.
    """
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    varied = ["".join(map(chr, range(0x1F600, 0x1F650))), "".join(map(chr, range(0x4E00, 0x4F00))), "é è ê ç ñ ü"]
    hf.train_from_iterator(varied * 5 + TEXTS, trainer)
    return Tokenizer(hf, tiny_config.special_tokens)


def stream_pieces(tok: Tokenizer, ids: list[int], context: list[int] | None = None) -> list[str]:
    s = tok.stream(context)
    return [s.step(i) for i in ids]


@pytest.mark.parametrize("text", TEXTS)
def test_byte_stream_emits_each_character_when_complete(byte_tok: Tokenizer, text: str) -> None:
    ids = byte_tok.encode(text)
    assert len(ids) == len(text.encode())  # one id per byte: the hardest case for streaming
    pieces = stream_pieces(byte_tok, ids)
    # Piece i is non-empty exactly when byte i completes a character, and then it is that character.
    expected = []
    for ch in text:
        n = len(ch.encode())
        expected += [""] * (n - 1) + [ch]
    assert pieces == expected
    assert "".join(pieces) == text == byte_tok.decode(ids)


@pytest.mark.parametrize("text", TEXTS)
def test_bpe_stream_never_emits_replacement_characters(bpe_tok: Tokenizer, text: str) -> None:
    ids = bpe_tok.encode(text)
    assert len(ids) < len(text.encode())  # merges happened
    pieces = stream_pieces(bpe_tok, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == text == bpe_tok.decode(ids)


def test_bpe_has_tokens_that_split_characters(bpe_tok: Tokenizer) -> None:
    """Guards the test above: the trained vocabulary really contains partial-character tokens."""
    partial = 0
    for text in TEXTS:
        for i in bpe_tok.encode(text):
            if "\ufffd" in bpe_tok.decode([i]):
                partial += 1
    assert partial > 0


@pytest.mark.parametrize("tok_name", ["byte_tok", "bpe_tok"])
@pytest.mark.parametrize("prompt", ["fn main() { é", "🦀🦀🦀", "x中"])
def test_stream_primed_with_the_prompt(request: pytest.FixtureRequest, tok_name: str, prompt: str) -> None:
    """The engine primes the stream with the prompt's last ids; only the continuation may come out."""
    tok: Tokenizer = request.getfixturevalue(tok_name)
    context = tok.encode(prompt)
    for text in TEXTS:
        ids = tok.encode(text)
        pieces = stream_pieces(tok, ids, context)
        assert not any("\ufffd" in p for p in pieces)
        assert "".join(pieces) == text


def test_stream_skips_special_tokens(byte_tok: Tokenizer) -> None:
    ids = byte_tok.encode("a🦀") + [byte_tok.eos_id] + byte_tok.encode("é")
    assert "".join(stream_pieces(byte_tok, ids)) == "a🦀é"


@pytest.mark.parametrize("tok_name", ["byte_tok", "bpe_tok"])
def test_encode_never_yields_special_ids(request: pytest.FixtureRequest, tok_name: str) -> None:
    tok: Tokenizer = request.getfixturevalue(tok_name)
    ids = tok.encode(FIM_TEXT)
    assert not set(ids) & tok.special_ids
    assert tok.fim_prefix_id in tok.special_ids and len(tok.special_ids) == len(SPECIAL_TOKENS)
    assert tok.decode(ids) == FIM_TEXT  # the markers survive as plain text
    assert tok.encode_batch([FIM_TEXT, "x"]) == [ids, tok.encode("x")]


def test_special_ids_decode_to_nothing(byte_tok: Tokenizer) -> None:
    """Ids built by the prompt assembler are control tokens; decode drops them."""
    ids = [byte_tok.fim_prefix_id, *byte_tok.encode("a"), byte_tok.fim_suffix_id, byte_tok.fim_middle_id]
    assert byte_tok.decode(ids) == "a"


def test_missing_special_token_is_reported(tiny_config: ModelConfig) -> None:
    special = {**tiny_config.special_tokens, "fim_middle_token": "<|fim_mid|>"}
    with pytest.raises(KeyError, match="fim_middle_token"):
        Tokenizer(build_byte_tokenizer(384), special)


def test_byte_tokenizer_size(tiny_config: ModelConfig) -> None:
    assert build_byte_tokenizer(384).get_vocab_size(with_added_tokens=True) == 384
    assert build_byte_tokenizer(261).get_vocab_size(with_added_tokens=True) == 261
    with pytest.raises(ValueError, match="261"):
        build_byte_tokenizer(260)

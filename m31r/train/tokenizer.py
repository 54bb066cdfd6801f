"""Byte-level BPE tokenizer for Rust, trained with HF `tokenizers` on the corpus train split.

Byte-level means every string (any UTF-8, CRLF, tabs) round-trips exactly; the Rust-aware
pre-tokenizer keeps operators, lifetimes and indentation runs together so code compresses well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_SUFFIX = "<|fim_suffix|>"
FIM_MIDDLE = "<|fim_middle|>"
PAD = "<|pad|>"
# Order fixes the ids 0..4, which the model and daemon rely on.
SPECIAL_TOKENS = (EOT, FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE, PAD)

# Pieces; at each position the first matching alternative wins. Most may take one leading space
# (GPT-2 style: the space belongs to the next word), except indentation, which is its own piece:
#   newline(s) + indentation | char literal | lifetime | `&mut` | identifier | 1-3 digits |
#   comment opener or multi-char operator | run of brackets/separators (holds no operator
#   character, so it cannot split an operator) | any other single symbol |
#   spaces not followed by text | any other whitespace.
RUST_SPLIT_PATTERN = (
    r"(?:\r?\n)+[ \t]*"
    r"| ?'(?:\\[^\r\n']{1,10}|[^\\\r\n'])'"
    r"| ?'[\p{L}_][\p{L}\p{N}_]*"
    r"| ?&mut\b"
    r"| ?[\p{L}_][\p{L}\p{N}_]*"
    r"| ?\p{N}{1,3}"
    r"| ?(?://[/!]?|/\*|\*/|<<=|>>=|\.\.=|\.\.\.|::|->|=>|\.\.|==|!=|<=|>=|&&|\|\||\+=|-=|\*=|/=|%=|\^=|&="
    r"|\|=|<<|>>)"
    r"| ?[(){}\[\];,?#\"]{1,4}"
    r"| ?[^\s\p{L}\p{N}]"
    r"|[ \t]+(?!\S)"
    r"|\s+"
)


def build_empty_tokenizer() -> Tokenizer:
    """Untrained byte-level BPE with the Rust pre-tokenizer and byte-level decoder (no normalizer)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(RUST_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def iter_texts(jsonl: Path, max_bytes: int | None = None) -> Iterator[str]:
    """Texts of a corpus JSONL; with max_bytes, a path-hash sample of about that size.

    Sampling by hash (instead of taking the head) keeps the sample spread over the whole
    sorted corpus rather than only its first crates.
    """
    keep = 1.0
    if max_bytes is not None:
        total = Path(jsonl).stat().st_size
        keep = min(1.0, max_bytes / max(total, 1))
    used = 0
    with Path(jsonl).open(encoding="utf-8") as f:
        for line in f:
            doc = json.loads(line)
            if keep < 1.0:
                h = int.from_bytes(hashlib.sha256(doc["path"].encode()).digest()[:8], "big")
                if h / 2**64 >= keep:
                    continue
            size = len(doc["text"].encode())
            if max_bytes is not None and used + size > max_bytes:
                return
            used += size
            yield doc["text"]


def pad_vocab(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Fill the model vocab up to exactly `vocab_size` with unreachable `<|reserved_N|>` entries.

    The embedding size equals the tokenizer size, so it must be exact even when BPE runs out of
    merges on a small corpus. They go in the BPE vocab (not added tokens), so no merge ever
    produces them and user text can never be encoded as one.
    """
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"tokenizer has {size} entries, more than vocab_size={vocab_size}")
    if size == vocab_size:
        return tok
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    next_id = max(vocab.values()) + 1
    for n in range(vocab_size - size):
        vocab[f"<|reserved_{n}|>"] = next_id + n
    return Tokenizer.from_str(json.dumps(data))


def train_tokenizer(
    train_jsonl: Path, out_path: Path, vocab_size: int = 16384, *, max_bytes: int | None = None
) -> Tokenizer:
    """Train on the train split, pad to exactly `vocab_size`, write `out_path` (tokenizer.json)."""
    tok = build_empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(train_jsonl, max_bytes), trainer=trainer)
    tok = pad_vocab(tok, vocab_size)
    check_tokenizer(tok, vocab_size)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return tok


def check_tokenizer(tok: Tokenizer, vocab_size: int) -> None:
    """Fail loudly if the invariants the model and daemon depend on do not hold."""
    for i, special in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(special) != i:
            raise ValueError(f"{special} has id {tok.token_to_id(special)}, expected {i}")
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"tokenizer size {size} != vocab_size {vocab_size}")


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def bytes_per_token(tokenizer: Tokenizer, jsonl_path: Path, max_files: int | None = None) -> float:
    """UTF-8 bytes per token over a split: the compression figure reported in the README."""
    n_bytes = n_tokens = 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_tokens
        n_tokens += sum(len(e.ids) for e in tokenizer.encode_batch(batch, add_special_tokens=False))
        batch.clear()

    with Path(jsonl_path).open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if max_files is not None and i >= max_files:
                break
            text = json.loads(line)["text"]
            n_bytes += len(text.encode())
            batch.append(text)
            if len(batch) >= 256:
                flush()
    flush()
    return n_bytes / max(n_tokens, 1)


def main(argv: list[str] | None = None) -> int:
    """`python -m m31r.train.tokenizer TRAIN_JSONL OUT_JSON [--val VAL_JSONL]`."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("train_jsonl", type=Path)
    p.add_argument("out_path", type=Path)
    p.add_argument("--vocab-size", type=int, default=16384)
    p.add_argument("--max-bytes", type=int, default=None)
    p.add_argument("--val", type=Path, default=None, help="report bytes/token on this split")
    args = p.parse_args(argv)
    start = time.perf_counter()
    tok = train_tokenizer(args.train_jsonl, args.out_path, args.vocab_size, max_bytes=args.max_bytes)
    elapsed = time.perf_counter() - start
    print(f"trained {tok.get_vocab_size(with_added_tokens=True)} tokens in {elapsed:.1f}s")
    if args.val is not None:
        print(f"bytes/token on {args.val}: {bytes_per_token(tok, args.val):.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

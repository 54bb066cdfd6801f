"""Training rows: plain next-token text and FIM samples in the exact serving layout, with loss categories.

Every target token carries a category that decides which loss term it feeds (README "The default model",
Objectives):
  NEXT  next-token prediction on ordinary code,
  FIM   the middle of a FIM sample and its closing <|endoftext|>,
  COT   "reasoning comments": a block of `//` line comments (not `///` or `//!` docs) directly followed by
        the code it explains. The model learns to state intent in a short comment, then write the code.
  IGNORE  control tokens that are given, never predicted.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import numpy as np

from m31r.context import context_ids, context_room
from m31r.fim import FimBudget, build_fim_prompt
from m31r.tokenizer import Tokenizer
from m31r_protocol.context import Window, query_words, rank, windows

IGNORE, NEXT, FIM, COT = -1, 0, 1, 2

_COMMENT = re.compile(r"^[ \t]*//(?![/!])")


def cot_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of `//` comment blocks that are directly followed by a line of code."""
    spans: list[tuple[int, int]] = []
    pos = 0
    block_start: int | None = None
    for line in text.splitlines(keepends=True):
        if _COMMENT.match(line):
            if block_start is None:
                block_start = pos
        else:
            stripped = line.strip()
            if block_start is not None and stripped and not stripped.startswith("//"):
                spans.append((block_start, pos))
            block_start = None
        pos += len(line)
    return spans


def _categories(text: str, offsets: list[tuple[int, int]]) -> np.ndarray:
    """Each token's loss category: COT for tokens starting inside a reasoning-comment span, else NEXT."""
    cats = np.full(len(offsets), NEXT, dtype=np.int8)
    spans = cot_spans(text)
    if spans and offsets:
        starts = np.fromiter((o[0] for o in offsets), dtype=np.int64, count=len(offsets))
        for a, b in spans:
            cats[np.searchsorted(starts, a) : np.searchsorted(starts, b)] = COT
    return cats


def tokenize_document(tok: Tokenizer, text: str) -> tuple[list[int], list[int]]:
    """Token ids of a whole file and each token's loss category (NEXT or COT)."""
    enc = tok.hf.encode(text, add_special_tokens=False)
    return enc.ids, _categories(text, enc.offsets).tolist()


def tokenize_documents(tok: Tokenizer, texts: list[str], batch: int = 512):
    """(ids, categories) arrays per text, as tokenize_document gives, tokenised in parallel batches."""
    for i in range(0, len(texts), batch):
        part = texts[i : i + batch]
        for text, enc in zip(part, tok.hf.encode_batch(part, add_special_tokens=False), strict=True):
            yield np.asarray(enc.ids, dtype=np.uint16), _categories(text, enc.offsets)


@dataclass(frozen=True)
class FimSample:
    ids: list[int]
    cats: list[int]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def block_bodies(lines: list[str], max_lines: int) -> list[tuple[int, int]]:
    """(first body line, closing line) of each `{`-ending line whose closing `}` is found by indentation, for
    bodies of 1 to max_lines lines with some code in them: what an editor user asks to have written."""
    out = []
    for i, ln in enumerate(lines):
        if not ln.rstrip().endswith("{"):
            continue
        ind = _indent(ln)
        for j in range(i + 1, min(len(lines), i + 2 + max_lines)):
            lj = lines[j]
            if not lj.strip():
                continue
            if _indent(lj) <= ind:
                if lj.lstrip().startswith("}") and _indent(lj) == ind and 1 <= j - i - 1 <= max_lines:
                    out.append((i + 1, j))
                break
    return [(a, b) for a, b in out if any(lines[k].strip() for k in range(a, b))]


BLOCK_MAX_LINES = 24  # block-body middles: bodies up to this long (the eval's multi-line tasks stop at 8)


def block_middle(text: str, rng: random.Random) -> tuple[int, int] | None:
    """A block body, or its tail from one of its lines, ending where the closing `}` line starts: the model
    learns to write the rest of a block and stop where the suffix takes over. None for a file with no block."""
    lines = text.splitlines(keepends=True)
    bodies = block_bodies(lines, BLOCK_MAX_LINES)
    if not bodies:
        return None
    i, j = rng.choice(bodies)
    if rng.random() < 0.4:  # the cursor inside the body: the lines above it are written already
        i = rng.randrange(i, j)
    offs = [0]
    for line in lines[:j]:
        offs.append(offs[-1] + len(line))
    return offs[i], offs[j]


def past_blanks(text: str, a: int) -> int:
    """`a`, or where the run of spaces and tabs it falls inside ends. Serving takes the whitespace before the cursor as
    typed: a completion may not add to healed whitespace (Tokenizer.heal_ids), so a middle that goes on with more of it
    teaches a first token the engine never lets the model write."""
    if 0 < a < len(text) and text[a - 1] in " \t" and text[a] in " \t":
        while a < len(text) and text[a] in " \t":
            a += 1
    return a


def choose_middle(text: str, rng: random.Random, block_rate: float = 0.0) -> tuple[int, int]:
    """Character span of the middle. Mostly starting at a line start (the cursor-line text becomes the
    start of the middle when serving) and ending anywhere: the rest of one line, a block, or nothing.
    With block_rate > 0, that share of middles is a block body (block_middle) where the file has one."""
    if block_rate > 0 and rng.random() < block_rate:
        span = block_middle(text, rng)
        if span is not None:
            return span
    line_starts = [0] + [m.end() for m in re.finditer("\n", text) if m.end() < len(text)]
    a = rng.choice(line_starts) if rng.random() < 0.85 else past_blanks(text, rng.randrange(len(text) + 1))
    kind = rng.random()
    if kind < 0.05:  # empty middle: the model must learn to stop at once
        return a, a
    if kind < 0.45:  # the rest of the current line (single-line infill)
        nl = text.find("\n", a)
        b = len(text) if nl < 0 else nl + (1 if rng.random() < 0.5 else 0)
    elif kind < 0.55:  # to the end of the file: an empty suffix
        b = len(text)
    else:  # several lines, ending at a random character
        n_lines = rng.randint(1, 12)
        b = a
        for _ in range(n_lines):
            nl = text.find("\n", b)
            b = len(text) if nl < 0 else nl + 1
        if rng.random() < 0.3 and b > a:
            b = rng.randint(a, b)
    return a, min(b, len(text))


def fim_sample(tok: Tokenizer, text: str, rng: random.Random, budget: FimBudget, block_rate: float = 0.0,
               neighbours: list[tuple[str, list[Window]]] | None = None) -> FimSample:
    """One FIM sample; with `neighbours` (other files of the text's crate), the snippets of them the serving
    side would choose (m31r_protocol.context) come first, laid out as served (m31r.context), learned as ordinary
    text."""
    a, b = choose_middle(text, rng, block_rate)
    middle = text[a:b]
    prompt = build_fim_prompt(tok, text[:a], text[b:], budget)
    ctx: list[int] = []
    if neighbours:
        ctx = context_ids(tok, rank(query_words(text[:a]), neighbours), context_room(budget, prompt))
    # Token healing, as served: the prompt ends one token early and the middle starts by writing it again.
    m_ids = tok.encode(prompt.heal + middle)
    # A middle longer than the completion budget is cut and gets no <|endoftext|>: the model must not learn
    # to stop at an arbitrary cut point. A whole middle always ends with one.
    m_ids = m_ids + [tok.eos_id] if len(m_ids) < budget.reserve else m_ids[: budget.reserve]
    # Prompt tokens are context, learned as ordinary text except the control tokens; the cursor-line
    # text after <|fim_middle|> is already part of the middle.
    p_cats = [NEXT] * len(prompt.ids)
    n_s = prompt.suffix_tokens
    p_cats[0] = p_cats[n_s + 1] = p_cats[len(prompt.ids) - prompt.line_tokens - 1] = IGNORE
    for i in range(len(prompt.ids) - prompt.line_tokens, len(prompt.ids)):
        p_cats[i] = FIM
    return FimSample(ctx + prompt.ids + m_ids, [NEXT] * len(ctx) + p_cats + [FIM] * len(m_ids))


class Neighbours:
    """Other files of a text's crate, as an editor has them at hand (a few open or nearby files), with their
    windows kept: a sample's context is chosen from up to `files` of them, drawn at random."""

    def __init__(self, paths: list[str], crates: list[str], files: int = 16, shown: list[str | None] | None = None
                 ) -> None:
        """`paths`: each text's corpus path (a textbook piece's is its source file's); `shown`: each file's path as the
        language server shows it (the corpus's `crate_path`); where None, crate_path guesses it from the corpus path
        (a corpus built before it was recorded)."""
        shown = shown or [None] * len(paths)
        self.sources = paths
        self.paths, self.files = [s or crate_path(p) for p, s in zip(paths, shown, strict=True)], files
        self.by_crate: dict[str, list[int]] = {}
        for i, c in enumerate(crates):
            self.by_crate.setdefault(c, []).append(i)
        self.crates = crates
        self._windows: dict[int, list[Window]] = {}

    def of(self, i: int, texts: list[str], rng: random.Random) -> list[tuple[str, list[Window]]]:
        # Not the text's own file: an editor's snippets never come from the file being edited, and a textbook piece's
        # source file (or a sibling piece of it) holds the piece, its middle included, verbatim.
        others = [j for j in self.by_crate.get(self.crates[i], ()) if self.sources[j] != self.sources[i]]
        if len(others) > self.files:
            others = rng.sample(others, self.files)
        out = []
        for j in others:
            if j not in self._windows:
                self._windows[j] = windows(texts[j])
            out.append((self.paths[j], self._windows[j]))
        return out


def crate_path(path: str) -> str:
    """A corpus path as the language server would show it, relative to its crate's folder, guessed from the corpus's
    layouts (`m31r train corpus` records the exact one, `crate_path`, since it walks the Cargo.toml files):
    `[suite/]registry/serde-1.0.0/src/de.rs` and `[suite/]rust/library/core/src/fmt.rs` -> `src/...`."""
    parts = path.split("/")
    for i, part in enumerate(parts[:2]):  # an optional suite label (`trixie/`) first
        if part == "registry" and len(parts) > i + 2:
            return "/".join(parts[i + 2 :])
        if part == "rust" and len(parts) > i + 3 and parts[i + 1] in ("library", "compiler"):
            return "/".join(parts[i + 3 :])
    return path.split("/", 2)[-1]


def pack_fim_row(
    tok: Tokenizer, texts: list[str], rng: random.Random, seq_len: int, budget: FimBudget, block_rate: float = 0.0,
    neighbours: Neighbours | None = None, context_rate: float = 0.0,
) -> tuple[np.ndarray, np.ndarray]:
    """One row of seq_len + 1 tokens filled with whole-or-cut FIM samples; categories are per *target*.

    The category of position i describes token i; the trainer predicts token i+1 from i, so the row's
    targets are ids[1:] with categories cats[1:].
    """
    ids: list[int] = []
    cats: list[int] = []
    while len(ids) < seq_len + 1:
        i = rng.randrange(len(texts))
        text = texts[i]
        if not text:
            continue
        near = neighbours.of(i, texts, rng) if neighbours and context_rate > 0 and rng.random() < context_rate else None
        s = fim_sample(tok, text, rng, budget, block_rate, near)
        ids += s.ids
        cats += s.cats
    return np.asarray(ids[: seq_len + 1], dtype=np.int64), np.asarray(cats[: seq_len + 1], dtype=np.int64)


def lm_row(
    stream: np.ndarray, stream_cats: np.ndarray, rng: random.Random, seq_len: int
) -> tuple[np.ndarray, np.ndarray]:
    """A random window of the concatenated corpus (files separated by <|endoftext|>)."""
    start = rng.randrange(len(stream) - seq_len - 1)
    end = start + seq_len + 1
    return stream[start:end].astype(np.int64), stream_cats[start:end].astype(np.int64)

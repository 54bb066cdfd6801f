"""The lines above the cursor (P_above, m31r.fim.cut_above) in a dense block of code: lines from the nearest multiple of
`line_step` (16) that pass their budget. Such a prompt kept no line above the cursor at all, in serving and in the
training samples laid out the same way; now a finer step keeps the lines that fit, and the start still moves only
every few lines while the user types along the file, and falls where the language server's cut of a long document
expects it. On the bundled tokenizer (release/tokenizer.json)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from m31r.config import load_config
from m31r.fim import FimBudget, above_steps, build_fim_prompt, cut_above
from m31r.tokenizer import Tokenizer
from m31r.train.samples import choose_middle, fim_sample
from m31r_lsp.completion import LINE_STEP, sent_text

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    cfg = load_config(REPO / "release" / "config.yaml")
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json", cfg.special_tokens, cfg.vocab_size)


def dense_lines(n: int, width: int = 12) -> list[str]:
    """Rust lines of a lookup table, ~6 tokens a number (~70 a line of 12): 16 such lines pass a 512-token context's
    P_above, and 4 or 5 fit."""
    return [f"    [{', '.join(f'0x{(i * 7919 + j * 104729) % 65536:04x}' for j in range(width))}], // row {i}\n"
            for i in range(n)]


def most_that_fit(tok: Tokenizer, lines: list[str], budget: int) -> int:
    """How many whole lines directly above the cursor fit `budget` (tokens counted line by line, as cut_above does)."""
    used = kept = 0
    for line in reversed(lines):
        used += len(tok.encode(line))
        if used > budget:
            break
        kept += 1
    return kept


def test_the_finer_steps_divide_the_step() -> None:
    assert above_steps(16) == [16, 4, 1] and above_steps(8) == [8, 2, 1] and above_steps(1) == [1]
    for step in range(1, 40):
        steps = above_steps(step)
        assert steps[-1] == 1 and all(a % b == 0 and b < a for a, b in zip(steps, steps[1:], strict=False))


def test_a_cursor_in_a_dense_block_keeps_the_lines_above_that_fit(bpe) -> None:
    """12 lines past the last multiple of 16 hold ~830 tokens, a 512-token context's P_above 349: the prompt had
    nothing between <|fim_prefix|> and <|fim_middle|>, the model completing `let total = ` with no table in sight."""
    budget = FimBudget.for_context(512)
    table = ["const TABLE: [[u16; 12]; 44] = [\n", *dense_lines(27)]  # 28 lines: 12 past line 16
    line = "    let total = "
    p = build_fim_prompt(bpe, "".join(table) + line, "\n];\n", budget)
    fit = most_that_fit(bpe, table, budget.above)
    assert 4 <= fit < 12 and sum(len(bpe.encode(x)) for x in table[16:]) > budget.above  # the case at hand
    above = bpe.decode(p.ids[p.suffix_tokens + 2 : p.suffix_tokens + 2 + p.above_tokens])
    kept = len(table) - p.above_start_line
    assert above == "".join(table[p.above_start_line :]) and 0 < p.above_tokens <= budget.above
    assert fit - 3 <= kept <= fit and p.above_start_line % 4 == 0  # the next finer step: a multiple of 4


def test_lines_too_long_for_the_finer_step_keep_the_single_lines_that_fit(bpe) -> None:
    """Lines of ~135 tokens: no 4 of them fit 349 tokens; the two directly above the cursor do."""
    budget = FimBudget.for_context(512)
    lines = dense_lines(23, width=25)
    assert most_that_fit(bpe, lines, budget.above) == 2
    text, start = cut_above(bpe, "".join(lines), budget.above, budget.line_step)
    assert (start, text) == (21, "".join(lines[21:]))


def test_a_coarse_start_that_keeps_enough_stays_on_the_step(bpe) -> None:
    """Short lines, a large budget: the start is a multiple of 16 at every line, as it always was (at most 16 lines
    short of what fits)."""
    lines = [f"    let v{i} = v{i - 1}.wrapping_mul({i}) ^ {i};\n" for i in range(1, 300)]
    budget = FimBudget.for_context(2048)
    for n in range(1, len(lines) + 1, 7):
        _, start = cut_above(bpe, "".join(lines[:n]), budget.above, budget.line_step)
        fit = most_that_fit(bpe, lines[:n], budget.above)
        assert start % 16 == 0 and n - fit <= start < n - fit + 16, (n, start, fit)


@pytest.mark.parametrize("width", [6, 12, 40])
def test_typing_along_a_dense_file_moves_the_start_rarely(bpe, width) -> None:
    """Enter after each line of a dense table: P_above never empty where its last line fits, always at least half of
    what fits, and its start only ever moves forward, on a multiple of 4 for lines that 4 at a time fit (the prefix
    cache misses once in ~4 lines, not at each)."""
    lines = ["fn table() -> Vec<Vec<u16>> {\n", "    vec![\n", *dense_lines(140, width)]
    budget = FimBudget.for_context(512)
    counts = [len(bpe.encode(x)) for x in lines]
    starts = []
    for n in range(1, len(lines) + 1):
        text, start = cut_above(bpe, "".join(lines[:n]), budget.above, budget.line_step)
        fit = most_that_fit(bpe, lines[:n], budget.above)
        assert start < n and 2 * sum(counts[start:n]) >= sum(counts[n - fit : n]), n
        assert text == "".join(lines[start:n]) and sum(counts[start:n]) <= budget.above
        starts.append(start)
    assert starts == sorted(starts)
    moves = sum(a != b for a, b in zip(starts, starts[1:], strict=False))
    if most_that_fit(bpe, lines[-8:], budget.above) >= 8:
        assert moves <= len(lines) // 4 + 1 and all(s % 4 == 0 for s in starts)


def test_training_samples_keep_the_lines_above_a_dense_middle(bpe) -> None:
    """Training lays its FIM samples out with build_fim_prompt: in 256-token rows a middle inside a table of ~20-token
    lines had no line above it in half the samples; the model learned to complete without the lines above."""
    text = "const TABLE: [[u16; 3]; 200] = [\n" + "".join(dense_lines(200, width=3)) + "];\n"
    budget = FimBudget.for_context(256)
    rng = random.Random(45)
    seen = 0
    for _ in range(60):
        state = rng.getstate()
        cursor, _ = choose_middle(text, rng)  # fim_sample's first draw: where its middle starts
        rng.setstate(state)
        s = fim_sample(bpe, text, rng, budget)
        if "\n" not in text[:cursor]:
            continue
        seen += 1
        a, m = s.ids.index(bpe.fim_prefix_id), s.ids.index(bpe.fim_middle_id)
        above = bpe.decode(s.ids[a + 1 : m])
        assert above and text[:cursor].endswith(above + text[text.rfind("\n", 0, cursor) + 1 : cursor]), above
    assert seen > 40


@pytest.mark.parametrize("width", [3, 12, 40])
def test_the_language_servers_cut_of_a_long_document_gives_the_same_prompt(bpe, width) -> None:
    """The language server sends a long document's lines above from a multiple of LINE_STEP (16) lines: the finer
    steps divide it, so the daemon's prompt from what is sent is the one the whole document gives."""
    assert all(LINE_STEP % s == 0 for s in above_steps(LINE_STEP))
    body = "".join(dense_lines(900, width))
    budget = FimBudget.for_context(512)
    for k in range(3, 40, 6):
        cursor = len(body) - sum(map(len, body.splitlines(keepends=True)[-k:]))
        prefix, suffix = body[:cursor] + "    let x = ", body[cursor:]
        sent_prefix, sent_suffix = sent_text(prefix, suffix, 512)
        dropped = prefix[: len(prefix) - len(sent_prefix)].count("\n")
        assert prefix.endswith(sent_prefix) and dropped > 0 and dropped % LINE_STEP == 0  # cut
        sent = build_fim_prompt(bpe, sent_prefix, sent_suffix, budget)
        whole = build_fim_prompt(bpe, prefix, suffix, budget)
        assert (sent.ids, sent.heal, sent.above_start_line + dropped) == (whole.ids, whole.heal, whole.above_start_line)
        assert whole.above_tokens > 0

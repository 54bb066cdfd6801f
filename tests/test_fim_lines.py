"""Where m31r.fim splits a prefix into the lines above the cursor and the cursor's line: at the last line end of
any kind ("\\n", "\\r\\n", or a lone "\\r" as old Mac files have), as cut_above's str.splitlines counts lines. Split at
"\\n" alone, a CR-only prefix was all one cursor line, held to the line's small token budget. Text without a lone
"\\r" (training's) splits exactly as before; the language server cuts what it sends at the same place."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from m31r.config import load_config
from m31r.fim import FimBudget, build_fim_prompt, split_prefix
from m31r.tokenizer import Tokenizer
from m31r_protocol.context import line_start

REPO = Path(__file__).resolve().parent.parent
# Line ends of each kind, and the characters only str.splitlines takes for one (which stay in their line).
PIECES = ["a", "fn", " ", "\n", "\r\n", "\x0c", "\x0b", "\u2028", "\x85", "é", "🐢"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json", load_config(REPO / "release/config.yaml")
                               .special_tokens)


def test_a_cr_only_prefix_splits_at_its_last_line_end() -> None:
    assert split_prefix("fn a() {\r    x\r    y") == ("fn a() {\r    x\r", "    y")
    assert split_prefix("fn a() {\r    x\r") == ("fn a() {\r    x\r", "")
    assert split_prefix("a\nb\rc") == ("a\nb\r", "c") and split_prefix("a\rb\nc") == ("a\rb\n", "c")
    assert split_prefix("a\r\nb") == ("a\r\n", "b") and split_prefix("no break") == ("", "no break")


@pytest.mark.parametrize("seed", range(3))
def test_text_without_a_lone_cr_splits_as_before(seed) -> None:
    """Every prefix of random text with LF and CRLF line ends (and form feeds, U+2028 ...) that does not end between
    the two characters of a "\\r\\n": the split of `rfind("\\n")`, which training has always used."""
    rng = random.Random(seed)
    for _ in range(200):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 40)))
        for i in range(len(text) + 1):
            prefix = text[:i]
            if prefix.endswith("\r"):
                continue
            cut = prefix.rfind("\n") + 1
            assert split_prefix(prefix) == (prefix[:cut], prefix[cut:])


@pytest.mark.parametrize("seed", range(3))
def test_the_language_server_cuts_where_the_prompt_splits(seed) -> None:
    """The cut of a long prefix (m31r_protocol.context.line_start, the language server's) starts the cursor's line
    where split_prefix does, lone "\\r"s included, and the lines above end in a line break that cut_above's
    splitlines counts as one."""
    rng = random.Random(seed)
    for _ in range(300):
        text = "".join(rng.choice([*PIECES, "\r", "\r\r", "\n\r"]) for _ in range(rng.randint(0, 40)))
        above, line = split_prefix(text)
        assert line_start(text) == len(above)
        assert not any(c in line for c in "\r\n")
        assert not above or (above.endswith(("\r", "\n")) and "".join(above.splitlines(keepends=True)) == above)


def test_a_cr_only_document_keeps_its_lines_above_in_the_prompt(bpe) -> None:
    """The same code with LF and with lone-CR line ends: the prompt keeps the same lines above the cursor (from the
    same 16-line step) and the same cursor line, where the CR-only one had nothing above and a cursor line cut to its
    budget."""
    lines = [f"    let value_{i} = compute_{i % 7}(value_{i - 1});" for i in range(1, 400)]
    lf = "fn main() {\n" + "\n".join(lines) + "\n    let total = value_"
    cr = lf.replace("\n", "\r")
    budget = FimBudget.for_context(512)
    p_lf, p_cr = (build_fim_prompt(bpe, text, "\n}\n".replace("\n", nl), budget)
                  for text, nl in ((lf, "\n"), (cr, "\r")))
    assert p_cr.above_tokens > budget.above // 2 and p_cr.above_start_line == p_lf.above_start_line > 0
    assert (p_cr.line_tokens, p_cr.heal) == (p_lf.line_tokens, p_lf.heal) and p_cr.line_tokens < budget.line

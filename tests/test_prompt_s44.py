"""Audit of how a completion's prompt is built: token healing at the pieces the release tokenizer's pre-tokenizer
joins (m31r.fim.heal_split), and the crate's files the language server reads for project context (m31r_lsp.context).
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from m31r.config import load_config
from m31r.fim import FimBudget, build_fim_prompt, heal_split
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer, build_byte_tokenizer

REPO = Path(__file__).resolve().parent.parent

# Rust lines whose typed prefixes end inside a piece that the finished line spells as fewer tokens: `&mut` (one
# piece, `&m` is two), a lifetime (`'static`, `'st` is `'` + `st`), a word whose leading space is a token of its own
# (`    asser` as `   ` + ` ` + `asser`, `    assert` as `   ` + ` assert`), a run of brackets (`(()` then `(())`).
LINES = ["    fn private_mut(&mut self, target: &mut W) -> Result<(), Error> {",
         "impl<T: Clone + 'static + Send> Handle<'a, T> {",
         "        assert_eq!(iter.next(), Some(Ok(())));",
         "    println!(\"found {} at {:?}\", name, path);",
         "        let url = &argv[1..];"]


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    cfg = load_config(REPO / "release" / "config.yaml")
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json", cfg.special_tokens, cfg.vocab_size)


def test_a_healed_cursor_line_is_the_start_of_the_finished_lines_tokens(bpe) -> None:
    """At every cursor of these lines, the ids the prompt keeps are the first ids of the finished line: the model
    goes on from a token sequence that text has. `&mu` kept `&` and owed `mu`, but `&mut` is one token, so the
    prompt ended in a split no file has (so did `'st`, ` ` + `asser`, `(` + `()`)."""
    for line in LINES:
        full = bpe.encode(line)
        for c in range(1, len(line)):
            kept, healed = heal_split(bpe, bpe.encode(line[:c]))
            assert full[: len(kept)] == kept and bpe.decode(kept) + healed == line[:c], line[:c]
    budget = FimBudget.for_context(2048)
    for typed, owed in [("    let r = &mu", " &mu"), ("fn f(x: &'sta", "'sta"), ("        asser", " asser"),
                        ("    Ok(()", "(()"), ("let s = 'a", " 'a"), ("    x.le", "le")]:
        assert build_fim_prompt(bpe, "fn f() {\n" + typed, "\n}\n", budget).heal == owed, typed


def test_a_byte_tokenizer_heals_as_before() -> None:
    """No token spans a space and a word in a byte vocabulary: healing more than the last word gains nothing."""
    tok = Tokenizer(build_byte_tokenizer(512), DEFAULT_SPECIAL)
    for line, owed in [("    let x", "x"), ("Ok(()", ")"), ("&mu", "mu"), ("'st", "st")]:
        assert heal_split(tok, tok.encode(line))[1] == owed


# -- the crate's files -----------------------------------------------------------------------------------------


POINT = "pub struct Point {\n    pub x: i64,\n}\n"


def crate(root: Path, files: dict[str, str | bytes]) -> Path:
    root.mkdir()
    (root / "Cargo.toml").write_text("[package]\nname = \"demo\"\n")
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return root


def test_a_named_pipe_in_the_crate_is_not_read(tmp_path) -> None:
    """A FIFO called `x.rs` blocked the read of it, and with the lock held every request after it, until something
    wrote to the pipe."""
    from m31r_lsp.context import ProjectContext

    root = crate(tmp_path / "demo", {"src/main.rs": "", "src/point.rs": POINT})
    os.mkfifo(root / "src/a_pipe.rs")
    got: list = []
    worker = threading.Thread(target=lambda: got.append(ProjectContext(lambda: []).snippets(
        (root / "src/main.rs").as_uri(), "let p = Point { x: 1 };\n")), daemon=True)
    worker.start()
    worker.join(60)  # immediate when the pipe is passed over; the wait is only how long a failure takes
    blocked = worker.is_alive()
    if blocked:  # let the blocked read end, so the test fails rather than hangs
        os.close(os.open(root / "src/a_pipe.rs", os.O_WRONLY))
        worker.join()
    assert not blocked
    assert [s.path for s in got[0]] == ["src/point.rs"]


def test_files_that_are_not_utf8_are_left_out_and_a_bom_is_dropped(tmp_path) -> None:
    """Training's corpus leaves out a file that is not UTF-8 and drops a byte order mark (m31r.train.corpus); read
    with errors="replace", a Latin-1 file was quoted with U+FFFD in the prompt, and a BOM led its first window."""
    from m31r_lsp.context import ProjectContext

    latin = "// Préface\n".encode("latin-1") + POINT.encode()
    root = crate(tmp_path / "demo", {"src/main.rs": "", "src/latin.rs": latin,
                                     "src/bom.rs": "\ufeff" + POINT.replace("Point", "Spot") + "fn f(p: Point) {}\n"})
    got = ProjectContext(lambda: []).snippets((root / "src/main.rs").as_uri(), "let p = Point { x: 1 };\n")
    assert [s.path for s in got] == ["src/bom.rs"]
    assert got[0].text == POINT.replace("Point", "Spot") + "fn f(p: Point) {}\n"

"""Project context: which snippets of other files are chosen (m31r_protocol.context), how they become prompt
tokens (m31r.context), how training lays them out (m31r.train.samples), and how the language server finds the
files (m31r_lsp.context)."""

from __future__ import annotations

import os
import random

import pytest

from m31r_protocol.context import QUERY_LINES, QUERY_STEP, WINDOW_LINES, query_words, rank, windows
from m31r_protocol.messages import Snippet

POINT = "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n\nimpl Point {\n    pub fn norm(&self) -> i64 {\n" \
        "        self.x.abs() + self.y.abs()\n    }\n}\n"
COLOR = "pub enum Color {\n    Red,\n    Green,\n}\n"
CONSTS = "".join(f"const C{i}: u8 = {i};\n" for i in range(60))


def numbered(n: int, word: str = "line") -> str:
    return "".join(f"let {word}_{i} = {i};\n" for i in range(n))


# -- choosing snippets -----------------------------------------------------------------------------------------


def test_windows_overlap_by_half_and_cover_the_file() -> None:
    text = numbered(45)
    wins = windows(text)
    assert [w.start for w in wins] == list(range(0, 45 - WINDOW_LINES // 2, WINDOW_LINES // 2))
    assert all(w.text == "".join(text.splitlines(keepends=True)[w.start : w.start + WINDOW_LINES]) for w in wins)
    assert wins[-1].text.endswith("let line_44 = 44;\n")
    assert windows("") == [] and windows("\n\n  \n") == []
    assert [w.text for w in windows("fn a() {}\n")] == ["fn a() {}\n"]  # shorter than a window: whole


def test_query_is_whole_lines_above_the_cursor_block() -> None:
    def words(n: int, typed: str = "") -> set[str]:
        return set(query_words(numbered(n, "q") + typed))

    # The QUERY_LINES lines above the cursor line's block of QUERY_STEP: lines typed inside the block change nothing.
    n = 3 * QUERY_STEP + 1
    block = n // QUERY_STEP * QUERY_STEP
    assert words(n) == {"let"} | {f"q_{i}" for i in range(block - QUERY_LINES, block)}
    assert all(words(k) == words(n) for k in range(block, block + QUERY_STEP))
    assert words(block + QUERY_STEP) != words(n)
    assert words(n, "    let typed_now = ") == words(n)  # typing on the cursor line: the prompt's head stays cached
    # In the file's first block, the lines above the cursor.
    assert words(3) == {"let", "q_0", "q_1", "q_2"} and words(0) == set()
    assert query_words("fn main") == frozenset()
    # Lines that end in a lone CR (old Mac files) are lines too: the same words as the LF text.
    for n in (3, 3 * QUERY_STEP + 1):
        text = numbered(n, "q") + "    let typed_now = "
        assert query_words(text.replace("\n", "\r")) == query_words(text) != frozenset()


def test_rank_orders_by_similarity_and_never_overlaps_within_a_file() -> None:
    query = query_words("let p = Point { x: 1, y: 2 };\nlet n = p.norm();\n")
    files = [("src/color.rs", windows(COLOR)), ("src/point.rs", windows(POINT)), ("src/big.rs", windows(CONSTS))]
    got = rank(query, files)
    assert got[0] == Snippet(POINT, "src/point.rs")
    assert all(s.path != "src/big.rs" for s in got)  # shares no identifier with the query
    # In one file, a chosen window shuts out the windows overlapping it.
    near = windows(numbered(80, "Point"))
    got = rank(frozenset({"let", "Point_3", "Point_25"}), [("a.rs", near)], limit=8)
    starts = [next(w.start for w in near if w.text == s.text) for s in got]
    assert all(abs(a - b) >= WINDOW_LINES for i, a in enumerate(starts) for b in starts[:i])
    assert rank(frozenset(), files) == []
    assert len(rank(frozenset({"let"}), [("a.rs", near)], limit=2)) == 2


# -- prompt tokens -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory):
    import json

    from m31r.tokenizer import SPECIAL_TOKENS, Tokenizer
    from m31r.train.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("context_tok")
    with open(d / "train.jsonl", "w") as f:
        for i, text in enumerate([POINT, COLOR, numbered(30)] * 3):
            f.write(json.dumps({"path": f"f{i}.rs", "text": text}) + "\n")
    train_tokenizer(d / "train.jsonl", d / "tokenizer.json", 400)
    special = dict(zip(("eos_token", "fim_prefix_token", "fim_suffix_token", "fim_middle_token", "pad_token"),
                       SPECIAL_TOKENS, strict=True))
    return Tokenizer.from_file(d / "tokenizer.json", special)


def test_context_ids_fit_the_budget_best_nearest_the_prompt(tok) -> None:
    from m31r.context import context_budget, context_ids
    from m31r.fim import FimBudget

    a, b = Snippet(POINT, "src/point.rs"), Snippet(COLOR, "src/color.rs")
    one = tok.encode("// src/point.rs\n" + POINT) + [tok.eos_id]
    two = tok.encode("// src/color.rs\n" + COLOR) + [tok.eos_id]
    assert context_ids(tok, [a, b], 10_000) == two + one  # best (first) last, nearest the prompt
    assert context_ids(tok, [a, b], len(one)) == one
    assert context_ids(tok, [a, b], len(two)) == two  # what does not fit is skipped, the rest still taken
    assert context_ids(tok, [a, b], len(two) - 1) == []
    assert context_ids(tok, [Snippet("x = 1")], 100) == tok.encode("x = 1\n") + [tok.eos_id]  # no path: no comment
    budget = FimBudget.for_context(2048)
    assert context_budget(budget, 100) == 512  # a quarter of the context at most
    assert context_budget(budget, 2048 - budget.reserve - 40) == 40  # what the prompt and completion leave
    assert context_budget(budget, 2048) == 0


def test_training_samples_carry_the_serving_context(tok) -> None:
    """With neighbours, a FIM sample is the snippets the serving side would send (m31r.context, same ranking)
    followed by the same sample it would be without them; the snippets are ordinary text to learn."""
    from m31r.context import context_budget, context_ids
    from m31r.fim import FimBudget, build_fim_prompt
    from m31r.train.samples import NEXT, Neighbours, choose_middle, crate_path, fim_sample, pack_fim_row

    budget = FimBudget.for_context(512)
    text = "fn main() {\n    let p = Point { x: 1, y: 2 };\n    let n = p.norm();\n    println!(\"{n}\");\n}\n"
    near = [("src/point.rs", windows(POINT)), ("src/color.rs", windows(COLOR))]
    for seed in range(20):
        plain = fim_sample(tok, text, random.Random(seed), budget)
        led = fim_sample(tok, text, random.Random(seed), budget, neighbours=near)
        a, b = choose_middle(text, random.Random(seed))
        prompt = build_fim_prompt(tok, text[:a], text[b:], budget)
        head = context_ids(tok, rank(query_words(text[:a]), near), context_budget(budget, len(prompt.ids)))
        assert led.ids == head + plain.ids and led.cats == [NEXT] * len(head) + plain.cats
        if "Point" in text[:a].rsplit("\n", 1)[0]:
            assert head[:len(tok.encode("// src/point.rs\n"))] == tok.encode("// src/point.rs\n")
    assert crate_path("registry/serde-1.0.0/src/de.rs") == "src/de.rs"

    texts = [text, POINT, COLOR, numbered(30)]
    neighbours = Neighbours(["registry/a-1/src/main.rs", "registry/a-1/src/point.rs", "registry/a-1/src/color.rs",
                             "registry/b-1/src/lib.rs"], ["a", "a", "a", "b"])
    assert [p for p, _ in neighbours.of(0, texts, random.Random(0))] == ["src/point.rs", "src/color.rs"]
    assert neighbours.of(3, texts, random.Random(0)) == []  # a crate of one file
    # context_rate 0 draws what rows drew before neighbours existed (resumed runs and old configs stay exact).
    r0 = pack_fim_row(tok, texts, random.Random(5), 400, budget, 0.0)
    r1 = pack_fim_row(tok, texts, random.Random(5), 400, budget, 0.0, neighbours, 0.0)
    assert (r0[0] == r1[0]).all() and (r0[1] == r1[1]).all()
    r2 = pack_fim_row(tok, texts, random.Random(5), 400, budget, 0.0, neighbours, 1.0)
    assert tok.encode("// src/point.rs\n")[0] in r2[0].tolist()


# -- the language server's files ---------------------------------------------------------------------------------


def crate(tmp_path, files: dict[str, str]):
    tmp_path.mkdir(parents=True)
    (tmp_path / "Cargo.toml").write_text("[package]\nname = \"demo\"\n")
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return tmp_path


def test_project_files_from_disk_and_open_documents(tmp_path) -> None:
    from m31r_lsp.context import ProjectContext

    root = crate(tmp_path / "demo", {"src/main.rs": "", "src/geo/point.rs": POINT, "src/color.rs": COLOR,
                                     "target/debug/build/gen.rs": POINT, "src/notes.txt": POINT,
                                     "src/huge.rs": "let Point = 1;\n" * 20_000})
    main = (root / "src/main.rs").as_uri()
    prefix = "fn main() {\n    let p = Point { x: 1, y: 2 };\n    let n = p.norm();\n"
    opened: list[tuple[str, str]] = []
    ctx = ProjectContext(lambda: opened)
    got = ctx.snippets(main, prefix)
    assert got[0] == Snippet(POINT, "src/geo/point.rs")  # crate-relative, as training showed paths
    assert {s.path for s in got} <= {"src/geo/point.rs", "src/color.rs"}  # not target/, .txt or a huge file
    assert ctx.snippets(main, "let p = Po") == []  # nothing whole above the cursor

    # An open document is read from the editor, not the disk (its unsaved text counts).
    edited = POINT.replace("norm", "length")
    opened += [((root / "src/geo/point.rs").as_uri(), edited), (main, prefix), ("untitled:Untitled-1", POINT)]
    got = ctx.snippets(main, prefix.replace("norm", "length"))
    assert got[0] == Snippet(edited, "src/geo/point.rs")
    assert all(s.text != prefix for s in got)  # never the document itself

    # A file changed on disk is read again.
    opened.clear()
    (root / "src/color.rs").write_text("pub fn norm_all(p: &[Point]) -> i64 {\n    p.iter().map(Point::norm).sum()\n}")
    os.utime(root / "src/color.rs", ns=(1, 10**18))
    assert any("norm_all" in s.text for s in ctx.snippets(main, prefix))


def test_nearest_files_first_and_a_document_outside_any_crate(tmp_path) -> None:
    from m31r_lsp import context as lsp_context
    from m31r_lsp.context import ProjectContext, crate_root

    files = {f"src/far/f{i}.rs": f"fn far_{i}(p: Point) {{}}\n" for i in range(lsp_context.MAX_FILES + 5)}
    files["src/zz/near.rs"] = "fn near(p: Point) -> Point { make() }\n"  # the likest, listed after all the others
    root = crate(tmp_path / "demo", {"src/zz/main.rs": "", **files})
    assert crate_root(root / "src/zz/main.rs") == root
    got = ProjectContext(lambda: []).snippets((root / "src/zz/main.rs").as_uri(), "let p: Point = make();\n")
    # More files than a request ranks: those of the cursor's folder come first, so the likest is not cut.
    assert got[0].path == "src/zz/near.rs"
    loose = tmp_path / "loose"
    loose.mkdir()
    (loose / "a.rs").write_text("")
    (loose / "b.rs").write_text(POINT)
    assert crate_root(loose / "a.rs") == loose
    assert ProjectContext(lambda: []).snippets((loose / "a.rs").as_uri(), "let p = Point::new();\n")[0].path == "b.rs"

"""Audit of how the language server lists a crate's files for project context (m31r_lsp.context.walk): a document in
no crate (`~/x.rs`) walked the whole tree under its folder every refresh, with the lock every completion takes held;
in a crate of more files than a listing takes, the walk from the root in name order stopped before the document's
folder; and a symlinked `.rs` leading out of the crate was quoted. Counts of entries and files, never timings."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from test_context import crate

from m31r_lsp import context as lsp_context
from m31r_lsp.context import ProjectContext, walk

POINT = "pub struct Point {\n    pub x: i64,\n}\n"
QUERY = "let p = Point { x: 1 };\n"


@pytest.fixture(autouse=True)
def no_time_limit(monkeypatch) -> None:
    """A loaded machine's walk is cut by entries, as the tests count, not by time (its own test lowers it)."""
    monkeypatch.setattr(lsp_context, "MAX_WALK_S", 600.0)


def many(folder: Path, n: int, suffix: str, per_folder: int = 1000) -> None:
    """`n` empty files ending in `suffix`, `per_folder` to a subfolder of `folder`."""
    for i in range(n):
        sub = folder / f"d{i // per_folder:03}"
        if i % per_folder == 0:
            sub.mkdir(parents=True)
        os.close(os.open(sub / f"f{i:05}{suffix}", os.O_CREAT | os.O_WRONLY, 0o644))


def test_a_document_in_no_crate_lists_its_own_folder_only(tmp_path) -> None:
    """A scratch file in the home folder walked all of home: here only the folder's own entries are looked at."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "x.rs").write_text("")
    (home / "y.rs").write_text(POINT)
    many(home / "work", 3000, ".rs")
    (home / "work/d000/f00000.rs").write_text(POINT + "fn f(p: Point) { p.x }\n")  # likelier than y.rs, and far
    found, visited, cut = walk(home, home / "x.rs", ".rs")
    assert (sorted(p.name for p in found), visited, cut) == (["x.rs", "y.rs"], 3, False)
    assert [s.path for s in ProjectContext(lambda: []).snippets((home / "x.rs").as_uri(), QUERY)] == ["y.rs"]


def test_a_large_crate_lists_the_documents_folder_and_its_neighbours_first(tmp_path) -> None:
    """More .rs files before `src/zz` in name order than a listing takes: the walk from the root never reached the
    document's folder, so the file beside it, the likest, was not quoted."""
    root = crate(tmp_path / "demo", {"src/zz/main.rs": "", "src/zz/near.rs": POINT, "src/zz/inner/deep.rs": "",
                                     "src/sibling.rs": ""})
    many(root / "src/aaa", lsp_context.MAX_LISTED + 500, ".rs")
    found, visited, cut = walk(root, root / "src/zz/main.rs", ".rs")
    assert cut and len(found) <= lsp_context.MAX_LISTED + 1000 and visited <= lsp_context.MAX_VISITED
    rel = {p.relative_to(root).as_posix() for p in found}
    assert {"src/zz/main.rs", "src/zz/near.rs", "src/zz/inner/deep.rs", "src/sibling.rs"} <= rel
    got = ProjectContext(lambda: []).snippets((root / "src/zz/main.rs").as_uri(), QUERY)
    assert [s.path for s in got] == ["src/zz/near.rs"]


def test_a_walk_stops_after_max_visited_entries_and_says_so_once(tmp_path, monkeypatch, caplog) -> None:
    """Entries of any name count (a tree of non-Rust files was walked whole), the nearest are kept, and the log says
    once, not at every refresh, that the listing was cut."""
    root = crate(tmp_path / "demo", {"src/zz/main.rs": "", "src/zz/near.rs": POINT})
    many(root / "assets", lsp_context.MAX_VISITED + 1000, ".txt")
    found, visited, cut = walk(root, root / "src/zz/main.rs", ".rs")
    assert cut and visited == lsp_context.MAX_VISITED
    assert [p.relative_to(root).as_posix() for p in found] == ["src/zz/main.rs", "src/zz/near.rs"]

    monkeypatch.setattr(lsp_context, "LISTING_TTL_S", -1.0)  # every request walks again
    ctx = ProjectContext(lambda: [])
    with caplog.at_level(logging.INFO, logger="m31r_lsp.context"):
        for _ in range(3):
            assert [s.path for s in ctx.snippets((root / "src/zz/main.rs").as_uri(), QUERY)] == ["src/zz/near.rs"]
    said = [r.getMessage() for r in caplog.records if r.name == "m31r_lsp.context"]
    assert len(said) == 1 and f"after {lsp_context.MAX_VISITED} entries" in said[0], said


def test_a_walk_out_of_time_stops_at_once(tmp_path, monkeypatch) -> None:
    """The walk holds the lock every completion takes: past MAX_WALK_S it looks at no further entry."""
    root = crate(tmp_path / "demo", {"src/main.rs": "", "src/point.rs": POINT})
    many(root / "src/more", 50, ".rs")
    monkeypatch.setattr(lsp_context, "MAX_WALK_S", -1.0)  # out of time from the start
    found, visited, cut = walk(root, root / "src/main.rs", ".rs")
    assert (visited, cut) == (1, True) and len(found) <= 1


def test_heavy_folders_are_not_entered_and_the_order_is_a_walk_from_the_root(tmp_path) -> None:
    """`target`, `.git`, `node_modules` and hidden folders are never entered; among the files found, the order (which
    decides, among files as near, which are ranked) is a name-ordered walk's from the root, as before."""
    files = {f"{d}/x.rs": POINT for d in ("target/debug", ".git/hooks", "node_modules/m", "src/.hidden")}
    files |= {rel: "" for rel in ("src/main.rs", "src/b/c.rs", "src/b/a.rs", "src/z.rs", "src/a/q/r.rs", "build.rs",
                                  "tests/t.rs", "tests/data/u.rs", "src/b/notes.md")}
    root = crate(tmp_path / "demo", files)
    found, visited, cut = walk(root, root / "src/b/c.rs", ".rs")
    assert not cut
    assert visited == 20  # b 3, src 5, a 1, q 1, root 7, tests 2, data 1: nothing under the four skipped folders
    reference = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in {"target", "node_modules"} and not d.startswith("."))
        reference += [Path(folder) / n for n in sorted(names) if n.endswith(".rs")]
    assert found == reference


def test_a_symlink_leading_out_of_the_crate_is_not_quoted(tmp_path) -> None:
    """`src/secret.rs -> ~/elsewhere/keys.rs` quoted a file of no crate of the document's into the prompt; a link
    within the crate is listed as before."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keys.rs").write_text("pub struct Point { pub secret_key: &'static str }\n")
    root = crate(tmp_path / "demo", {"src/main.rs": "", "lib/point.rs": POINT})
    (root / "src/secret.rs").symlink_to(outside / "keys.rs")
    (root / "src/alias.rs").symlink_to(root / "lib/point.rs")
    (root / "src/loop.rs").symlink_to(root / "src/loop.rs")  # no error (listed or not: it cannot be read)
    found, _, _ = walk(root, root / "src/main.rs", ".rs")
    listed = {p.relative_to(root).as_posix() for p in found} - {"src/loop.rs"}
    assert listed == {"lib/point.rs", "src/alias.rs", "src/main.rs"}
    got = ProjectContext(lambda: []).snippets((root / "src/main.rs").as_uri(), QUERY)
    assert {s.path for s in got} == {"src/alias.rs", "lib/point.rs"}

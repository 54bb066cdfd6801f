"""Audit of project context (the forty-seventh session): a crate's listing cut for one document served another folder's
document; a file that is not UTF-8 was read again at every keystroke; listings of every crate and folder ever completed
in were kept for the whole session; and a module folder named `target` (cc-rs's `src/target/`) was never walked.
Counts of files read and listings kept, never timings."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_context import crate

from m31r_lsp import context as lsp_context
from m31r_lsp.context import ProjectContext, walk

POINT = "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n"
QUERY = "let p = Point { x: 1, y: 2 };\n"


@pytest.fixture(autouse=True)
def no_time_limit(monkeypatch) -> None:
    """A loaded machine's walk is cut by entries, as the tests count, not by time."""
    monkeypatch.setattr(lsp_context, "MAX_WALK_S", 600.0)


def paths(ctx: ProjectContext, doc: Path) -> list[str]:
    return [s.path for s in ctx.snippets(doc.as_uri(), QUERY)]


def test_a_cut_listing_serves_only_the_folder_it_was_walked_for(tmp_path, monkeypatch) -> None:
    """A crate too large to list whole: the listing walked for a document in `src/a` (its neighbours) was the crate's
    for the next 10 s, so a document in `zz/b` got none of its own neighbours, and other snippets than it got alone."""
    monkeypatch.setattr(lsp_context, "MAX_VISITED", 60)
    root = crate(tmp_path / "demo", {"src/a/main.rs": "", "zz/b/main.rs": "", "zz/b/near.rs": POINT,
                                     **{f"src/a/f{i:03}.rs": "fn f() {}\n" for i in range(100)}})
    a, b = root / "src/a/main.rs", root / "zz/b/main.rs"
    alone = {doc: paths(ProjectContext(lambda: []), doc) for doc in (a, b)}
    assert alone[b] == ["zz/b/near.rs"]
    ctx = ProjectContext(lambda: [])
    for doc in (a, b, a, b):
        assert paths(ctx, doc) == alone[doc], doc


def test_listings_that_expired_are_dropped(tmp_path, monkeypatch) -> None:
    """Each folder completed in (a document in no crate lists its own folder) kept its listing for the whole session;
    an expired one is walked again anyway, so it goes."""
    monkeypatch.setattr(lsp_context, "LISTING_TTL_S", -1.0)  # every listing has expired by the next request
    ctx = ProjectContext(lambda: [])
    for i in range(20):
        folder = tmp_path / f"scratch{i}"
        folder.mkdir()
        (folder / "x.rs").write_text("")
        (folder / "y.rs").write_text(POINT)
        assert paths(ctx, folder / "x.rs") == ["y.rs"]
    assert len(ctx._listings) == 1


def test_a_file_that_is_not_utf8_is_read_once_until_it_changes(tmp_path, monkeypatch) -> None:
    """A Latin-1 fixture beside the document was opened and decoded at every keystroke (each file that is UTF-8 is
    read once per version); once it changes it is read again, and quoted once it is UTF-8."""
    root = crate(tmp_path / "demo", {"src/main.rs": "", "src/point.rs": POINT})
    latin = root / "src/latin.rs"
    latin.write_bytes("// café\npub struct Point { pub z: i64 }\n".encode("latin-1") * 500)
    opened: dict[str, int] = {}
    real_open = Path.open

    def counting(self: Path, mode: str = "r", *args, **kwargs):
        if "r" in mode:  # reads (the test's own writes open it too)
            opened[self.name] = opened.get(self.name, 0) + 1
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", counting)
    ctx = ProjectContext(lambda: [])
    for _ in range(5):
        assert paths(ctx, root / "src/main.rs") == ["src/point.rs"]
    assert opened == {"latin.rs": 1, "point.rs": 1}
    latin.write_text("pub struct Point { pub x: i64, pub y: i64 }\n")
    assert set(paths(ctx, root / "src/main.rs")) == {"src/point.rs", "src/latin.rs"}
    assert opened["latin.rs"] == 2


def test_a_module_folder_named_target_is_walked(tmp_path) -> None:
    """cc-rs keeps modules in `src/target/`: skipped by name, its files were never listed, and a document in it got no
    snippets at all. Only a `target` beside a Cargo.toml is cargo's build output, a nested crate's included."""
    root = crate(tmp_path / "cc", {"src/lib.rs": "mod target;\n", "src/target/apple.rs": "",
                                   "src/target/parser.rs": POINT, "target/debug/gen.rs": POINT,
                                   "fuzz/Cargo.toml": "[package]\n", "fuzz/target/gen.rs": POINT,
                                   "fuzz/src/main.rs": ""})
    found, _, cut = walk(root, root / "src/target/apple.rs", ".rs")
    assert not cut
    assert sorted(p.relative_to(root).as_posix() for p in found) == [
        "fuzz/src/main.rs", "src/lib.rs", "src/target/apple.rs", "src/target/parser.rs"]
    assert paths(ProjectContext(lambda: []), root / "src/target/apple.rs") == ["src/target/parser.rs"]
    assert paths(ProjectContext(lambda: []), root / "src/lib.rs") == ["src/target/parser.rs"]
    # A document in the crate's own build output still gets the crate's sources (the walk starts at the root).
    assert paths(ProjectContext(lambda: []), root / "target/debug/gen.rs") == ["src/target/parser.rs"]



def test_a_snippet_given_twice_is_laid_out_once(tiny_engine) -> None:
    """Tabby's changed and recently opened files can name one snippet twice: laid out twice, it took the room of the
    next one."""
    from m31r.context import context_ids
    from m31r_protocol.messages import Snippet

    tok = tiny_engine.tokenizer
    a, b = Snippet("fn a() {}\n", "src/a.rs"), Snippet("fn b() {}\n", "src/b.rs")
    once = context_ids(tok, [a, b], 1000)
    assert context_ids(tok, [a, a, b], 1000) == once
    room = len(once)  # room for both, not for a twice and b
    assert context_ids(tok, [a, a, b], room) == once
    assert context_ids(tok, [a, Snippet(a.text, "src/c.rs")], 1000) != context_ids(tok, [a], 1000)  # another file

"""Project context (`projectContext`) quotes files of the completed document's language only: a TOML, Markdown or
Python document in a Rust workspace got Rust snippets laid before its prompt (the crate's .rs files were the only
files looked at, whatever the document). Real server, real daemon (test_lsp's fixtures) for the end-to-end case."""

from __future__ import annotations

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE

from m31r_lsp.context import ProjectContext, language_suffix

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp

POINT = "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n\nimpl Point {\n    pub fn norm(&self) -> i64 {\n" \
        "        self.x * self.x + self.y * self.y\n    }\n}\n"
PY = "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def norm(self):\n" \
     "        return self.x * self.x + self.y * self.y\n"
# Lines above the cursor naming the same things, in each language's documents.
QUERY = "Point x y norm\nlet p = Point { x: 1, y: 2 }; p.norm()\n"


@pytest.fixture
def crate(tmp_path):
    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    (root / "scripts").mkdir()
    (root / "Cargo.toml").write_text('[package]\nname = "demo"\n')
    (root / "src/point.rs").write_text(POINT)
    (root / "src/main.rs").write_text("")
    (root / "scripts/geo.py").write_text(PY)
    (root / "scripts/tool.py").write_text("")
    (root / "README.md").write_text("")
    (root / "docs.md").write_text("# Point\n\nA Point has x and y; norm() is x * x + y * y.\n")
    return root


def test_snippets_come_from_files_of_the_documents_language(crate):
    ctx = ProjectContext(lambda: [])
    uri = {name: (crate / name).as_uri() for name in ("src/main.rs", "Cargo.toml", "README.md", "scripts/tool.py")}
    assert [s.path for s in ctx.snippets(uri["src/main.rs"], QUERY)] == ["src/point.rs"]
    assert [s.path for s in ctx.snippets(uri["scripts/tool.py"], QUERY)] == ["scripts/geo.py"]
    assert [s.path for s in ctx.snippets(uri["README.md"], QUERY)] == ["docs.md"]
    assert ctx.snippets(uri["Cargo.toml"], QUERY) == []  # the only TOML file is the document itself

    # Open documents too: an unsaved Rust buffer (no suffix: its languageId says) quotes the open Rust file, never the
    # open Python one or an unsaved Markdown buffer; nor does a Rust file on disk.
    opened = [(uri["scripts/tool.py"], PY.replace("Point", "Pt"), "python"), ("untitled:Untitled-1", "", "rust"),
              ("untitled:Untitled-2", "Point x y norm\n" * 3, "markdown"),
              ((crate / "src/point.rs").as_uri(), POINT, "rust")]
    assert [s.path for s in ctx.snippets("untitled:Untitled-1", QUERY, opened)] == ["point.rs"]
    assert [s.path for s in ctx.snippets(uri["src/main.rs"], QUERY, opened)] == ["src/point.rs"]
    assert ctx.snippets("untitled:Untitled-3", QUERY, [*opened, ("untitled:Untitled-3", "", "plaintext")]) == []

    assert language_suffix(uri["src/main.rs"]) == ".rs" and language_suffix("untitled:x", "Rust") == ".rs"
    assert language_suffix("untitled:x", "toml") is None and language_suffix(uri["Cargo.toml"], "rust") == ".toml"


@pytest.mark.parametrize(("name", "language", "nl", "want"), [
    ("Cargo.toml", "toml", "\n", []), ("README.md", "markdown", "\n", ["docs.md"]),
    ("scripts/tool.py", "python", "\n", ["scripts/geo.py"]), ("src/main.rs", "rust", "\n", ["src/point.rs"]),
    ("src/main.rs", "rust", "\r", ["src/point.rs"])])
async def test_a_request_carries_snippets_of_its_documents_language(lsp, crate, name, language, nl, want):
    """Through the server, with the Rust file open as well: a TOML, Markdown or Python document's Fim carries no Rust
    snippet, and a Rust one no other; lines that end in a lone "\\r" (old Mac files) are lines here too (the lines
    above the cursor, read up to the last "\\n", were none)."""
    s = await lsp({**NOISE, "projectContext": True, "maxTokens": 2})
    point = (crate / "src/point.rs").as_uri()
    s.open(POINT, uri=point)
    uri, text = (crate / name).as_uri(), QUERY.replace("\n", nl)
    s.version[uri], s.texts[uri] = 1, text
    s.client.text_document_did_open(t.DidOpenTextDocumentParams(
        t.TextDocumentItem(uri=uri, language_id=language, version=1, text=text)))
    await s.inline(len(text), uri=uri)
    st = await s.stats()
    assert st["lastFim"]["document"] == uri and st["lastFim"]["context"] == want

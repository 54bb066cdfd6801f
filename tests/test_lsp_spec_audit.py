"""`m31r lsp` against LSP 3.18 and what editors do with its answers: a pytest-lsp client drives the real server
process, which talks to a real m31rd on the tiny random-weight bundle (test_lsp's fixtures). Nothing is mocked."""

from __future__ import annotations

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, expected
from test_lsp_edges import applied

from m31r_lsp.documents import position_at

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp


def augments(item: t.InlineCompletionItem, selected: t.SelectedCompletionInfo) -> bool:
    """Whether VS Code shows `item` beside its menu's selected item: it must start with the item's text and replace
    the item's range, or more from the same start (vscode src/vs/editor/contrib/inlineCompletions/browser/model/
    singleTextEditHelpers.ts, singleTextEditAugments: "can replace even more")."""
    r, s = item.range, selected.range
    return (item.insert_text.startswith(selected.text) and r is not None and r.start == s.start
            and (s.end.line, s.end.character) <= (r.end.line, r.end.character))


async def test_a_suggestion_beside_the_menu_may_replace_the_closers_after_the_cursor(lsp):
    """`dbg!(v.le|)` (the editor typed the `)`) with `len` selected in the menu: the suggestion for `v.len|)` writes its
    own `)` and so replaces the one there, up to the line's end (a `)` that closes nothing open would be cut,
    so the `(` is there). The server dropped every such suggestion (it answered only
    those ending at the cursor), so the user saw no ghost text beside the menu; now it comes over the item's range and
    the closers, which VS Code takes (the range may extend past the item's)."""
    s = await lsp({**NOISE, "multiline": "never", "maxTokens": 24, "seed": 8})  # (a seed whose answer holds a `)`)
    text = "fn main() {\n    let v = vec![1];\n    let n = dbg!(v.le)\n}\n"
    s.open(text)
    cursor = text.index("v.le)") + len("v.le")
    start = cursor - len("le")
    (l0, c0), (l1, c1) = position_at(text, start), position_at(text, cursor)
    selected = t.SelectedCompletionInfo(range=t.Range(t.Position(l0, c0), t.Position(l1, c1)), text="len")
    params = s.inline_params(cursor)
    params.context.selected_completion_info = selected
    res = await s.client.text_document_inline_completion_async(params)
    st = await s.stats()
    accepted, after = text[:start] + "len" + text[cursor:], start + len("len")
    want = expected(accepted, after, st["lastRaw"], multiline="never")
    assert want is not None and want.end == after + 1  # the suggestion replaces the `)`
    assert len(res.items) == 1
    item = res.items[0]
    assert augments(item, selected)
    assert applied(text, item.range, item.insert_text) == accepted[: want.start] + want.text + accepted[want.end :]


async def test_many_open_documents_of_other_crates_leave_room_for_the_crates_own_files(lsp, tmp_path):
    """Project context ranks 64 files a request. The open documents came first, in the order they were opened: with
    70 Rust documents of other crates open (the sources of dependencies and std that go-to-definition opens count),
    the crate's own files on disk were never read, and a function defined beside the cursor never reached the
    prompt. Files are now taken nearest the document first, open or not."""
    root = tmp_path / "demo"
    (root / "src").mkdir(parents=True)
    (root / "Cargo.toml").write_text('[package]\nname = "demo"\n')
    (root / "src" / "widget.rs").write_text("pub fn frobnicate_widget(w: &mut Widget) -> u32 {\n    w.size\n}\n")
    s = await lsp({**NOISE, "projectContext": True})
    for i in range(70):
        s.open(f"pub fn helper_{i}() -> u32 {{\n    {i}\n}}\n", uri=(tmp_path / "deps" / f"dep{i}" / "lib.rs").as_uri())
    main = root / "src" / "main.rs"
    text = "fn main() {\n    let mut w = Widget::default();\n    let n = frobnicate_widget(&mut w);\n    let t = \n}\n"
    s.open(text, uri=main.as_uri())
    await s.inline(text.index("let t = ") + len("let t = "), uri=main.as_uri())
    st = await s.stats()
    assert st["lastFim"]["context"][0] == "src/widget.rs"  # the best match, where it was not among them

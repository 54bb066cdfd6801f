"""m31r_protocol.policy: in a line comment, the brackets are those of the comment's text.

A doc comment's example is code: read as comment, its brackets were none, and the completion's closers were cut as
closing nothing (`/// assert!(x.has(█` answered `"e"));` showed `"e"`). Documents mark the cursor with █.
"""

from __future__ import annotations

import pytest
from test_policy_s43 import apply

ITEM = "pub fn has(&self, name: &str) -> bool {\n    true\n}\n"


@pytest.mark.parametrize("comment, raw, want", [
    # one line of a doc example: its own closers are kept, one too many is still cut
    ("/// assert!(doc.root().has_tag_name(█", '"e"));', '/// assert!(doc.root().has_tag_name("e"));'),
    ("/// assert!(doc.root().has_tag_name(█", '"e")));', '/// assert!(doc.root().has_tag_name("e"))'),
    # an example over several lines of the same comment
    ("/// let v = vec![\n///     1,\n///     █", "2];", "/// let v = vec![\n///     1,\n///     2];"),
    # an inner doc comment, and a plain comment after code: their own text, not the code's brackets
    ("//! Calls f(█", "x).", "//! Calls f(x)."),
    ("let x = g(a); // calls g(█", "b) too", "let x = g(a); // calls g(b) too"),
])
def test_closers_of_brackets_a_line_comment_opened_are_kept(comment, raw, want):
    assert apply(comment + "\n" + ITEM, raw) == want + "\n" + ITEM


def test_a_comment_of_another_kind_above_is_not_read():
    """`//` lines above a `///` one are another comment: a bracket they leave open is not the doc line's."""
    doc = "// see (the notes\n/// Returns x█\n" + ITEM
    assert apply(doc, "y).") == "// see (the notes\n/// Returns xy\n" + ITEM


def test_a_comment_marker_inside_a_string_is_no_comment():
    """`"http://` is a string, not a comment: the cursor in it is unclear, and nothing is cut."""
    doc = 'fn f() {\n    let u = "http://x.org/(█\n}\n'
    assert apply(doc, 'a)");') == 'fn f() {\n    let u = "http://x.org/(a)");\n}\n'

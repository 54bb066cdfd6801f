"""m31r_protocol.policy: how it reads Rust's brackets: nested block comments, char literals and raw strings beside
brackets and quotes, the char literal the cursor is in; closers in the wrong order; a one-line block's comment.

Documents mark the cursor with █.
"""

from __future__ import annotations

import pytest
from test_policy_s43 import apply


def in_fn(line: str) -> str:
    return "fn f() {\n    " + line + "\n}\n"


# -- 1. what holds brackets that are none ----------------------------------------------------------------------------


@pytest.mark.parametrize("before, want", [
    ("/* a /* b */ ( */", "g(a)"),  # the `(` is in the outer comment: it was read as open, and "a))" kept whole
    ("/* a /* b */ ) */", "g(a)"),  # the `)` closed nothing: the prefix was unclear, and nothing was cut
    ("/*! a /* b ( */ c ( */", "g(a)"),  # an inner doc comment nests too
    ('let s = c"(";', "g(a)"),  # a C string (it made the prefix unclear)
    ('let s = cr#"(" )"#;', "g(a)"),
])
def test_brackets_in_nested_comments_and_c_strings_are_none(before, want):
    assert apply(in_fn(before + "\n    g(█"), "a));") == in_fn(before + "\n    " + want)


def test_a_cursor_in_a_nested_comment_is_not_judged():
    """After `/* a /* b */` the comment is still open: its brackets are text (it cut "a))" to "a)")."""
    assert apply("/* a /* b */ g(█", "a))") == "/* a /* b */ g(a))"


@pytest.mark.parametrize("before", [
    '/** doc ( */', '/// doc (', '//! (', 'let s = r#"he said "(" ok"#;', 'let s = br##"a "# ( "##;',
    'let s = b"(";', "let c = '\\'';", "/*/ ( */", "let c = b'(';", "let c = '\\u{28}';", 'let r#match = "(";',
])
def test_brackets_in_doc_comments_raw_strings_and_char_literals_are_none(before):
    """(These were read right before too.)"""
    assert apply(in_fn(before + "\n    g(█"), "a));") == in_fn(before + "\n    g(a)")


@pytest.mark.parametrize("doc, want", [
    ("g('{', █", "g('{', a)"),
    ("fn f<'a>(x: &'a str) -> &'static str {\n    g(&'a █", "fn f<'a>(x: &'a str) -> &'static str {\n    g(&'a a)"),
    ("g(r#match, █", "g(r#match, a)"),
])
def test_lifetimes_and_char_literals_beside_brackets(doc, want):
    assert apply(doc, "a));") == want


def test_the_char_literal_the_cursor_is_in_holds_no_bracket():
    """`'(` before the cursor: its `(` was read as open, so the one `)` too many was kept: `g('('));`."""
    assert apply(in_fn("g('(█"), "'));") == in_fn("g('(')")
    assert apply(in_fn("s.push('█"), "{');") == in_fn("s.push('{');")  # its own `{` in the char it closes


# -- 2. closers in the wrong order -----------------------------------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    (in_fn("foo({█"), "x)})", in_fn("foo({x")),  # `)` where the `{` is open: cut at the first wrong closer
    (in_fn("foo({█})"), "x)}", in_fn("foo({x})")),  # ... and the document's own closers stay
    (in_fn("foo({█"), "x})", in_fn("foo({x})")),  # the right order is kept
    (in_fn("█"), "(a});", in_fn("(a")),  # its own `(` closed by a `}`: was shown as `(a}`
    (in_fn("let v = █"), "vec![(1, 2];", in_fn("let v = vec![(1, 2")),
    (in_fn("let v = █"), "vec![(1, 2)];", in_fn("let v = vec![(1, 2)];")),
])
def test_closers_in_the_wrong_order_are_cut_at_the_first(doc, raw, want):
    assert apply(doc, raw) == want


# -- 3. char literals and raw strings where the completion meets the document's closers ------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    # a bracket or quote in a char literal opened a bracket or a string: the document's closers were written again
    (in_fn("s.push(█);"), "'(');", in_fn("s.push('(');")),
    (in_fn("s.push(█);"), "'\"');", in_fn("s.push('\"');")),
    (in_fn("g(x█).h();"), ", '(')", in_fn("g(x, '(').h();")),
    (in_fn("g(█)"), 'r#"a"b"#)', in_fn('g(r#"a"b"#)')),
    # ... and in the cursor's line before it, a `'"'` or `r#"a"b"#` read as a string open at the cursor
    (in_fn("let c = '\"'; g(█)"), "x)", in_fn("let c = '\"'; g(x)")),
    (in_fn('let s = r#"a"b"#; g(█);'), "x);", in_fn('let s = r#"a"b"#; g(x);')),
    # the cursor in a char literal the editor closed
    ("let c = '█';", "{';", "let c = '{';"),
])
def test_char_literals_and_raw_strings_meeting_the_documents_closers(doc, raw, want):
    assert apply(doc, raw) == want


# -- 4. a one-line block ---------------------------------------------------------------------------------------------


def test_a_one_line_body_with_a_line_comment_is_not_joined_with_its_closer():
    """`{ x + 1 // add }` comments out the `}`: the body keeps its line (nothing shows at max_lines=1)."""
    assert apply("fn f() {█}\n", "\n    x + 1 // add\n", max_lines=1) is None
    assert apply("fn f() {█\n", "\n    x + 1 // add\n}", max_lines=1) is None
    assert apply("fn f() {█\n", '\n    g("http://x", \'/\')\n}', max_lines=1) == "fn f() { g(\"http://x\", '/') }\n"

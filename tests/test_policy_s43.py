"""m31r_protocol.policy: a block's line break before the closers after the cursor, one-line blocks at max_lines=1,
closers the document already has after the cursor, and closers that close no open bracket.

Documents mark the cursor with █.
"""

from __future__ import annotations

import pytest

from m31r_protocol import policy
from m31r_protocol.policy import Options, Suggestion


def cur(doc: str) -> tuple[str, int]:
    i = doc.index("█")
    return doc[:i] + doc[i + 1 :], i


def suggest(doc: str, raw: str, **opts) -> Suggestion | None:
    text, offset = cur(doc)
    return policy.postprocess(policy.plan(text, offset, Options(**opts)), raw)


def apply(doc: str, raw: str, **opts) -> str | None:
    """The document once the suggestion is accepted, or None when nothing shows."""
    text, offset = cur(doc)
    s = suggest(doc, raw, **opts)
    if s is None:
        return None
    assert s.start <= offset <= s.end and s.text.startswith(text[s.start : offset])
    it = iter(s.text[offset - s.start :])
    assert all(c in it for c in text[offset : s.end]), "it deletes only what it writes again"
    return text[: s.start] + s.text + text[s.end :]


# -- 1. a block's closers after the cursor keep their own line ------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    ("fn f() {█}\n", "\n    body();\n", "fn f() {\n    body();\n}\n"),
    ("    if x {█}\n", "\n        body();\n", "    if x {\n        body();\n    }\n"),
    ("    if x {█ }\n", "\n        body();\n    ", "    if x {\n        body();\n    }\n"),  # the space is the indent's
    ("\tif x {█})\n", "\n\t\ta();\n\t\tb();\n", "\tif x {\n\t\ta();\n\t\tb();\n\t})\n"),
    ("fn f() {█}\r\n", "\n    body();\n", "fn f() {\r\n    body();\r\n}\r\n"),
])
def test_a_block_ending_its_last_line_leaves_the_closers_on_a_line_of_their_own(doc, raw, want):
    """The model's answer for `{|}` ends with a line break before the `}`: trimmed, the `}` ended up at the end of the
    block's last line (`body();}`)."""
    assert apply(doc, raw) == want


@pytest.mark.parametrize("doc, raw, want", [
    ("fn f() {█}\n", "\n    body();", "fn f() {\n    body();}\n"),  # cut short (no break): the user goes on typing
    ("foo(█)\n", "a,\n", "foo(a,)\n"),  # one line: the break is the end of the answer, not a layout
    ("fn f() {█}\n", "\n    body();\n}", "fn f() {\n    body();\n}\n"),  # it wrote the `}` itself: replaced
    ('    s.push_str("█");\n', "a\n    b\n", '    s.push_str("a\n    b");\n'),  # in a string: no indentation added
])
def test_the_closers_line_is_added_only_for_a_whole_multi_line_answer(doc, raw, want):
    assert apply(doc, raw) == want


def test_the_closers_line_counts_against_max_lines():
    assert apply("fn f() {█}\n", "\n    a();\n    b();\n", max_lines=3) == "fn f() {\n    a();\n    b();}\n"
    assert apply("fn f() {█}\n", "\n    a();\n    b();\n", max_lines=4) == "fn f() {\n    a();\n    b();\n}\n"


# -- 2. max_lines=1 after a `{` -------------------------------------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    ("fn f() {█}\n", "\n    body();\n", "fn f() { body(); }\n"),  # the document's `}` after the cursor
    ("fn f() {█ }\n", "\n    body();\n", "fn f() { body(); }\n"),
    ("    if x {█\n    done();\n", "\n        go();\n    }\n    done();", "    if x { go(); }\n    done();\n"),
    ("    let y = if x {█\n", "\n        1\n    } else {\n        2\n    };", "    let y = if x { 1 }\n"),
])
def test_max_lines_1_after_an_opening_brace_shows_a_one_line_body(doc, raw, want):
    """One line can hold no line break, so a block the model writes under the `{` showed nothing at all; a block it
    writes with a one-line body shows as `{ body }` on the cursor's line."""
    assert apply(doc, raw, max_lines=1) == want


@pytest.mark.parametrize("doc, raw", [
    ("fn f() {█}\n", "\n    a();\n    b();\n"),  # a longer body is no one-liner
    ("fn f() {█}\n", "\n    a();"),  # the answer may go on (cut short): not known to be the whole body
    ("    if x {█\n    }\n", "\n        go();\n"),  # the document closes the block on the next line already
    ("fn f() {█}\n", "\n    if a {\n    }\n"),  # that `}` closes the body's own block
    ("fn f() {█}\n", "\n    match a {\n"),
])
def test_max_lines_1_after_an_opening_brace_shows_nothing_without_a_whole_one_line_body(doc, raw):
    assert apply(doc, raw, max_lines=1) is None


def test_max_lines_1_keeps_a_first_line_the_model_wrote_after_the_brace():
    assert apply("fn f() {█}\n", " body() }", max_lines=1) == "fn f() { body() }\n"
    assert apply("    if x {█\n", "\n        go();\n    }", max_lines=2) == "    if x {\n        go();\n"


# -- 3. closers the document already has after the cursor ------------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    ("let v = xs.iter().map(|x| f(x█).collect());", " * 2)", "let v = xs.iter().map(|x| f(x * 2).collect());"),
    ("let y = g(h(a█) ).unwrap();", ", b))", "let y = g(h(a, b) ).unwrap();"),  # whitespace among the document's
    ("let y = g(h(a█)).unwrap();", ", b) )", "let y = g(h(a, b)).unwrap();"),  # ... and among the completion's
    ("let y = v[f(a█)].len();", ", b)]", "let y = v[f(a, b)].len();"),
])
def test_closers_the_document_has_after_the_cursor_are_not_written_again(doc, raw, want):
    """Mid-line the rest of the line is no closers only, so no range replaced them: accepting wrote them twice."""
    assert apply(doc, raw) == want


@pytest.mark.parametrize("doc, raw, want", [
    ("foo(bar(x█).baz()", "y))", "foo(bar(xy)).baz()"),  # the document lacks foo's `)`: one stays
    ("let v = f(x█).len();", " + g(1)", "let v = f(x + g(1)).len();"),  # its own brackets' closers
    ("let v = f(x█).len();", "y]", "let v = f(xy).len();"),  # a `]` where a `)` is open: no closer of the document
])
def test_closers_the_document_lacks_after_the_cursor_stay(doc, raw, want):
    assert apply(doc, raw) == want


# -- 4. closers that close no bracket open before the cursor ---------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    # even_squares in benchmarks/sim_typing.py: one `)` too many, 13 wrong shows in a row.
    ("fn f(xs: &[i32]) -> Vec<i32> {\n    xs.iter().map(|&x| x * █)\n}\n", "x).collect())",
     "fn f(xs: &[i32]) -> Vec<i32> {\n    xs.iter().map(|&x| x * x).collect()\n}\n"),
    ("fn f() {\n    xs.iter().map(g).█\n}\n", "collect())", "fn f() {\n    xs.iter().map(g).collect()\n}\n"),
    ("fn f() {\n    let c = '}'; // )\n    let s = \"(\";\n    g(█\n", "a)]", "fn f() {\n    let c = '}'; // )\n"
     "    let s = \"(\";\n    g(a)\n"),  # brackets in a char literal, a comment and a string are none
    ("fn f<'a>(x: &'a str) {\n    █\n}\n", "x.len()))", "fn f<'a>(x: &'a str) {\n    x.len()\n}\n"),
])
def test_a_closer_of_no_open_bracket_is_cut(doc, raw, want):
    assert apply(doc, raw) == want


@pytest.mark.parametrize("doc, raw, want", [
    ('let s = "(█', "a))", 'let s = "(a))'),  # in a string: its brackets are text
    ("x) + f(█", "a))", "x) + f(a))"),  # the prefix closes what it did not open: an edit in progress, no judging
    ("/* ( */ g(█", "a))", "/* ( */ g(a)"),
])
def test_closers_are_judged_only_where_the_open_brackets_are_known(doc, raw, want):
    assert apply(doc, raw) == want


def test_brackets_in_the_completions_char_literals_and_strings_close_nothing():
    doc = "fn f(c: char) -> bool {\n    c == █\n}\n"
    assert apply(doc, "')' || c == '}' || \"]\".contains(c)") == (
        "fn f(c: char) -> bool {\n    c == ')' || c == '}' || \"]\".contains(c)\n}\n")


def test_a_long_prefix_is_read_from_its_last_top_level_item():
    """A prefix past SCAN_CHARS is read from the first item starting at column 0 among its last SCAN_CHARS (the
    whole 5 MB prefix took 0.2 s a suggestion); where it has none, nothing is judged."""
    filler = "".join(f"fn f{i}() {{ g({i}); }}\n" for i in range(policy.SCAN_CHARS // 16))
    assert len(filler) > policy.SCAN_CHARS
    assert apply(filler + "fn main() {\n    let y = f(x█\n}\n", "));") == filler + "fn main() {\n    let y = f(x)\n}\n"
    indented = "mod m {\n" + "".join(f"    fn f{i}() {{ g({i}); }}\n" for i in range(policy.SCAN_CHARS // 16))
    assert apply(indented + "    fn h() {\n        let y = f(x█\n    }\n}\n", "));") == (
        indented + "    fn h() {\n        let y = f(x));\n    }\n}\n")


def test_a_completion_that_begins_with_a_line_break_is_judged_by_its_first_line_with_text():
    """At a line's end the model often begins with the line break: Done.line_logprob is that break's (near certain),
    and confident_lines then cut the unlikely line after it, so nothing showed, even to a user who asked (an invoked
    request shows its best unsure suggestion). The gate is now the first line with text, with the breaks before it."""
    raw, by_line = "\n    return t;\n}", [-0.01, -4.0, -0.1]
    first = policy.first_line_logprob(raw, by_line[0], by_line)
    assert first == pytest.approx(-4.01) and not policy.confident(first, 0.05)
    assert policy.confident_lines(raw, by_line, 0.05) == "\n    return t;"  # kept whole when the gate lets it through
    # a completion that begins with text: the daemon's figure, and the cut as before
    assert policy.first_line_logprob("a;\nb;", -0.5, [-0.5, -9.0]) == -0.5
    assert policy.confident_lines("a;\nb;", [-0.5, -9.0], 0.05) == "a;"
    # blank lines, then a likely one: shown, and the cut goes on after it
    assert policy.confident(policy.first_line_logprob("\n\n    x;\n    y;", -0.1, [-0.1, -0.2, -0.3, -8.0]), 0.05)
    assert policy.confident_lines("\n\n    x;\n    y;", [-0.1, -0.2, -0.3, -8.0], 0.05) == "\n\n    x;"
    # an older daemon without line figures: its line_logprob, and nothing cut
    assert policy.first_line_logprob("\n    x;", -0.2, []) == -0.2
    assert policy.confident_lines("\n    x;", [], 0.05) == "\n    x;"

"""An audit of m31r_protocol.policy as a user sees it: CRLF and lone-CR files, tab indentation, auto-closed brackets and
quotes, the end of a file, trailing whitespace, typing through a suggestion, multi-byte text, empty answers and line
caps; then properties every suggestion keeps, whatever the document and the model's answer.

Documents mark the cursor with █.
"""

from __future__ import annotations

import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from m31r_protocol import policy
from m31r_protocol.policy import Options, Shown, Suggestion

EOL = re.compile(r"\r\n|\r|\n")


def cur(doc: str) -> tuple[str, int]:
    i = doc.index("█")
    return doc[:i] + doc[i + 1 :], i


def subsequence(a: str, b: str) -> bool:
    it = iter(b)
    return all(c in it for c in a)


def check(text: str, offset: int, s: Suggestion) -> str:
    """The invariants an editor relies on; returns the document once the suggestion is accepted."""
    assert s.start <= offset <= s.end, (s, offset)
    assert s.text.startswith(text[s.start : offset]), "ghost text must extend what is typed"
    # Nothing after the cursor is deleted but what the suggestion writes again (the closers it replaces).
    assert subsequence(text[offset : s.end], s.text[offset - s.start :]), (text[offset : s.end], s)
    # The range never cuts a line break in two, and joining never makes one "\r\n" of a "\r" and a "\n".
    out = text[: s.start] + s.text + text[s.end :]
    assert len(EOL.findall(out)) == sum(len(EOL.findall(x)) for x in (text[: s.start], s.text, text[s.end :]))
    # Nor a UTF-16 surrogate pair, where a front end's text holds one as two code points.
    for at in (s.start, s.end):
        assert not ("\ud800" <= text[at - 1 : at] <= "\udbff" and "\udc00" <= text[at : at + 1] <= "\udfff")
    return out


def apply(doc: str, raw: str, **opts) -> str | None:
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset, Options(**opts)), raw)
    return None if s is None else check(text, offset, s)


# -- line ends -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nl", ["\r\n", "\r"])
def test_model_line_feeds_are_written_with_the_documents_line_ends(nl):
    doc = "fn main() {\n    let x = █\n}\n".replace("\n", nl)
    assert apply(doc, "1;\n    let y = 2;\n}") == "fn main() {\n    let x = 1;\n    let y = 2;\n}\n".replace("\n", nl)
    blank = "fn main() {\n    █\n}\n".replace("\n", nl)
    assert apply(blank, "let y = 2;\r\nlet z = 3;\r\n") == "fn main() {\n    let y = 2;\n    let z = 3;\n}\n".replace(
        "\n", nl)


def test_a_suggestion_starting_a_line_after_a_lone_cr_does_not_join_it_into_crlf():
    """A file with mixed line ends: the suggestion's break after the "\\r" above must stay a break of its own."""
    text, offset = cur("fn f() {\n    a();\r█}\n")
    s = policy.postprocess(policy.plan(text, offset), "\n    b();")
    assert s is not None and s.text == "\r    b();"
    check(text, offset, s)  # the count of line breaks adds up


@pytest.mark.parametrize("doc", ["fn f() {\r█\n}", "let x = 1;\r█\nlet y;", "\r█\n"])
def test_a_cursor_inside_crlf_gets_no_suggestion(doc):
    """No editor puts a cursor between "\\r" and "\\n" (an HTTP client may): anything inserted there splits the
    line break, and on a blank line the range used to delete the "\\r"."""
    text, offset = cur(doc)
    assert policy.postprocess(policy.plan(text, offset), "    x();\n    y();") is None


def test_confident_lines_cut_crlf_answers_like_lf_ones():
    lp = math.log
    figures = [lp(0.9), lp(0.9), lp(0.01)]
    for raw in ("a();\nb();\nc();", "a();\r\nb();\r\nc();"):
        sure = policy.confident_lines(raw, figures, 0.05)
        assert apply("fn f() {\r\n    █\r\n}\r\n", sure) == "fn f() {\r\n    a();\r\n    b();\r\n}\r\n"
    # The daemon counts lines at "\n" (m31r.engine.line_logprobs): a lone "\r" ends none of its figures' lines.
    assert policy.confident_lines("a\rb\nc", [lp(0.9), lp(0.01)], 0.05) == "a\rb"


@pytest.mark.parametrize("nl", ["\n", "\r\n", "\r"])
def test_max_lines_counts_lines_alike_whatever_the_line_end(nl):
    doc = "fn main() {█\n}\n".replace("\n", nl)
    raw = "\n    a();\n    b();\n    c();\n}"
    assert apply(doc, raw, max_lines=3) == "fn main() {\n    a();\n    b();\n}\n".replace("\n", nl)


# -- indentation ---------------------------------------------------------------------------------------------


def test_nested_space_indents_become_tabs_in_a_tab_indented_file():
    doc = "fn main() {\n\tif x {\n\t\t█\n\t}\n}\n"
    raw = "let y = 2;\nif a {\n    b();\n}\n"
    assert apply(doc, raw) == "fn main() {\n\tif x {\n\t\tlet y = 2;\n\t\tif a {\n\t\t\tb();\n\t\t}\n\t}\n}\n"
    assert apply("fn main() {\n\t█\n}\n", "    if a {\n        b();\n    }") == (
        "fn main() {\n\tif a {\n\t\tb();\n\t}\n}\n")


def test_a_space_indented_dedent_in_a_tab_file_ends_the_suggestion():
    """`    }` (4 columns) closes the `\\t\\t` block (8): compared as characters, 4 > 2 kept it, and the `}` closed the
    user's `if` a second time."""
    doc = "fn main() {\n\tif x {\n\t\tlet a = █\n\t}\n}\n"
    want = "fn main() {\n\tif x {\n\t\tlet a = 1;\n\t\tb();\n\t}\n}\n"
    assert apply(doc, "1;\n        b();\n    }\n    c();") == want


def test_two_space_model_indents_become_tabs():
    assert apply("fn main() {\n\t█\n}\n", "  if a {\n    b();\n  }") == "fn main() {\n\tif a {\n\t\tb();\n\t}\n}\n"


def test_tab_model_indents_become_the_files_spaces():
    doc = "fn main() {\n    let a = █\n}\n"
    want = "fn main() {\n    let a = 1;\n    if a {\n        b();\n    }\n}\n"
    assert apply(doc, "1;\n\tif a {\n\t\tb();\n\t}") == want


def test_mixed_tab_and_space_indent_is_made_tabs():
    assert apply("fn main() {\n\t█\n}\n", "\tif a {\n\t    b();\n\t}") == "fn main() {\n\tif a {\n\t\tb();\n\t}\n}\n"


# -- brackets and quotes after the cursor --------------------------------------------------------------------


@pytest.mark.parametrize("doc, raw, want", [
    ("foo(█)", "a, b)", "foo(a, b)"),
    ("foo(█)", "a, b", "foo(a, b)"),
    ("foo(█);", "a);", "foo(a);"),
    ('let s = "█";', 'hello";', 'let s = "hello";'),
    ('let s = "█";', "hello", 'let s = "hello";'),
    ('let s = "█";', '\\"', 'let s = "\\"";'),  # an escaped quote closes nothing
    ("if x {█}", " a() }", "if x { a() }"),
    ("struct S {█}", "\n    a: u32,\n}", "struct S {\n    a: u32,\n}"),
    ("fn f<█>()", "'a>()", "fn f<'a>()"),  # a lifetime's quote is no string
    ("fn f<█>", "T: Clone>", "fn f<T: Clone>"),
    ("fn f(x: &'█)", "a str)", "fn f(x: &'a str)"),
    ("let c = '█';", "a';", "let c = 'a';"),
    ("let c = '█';", "a", "let c = 'a';"),
])
def test_auto_closed_pairs(doc, raw, want):
    assert apply(doc, raw) == want


@pytest.mark.parametrize("doc, raw, want", [
    ("let v: Vec<█>", "Option<u8>", "let v: Vec<Option<u8>>"),
    ("let v: Vec<█>;", "Option<u8>>;", "let v: Vec<Option<u8>>;"),
    ("let v: Vec<█>;", "u8>", "let v: Vec<u8>;"),
    ("let m: HashMap<█>", "String, Vec<u8>", "let m: HashMap<String, Vec<u8>>"),
    ("let f = foo(█)", "|x| x > 1)", "let f = foo(|x| x > 1)"),
    ("let f = foo(█)", "|x| -> u8 { x })", "let f = foo(|x| -> u8 { x })"),
])
def test_a_generics_own_angle_bracket_is_not_the_auto_closed_one(doc, raw, want):
    """The `>` of the completion's `Option<u8>` used to stand for the editor's `>`, which was then replaced:
    `Vec<Option<u8>` lost a bracket."""
    assert apply(doc, raw) == want


@pytest.mark.parametrize("doc, raw, want", [
    ("if x { █ }", "a()}", "if x { a() }"),
    ("foo(█  )", "a)", "foo(a  )"),
    ("let x = █  ;", "5;", "let x = 5  ;"),
    ("if x { █ }", "a() }", "if x { a() }"),  # writes them with the space itself: replaced
])
def test_whitespace_among_closers_is_never_deleted(doc, raw, want):
    assert apply(doc, raw) == want


# -- end of file, trailing whitespace, text already there ----------------------------------------------------------


def test_end_of_file_without_a_final_newline():
    assert apply("fn main() {\n    let x = █", "1;\n}") == "fn main() {\n    let x = 1;"
    assert apply("fn main() {\n    █", "    let x = 1;\n}") == "fn main() {\n    let x = 1;"
    assert apply("fn main() {\r\n    █", "    let x = 1;\n    let y = 2;") == (
        "fn main() {\r\n    let x = 1;\r\n    let y = 2;")


def test_trailing_whitespace_after_the_cursor_is_kept():
    assert apply("let x = █   ", "5;") == "let x = 5;   "
    assert apply("let x = █ \t\nlet y;", "5;") == "let x = 5; \t\nlet y;"


@pytest.mark.parametrize("doc, raw, want", [
    ("let x = █.unwrap();", "foo().unwrap();", "let x = foo().unwrap();"),
    ("let x = █.unwrap();", "foo().unw", "let x = foo().unwrap();"),
    ("foo(█bar)", "x, bar)", "foo(x, bar)"),
    ("let x = █ + 1;", "a + 1;", "let x = a + 1;"),
])
def test_text_already_after_the_cursor_is_not_written_again(doc, raw, want):
    assert apply(doc, raw) == want


@pytest.mark.parametrize("raw", ["", " ", "\n", "\r\n\r\n", "\t \n  ", "\r"])
@pytest.mark.parametrize("doc", ["let x = █", "fn f() {\r\n    █\r\n}", "foo(█)", "let █x = 1;", "█"])
def test_empty_and_whitespace_answers_show_nothing(doc, raw):
    assert apply(doc, raw) is None


# -- multi-byte text ---------------------------------------------------------------------------------------------


def test_multi_byte_text_around_the_cursor():
    assert apply('let s = "😀█";', '😀";') == 'let s = "😀😀";'
    assert apply("let s = █;", '"é"') == 'let s = "é";'
    assert apply("let 名前 = █", "\"値\";\nlet x = 1;") == "let 名前 = \"値\";\nlet x = 1;"


# -- typing through a shown suggestion -------------------------------------------------------------------------


def shown_for(doc: str, raw: str) -> Shown:
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), raw)
    assert s is not None
    return Shown(text, offset, s)


def test_typing_a_character_the_suggestion_does_not_have_drops_it():
    shown = shown_for("let x = █", "compute(1);")
    assert policy.typed_through(shown, "let x = cx", 10) is None
    assert policy.typed_through(shown, "let x = C", 9) is None  # case matters in Rust


def test_typing_up_to_the_closers_already_there_leaves_nothing_to_show():
    """`foo(|)` showing "a)": once "a" is typed, the rest is the ")" the editor put there: a suggestion of nothing
    new, where the model could have been asked what follows."""
    shown = shown_for("foo(█)", "a)")
    assert policy.typed_through(shown, "foo(a)", 5) is None
    shown = shown_for("foo(█)", "ab)")
    assert policy.typed_through(shown, "foo(a)", 5) == Suggestion("ab)", 4, 6)


def test_typing_through_a_line_break_in_a_crlf_file():
    shown = shown_for("fn f() {\r\n    let a = 1;█\r\n}", "\n    let b = 2;")
    text, offset = shown.text[:24] + "\r\n    " + shown.text[24:], 30
    s = policy.typed_through(shown, text, offset)
    assert s is not None and check(text, offset, s) == "fn f() {\r\n    let a = 1;\r\n    let b = 2;\r\n}"
    # An editor that typed a bare "\n" into the CRLF file typed something else.
    assert policy.typed_through(shown, shown.text[:24] + "\n" + shown.text[24:], 25) is None


# -- properties ---------------------------------------------------------------------------------------------------

_PAIR = "\ud83d\ude00"  # 😀 as UTF-16 units, as a front end reading with surrogatepass would hold it
_DOC = st.lists(st.sampled_from([
    "fn f", " ", "    ", "\t", "(", ")", "{", "}", "[", "]", "<", ">", '"', "'", ";", ",", "\n", "\r\n", "\r", "x", "é",
    "😀", _PAIR, "let a = ", "a.b()", "\\", "\n    ", "\n\t"]), max_size=14).map("".join)
_RAW = st.lists(st.sampled_from([
    "x", " ", "    ", "\t", "(", ")", "{", "}", "]", ">", "<", '"', "'", ";", "\n", "\r\n", "\r", "é", "😀", "foo",
    "a.b()", "\n    ", "\n\t"]), max_size=12).map("".join)
_MODES = st.sampled_from(["auto", "always", "never"])


def _not_inside(a: str, b: str) -> bool:
    """A cursor between `a` and `b` is a real one: not inside a "\\r\\n" nor a surrogate pair."""
    return not (a.endswith("\r") and b.startswith("\n")) and not (a[-1:] == _PAIR[0] and b[:1] == _PAIR[1])


@settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
@given(_DOC, _DOC, _RAW, _MODES, st.integers(1, 4))
def test_every_suggestion_keeps_the_editors_invariants(a, b, raw, mode, max_lines):
    text, offset = a + b, len(a)
    p = policy.plan(text, offset, Options(multiline=mode, max_lines=max_lines))
    s = policy.postprocess(p, raw)
    if s is None:
        return
    assert _not_inside(a, b)
    check(text, offset, s)
    # Its line breaks are the document's, and a multi-line one keeps at most max_lines lines: a last break that puts
    # the document's text after the suggestion (closers) on a line of its own opens no line of the suggestion's.
    assert set(EOL.findall(s.text)) <= {p.cursor.newline}
    own = s.text[offset - s.start :]
    if text[s.end : s.end + 1] not in ("", "\r", "\n"):
        own = re.sub(r"(\r\n|\r|\n)[ \t]*\Z", "", own)  # (the break, and the indentation it gives them)
    assert len(EOL.findall(own)) < max_lines or not p.multiline
    assert s.text[offset - s.start :].strip()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(_DOC.filter(lambda d: "\r" not in d), _DOC.filter(lambda d: "\r" not in d), _RAW, _MODES,
       st.sampled_from(["\r\n", "\r"]))
def test_a_crlf_or_cr_file_gets_the_lf_files_suggestion(a, b, raw, mode, nl):
    """The same document with other line ends ends up the same once accepted, line ends aside."""
    if "\n" not in a + b:
        return  # no line end to follow: a suggestion's breaks are "\n"

    def accepted(x: str, y: str) -> str | None:
        s = policy.postprocess(policy.plan(x + y, len(x), Options(multiline=mode)), raw)
        return None if s is None else check(x + y, len(x), s)

    lf = accepted(a, b)
    assert accepted(a.replace("\n", nl), b.replace("\n", nl)) == (None if lf is None else lf.replace("\n", nl))


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(_DOC, _DOC, _RAW, st.integers(0, 12))
def test_typed_through_only_extends_what_was_shown(a, b, raw, n):
    text, offset = a + b, len(a)
    s = policy.postprocess(policy.plan(text, offset), raw)
    if s is None:
        return
    shown = Shown(text, offset, s)
    rest = policy.predicted(shown)
    typed = text[:offset] + rest[:n] + text[offset:]
    t = policy.typed_through(shown, typed, offset + n)
    if t is None:
        return
    assert 0 < n < len(rest)
    # Accepting it then gives the document accepting the shown one gave.
    assert check(typed, offset + n, t) == check(text, offset, s)
    assert t.text[offset + n - t.start :] != typed[offset + n : t.end]  # it shows something new


@pytest.mark.parametrize("doc, raw, typed, at", [
    ("foo(█)", "a) + b", "foo(a))", 6),  # an editor that does not type over its ")"
    ("fn f() {\n█    \n}", "x();", "fn f() {\n     \n}", 10),  # at column 0 of an indented blank line
])
def test_typed_through_never_deletes_what_the_rest_would_no_longer_write(doc, raw, typed, at):
    shown = shown_for(doc, raw)
    assert policy.typed_through(shown, typed, at) is None

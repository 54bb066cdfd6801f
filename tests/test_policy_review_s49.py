"""A review of the forty-ninth session's mid-line rules (docs/serving.md "Mid-line cursors") against Rust lines being
edited: a comment after the code, an answer whose own brackets take the rest's closers, and a `;` of the answer's
before the document's closers. Each case is the document once the suggestion is accepted (None: nothing shown)."""

from __future__ import annotations

import pytest
from policy_util import accept


@pytest.mark.parametrize(("doc", "raw", "want"), [
    # The model ended its line where only closers/punctuation and a comment follow: that is the line's end, not a
    # rewrite of it (the rule hid these right answers, which 65dbb13 showed).
    ("    let x = █; // why\n", "5", "    let x = 5; // why\n"),
    ("    foo(a)█ // call foo\n", ";", "    foo(a); // call foo\n"),
    ("    x += 1;█ /* c */\n", " y += 1;", "    x += 1; y += 1; /* c */\n"),
    ("    let x = █); // c\n", "f(5", "    let x = f(5); // c\n"),
    ("\tlet x = █; // why\r\n}\r\n", "5", "\tlet x = 5; // why\r\n}\r\n"),
])
def test_line_ended_before_a_comment_is_shown(doc: str, raw: str, want: str) -> None:
    assert accept(doc, raw, ended_line=True) == want


@pytest.mark.parametrize(("doc", "raw"), [
    ("    let total█ = 1; // c\n", " = 10;"),  # code before the comment: still a rewrite
    ('    let url = "http:█//x.com";\n', "//y"),  # in a string `//` is no comment
])
def test_line_ended_before_code_is_still_a_rewrite(doc: str, raw: str) -> None:
    assert accept(doc, raw, ended_line=True) is None


@pytest.mark.parametrize("ended", [False, True])
@pytest.mark.parametrize(("doc", "raw", "want"), [
    # It ends with the rest's code before the comment: cut there, as where the line has no comment (was `a);); //`).
    ("    foo(█); // done\n", "a);", "    foo(a); // done\n"),
    ("    let x = █; // why\n", "5;", "    let x = 5; // why\n"),
    ("fn f() {\r\n    let c = f(█); // c)\r\n}\r\n", "x);", "fn f() {\r\n    let c = f(x); // c)\r\n}\r\n"),
])
def test_answer_ending_with_the_code_before_a_comment_is_cut_there(doc: str, raw: str, want: str, ended: bool) -> None:
    assert accept(doc, raw, ended) == want


@pytest.mark.parametrize(("doc", "raw", "want"), [
    # Its text at the cursor opens a bracket that the rest's `)` closes in its line: the document's `)`, which closed
    # `f(`, would be cut away (`f(g(x)`); inserted whole it read `f(g(x)x)`. Nothing.
    ("    let s = f(█x)\n", "g(x)", None),
    ("fn f() {\n    foo(█bar)\n}\n", "Some(bar)", None),
    # Where the rest's closers still close what the document's did, the cut stands.
    ("fn f() {\n    foo(█x));\n}\n", "bar(x));", "fn f() {\n    foo(bar(x));\n}\n"),
    ("    b.iter█ {\n", "(|| {", "    b.iter(|| {\n"),  # a bracket closed on a later line
    ("        } else █{\n", "if x {", "        } else if x {\n"),
])
def test_answer_taking_the_rests_closers_for_its_own(doc: str, raw: str, want: str | None) -> None:
    assert accept(doc, raw) == want


@pytest.mark.parametrize(("doc", "raw", "want"), [
    # None of its closers stood for the document's, which stayed after its `;`.
    ("fn f() {\n    g(█);\n}\n", "h(x);", "fn f() {\n    g(h(x));\n}\n"),
    ("fn f() {\n    foo(█)\n}\n", "x;", "fn f() {\n    foo(x)\n}\n"),
    ("fn f() {\n    foo(bar(\n        baz(█)));\n}\n", "x);", "fn f() {\n    foo(bar(\n        baz(x)));\n}\n"),
    ("fn f() {\n    let v = [█];\n}\n", "1, 2;", "fn f() {\n    let v = [1, 2];\n}\n"),
    # Its line then leaves a bracket open: nothing (was `let mut i = 0;];`).
    ("fn f() {\n    let mut█];\n}\n", " i = 0;", None),
    # Before a `}` a `;` is Rust: left as it is.
    ("fn f() {\n    run(|| { █ });\n}\n", "x;", "fn f() {\n    run(|| { x; });\n}\n"),
])
def test_answers_semicolon_never_precedes_the_documents_closers(doc: str, raw: str, want: str | None) -> None:
    assert accept(doc, raw) == want


@pytest.mark.parametrize(("doc", "raw", "want"), [
    # Before closers among existing lines, right after an opener the editor auto-closed: the answer's lines are that
    # bracket's body, not a line being finished (the first-line rule showed nothing, or `foo(a,);`).
    ("fn f() {\n    if x {█}\n    y();\n}\n", "\n        foo();\n    }",
     "fn f() {\n    if x {\n        foo();\n    }\n    y();\n}\n"),
    ("fn f() {\n    let v = vec![█];\n    y();\n}\n", "\n        1,\n        2,\n    ];",
     "fn f() {\n    let v = vec![\n        1,\n        2,\n    ];\n    y();\n}\n"),
    ("fn f() {\n    let v = foo(█);\n    y();\n}\n", "a,\n        b,\n    );",
     "fn f() {\n    let v = foo(a,\n        b,\n    );\n    y();\n}\n"),
    # A line it finishes: its first line only, as the rule has it.
    ("fn f() {\n    let s = S {█};\n    y();\n}\n", " a: 1, b: 2 };\n    let z = 3;",
     "fn f() {\n    let s = S { a: 1, b: 2 };\n    y();\n}\n"),
    ("    #[█]\n    fn f() {}\n", "test]\n    #[should_panic]", "    #[test]\n    fn f() {}\n"),
])
def test_block_body_after_an_opener_among_existing_lines(doc: str, raw: str, want: str) -> None:
    assert accept(doc, raw) == want

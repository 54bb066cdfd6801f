"""m31r_protocol.policy: the completion policy shared by the LSP server and the HTTP adapter. Pure functions, no daemon.

Documents are written with a "|" marking the cursor; `apply` shows what the editor ends up with.
"""

from __future__ import annotations

import pytest

from m31r_protocol import policy
from m31r_protocol.policy import Options, Shown, Suggestion


def cur(doc: str):
    """Cursor marked with █ (so "|" stays usable in Rust closures)."""
    i = doc.index("█")
    return doc[:i] + doc[i + 1 :], i


def run(doc: str, raw: str, **opts) -> tuple[policy.Plan, Suggestion | None]:
    text, offset = cur(doc)
    p = policy.plan(text, offset, Options(**opts))
    return p, policy.postprocess(p, raw)


def apply(doc: str, raw: str, **opts) -> str | None:
    """The document after accepting the suggestion (cursor dropped), or None when nothing is suggested."""
    text, offset = cur(doc)
    p = policy.plan(text, offset, Options(**opts))
    s = policy.postprocess(p, raw)
    if s is None:
        return None
    assert s.start <= offset <= s.end, (s, offset)
    assert s.text.startswith(text[s.start : offset]), "ghost text must extend what is typed"
    return text[: s.start] + s.text + text[s.end :]


# -- plan: single-line vs multi-line, prompt split ---------------------------------------------------------


@pytest.mark.parametrize(
    "doc, multiline",
    [
        ("fn main() {\n    let x = █\n}\n", True),  # end of line
        ("fn main() {█\n}", True),
        ("foo(█)", True),  # only a closer follows
        ('println!("█");', True),  # closing quote, paren and semicolon
        ("let v = vec![█];", True),
        ("let x = █   ", True),  # trailing whitespace only
        ("let █x = 5;", False),  # mid-line: code follows
        ("fn f(█a: u32) {}", False),
        ("if a █&& b {", False),
    ],
)
def test_multiline_auto(doc, multiline):
    p, _ = run(doc, "")
    assert p.multiline is multiline
    assert p.stop == ([] if multiline else ["\n"])


@pytest.mark.parametrize("mode, expected", [("always", True), ("never", False)])
def test_multiline_modes(mode, expected):
    for doc in ("let x = █", "let █x = 5;"):
        p, _ = run(doc, "", multiline=mode)
        assert p.multiline is expected


def test_plan_splits_at_cursor_and_carries_limits():
    text, offset = cur("fn main() {\n    let x = █1;\n}\n")
    p = policy.plan(text, offset, Options(max_tokens=32, deadline_ms=500))
    assert p.prefix == "fn main() {\n    let x = " and p.suffix == "1;\n}\n"
    kw = p.fim_kwargs()
    assert kw == {"prefix": p.prefix, "suffix": p.suffix, "stop": ["\n"], "max_tokens": 32, "deadline_ms": 500}
    assert p.prefix + p.suffix == text


def test_plan_whitespace_line_generates_from_column_zero():
    text, offset = cur("fn main() {\n    █\n}\n")
    p = policy.plan(text, offset)
    assert p.prefix == "fn main() {\n"  # the line's whitespace is left out
    assert p.suffix == "\n}\n"
    assert p.multiline and p.cursor.blank_line


def test_plan_empty_document_and_bounds():
    p = policy.plan("", 0)
    assert p.prefix == "" and p.suffix == "" and p.multiline
    with pytest.raises(ValueError):
        policy.plan("abc", 4)


@pytest.mark.parametrize("bad", [dict(multiline="sometimes"), dict(max_tokens=0), dict(deadline_ms=0),
                                 dict(max_lines=0)])
def test_options_validated(bad):
    with pytest.raises(ValueError):
        Options(**bad)


# -- plain completions --------------------------------------------------------------------------------------


def test_end_of_line_single_line():
    assert apply("fn main() {\n    let x = █\n}\n", "compute(1);") == "fn main() {\n    let x = compute(1);\n}\n"


def test_range_is_at_cursor_for_plain_insert():
    text, offset = cur("let x = █")
    _, s = run("let x = █", "1;")
    assert s == Suggestion("1;", offset, offset)


def test_trailing_whitespace_and_newlines_trimmed():
    _, s = run("let x = █", "1;   \n\n\n")
    assert s is not None and s.text == "1;"


def test_single_line_cut_at_newline_even_if_daemon_ran_on():
    # mid-line → single-line: whatever follows the first line break is not shown
    assert apply("let █ = 5;", "x: u32 = 5;\nlet y = 2;") == "let x: u32 = 5;"


def test_multiline_at_end_of_line():
    doc = "fn add(a: i32, b: i32) -> i32 {█\n}\n"
    want = "fn add(a: i32, b: i32) -> i32 {\n    let s = a + b;\n    s\n}\n"
    assert apply(doc, "\n    let s = a + b;\n    s") == want


def test_multiline_never_keeps_first_line():
    assert apply("fn f() {█\n}", "\n    body();", multiline="never") is None
    assert apply("let x = █", "foo()\nbar()", multiline="never") == "let x = foo()"


# -- overlap with the text after the cursor -----------------------------------------------------------------


def test_mid_line_completion_that_rewrites_the_rest_of_the_line_is_cut():
    doc = "fn add(█) -> i32 {\n}\n"
    # not only closers follow: single line; the model wrote the rest of the line again
    assert apply(doc, "a: i32, b: i32) -> i32 {") == "fn add(a: i32, b: i32) -> i32 {\n}\n"


def test_mid_line_tail_overlap_is_cut():
    # the completion ends with the start of what follows the cursor
    assert apply("let x█ = compute(1);", ": u32 = comp") == "let x: u32 = compute(1);"


def test_mid_line_overlap_keeps_single_space():
    assert apply("let x█ = 5;", ": u32 = 5;") == "let x: u32 = 5;"


def test_mid_line_overlap_needs_depth_zero():
    # ")" inside the completion closes its own "(": it is not the ")" that follows the cursor
    text = apply("let y = f(█) + 1;", "g(2)")
    assert text == "let y = f(g(2)) + 1;"


def test_mid_line_whole_rest_repeated_at_start_is_dropped():
    assert apply("let █x = 5;", "x = 5;") is None


# -- auto-closed brackets -----------------------------------------------------------------------------------


def test_closer_written_by_model_replaces_the_auto_closed_one():
    text, offset = cur("    foo(█)\n")
    _, s = run("    foo(█)\n", "a, b);")
    assert s is not None and s.start == offset and s.end == offset + 1  # the range covers ")"
    assert apply("    foo(█)\n", "a, b);") == "    foo(a, b);\n"


def test_closer_not_written_by_model_stays():
    text, offset = cur("foo(█)")
    _, s = run("foo(█)", "a, b")
    assert s == Suggestion("a, b", offset, offset)
    assert apply("foo(█)", "a, b") == "foo(a, b)"


def test_nested_closer_in_completion_is_not_the_auto_closed_one():
    assert apply("foo(█)", "bar(1), 2") == "foo(bar(1), 2)"
    assert apply("foo(█)", "bar(1), 2);") == "foo(bar(1), 2);"


def test_string_and_paren_closers():
    assert apply('println!("█")', 'hello {}", name);') == 'println!("hello {}", name);'
    assert apply('println!("█");', 'hi")') == 'println!("hi");'


def test_partly_closed_keeps_the_rest():
    # the model closed the string but not the call: ")" must survive
    assert apply('println!("█")', 'hello"') == 'println!("hello")'


def test_model_closing_something_else_first_is_cut():
    # after the cursor comes ")", but the model closes a "]" that is not open: cut there
    assert apply("foo(█)", "a]") == "foo(a)"


def test_multiline_completion_closing_the_auto_closed_bracket():
    doc = "let v = vec![█];\n"
    assert apply(doc, "\n    1,\n    2,\n];") == "let v = vec![\n    1,\n    2,\n];\n"


def test_only_retyping_the_closers_is_dropped():
    assert apply("foo(█)", ")") is None
    assert apply('println!("█")', '")') is None
    assert apply('println!("█")', '"') is None


def test_closers_with_semicolon():
    assert apply("    let s = String::from(█);", '"x");') == '    let s = String::from("x");'
    assert apply("    let s = String::from(█);", '"x")') == '    let s = String::from("x");'


def test_generic_closer():
    assert apply("let v: Vec<█> = Vec::new();", "u8") == "let v: Vec<u8> = Vec::new();"


# -- indentation ---------------------------------------------------------------------------------------------


def test_stops_at_line_indented_less_than_block():
    doc = "fn main() {\n    let a = 1;█\n}\n"
    raw = "\n    let b = 2;\n}\n\nfn other() {\n"
    assert apply(doc, raw) == "fn main() {\n    let a = 1;\n    let b = 2;\n}\n"


def test_block_opened_on_cursor_line_ends_with_its_closer():
    doc = "fn main() {\n    if ready {█\n"
    raw = "\n        go();\n    }\n    done();\n}"
    assert apply(doc, raw) == "fn main() {\n    if ready {\n        go();\n    }\n"


def test_whitespace_line_reindented_to_the_lines_indentation():
    doc = "fn main() {\n    █\n}\n"
    # the model wrote from column 0 with 2-space indentation: the line's 4 spaces win
    text, offset = cur(doc)
    _, s = run(doc, "  let x = 1;\n  let y = 2;")
    assert s is not None and s.start == text.index("    ") and s.end == offset
    assert s.text == "    let x = 1;\n    let y = 2;"
    assert apply(doc, "  let x = 1;\n  let y = 2;") == "fn main() {\n    let x = 1;\n    let y = 2;\n}\n"


def test_whitespace_line_cursor_inside_whitespace():
    doc = "fn main() {\n  █  \n}\n"  # cursor in the middle of the line's whitespace
    text, offset = cur(doc)
    _, s = run(doc, "    run();")
    assert s is not None and s.end == text.index("\n}")  # the whole whitespace line is replaced
    assert apply(doc, "    run();") == "fn main() {\n    run();\n}\n"


def test_empty_line_keeps_model_indentation():
    doc = "fn main() {\n█\n}\n"
    assert apply(doc, "    run();") == "fn main() {\n    run();\n}\n"


def test_whitespace_line_skips_leading_blank_lines():
    assert apply("fn main() {\n    █\n}\n", "\n\n    run();") == "fn main() {\n    run();\n}\n"


def test_whitespace_line_block_indent_from_first_line():
    doc = "fn main() {\n    █\n}\n"
    assert apply(doc, "    a();\n    b();\n}\nfn x() {}") == "fn main() {\n    a();\n    b();\n}\n"


def test_tabs():
    doc = "fn main() {\n\t█\n}\n"
    assert apply(doc, "    a();\n    b();") == "fn main() {\n\ta();\n\tb();\n}\n"


# -- not repeating what is there -----------------------------------------------------------------------------


def test_lines_duplicating_the_next_lines_are_cut():
    doc = "fn main() {\n    let a = 1;█\n    let c = 3;\n}\n"
    raw = "\n    let b = 2;\n    let c = 3;\n}"
    assert apply(doc, raw) == "fn main() {\n    let a = 1;\n    let b = 2;\n    let c = 3;\n}\n"


def test_closing_brace_of_next_line_not_repeated():
    doc = "fn main() {█\n}\n"
    assert apply(doc, "\n    run();\n}") == "fn main() {\n    run();\n}\n"


def test_whitespace_line_writing_the_next_line_is_dropped():
    assert apply("fn main() {\n    █\n    run();\n}\n", "    run();") is None


def test_nested_closer_with_other_indent_is_not_a_duplicate():
    doc = "fn main() {█\n}\n"
    raw = "\n    if a {\n        b();\n    }"
    assert apply(doc, raw) == "fn main() {\n    if a {\n        b();\n    }\n}\n"


# -- dropped suggestions -------------------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["", "   ", "\n\n", "\t \n  "])
def test_empty_and_whitespace_dropped(raw):
    assert run("let x = █", raw)[1] is None
    assert run("fn f() {\n    █\n}", raw)[1] is None


@pytest.mark.parametrize("raw", ["xxxxxxxxxxxxxxxx", "))))))))", "a, a, a, a, a, a, ", "ababababab",
                                 " " * 40 + "x" * 8])
def test_self_repeating_dropped(raw):
    assert run("let x = █", raw)[1] is None


def test_repeated_lines_cut_to_one():
    doc = "fn main() {\n    █\n}\n"
    assert apply(doc, "    tick();\n    tick();\n    tick();\n    tick();") == "fn main() {\n    tick();\n}\n"


def test_repeated_block_cut_to_one_period():
    doc = "fn main() {█\n}\n"
    raw = "\n    a();\n    b();\n    a();\n    b();\n    a();\n    b();"
    assert apply(doc, raw) == "fn main() {\n    a();\n    b();\n}\n"


def test_repeating_the_line_above_dropped():
    assert apply("    let total = 0;\n    let █", "total = 0;") is None


def test_real_code_is_not_self_repeating():
    for s in ("let x = 1;", "a + b + c", "vec![0; 16]", "Ok(())", "0x00000000"):
        assert not policy.is_self_repeating(s), s


def test_max_lines():
    doc = "fn main() {█\n}\n"
    raw = "".join(f"\n    step{i}();" for i in range(30))
    _, s = run(doc, raw, max_lines=5)
    assert s is not None and s.text.count("\n") == 4


# -- line endings ---------------------------------------------------------------------------------------------


def test_crlf_document():
    doc = "fn main() {\r\n    let a = 1;█\r\n}\r\n"
    text, offset = cur(doc)
    p = policy.plan(text, offset)
    assert p.cursor.after == "" and p.multiline
    s = policy.postprocess(p, "\n    let b = 2;")
    assert s is not None and s.text == "\r\n    let b = 2;" and s.end == offset


@pytest.mark.parametrize("nl", ["\r", "\r\n"])
def test_a_lone_cr_breaks_lines_as_in_the_editor(nl):
    """LSP (and editors) break lines at "\r\n", "\r" and "\n": a document of lone "\r"s has the cursor context, the
    request and the suggestion of its "\n" twin, with its own line break in the suggestion."""
    twin = "fn main() {\n    let a = 1;\n\n    █\n    run(a);\n}\n"
    raw = "let b = 2;\nif b > a {\n    go();\n}"
    (lf, at), (text, offset) = cur(twin), cur(twin.replace("\n", nl))
    c, want = policy.cursor_at(text, offset), policy.cursor_at(lf, at)
    assert (c.before, c.after, c.indent, c.blank_line, c.next_lines, c.previous_line, c.newline) == (
        want.before, want.after, want.indent, want.blank_line, want.next_lines, want.previous_line, nl)
    assert text[c.line_end:].startswith(nl + "    run(a);")
    p, q = policy.plan(text, offset), policy.plan(lf, at)
    assert (p.prefix, p.suffix, p.multiline, p.stop) == (q.prefix.replace("\n", nl), q.suffix.replace("\n", nl),
                                                         True, [])
    s, t = policy.postprocess(p, raw), policy.postprocess(q, raw)
    assert s is not None and t is not None and t.text.count("\n") == 3
    assert s.text == t.text.replace("\n", nl) and (s.start, s.end) == (c.line_start, c.line_end)
    assert policy.word_before("let a\rlet bc", 12) == 10


def test_cursor_context():
    text, offset = cur("a\n\n  b█c\nd\n")
    c = policy.cursor_at(text, offset)
    assert (c.before, c.after, c.indent, c.blank_line) == ("  b", "c", "  ", False)
    assert c.previous_line == "a" and c.next_lines[:2] == ("d", "")


# -- typed-through and accept-ahead ----------------------------------------------------------------------------


def shown_for(doc: str, raw: str) -> Shown:
    text, offset = cur(doc)
    p = policy.plan(text, offset)
    s = policy.postprocess(p, raw)
    assert s is not None
    return Shown(text, offset, s)


def test_typed_through_answers_with_the_rest():
    shown = shown_for("let x = █", "compute(1);")
    text, offset = cur("let x = comp█")
    s = policy.typed_through(shown, text, offset)
    assert s is not None
    assert text[: s.start] + s.text + text[s.end :] == "let x = compute(1);"
    assert s.text.startswith(text[s.start : offset])


def test_typed_through_with_closer_range():
    shown = shown_for("    foo(█)\n", "a, b);")
    text, offset = cur("    foo(a,█)\n")
    s = policy.typed_through(shown, text, offset)
    assert s is not None and text[: s.start] + s.text + text[s.end :] == "    foo(a, b);\n"


def test_typed_through_on_whitespace_line():
    shown = shown_for("fn main() {\n    █\n}\n", "    run();")
    text, offset = cur("fn main() {\n    ru█\n}\n")
    s = policy.typed_through(shown, text, offset)
    assert s is not None and text[: s.start] + s.text + text[s.end :] == "fn main() {\n    run();\n}\n"


@pytest.mark.parametrize("typed", ["let x = cx█", "let x = █", "let y = comp█", "let x = compute(1);█"])
def test_typed_through_misses(typed):
    shown = shown_for("let x = █", "compute(1);")
    text, offset = cur(typed)
    assert policy.typed_through(shown, text, offset) is None


def test_typed_through_needs_the_rest_of_the_document_unchanged():
    shown = shown_for("let x = █\nfoo();", "compute(1);")
    text, offset = cur("let x = co█\nbar();")
    assert policy.typed_through(shown, text, offset) is None


def test_typed_through_keeps_the_alternatives_the_typed_text_agrees_with():
    text, offset = cur("let x = █")
    p = policy.plan(text, offset)
    first, *others = (policy.postprocess(p, raw) for raw in ("compute(1);", "compare(a, b);", "clone();", "x;"))
    shown = Shown(text, offset, first, alternatives=tuple(others))
    text, offset = cur("let x = comp█")
    kept = policy.typed_through_alternatives(shown, text, offset)
    assert [text[: s.start] + s.text + text[s.end :] for s in kept] == ["let x = compare(a, b);"]
    assert all(s.text.startswith(text[s.start : offset]) for s in kept)
    assert policy.typed_through_alternatives(shown, *cur("let x = compu█")) == []


def test_accepted_state():
    shown = shown_for("    foo(█)\n", "a, b);")
    text, offset = policy.accepted_state(shown)
    assert text == "    foo(a, b);\n" and text[:offset] == "    foo(a, b);"


def test_word_before():
    text = "let value = some_fn"
    assert policy.word_before(text, len(text)) == text.index("some_fn")
    assert policy.word_before("x = (", 5) == 5
    assert policy.word_before("a\nbc", 4) == 2


def test_confident_compares_the_first_lines_probability_with_the_floor():
    import math

    assert policy.confident(math.log(0.2), 0.1) and not policy.confident(math.log(0.05), 0.1)
    assert policy.confident(math.log(0.1), 0.1)  # at the floor: shown
    assert policy.confident(-50.0, 0) and policy.confident(None, 0.9)  # off; an answer without the figure
    assert not policy.confident(-0.01, 1.0) and policy.confident(0.0, 1.0)


def test_confident_lines_cuts_where_the_lines_so_far_fall_under_the_floor():
    """The lines are kept while the probability of all of them so far stays at or above the floor; the first line is
    always kept (the gate above decides it); lines beyond the figures (an older daemon's answer) are kept."""
    from math import log as lp

    raw = "if x {\n    y();\n    z();\n}"
    assert policy.confident_lines(raw, [lp(0.5), lp(0.5), lp(0.5), lp(1.0)], 0.2) == "if x {\n    y();"
    assert policy.confident_lines(raw, [lp(0.5), lp(0.5), lp(0.8), lp(1.0)], 0.2) == raw  # 0.2 itself is kept
    assert policy.confident_lines(raw, [lp(0.5), lp(0.1)], 0.2) == "if x {"
    assert policy.confident_lines(raw, [lp(0.01), lp(1.0)], 0.2) == "if x {"  # under the floor at once: one line
    assert policy.confident_lines(raw, [lp(0.5), lp(0.1)], 0) == raw  # the floor off
    assert policy.confident_lines(raw, [lp(0.5)], 0.2) == raw and policy.confident_lines(raw, [], 0.2) == raw
    assert policy.confident_lines("a\n", [lp(0.5), lp(0.1)], 0.2) == "a"  # the empty line after a break is a line
    assert policy.confident_lines("a", [lp(0.5), lp(0.01), lp(0.01)], 0.2) == "a"  # more figures than lines

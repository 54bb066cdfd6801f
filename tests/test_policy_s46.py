"""What the editor shows at a cursor before a line's code (only its indentation before it) with closers after it, the
cursor of `eval_fim.py`'s multi-line tasks: the lines the completion inserts are whole lines, so the closers keep their
own line. Joined, accepting left `body();    }` (21 of the 22 multi-line suggestions that evaluation showed).

Documents mark the cursor with █.
"""

from __future__ import annotations

import math

import pytest

from m31r_lsp.completion import shown_suggestion
from m31r_protocol import policy
from m31r_protocol.policy import Options


def cur(doc: str) -> tuple[str, int]:
    i = doc.index("█")
    return doc[:i] + doc[i + 1 :], i


def accept(text: str, s: policy.Suggestion | None) -> str | None:
    return None if s is None else text[: s.start] + s.text + text[s.end :]


def apply(doc: str, raw: str, **opts) -> str | None:
    """The document once the suggestion is accepted, or None when nothing shows."""
    text, offset = cur(doc)
    return accept(text, policy.postprocess(policy.plan(text, offset, Options(**opts)), raw))


@pytest.mark.parametrize("doc, raw, want", [
    # the cursor at column 0 of the closer's line: the model writes the body's indentation itself
    ("fn f() {\n    if x {\n█        }\n}\n", "            body();\n",
     "fn f() {\n    if x {\n            body();\n        }\n}\n"),
    # the cursor after the closer's indentation, which its line keeps
    ("    if x {\n    █}\n", "    body();\n", "    if x {\n        body();\n    }\n"),
    ("fn f() {\n    g(\n█    );\n}\n", "        a,\n", "fn f() {\n    g(\n        a,\n    );\n}\n"),
    ("fn f() {\r\n█}\r\n", "    body();\n", "fn f() {\r\n    body();\r\n}\r\n"),
])
def test_a_whole_line_before_the_closers_leaves_them_on_their_own_line(doc, raw, want):
    assert apply(doc, raw) == want


def test_a_line_cut_by_the_policy_before_the_closers_leaves_them_on_their_own_line():
    """max_lines cuts after a line the model ended: that line is whole too."""
    assert apply("fn f() {\n█}\n", "    a();\n    b();\n", max_lines=1) == "fn f() {\n    a();\n}\n"


@pytest.mark.parametrize("doc, raw, want", [
    ("foo(█)\n", "a,\n", "foo(a,)\n"),  # mid-line: a one-line answer's break is its end, not a layout
    ("fn f() {█}\n", "\n    a();\n    b();\n", "fn f() {\n    a();\n    b();\n}\n"),
    ("fn f() {\n    █}\n", "body();", "fn f() {\n    body();}\n"),  # no break: cut short, the user goes on typing
])
def test_elsewhere_the_closers_stay_as_before(doc, raw, want):
    assert apply(doc, raw) == want


def lp(p: float) -> float:
    return math.log(p)


@pytest.mark.parametrize("doc, raw, by_line, want", [
    ("fn f() {\n█}\n", "    a();\n    b();\n", [lp(0.9), lp(0.01), lp(0.9)], "fn f() {\n    a();\n}\n"),
    # the floor falls at the answer's end (the "" after its break): the break still ends the line
    ("fn f() {\n█}\n", "    a();\n", [lp(0.5), lp(0.01)], "fn f() {\n    a();\n}\n"),
])
def test_lines_cut_at_the_floor_before_the_closers_leave_them_on_their_own_line(doc, raw, by_line, want):
    """The language server's own post-processing (shown_suggestion): cut to its confident lines, the last line kept
    lost the break that ended it, and the closers joined it."""
    text, offset = cur(doc)
    plan = policy.plan(text, offset)
    s, why = shown_suggestion(plan, raw, by_line[0], by_line, policy.MIN_PROBABILITY)
    assert why == "" and accept(text, s) == want


def test_lines_cut_at_the_floor_mid_line_are_unchanged():
    """After `{` on the cursor's line a cut answer is still one the user goes on typing (test_policy_s43)."""
    text, offset = cur("fn f() {█}\n")
    raw, by_line = "\n    a();\n    b();\n", [lp(0.9), lp(0.9), lp(0.01), lp(0.9)]
    s, _ = shown_suggestion(policy.plan(text, offset), raw, by_line[0], by_line, policy.MIN_PROBABILITY)
    assert accept(text, s) == "fn f() {\n    a();}\n"

"""Typed-through across a bracket the editor auto-closes when the suggestion's rest does not write that closer: a
line's first part (`ffi_dispatch!(A, b,` on a blank line; `assert_eq!(P`). Typing its `(` made `(|)`, and the
suggestion was dropped for a new request that showed something else or nothing (flicker in
`benchmarks/sim_typing.py --data`, held-out crate code)."""

from __future__ import annotations

import pytest

from m31r_protocol import policy
from m31r_protocol.policy import Shown, Suggestion


def cur(doc: str) -> tuple[str, int]:
    """Cursor marked with █."""
    i = doc.index("█")
    return doc[:i] + doc[i + 1 :], i


def shown_for(doc: str, raw: str) -> Shown:
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), raw)
    assert s is not None
    return Shown(text, offset, s)


def accept(text: str, s: Suggestion) -> str:
    return text[: s.start] + s.text + text[s.end :]


BODY = "fn drop(&mut self) {\n    unsafe {\n            █\n        }\n    }\n}\n"
LINE = "            ffi_dispatch!(WAYLAND_SERVER_HANDLE, wl_client_destroy,"


@pytest.mark.parametrize("doc, raw, typed, want", [
    # A whole line shown on a blank line, cut before its call's `)`: the rest goes before the auto-closed `)`.
    (BODY, LINE, BODY.replace("█", "ffi_dispatch!(█)"),
     BODY.replace("█", "ffi_dispatch!(WAYLAND_SERVER_HANDLE, wl_client_destroy,)")),
    (BODY, LINE, BODY.replace("█", "ffi_dispatch!(WAY█)"),
     BODY.replace("█", "ffi_dispatch!(WAYLAND_SERVER_HANDLE, wl_client_destroy,)")),
    ("fn t() {\n        █\n}\n", "        assert_eq!(P", "fn t() {\n        assert_eq!(█)\n}\n",
     "fn t() {\n        assert_eq!(P)\n}\n"),
    # An auto-closed quote and bracket, neither written by the rest.
    ("fn main() {\n    █\n}\n", "    println!(\"hello", "fn main() {\n    println!(\"█\")\n}\n",
     "fn main() {\n    println!(\"hello\")\n}\n"),
    # Two auto-closed `)`: the rest writes the inner one again and leaves the outer one after it.
    ("let x = █;\n", "f(g(a)", "let x = f(g(█));\n", "let x = f(g(a));\n"),
])
def test_typed_through_keeps_the_auto_closed_closers_the_rest_does_not_write(doc, raw, typed, want):
    shown = shown_for(doc, raw)
    text, offset = cur(typed)
    s = policy.typed_through(shown, text, offset)
    assert s is not None
    assert s.start <= offset <= s.end and s.text.startswith(text[s.start : offset])
    assert accept(text, s) == want
    # What the model answering that rest at this cursor shows: the same suggestion, no flicker.
    asked = policy.postprocess(policy.plan(text, offset), policy.predicted(shown)[offset - shown.offset :])
    assert asked is not None and accept(text, asked) == want


def test_the_runners_up_survive_the_auto_closed_bracket_too():
    text, offset = cur(BODY)
    p = policy.plan(text, offset)
    first = policy.postprocess(p, LINE)
    other = policy.postprocess(p, "            ffi_dispatch!(WAYLAND_SERVER_HANDLE, wl_client_get_fd,")
    gone = policy.postprocess(p, "            drop(x);")
    assert first is not None and other is not None and gone is not None
    shown = Shown(text, offset, first, alternatives=(other, gone))
    typed, at = cur(BODY.replace("█", "ffi_dispatch!(█)"))
    assert [accept(typed, s) for s in policy.typed_through_alternatives(shown, typed, at)] == [
        BODY.replace("█", "ffi_dispatch!(WAYLAND_SERVER_HANDLE, wl_client_get_fd,)")]


@pytest.mark.parametrize("doc, raw, typed", [
    # The shown one replaced the `)` after its cursor and its rest no longer writes it: accepting would delete it.
    ("foo(█)", "a) + b", "foo(a█))"),
    # Something other than closers was inserted after the cursor.
    ("let x = █;\n", "f(g(a)", "let x = f(g(█)x);\n"),
    # The typed text leaves what was shown.
    (BODY, LINE, BODY.replace("█", "ffi_dispatch![█]")),
])
def test_typed_through_still_misses(doc, raw, typed):
    assert policy.typed_through(shown_for(doc, raw), *cur(typed)) is None

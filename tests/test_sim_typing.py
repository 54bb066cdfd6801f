"""What benchmarks/sim_typing.py found, a user typing the held-out exec problems through `m31r lsp`, and its smoke test.

- typed-through was lost at every bracket: the editor's auto-closed `)` after a typed `(`, or a typed `)` overtyping
  one, made the text no longer the shown text plus what was typed, so the model was asked again (and often showed
  something else, or nothing);
- a multi-line suggestion stopped before the line closing the cursor's block, where the document has no closer yet:
  `return true;|` showed nothing, `xs.swap(j, j |)` left the `}` to type.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from m31r_protocol import policy
from m31r_protocol.policy import Options, Shown, Suggestion

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import sim_typing  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def cur(doc: str) -> tuple[str, int]:
    i = doc.index("█")
    return doc.replace("█", ""), i


def shown_at(doc: str, raw: str, **opts) -> Shown:
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset, Options(**opts)), raw)
    assert s is not None
    return Shown(text, offset, s)


def accepted(text: str, s: Suggestion) -> str:
    return text[: s.start] + s.text + text[s.end :]


# -- typed-through with the editor's bracket pairs -------------------------------------------------------------


def test_typed_through_survives_an_auto_closed_bracket():
    """`split_whitespace|` shows `().collect()`; the user types `(` and the editor makes it `(|)`: the rest,
    `).collect()`, is still the suggestion (over the auto-closed `)`), and accepting it gives the same line."""
    sh = shown_at("fn f(s: &str) {\n    s.split_whitespace█\n}\n", "().collect()")
    text = sh.text[: sh.offset] + "()" + sh.text[sh.offset :]
    hit = policy.typed_through(sh, text, sh.offset + 1)
    assert hit is not None
    assert accepted(text, hit) == accepted(sh.text, sh.suggestion)
    assert hit.text[sh.offset + 1 - hit.start :] == ").collect()"


def test_typed_through_survives_an_overtyped_closer():
    """`p.parse().ok()|)` shows `).unwrap_or(0)` over the `)`; the user types `)`, which the editor overtypes (the text
    does not change, the cursor moves): `.unwrap_or(0)` is still shown."""
    sh = shown_at("fn f() {\n    x.and_then(|p| p.parse().ok()█)\n}\n", ").unwrap_or(0)")
    assert sh.suggestion.end == sh.offset + 1  # (it writes the `)` itself)
    hit = policy.typed_through(sh, sh.text, sh.offset + 1)
    assert hit is not None
    assert accepted(sh.text, hit) == accepted(sh.text, sh.suggestion)
    assert hit.text[sh.offset + 1 - hit.start :] == ".unwrap_or(0)"


def test_typed_through_still_refuses_a_changed_document():
    """Only the closers after the cursor may differ: text the user changed elsewhere ends it, and so does a closer the
    suggestion would delete."""
    sh = shown_at("fn f() {\n    g(█)\n}\n", "a, b)")
    edited = sh.text.replace("fn f()", "fn h()")
    assert policy.typed_through(sh, edited[: sh.offset] + "a" + edited[sh.offset :], sh.offset + 1) is None
    # `a` typed, and something other than a closer after the cursor
    text = sh.text[: sh.offset] + "a;" + sh.text[sh.offset :]
    assert policy.typed_through(sh, text, sh.offset + 1) is None


# -- the line closing the cursor's block ------------------------------------------------------------------------


def test_the_blocks_closer_is_kept_where_the_document_has_none():
    doc = "fn f(xs: &[i32]) -> bool {\n    for x in xs {\n        if *x == 0 {\n            return true;█\n    }\n"
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), "\n        }\n    }\n    false")
    assert s is not None and s.text == "\n        }"


def test_the_closer_continuing_the_structure_is_kept():
    doc = "fn f(x: i32) -> i32 {\n    if x > 0 {\n        x█\n}\n"
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), "\n    } else {\n        -x\n    }")
    assert s is not None and s.text == "\n    } else {"


@pytest.mark.parametrize("after", ["        }\n", "        } else {\n            b();\n        }\n",
                                   "        c();\n        }\n"])
def test_no_second_closer_where_the_document_has_one(after):
    """The editor auto-closed the block (`}` next), the block goes on (`c();`), or the document's closer continues it
    (`} else {`): the model's `}` would close it twice."""
    doc = "fn f() {\n    loop {\n        if a {\n            b();█\n" + after + "    }\n}\n"
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), "\n        }\n        d();")
    assert s is None


def test_a_closer_two_levels_out_is_not_kept():
    doc = "fn f() {\n    loop {\n        if a {\n            b();█\n"
    text, offset = cur(doc)
    s = policy.postprocess(policy.plan(text, offset), "\n    }\n}")
    assert s is None


# -- the benchmark's own rules ----------------------------------------------------------------------------------


def target(body: str) -> sim_typing.Target:
    return sim_typing.Target("t", "fn f() {\n", body, "\n}\n", sim_typing.autoclose_map(body))


def test_autoclose_map_pairs_code_brackets_on_one_line_only():
    t = target('    g(a, "(x", \'(\', [1]);\n    if a {\n        b();\n    }')
    opened = {t.body[i] for i in t.autoclose}
    assert opened == {"(", '"', "["}
    assert t.body.index("{") not in t.autoclose  # its `}` is lines below
    assert t.body.index("(x") + 0 not in t.autoclose  # in a string
    assert t.body.index("'(") + 1 not in t.autoclose  # a char literal


def test_accept_refuses_a_duplicate_closer_and_takes_a_right_one():
    t = target("    g(a(b));")
    st = sim_typing.State(t, len("    g(a("), "))")
    text = st.text()
    assert sim_typing.accept(st, Suggestion("b));", st.cursor, st.cursor)) is None  # `b)));`: one `)` too many
    ok = sim_typing.accept(st, Suggestion("b));", st.cursor, st.cursor + 2))
    assert ok is not None and ok.i == len(t.body) and ok.pending == "" and ok.text() == text.replace("))", "b));")
    part = sim_typing.accept(st, Suggestion("b", st.cursor, st.cursor))
    assert part is not None and part.pending == "))"


def test_the_benchmark_types_a_problem_through_a_real_session(tiny_bundle, tmp_path, capsys):
    """Smoke test on the tiny random bundle (no floor: it is sure of nothing): a real daemon and `m31r lsp`, every
    character of one problem typed, the scores consistent with the events."""
    out = tmp_path / "sim.json"
    rc = sim_typing.main(["--bundle", str(tiny_bundle.path), "--subset", "1", "--min-probability", "0",
                          "--max-tokens", "8", "--threads", "1", "--out", str(out), "--quiet"])
    assert rc == 0
    res = json.loads(out.read_text())
    sc, events = res["scores"], res["events"]
    assert sc["problems"] == 1 and sc["requests"] == len(events) > 0
    tg = sim_typing.targets(1)[0]
    assert events[-1]["i"] == len(tg.body)  # typed to the end
    assert sc["shown"] == sum(1 for e in events if e["shown"]) and sc["accepts"] + sc["wrong_shows"] == sc["shown"]
    assert sc["daemon_requests"] > 0 and res["meta"]["cpu_flags"] is not None
    assert '"scores"' in capsys.readouterr().out

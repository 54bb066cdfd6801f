"""Session 47: the daemon says which stop ended a completion (Done.stopped_by, Done.stop_sequence), and the editors'
policy reads from a line break there that the model ended its line.

A line asked for at a cursor before a line's code (`█    } else {`, the cursor at a line's head with code after
it) is a single-line request: its "\\n" stop holds back the break the model ended its line with, so the editor could
not tell "None" (a whole line, to go above the code) from "None" (to be joined to it), and showed
`                None            } else {`. Three of the 50 multi-line eval tasks were shown so.
"""

from __future__ import annotations

import pytest

from m31r.stops import StopMatcher, first_hit, first_stop
from m31r_lsp.completion import shown_suggestion
from m31r_protocol import messages as m
from m31r_protocol import policy
from m31r_protocol.client import Client
from m31rd.server import Typed, clip, typed_through

pytestmark = pytest.mark.timeout(60)


def test_the_matcher_names_the_stop_that_ended_the_text() -> None:
    sm = StopMatcher(["\n", "}\n\n"])
    assert sm.feed("a}") == ("a", False) and sm.matched is None  # "}" could begin the second one: held
    assert sm.feed("\n\nb") == ("}", True) and sm.matched == "\n"  # "\n" ends first
    assert first_hit("x}\n", ["\n", "}\n"]) == (1, "}\n")  # of two ending at once, the longer
    assert first_stop("x}\n", ["\n", "}\n"]) == 1
    start = StopMatcher(["\n    }\n"], start_stops=["    }\n"])
    assert start.feed("    }") == ("", False) and start.feed("\n") == ("", True) and start.matched == "    }\n"
    # A line repeating the line above ends the text before it: no sequence ended it, whatever matched with it.
    rep = StopMatcher(["X"], repeat_context="    let a = 1;\n")
    text, hit = rep.feed("    let a = 1;\nX")
    assert (text, hit) == ("", True) and rep.repeated and rep.matched is None, rep.matched


def test_a_line_ended_by_a_stop_is_checked_for_repeats() -> None:
    """A stop beginning with a line break ends the completion's line: the repeated-line stop sees that line whole.
    A single-line request (stop "\n") wrote the line above again (`Color::Green => "green",` under itself), since its
    line end never reached the repeat check."""
    above = '        Color::Green => "green",\n        '
    sm = StopMatcher(["\n"], repeat_context=above)
    assert sm.feed('Color::Green => "green",\nx') == ("", True) and sm.repeated and sm.matched is None
    sm = StopMatcher(["\n"], repeat_context=above)
    assert sm.feed('Color::Blue => "blue",\nx') == ('Color::Blue => "blue",', True)
    assert not sm.repeated and sm.matched == "\n"
    # The daemon's own stop at the suffix's next line, as a multi-line Fim's.
    sm = StopMatcher(["\n    }\n"], repeat_context="    a();\n")
    assert sm.feed("    a();\n    }\n") == ("", True) and sm.repeated
    sm = StopMatcher(["\n    }\n"], repeat_context="    a();\n")
    assert sm.feed("    b();\n    }\n") == ("    b();", True) and sm.matched == "\n    }\n"


def at(doc: str) -> tuple[str, int]:
    return doc.replace("█", ""), doc.index("█")


ELSE = "fn f(x: Option<u8>) -> Option<u8> {\n    if x.is_some() {\n        x\n█    } else {\n        None\n    }\n}\n"


def test_a_line_the_model_ended_goes_above_the_code_after_the_cursor() -> None:
    text, offset = at(ELSE)
    p = policy.plan(text, offset)
    assert not p.multiline and p.stop == ["\n"]  # code after the cursor: a line task
    sug = policy.postprocess(p, "        let y = x?;", ended_line=True)
    assert sug is not None
    assert text[: sug.start] + sug.text + text[sug.end :] == ELSE.replace("█", "        let y = x?;\n")
    # Not ended by the model (its budget ran out mid-line): the text goes on the cursor's line, as before.
    glued = policy.postprocess(p, "        let y = x?;")
    assert glued is not None and "\n" not in glued.text
    # A raw answer that holds its own break says the same as ended_line.
    assert policy.postprocess(p, "        let y = x?;\n") == sug


def test_the_runners_up_end_their_lines_as_the_answer_did() -> None:
    """A beam search's runners-up at the same cursor (the daemon searches only completions a line end stops) go
    above the code as the answer does, so cycling to one does not join it to `    } else {`."""
    text, offset = at(ELSE)
    p = policy.plan(text, offset)
    first = policy.postprocess(p, "        let y = x?;", ended_line=True)
    others = policy.alternatives(p, first, ["        let y = x.unwrap();"], ended_line=True)
    assert [o.text for o in others] == ["        let y = x.unwrap();\n"]


def test_inside_the_indentation_the_code_keeps_its_own() -> None:
    doc = "fn f() {\n  █  let b = 2;\n}\n"
    text, offset = at(doc)
    p = policy.plan(text, offset)
    sug = policy.postprocess(p, "  let a = 1;", ended_line=True)
    assert sug is not None
    assert text[: sug.start] + sug.text + text[sug.end :] == "fn f() {\n    let a = 1;\n    let b = 2;\n}\n"


def test_a_line_that_writes_the_code_after_again_shows_nothing() -> None:
    text, offset = at(ELSE)
    assert policy.postprocess(policy.plan(text, offset), "    } else {", ended_line=True) is None


def test_mid_line_a_stop_at_a_break_changes_nothing() -> None:
    """Not at a line's head the text continues the cursor's line: the break the model ended it with is the
    document's own."""
    doc = "fn f() {\n    let a = █;\n}\n"
    text, offset = at(doc)
    p = policy.plan(text, offset)
    assert policy.postprocess(p, "1", ended_line=True) == policy.postprocess(p, "1")


def test_the_language_server_reads_the_stop_from_done() -> None:
    text, offset = at(ELSE)
    p = policy.plan(text, offset)
    shown, why = shown_suggestion(p, "        let y = x?;", -0.1, [-0.1], 0.05, stop_sequence="\n")
    assert why == "" and shown is not None and shown.text.endswith("x?;\n")
    # The daemon's own stop at the suffix's line ("\n    } else {\n") ends a line too.
    assert policy.ended_by_line_break("\n    } else {\n") and not policy.ended_by_line_break("    }\n")
    assert not policy.ended_by_line_break(None) and not policy.ended_by_line_break(";")
    old, _ = shown_suggestion(p, "        let y = x?;", -0.1, [-0.1], 0.05)  # an older daemon: no stop_sequence
    assert old is not None and "\n" not in old.text
    # Lines the floor cut end where the floor cut them, not where the model ended: the break comes from whole_lines.
    multi = policy.plan(*at("fn f() {\n    █\n}\n"))
    cut, _ = shown_suggestion(multi, "a();\nb();", -0.1, [-0.1, -9.0], 0.05, stop_sequence="\n}\n")
    assert cut is not None and "b()" not in cut.text


def test_typed_through_answers_keep_or_name_their_stop() -> None:
    last = Typed("let x = ", "", "foo.bar()", "stop", (3, 4, 7, 9), stopped_by="sequence", stop_sequence="\n",
                 stops=("\n",), max_tokens=8)
    rest = typed_through(last, m.Fim(id=1, prefix="let x = fo", suffix=""))
    assert rest is not None
    assert clip(rest, 8, ["\n"]) == ("o.bar()", "stop", "sequence", "\n")  # the earlier answer's own end
    assert clip(rest, 8, ["\n", "("]) == ("o.bar", "stop", "sequence", "(")  # this request's stop cut it sooner
    assert clip(rest, 2, ["\n"]) == ("o.", "length", None, None)


async def test_the_daemon_says_which_stop_ended_a_completion(shared_daemon) -> None:
    sock = shared_daemon[1]
    async with await Client.connect(sock, client="s47-stops") as c:
        free = await c.generate("fn main() {\n", max_tokens=24, lookahead=0)
        text = "".join([t.text async for t in free])
        assert free.done is not None and free.done.finish_reason == "length"
        assert free.done.stopped_by is None and free.done.stop_sequence is None
        # A stop taken from the middle of that text: the same greedy answer ends there, and Done names it.
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop, text
        cut = await c.generate("fn main() {\n", max_tokens=24, lookahead=0, stop=["\u2603never", stop])
        got = "".join([t.text async for t in cut])
        assert got == text[: text.index(stop)]
        assert cut.done is not None and cut.done.finish_reason == "stop"
        assert (cut.done.stopped_by, cut.done.stop_sequence) == ("sequence", stop)
        # A document's typed-through answer (no model call) that this request's stop cuts names that stop. (The tiny
        # model answers this one with one character over and over.)
        prefix, suffix = "fn main() {\n    let x = 1;\n    ", "\n}\n"
        first = await c.fim(prefix, suffix, document="s47://stops.rs", max_tokens=40, lookahead=0, beams=1)
        whole = "".join([t.text async for t in first])
        assert first.done is not None and first.done.finish_reason == "length" and len(whole) > 8, whole
        stop = whole[1:4]
        typed = await c.fim(prefix + whole[0], suffix, document="s47://stops.rs", max_tokens=40, lookahead=0,
                            beams=1, stop=["\u2603", stop])
        rest = "".join([t.text async for t in typed])
        assert typed.done is not None and typed.done.source == "typed_through", typed.done
        assert rest == whole[1 : 1 + whole[1:].index(stop)]
        assert (typed.done.finish_reason, typed.done.stopped_by, typed.done.stop_sequence) == ("stop", "sequence", stop)


def test_the_cli_and_http_answers_carry_them(shared_daemon, tmp_path) -> None:
    """`m31r generate --json` and the HTTP adapter's /generate pass Done's stopped_by and stop_sequence on."""
    import json
    import os
    import subprocess
    import sys

    import httpx
    from test_http import Server

    sock = shared_daemon[1]
    r = subprocess.run([sys.executable, "-m", "m31r.cli", "generate", "fn main() {\n", "--json", "--max-tokens", "24",
                        "--socket", str(sock)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, r.stderr
    free = json.loads(r.stdout)
    assert (free["finish_reason"], free["stopped_by"], free["stop_sequence"]) == ("length", None, None)
    stop = free["text"][len(free["text"]) // 2 :][:2]
    server = Server(tmp_path, sock)
    try:
        server.wait_healthy()
        with httpx.Client(base_url=server.url, timeout=60) as http:
            got = http.post("/generate", json={"prompt": "fn main() {\n", "max_tokens": 24, "stop": [stop]}).json()
    finally:
        server.stop()
    assert got["text"] == free["text"][: free["text"].index(stop)]
    assert (got["finish_reason"], got["stopped_by"], got["stop_sequence"]) == ("stop", "sequence", stop), got

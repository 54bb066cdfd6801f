"""Suggestions at a cursor inside a word (session 48): `let tot█al = 1;`, `for word in te█xt.split_whitespace() {`.

The daemon heals the word (takes its start off the prompt, the model writes it again unstreamed), and the model then
nearly always writes the word's rest too: "al = 10;". Shown at the cursor, that doubled the rest and left the line's
old code behind it (`let total = 10;al = 1;`, `fn count_words(text: &str) -> usize {unt_words(text: &str) -> ...`):
every suggestion the bundled model showed at a mid-word cursor of this file was such a line. The policy now reads an
answer that writes the rest again as what follows the word (its range over the rest), shows nothing where it then
rewrites the code after the word, and nothing for an answer that splits the word (`co█unts` answered "mment").

A real `m31r lsp` against a real daemon serving the bundled model (fp32, as the tests run it), and the policy itself.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
from lsp_stdio import URI, Stdio

from m31r_lsp.documents import offset_at, position_at
from m31r_protocol import policy

pytestmark = pytest.mark.timeout(120)

TEXT = """use std::collections::HashMap;

fn count_words(text: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    for word in text.split_whitespace() {
        *counts.entry(word.to_string()).or_insert(0) += 1;
    }
    counts
}

fn main() {
    let v = vec![1, 2];
    let n = v.len
    let total = 1;
    println!("{:?} {}", count_words("a b a"), total + n);
}
"""
# Cursors inside words: (the text before the cursor on its line, ending in the word's start). The bundled model writes
# the word's rest again at each but the last, then other code than the line has (the first five) or nothing new.
CURSORS = ["fn co", "fn count_words(te", "    for wo", "        *counts.en", "        *counts.entry(wo",
           "    let to", "    let n = v.le", "        *co"]


def at(before: str) -> int:
    return TEXT.index("\n" + before) + 1 + len(before)


def accepted(text: str, item: dict) -> str:
    r = item["range"]
    a, b = (offset_at(text, p["line"], p["character"], "utf-16") for p in (r["start"], r["end"]))
    return text[:a] + item["insertText"] + text[b:]


async def session(sock: Path, texts: dict[str, str]) -> Stdio:
    s = await Stdio.spawn(sock)
    settings = {"socket": str(sock), "minProbability": 0, "debounceMode": "fixed", "debounceMs": 0}
    await s.request("initialize", {"processId": None, "capabilities": {}, "initializationOptions": {"m31r": settings}})
    s.send("initialized", {})
    for uri, text in texts.items():
        s.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "rust", "version": 1, "text": text}})
    return s


async def inline(s: Stdio, uri: str, text: str, offset: int, selected: tuple[int, str] | None = None) -> list[dict]:
    line, ch = position_at(text, offset, "utf-16")
    context: dict = {"triggerKind": 1}
    if selected is not None:  # (where the menu item's range starts, its text): the range ends at the cursor
        l0, c0 = position_at(text, selected[0], "utf-16")
        context["selectedCompletionInfo"] = {"text": selected[1], "range": {
            "start": {"line": l0, "character": c0}, "end": {"line": line, "character": ch}}}
    answer = await s.request("textDocument/inlineCompletion", {
        "textDocument": {"uri": uri}, "position": {"line": line, "character": ch}, "context": context}, timeout=60)
    return answer["result"]["items"]


def test_the_server_never_splits_or_doubles_the_word_at_the_cursor(release_daemon) -> None:
    """At each mid-word cursor every item shown keeps the word whole: it writes the word's rest over itself and then
    only what follows the word, the line's code after the word left as it was. The server shows what the policy makes
    of the daemon's answer; at most cursors the model wrote the rest again (the case that was shown doubled)."""
    async def run() -> tuple[int, int]:
        s = await session(release_daemon, {URI: TEXT})
        rewrote = shown = 0
        for before in CURSORS:
            offset = at(before)
            cur = policy.cursor_at(TEXT, offset)
            rest = policy.word_rest(cur)
            assert rest and rest == re.match(r"\w+", cur.after).group()
            items = await inline(s, URI, TEXT, offset)
            stats = (await s.request("m31r/stats", {}))["result"]
            raw = stats["lastRaw"]
            rewrote += raw.startswith(rest)
            want = policy.postprocess(policy.plan(TEXT, offset), raw)
            assert [(i["insertText"], i["range"]["end"]["character"]) for i in items[:1]] == (
                [] if want is None else [(want.text, position_at(TEXT, want.end, "utf-16")[1])]), before
            for item in items:  # the suggestion and the beam search's runners-up
                shown += 1
                line = accepted(TEXT, item).splitlines()[TEXT.count("\n", 0, offset)]
                assert line.startswith(cur.before + rest) and item["insertText"].startswith(rest), (before, item)
                assert line.endswith(cur.after[len(rest):]), (before, item)
        assert await s.end() == (0, "")
        return rewrote, shown

    rewrote, shown = asyncio.run(run())
    assert rewrote >= 5  # the model wrote the rest again (before: shown doubled at each)
    assert shown >= 1  # `v.le█n` (the line's end after the word): "n" and what follows it


def test_the_selected_menu_item_that_leaves_a_word_rest_is_not_split(release_daemon) -> None:
    """`use std::collections::Hash█Se;` with `HashSet` selected (inserted, not replacing): the text it completes is
    `HashSet█Se;`, a cursor inside a word; the model answered ";" and the item showed `HashSet;Se;`."""
    text = "use std::collections::HashSe;\n"
    cursor = text.index("Se;")

    async def run() -> list[dict]:
        s = await session(release_daemon, {URI: text})
        items = await inline(s, URI, text, cursor, selected=(cursor - len("Hash"), "HashSet"))
        raw = (await s.request("m31r/stats", {}))["result"]["lastRaw"]
        assert not raw.startswith("Se"), raw  # (the answer that was shown: it does not write the rest)
        assert await s.end() == (0, "")
        return items

    assert asyncio.run(run()) == []


def _plan(line: str, after: str, below: str = "\n}\n") -> policy.Plan:
    text = "fn main() {\n" + line + after + below
    return policy.plan(text, len("fn main() {\n" + line))


def _accepted(p: policy.Plan, s: policy.Suggestion | None) -> str | None:
    text = p.prefix + p.suffix
    return None if s is None else (text[: s.start] + s.text + text[s.end :]).splitlines()[1]


@pytest.mark.parametrize("line, after, raw, want", [
    ("    let tot", "al = 1;", "al = 10;", None),  # a rewrite of the line: shown, it left `total = 10;al = 1;`
    ("    let tot", "al = 1;", "al = 1;", None),  # nothing new
    ("    let tot", "al = 1;", "al_sum = 1;", "    let total_sum = 1;"),  # the word made longer, the code kept
    ("    let co", "unts = 1;", "mment", None),  # splits the word: `commentunts`
    ("    let n = v.le", "n", "n();", "    let n = v.len();"),  # shown after the word, over its rest
    ("    let n = v.le", "n", "n", None),
    ("    f(v.le", "n)", "n())", "    f(v.len())"),  # the closers after the word, as at its end
    ("    let n = v.le", "n;", "n() + 1;", "    let n = v.len() + 1;"),
    ("    let s = caf", "é;", "é.to_string();", "    let s = café.to_string();"),  # a word of any letters
    ("    let s = caf", "é + 1;", "é * 2;", None),
    ("    let s = caf", "é", "é.len()", "    let s = café.len()"),
    ("    x.le", "n\t", "n()", "    x.len()\t"),
])
def test_postprocess_at_a_cursor_inside_a_word(line: str, after: str, raw: str, want: str | None) -> None:
    p = _plan(line, after)
    s = policy.postprocess(p, raw)
    assert _accepted(p, s) == want
    if s is not None:  # an editor shows it as ghost text after the word: it starts with the rest, which it covers
        assert s.start == p.cursor.offset and s.text.startswith(policy.word_rest(p.cursor))
        assert s.end >= p.cursor.offset + len(policy.word_rest(p.cursor))


def test_a_cursor_inside_a_word_in_a_crlf_file_and_at_a_file_end_without_a_line_break() -> None:
    text = "fn main() {\r\n    let n = v.len"
    p = policy.plan(text, len(text) - 1)
    s = policy.postprocess(p, "n();")
    assert s == policy.Suggestion("n();", len(text) - 1, len(text))
    p = policy.plan(text + "\r\n}\r\n", len(text) - 1, policy.Options(multiline="always"))
    s = policy.postprocess(p, "n();\r\n    println!(\"{}\", n);\r\n")
    assert s is not None and s.text == "n();\r\n    println!(\"{}\", n);" and s.end == len(text)

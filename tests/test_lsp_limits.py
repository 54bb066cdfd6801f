"""`m31r lsp` on documents larger than what the daemon takes in one request. Real server, real daemon (test_lsp's
fixtures), nothing mocked."""

from __future__ import annotations

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, URI, expected

from m31r_lsp.completion import CHARS_PER_TOKEN
from m31r_lsp.documents import offset_at, position_at
from m31r_protocol import Client, Sampling

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp
TINY_CONTEXT = 512  # configs/model/tiny.yaml's max_context: the server sends at most 64 characters a token each side


def big_document(chars: int) -> str:
    """Rust of about `chars` characters: functions of lines of varying length (so that where the lines above the
    cursor are cut matters), CRLF line breaks and characters outside the BMP."""
    parts, size, i = [], 0, 0
    while size < chars:
        body = "".join(f"    let v{i}_{k} = {'x' * (k * 7 % 23)} + 🐢{k};\r\n" for k in range(i % 9 + 1))
        parts.append(f"fn f{i}() {{\r\n{body}}}\r\n\r\n")
        size, i = size + len(parts[-1]), i + 1
    return "".join(parts)


def applied(text: str, rng: t.Range, new: str) -> str:
    a = offset_at(text, rng.start.line, rng.start.character)
    return text[:a] + new + text[offset_at(text, rng.end.line, rng.end.character):]


async def test_a_document_over_the_daemons_prompt_limit_gets_completions(lsp):
    """The server sent the whole document as the Fim's prefix and suffix: in one over the daemon's --max-prompt-chars
    (2 Mi characters) every completion was refused (bad_request) and the editor never saw one, and each keystroke in a
    smaller large file copied all of it to the daemon. Each side is now cut to what the daemon keeps of it, and the
    suggestion's range is still the document's."""
    s = await lsp(NOISE)
    text = big_document(2_200_000)
    assert len(text) > 1 << 21
    offset = text.index("fn f5000() {\r\n") + len("fn f5000() {\r\n    let ")  # mid-document, mid-line
    s.open(text)
    res = await s.inline(offset)
    st = await s.stats()
    assert not any(k.startswith("daemon_error") for k in st), st
    assert st["text_cut"] == 1
    fim, limit = st["lastFim"], CHARS_PER_TOKEN * TINY_CONTEXT
    assert text[:offset].endswith(fim["prefix"]) and text[offset:].startswith(fim["suffix"])
    assert 0 < len(fim["prefix"]) <= 2 * limit and len(fim["suffix"]) == limit
    [item] = res.items
    want = expected(text, offset, st["lastRaw"], multiline="always")
    assert applied(text, item.range, item.insert_text) == text[:want.start] + want.text.replace(
        "\r\n", "\n") + text[want.end:]
    line, ch = position_at(text, offset)
    menu = await s.client.text_document_completion_async(t.CompletionParams(
        text_document=t.TextDocumentIdentifier(URI), position=t.Position(line, ch)))
    st = await s.stats()
    want = expected(text, offset, st["lastRaw"], multiline="always")
    [entry] = menu.items
    assert applied(text, entry.text_edit.range, entry.text_edit.new_text) == text[:want.start] + want.text + text[
        want.end:]


async def test_a_cut_document_gets_the_prompt_the_whole_text_gives(lsp, daemon):
    """What is cut away is what the daemon would not have kept, the lines above the cursor cut where the daemon's own
    cut would fall: through the server (the text cut), the daemon answers what it answers for the whole text sent
    directly, to the figure (a sampled answer and its probability follow every token of the prompt)."""
    s = await lsp({**NOISE, "deadlineMs": 30000, "multiline": "never"})
    big = big_document(120_000)
    long_line = big[:30_000] + "    let v = [" + "1, 22, 333, " * 4_000  # the cursor's line alone is cut too
    cases = [(big, big.index("{\r\n", int(len(big) * where)) + len("{\r\n    let v"))
             for where in (0.4, 0.7, 0.95)]  # cursors with the text cut on both sides, then on one
    for k, (text, offset) in enumerate([*cases, (long_line + "\n];\n", len(long_line))]):
        uri = f"file:///work/src/big{k}.rs"
        s.open(text, uri=uri)
        await s.inline(offset, uri=uri)
        st = await s.stats()
        assert st["text_cut"] == k + 1 and len(st["lastFim"]["prefix"]) <= CHARS_PER_TOKEN * TINY_CONTEXT * 2
        fim = st["lastFim"]
        async with await Client.connect(daemon, client="whole") as c:
            stream = await c.fim(text[:offset], text[offset:], max_tokens=fim["max_tokens"], stop=fim["stop"], seed=7,
                                 deadline_ms=30000, sampling=Sampling(temperature=1.0))
            raw, done = await stream.collect()
        assert (raw, list(done.logprob_by_line)) == (st["lastRaw"], st["lastLogprobByLine"]), k


async def test_a_cut_cr_only_document_gets_the_prompt_the_whole_text_gives(lsp, daemon):
    """Lines that end in a lone "\\r" (old Mac files): the server split the prefix at its last "\\n" only, so in a
    CR-only document the whole prefix was the cursor's line, cut at a character count rather than at a line of the
    daemon's 16-line step, and the daemon (which reads "\\r" as a line end) was prompted with other lines than the
    whole text gives. Cut at the last line end of any kind, the answer is the whole text's, to the figure."""
    s = await lsp({**NOISE, "deadlineMs": 30000, "multiline": "never"})
    text = big_document(120_000).replace("\r\n", "\r")
    assert "\n" not in text
    for k, where in enumerate((0.5, 0.9)):
        offset = text.index("{\r", int(len(text) * where)) + len("{\r    let v")
        uri = f"file:///work/src/mac{k}.rs"
        s.open(text, uri=uri)
        await s.inline(offset, uri=uri)
        st = await s.stats()
        fim = st["lastFim"]
        assert st["text_cut"] == k + 1 and text[:offset].endswith(fim["prefix"])
        start = offset - len(fim["prefix"])
        assert text[start - 1] == "\r" and text[:start].count("\r") % 16 == 0  # whole lines, at the daemon's step
        async with await Client.connect(daemon, client="whole") as c:
            stream = await c.fim(text[:offset], text[offset:], max_tokens=fim["max_tokens"], stop=fim["stop"], seed=7,
                                 deadline_ms=30000, sampling=Sampling(temperature=1.0))
            raw, done = await stream.collect()
        assert (raw, list(done.logprob_by_line)) == (st["lastRaw"], st["lastLogprobByLine"]), k

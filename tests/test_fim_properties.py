"""Property-based audit of the FIM prompt (m31r.fim), streaming detokenisation (m31r.tokenizer) and project-context
tokens (m31r.context) on the bundled tokenizer (release/tokenizer.json), whose byte-level BPE spells CJK and emoji in
tokens that split characters, and CR LF as two tokens.

What must hold for any prefix and suffix: every part of the prompt within its budget; each part's text, decoded, is
exactly the text it claims to keep (the cursor line with its healed text, the lines above from the line it names, the
suffix from the cursor), so no character is dropped, doubled or split at a cut, nor a CR LF; a stream's pieces add up
to the batch decode and never show half a character; snippets stay whole and within their room.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers

from m31r.config import load_config
from m31r.context import context_ids
from m31r.fim import HEAL_WORD_BYTES, FimBudget, build_fim_prompt, cut_suffix, heal_prompt, heal_split, split_prefix
from m31r.tokenizer import DEFAULT_SPECIAL, SPECIAL_TOKENS, Tokenizer

REPO = Path(__file__).resolve().parent.parent
# Bounded runs: the whole module stays well under a minute on 2 cores.
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Pieces of text that meet at cuts: line ends of every kind (and the breaks str.splitlines adds), indentation,
# identifiers, multi-byte and astral characters, a combining mark, and a genuine U+FFFD.
PIECES = ["\n", "\r\n", "\r", "\t", " ", "    ", "x", "foo_ba", "let ", "1", "(", "}", ";", "é", "e\u0301", "\u0301",
          "中", "文字", "🦀", "𝔘", "👩\u200d💻", "\u00a0", "\x0c", "\u2028", "\x85", "\x0b", "\ufffd", "'"]
texts = st.lists(st.one_of(st.sampled_from(PIECES), st.text(max_size=3)), max_size=40).map("".join)


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    cfg = load_config(REPO / "release" / "config.yaml")
    return Tokenizer.from_file(REPO / "release" / "tokenizer.json", cfg.special_tokens, cfg.vocab_size)


def parts(p) -> tuple[list[int], list[int], list[int]]:
    """The ids of S, P_above and P_line, checking the markers between them."""
    s, a = p.suffix_tokens, p.above_tokens
    assert len(p.ids) == 3 + s + a + p.line_tokens
    return p.ids[1 : 1 + s], p.ids[2 + s : 2 + s + a], p.ids[3 + s + a :]


def longest_token(tok: Tokenizer) -> float:
    """The most bytes of text one token of `tok` stands for, added tokens included (no bound where a normalizer may
    change the text before it is split)."""
    if not hasattr(tok, "_test_longest"):
        added = [t.content.encode() for t in tok.hf.get_added_tokens_decoder().values()]
        tok._test_longest = math.inf if tok.hf.normalizer is not None else max(
            len(b) for b in [*added, *(b for b in tok.token_bytes if b)])
    return tok._test_longest


def check_prompt(tok: Tokenizer, prefix: str, suffix: str, budget: FimBudget, heal: bool = True) -> None:
    p = build_fim_prompt(tok, prefix, suffix, budget, heal)
    assert [p.ids[0], p.ids[1 + p.suffix_tokens], p.ids[2 + p.suffix_tokens + p.above_tokens]] == \
        [tok.fim_suffix_id, tok.fim_prefix_id, tok.fim_middle_id]
    s_ids, a_ids, l_ids = parts(p)
    assert len(s_ids) <= max(budget.suffix, 0) and len(a_ids) <= max(budget.above, 0)
    assert len(l_ids) <= max(budget.line, 0)
    assert not set(s_ids + a_ids + l_ids) & tok.special_ids  # the user's text never becomes a marker
    above, line = split_prefix(prefix)
    s, a, typed = tok.decode(s_ids), tok.decode(a_ids), tok.decode(l_ids) + p.heal
    # The suffix from the cursor, the lines above from the one named, the end of the cursor line: nothing more.
    assert suffix.startswith(s) and not (s.endswith("\r") and suffix[len(s) :].startswith("\n")), (suffix, s)
    assert a == "".join(above.splitlines(keepends=True)[p.above_start_line :]), (above, a, p.above_start_line)
    if a and p.above_start_line % budget.line_step:  # a finer step (cut_above): from the next multiple, under half
        on_step = -(-p.above_start_line // budget.line_step) * budget.line_step
        assert 2 * sum(len(tok.encode(x)) for x in above.splitlines(keepends=True)[on_step:]) < budget.above
    assert line.endswith(typed), (line, typed)
    # (a line of more bytes than `budget.line` of the longest tokens hold is over budget without tokenising it: a
    # megabyte took ~1 s)
    if len(line.encode()) <= budget.line * longest_token(tok) and len(tok.encode(line)) <= budget.line:
        assert typed == line  # the whole cursor line: nothing dropped or doubled at the heal
    assert heal or p.heal == ""
    assert "\n" not in p.heal and "\r" not in p.heal  # healing stays on the cursor's line


@PROPERTY
@given(prefix=texts, suffix=texts, sizes=st.tuples(st.integers(0, 30), st.integers(0, 12), st.integers(0, 50)),
       step=st.integers(1, 4), heal=st.booleans())
def test_any_prompt_keeps_its_budgets_and_the_text_at_every_cut(bpe, prefix, suffix, sizes, step, heal) -> None:
    suffix_budget, line_budget, above_budget = sizes
    check_prompt(bpe, prefix, suffix, FimBudget(suffix_budget, line_budget, above_budget, 16, step), heal)


@PROPERTY
@given(prefix=texts, suffix=texts)
def test_any_prompt_under_the_serving_budget(bpe, prefix, suffix) -> None:
    check_prompt(bpe, prefix, suffix, FimBudget.for_context(2048))
    check_prompt(bpe, prefix * 30, suffix * 30, FimBudget.for_context(128))


def test_documents_at_the_edges(bpe) -> None:
    """Empty parts, no final line end, CR LF and lone-CR files, a cursor right after a character of several bytes or
    tokens, and lines of a megabyte at the cursor, above it and after it."""
    b = FimBudget.for_context(2048)
    crab = "let s = \"🦀中é\u0301"
    for prefix, suffix in [("", ""), ("", "fn main() {}"), ("fn main() {", ""), ("a\r\nb\r\n  c", "d\r\ne\r\n"),
                           ("a\rb\r  c", "d\re\r"), (crab, "\";\n"), ("x\n" + crab, "\";"), ("\r\n", "\r\n"),
                           ("\ufffd", "\ufffd"), ("\t\t", "\t}")]:
        check_prompt(bpe, prefix, suffix, b)
        check_prompt(bpe, prefix, suffix, b, heal=False)
    assert build_fim_prompt(bpe, "let s = \"中", "", b).heal == "中"  # the whole character, no byte of it kept
    mb = "let v = [" + "1, 中é🦀 " * 120_000  # a 1 MB line (in UTF-8), no final line end
    assert len(mb.encode()) > 1_000_000
    check_prompt(bpe, "fn f() {\n" + mb, "\n}", b)  # at the cursor
    check_prompt(bpe, "fn f() {\n" + mb + "\n    x", "\n}", b)  # above it: left out whole
    check_prompt(bpe, "fn f() {\n    ", mb, b)  # after it: cut by tokens


# -- regressions: cuts by tokens ----------------------------------------------------------------------------------


def test_a_long_cursor_line_cut_by_tokens_keeps_whole_characters(bpe) -> None:
    """文 is three byte tokens: a cursor line longer than its budget, cut from the start by tokens, began with the
    last bytes of one, and the prompt held U+FFFD, text the file never had."""
    b = FimBudget.for_context(2048)
    assert len(bpe.encode("文")) == 3
    for pad in range(3):  # the cut falls on each byte of a character
        line = "let s = \"" + "x" * pad + "文" * 200
        p = build_fim_prompt(bpe, "fn f() {\n" + line, "\";\n}\n", b, heal=False)
        kept = bpe.decode(parts(p)[2])
        assert "\ufffd" not in kept and line.endswith(kept) and 0 < p.line_tokens <= b.line


def test_a_suffix_line_cut_by_tokens_never_ends_between_cr_and_lf(bpe) -> None:
    """CR LF is two tokens: a first suffix line cut just before its LF kept a lone CR, a line end the file never had
    (a CR LF file served as it is, as training samples and the benchmarks build prompts)."""
    first = "let total = 1;\r\n"
    ids = bpe.encode(first)
    assert bpe.decode(ids[-2:]) == "\r\n" and bpe.token_bytes[ids[-2]] == b"\r"
    budget = len(ids) - 1  # all of the line but its LF
    assert cut_suffix(bpe, first + "x\r\n", budget) == "let total = 1;"
    p = build_fim_prompt(bpe, "fn f() {\n    ", first + "x\r\n", FimBudget(budget, 8, 64, 16))
    assert bpe.decode(parts(p)[0]) == "let total = 1;"


def test_lines_above_that_encode_longer_whole_still_start_at_a_line(bpe) -> None:
    """str.splitlines breaks at a form feed, the tokenizer does not: `\\x0c x` counted as two lines is 2 tokens, whole
    it is 3. The lines above then passed their budget once encoded whole and lost tokens at their start, so P_above
    began inside a line, not at the line (a multiple of line_step) it claimed."""
    assert len(bpe.encode("\x0c x")) > len(bpe.encode("\x0c")) + len(bpe.encode(" x"))
    above = "".join(f"let v{i} = {i};\x0c x\n" for i in range(40))
    lines = above.splitlines(keepends=True)
    for budget in range(20, 200, 7):
        p = build_fim_prompt(bpe, above + "    ", "}\n", FimBudget(16, 8, budget, 16, line_step=4))
        a = bpe.decode(parts(p)[1])
        assert p.above_tokens <= budget and p.above_start_line % 4 == 0
        assert a == "".join(lines[p.above_start_line :]), (budget, p.above_start_line, a[:20])


# -- healing ------------------------------------------------------------------------------------------------------


@PROPERTY
@given(line=texts.map(lambda t: "".join(t.splitlines())))
def test_healing_takes_back_whole_characters_of_the_cursor_line(bpe, line) -> None:
    ids = bpe.encode(line)
    kept, healed = heal_split(bpe, ids)
    assert kept == ids[: len(kept)] and bpe.decode(kept) + healed == line
    assert bool(healed) == bool(line)
    removed = ids[len(kept) :]
    # Beyond the last token and the whole characters it ends, only a word's tokens, within HEAL_WORD_BYTES.
    assert len(healed.encode()) <= HEAL_WORD_BYTES or len(removed) <= 4
    if removed:  # the healing mask lets the model write the text back the way the line had it
        assert removed[0] in bpe.heal_ids(healed.encode())
    kept_plain, healed_plain = heal_prompt(bpe, ids)
    assert bpe.decode(kept_plain) + healed_plain == line


# -- streaming detokenisation -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def odd_ids(bpe) -> list[int]:
    """Tokens that are no whole character alone (a lead or continuation byte), U+FFFD's and the special ids."""
    def whole(b: bytes) -> bool:
        try:
            b.decode()
        except UnicodeDecodeError:
            return False
        return True

    return [i for i, b in enumerate(bpe.token_bytes) if b and not whole(b)] + bpe.encode("\ufffd") + \
        sorted(bpe.special_ids)


def token_bytes(tok: Tokenizer, ids: list[int]) -> bytes:
    return b"".join(tok.token_bytes[i] or b"" for i in ids)


def stream_all(tok: Tokenizer, ids: list[int], context: list[int] | None = None) -> tuple[list[str], str]:
    s = tok.stream(context)
    return [s.step(i) for i in ids], s.flush()


@PROPERTY
@given(data=st.data(), prompt=texts)
def test_a_stream_of_any_ids_adds_up_to_the_batch_decode(bpe, odd_ids, data, prompt) -> None:
    ids = data.draw(st.lists(st.one_of(st.sampled_from(odd_ids), st.integers(0, bpe.vocab_size - 1)), max_size=24))
    context = bpe.encode(prompt)
    pieces, tail = stream_all(bpe, ids, context)
    text = "".join(pieces) + tail
    # Bytes that form no character are left out; every character the ids spell comes out, and nothing of the prompt.
    whole = token_bytes(bpe, context[-8:] + ids).decode("utf-8", "ignore")
    before = token_bytes(bpe, context[-8:]).decode("utf-8", "ignore")
    assert whole.startswith(before) and text == whole[len(before) :]
    spelled = token_bytes(bpe, ids)
    if spelled.decode("utf-8", "ignore").encode() == spelled:  # the ids spell text: that text, as batch decode has it
        assert text == bpe.decode(ids)
        assert "".join(stream_all(bpe, ids)[0]) == bpe.decode(ids)
    # Never half a character mid-stream: each piece is where the text goes on, not a U+FFFD it later corrects.
    shown = ""
    for piece in pieces:
        shown += piece
        assert text.startswith(shown)


@PROPERTY
@given(prompt=texts, completion=texts)
def test_a_stream_after_any_prompt_shows_the_completion_only(bpe, prompt, completion) -> None:
    pieces, tail = stream_all(bpe, bpe.encode(completion), bpe.encode(prompt))
    assert "".join(pieces) + tail == completion and tail == ""


def test_a_prompt_ending_in_u_fffd_is_not_sent_again(bpe) -> None:
    """tokenizers' DecodeStream, primed with ids whose text ended in U+FFFD (a genuine one: a healed prompt keeps the
    text before the cursor's word), sent that whole text again with the first token: the engine then left out the
    healed text's length of it and returned the rest of the prompt as the completion."""
    kept, healed = heal_prompt(bpe, bpe.encode("let s = \"\ufffdab"))
    assert healed == "ab" and bpe.decode(kept).endswith("\ufffd")
    pieces, tail = stream_all(bpe, bpe.encode("ab\";"), kept)
    assert "".join(pieces) + tail == "ab\";"
    # ... and a completion ending in a genuine U+FFFD gave it up: it waited for a token that never came.
    assert "".join(stream_all(bpe, bpe.encode("let s = \"\ufffd"))[0]) == "let s = \"\ufffd"


@pytest.fixture(scope="module")
def fallback_tok() -> Tokenizer:
    """A tokenizer whose decoder is not byte-level (a Llama-style byte fallback: `<0xE4>` tokens, all or nothing per
    run of them), as an imported checkpoint may bring: the stream falls back to diffing decoded text."""
    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for w in ["▁", "a", "b", "▁a", "ab", "é", "中"]:
        vocab.setdefault(w, len(vocab))
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b")], byte_fallback=True))
    hf.normalizer = normalizers.Replace(" ", "▁")
    hf.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    hf.add_special_tokens(list(SPECIAL_TOKENS))
    return Tokenizer(hf, DEFAULT_SPECIAL)


@PROPERTY
@given(prompt=st.text(alphabet="ab é中🦀\ufffdx", max_size=12), completion=st.text(alphabet="ab é中🦀\ufffdx",
                                                                                  max_size=12))
def test_a_stream_with_a_text_decoder_adds_up_to_the_completion(fallback_tok, prompt, completion) -> None:
    tok = fallback_tok
    assert not tok.byte_level
    s = tok.stream(tok.encode(prompt))
    shown = ""
    for i in tok.encode(completion):
        shown += s.step(i)
        assert completion.startswith(shown)
    assert shown + s.flush() == completion


# -- project context ----------------------------------------------------------------------------------------------


snippets = st.lists(st.tuples(texts, st.sampled_from(["", "src/a.rs", "src/中.rs", "src/x\n.rs", "a\r\nb"])),
                    max_size=5)


@PROPERTY
@given(chosen=snippets, budget=st.integers(-5, 120))
def test_context_ids_are_whole_snippets_within_their_room(bpe, chosen, budget) -> None:
    from m31r_protocol.messages import Snippet

    given_snippets = [Snippet(text, path) for text, path in chosen]
    ids = context_ids(bpe, given_snippets, budget)
    assert len(ids) <= max(budget, 0)
    # Best first, laid out best last; each one whole: its path's comment line, its text, a line end, the end token;
    # one laid out already is not laid out again.
    expect, used = [], 0
    for s in given_snippets:
        text = s.text if s.text.endswith("\n") else s.text + "\n"
        one = bpe.encode(f"// {' '.join(s.path.splitlines())}\n{text}" if s.path else text) + [bpe.eos_id]
        if used + len(one) <= budget and one not in expect:
            expect.append(one)
            used += len(one)
    assert ids == [i for one in reversed(expect) for i in one]


def test_a_snippet_path_is_one_comment_line(bpe) -> None:
    """A path with a line break in it (an HTTP client's `context`) put a line of code no file has before the
    snippet."""
    from m31r_protocol.messages import Snippet

    ids = context_ids(bpe, [Snippet("fn a() {}\n", "src/a.rs\nfn injected() {}")], 100)
    assert bpe.decode(ids) == "// src/a.rs fn injected() {}\nfn a() {}\n"


# -- through a real daemon ----------------------------------------------------------------------------------------


def test_a_daemon_completion_after_a_genuine_u_fffd_is_the_completion(shared_daemon, tiny_bundle) -> None:
    """The byte tokenizer of the tiny bundle spells U+FFFD in three tokens; a cursor in the word after it heals the
    word, and the prompt's text before it ended in U+FFFD: the answer was the prompt's own text again."""
    from m31r_protocol.client import Client

    _, sock = shared_daemon
    tok = Tokenizer.from_file(Path(tiny_bundle.path) / "tokenizer.json", DEFAULT_SPECIAL)

    async def ask() -> tuple[str, list[int], int]:
        async with await Client.connect(sock) as client:
            stream = await client.fim("fn f() {\n    let s = \"\ufffdab", "\";\n}\n", max_tokens=8, lookahead=0)
            text, done = await stream.collect()
            return text, stream.tokens, done.usage.healed_tokens

    text, tokens, healed = asyncio.run(ask())
    written = token_bytes(tok, tokens).decode("utf-8", "ignore")
    assert healed == 2  # the healed word, written again first (byte by byte), neither streamed nor returned
    assert written.startswith(text) and "let s" not in text

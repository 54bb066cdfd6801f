"""Completion policy shared by the editor front ends (the LSP server and the HTTP adapter).

Pure functions and dataclasses over a document string and a cursor offset; no editor protocol, no torch.

    plan(text, offset, options)   → a Plan: the Fim request to send (prefix, suffix, stop, max_tokens, deadline)
                                    and what post-processing needs to know about the cursor
    postprocess(plan, raw)        → a Suggestion (insert text + replace range as document offsets) or None
    alternatives(plan, shown, raws) → a beam search's runners-up as further Suggestions
    typed_through(shown, text, offset) → the shown suggestion still valid after the user typed part of it
    confident(line_logprob, min_probability) → whether a suggestion is likely enough to show
    confident_lines(raw, logprob_by_line, min_probability) → a completion cut to the lines likely enough to show
    first_line_logprob(raw, line_logprob, logprob_by_line) → what `confident` judges: the first line shown's figure
    accepted_state(shown)         → (text, offset) of the document once the suggestion is accepted

Rules (what editor users expect from ghost text):
- Multi-line only at the end of a line or when only closing brackets/punctuation follow the cursor;
  single-line (stop at "\\n") mid-line. `multiline` = "auto" | "always" | "never". After code and before closers,
  a multi-line answer shows only its first line where the next line is code of the cursor's block.
- On a whitespace-only line the model writes from column 0 (the line's whitespace is left out of the
  prompt) and the result is re-indented to the line's own indentation; the range covers the whole line.
- Never repeat what is already there: text after the cursor that the model wrote again is trimmed, and
  so are completion lines that duplicate the lines following the cursor.
- Mid-line before other code, a line the model ended without writing that code is a rewrite of the line, which an
  insertion cannot show: nothing (`total█ = 1;` answered " = 10;\n").
- Auto-closed brackets: when only closers follow the cursor and the completion closes them itself, the
  range extends over them so the editor replaces them instead of leaving a second copy; a multi-line one that ends its
  last line before them (or any one, before a line's code: only indentation before the cursor) leaves them on a line
  of their own. Mid-line, its last closers that the document's closers
  right after the cursor close too are cut. One that ends with the line's whole rest replaces it where its own line
  pairs its brackets no worse; the document's closers are never put after a `;` of the completion's.
- A completion is cut before a closer of no bracket open before the cursor (or of another one than is open, or
  than it opened itself): brackets in comments (nested ones too), strings and char literals are none.
- max_lines=1 right after a `{`: a one-line body the model wrote under it shows as `{ body }` (no line break).
- A multi-line completion stops before a line indented less than the cursor's block, and before the line at which
  the model's probability of the lines so far falls under the editor's floor (the first line alone must reach it).
- Empty, whitespace-only and self-repeating suggestions are dropped.
- Inside a word (`tot█al`): only an answer that writes the word's rest again is shown, as what follows the word
  (its range over the rest), and not where it then rewrites the code after the word.
- A multi-line answer that `max_tokens` ended mid-line is shown without that unfinished line (finished_lines).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Literal

Multiline = Literal["auto", "always", "never"]
MULTILINE_MODES: tuple[str, ...] = ("auto", "always", "never")

OPENERS = {"(": ")", "[": "]", "{": "}"}
CLOSERS = {")": "(", "]": "[", "}": "{"}
QUOTES = frozenset("\"`")
# What may follow the cursor for a multi-line completion to still make sense: closing brackets, quotes and
# punctuation that editors auto-insert or that ends a statement.
TRAILING_OK = frozenset(")]}>\"'`;,.:") | frozenset(" \t")


@dataclass(frozen=True)
class Options:
    multiline: str = "auto"  # one of MULTILINE_MODES
    max_tokens: int = 64
    deadline_ms: int | None = 800
    max_lines: int = 12  # a multi-line suggestion keeps at most this many lines
    single_line_max_tokens: int | None = None  # None: max_tokens

    def __post_init__(self) -> None:
        if self.multiline not in MULTILINE_MODES:
            raise ValueError(f"multiline must be one of {MULTILINE_MODES}, not {self.multiline!r}")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if self.deadline_ms is not None and self.deadline_ms < 1:
            raise ValueError("deadline_ms must be at least 1 (or None)")
        if self.max_lines < 1:
            raise ValueError("max_lines must be at least 1")


@dataclass(frozen=True)
class Cursor:
    """Where the cursor is, in the document string."""

    offset: int
    line_start: int  # offset of the cursor line's first character
    line_end: int  # offset of the cursor line's end (its line break, or the end of the text)
    before: str  # the cursor line's text before the cursor
    after: str  # the cursor line's text after the cursor (without the line break)
    indent: str  # the cursor line's leading whitespace
    blank_line: bool  # the cursor line is whitespace only
    next_lines: tuple[str, ...]  # the lines after the cursor line (without line breaks), a few at most
    previous_line: str | None  # the nearest non-blank line above the cursor line
    newline: str  # the document's line break ("\n", "\r\n" or "\r"): in a mixed file, the one above the cursor line

    @property
    def at_line_head(self) -> bool:
        """Only indentation before the cursor: what a suggestion inserts there are whole lines, each ended by its break
        (the text after the cursor keeps a line of its own)."""
        return not self.before.strip()


@dataclass(frozen=True)
class Plan:
    """A Fim request to send, and the cursor context post-processing needs."""

    prefix: str
    suffix: str
    stop: list[str]
    max_tokens: int
    deadline_ms: int | None
    multiline: bool
    cursor: Cursor
    max_lines: int = 12

    def fim_kwargs(self) -> dict:
        """Keyword arguments for `m31r_protocol.Client.fim` (add document=...)."""
        return {"prefix": self.prefix, "suffix": self.suffix, "stop": list(self.stop), "max_tokens": self.max_tokens,
                "deadline_ms": self.deadline_ms}


@dataclass(frozen=True)
class Suggestion:
    """Replace text[start:end] with `text`. start <= cursor <= end, and text[start:cursor] is a prefix of `text`
    so an editor shows it as ghost text extending what is typed."""

    text: str
    start: int
    end: int


@dataclass(frozen=True)
class Shown:
    """A suggestion that was shown for `text` with the cursor at `offset`."""

    text: str
    offset: int
    suggestion: Suggestion
    extra: dict = field(default_factory=dict, compare=False)  # front-end bookkeeping, never read here
    alternatives: tuple[Suggestion, ...] = ()  # shown beside it, for the editor to cycle through


# -- the cursor -----------------------------------------------------------------------------------------------


# Lines break at "\r\n", "\r" and "\n", as in LSP (and the editors): a file of lone "\r"s has lines too.
_EOL = re.compile(r"\r\n|\r|\n")


def _newline_at(text: str, line_start: int, eol: re.Match | None) -> str:
    """The line break a suggestion for the line starting at `line_start` writes: the one ending the line above (so a
    suggestion that starts with a break never joins a lone "\r" before it into a "\r\n" in a mixed file), else the
    one ending the line, else the document's first, else "\n"."""
    if line_start > 0:
        return "\r\n" if text[line_start - 2 : line_start] == "\r\n" else text[line_start - 1]
    m = eol or _EOL.search(text)
    return m.group() if m else "\n"


def _line_start(text: str, offset: int) -> int:
    """Offset of the first character of the line holding `offset`; inside a "\r\n", the line it ends."""
    if 0 < offset < len(text) and text[offset - 1 : offset + 1] == "\r\n":
        offset -= 1
    return max(text.rfind("\n", 0, offset), text.rfind("\r", 0, offset)) + 1


def leading_ws(s: str) -> str:
    return s[: len(s) - len(s.lstrip(" \t"))]


def cursor_at(text: str, offset: int, *, context_lines: int = 8) -> Cursor:
    if not 0 <= offset <= len(text):
        raise ValueError(f"offset {offset} outside a text of {len(text)} characters")
    line_start = _line_start(text, offset)
    eol = _EOL.search(text, offset)
    line_end = len(text) if eol is None else eol.start()
    line = text[line_start:line_end]
    before, after = text[line_start:offset], text[offset:line_end]
    next_lines: list[str] = []
    pos = -1 if eol is None else eol.end()
    while pos >= 0 and len(next_lines) < context_lines:
        m = _EOL.search(text, pos)
        next_lines.append(text[pos : len(text) if m is None else m.start()])
        pos = -1 if m is None else m.end()
    previous_line = None
    end = line_start  # where the line after the one looked at starts
    while end > 0:
        brk = end - 2 if text[end - 2 : end] == "\r\n" else end - 1  # the line break ending the line looked at
        s = _line_start(text, brk)
        prev = text[s:brk]
        if prev.strip():
            previous_line = prev
            break
        end = s
    return Cursor(offset, line_start, line_end, before, after, leading_ws(line), not line.strip(),
                  tuple(next_lines), previous_line, _newline_at(text, line_start, eol))


def wants_multiline(cur: Cursor, mode: str = "auto") -> bool:
    if mode == "always":
        return True
    if mode == "never":
        return False
    return all(c in TRAILING_OK for c in cur.after)


def plan(text: str, offset: int, options: Options | None = None) -> Plan:
    """The Fim request for a cursor at `offset` in `text`."""
    o = options or Options()
    cur = cursor_at(text, offset)
    multiline = wants_multiline(cur, o.multiline)
    if cur.blank_line:
        # Generate from column 0: the line's whitespace stays out of the prompt (the model indents itself,
        # and whitespace tokens then merge the way they did in training); the result is re-indented.
        prefix, suffix = text[: cur.line_start], text[cur.line_end :]
    else:
        prefix, suffix = text[:offset], text[offset:]
    stop = [] if multiline else ["\n"]
    max_tokens = o.max_tokens if multiline else (o.single_line_max_tokens or o.max_tokens)
    return Plan(prefix, suffix, stop, max_tokens, o.deadline_ms, multiline, cur, o.max_lines)


# -- post-processing ------------------------------------------------------------------------------------------


@dataclass
class _Scan:
    """Characters of a completion at bracket depth 0 relative to the cursor (outside strings it opened)."""

    items: list[tuple[int, str, bool]]  # (index, char, is_excess_closer)
    open: int = 0  # brackets (a generic's `<` too) left open at its end, `seed`'s included
    mismatched: int = 0  # closers of another bracket than the one open


# A char literal's character ('(', '\'', '\u{1F600}') and a raw string (r#"a "(" b"#), shared by both readings below.
_CHAR_BODY = r"""(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]*\}|.)|[^\\'\n\r])"""
_RAW_STRING = r"""[bc]?r(?P<hashes>#*)".*?"(?P=hashes)"""
# A char literal or a raw string, whose brackets and quotes are text, unlike those of the plain quote-to-quote reading
# below; a lifetime's lone quote matches neither.
_LITERAL = re.compile(r"(?<!\w)(?:b?'" + _CHAR_BODY + "'|" + _RAW_STRING + ")", re.S)


def _scan_depth0(s: str, in_string: str | None = None, seed: tuple[str, ...] = ()) -> _Scan:
    """Walk `s` tracking brackets (generics' angle brackets too) and strings the completion itself opens. A closing
    bracket with no opener inside `s` is an "excess closer": it closes something opened before the cursor. `seed`:
    brackets open before `s` (innermost last), which its closers close first."""
    items: list[tuple[int, str, bool]] = []
    stack: list[str] = list(seed)
    mismatched = 0
    quote: str | None = None
    i = 0
    while i < len(s):
        c = s[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
            i += 1
            continue
        if c in "'rbc" and (lit := _LITERAL.match(s, i)):
            if not stack:
                items.append((i, c, False))
            i = lit.end()
            continue
        if c in QUOTES:
            if not stack:
                items.append((i, c, False))
            quote = c
        elif c in OPENERS:
            stack.append(c)
        elif c == "<" and (s[i - 1 : i].isalnum() or s[i - 1 : i] in ("_", ":")):
            stack.append(c)  # a generic's `Vec<` / `::<` (rustfmt spaces a comparison's `a < b`)
        elif c == ">" and stack and stack[-1] == "<" and s[i - 1 : i] not in ("-", "="):
            stack.pop()  # its `>`, which must not stand for a `>` the editor auto-closed after the cursor
        elif c in CLOSERS:
            while stack and stack[-1] == "<":
                stack.pop()  # that `<` was a comparison after all
            if stack and stack[-1] == CLOSERS[c]:
                stack.pop()
            elif not stack:
                items.append((i, c, True))
            else:
                stack.pop()  # mismatched: keep going, the model's brackets are its own business
                mismatched += 1
        elif not stack:
            items.append((i, c, False))
        i += 1
    return _Scan(items, len(stack), mismatched)


def _inside_string(before: str) -> str | None:
    """The quote character of a string literal open at the end of `before` (one line), if any."""
    quote: str | None = None
    i = 0
    while i < len(before):
        c = before[i]
        if quote is not None:
            if c == "\\":
                i += 2
                continue
            if c == quote:
                quote = None
        elif c in "'rbc" and (lit := _LITERAL.match(before, i)):
            i = lit.end()
            continue
        elif c in QUOTES:
            quote = c
        i += 1
    return quote


def _match_closers(comp: str, cur: Cursor, prefix: str) -> tuple[str, int]:
    """`after` is closers/punctuation only. Returns (text, end): the completion (possibly extended with the
    closers it did not write) and where its range ends."""
    text, end = _pair_closers(comp, cur)
    if ("\n" in comp or (text, end) == (comp, cur.line_end) or not cur.after.strip()
            or not comp.rstrip(" \t").endswith((cur.after.rstrip(" \t"), ";"))):
        return text, end
    # The brackets open before the cursor's line (a scan of up to SCAN_CHARS of the prefix: only here).
    outer = (_open_brackets(prefix[: max(0, len(prefix) - len(cur.before))]) or ((), ""))[0]
    paired = cur.before + text + cur.after[end - cur.offset :]  # the line the pairing makes
    if (comp.rstrip(" \t").endswith(cur.after.rstrip(" \t")) and _is_subsequence(cur.after, comp)
            and _unpaired(outer, cur.before + comp) <= _unpaired(outer, paired)):
        # It ends with the line's whole rest: the line it makes is its own, shown where that pairs its brackets no worse
        # (`in_iter(█));` answered "into_iter(x));"). Paired closer by closer, its first `)`, which closes a bracket it
        # opened itself, stood for the document's first, and its `;` came before the second: `into_iter(x)););`; a
        # line's `}█;` answered "};" was shown as nothing. (At `Vec<█>` answered "Option<u8>", its own line leaves
        # `Vec<` open: the document's `>` stays.) The editor shows a replacement that keeps what it replaces.
        return comp, cur.line_end
    rest = cur.after[end - cur.offset :]  # the document's, after the range
    if text.startswith(comp) and comp.rstrip(" \t").endswith(";") and (
            any(c in CLOSERS for c in text[len(comp) :]) or end == cur.offset and rest.lstrip()[:1] in (")", "]")):
        # The document's closers, those it did not write (`get_mut(█)));` answered "x));": `x)););`) or all of them
        # (`g(█);` answered "h(x);": `g(h(x););`), went after its `;`. Before it they make the document's line
        # (`bar(x█));` answered "x);", `foo(` open above: `bar(x));`), shown where its brackets then pair; else its own
        # line contradicts the document's closers: nothing.
        cut = comp.rstrip(" \t")[:-1] + text[len(comp) :]
        if not _is_subsequence(cur.after[: end - cur.offset], cut):
            return text, end  # its `;` stood for the document's (`█;>` answered ";"): no `;` of the line goes
        return (cut, end) if _unpaired(outer, cur.before + cut + rest) == 0 else ("", cur.offset)
    return text, end


def _unpaired(outer: tuple[str, ...], line: str) -> int:
    """The brackets of `line` that pair with none: closers of nothing open, in it or in `outer` (those open before
    it), or of another bracket than the one open, and the openers it leaves open beyond the outer ones."""
    scan = _scan_depth0(line, seed=outer)
    return sum(e for _, _, e in scan.items) + scan.mismatched + max(0, scan.open - len(outer))


def _pair_closers(comp: str, cur: Cursor) -> tuple[str, int]:
    """_match_closers' pairing of the completion's closers with the document's, in order."""
    after = cur.after
    wanted = [(i, c) for i, c in enumerate(after) if not c.isspace()]
    if not wanted:
        return comp, cur.offset
    open_quote = _inside_string(cur.before)
    if open_quote is None and after[:1] == "'" and any(tok == "'" for _, tok in _rust_brackets(cur.before)):
        open_quote = "'"  # in a char literal the editor closed (`'█'` answered "{';"), its quote as a string's
    # Inside a string the completion's first unescaped matching quote closes it: scan only from there.
    start = 0
    if open_quote is not None:
        j = 0
        while j < len(comp):
            if comp[j] == "\\":
                j += 2
                continue
            if comp[j] == open_quote:
                break
            j += 1
        scan_items = [(j, open_quote, True)] if j < len(comp) else []
        start = j + 1
        if j < len(comp):
            scan_items += [(k + start, c, e) for k, c, e in _scan_depth0(comp[start:]).items]
    else:
        scan_items = _scan_depth0(comp).items
    matched = 0
    first = -1
    cut: int | None = None
    it = iter(scan_items)
    for _, want in wanted:
        for idx, c, excess in it:
            if c == want:
                matched += 1
                first = idx if first < 0 else first
                break
            if excess or (c in QUOTES and want in QUOTES):
                cut = idx  # it closes something else first: the rest of the completion is wrong
                break
        else:
            break
        if cut is not None:
            break
    if cut is not None:
        comp = comp[:cut]
    if matched == 0:
        return comp, cur.offset
    # Partly closed: keep the closers it did not write, in order, after the completion.
    text = comp if matched == len(wanted) else comp + after[wanted[matched][0] :]
    if not _is_subsequence(after, text):
        # Replacing the closers would delete the whitespace the user has among them (`{ | }` and "a()}"): the
        # completion up to its first closer, before the document's own.
        return comp[:first], cur.offset
    return text, cur.line_end


def _closers_on_their_line(comp: str, cur: Cursor) -> tuple[str, int]:
    """A multi-line completion that ended with a line break before the closers after the cursor (`{|}` answered
    "\n    body();\n"): the break and the cursor line's indentation, so they close on a line of their own as the
    model wrote them, not at the end of its last line. The range takes in the whitespace before them."""
    if cur.after.lstrip()[:1] not in CLOSERS or _inside_string(cur.before) is not None:
        return comp, cur.offset  # in a string a line break and indentation are text
    text = comp + "\n" + cur.indent
    ws = cur.after[: len(cur.after) - len(cur.after.lstrip(" \t"))]
    return text, cur.offset + (len(ws) if _is_subsequence(ws, cur.indent) else 0)


# Rust text that can hold a bracket that is none: comments (a block comment, from `comment`, is read by
# _rust_brackets: they nest), strings (raw, byte and C ones too) and char literals (a lifetime's lone quote matches
# none of them; one the text ends in, `'(`, is the cursor's, from `char`); then the brackets; last, a string left open.
_RUST_TOKENS = re.compile(
    r"""//[^\n\r]*|(?P<comment>/\*)|"""
    r"""(?<!\w)""" + _RAW_STRING + r"""|(?<!\w)[bc]?"(?:\\.|[^"\\])*"|"""
    r"""(?<!\w)b?'(?:""" + _CHAR_BODY + r"""'|"""
    r"""(?P<char>(?:\\[^'\n\r]{0,9}|[^\\'\n\r])?\Z))|"""
    r"""(?P<bracket>[()\[\]{}])|(?P<unclosed>")""", re.S)
_COMMENT_EDGES = re.compile(r"/\*|\*/")


def _rust_brackets(text: str) -> Iterator[tuple[int, str]]:
    """(offset, bracket) for the brackets of Rust code `text`, then (offset, "") for a string or block comment it leaves
    open, or (offset, "'") for a char literal, or (offset, "//") for the line comment it ends in. A block comment ends
    at the `*/` of its own `/*`, not the first one (`/* a /* b */ ( */` is all comment)."""
    pos: int | None = 0
    while pos is not None:
        tokens, pos = _RUST_TOKENS.finditer(text, pos), None
        for m in tokens:
            if tok := m.group("bracket"):
                yield m.start(), tok
            elif m.group("comment"):
                depth, pos = 1, m.end()
                while depth:
                    if (edge := _COMMENT_EDGES.search(text, pos)) is None:
                        yield m.start(), ""
                        return
                    depth += 1 if edge.group() == "/*" else -1
                    pos = edge.end()
                break  # the tokens go on after the comment
            elif m.group("unclosed"):
                yield m.start(), ""
                return
            elif m.group("char") is not None:
                yield m.start(), "'"
            elif m.end() == len(text) and m.group().startswith("//"):
                yield m.start(), "//"


# The text before the cursor read for its open brackets: the scan costs ~0.1 ms a KB, and reading a whole 5 MB file's
# prefix for every suggestion took 0.2 s of the language server's time, this at most ~4 ms.
SCAN_CHARS = 1 << 15
# A line that starts at column 0 with an item (`fn`, `pub`, `impl`, `#[...]`, `use`): no bracket is open before it.
_TOP_LEVEL = re.compile(r"^[A-Za-z_#]", re.M)


def _has_line_comment(line: str) -> bool:
    """Whether `line` has a `//` comment (outside strings and char literals): it would comment out what follows."""
    return any(m.group().startswith("//") for m in _RUST_TOKENS.finditer(line))


def _open_brackets(prefix: str) -> tuple[tuple[str, ...], str] | None:
    """The brackets open at the end of `prefix` (innermost last) and the char literal it ends inside (`'(`, or ""), or
    None where that is unclear: the cursor is in a string or block comment, the prefix closes a bracket it did not open
    (an edit in progress), or a long prefix has no top-level line among its last SCAN_CHARS to start from. In a line
    comment: those open in its text (_comment_code)."""
    if len(prefix) <= SCAN_CHARS:
        return _brackets_open_in(prefix)
    top = _TOP_LEVEL.search(prefix, len(prefix) - SCAN_CHARS)
    return None if top is None else _brackets_open_in(prefix[top.start():])


_LINE_COMMENT = re.compile(r"[ \t]*(//[/!]?)")
COMMENT_LINES = 200  # the comment lines above the cursor's read for the brackets its example opened


def _comment_code(text: str, start: int) -> str:
    """The text of the line comment at `start`, which `text` ends in, after those of the comment lines just above it
    of the same kind (`///`, `//!` or `//`), markers left out. A doc comment's example is code (`/// assert!(x.has(|`
    answered `"e"));`): read as comment, its brackets were none, and the completion's closers were cut as closing
    nothing."""
    marker = _LINE_COMMENT.match(text, start).group(1)
    lines = [text[start + len(marker) :]]
    for line in reversed(text[: max(text.rfind("\n", 0, start), text.rfind("\r", 0, start), 0)].splitlines()[
            -COMMENT_LINES:]):
        if (m := _LINE_COMMENT.match(line)) is None or m.group(1) != marker:
            break
        lines.append(line[m.end() :])
    return "\n".join(reversed(lines))


@functools.lru_cache(maxsize=4)  # one scan for a suggestion and its alternatives
def _brackets_open_in(text: str) -> tuple[tuple[str, ...], str] | None:
    stack: list[str] = []
    for i, tok in _rust_brackets(text):
        if tok == "//":
            return _brackets_open_in(_comment_code(text, i))
        if not tok:
            return None
        if tok == "'":
            return tuple(stack), text[i:]
        if tok in OPENERS:
            stack.append(tok)
        elif not stack or stack.pop() != CLOSERS[tok]:
            return None
    return tuple(stack), ""


def _cut_unopened_closers(comp: str, prefix: str) -> str:
    """The completion cut before a closer of no bracket open before the cursor, or of another one (`.collect())` where
    only `map(` was open), or of another one than the completion opened (`(a}`): a small model often writes one closer
    too many or in the wrong order, and accepting it breaks the code. It is read on from the char literal the cursor is
    in (`'(` answered "'));"), whose bracket is none."""
    if (opened := _open_brackets(prefix)) is None:
        return comp
    stack, lit = list(opened[0]), opened[1]
    own: list[str] = []  # brackets the completion opens itself
    for i, tok in _rust_brackets(lit + comp):
        if tok in ("", "'", "//"):
            break
        if tok in OPENERS:
            own.append(tok)
        else:
            pending = own or stack  # its own brackets first, then those open before the cursor
            if not pending or pending.pop() != CLOSERS[tok]:
                return comp[: max(0, i - len(lit))]
    return comp


def _is_subsequence(a: str, b: str) -> bool:
    """Whether `a`'s characters appear in `b` in order: `b` replacing `a` deletes none of them."""
    it = iter(b)
    return all(c in it for c in a)


def _code_before_comment(after: str, before: str) -> str:
    """The rest of the line `after` without the comment that ends it (`); // done`: ");"), stripped; all of it where
    it has none or the cursor is in a string (`"http:█//x"`), whose `//` is text."""
    if _inside_string(before) is None:
        for m in _RUST_TOKENS.finditer(after):
            if m.group().startswith("//") or m.group("comment") and after.rstrip().endswith("*/"):
                return after[: m.start()].strip()
            if m.group("comment"):
                break
    return after.strip()


def _closes(s: str, opened: tuple[str, ...]) -> int:
    """How many of the brackets `opened` before the cursor (innermost last), innermost first, `s` closes."""
    excess = [c for _, c, e in _scan_depth0(s).items if e]
    k = 0
    while k < min(len(excess), len(opened)) and opened[-1 - k] == CLOSERS[excess[k]]:
        k += 1
    return k


def _trim_after_overlap(comp: str, after: str, before: str | None = None, prefix: str = "") -> str:
    """Mid-line: drop the part of the completion that writes the rest of the line again. `before` (the line's text
    before the cursor) and `prefix` (the document's), where given, let the rest's code before a comment count as the
    rest, and make nothing of an answer whose text at the cursor takes the rest's closers for brackets of its own."""
    tail = after.strip()
    if not tail:
        return comp
    # It ends with the whole rest of the line (`fn main(█{` answered ") {"), or with its code before a comment ending
    # it (`foo(█); // done` answered "a);"): the line it wrote is the document's with its own text at the cursor,
    # whatever brackets that text opens (`{` was no cut point, so `{{` was left)...
    line = comp.rstrip(" \t")
    code = tail if before is None else _code_before_comment(after, before)
    for rest in dict.fromkeys((tail, code)):
        if rest and line.endswith(rest) and len(line) > len(rest):
            cut = line[: len(line) - len(rest)]
            if before is not None:
                opened = (_open_brackets(prefix) or ((), ""))[0]
                if _closes(cut + code, opened) < _closes(code, opened):
                    # ...but not where a closer of the rest closes a bracket of that text's (`f(█x)` answered
                    # "g(x)"): the document's, which closed one before the cursor, is gone (`f(g(x)`; inserted whole,
                    # `f(g(x)x)`).
                    return ""
            return cut.rstrip(" \t") if after[:1].isspace() else cut
    depth0 = {i for i, _, _ in _scan_depth0(comp).items}
    # The completion contains the rest of the line, starting at bracket depth 0: cut there.
    pos = comp.find(tail)
    while pos >= 0:
        if pos in depth0 or pos == 0:
            # `after`'s own leading whitespace stays in the document: the cut must not add a second copy.
            return comp[:pos].rstrip(" \t") if after[:1].isspace() else comp[:pos]
        pos = comp.find(tail, pos + 1)
    # The completion ends with the start of the rest of the line (at least 3 characters of it).
    head = after.lstrip()
    for k in range(min(len(head), len(comp)), 2, -1):
        if comp.endswith(head[:k]) and (len(comp) - k) in depth0 | {0}:
            cut = comp[: len(comp) - k]
            return cut.rstrip(" \t") if after[:1].isspace() else cut
    return _trim_closers_there(comp, after)


def _trim_closers_there(comp: str, after: str) -> str:
    """Cut the completion's closing brackets where the document's, right after the cursor, close the same brackets
    (`f(x█).collect())` answered "x * 2)"): accepting would close them twice. Whitespace between closers on either
    side does not matter. Only closers of brackets opened before the cursor, all at the completion's end, are cut, and
    only as many as the document has there: a closer it lacks stays."""
    doc = [c for c in after[: len(after) - len(after.lstrip(_CLOSERS_WS))] if c in CLOSERS]
    excess = [(i, c) for i, c, e in _scan_depth0(comp).items if e]
    if not excess or not doc or excess[0][0] < len(comp.rstrip(_CLOSERS_WS)):
        return comp  # it closes a bracket and writes on: the document's closers are not its own
    mine = [c for _, c in excess]
    k = min(len(mine), len(doc))
    # Its first k close what the document's close; cutting its last k instead must write the same closers.
    if mine[:k] != doc[:k] or mine[k:] + doc[:k] != doc[:k] + mine[k:]:
        return comp
    cut = comp[: excess[len(excess) - k][0]]
    return cut.rstrip(" \t") if after[:1].isspace() else cut


_CLOSERS_WS = ")]} \t"


def _period(s: str) -> int | None:
    """The shortest p such that s is a repetition of s[:p] (allowing a partial last copy), p <= len/4."""
    n = len(s)
    for p in range(1, n // 4 + 1):
        if all(s[i] == s[i % p] for i in range(p, n)):
            return p
    return None


def is_self_repeating(s: str) -> bool:
    """Noise a small model falls into: one short unit over and over ("aaaaaa", "))))))", "a, a, a, a")."""
    t = "".join(s.split())
    return len(t) >= 6 and _period(t) is not None and len(set(t)) <= 4


def _line_period(lines: list[str]) -> int | None:
    """The shortest p (p <= len/3) such that the non-blank lines repeat with period p: a loop of a block."""
    n = len(lines)
    for p in range(1, n // 3 + 1):
        if any(lines[i].strip() for i in range(p)) and all(
                lines[i].rstrip() == lines[i % p].rstrip() for i in range(p, n)):
            return p
    return None


def _one_line_block(kept: list[str], cur: Cursor) -> str:
    """With max_lines=1, a completion that starts the block the cursor's `{` opens on the next line: its body on the
    cursor's line (`{ body }`) where the model wrote a one-line body and closed it (or the closer is after the cursor).
    A line break would break the one-line promise and a longer body is no one-liner: else the first line, as before."""
    lines = [ln for ln in kept[1:] if ln.strip()]
    if kept[0].strip() or not lines or len(lines) > 2:
        return kept[0]
    body = lines[0].strip()
    closer = lines[1] if len(lines) == 2 else None
    if closer is None:
        closed = not kept[-1].strip() and cur.after.lstrip().startswith("}")  # it ended its line before the doc's `}`
    else:
        closed = closer.lstrip().startswith("}") and len(leading_ws(closer)) <= len(cur.indent)
    if not closed or body[0] in CLOSERS or body[-1] in OPENERS or _has_line_comment(body):
        return kept[0]  # (a `// comment` would comment out the `}` after it)
    return " " + body + " }"


def _dedupe_lines(lines: list[str]) -> list[str]:
    """Cut at a non-blank line that repeats the one before it exactly (a loop, never valid code twice)."""
    out: list[str] = []
    for ln in lines:
        if out and ln.strip() and ln.rstrip() == out[-1].rstrip():
            break
        out.append(ln)
    return out


def _indent_style(cur: Cursor) -> str | None:
    """The document's indentation character near the cursor ("\t" or " "), or None where no line shows one."""
    for ln in (cur.indent + "x", cur.previous_line or "", *cur.next_lines):  # (the cursor line's indent first)
        if ln[:1] in ("\t", " ") and ln.strip():
            return ln[0]
    return None


def _space_unit(lines: list[str]) -> int:
    """The indentation step of the space-indented ones of `lines`: 2 where their indents say so, else 4 (rustfmt's)."""
    g = 0
    for ln in lines:
        ws = leading_ws(ln)
        if ln.strip() and ws and "\t" not in ws:
            g = math.gcd(g, len(ws))
    return 2 if g == 2 else 4


def _restyle(lines: list[str], style: str | None, unit: int) -> list[str]:
    """Leading whitespace in the document's style: a small model writes spaces (rustfmt's) into a tab-indented file
    more often than not, and "\t    " lines mix the two (each `unit` spaces is one tab, and the other way round)."""
    if style is None:
        return lines
    out = []
    for ln in lines:
        ws = leading_ws(ln)
        other = " " if style == "\t" else "\t"
        if other not in ws or not ln.strip():
            out.append(ln)
            continue
        cols = _width(ws, unit)
        new = "\t" * (cols // unit) + " " * (cols % unit) if style == "\t" else " " * cols
        out.append(new + ln[len(ws) :])
    return out


def _width(ws: str, unit: int) -> int:
    """Columns of leading whitespace, a tab counting `unit`: tabs and spaces compare by what an editor shows."""
    return sum(unit if c == "\t" else 1 for c in ws)


def _reindent(lines: list[str], base_from: str, base_to: str) -> list[str]:
    if base_from == base_to:
        return lines
    out = []
    for ln in lines:
        if ln.startswith(base_from) and ln.strip():
            out.append(base_to + ln[len(base_from) :])
        else:
            out.append(ln)
    return out


def postprocess(p: Plan, raw: str, ended_line: bool = False) -> Suggestion | None:
    """Turn the daemon's raw completion for plan `p` into what the editor shows, or None to show nothing.
    `ended_line`: the model ended raw's last line, with a line break that the stop sequence ending the completion held
    back (the daemon's Done.stop_sequence begins with one: ended_by_line_break)."""
    cur = p.cursor
    if cur.before.endswith("\r"):
        return None  # the cursor splits a "\r\n" (no editor puts it there): any text inserted would split it too
    if rest := word_rest(cur):
        return _from_word_end(p, raw, ended_line, rest)
    comp = raw.replace("\r\n", "\n").replace("\r", "\n") + ("\n" if ended_line else "")
    ends_line = ended = False
    if not p.multiline:
        comp, brk, _ = comp.partition("\n")
        ended = bool(brk)
        # A line asked for before a line's code, that the model ended: a whole line of its own above that code.
        ends_line = ended and cur.at_line_head
    start = cur.offset

    # Indentation in the document's style (the first line of a completion mid-line continues the cursor's line).
    style = _indent_style(cur)
    unit = _space_unit([*cur.next_lines, cur.previous_line or "", cur.indent] if style == " " else comp.split("\n"))
    head, sep, rest = comp.partition("\n") if not cur.blank_line else ("", "", comp)
    comp = head + sep + "\n".join(_restyle(rest.split("\n"), style, unit))

    if cur.blank_line:
        # Generated from column 0: skip blank lines it began with, then re-indent to the line's whitespace.
        lines = comp.split("\n")
        while len(lines) > 1 and not lines[0].strip():
            lines.pop(0)
        if not lines[0].strip():
            return None
        model_indent = leading_ws(lines[0])
        if cur.indent:
            lines = _reindent(lines, model_indent, cur.indent)
        comp = "\n".join(lines)
        start = cur.line_start
        block_indent = leading_ws(lines[0])
    else:
        block_indent = cur.indent

    lines = comp.split("\n")
    nxt = next((ln.rstrip() for ln in cur.next_lines if ln.strip()), None)
    if cur.blank_line and nxt is not None and lines[0].rstrip() == nxt:
        return None  # it would write the line that follows again
    if (p.multiline and len(lines) > 1 and cur.after.strip() and not cur.at_line_head and nxt is not None
            and nxt.strip()[0] not in CLOSERS and len(leading_ws(nxt)) >= len(cur.indent)):
        # Mid-line (code before the cursor, closers after it) with code of the block on the next line: the user is
        # finishing this line among lines that exist (`#[█]` answered "test]\n#[should_panic]"), where the lines after
        # its first were wrong in held-out cases whose first line was right (benchmarks/eval_midline.py --after
        # closers). At a line's head (a block's body before its `}`) its lines are whole lines above that code.
        # Not where its first line leaves open a bracket that its next lines fill: the body of one the line ends
        # with (`if x {█}` answered "\n        foo();\n    }", shown as nothing), or of the one the cursor is in,
        # the line ending with an argument's `,` (`foo(█);` answered "a,\n        b,\n    );": `foo(a,);`).
        head = (cur.before + lines[0]).rstrip()
        if not (head[-1:] in OPENERS or head.endswith(",") and any(c in CLOSERS for c in cur.after)
                and not any(e for _, _, e in _scan_depth0(lines[0]).items)):
            lines = lines[:1]
    if p.multiline and len(lines) > 1:
        # Stop before a line indented less than the cursor's block; after the line that closes a block the
        # cursor line opened; cap the length; cut repetition loops.
        opens_block = (cur.before + lines[0] if not cur.blank_line else lines[0]).rstrip()[-1:] in OPENERS
        kept = [lines[0]]
        # How far out the document's own next line is: the block's end, when it is further out than the block's closer.
        nxt_depth = None if nxt is None else _width(leading_ws(nxt), unit)
        for ln in lines[1:]:
            depth, block = _width(leading_ws(ln), unit), _width(block_indent, unit)
            if ln.strip() and depth < block:
                # The line closing the cursor's block (`}`, `} else {`, `});`), one level out, where the document has
                # no closer there yet (its next line is further out): what the user types next. Cut before it, the
                # suggestion at a block's last statement left the `}` to type, and at its end (`return x;|`) showed
                # nothing.
                if ln.strip()[0] in CLOSERS and block - depth == unit and nxt_depth is not None and nxt_depth < depth:
                    kept.append(ln)
                break
            kept.append(ln)
            if opens_block and ln.strip() and depth == block and ln.strip()[0] in CLOSERS:
                break
        kept = _dedupe_lines(kept)
        if (period := _line_period(kept)) is not None:
            kept = kept[:period]
        elif (period := _line_period(kept[1:])) is not None:  # the loop starts after the cursor line
            kept = kept[: 1 + period]
        if p.max_lines == 1 and not cur.blank_line and cur.before.rstrip().endswith("{"):
            kept = [_one_line_block(kept, cur)]
        kept = kept[: p.max_lines]
        # Lines that duplicate the document's next non-blank line: the model ran into existing code.
        if nxt is not None:
            for j in range(1, len(kept)):
                if kept[j].strip() and kept[j].rstrip() == nxt:
                    kept = kept[:j]
                    break
        ends_line = kept == lines and not lines[-1].strip()  # all of it (its last line too), a line break last
        # Before a line's code (only its indentation before the cursor) the lines it inserts are whole lines: one
        # cut above before a line of the model's ends there too.
        ends_line = ends_line or (kept != lines and cur.at_line_head)
        while len(kept) > 1 and not kept[-1].strip():
            kept.pop()
        lines = kept
    comp = "\n".join(lines)
    if (closed := _cut_unopened_closers(comp, p.prefix)) != comp:
        comp, lines, ends_line = closed, closed.split("\n"), False
    if len(lines) > 1:
        comp = comp.rstrip()
    elif cur.after.strip():
        comp = comp.rstrip("\n")
    else:
        comp = comp.rstrip()

    end = cur.offset
    if cur.blank_line:
        end = cur.line_end
    elif cur.after:
        if all(c in TRAILING_OK for c in cur.after):
            closed, end = _match_closers(comp, cur, p.prefix)
            # A one-line answer's break is a layout only where the line is all its own (`    █}` answered
            # "body();\n"): joined, it left `body();}`, or `body();    }` with the cursor at column 0.
            if ends_line and (len(lines) > 1 or cur.at_line_head) and closed == comp and end == cur.offset:
                closed, end = _closers_on_their_line(comp, cur)
            comp = closed
        else:
            trimmed = _trim_after_overlap(comp, cur.after, cur.before, p.prefix)
            if (ended and trimmed == comp and not cur.at_line_head
                    and not all(c in TRAILING_OK for c in _code_before_comment(cur.after, cur.before))):
                # The model ended its line where the document's goes on with other code (`name█{` answered
                # ": input.call(x)?,\n"): it rewrote the line, and inserted, its text left the old code behind it
                # (`name: input.call(x)?,{`). Of such answers on held-out crates none was right. A comment is no
                # code: before `; // why` the line ends where the model ended it (`let x = █; // why` answered "5").
                return None
            if ends_line and cur.at_line_head and trimmed == comp:
                # Whole lines before the line's code (`█    } else {` answered "        x += 1;\n"): that code
                # starts a line again, after the indentation that was before the cursor. Joined, it read
                # `        x += 1;    } else {`.
                trimmed = comp + "\n" + cur.before
            comp = trimmed

    typed = cur.before if cur.blank_line else ""
    body = comp[len(typed) :] if comp.startswith(typed) else comp
    if not body.strip():
        return None
    if not cur.blank_line and end > cur.offset and comp == cur.after[: end - cur.offset]:
        return None  # it only types the closers that are already there
    if is_self_repeating(body):
        return None
    # The whole line it would make only repeats the line above (at the end of a line, nothing new after).
    first_line = (cur.before + body if not cur.blank_line else comp).split("\n", 1)[0]
    if (cur.previous_line is not None and "\n" not in body and first_line.strip() == cur.previous_line.strip()
            and not cur.after.strip() and len(first_line.strip()) > 1):
        return None
    if cur.newline != "\n":
        comp = comp.replace("\n", cur.newline)
    return Suggestion(comp, start, end)


def is_word_char(c: str) -> bool:
    """A character of an identifier or word, of any script (what editors filter completion menus by)."""
    return c.isalnum() or c == "_"


def word_rest(cur: Cursor) -> str:
    """The rest of the word the cursor is inside (`tot█al = 1;`: "al"), or "" where it is not inside one."""
    if not (cur.before[-1:] and is_word_char(cur.before[-1]) and cur.after[:1] and is_word_char(cur.after[0])):
        return ""
    n = next((i for i, c in enumerate(cur.after) if not is_word_char(c)), len(cur.after))
    return cur.after[:n]


def _from_word_end(p: Plan, raw: str, ended_line: bool, rest: str) -> Suggestion | None:
    """postprocess at a cursor inside a word, whose `rest` follows the cursor. Healed, the model writes the word again
    from its start, and nearly always its rest too (`tot█al = 1;` answered "al = 10;"): inserted at the cursor, that
    doubled the rest (`total = 10;al = 1;`). Such an answer is what the model writes after the word: post-processed
    there, shown from the cursor over the rest (the editor shows it after the word), and nothing where it then writes
    other code than the line has after the word (a rewrite of the line, which an insertion cannot show without leaving
    the old code behind it). An answer that does not write the rest first splits the word (`co█unts` answered
    "mment", `*commentunts`): nothing either."""
    cur = p.cursor
    comp = raw.replace("\r\n", "\n").replace("\r", "\n")
    if not comp.startswith(rest):
        return None
    tail, after = comp[len(rest) :], cur.after[len(rest) :]
    line = tail.partition("\n")[0]
    if any(c not in TRAILING_OK for c in after) and line.strip() and _trim_after_overlap(line, after) == line:
        return None
    at = replace(cur, offset=cur.offset + len(rest), before=cur.before + rest, after=after)
    s = postprocess(replace(p, prefix=p.prefix + rest, suffix=p.suffix[len(rest) :], cursor=at), tail, ended_line)
    return None if s is None else Suggestion(rest + s.text, cur.offset, s.end)


# -- typed-through and accept-ahead ---------------------------------------------------------------------------


# The front ends' default floor: on held-out crates it hid about half of the wrong single-line suggestions of
# m31r-mini 0.7.0 and 1-5% of the right ones (README "Confidence").
MIN_PROBABILITY = 0.05


def ended_by_line_break(stop_sequence: str | None) -> bool:
    """Whether the stop sequence that ended a completion (Done.stop_sequence) began with a line break: the model
    ended the text's last line (postprocess's ended_line). An older daemon says nothing: False."""
    return stop_sequence is not None and stop_sequence[:1] in ("\n", "\r")


def finished_lines(text: str, finish_reason: str | None) -> tuple[str, bool]:
    """A multi-line answer that ran out of tokens (`length`) mid-line, without that unfinished line, and whether the
    text now ends at a line the model ended (postprocess's ended_line). `max_tokens` cuts at a token, so such a last
    line is almost never whole (`.action(ArgA`), and accepted it leaves the user a broken statement to finish by hand.
    Other answers, and one that is a single line, as they are."""
    if finish_reason != "length" or "\n" not in text or text.endswith("\n"):
        return text, False
    return text[: text.rindex("\n")], True


def to_postprocess(raw: str, sure: str, stop_sequence: str | None, finish_reason: str | None) -> tuple[str, bool]:
    """What postprocess takes of an answer `raw` whose confident lines are `sure` (confident_lines), and its
    ended_line: where the floor cut lines, the text no longer ends where the model ended it; otherwise the model's
    end (a stop beginning with a line break) or max_tokens' unfinished line (finished_lines) decides."""
    if sure != raw:
        return sure, False
    text, cut = finished_lines(raw, finish_reason)
    return text, cut or ended_by_line_break(stop_sequence)


def confident(line_logprob: float | None, min_probability: float) -> bool:
    """Whether the model gave the suggestion's first line (Done.line_logprob) at least `min_probability`. On the
    held-out crates that probability sorts right lines from wrong ones well (README "Confidence"), so a floor hides
    mostly wrong suggestions. An answer without the figure (an older daemon) is shown."""
    return line_logprob is None or min_probability <= 0 or line_logprob >= math.log(min_probability)


def _first_shown_lines(raw: str) -> int:
    """The lines of `raw` up to and including its first with text: the line an editor shows first, after the line
    breaks a completion at a line's end begins with ("\n    body();")."""
    for i, line in enumerate(raw.split("\n")):
        if line.strip():
            return i + 1
    return 1


def first_line_logprob(raw: str, line_logprob: float | None, logprob_by_line: list[float]) -> float | None:
    """The log-probability of the first line an editor shows of `raw` (what `confident` gates): Done.line_logprob,
    or, where `raw` begins with blank lines, theirs and its first line with text's summed. Gated on line_logprob
    alone, such a completion was judged by its line break, near certain, and confident_lines then cut the line after
    it: nothing shown, not even to a user who asked for a suggestion (an invoked request shows an unsure one)."""
    n = _first_shown_lines(raw)
    if n == 1 or len(logprob_by_line) < n:
        return line_logprob
    return sum(logprob_by_line[:n])


def confident_lines(raw: str, logprob_by_line: list[float], min_probability: float, whole_lines: bool = False) -> str:
    """`raw` cut before the line at which the model's probability of its lines so far (Done.logprob_by_line summed)
    falls under `min_probability`; the first line shown is kept (`confident` of first_line_logprob is its gate), with
    the blank lines before it. The floor that decides whether a suggestion shows thus also decides how much of it: on
    the held-out crates, cut at the editors' 0.05 the shown multi-line suggestions kept every right line and lost two
    thirds of the wrong ones (README "Confidence"). Lines without a figure (an older daemon) are kept. `whole_lines`
    (the cursor before a line's code, only indentation before it: `    █}`): what is kept of a cut answer ends with the
    break of its last line, so the closers after the cursor keep their own line (`postprocess`), not `body();    }`."""
    if min_probability <= 0 or len(logprob_by_line) < 2:
        return raw
    floor, lines, keep = math.log(min_probability), raw.split("\n"), _first_shown_lines(raw)
    total = sum(logprob_by_line[:keep])
    for i in range(keep, min(len(lines), len(logprob_by_line))):
        total += logprob_by_line[i]
        if total < floor:
            return "\n".join(lines[:i]) + ("\n" if whole_lines else "")
    return raw


def predicted(shown: Shown) -> str:
    """What the shown suggestion adds after the cursor it was shown at."""
    s = shown.suggestion
    return s.text[shown.offset - s.start :]


def typed_through(shown: Shown, text: str, offset: int) -> Suggestion | None:
    """If the user typed the start of what `shown` predicted (and nothing else changed), the rest of it,
    as a Suggestion on the new text; else None."""
    pred = predicted(shown)
    c0 = shown.offset
    n = offset - c0
    if n <= 0 or n >= len(pred.rstrip()) or text[c0:offset] != pred[:n] or text[:c0] != shown.text[:c0]:
        return None
    s = shown.suggestion
    if len(text) == len(shown.text) + n and text[offset:] == shown.text[c0:]:
        end = s.end + n
    else:
        # The editor's own bracket handling changed the closers after the cursor as the user typed: it auto-closed a
        # typed `(` (`f(|)`) or the typed `)` overtyped one. Still the same suggestion if accepting it now gives the
        # document it gave, replacing only closers: the typed-through was lost on every bracket, and the model, asked
        # again, often answered something else or nothing.
        tail = shown.text[s.end :]
        end = len(text) - len(tail)
        if (not text.endswith(tail) or end < offset or not set(text[offset:end]) <= _AUTO_CLOSED
                or not set(shown.text[c0 : s.end]) <= _AUTO_CLOSED):
            return None
        if s.end == c0:
            # The shown one replaced nothing after its cursor: every closer there now the editor wrote for a bracket
            # typed from it. Those the rest does not write again stay after it (`ffi_dispatch!(|)` with the rest of a
            # line cut before its `)`: inserted before the `)`, as typing it out would leave it), not dropped.
            end = offset + _closers_rewritten(text[offset:end], pred[n:])
    replaced = text[offset:end]  # what it replaces after the cursor: closers it writes again, blank indent
    if pred[n:] == replaced or not _is_subsequence(replaced, pred[n:]):
        # All it has left are the closers already there (`foo(a|)`): nothing to show, the model is asked. Or what
        # is typed was the part of it that wrote them again: the rest would delete them.
        return None
    return Suggestion(s.text, s.start, end)


# What an editor inserts after the cursor when the user types an opening bracket or quote, and lets the user overtype.
_AUTO_CLOSED = frozenset(")]}\"'`")


def _closers_rewritten(closers: str, rest: str) -> int:
    """How many of the closers after the cursor, from the first, `rest` writes again (in order)."""
    k = 0
    while k < len(closers) and _is_subsequence(closers[: k + 1], rest):
        k += 1
    return k


def typed_through_alternatives(shown: Shown, text: str, offset: int) -> list[Suggestion]:
    """The shown runners-up that the typed text agrees with too, each as typed_through makes the suggestion: an
    editor cycling through them keeps them while the user types."""
    others = (typed_through(replace(shown, suggestion=a), text, offset) for a in shown.alternatives)
    return [s for s in others if s is not None]


def accepted_state(shown: Shown) -> tuple[str, int]:
    """The document text and cursor offset once the shown suggestion is accepted."""
    s = shown.suggestion
    text = shown.text[: s.start] + s.text + shown.text[s.end :]
    return text, s.start + len(s.text)


def word_before(text: str, offset: int) -> int:
    """Offset where the word ending at `offset` starts (completion menus filter on it; `grö█`: at `g`)."""
    i = offset
    while i > 0 and is_word_char(text[i - 1]):
        i -= 1
    return i


def alternatives(p: Plan, shown: Suggestion | None, raws: list[str], ended_line: bool = False) -> list[Suggestion]:
    """A beam search's runners-up (`Done.alternatives`) as further suggestions: each post-processed like the first,
    leaving out any that show nothing or the same as `shown` or one before it. `ended_line`: the answer's (the daemon
    searches only completions a line end stops, and says how only the answer ended: the runners-up are taken to have
    ended as it did, so that cycling to one at a line's head does not join it to the code after the cursor)."""
    out: list[Suggestion] = []
    for raw in raws:
        s = postprocess(p, raw, ended_line)
        if s is not None and s != shown and s not in out:
            out.append(s)
    return out

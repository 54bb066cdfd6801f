"""The fill-in-the-middle prompt layout, shared by serving and training so both see the same tokens.

    <|fim_suffix|> S <|fim_prefix|> P_above <|fim_middle|> P_line  →  model writes the rest of the middle

Suffix first, so typing only appends: while the user types on a line only P_line (the cursor line's text
before the cursor) changes, and Enter moves that line into P_above, again an append. Each part is
tokenised on its own, so an edit in one part never changes the tokens of another.

Truncation keeps the sequence stable too: S keeps whole lines forward from the cursor up to a token
budget; P_above starts at a line whose index is a multiple of `line_step`, the first that fits its budget,
so its start moves only every few lines of growth, never with each keystroke. Where that would keep less than
half of what fits (`line_step` long lines pass the budget), a finer step does (cut_above).

Token healing: a cursor may stand inside what would be one token of the finished line (`foo.ba|` of
`foo.bar()`, or indentation that the finished line tokenises as `   ` + ` let`). The prompt therefore ends one
token early, and the completion must start with that token's text (`FimPrompt.heal`): the engine allows only
tokens consistent with it, then leaves it out of the text it returns. Training lays samples out the same way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from m31r.stops import RepeatedLine
from m31r.tokenizer import Tokenizer


@dataclass(frozen=True)
class FimBudget:
    suffix: int  # tokens of S
    line: int  # tokens of P_line
    above: int  # tokens of P_above
    reserve: int  # tokens left for the completion
    line_step: int = 16  # P_above starts at a line index that is a multiple of this (or of a finer step: cut_above)

    @classmethod
    def for_context(cls, max_context: int, line_step: int = 16) -> FimBudget:
        suffix, line, reserve = max_context // 8, max_context // 16, max_context // 8
        return cls(suffix, line, max_context - suffix - line - reserve - 3, reserve, line_step)

    @property
    def max_reserve(self) -> int:
        """The longest completion a FIM request may ask for: half the context, the rest for the code around it."""
        return (self.suffix + self.line + self.above + self.reserve + 3) // 2

    def with_reserve(self, max_tokens: int) -> FimBudget:
        """This layout, with room for `max_tokens` where they pass the usual reserve (up to max_reserve): the lines
        above the cursor give it up, so a long completion costs context rather than its own end. Requests within
        the reserve keep the one layout, and with it their prefix cache."""
        if max_tokens <= self.reserve:
            return self
        if max_tokens > self.max_reserve:
            raise ValueError(f"max_tokens {max_tokens} is more than a fim completion may have ({self.max_reserve})")
        return dataclasses.replace(self, above=self.above - (max_tokens - self.reserve), reserve=max_tokens)


@dataclass(frozen=True)
class FimPrompt:
    ids: list[int]
    suffix_tokens: int
    above_tokens: int
    line_tokens: int
    above_start_line: int  # index of the first line of P_above kept
    heal: str = ""  # text of P_line's last token, left out of ids: the completion starts by writing it again
    truncated: bool = False  # the prefix or suffix lost text to its budget (lines far from the cursor, a line's end)


def split_prefix(prefix: str) -> tuple[str, str]:
    """(P_above, P_line): the complete lines above the cursor, and the cursor line's text before it.

    Lines end at "\\n", "\\r\\n" and a lone "\\r" (old Mac files), as cut_above's str.splitlines counts them: split at
    "\\n" alone, a CR-only prefix was all one cursor line, kept to P_line's few tokens. Text without a lone "\\r" splits
    as before (training's corpus is LF); form feeds and the like, which splitlines breaks at too, stay in their line
    as they always did. The "\\r" is looked for after the last "\\n" only, not through a long prefix."""
    nl = prefix.rfind("\n")
    cut = max(nl, prefix.rfind("\r", nl + 1)) + 1
    return prefix[:cut], prefix[cut:]


def _token_counts(tok: Tokenizer, lines: list[str]) -> list[int]:
    return [len(ids) for ids in tok.encode_batch(lines)] if lines else []


def _cut_between(tok: Tokenizer, left: int, right: int) -> bool:
    """Whether a cut between these two adjacent tokens of an encoded text falls between whole characters, and not
    between the CR and LF of one line end. A cut inside a character decodes its bytes to U+FFFD, text the file never
    had (a long line of CJK or accented text); one inside CR LF leaves a lone CR, a line end the file never had."""
    a, b = tok.token_bytes[left] or b"", tok.token_bytes[right] or b""
    if b and 0x80 <= b[0] < 0xC0:  # `right` opens with a continuation byte: the character began in `left`
        return False
    return not (a.endswith(b"\r") and b.startswith(b"\n"))


def keep_head(tok: Tokenizer, ids: list[int], n: int) -> list[int]:
    """At most the first `n` of an encoded text's ids, ending between whole characters (see _cut_between)."""
    if len(ids) <= n:
        return ids
    n = max(n, 0)
    while n > 0 and not _cut_between(tok, ids[n - 1], ids[n]):
        n -= 1
    return ids[:n]


def keep_tail(tok: Tokenizer, ids: list[int], n: int) -> list[int]:
    """At most the last `n` of an encoded text's ids, starting between whole characters (see _cut_between)."""
    if len(ids) <= n:
        return ids
    i = len(ids) - max(n, 0)
    while i < len(ids) and not _cut_between(tok, ids[i - 1], ids[i]):
        i += 1
    return ids[i:]


def cut_suffix(tok: Tokenizer, suffix: str, budget: int) -> str:
    """Whole lines forward from the cursor while they fit; the first line is cut by tokens if it alone
    is too long."""
    lines = suffix.splitlines(keepends=True)
    kept, used = 0, 0
    first: list[int] = []  # the first line's ids, kept for a cut by tokens: a line of megabytes is encoded once
    # Count lazily in small batches: a long file's suffix is mostly beyond the budget.
    while kept < len(lines):
        batch = tok.encode_batch(lines[kept : kept + 32])
        first = first or batch[0]
        for n in map(len, batch):
            if used + n > budget:
                break
            used += n
            kept += 1
        else:
            continue
        break
    if kept == 0 and lines:
        if budget <= 0:
            return ""
        return tok.decode(keep_head(tok, first, budget))
    return "".join(lines[:kept])


def above_steps(line_step: int) -> list[int]:
    """The steps P_above's start may fall on, coarsest first: `line_step`, then finer steps each dividing the one
    before (16, 4, 1), so a cut at a multiple of `line_step` (the language server's, m31r_lsp.completion) is one at a
    multiple of each of them too."""
    steps = [max(1, line_step)]
    while steps[-1] > 1:
        s = steps[-1]
        steps.append(next(d for d in range(max(1, s // 4), 0, -1) if s % d == 0))
    return steps


def cut_above(tok: Tokenizer, above: str, budget: int, line_step: int) -> tuple[str, int]:
    """The tail of `above` that fits `budget` and its first line's index: a multiple of `line_step` where the lines
    from there keep at least half the tokens of the most whole lines that fit, else a multiple of the next finer step
    (above_steps) that does, down to a single line.

    A coarse step keeps the start still while lines are added, so the daemon's prefix cache holds across Enter; but
    where `line_step` lines pass the budget (long dense lines, a small context, a long completion's budget) the lines
    from the nearest multiple never fit, and the prompt had no line above the cursor at all, or kept one or two where
    the budget held a dozen. The finer steps serve those cursors, still moving the start only every few lines."""
    lines = above.splitlines(keepends=True)
    n = len(lines)
    counts: list[int] = []  # tokens of lines[n - 1], lines[n - 2], ...: those that fit, walking up from the cursor
    used = 0
    # Count lazily in small batches: a long file's lines above are mostly beyond the budget.
    while len(counts) < n:
        end = n - len(counts)
        for c in reversed(_token_counts(tok, lines[max(0, end - 32) : end])):
            if used + c > budget:
                break
            used += c
            counts.append(c)
        else:
            continue
        break
    fit = n - len(counts)  # the first of the most whole lines that fit
    for step in above_steps(line_step):
        start = min(-(-fit // step) * step, n)
        kept = sum(counts[: n - start])
        if 2 * kept >= used:
            break
    return "".join(lines[start:]), start


HEAL_WORD_BYTES = 24  # the longest word fragment healing takes back; a longer one keeps its start in the prompt


def _word_char(c: str) -> bool:
    return c.isalnum() or c == "_"


_RUN = frozenset("(){}[];,?#\"")  # what the pre-tokenizer joins into runs of up to four (m31r.train.tokenizer)


def _joins(tok: Tokenizer, prev: str, healed: str) -> str:
    """Whether token text `prev` is part of the pre-tokenizer piece that `healed` (the text taken back so far) ends:
    "word" (a word's own token, or a bracket run's: go on), "opens" (what opens a word's piece, where some token
    spans the two: a lone space, a lifetime's `'`, the `&` of `&mut`; it starts there) or "". A prompt that keeps
    it ends in a split of that piece no finished text has: `&mu` as `&` + `mu`, where `&mut` is one token, or
    `    asser` as `   ` + ` ` + `asser`, where `assert` is ` assert`; the model goes on from ids it never saw."""
    h, run = healed[0], set(healed) <= _RUN
    if _word_char(h) and _word_char(prev[-1]):
        return "word"
    if not tok.starts_a_token((prev + h).encode()):
        return ""
    if run and set(prev) <= _RUN:
        return "word"
    if prev[:1] == " " and (set(prev[1:]) <= _RUN if run else prev == " " and _word_char(h)):
        return "opens"
    if prev in ("'", " '") and (h.isalpha() or h == "_") or prev in ("&", " &") and "mut".startswith(healed):
        return "opens"
    return ""


def heal_split(tok: Tokenizer, line_ids: list[int]) -> tuple[list[int], str]:
    """(ids without the text to heal, that text): the last token, and the tokens before it that spell the same
    word, so a cursor inside a word owes the whole fragment. `thi` as `th` + `i` healed by its last token alone
    leaves the model to go on from a split no training text has, and it ends the word there; owing `thi`, it
    writes `this`. So too what opens the word's pre-tokenizer piece, and a bracket run's tokens (_joins). Where the
    last token ends a character that earlier byte tokens began (`é` as two byte tokens), all of them: the healed
    text is always whole characters."""
    for k in range(1, min(4, len(line_ids)) + 1):
        pieces = [tok.token_bytes[i] for i in line_ids[-k:]]
        if any(p is None for p in pieces):
            return line_ids, ""
        try:
            healed = b"".join(pieces).decode("utf-8")
        except UnicodeDecodeError:
            continue
        ids, size = line_ids[:-k], sum(map(len, pieces))
        while ids and (prev := tok.token_bytes[ids[-1]]):
            try:
                text = prev.decode("utf-8")
            except UnicodeDecodeError:
                break
            joins = _joins(tok, text, healed)
            if not joins or size + len(prev) > HEAL_WORD_BYTES:
                break
            ids, healed, size = ids[:-1], text + healed, size + len(prev)
            if joins == "opens":
                break
        return ids, healed
    return line_ids, ""


def heal_prompt(tok: Tokenizer, ids: list[int]) -> tuple[list[int], str]:
    """A plain (generate) prompt's ids and the text to heal at its end. A prompt that stops inside a word or after a
    space ends in a token split no finished text has (`for x in ` is `in` + ` `), as a FIM prompt's cursor line
    does. A prompt that is all one word keeps its ids: healing would leave nothing to continue from."""
    kept, heal = heal_split(tok, ids)
    return (kept, heal) if kept else (ids, "")


def build_fim_prompt(tok: Tokenizer, prefix: str, suffix: str, budget: FimBudget, heal: bool = True) -> FimPrompt:
    above, line = split_prefix(prefix)
    # The cuts count tokens line by line; encoded whole, a text can come out a few tokens longer (a first suffix line
    # cut by tokens, then decoded and encoded again): the ids are held to their budgets all the same, so a prompt
    # never takes the completion's room. Every cut by tokens keeps whole characters (keep_head, keep_tail).
    s_text = cut_suffix(tok, suffix, budget.suffix)
    s_all = tok.encode(s_text)
    s_ids = keep_head(tok, s_all, budget.suffix)
    above_text, start_line = cut_above(tok, above, budget.above, budget.line_step)
    a_ids = tok.encode(above_text)
    # Lines that str.splitlines breaks but the tokenizer does not (a form feed, U+2028) can encode longer whole: start
    # a block further down, so P_above still begins at a line it names; after a few tries, cut its start by tokens.
    for _ in range(4):
        if len(a_ids) <= budget.above:
            break
        counted = sum(_token_counts(tok, above_text.splitlines(keepends=True)))  # what cut_above counted
        room = min(counted - (len(a_ids) - budget.above), counted * budget.above // len(a_ids))
        above_text, start_line = cut_above(tok, above, room, budget.line_step)
        a_ids = tok.encode(above_text)
    a_kept = keep_tail(tok, a_ids, budget.above)
    # A very long cursor line keeps its end, nearest the cursor.
    l_all = tok.encode(line)
    l_ids = keep_tail(tok, l_all, budget.line)
    # (before healing, which only moves the cursor line's last token into the completion: no text is lost)
    truncated = (len(s_text) < len(suffix) or len(s_ids) < len(s_all) or start_line > 0 or len(a_kept) < len(a_ids)
                 or len(l_ids) < len(l_all))
    l_ids, healed = heal_split(tok, l_ids) if heal else (l_ids, "")
    ids = [tok.fim_suffix_id, *s_ids, tok.fim_prefix_id, *a_kept, tok.fim_middle_id, *l_ids]
    return FimPrompt(ids, len(s_ids), len(a_kept), len(l_ids), start_line, healed, truncated)


def suffix_stop(prefix: str, suffix: str) -> str | None:
    """A stop sequence that ends a completion where it starts to write the code after the cursor again.

    A model that misses its end-of-middle runs on into the suffix: a block body followed by the block's own `}`,
    then the code below, to the token limit. The suffix's first whole non-blank line after the cursor's line (or
    the cursor's line itself, when the cursor is at its start), written as a whole line of the completion at the
    same indentation, is that point. Whole line only: `    } else {` does not match `    }`.
    """
    # Line by line from the cursor, not a split of the whole suffix: it runs per request (and per typed-through
    # keystroke) on the daemon's event loop, and a suffix can be megabytes.
    start = 0
    if prefix and not prefix.endswith("\n"):  # the cursor's line goes on in the suffix: start after it
        start = suffix.find("\n") + 1
        if start == 0:
            return None
    while (end := suffix.find("\n", start)) >= 0:  # a last line without its line end is not a whole line
        line = suffix[start:end]
        if line.strip():
            return "\n" + line.rstrip() + ("\r\n" if line.endswith("\r") else "\n")
        start = end + 1
    return None


def start_stop(prefix: str, suffix: str) -> str | None:
    """suffix_stop's line as the completion's own first line: where the cursor is at a line's start, the line end
    that suffix_stop begins with is the prefix's, so that sequence alone never matches a completion that opens with
    the suffix's next line (the model saying there is nothing to insert). A stop only at the completion's start
    (StopMatcher's start_stops)."""
    if prefix and not prefix.endswith("\n"):
        return None
    at_suffix = suffix_stop(prefix, suffix)
    return at_suffix[1:] if at_suffix else None


def line_context(prefix: str, lines: int = RepeatedLine.MAX_PERIOD) -> str:
    """The prefix's last `lines` whole lines and the cursor line's text: what the repeated-line stop (m31r.stops)
    compares a completion's first lines with, so that a completion repeating the lines above the cursor ends too."""
    i = len(prefix)
    for _ in range(lines + 1):
        i = prefix.rfind("\n", 0, max(i, 0))
        if i < 0:
            return prefix
    return prefix[i + 1 :]

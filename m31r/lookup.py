"""Prompt-lookup drafts: guesses of the next tokens, copied from the document itself (no draft model).

Code repeats itself: a completion often re-types identifiers, argument lists, `self.`-chains or whole lines that
already stand in the prefix or the suffix around the cursor. When the last few generated tokens also occur earlier
in the context, the tokens that followed them there are a cheap guess of what comes next. The engine runs such a
guess as extra rows of one decode step and keeps the part that greedy decoding confirms (Engine.generate), so the
guesses only decide how many tokens one step yields, never which.
"""

from __future__ import annotations

MAX_NGRAM = 3  # the longest suffix of the context looked up (longer matches are rarer and add little)


class Lookup:
    """The context seen so far (prompt, then every generated token), indexed by its n-grams.

    `index[n-gram]` is the position just after the latest occurrence of that n-gram that is not the context's own
    suffix, so a lookup costs one dict access per n-gram length, and each appended token adds MAX_NGRAM entries.
    """

    def __init__(self, tokens: list[int], max_ngram: int = MAX_NGRAM):
        self.tokens: list[int] = []
        self.max_ngram = max_ngram
        self.index: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def _add(self, end: int) -> None:
        """Index the n-grams that end at position `end` (exclusive)."""
        t = self.tokens
        for n in range(1, min(self.max_ngram, end) + 1):
            self.index[tuple(t[end - n : end])] = end

    def append(self, token: int) -> None:
        # The n-grams ending at the old end become "earlier occurrences" only once a token follows them.
        self.tokens.append(token)
        if len(self.tokens) > 1:
            self._add(len(self.tokens) - 1)

    def extend(self, tokens: list[int]) -> None:
        """append() for each token, in bulk: a 1k-token prompt is indexed in well under a decode step."""
        t, old = self.tokens, len(self.tokens)
        t.extend(tokens)
        lo, hi = max(old, 1), len(t) - 1  # the n-gram ends to index: old..len-1, as append() would have
        for n in range(1, self.max_ngram + 1):
            start = max(lo, n)
            if start <= hi:  # keys t[e-n:e] for e in start..hi, later ends overwriting earlier ones
                grams = zip(*(t[start - n + i : hi - n + i + 1] for i in range(n)), strict=True)
                self.index.update(zip(grams, range(start, hi + 1), strict=True))

    def drafts(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (1 to
        max_ngram tokens) of the context; [] when none of its suffixes occurred before."""
        t = self.tokens
        if k <= 0 or not t:
            return []
        for n in range(min(self.max_ngram, len(t)), 0, -1):
            end = self.index.get(tuple(t[len(t) - n :]))
            if end is not None:
                return continuation(t, end, k)
        return []


def continuation(tokens: list[int], end: int, k: int) -> list[int]:
    """k tokens copied from `end` on; a copy that reaches the end of `tokens` goes on with its own start, as a
    repeat does (for a match just behind the end, as in `0, 0, 0` or `.0.0.0`, the period goes on)."""
    out = tokens[end : end + k]
    while len(out) < k:
        out.append(out[len(out) - (len(tokens) - end)])
    return out


def find_drafts(tokens: list[int], k: int, max_ngram: int = MAX_NGRAM) -> list[int]:
    """Lookup(tokens).drafts(k) without keeping the index: the plain definition, for tests and one-off calls."""
    for n in range(min(max_ngram, len(tokens) - 1), 0, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 1, n - 1, -1):  # latest first; never the suffix itself (end < len)
            if tokens[end - n : end] == suffix:
                return continuation(tokens, end, k)
    return []

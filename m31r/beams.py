"""Beam search: the completion the model finds most likely as a whole, not one token at a time.

Greedy decoding commits to each step's most likely token, so a line that starts with a second choice is never
written even when it is the likelier line. Beam search keeps the `width` likeliest partial completions at each step
and answers with the likeliest finished one: the highest sum of its tokens' log-probabilities, end included. A sum
favours short completions, which suits a line (the single-line FIM tasks of `make eval` gain from it); longer
answers end early under it, so the daemon uses it where a line end stops the completion (README "Beam search for
line completions").

A hypothesis finishes where `Engine.generate` would stop it: the model's end token, a stop sequence, the
repeated-line stop, or `max_tokens`; token healing holds every hypothesis to the owed text first. The search ends
once no unfinished hypothesis can beat the best finished one (scores only fall), or past the deadline, where the
likeliest answers, finished or not (a line end in its last token, picked late, ends its text as in generate). Then
the winner's tokens go through the same text path as `generate`'s, so its pieces, stops and usage read as a greedy
run that chose those tokens would report. Nothing streams before then: a hypothesis is final only when the search ends.

Each hypothesis decodes on a cache of its own, and they all share the prompt. A hypothesis extended twice gives its
second child a copy of the tail it wrote, not of the prompt (KVCache.take). The other caches come from the caller's
`spares`, which keep the prompts they held: while the user types, a spare holds all of the new prompt but its last
few tokens, and only those are copied (Engine.reusable's rule decides which positions hold the same bits). Being the
same bits, the prompt is read once per decode step for all hypotheses (Decode.share): the native attention takes it
from the first hypothesis' cache for every row.
"""

from __future__ import annotations

import codecs
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from m31r.engine import Chunk, Decode, Engine, Outcome, Piece, TextPath, heal_step
from m31r.model import KVCache
from m31r.stops import StopMatcher

MAX_BEAMS = 8
MAX_SPARES = MAX_BEAMS - 1  # spare caches a `spares` list keeps between searches


@dataclass
class Hypothesis:
    score: float  # sum of the log-probabilities of its tokens
    tokens: list[int]
    cache: int  # index of the cache holding its keys/values (live hypotheses only)
    owed: bytes  # healed bytes still to write (Engine.generate)
    after_space: bool  # healed whitespace just ended: the next token may not add to it
    skip: int  # healed characters still to leave out of the text
    pending: bytes  # bytes of a character not yet complete
    stops: StopMatcher
    end: str = ""  # why it finished: end | sequence | repeat | length | deadline ("" while live)
    logprobs: tuple[float, ...] = ()  # of each token: Outcome.logprobs
    tops: tuple[tuple[tuple[int, float], ...], ...] = ()  # the likeliest tokens at each of its steps (top_logprobs)
    counted: int = 0  # tokens that wrote completion text, what max_tokens bounds (not healed text only: Outcome)
    late: bool = False  # its last token was picked past the deadline: a line end in it ends the text (_answer)


def _extend(engine: Engine, h: Hypothesis, tok: int, score: float,
            top: tuple[tuple[int, float], ...] = ()) -> Hypothesis:
    """h followed by tok: its healing, text and stop state moved on, `end` set if tok finishes it."""
    logprobs, tops = (*h.logprobs, score - h.score), (*h.tops, top)
    if tok in engine.stop_ids:
        return Hypothesis(score, h.tokens + [tok], h.cache, b"", False, 0, b"", h.stops, "end", logprobs, tops,
                          h.counted)
    written = engine.tokenizer.token_bytes[tok] or b""
    counted = h.counted + (not (h.owed and h.owed.startswith(written)))
    owed, after_space = heal_step(h.owed, written) if h.owed else (b"", False)
    # An added token that is text has no token_bytes: its text, as TextStream gives it (a stop in it ends h).
    shown = written if written or tok in engine.tokenizer.special_ids else engine.tokenizer.decode([tok]).encode()
    decoder = codecs.getincrementaldecoder("utf-8")("ignore")  # as the text path's stream (m31r.tokenizer.TextStream)
    text = decoder.decode(h.pending + shown)
    pending = decoder.getstate()[0]
    n = min(h.skip, len(text))
    text, skip = text[n:], h.skip - n
    stops = h.stops.clone()
    _, hit = stops.feed(text)
    end = ("repeat" if stops.repeated else "sequence") if hit else ""
    return Hypothesis(score, h.tokens + [tok], h.cache, owed, after_space, skip, pending, stops, end, logprobs, tops,
                      counted)


def beam_generate(
    engine: Engine,
    ids: list[int],
    *,
    width: int,
    max_tokens: int = 64,
    stop: list[str] | tuple[str, ...] = (),
    cache: KVCache | None = None,
    result: Outcome | None = None,
    batched: bool = False,
    heal: str = "",
    deadline: float | None = None,
    repeat_context: str | None = None,
    start_stops: list[str] | tuple[str, ...] = (),
    spares: list[KVCache] | None = None,
    top_logprobs: int = 0,
) -> Iterator[Piece | Chunk | list[Decode]]:
    """Engine.generate's contract (prompt ids only, greedy only), answered by a beam search of `width` hypotheses.
    With `batched`, a decode step is yielded as a list of Decode, one per live hypothesis, for the driver to run
    together (Engine.run) and send back as a list of logits; `cache` holds the prompt afterwards, not the answer.
    `spares`: caches to take the other hypotheses' from and give back (up to MAX_SPARES kept), owned by the caller
    and used by one search at a time. Width 1 is greedy decoding, token for token. `top_logprobs`: each Piece of the
    answer carries the likeliest tokens at its step, as Engine.generate's do."""
    t0 = time.perf_counter()
    if not 1 <= width <= MAX_BEAMS:
        raise ValueError(f"beams must be between 1 and {MAX_BEAMS}, got {width}")
    res = result if result is not None else Outcome(prompt_tokens=len(ids))
    cache = cache if cache is not None else engine.new_cache()
    logits = yield from engine.start(ids, max_tokens, cache, res, batched, deadline, t0)
    if logits is None:
        return

    def late() -> bool:
        return deadline is not None and time.perf_counter() >= deadline

    caches = [cache]
    stops = StopMatcher(stop, repeat_context, start_stops)
    live = [Hypothesis(0.0, [], 0, heal.encode(), False, len(heal), b"", stops)]
    rows = [logits]
    done: list[Hypothesis] = []
    spares = spares if spares is not None else []
    share = object()  # the key of this search's rows: their caches hold the prompt's keys/values, bit for bit
    room = engine.config.max_context - len(ids)  # as Engine.generate: healing tokens are not counted, room bounds them
    try:
        for i in range(room):
            lg = torch.stack(list(rows)).float()
            if engine.unused_ids is not None:
                lg = lg.index_fill(1, engine.unused_ids, float("-inf"))
            for k, h in enumerate(live):
                if h.owed or h.after_space:
                    lg[k] = engine.heal_logits(lg[k], h.owed)
            lp = F.log_softmax(lg, dim=-1)
            top, at = lp.topk(width, dim=-1)
            tops: list[tuple[tuple[int, float], ...]] = [()] * len(live)
            if top_logprobs:
                values, ids_ = lp.topk(min(top_logprobs, lp.shape[-1]), dim=-1)
                tops = [tuple((t, v) for t, v in zip(ids_[k].tolist(), values[k].tolist(), strict=True)
                              if v > -math.inf) for k in range(len(live))]
            picks = [(h.score + s, k, t) for k, h in enumerate(live)
                     for s, t in zip(top[k].tolist(), at[k].tolist(), strict=True) if s != float("-inf")]
            picks.sort(key=lambda p: (-p[0], p[1], p[2]))  # ties: the older hypothesis, then the lower id
            grown: list[Hypothesis] = []
            for score, k, tok in picks:
                if len(grown) == width:
                    break
                h = _extend(engine, live[k], tok, score, tops[k])
                (done if h.end else grown).append(h)
            best = max(done, key=lambda h: h.score, default=None)
            if not grown or (best is not None and best.score >= grown[0].score):
                break
            past = late()  # the tokens just picked arrived past the deadline: no further model call
            for h in grown:
                h.late = past
                if h.counted == max_tokens or i + 1 == room:
                    h.end = "length"
                elif past:
                    h.end = "deadline"
            done += [h for h in grown if h.end]
            grown = [h for h in grown if not h.end]
            if not grown:
                break
            caches = _place(engine, grown, caches, ids, spares)
            calls = [Decode(caches[h.cache], h.tokens[-1], share=(share, len(ids))) for h in grown]
            rows = (yield calls) if batched else engine.run(calls, [])[0]
            res.decode_steps += 1
            live = grown
    finally:
        del cache.tokens[len(ids):]  # the answer's keys/values may be in another cache, or overwritten
        spares += caches[1:]
        del spares[MAX_SPARES:]
    ranked = sorted(done, key=lambda h: -h.score)  # stable: ties keep the order they finished in
    win = _answer(engine, ids, ranked[0], stop, heal, repeat_context, start_stops)  # its pieces carry its figures
    res.finish_reason, res.stopped_by, res.stop_sequence = win.finish_reason, win.stopped_by, win.stop_sequence
    res.logprobs = list(ranked[0].logprobs[: len(win.tokens) + (win.stopped_by == "end")])
    res.healing_tokens = len(win.tokens) - min(ranked[0].counted, len(win.tokens))
    res.completion_tokens = len(win.tokens) - res.healing_tokens
    res.tokens = list(win.tokens)
    for piece in win.pieces[res.healing_tokens:]:  # not the healing tokens' (empty) pieces: generate's stream
        res.text += piece.text
        if res.first_token_ms is None:
            res.first_token_ms = (time.perf_counter() - t0) * 1000
        yield piece
    if win.finish_reason != "deadline":
        res.alternatives = _alternatives(engine, ids, ranked[1:], win.text, width - 1, stop, heal, repeat_context,
                                         start_stops)
    res.total_ms = (time.perf_counter() - t0) * 1000


def _place(engine: Engine, grown: list[Hypothesis], caches: list[KVCache], ids: list[int],
           spares: list[KVCache]) -> list[KVCache]:
    """Give each new hypothesis a cache holding its parent's keys/values: the parent's own for its first child, and
    for the others one that a parent without children held (given the parent's tail), else one from `spares` (given
    what it lacks of the prompt, and the tail), else a copy."""
    claimed: set[int] = set()
    second: list[Hypothesis] = []
    for h in grown:
        if h.cache in claimed:
            second.append(h)
        else:
            claimed.add(h.cache)
    spare = [c for c in range(len(caches)) if c not in claimed]
    for h in second:
        src = caches[h.cache]
        if spare:
            c = spare.pop()
            caches[c].take(src, len(ids))
        else:
            if spares:
                kept = [engine.reusable(s, ids) for s in spares]
                s = spares.pop(kept.index(max(kept)))
                s.take(src, max(kept))
                caches.append(s)
            else:
                caches.append(src.clone())
            c = len(caches) - 1
        h.cache = c
    return caches


@dataclass
class Answer:
    """A hypothesis as Engine.generate would have streamed it."""

    pieces: list[Piece]
    finish_reason: str
    stopped_by: str | None
    stop_sequence: str | None = None  # Outcome.stop_sequence

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.pieces)

    @property
    def tokens(self) -> list[int]:
        return [p.id for p in self.pieces if p.id is not None]


def _answer(engine: Engine, ids: list[int], h: Hypothesis, stop: list[str] | tuple[str, ...], heal: str,
            repeat_context: str | None, start_stops: list[str] | tuple[str, ...]) -> Answer:
    """h's tokens through generate's text path: the tokenizer's stream, the healed text left out, stop sequences cut
    and held back, and as generate past its deadline: a line end in the last token, or in the text held back after
    it, ends the text there (finish_reason deadline)."""
    text, hit = TextPath(engine.tokenizer, ids, heal, stop, repeat_context, start_stops), False
    out = Answer([], "deadline" if h.end == "deadline" else "length", None)
    for i, tok in enumerate(h.tokens):
        if tok in engine.stop_ids:
            out.finish_reason, out.stopped_by = "stop", "end"
            break
        piece, hit = text.step(tok)
        cut = not hit and h.late and i == len(h.tokens) - 1 and "\n" in piece
        if cut:
            piece, hit, out.finish_reason = piece[: piece.index("\n")], True, "deadline"
        out.pieces.append(Piece(tok, piece, h.logprobs[i], h.tops[i]))
        if hit:
            if not cut:
                out.finish_reason, out.stopped_by, out.stop_sequence = "stop", text.stopped_by, text.stop_sequence
            break
    if not hit and (tail := text.flush()):
        if h.end == "deadline" and "\n" in tail:  # a line end held back (for a stop "\n...") ends it
            tail = tail[: tail.index("\n")]
        if tail:
            out.pieces.append(Piece(None, tail))
    return out


def _alternatives(engine: Engine, ids: list[int], ranked: list[Hypothesis], first: str, n: int,
                  stop: list[str] | tuple[str, ...], heal: str, repeat_context: str | None,
                  start_stops: list[str] | tuple[str, ...]) -> list[str]:
    """The texts of the next likeliest finished hypotheses, up to n, each non-empty and unlike the answer's and the
    others' (hypotheses that differ only in tokens, or past a stop, read the same)."""
    seen, out = {first}, []
    for h in ranked:
        if len(out) == n:
            break
        if h.end in ("", "deadline"):
            continue
        text = _answer(engine, ids, h, stop, heal, repeat_context, start_stops).text
        if text.strip() and text not in seen:
            seen.add(text)
            out.append(text)
    return out

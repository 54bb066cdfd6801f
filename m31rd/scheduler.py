"""The inference thread's scheduler: engine-level requests in, engine-level events out.

It knows nothing of the socket protocol. A `Request` is prompt token ids, sampling, stop sequences, token healing,
a deadline and a `Cancellation` handle; what comes back, through the callback the request was submitted with, is a
`Piece` per token (as the engine yields them), then one `Finished` (finish reason, usage, timings) or one `Failed`
(code `cancelled` or `internal`). `m31rd/server.py` alone maps wire messages to and from these. The daemon runs
`serve()` on its torch thread; tests and benchmarks drive the same scheduler in-process (`drain()`, `run_together`).

It works in rounds: each running request advances to its next model call (a prefill chunk or a decode step), then
the engine runs every collected call (Engine.run), decode rows and short chunks in shared forward passes (a decode
step with prompt-lookup drafts takes a row per draft). A short
request is never stuck behind a long prefill, concurrent streams share the cost of reading the weights, and every
round boundary is a point where cancellation and deadlines take effect: the engine makes no model call for a
request past its deadline (Engine.generate), and a queued request past it is answered without starting. The engine
shares passes only in ways that give a row the same bits, so a request's output does not depend on what runs
beside it.
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field

import torch

from m31r.beams import beam_generate
from m31r.engine import Chunk, ContextOverflowError, Decode, Engine, Outcome, Piece, line_logprobs
from m31r.sampling import SamplingParams
from m31rd.cancellation import Cancellation
from m31rd.prefix_cache import PrefixCache, Slot

log = logging.getLogger("m31rd")


@dataclass(eq=False)
class Request:
    """What the scheduler runs: a tokenised prompt and the rules of its generation."""

    ids: list[int]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    heal: str = ""  # token healing: text the prompt left out, written again first (m31r.fim)
    document: str = ""  # the prefix-cache slot it prefers on a tie (prefix_cache)
    deadline: float | None = None  # a time.perf_counter() value: the hard limit (Engine.generate)
    lookahead: int = 0  # prompt-lookup drafts per decode step (Engine.generate; greedy only, same output)
    beams: int = 1  # above 1: a beam search of this width (m31r.beams; greedy only), lookahead unused
    repeat_context: str | None = None  # the document before a completion: the repeated-line stop (m31r.stops)
    start_stops: Sequence[str] = ()  # stop sequences only at the completion's start (m31r.fim.start_stop)
    top_logprobs: int = 0  # the likeliest tokens each Piece carries (Engine.generate, beam_generate)
    min_probability: float | None = None  # an editor's confidence floor: ends the text once met (Engine.generate)
    received: float = field(default_factory=time.perf_counter)  # timings count from here
    cancellation: Cancellation = field(default_factory=Cancellation)


@dataclass(frozen=True)
class Finished:
    """The last event of a request that ran to its end (finish_reason stop | length | deadline). Times in ms from
    `Request.received`, except prefill_ms."""

    finish_reason: str
    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    healed_tokens: int = 0  # tokens that wrote the prompt's healed end again (Outcome.healing_tokens)
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_ms: float | None = None
    total_ms: float = 0.0
    decode_steps: int = 0  # prompt-lookup decoding's figures (Outcome)
    drafted: int = 0
    accepted: int = 0
    alternatives: tuple[str, ...] = ()  # a beam search's runners-up (m31r.beams)
    logprob: float | None = None  # the completion's log-probability, its end included (Outcome.logprobs)
    line_logprob: float | None = None  # its first line's (the first of m31r.engine.line_logprobs)
    logprob_by_line: tuple[float, ...] = ()  # each of its text's lines' (m31r.engine.line_logprobs)
    stopped_by: str | None = None  # what a "stop" was (Outcome.stopped_by)
    stop_sequence: str | None = None  # the stop sequence that ended it (Outcome.stop_sequence)


@dataclass(frozen=True)
class Failed:
    """The last event of a request that did not run to its end: code `cancelled`, `shutting_down`, `internal` or
    `context_overflow` (with its figures in `overflow`, which the server puts in the Error frame)."""

    code: str
    message: str
    overflow: ContextOverflowError | None = None


Event = Piece | Finished | Failed
Emit = Callable[[Event], None]  # called on the scheduler's thread


@dataclass(eq=False)
class _Run:
    """A submitted request's state on the scheduler's thread (nothing else touches it)."""

    request: Request
    emit: Emit
    slot: Slot | None = None
    gen: Generator[Piece | Chunk | Decode | list[Decode], torch.Tensor | list[torch.Tensor] | None, None] | None = None
    call: Chunk | Decode | list[Decode] | None = None  # the model call it waits for (a beam search's: one per beam)
    logits: torch.Tensor | list[torch.Tensor] | None = None  # that call's result, sent into the generator next round
    outcome: Outcome | None = None
    started: float = 0.0
    failure: str | None = None  # a shared model pass failed: answer `internal`

    @property
    def cancel_reason(self) -> str | None:
        return self.request.cancellation.reason


class Scheduler:
    def __init__(self, engine: Engine, cache: PrefixCache, max_active: int = 4):
        self.engine, self.cache = engine, cache
        self.max_active = max(1, max_active)
        self.inbox: queue.SimpleQueue[tuple[Request, Emit] | None] = queue.SimpleQueue()
        self.pending: deque[_Run] = deque()
        self.running: list[_Run] = []
        self.active = 0  # len(running) after the last round, for the daemon's status
        self.stopping = False
        self.rounds = 0  # rounds that ran model calls
        self.mixed_rounds = 0  # of which prefill chunks ran beside decode steps

    def submit(self, request: Request, emit: Emit) -> None:
        """Queue a request (from any thread); `emit` gets its events on the scheduler's thread."""
        self.inbox.put((request, emit))

    def stop(self) -> None:
        """Finish what was submitted, then end `serve` (from any thread)."""
        self.inbox.put(None)

    def serve(self) -> None:
        """Run rounds until `stop` and everything submitted before it has finished (the daemon's torch thread)."""
        while self.round(block=True):
            pass

    def drain(self) -> None:
        """Run rounds on the calling thread until everything submitted so far has finished."""
        while self.pending or self.running or not self.inbox.empty():
            self.round()

    @property
    def idle(self) -> bool:
        return not self.pending and not self.running

    # -- one round ----------------------------------------------------------------------------------------

    def round(self, block: bool = False) -> bool:
        """Take what was submitted, start what fits, advance every running request to its next model call and run
        those calls. `block`: wait for a submission when there is nothing to do. False once `stop` was called and
        nothing is left."""
        self._take(block and self.idle and not self.stopping)
        # Running requests that were cancelled (or whose pass failed) end before anything starts: their slots and
        # places go to the requests waiting now. Ended after the starts, a keystroke's request found the one it
        # superseded still holding its document's slot, and took a fresh one (a cold prefill) or evicted another
        # document's.
        self.running = [run for run in self.running if self._settle(run)]
        now = time.perf_counter()
        for run in [r for r in self.pending if r.cancel_reason or self._expired(r, now)]:
            self.pending.remove(run)  # answer cancelled and expired waiters now, not when they reach the head
            if run.cancel_reason:
                self._emit(run, Failed(run.request.cancellation.code, run.cancel_reason))
            else:
                ms = (now - run.request.received) * 1000
                self._emit(run, Finished("deadline", len(run.request.ids), queue_ms=ms, total_ms=ms))
        while self.pending and len(self.running) < self.max_active:
            run = self.pending[0]
            try:
                started = self._try_start(run)
            except ContextOverflowError as e:  # a prompt the server let through too long: the client's to shorten
                self.pending.popleft()
                self._emit(run, Failed("context_overflow", str(e), e))
                continue
            except Exception as e:  # never let one request kill the only inference thread
                log.error("starting a request failed: %s", traceback.format_exc())
                self.pending.popleft()
                self._emit(run, Failed("internal", f"cannot start: {e!r}"))
                continue
            if not started:
                break  # every slot is busy: wait for a running request to finish
            self.pending.popleft()
            self.running.append(run)
        self.running = [run for run in self.running if self._advance(run)]
        self._run_calls(self.running)
        self.active = len(self.running)
        return not (self.stopping and self.idle)

    def _take(self, block: bool) -> None:
        try:
            item = self.inbox.get(block=block)
            while True:
                if item is None:
                    self.stopping = True
                else:
                    self.pending.append(_Run(*item))
                item = self.inbox.get_nowait()
        except queue.Empty:
            pass

    @staticmethod
    def _expired(run: _Run, now: float) -> bool:
        return run.request.deadline is not None and now >= run.request.deadline

    def _emit(self, run: _Run, event: Event) -> None:
        try:
            run.emit(event)
        except Exception:  # a receiver that went away must not take the inference thread with it
            log.error("delivering an event failed: %s", traceback.format_exc())

    def _run_calls(self, runs: list[_Run]) -> None:
        """Run the model call of every request waiting for one: one round's forward passes."""
        waiting = [r for r in runs if isinstance(r.call, Decode | list | Chunk)]
        if not waiting:
            return
        self.rounds += 1
        self.mixed_rounds += 0 < sum(isinstance(r.call, Chunk) for r in waiting) < len(waiting)  # chunks beside steps
        for run in waiting:
            handle = run.request.cancellation
            handle.calls += 1
            handle.calls_after += handle.reason is not None
        self._execute(waiting)

    def _execute(self, runs: list[_Run]) -> None:
        """One Engine.run for these requests' calls. Where it fails, the failure is not blamed on every request in it:
        what the passes that did run recorded is rolled back and each request's call runs again by itself (the same
        bits, as the engine shares passes only where a row's bits do not change), so a request whose call cannot run
        (its cache cannot grow, say) fails alone, and its neighbours go on."""
        decodes = [r for r in runs if isinstance(r.call, Decode | list)]
        chunks = [r for r in runs if isinstance(r.call, Chunk)]
        rows = [r.call if isinstance(r.call, list) else [r.call] for r in decodes]
        steps, prefills = [d for ds in rows for d in ds], [r.call for r in chunks]
        marks = [(c.cache, len(c.cache.tokens), len(c.cache.chunks)) for c in (*steps, *prefills)]
        try:
            decoded, chunked = self.engine.run(steps, prefills)  # type: ignore[arg-type]
        except Exception as e:
            log.error("a model pass failed: %s", traceback.format_exc())
            for cache, n, k in marks:  # positions past these are written again by whatever runs next
                del cache.tokens[n:]
                del cache.chunks[k:]
            if len(runs) > 1:
                for run in decodes + chunks:
                    self._execute([run])
                return
            runs[0].call, runs[0].failure = None, f"inference failed: {e!r}"
            return
        at = 0
        for run, ds in zip(decodes, rows, strict=True):
            run.logits = decoded[at : at + len(ds)] if isinstance(run.call, list) else decoded[at]
            run.call = None
            at += len(ds)
        for run, logits in zip(chunks, chunked, strict=True):
            run.call, run.logits = None, logits

    def _try_start(self, run: _Run) -> bool:
        """Give the request a cache slot and its generator. False: every slot is busy (it waits). A request the engine
        refuses raises here, before it takes a slot: the slot it would take (its document's cache) stays as it was."""
        req = run.request
        self.engine.check(req.ids, req.max_tokens)
        slot = self.cache.acquire(req.ids, req.document)
        if slot is None:
            return False
        run.slot, run.started = slot, time.perf_counter()
        run.outcome = Outcome(prompt_tokens=len(req.ids))
        common = dict(max_tokens=req.max_tokens, stop=req.stop, cache=slot.cache, result=run.outcome, batched=True,
                      heal=req.heal, deadline=req.deadline, repeat_context=req.repeat_context,
                      start_stops=req.start_stops)
        if req.beams > 1:
            run.gen = beam_generate(self.engine, req.ids, width=req.beams, spares=self.cache.spares,
                                    top_logprobs=req.top_logprobs, **common)
        else:
            run.gen = self.engine.generate(req.ids, sampling=req.sampling, lookahead=req.lookahead,
                                           top_logprobs=req.top_logprobs, min_probability=req.min_probability,
                                           **common)
        return True

    def _end(self, run: _Run, event: Finished | Failed, reusable: bool = True) -> bool:
        if run.gen is not None:
            run.gen.close()
        assert run.slot is not None and run.outcome is not None
        self.cache.release(run.slot, run.outcome.prompt_tokens, run.outcome.cached_tokens, reusable)
        self._emit(run, event)
        return False

    def _finished(self, run: _Run) -> Finished:
        o, received = run.outcome, run.request.received
        assert o is not None
        queue_ms = (run.started - received) * 1000
        by_line = line_logprobs(self.engine.tokenizer.token_bytes, o.tokens, o.logprobs, o.text.count("\n") + 1,
                                run.request.heal.count("\n"))
        return Finished(
            o.finish_reason or "length", o.prompt_tokens, o.cached_tokens, o.completion_tokens, o.healing_tokens,
            queue_ms=queue_ms,
            prefill_ms=o.prefill_ms, first_token_ms=None if o.first_token_ms is None else queue_ms + o.first_token_ms,
            total_ms=(time.perf_counter() - received) * 1000, decode_steps=o.decode_steps, drafted=o.drafted,
            accepted=o.accepted, alternatives=tuple(o.alternatives), logprob=sum(o.logprobs) if o.logprobs else None,
            line_logprob=by_line[0] if by_line else None, logprob_by_line=tuple(by_line), stopped_by=o.stopped_by,
            stop_sequence=o.stop_sequence)

    def _settle(self, run: _Run) -> bool:
        """End a running request whose pass failed (`internal`) or that was cancelled; True if it runs on."""
        if run.failure is not None:
            return self._end(run, Failed("internal", run.failure), reusable=False)
        if run.cancel_reason:
            return self._end(run, Failed(run.request.cancellation.code, run.cancel_reason))
        return True

    def _advance(self, run: _Run) -> bool:
        """Advance a running request to its next model call (collected for this round), emitting the tokens produced
        on the way. True while it runs on; False once it has finished (its last event emitted, its slot released)."""
        if not self._settle(run):
            return False
        assert run.gen is not None
        while True:
            try:
                logits, run.logits = run.logits, None
                ev = run.gen.send(logits)
            except StopIteration:
                return self._end(run, self._finished(run))
            except ContextOverflowError as e:  # a prompt the server let through too long: the client's to shorten
                return self._end(run, Failed("context_overflow", str(e), e), reusable=False)
            except Exception as e:
                log.error("inference failed: %s", traceback.format_exc())
                return self._end(run, Failed("internal", f"inference failed: {e!r}"), reusable=False)
            if isinstance(ev, Chunk | Decode | list):
                run.call = ev
                return True
            self._emit(run, ev)


def run_together(engine: Engine, prompts: Sequence[str | list[int]], max_tokens: int,
                 **kw) -> tuple[list[list[int | None]], Scheduler]:
    """Generate for every prompt at once through a Scheduler with a slot each, on this thread: the token ids each
    produced (None for held-back text released at the end), and the scheduler (its `rounds`, `mixed_rounds`).
    Keyword arguments go to every Request."""
    cache = PrefixCache(engine, 0, slots=len(prompts))
    sched = Scheduler(engine, cache, max_active=len(prompts))
    outs: list[list[int | None]] = [[] for _ in prompts]
    for out, p in zip(outs, prompts, strict=True):
        ids = engine.tokenizer.encode(p) if isinstance(p, str) else list(p)
        sched.submit(Request(ids, max_tokens, **kw),
                     lambda ev, out=out: out.append(ev.id) if isinstance(ev, Piece) else None)
    sched.drain()
    return outs, sched

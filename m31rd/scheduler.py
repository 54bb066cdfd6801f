"""The one inference thread: the only code in the daemon that touches torch.

The asyncio side hands jobs over through a queue; results go back with `loop.call_soon_threadsafe`. The
thread works in rounds: each active job advances to its next model call (a prefill chunk or a decode step),
then the engine runs every collected call (Engine.run), decode rows and short chunks in shared forward passes.
A short request is never stuck behind a long prefill, concurrent streams share the cost of reading the
weights, and every round boundary is a point where cancellation and deadlines take effect: the engine makes no
model call for a job past its deadline (Engine.generate), and a queued job past it is answered without starting.
The engine shares passes only in ways that give a row the same bits, so a request's output does not depend on
what runs beside it.
The loop runs on the daemon's TorchThread, the thread that loaded the model (see torch_thread).
"""

from __future__ import annotations

import logging
import queue
import time
import traceback
from collections import deque
from collections.abc import Callable, Generator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from m31r.engine import Chunk, Decode, Engine, Generation, Token
from m31r.sampling import SamplingParams
from m31r_protocol import messages as m
from m31rd.prefix_cache import PrefixCache, Slot
from m31rd.torch_thread import TorchThread

log = logging.getLogger("m31rd")

Post = Callable[["Job", msgspec.Struct, bool], None]  # (job, message, final) — runs on the event loop


@dataclass(eq=False)
class Job:
    rid: int
    request: m.Generate | m.Fim
    sampling: SamplingParams
    conn: Any = None  # the connection that asked; only the event loop uses it
    document: str = ""
    received: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    cancel_reason: str | None = None  # set from the event loop; read between steps
    # Inference-thread state.
    ids: list[int] | None = None  # the prompt, tokenised before the job is queued
    max_tokens: int = 0
    heal: str = ""  # token healing: text the FIM prompt left out, written again first (m31r.fim)
    slot: Slot | None = None
    gen: Generator[Token | Chunk | Decode, torch.Tensor | None, None] | None = None
    call: Chunk | Decode | None = None  # the model call the job waits for
    logits: torch.Tensor | None = None  # that call's result, sent into the generator next round
    result: Generation | None = None
    started: float = 0.0
    text: str = ""  # what was sent so far (typed-through reuses it)
    ends: list[int] = field(default_factory=list)  # where each token sent ends in `text`
    failed: bool = False  # a batched step failed: answer `internal`
    # Model calls (prefill chunks and decode steps) run for this job, and how many had run when it was cancelled:
    # the per-request log line reports the calls made after a cancel, which the round structure keeps at most 1.
    calls: int = 0
    calls_at_cancel: int | None = None
    cancelled_at: float | None = None

    def cancel(self, reason: str) -> None:
        if self.cancel_reason is None:
            self.cancel_reason = reason
            self.calls_at_cancel, self.cancelled_at = self.calls, time.perf_counter()


class Scheduler:
    def __init__(self, engine: Engine, cache: PrefixCache, post: Post, call_soon: Callable, thread: TorchThread,
                 max_active: int = 4):
        self.engine, self.cache = engine, cache
        self._post, self._call_soon = post, call_soon
        self.max_active = max(1, max_active)
        self.inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.active = 0
        self.thread = thread
        self.finished: Future[None] | None = None

    def start(self) -> None:
        self.finished = self.thread.submit(self._run)

    def submit(self, job: Job) -> None:
        self.inbox.put(job)

    def stop(self) -> None:
        self.inbox.put(None)

    # -- thread side ------------------------------------------------------------------------------------

    def _send(self, job: Job, msg: msgspec.Struct, final: bool = False) -> None:
        self._call_soon(self._post, job, msg, final)

    def _run(self) -> None:
        pending: deque[Job] = deque()
        active: list[Job] = []
        stopping = False
        while not (stopping and not active and not pending):
            block = not active and not pending and not stopping
            try:
                item = self.inbox.get(block=block)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        pending.append(item)
                    item = self.inbox.get_nowait()
            except queue.Empty:
                pass
            now = time.perf_counter()
            for job in [j for j in pending if j.cancel_reason or (j.deadline is not None and now >= j.deadline)]:
                pending.remove(job)  # answer cancelled and expired waiters now, not when they reach the head
                if job.cancel_reason:
                    self._send(job, m.Error(id=job.rid, code="cancelled", message=job.cancel_reason), True)
                else:
                    self._send(job, self._expired(job), True)
            while pending and len(active) < self.max_active:
                job = pending[0]
                if job.cancel_reason:
                    pending.popleft()
                    self._send(job, m.Error(id=job.rid, code="cancelled", message=job.cancel_reason), True)
                    continue
                try:
                    started = self._start(job)
                except Exception as e:  # never let one request kill the only inference thread
                    log.error("starting a request failed: %s", traceback.format_exc())
                    pending.popleft()
                    self._send(job, m.Error(id=job.rid, code="internal", message=f"cannot start: {e!r}"), True)
                    continue
                if not started:
                    break  # every slot is busy: wait for a running job to finish
                pending.popleft()
                active.append(job)
            for job in list(active):
                if self._step(job):
                    active.remove(job)
            self._run_calls([job for job in active if job.call is not None])
            self.active = len(active)

    def _run_calls(self, jobs: list[Job]) -> None:
        """Run the model call of every job waiting for one: one round."""
        if not jobs:
            return
        decodes = [j for j in jobs if isinstance(j.call, Decode)]
        chunks = [j for j in jobs if isinstance(j.call, Chunk)]
        try:
            decoded, chunked = self.engine.run([j.call for j in decodes], [j.call for j in chunks])
        except Exception as e:
            log.error("a model pass failed: %s", traceback.format_exc())
            for job in jobs:
                job.call = None
                job.cancel(f"inference failed: {e!r}")
                job.failed = True
            return
        for job, logits in zip(decodes + chunks, decoded + chunked, strict=True):
            job.call, job.logits = None, logits
            job.calls += 1

    def _start(self, job: Job) -> bool:
        """True: running; False: no free slot yet. The prompt's ids come with the job: tokenising happens on the
        event loop's side (m31rd.server), never on this thread, where a huge prompt would stall every stream."""
        assert job.ids is not None
        slot = self.cache.acquire(job.ids, job.document)
        if slot is None:
            return False
        job.slot = slot
        job.started = time.perf_counter()
        job.result = Generation(prompt_tokens=len(job.ids))
        job.gen = self.engine.generate(
            job.ids, max_tokens=job.max_tokens, sampling=job.sampling, stop=job.request.stop, cache=slot.cache,
            result=job.result, batched=True, heal=job.heal, deadline=job.deadline)
        return True

    def _finish(self, job: Job, msg: msgspec.Struct, ok: bool = True) -> bool:
        if job.gen is not None:
            job.gen.close()
        assert job.slot is not None and job.result is not None
        self.cache.release(job.slot, job.result.prompt_tokens, job.result.cached_tokens, ok)
        self._send(job, msg, True)
        return True

    def _done(self, job: Job) -> m.Done:
        r = job.result
        assert r is not None
        queue_ms = (job.started - job.received) * 1000
        first = None if r.first_token_ms is None else round(queue_ms + r.first_token_ms, 2)
        return m.Done(
            id=job.rid, finish_reason=r.finish_reason or "length",
            usage=m.Usage(prompt_tokens=r.prompt_tokens, cached_tokens=r.cached_tokens,
                          completion_tokens=r.completion_tokens),
            timings=m.Timings(queue_ms=round(queue_ms, 2), prefill_ms=round(r.prefill_ms, 2),
                              first_token_ms=first,
                              total_ms=round((time.perf_counter() - job.received) * 1000, 2)))

    def _expired(self, job: Job) -> m.Done:
        """The answer to a job whose deadline passed before it started: no tokens."""
        prompt = len(job.ids) if job.ids is not None else 0
        ms = round((time.perf_counter() - job.received) * 1000, 2)
        return m.Done(id=job.rid, finish_reason="deadline", usage=m.Usage(prompt_tokens=prompt),
                      timings=m.Timings(queue_ms=ms, total_ms=ms))

    def _step(self, job: Job) -> bool:
        """Advance a job to its next model call (a prefill chunk or a decode step, collected for this round),
        sending the tokens produced on the way. True when it has finished."""
        if job.failed:
            return self._finish(job, m.Error(id=job.rid, code="internal", message=job.cancel_reason or ""), False)
        if job.cancel_reason:
            return self._finish(job, m.Error(id=job.rid, code="cancelled", message=job.cancel_reason))
        assert job.gen is not None and job.result is not None
        while True:
            try:
                logits, job.logits = job.logits, None
                ev = job.gen.send(logits)
            except StopIteration:
                return self._finish(job, self._done(job))
            except Exception as e:
                log.error("inference failed: %s", traceback.format_exc())
                msg = m.Error(id=job.rid, code="internal", message=f"inference failed: {e!r}")
                return self._finish(job, msg, False)
            if isinstance(ev, Chunk | Decode):
                job.call = ev
                return False
            job.text += ev.text
            job.ends.append(len(job.text))
            self._send(job, m.Token(id=job.rid, text=ev.text, token=ev.id))

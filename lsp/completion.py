"""From a completion request to a suggestion: debounce, typed-through, the daemon Fim, post-processing.

One Job per document and kind at a time computes a suggestion for one (version, cursor) pair. Requests for the same
pair share it (an editor may ask for an inline and a menu completion on the same keystroke); a request for
anything else supersedes it: the job is cancelled, its daemon request gets a Cancel, and the requests that
waited on it answer empty. The kinds: the plain cursor's requests, and those made while the editor's completion menu
has an item selected (selectedCompletionInfo: for the text with that item accepted). An editor sends one of each on a
keystroke (VS Code with `m31r.completionMenu`: the menu's request and the ghost text beside its selected item), and
with one job they superseded each other, keystroke after keystroke; each kind has its own job, shown suggestion and
daemon `document` (selected_document) too, as the daemon supersedes an older Fim of the same one. Past
MAX_LIVE_DOCUMENTS documents with a job running, a new job supersedes those of the documents asked about longest ago
likewise. A client's `$/cancelRequest` cancels the request's handler task; the job is
cancelled with it once nothing else waits on it, and the handler ends with RequestCancelled.

A result is for the text and version captured when the request arrived: if the document changed before
it was ready it is dropped (stale). It is for the settings it was computed under too (EditorSettings.shape): after a
settings change that would change it, neither the finished job nor the shown suggestion answers a request.

An invoked request (the user asked: VS Code's "Trigger Inline Suggestion", Alt+\\) shows the model's best suggestion
even where the model is unsure of its first line: the confidence floor hides suggestions nobody asked for, and with
it that key did nothing at such a cursor. The lines after the first are still cut at the floor; the daemon, which
ended the answer where the floor fell (Fim.min_probability), is asked again without one for its whole first line.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from m31r_lsp.context import ProjectContext
from m31r_lsp.daemon_link import EditorLink
from m31r_lsp.documents import SPLITLINES_BREAKS, Lines, scrub, split_breaks
from m31r_lsp.settings import EditorSettings
from m31r_protocol import DaemonError, DaemonUnavailable, Sampling, policy
from m31r_protocol.client import Client
from m31r_protocol.context import QUERY_LINES, QUERY_STEP, line_start
from m31r_protocol.messages import Done, Snippet
from m31r_protocol.reconnect import Unavailable

log = logging.getLogger("m31r_lsp.completion")

# What of a document a Fim carries. The daemon refuses a prompt over its --max-prompt-chars (2 Mi characters by
# default): a larger document got no completion at all, and a smaller one cost a copy of the whole text per keystroke,
# where the daemon keeps a context's worth of tokens around the cursor. No token spans more characters than it has
# bytes, at most CHARS_PER_TOKEN (the bundled tokenizer's longest token: 64 bytes), so that many characters per token
# of context on either side hold everything the daemon would keep; MAX_SIDE_CHARS bounds it for models of long
# contexts, three sides' worth (lines above, the cursor's line, the text after it) staying well under 2 Mi.
CHARS_PER_TOKEN = 64
MAX_SIDE_CHARS = 1 << 18
# Documents with a job (or warm-up) running at once (one per kind: at most 16 daemon requests). The daemon takes 16
# requests at a time from a connection (its --max-per-connection) and refuses the rest `busy`: an editor asking in 24
# documents at once had the 8 newest requests, those the user most likely waits on, refused while the oldest were
# served. Past this many, the jobs of the documents asked about longest ago are cancelled (superseded by the newer
# ones; their requests answer empty).
MAX_LIVE_DOCUMENTS = 8
BUSY_NOTICE_S = 600.0  # the daemon's `busy` refusals are said once, then at most once per this long
LINE_STEP = 16  # the daemon's FimBudget.line_step: the lines above the cursor it keeps start at a multiple of a
# divisor of it (m31r.fim.above_steps), so a cut at a multiple of it leaves the daemon's own cut unchanged
assert LINE_STEP % QUERY_STEP == 0  # (query_prefix: a cut at a multiple of LINE_STEP keeps the context's blocks)


@dataclass(frozen=True)
class Result:
    text: str  # the document text the suggestion is for (its version's snapshot)
    version: int | None
    offset: int  # the cursor
    suggestion: policy.Suggestion
    source: str  # "model" (from the daemon) | "typed_through" (from the shown suggestion, no round trip)
    # More suggestions for the editor to cycle through: the daemon's beam search runners-up, post-processed the same way
    alternatives: list[policy.Suggestion] = field(default_factory=list)


@dataclass
class Job:
    # (version, cursor offset, the menu item's text it completes after, the floor it shows a suggestion above (0 for
    # an invoked request), the settings' shape)
    key: tuple[int | None, int, str, float, tuple]
    task: asyncio.Task[Result | None]
    waiters: int = 0

    @property
    def shape(self) -> tuple:
        """The settings' shape it was asked under (EditorSettings.shape)."""
        return self.key[4]


@dataclass
class Slot:
    """One kind of a document's requests (plain, or with a menu item selected): its job, the suggestion it showed (what
    typed-through answers from) and the warm-up after it."""
    job: Job | None = None
    shown: policy.Shown | None = None
    warm: asyncio.Task[None] | None = None

    def tasks(self) -> list[asyncio.Task]:
        return [t for t in (self.job.task if self.job else None, self.warm) if t is not None]


@dataclass
class DocState:
    plain: Slot = field(default_factory=Slot)
    selected: Slot = field(default_factory=Slot)  # requests with a menu item selected
    keystrokes: list[float] = field(default_factory=list)
    asked: int = 0  # when its last job started, in the order of all documents' jobs (Completer._make_room)

    @property
    def slots(self) -> tuple[Slot, Slot]:
        return self.plain, self.selected

    def running(self) -> bool:
        """Whether a job or warm-up of it is running (it may have requests at the daemon)."""
        return any(not t.done() for slot in self.slots for t in slot.tasks())


def selected_document(uri: str) -> str:
    """The daemon `document` of a document's requests with a menu item selected: the daemon supersedes an older Fim of
    the same `document`, and keeps a typed-through answer and a cache slot per `document`. (No URI has a space.)"""
    return uri + " #selected"


class Completer:
    def __init__(self, link: EditorLink, settings: Callable[[], EditorSettings],
                 document: Callable[[str], tuple[str, int | None] | None],
                 tell: Callable[[str], None] | None = None, project: ProjectContext | None = None,
                 lines: Callable[[str, str], Lines] | None = None):
        """`document(uri)` gives the live (text, version) of an open document, or None; `tell(message)` shows the
        user a message (window/showMessage); `project` finds code of the crate's other files for the prompt;
        `lines(uri, text)` the line index of a document's text (the server's keeps the document's line starts)."""
        self.link = link
        self.lines = lines or (lambda uri, text: Lines(text))
        self.project = project
        self.settings = settings
        self.document = document
        self.tell = tell or (lambda message: None)
        self._told_clamp: tuple[int, int] | None = None  # (maxTokens, limit) the user was told about
        self.docs: dict[str, DocState] = {}
        self.stats: Counter[str] = Counter()
        self.last_raw: str | None = None
        self.last_by_line: list[float] = []  # the daemon's Done.logprob_by_line for last_raw
        self.last_fim: dict | None = None
        self._background: set[asyncio.Task] = set()
        self._jobs_started = itertools.count(1)  # DocState.asked
        self._busy_told: float | None = None  # when the user was last told of a `busy` refusal (_busy)
        self._busy_untold = 0  # `busy` refusals since then

    # -- document events --------------------------------------------------------------------------------------

    def changed(self, uri: str, version: int | None) -> None:
        """A didChange: a job for an older version can only produce a stale result; stop it now."""
        st = self.docs.get(uri)
        for slot in st.slots if st is not None else ():
            if slot.job is not None and not slot.job.task.done() and slot.job.key[0] != version:
                slot.job.task.cancel()
                self.stats["stale"] += 1

    def closed(self, uri: str) -> None:
        st = self.docs.pop(uri, None)
        for task in [t for slot in st.slots for t in slot.tasks()] if st is not None else ():
            task.cancel()

    def reconfigured(self, old: EditorSettings, new: EditorSettings) -> None:
        """Settings changed under the running jobs. Completions turned off (`enable`: false): a job still debouncing or
        waiting on the daemon would answer its request with a suggestion the user no longer wants, so every job is
        cancelled (its daemon request gets a Cancel, its requests answer empty) and the shown suggestions go (none is
        typed through later). A change of what a completion is (EditorSettings.shape): the jobs of the old shape are
        cancelled, as the finished ones no longer answer."""
        if old.enable and not new.enable:
            for uri in list(self.docs):
                for slot in self.docs[uri].slots:
                    self._stop(slot, "disabled")
                self.closed(uri)
        elif old.shape() != new.shape():
            for slot in (slot for st in self.docs.values() for slot in st.slots):
                if slot.job is not None and slot.job.shape != new.shape():
                    self._stop(slot, "reshaped")

    def _stop(self, slot: Slot, why: str) -> None:
        if slot.job is not None and not slot.job.task.done():
            slot.job.task.cancel()
            self.stats[why] += 1

    # -- requests ---------------------------------------------------------------------------------------------

    async def complete(self, uri: str, offset_of: Callable[[str], int], *, invoked: bool = False,
                       selected: Callable[[str], tuple[str, int, str]] | None = None) -> Result | None:
        """The suggestion at a cursor (`offset_of(text)` maps the request's position into the snapshot). With
        `selected` (the editor's completion menu has an item selected), the suggestion is for the text as it will be
        once that item is accepted: `selected(text)` gives that text, its cursor and the item's text."""
        s = self.settings()
        if not s.enable:
            return None
        doc = self.document(uri)
        if doc is None:
            return None
        text, version = doc
        item = ""
        if selected is not None:
            text, offset, item = selected(text)
        else:
            offset = offset_of(text)
        st = self.docs.setdefault(uri, DocState())
        slot = st.selected if selected is not None else st.plain
        self.stats["requests"] += 1

        beside = st.selected.shown
        if slot is st.plain and beside is not None and (beside.text, beside.offset) == (text, offset):
            slot.shown = beside  # the menu's item was accepted: the ghost text shown beside it is this cursor's
        if slot.shown is not None and slot.shown.extra.get("shape") != s.shape():
            slot.shown = None  # shown under other settings: it is not what these would show
        if s.typed_through and slot.shown is not None:
            hit = policy.typed_through(slot.shown, text, offset)
            if hit is not None:
                self._supersede(slot)
                self.stats["typed_through"] += 1
                return Result(text, version, offset, hit, "typed_through",
                              policy.typed_through_alternatives(slot.shown, text, offset))
            if not (slot.shown.text == text and slot.shown.offset == offset):
                slot.shown = None

        key = (version, offset, item, 0.0 if invoked else s.min_probability, s.shape())
        job = slot.job
        if job is not None and job.key == key and not job.task.cancelled() and not (
                job.task.done() and (job.task.exception() is not None or job.task.result() is None)):
            # The same version and cursor: share the job (or its suggestion, if it has finished with one).
            self.stats["joined"] += 1
            if job.task.done():
                return job.task.result()
        else:
            self._supersede(slot)
            self._make_room(uri)
            document = uri if slot is st.plain else selected_document(uri)
            job = Job(key, asyncio.create_task(self._run(uri, document, slot, text, version, offset, invoked, s)))
            slot.job = job
            st.asked = next(self._jobs_started)
        job.waiters += 1
        try:
            result = await asyncio.shield(job.task)
            # (settings changed between the job's end and this handler's turn: `reconfigured` came too late for it)
            now = self.settings()
            return result if now.enable and now.shape() == job.shape else None
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():  # this request was cancelled ($/cancelRequest, shutdown)
                if job.waiters == 1:
                    job.task.cancel()
                self.stats["cancelled"] += 1
                raise
            return None  # superseded by a newer request, or the document changed
        except Exception:
            log.exception("completion failed")
            return None
        finally:
            job.waiters -= 1

    def _supersede(self, slot: Slot, why: str = "superseded") -> None:
        """Cancel the slot's job (counted as `why`) and its warm-up."""
        self._stop(slot, why)
        if slot.warm is not None and not slot.warm.done():
            slot.warm.cancel()

    def _make_room(self, uri: str) -> None:
        """Before a job starts for `uri`: cancel the jobs and warm-ups of the other documents asked about longest ago,
        so that at most MAX_LIVE_DOCUMENTS documents have one running."""
        live = sorted((st.asked, other) for other, st in self.docs.items() if other != uri and st.running())
        for _, other in live[: max(0, len(live) - MAX_LIVE_DOCUMENTS + 1)]:
            for slot in self.docs[other].slots:
                self._supersede(slot, "evicted")

    def debounce_s(self, s: EditorSettings) -> float:
        base = s.debounce_ms / 1000
        if s.debounce_mode == "fixed" or self.link.latency_ema_ms is None:
            return base
        # Adaptive: a quarter of the recent daemon latency, within [base/2, 2*base]. A fast daemon gets
        # requests sooner; a slow one is sent fewer that the next keystroke would supersede.
        return min(max(0.25 * self.link.latency_ema_ms / 1000, 0.5 * base), 2 * base)

    def _live_version(self, uri: str) -> int | None | bool:
        doc = self.document(uri)
        return False if doc is None else doc[1]

    async def _run(self, uri: str, document: str, slot: Slot, text: str, version: int | None, offset: int,
                   invoked: bool, s: EditorSettings) -> Result | None:
        """The job's suggestion, under settings `s`: those of its key (a change arriving before it starts is not
        its). `document`: the daemon's name for the slot's requests."""
        if not invoked:
            delay = self.debounce_s(s)
            if delay > 0:
                self.stats["debounced"] += 1
                await asyncio.sleep(delay)
        else:
            self.stats["undebounced"] += 1  # a manual trigger never waits
        if not self._fresh(uri, version):
            return None
        plan = policy.plan(text, offset, s.options())
        try:
            client = await self.link.get(wait=max(0.05, s.deadline_ms / 1000))
        except Unavailable:
            self.stats["unavailable"] += 1
            return None
        kwargs, prefix, suffix = fim_request(plan, s, client.welcome.max_context, self.lines(uri, text).breaks_before)
        if (prefix, suffix) != (plan.prefix, plan.suffix):
            self.stats["text_cut"] += 1
        self._clamped(plan.max_tokens, kwargs["max_tokens"])
        context = await self._context(uri, query_prefix(plan.prefix, prefix), s)
        # The width applies to a single-line suggestion of greedy decoding (the daemon searches only those; a
        # multi-line one stays greedy); None leaves it to the daemon's --beams.
        beams = s.beams if not plan.multiline and s.temperature == 0 else None
        got = await self._fim(document, client, kwargs, context, beams, s)
        if got is None or not self._fresh(uri, version):
            return None
        raw, done = got
        suggestion, why = shown_suggestion(plan, raw, done.line_logprob, done.logprob_by_line, s.min_probability,
                                           stats=self.stats, stop_sequence=done.stop_sequence,
                                           finish_reason=done.finish_reason)
        if why == "unsure":
            if not invoked:
                return None
            # The user asked: the model's best suggestion all the same (its first line: confident_lines cuts the rest).
            # The daemon ended this answer at the token that took it under the floor, so it is asked again without.
            self.stats["unsure_invoked"] += 1
            got = await self._fim(document, client, {**kwargs, "min_probability": None}, context, beams, s)
            if got is None or not self._fresh(uri, version):
                return None
            raw, done = got
            suggestion, why = shown_suggestion(plan, raw, done.line_logprob, done.logprob_by_line, s.min_probability,
                                               gate=False, stats=self.stats, stop_sequence=done.stop_sequence,
                                               finish_reason=done.finish_reason)
        if suggestion is None:
            return None
        self.stats["suggestions"] += 1
        alternatives = policy.alternatives(plan, suggestion, done.alternatives,
                                           policy.ended_by_line_break(done.stop_sequence))
        self.stats["alternatives"] += len(alternatives)
        slot.shown = policy.Shown(text, offset, suggestion, extra={"shape": s.shape()},
                                  alternatives=tuple(alternatives))
        if s.accept_ahead:
            slot.warm = self._spawn(self._warm(uri, document, slot.shown, s))
        return Result(text, version, offset, suggestion, "model", alternatives)

    def _fresh(self, uri: str, version: int | None) -> bool:
        """Whether the document is still at `version` (an answer for another is stale)."""
        if self._live_version(uri) == version:
            return True
        self.stats["stale"] += 1
        return False

    async def _fim(self, document: str, client: Client, kwargs: dict, context: list, beams: int | None,
                   s: EditorSettings) -> tuple[str, Done] | None:
        """The daemon's answer to a Fim (`kwargs`: fim_kwargs with the text as sent), or None when there is none (the
        daemon failed, timed out, or went away: counted and logged here)."""
        self.last_fim = {**kwargs, "document": document, "context": [c.path for c in context]}
        t0 = time.perf_counter()
        stream = None
        try:
            # A daemon that accepted the request but never finishes it must not hold the editor's request.
            async with asyncio.timeout(max(5.0, 5 * s.deadline_ms / 1000)):
                try:
                    stream = await client.fim(**kwargs, document=scrub(document), seed=s.seed, beams=beams,
                                              context=context, sampling=Sampling(temperature=s.temperature))
                    self.stats["daemon_requests"] += 1
                    raw, done = await stream.collect()
                except asyncio.CancelledError:
                    if stream is not None and stream.done is None:
                        self.stats["daemon_cancels"] += 1
                        self._spawn(_cancel_stream(stream))
                    raise
        except TimeoutError:
            log.warning("the daemon did not finish a completion in time")
            self.stats["daemon_timeouts"] += 1
            return None
        except DaemonUnavailable as e:
            self.link.lost(client, str(e))
            self.stats["unavailable"] += 1
            return None
        except DaemonError as e:
            if e.code == "busy":
                self._busy(e)
            elif e.code != "cancelled":
                log.warning("daemon error: %s", e)
            self.stats[f"daemon_error_{e.code}"] += 1
            return None
        self.link.record_latency((time.perf_counter() - t0) * 1000)
        self.last_raw, self.last_by_line = raw, list(done.logprob_by_line)
        if done.source == "typed_through":
            self.stats["daemon_typed_through"] += 1
        return raw, done

    def _busy(self, e: DaemonError) -> None:
        """A request the daemon refused `busy` (its queue, or this connection's share of it, is full: other clients'
        load, or a --max-per-connection under MAX_LIVE_DOCUMENTS): said in the log and to the user once, then at most
        once per BUSY_NOTICE_S with the count since. A warning per refused request buried the log, and the user was
        never told why completions went missing."""
        self._busy_untold += 1
        now = time.monotonic()
        if self._busy_told is not None and now - self._busy_told < BUSY_NOTICE_S:
            log.debug("daemon busy: %s", e.message)
            return
        n, told, self._busy_untold, self._busy_told = self._busy_untold, self._busy_told, 0, now
        why = e.message.removesuffix("; retry shortly")
        log.warning("the daemon refused %d completion request(s) as busy%s: %s", n,
                    "" if told is None else " since the last notice", why)
        self.tell(f"m31r: the completion daemon is busy ({why}); the completions it refuses are skipped.")

    async def _context(self, uri: str, prefix: str, s: EditorSettings) -> list:
        """Snippets of the crate's other files (none when the setting is off or finding them fails: a completion
        without them is still a completion)."""
        if not (s.project_context and self.project is not None):
            return []
        try:
            found = await self.project.find(uri, prefix)
        except Exception:
            log.exception("finding the crate's other files failed")
            return []
        self.stats["context_snippets"] += len(found)
        return [Snippet(text=scrub(c.text), path=scrub(c.path)) for c in found]

    def _clamped(self, max_tokens: int, limit: int) -> None:
        """fim_request sent `limit` for the plan's `max_tokens` (the daemon's limit, where it is lower): counted, and
        said to the user once per setting."""
        if max_tokens <= limit:
            return
        self.stats["max_tokens_clamped"] += 1
        if self._told_clamp != (max_tokens, limit):
            self._told_clamp = (max_tokens, limit)
            self.tell(f"m31r: maxTokens {max_tokens} is above the model's limit of {limit} tokens; using {limit}.")

    async def _warm(self, uri: str, document: str, shown: policy.Shown, s: EditorSettings) -> None:
        """Prefill the daemon's cache for the document as it will be once the suggestion is accepted (under its
        daemon `document`, which a warm-up of the other kind would supersede)."""
        text, offset = policy.accepted_state(shown)
        plan = policy.plan(text, offset, s.options())
        try:
            client = await self.link.get(wait=0)
        except Unavailable:
            return
        prefix, suffix = sent_text(plan.prefix, plan.suffix, client.welcome.max_context)
        context = await self._context(uri, query_prefix(plan.prefix, prefix), s)  # the same head as the request's
        stream = None
        try:
            stream = await client.fim(scrub(prefix), scrub(suffix), document=scrub(document), max_tokens=1,
                                      stop=plan.stop, context=context)
            self.stats["warm_requests"] += 1
            await stream.collect()
        except asyncio.CancelledError:
            if stream is not None and stream.done is None:
                self._spawn(_cancel_stream(stream))
            raise
        except (DaemonError, DaemonUnavailable):
            pass

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def close(self) -> None:
        """Cancel every document's job and warm-up and wait for them and the Cancels they send: a TCP session's
        server is dropped when its editor leaves, and its tasks must not outlive it."""
        tasks = [t for st in self.docs.values() for slot in st.slots for t in slot.tasks()]
        for uri in list(self.docs):
            self.closed(uri)
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*self._background, return_exceptions=True)

    def snapshot(self) -> dict:
        return {**self.stats, "lastRaw": self.last_raw, "lastLogprobByLine": self.last_by_line,
                "lastFim": self.last_fim, "debounceMs": round(self.debounce_s(self.settings()) * 1000, 2)}


async def _cancel_stream(stream) -> None:
    """Send Cancel, then read the stream to its end so the client forgets it."""
    with contextlib.suppress(DaemonUnavailable, ConnectionError):
        await stream.cancel()
    with contextlib.suppress(DaemonError, DaemonUnavailable, TimeoutError, ConnectionError):
        async with asyncio.timeout(10):
            async for _ in stream:
                pass


def fim_request(plan: policy.Plan, s: EditorSettings, max_context: int,
                breaks_before: Callable[[int], int] | None = None) -> tuple[dict, str, str]:
    """The Fim the language server sends for `plan` under settings `s` to a daemon whose model has `max_context`
    tokens: Client.fim's keyword arguments (less document, context, beams, seed and sampling), and the prefix and
    suffix sent before scrub (sent_text's). Shared with the evaluations' "as shown" (benchmarks/eval_fim.py), so that
    they score the request the server sends. `breaks_before`: as sent_text's."""
    kwargs = plan.fim_kwargs()
    prefix, suffix = sent_text(plan.prefix, plan.suffix, max_context, breaks_before)
    kwargs["prefix"], kwargs["suffix"] = scrub(prefix), scrub(suffix)
    # The daemon refuses a max_tokens above half its model's context, the rest being the code around the cursor (every
    # completion would silently come back empty): its limit instead (Completer._clamped tells the user).
    kwargs["max_tokens"] = min(plan.max_tokens, max_context // 2)
    # The daemon stops once the floor has decided what is shown (Fim.min_probability): the same suggestion, without
    # the tokens it would cut.
    kwargs["min_probability"] = s.min_probability or None
    return kwargs, prefix, suffix


def shown_suggestion(plan: policy.Plan, raw: str, line_logprob: float | None, logprob_by_line: list[float],
                     min_probability: float, *, gate: bool = True, stats: Counter[str] | None = None,
                     stop_sequence: str | None = None,
                     finish_reason: str | None = None) -> tuple[policy.Suggestion | None, str]:
    """What the editor shows of the daemon's answer `raw` (with its Done's line_logprob, logprob_by_line,
    stop_sequence and finish_reason) to `plan`'s Fim: (suggestion, "") or (None, why): "unsure" where its first line
    is under the floor `min_probability` (hidden, with `gate`: a request nobody invoked; the server asks an invoked
    one again and shows it ungated), "empty" where nothing is left once the lines after the first are cut at the
    floor (or max_tokens' unfinished line is dropped) and the policy has post-processed it. Shared with the
    evaluations' "as shown" (benchmarks/eval_fim.py), so that they score what the server shows. `stats` counts
    unsure, lines_cut, unfinished_line_cut and empty (Completer.stats)."""
    stats = stats if stats is not None else Counter()
    if gate and not policy.confident(policy.first_line_logprob(raw, line_logprob, logprob_by_line), min_probability):
        stats["unsure"] += 1
        return None, "unsure"
    sure = policy.confident_lines(raw, logprob_by_line, min_probability, whole_lines=plan.cursor.at_line_head)
    if sure != raw:
        stats["lines_cut"] += 1
    text, ended = policy.to_postprocess(raw, sure, stop_sequence, finish_reason)
    if text != sure:
        stats["unfinished_line_cut"] += 1
    suggestion = policy.postprocess(plan, text, ended)
    if suggestion is None:
        stats["empty"] += 1
        return None, "empty"
    return suggestion, ""


def sent_text(prefix: str, suffix: str, max_context: int,
              breaks_before: Callable[[int], int] | None = None) -> tuple[str, str]:
    """The prefix and suffix a Fim carries: each side cut to what the daemon could keep of it, the lines above the
    cursor at a line whose index in the document is a multiple of LINE_STEP, as the daemon's own cut is. The prompt
    is then the one the whole text gives (the daemon keeps fewer characters than were sent), in a document of any
    size. `breaks_before(i)`: split_breaks(prefix, 0, i), from a line index that need not count from the start."""
    limit = min(CHARS_PER_TOKEN * max(1, max_context), MAX_SIDE_CHARS)
    if len(prefix) > limit:
        cut = line_start(prefix)  # the daemon's split: the lines above, and the cursor's line up to the cursor
        prefix = _lines_above(prefix, cut, limit, breaks_before) + _line_end(prefix[cut:], limit)
    return prefix, suffix[:limit]


def query_prefix(prefix: str, sent: str) -> str:
    """The text that project context is chosen by (m31r_protocol.context.query_words reads the whole lines above the
    cursor's, in blocks of QUERY_STEP): the text sent when it holds enough whole lines for the same choice (it starts
    at a line whose index is a multiple of LINE_STEP, so the blocks fall alike), else the whole prefix. Reading a long
    document's whole prefix cost a list of all of its lines per keystroke."""
    if len(sent) < len(prefix):  # cut
        lines = split_breaks(sent, 0, line_start(sent))
        if lines // QUERY_STEP * QUERY_STEP >= QUERY_LINES:
            return sent
    return prefix


def _line_end(line: str, limit: int) -> str:
    """The end of the cursor's line (up to the cursor) in at most `limit` characters, cut at a multiple of half of it
    from the line's start: typing moves the cut once in limit/2 keystrokes, so the daemon still sees each new prefix
    extend the last one (its typed-through answers) on a line longer than the limit."""
    step = max(1, limit // 2)
    over = len(line) - limit
    return line if over <= 0 else line[-(-over // step) * step :]


def _lines_above(prefix: str, cut: int, limit: int, breaks_before: Callable[[int], int] | None = None) -> str:
    """The last whole lines of prefix[:cut] (text ending with a line break) that fit `limit` characters, from a line
    whose index in it is a multiple of LINE_STEP: the daemon counts its blocks of lines from the first line it is
    sent, so dropping whole blocks keeps them."""
    at = cut - limit
    if at <= 0:
        return prefix[:cut]
    if prefix[at - 1] == "\r" and prefix[at] == "\n":  # not between the two characters of one line break
        at += 1
    tail = prefix[at:cut]
    index = breaks_before(at) if breaks_before is not None else split_breaks(prefix, 0, at)  # the line at tail[0]
    lines = tail.splitlines(keepends=True)
    if prefix[at - 1] not in SPLITLINES_BREAKS:  # tail starts inside that line: its first whole line is the next one
        lines, index = lines[1:], index + 1
    skip = -index % LINE_STEP  # lines to the next multiple of LINE_STEP
    return "".join(lines[skip:])

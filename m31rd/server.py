"""The event-loop side of the daemon: connections, request validation, newest-wins, typed-through.

Data path: socket frame → protocol Struct (here) → scheduler Request (here) → scheduler (inference thread) →
engine → model → scheduler events → `_deliver` (back on the loop) → frame to the client. This module is the only
place that maps wire messages to and from the scheduler's requests and events. Nothing a client sends can stop
the daemon: a bad frame costs that client its connection, a bad request gets an Error, and everyone else is served.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import math
import os
import re
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import msgspec
import psutil

from m31r.checksums import BundleError, fingerprint
from m31r.config import load_config
from m31r.context import context_ids, context_room
from m31r.fim import FimBudget, build_fim_prompt, heal_prompt, line_context, start_stop, suffix_stop
from m31r.stops import first_hit, first_stop
from m31r_protocol import messages as m
from m31r_protocol.framing import FrameNotBegun, FrameTimeout, FrameTooLarge, pack, read_frame
from m31r_protocol.limits import MAX_FRAME_BYTES, MAX_LOGPROBS, MAX_SNIPPETS, MAX_STOP_CHARS, MAX_STOPS, MAX_STOPS_CHARS
from m31r_protocol.peer import peer_uid
from m31r_protocol.version import VERSION
from m31rd.cancellation import Cancellation
from m31rd.torch_thread import TorchThread

if TYPE_CHECKING:  # torch comes in with these: the server serves Hello and Status before it has loaded
    from collections.abc import Iterator

    from m31r.engine import ContextOverflowError, Engine, Piece
    from m31r.sampling import SamplingParams
    from m31r.tokenizer import Tokenizer
    from m31rd.scheduler import Event

log = logging.getLogger("m31rd")
FLUSH_S = 2.0  # how long a closing connection may take to send what is buffered for its client
SOCKET_CHECK_S = 1.0  # how often the daemon checks that its socket file is still the one it made (_watch_socket)
SMALL_PROMPT_CHARS = 1 << 16  # prompts up to this size are tokenised on their own worker, never behind a huge one
TYPED_DOCUMENTS = 256  # documents whose last suggestion a typed-through answer may come from (Daemon._remember)
TYPED_CHARS = 1 << 24  # the characters of their names, prefixes and suffixes kept for it, in all
HELLO_S = 10.0  # how long a new connection may take to begin its Hello where --read-timeout is 0 (no limit)
MAX_CONNECTIONS = 256  # connections served at once (fewer where open files are few: connection_cap); more are `busy`
SPARE_FILES = 64  # descriptors left to the daemon's own files, and to refusing connections past the cap
REFUSING = SPARE_FILES // 2  # connections past the cap being refused at once; more are closed without a word
READING_BYTES = 8 * MAX_FRAME_BYTES  # large frames' bytes being read at once, over all connections (reading_frame)
SMALL_FRAME_BYTES = 1 << 16  # frames up to this size are not counted: a connection's stream buffer holds as much
UNREAD_BYTES = 1 << 20  # answers a client may leave unread before the daemon drops it (Connection.send)


@dataclass(frozen=True)
class BundleIdentity:
    """What Hello and Status say of the model before it has loaded: read from the bundle's small files, without
    torch. The engine checks the bundle in full as it loads; a bundle it refuses ends the daemon."""

    model: str
    fingerprint: str
    path: str
    max_context: int

    @classmethod
    def read(cls, path: Path) -> BundleIdentity:
        import json

        try:
            meta = json.loads((path / "metadata.json").read_text())
            return cls(f"{meta['model_name']}@{meta['model_version']}", fingerprint(path), str(path),
                       load_config(path / "config.yaml").max_context)
        except Exception:  # the engine's load names the fault
            return cls("?", "?", str(path), 0)


@dataclass
class Typed:
    """The last finished greedy Fim of a document: what typed-through answers from."""

    prefix: str
    suffix: str
    text: str
    finish_reason: str
    ends: tuple[int, ...]  # where each of the suggestion's tokens ends in `text`
    logprob: float | None = None  # the suggestion's (Done.logprob): a lower bound for any rest of it
    by_line: tuple[float, ...] = ()  # Done.logprob_by_line: the line the user is on gives a lower bound for its rest
    stopped_by: str | None = None  # what a "stop" was (Outcome.stopped_by): end | sequence | repeat | unsure
    stop_sequence: str | None = None  # for "sequence": which (Done.stop_sequence)
    stops: tuple[str, ...] = ()  # the stop sequences it ran with (request_stops)
    shape: tuple = ()  # what else decided its text (answer_shape)
    max_tokens: int = 0  # the request's limits, which may have ended it
    min_probability: float = 0.0
    alternatives: tuple[str, ...] = ()  # Done.alternatives: a beam search's runners-up, whole


def answer_shape(req: m.Fim, sampling: SamplingParams, beams: int) -> tuple:
    """What, besides the prompt and the limits `clip` applies, decides a greedy Fim's text: an answer of another
    shape is not the one this request would get."""
    return sampling.repetition_penalty, beams, hash(tuple((s.path, s.text) for s in req.context))


def typed_through(last: Typed | None, req: m.Fim, shape: tuple = ()) -> Typed | None:
    """What is left of the last suggestion if the user typed its beginning (and the request has its shape),
    else None."""
    if last is None or req.suffix != last.suffix or not req.prefix.startswith(last.prefix) or shape != last.shape:
        return None
    typed = req.prefix[len(last.prefix) :]
    k = len(typed)
    if typed and last.text.startswith(typed) and len(last.text) > k:
        ends = tuple(e - k for e in last.ends if e > k)
        alternatives = tuple(a[k:] for a in last.alternatives if a.startswith(typed) and len(a) > k)
        return dataclasses.replace(last, prefix=req.prefix, text=last.text[k:], ends=ends,
                                   by_line=last.by_line[typed.count("\n") :], alternatives=alternatives)
    return None


def token_ends(tokenizer: Tokenizer, tokens: list[int], heal: str, text: str, healed: int,
               cut: bool) -> tuple[int, ...] | None:
    """Where each of a completion's `tokens` (those after its `healed` healing tokens: the ones streamed) ends in its
    `text`, from the tokens' own bytes; None where that is not certain. The frames' texts are no measure: text that
    may begin a stop sequence or repeat a line is held back and sent with a later token, so a typed-through answer
    cut at a token count by them wrote more tokens than max_tokens allowed (five for one) or fewer. `heal`: the
    prompt's healed end, whose last bytes the first token may write again; `cut`: the text ends before the tokens' end
    (a stop sequence or a deadline), not with them."""
    if not tokens:
        return ()
    parts = [tokenizer.text_bytes(t) for t in tokens]  # as the text stream takes them
    whole, hb, tb = b"".join(parts), heal.encode(), text.encode()
    # r: the healed bytes the first token writes again, the rest of the heal after the healing tokens' (all of it
    # where there were none). The text must be those bytes after r: all of them, or where cut, their start.
    rs = [len(hb)] if healed == 0 else range(min(len(hb), len(parts[0]) - 1) + 1)
    fits = [r for r in rs if r < len(parts[0]) and hb.endswith(parts[0][:r])
            and (whole[r:].startswith(tb) if cut else whole[r:] == tb)]
    if len(fits) != 1:
        return None
    byte_ends, at = [], -fits[0]
    for b in parts:
        at += len(b)
        byte_ends.append(min(at, len(tb)))
    # Byte offsets as character offsets (one inside a character: before it, where a cut leaves it out).
    char_ends = list(itertools.accumulate(len(c.encode()) for c in text))
    return tuple(bisect.bisect_right(char_ends, b) for b in byte_ends)


def overflow_error(rid: int, e: ContextOverflowError) -> m.Error:
    """The `context_overflow` frame, with the figures a front end words its own advice from (m31r_http)."""
    return m.Error(id=rid, code="context_overflow", message=str(e),
                   overflow=m.OverflowDetail(e.prompt_tokens, e.max_tokens, e.max_context))


def requests(n: int) -> str:
    """`n` requests, worded for its number: a limit of 1 said "1 requests in flight"."""
    return f"{n} request{'' if n == 1 else 's'}"


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


class Clipped(NamedTuple):
    """A typed-through answer: its text and how it ended (Done's fields)."""

    text: str
    finish_reason: str
    stopped_by: str | None = None
    stop_sequence: str | None = None


def clip(rest: Typed, max_tokens: int, stop: list[str], min_probability: float = 0.0) -> Clipped | None:
    """The typed-through answer to a request with these limits, and how it ends: `rest` cut after
    `max_tokens` tokens (a partly typed token counts as one), then before the first stop sequence, as the model
    would have stopped. None where only the model can answer: the rest ends where the earlier request's limits ended
    it, and this request allows more (a larger max_tokens, a lower confidence floor, fewer stop sequences), or where
    a deadline ended it; and this request's own limits end nothing sooner. (With the same limits, as an editor sends
    while the user types, the rest is answered: the model's would start the same and may run a little further, the
    typed tokens no longer counting towards max_tokens or the floor.)"""
    text, cut = rest.text, False
    ended = Clipped(text, rest.finish_reason, rest.stopped_by, rest.stop_sequence)
    if max_tokens <= len(rest.ends):
        cut = True
        if max_tokens < len(rest.ends):
            text = text[: rest.ends[max_tokens - 1]] if max_tokens > 0 else ""
            ended = Clipped(text, "length")
    if (hit := first_hit(text, stop)) is not None:
        text, cut = text[: hit[0]], True
        ended = Clipped(text, "stop", "sequence", hit[1])
    if rest.finish_reason == "length":
        own_end = max_tokens <= rest.max_tokens
    elif rest.finish_reason == "stop":
        own_end = {"end": True, "repeat": True, "unsure": min_probability >= rest.min_probability,
                   "sequence": set(rest.stops) <= set(stop)}.get(rest.stopped_by or "", False)
    else:  # a deadline's cut
        own_end = False
    return ended if cut or own_end else None


def clip_alternatives(rest: Typed, answer: str, max_tokens: int, stop: list[str]) -> list[str]:
    """The runners-up still open after the typed text, cut at this request's stop sequences as the answer is, so an
    editor cycling through suggestions keeps them while the user types. None are kept where this request's max_tokens is
    below the earlier one's: their tokens are not kept, so where that limit would cut them is unknown."""
    if max_tokens < rest.max_tokens:
        return []
    out: list[str] = []
    for a in rest.alternatives:
        if (at := first_stop(a, stop)) is not None:
            a = a[:at]
        if a and a != answer and a not in out:
            out.append(a)
    return out


def request_stops(req: m.Generate | m.Fim) -> list[str]:
    """The request's stop sequences; a Fim's also end where the completion writes the suffix's next line again
    (m31r.fim.suffix_stop), so a model that misses its end-of-middle does not repeat the code below the cursor."""
    if isinstance(req, m.Fim) and (at_suffix := suffix_stop(req.prefix, req.suffix)):
        return [*req.stop, at_suffix]
    return list(req.stop)


def request_start_stops(req: m.Generate | m.Fim) -> list[str]:
    """A Fim's stop only at the completion's start: the suffix's next line written first, where the cursor is at a
    line's start (m31r.fim.start_stop), which request_stops' sequence cannot see."""
    if isinstance(req, m.Fim) and (at_start := start_stop(req.prefix, req.suffix)):
        return [at_start]
    return []


def beams_refusal(beams: int, sampling: SamplingParams) -> str | None:
    """Why a request's `beams` cannot be served, or None."""
    from m31r.beams import MAX_BEAMS

    if not 1 <= beams <= MAX_BEAMS:
        return f"beams must be between 1 and {MAX_BEAMS}, got {beams}"
    if beams > 1 and not (sampling.greedy and sampling.repetition_penalty == 1.0):
        return "beam search is greedy: beams above 1 take no temperature and no repetition_penalty"
    return None


def request_beams(req: m.Generate | m.Fim, sampling: SamplingParams, default: int) -> int:
    """The beam width a request runs with: its own, else `default` for a greedy line completion (a "\\n" stop), where
    beam search measured better than greedy decoding; longer completions measured worse (README "Beam search for line
    completions")."""
    if req.beams is not None:
        return req.beams
    plain = sampling.greedy and sampling.repetition_penalty == 1.0
    return default if plain and "\n" in req.stop else 1


# Whitespace at a line's end, as str.rstrip (m31r.train.corpus.normalize's) takes it: \s is str.isspace's set.
_TRAILING = re.compile(r"[^\S\n]+(?=\n)")


def _lf(s: str) -> str:
    return s.replace("\r\n", "\n").replace("\r", "\n") if "\r" in s else s


def _bare(lines: str) -> str:
    """Whole lines without the spaces at their ends."""
    return _TRAILING.sub("", lines)


def _bare_above(prefix: str) -> str:
    """The lines above the cursor's without trailing spaces; the cursor's line as typed (`let x = ` means something)."""
    cut = prefix.rfind("\n") + 1
    return _bare(prefix[:cut]) + prefix[cut:]


def as_trained(req: m.Generate | m.Fim) -> m.Generate | m.Fim:
    """The request's text as the corpus the model learned from had it (m31r.train.corpus.normalize): no byte order
    mark, LF line ends (CR LF and lone CR read as LF), no spaces at the ends of whole lines (the cursor's line is kept
    as typed). The model never saw the others: served as they were, a file with CRLF line ends got 16.0% of make
    eval's single lines exactly right against 52.0% read as LF, and blank lines indented as editors leave them (with a
    trailing space on every fifth line) 50.0% and 0.433 multi-line edit similarity against 52.0% and 0.477 (README
    "Line ends"). Completions come back with LF: the editors' policy writes the document's own line break."""
    if isinstance(req, m.Generate):
        prompt = _bare_above(_lf(req.prompt.removeprefix("\ufeff")))
        return req if prompt == req.prompt else msgspec.structs.replace(req, prompt=prompt)
    # A cursor inside a CR LF (an HTTP client's offset can fall there) splits one line end: read apart, each half
    # would be one, and the file would gain a blank line.
    suffix = req.suffix[1:] if req.prefix.endswith("\r") and req.suffix.startswith("\n") else req.suffix
    prefix, suffix = _bare_above(_lf(req.prefix.removeprefix("\ufeff"))), _bare(_lf(suffix))
    context = [c if (t := _bare(_lf(c.text))) == c.text else msgspec.structs.replace(c, text=t) for c in req.context]
    if prefix == req.prefix and suffix == req.suffix and all(a is b for a, b in zip(context, req.context, strict=True)):
        return req
    return msgspec.structs.replace(req, prefix=prefix, suffix=suffix, context=context)


def prompt_chars(req: m.Generate | m.Fim) -> int:
    if isinstance(req, m.Generate):
        return len(req.prompt)
    return len(req.prefix) + len(req.suffix) + sum(len(s.text) + len(s.path) for s in req.context)


def wire_refusal(req: m.Generate | m.Fim, max_context: int, budget: FimBudget | None,
                 max_prompt_chars: int) -> str | None:
    """Why a request cannot be served, from its fields and the model's context alone (no torch: checked on arrival,
    also while the model loads), or None. `max_context` 0 and `budget` None: unknown yet, checked once loaded."""
    if max_context > 0 and not 0 <= req.max_tokens <= max_context:
        return f"max_tokens must be between 0 and {max_context}, got {req.max_tokens}"
    if isinstance(req, m.Fim) and budget is not None and req.max_tokens > budget.max_reserve:
        return (f"max_tokens {req.max_tokens} is more than a fim completion may have with this model: "
                f"{budget.max_reserve}, half its context (the rest holds the code around the cursor)")
    s = req.sampling
    if not all(math.isfinite(x) for x in (s.temperature, s.top_p, s.repetition_penalty)):
        return "temperature, top_p and repetition_penalty must be finite numbers"
    if req.deadline_ms is not None and req.deadline_ms < 0:
        return f"deadline_ms must be >= 0, got {req.deadline_ms}"
    if req.lookahead is not None and req.lookahead < 0:
        return f"lookahead must be >= 0, got {req.lookahead}"
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        return f"logprobs must be between 0 and {MAX_LOGPROBS}, got {req.logprobs}"
    if isinstance(req, m.Fim) and req.min_probability is not None and not 0 <= req.min_probability <= 1:
        return f"min_probability must be between 0 and 1, got {req.min_probability}"
    if (empty := next((i for i, x in enumerate(req.stop) if not x), None)) is not None:
        # Once left out unsaid: a client that meant something by it (a line end lost in quoting) never learned.
        return (f"stop[{empty}] is an empty string: a stop sequence needs at least one character; leave it out to "
                f"stop only at the model's end or max_tokens")
    if (len(req.stop) > MAX_STOPS or any(len(x) > MAX_STOP_CHARS for x in req.stop)
            or sum(map(len, req.stop)) > MAX_STOPS_CHARS):
        return (f"stop has {len(req.stop)} sequences of up to {max(map(len, req.stop))} characters, "
                f"{sum(map(len, req.stop))} in all; at most {MAX_STOPS} of at most {MAX_STOP_CHARS} are taken, "
                f"{MAX_STOPS_CHARS} characters in all (each is matched on every token)")
    if isinstance(req, m.Fim) and len(req.context) > MAX_SNIPPETS:
        return f"context has {len(req.context)} snippets; at most {MAX_SNIPPETS} are taken"
    if (chars := prompt_chars(req)) > max_prompt_chars:  # before tokenising: a length costs nothing
        what = "the prompt has" if isinstance(req, m.Generate) else "prefix, suffix and context have"
        return f"{what} {chars} characters; this daemon takes at most {max_prompt_chars} (--max-prompt-chars)"
    return None


class Built(NamedTuple):
    """A request's prompt as build_prompt makes it."""

    ids: list[int]
    max_tokens: int
    heal: str  # the healed text: the completion starts by writing it again (m31r.fim)
    truncated: bool = False  # the prompt lost text of the request's to fit (Done's)


def build_prompt(engine: Engine, budget: FimBudget, req: m.Generate | m.Fim) -> Built:
    """A request's prompt ids, max_tokens and healed text (m31r.fim). Runs on a worker thread: the tokenizer lets
    go of the GIL on long texts, so a huge prompt costs its own request time, not everyone's (on the inference
    thread it stalled every stream). Raises ContextOverflowError (too many tokens) or ValueError (an empty
    prompt)."""
    if isinstance(req, m.Fim):
        budget = budget.with_reserve(req.max_tokens)  # within max_reserve: the request was checked
        prompt = build_fim_prompt(engine.tokenizer, req.prefix, req.suffix, budget)
        room = context_room(budget, prompt)  # P_line at its budget: typing on a line keeps the snippets
        head = context_ids(engine.tokenizer, req.context, room) if req.context else []
        # (snippets that do not fit are no cut: the context is extra code the daemon lays before the prompt as room
        # allows, never all of it)
        return Built(head + prompt.ids, req.max_tokens, prompt.heal, prompt.truncated)
    ids = engine.tokenizer.encode(req.prompt)
    if not ids:
        raise ValueError("empty prompt: nothing to continue from")
    fitted = engine.fit_prompt(ids, req.max_tokens, req.truncate)
    kept, heal = heal_prompt(engine.tokenizer, fitted)
    return Built(kept, req.max_tokens, heal, len(fitted) < len(ids))


def build_unless_cancelled(engine: Engine, budget: FimBudget, job: InFlight) -> Built | None:
    """build_prompt, unless the job was cancelled while it waited for the worker: a client that cancels what it sends
    must not keep the workers tokenising megabytes for nothing (the limits count only live requests)."""
    return None if job.cancelled else build_prompt(engine, budget, job.wire)


@dataclass(eq=False)
class InFlight:
    """A Generate or Fim the daemon accepted, from admission to its last frame. Only the event loop touches it;
    the scheduler sees the Request built from it, and shares only `cancellation`."""

    conn: Connection
    wire: m.Generate | m.Fim
    sampling: SamplingParams
    received: float = field(default_factory=time.perf_counter)
    deadline: float | None = None
    cancellation: Cancellation = field(default_factory=Cancellation)
    text: str = ""  # what was sent so far (typed-through reuses it)
    tokens: list[int] = field(default_factory=list)  # the tokens sent (token_ends places them in `text`)
    heal: str = ""  # the prompt's healed end (build_prompt's)
    truncated: bool = False  # the prompt lost text of the request's to fit (build_prompt's; Done's)
    beams: int = 1  # the beam width it runs with (request_beams)

    @property
    def rid(self) -> int:
        return self.wire.id

    @property
    def document(self) -> str:
        return self.wire.document if isinstance(self.wire, m.Fim) else ""

    @property
    def cancelled(self) -> bool:
        return self.cancellation.cancelled

    def cancel(self, reason: str, code: str = "cancelled") -> None:
        self.cancellation.cancel(reason, code)


class ReadRefused(Exception):
    """A large frame that would take the bytes being read past READING_BYTES: refused before its body is read."""

    def __init__(self, size: int, reading: int):
        super().__init__(f"this {size}-byte frame was refused unread: the daemon is already reading {reading} bytes of "
                         f"other large frames, and reads at most {READING_BYTES} at once; retry shortly")


class Connection:
    def __init__(self, daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.daemon, self.reader, self.writer = daemon, reader, writer
        self.jobs: dict[int, InFlight] = {}
        self.client = "?"

    def send(self, msg: msgspec.Struct) -> None:
        if self.writer.is_closing():
            return
        self.writer.write(pack(self.daemon.enc.encode(msg)))
        if (unread := self.writer.transport.get_write_buffer_size()) > UNREAD_BYTES:
            self._drop(unread)

    def _drop(self, unread: int) -> None:
        """Give up on a client that leaves its answers unread. Its streams kept writing into the daemon's memory
        (up to --max-per-connection streams of max_tokens frames each, per connection), and closing politely would
        wait for it to read them."""
        log.warning("dropped the connection of client %r: %d bytes of its answers unread (limit %d)", self.client,
                    unread, UNREAD_BYTES)
        for job in self.jobs.values():
            job.cancel("the client did not read its answers")
        self.writer.transport.abort()

    async def refuse(self, error: m.Error) -> None:
        """Answer a connection that is not served with `error`, and close it once its client has (or after
        hello_s). What the client sends meanwhile is read and dropped: closed with its Hello unread, the socket
        reset, and the client saw "connection reset", not the error."""
        self.send(error)
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(self.daemon.hello_s):
                while await self.reader.read(SMALL_FRAME_BYTES):
                    pass
        await self._close()

    async def _close(self) -> None:
        self.writer.close()
        # What is buffered must reach a client that reads slowly before a stopping daemon exits (it would be cut
        # off mid-answer), but one that never reads must not hold the stop for long.
        with contextlib.suppress(OSError, TimeoutError):
            async with asyncio.timeout(FLUSH_S):
                await self.writer.wait_closed()

    async def serve(self) -> None:
        try:
            sock = self.writer.get_extra_info("socket")
            uid = peer_uid(sock) if sock is not None and sock.family == socket.AF_UNIX else None
            if uid is not None and uid != os.getuid():
                log.warning("refused a connection from uid %s", uid)
                self.send(m.Error(id=None, code="forbidden", message="this daemon serves only its own user"))
                return
            if await self._handshake():
                while (body := await self._read()) is not None:
                    if not self._handle(body):
                        break
                    await self.writer.drain()
                    # A frame already buffered is read without a pause: one client's flood of small frames (Status,
                    # Cancel) ran on for as many as it had buffered, stalling every other client for up to 0.9 s.
                    await asyncio.sleep(0)
        except FrameTooLarge as e:
            self.send(m.Error(id=None, code="frame_too_large", message=str(e)))
        except FrameTimeout as e:  # a client that stalls mid-frame would hold this connection forever
            self.send(m.Error(id=None, code="bad_request", message=f"{e} (--read-timeout); closing the connection"))
        except FrameNotBegun as e:  # nor may one that never says who it is (only the Hello has a deadline to begin)
            self.send(m.Error(id=None, code="bad_request", message=(
                f"no hello began within {e.timeout:g} s of connecting (--read-timeout); closing the connection")))
        except ReadRefused as e:
            self.send(m.Error(id=None, code="busy", message=f"{e}; closing the connection"))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away mid-frame: its jobs are cancelled below
        except Exception:
            log.exception("connection handler failed")
            self.send(m.Error(id=None, code="internal", message="the daemon hit an internal error on this connection"))
        finally:
            for job in self.jobs.values():
                job.cancel("client disconnected")
            self.daemon.drop_waiting(self)
            await self._close()

    async def _read(self, begin_within: float | None = None) -> bytes | None:
        """The next frame (read_frame's contract): whole within --read-timeout of its first byte, begun within
        `begin_within` seconds (the Hello's), a large one's body counted against READING_BYTES
        (Daemon.reading_frame)."""
        return await read_frame(self.reader, timeout=self.daemon.read_timeout, begin_within=begin_within,
                                reserve=self.daemon.reading_frame)

    async def _handshake(self) -> bool:
        body = await self._read(begin_within=self.daemon.hello_s)
        if body is None:
            return False
        try:
            hello = self.daemon.dec.decode(body)
        except (msgspec.MsgspecError, UnicodeDecodeError) as e:  # msgspec raises the latter for invalid UTF-8
            self.send(m.Error(id=None, code="bad_request", message=f"undecodable handshake: {e}"))
            return False
        if not isinstance(hello, m.Hello):
            self.send(m.Error(id=None, code="bad_request", message=f"expected hello first, got {type(hello).__name__}"))
            return False
        if hello.protocol != m.PROTOCOL_VERSION:
            self.send(m.Error(id=None, code="unsupported_version", message=(
                f"client speaks protocol {hello.protocol}, this daemon speaks {m.PROTOCOL_VERSION}; "
                f"upgrade the older side")))
            return False
        self.client = hello.client[:64]
        self.send(self.daemon.welcome())
        return True

    def _handle(self, body: bytes) -> bool:
        """Handle one message; False closes the connection."""
        try:
            msg = self.daemon.dec.decode(body)
        except msgspec.ValidationError as e:
            rid = _salvage_id(body)
            if rid is not None and self.daemon.holds(self, rid):  # answered as a duplicate is: that id's frames
                self.send(m.Error(id=None, code="bad_request", message=(  # are the running request's
                    f"request id {rid} is already in flight on this connection; this invalid message with its id was "
                    f"dropped: {e}")))
                return True
            self.send(m.Error(id=rid, code="bad_request", message=f"invalid message: {e}"))
            return True
        except (msgspec.DecodeError, UnicodeDecodeError) as e:  # msgspec raises the latter for invalid UTF-8
            self.send(m.Error(id=None, code="bad_request", message=f"undecodable frame: {e}"))
            return False
        if isinstance(msg, m.Generate | m.Fim):
            self.daemon.submit(self, msg)
        elif isinstance(msg, m.Cancel):
            if job := self.jobs.get(msg.id):
                job.cancel("cancelled by the client")
            else:
                self.daemon.cancel_waiting(self, msg.id)
        elif isinstance(msg, m.Status):
            self.send(self.daemon.status(msg.id))
        elif isinstance(msg, m.Shutdown):
            self.send(m.ShutdownReply(id=msg.id))
            self.daemon.request_stop("shutdown requested by a client")
        else:
            self.send(m.Error(id=None, code="bad_request", message=f"unexpected {type(msg).__name__} after handshake"))
        return True


def file_identity(path: Path) -> tuple[int, int] | None:
    """The file at `path` (device, inode), or None when there is none: which file a path names, not its name. Raises
    OSError where that cannot be told (a folder on the way no longer searchable)."""
    try:
        st = path.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_dev, st.st_ino


def connection_cap() -> int:
    """MAX_CONNECTIONS, or fewer where the soft limit on open files leaves less room past SPARE_FILES: at that limit
    accept() fails, and a client waited in the listen queue unanswered rather than being told `busy`."""
    try:
        import resource
    except ImportError:  # no such limits here
        return MAX_CONNECTIONS
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_CONNECTIONS if soft == resource.RLIM_INFINITY else max(1, min(MAX_CONNECTIONS, soft - SPARE_FILES))


def _salvage_id(body: bytes) -> int | None:
    with contextlib.suppress(Exception):
        rid = msgspec.msgpack.decode(body).get("id")
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None  # True is an int
    return None


class Daemon:
    def __init__(self, torch_thread: TorchThread, identity: BundleIdentity, *, cache_mb: float, max_queue: int = 32,
                 max_active: int = 4, grace_s: float = 5.0, max_per_connection: int = 16,
                 max_prompt_chars: int = 1 << 21, read_timeout: float | None = 10.0, lookahead: int = 0,
                 beams: int = 1, device: str = "cpu", dtype: str = "auto"):
        """The daemon serves from before its model has loaded: `attach` (on `torch_thread`, which builds the
        engine and serves the scheduler) brings the engine; until then Hello and Status are answered from
        `identity`, and requests wait. `lookahead`: the prompt-lookup drafts per decode step of a request that does
        not choose (Engine.generate). `beams`: the beam width of a greedy line completion that does not choose
        (request_beams)."""
        self.torch_thread, self.identity = torch_thread, identity
        self.device, self.dtype, self.cache_mb = device, dtype, cache_mb
        self.engine: Engine | None = None  # these four come with `attach`
        self.cache = None
        self.budget: FimBudget | None = None
        self.scheduler = None
        self.loaded = False  # on the event loop: the engine is attached and the waiting requests were submitted
        self.load_error: str | None = None
        self.waiting: list[tuple[Connection, m.Generate | m.Fim, float]] = []  # came before the model, and when
        self.closing = threading.Event()  # set at shutdown: the torch thread's queued start-up work is skipped
        # Whether the torch thread began the scheduler's rounds; set, and read against `closing`, under the lock.
        self.rounds_lock = threading.Lock()
        self.rounds_began = False
        self.max_queue, self.grace_s = max_queue, grace_s
        self.max_per_connection, self.max_prompt_chars = max_per_connection, max_prompt_chars
        self.read_timeout = read_timeout
        self.hello_s = read_timeout or HELLO_S  # a connection that never says Hello is never a client
        self.max_connections = connection_cap()  # read as serving begins: after main raised the limit
        self.reading = 0  # bytes of large frames being read now (reading_frame)
        self.refusing = 0  # connections past max_connections being refused now (_refuse)
        # Small prompts get a worker of their own, so that a huge prompt being tokenised never delays them.
        self.prompt_pools = (ThreadPoolExecutor(1, thread_name_prefix="m31rd-prompt"),
                             ThreadPoolExecutor(2, thread_name_prefix="m31rd-prompt-large"))
        self.preparing: set[asyncio.Task] = set()
        self.enc, self.dec = m.encoder(), m.client_decoder()
        self.max_active = max_active
        self.lookahead = lookahead
        self.beams = beams
        self.threads: int | None = None  # torch's intra-op threads on the inference thread (set by the warm-up)
        self.warm_up: concurrent.futures.Future | None = None  # while it runs (serve), Status answers, requests wait
        self.scheduler_done: concurrent.futures.Future[None] | None = None
        self.in_flight: set[InFlight] = set()
        self.by_document: dict[str, InFlight] = {}
        self.typed: OrderedDict[str, Typed] = OrderedDict()
        self.requests = 0
        self.started = time.time()
        self.stopping: asyncio.Event | None = None
        self.stop_reason = ""
        self.process = psutil.Process()

    def attach(self, engine: Engine) -> None:
        """The loaded engine, with the prefix cache and scheduler built on it (on the torch thread)."""
        from m31rd.prefix_cache import PrefixCache
        from m31rd.scheduler import Scheduler

        self.cache = PrefixCache(engine, self.cache_mb)
        self.budget = FimBudget.for_context(engine.config.max_context)
        self.scheduler = Scheduler(engine, self.cache, self.max_active)
        self.engine = engine

    def welcome(self) -> m.Welcome:
        i = self.identity
        return m.Welcome(protocol=m.PROTOCOL_VERSION, model=i.model, fingerprint=i.fingerprint,
                         max_context=i.max_context, capabilities=list(m.CAPABILITIES), daemon_version=VERSION)

    def status(self, rid: int) -> m.StatusReply:
        i, rss = self.identity, round(self.process.memory_info().rss / 2**20, 1)
        common = dict(id=rid, model=i.model, fingerprint=i.fingerprint, bundle=i.path, pid=os.getpid(),
                      uptime_s=round(time.time() - self.started, 1), requests=self.requests, rss_mb=rss,
                      threads=self.threads)
        if not self.loaded:  # the model is loading: the precision is still the asked-for one ("auto")
            return m.StatusReply(**common, device=self.device, dtype=self.dtype, queue=len(self.waiting), active=0,
                                 cache_slots=0, cache_slots_used=0, cache_mb=0.0, cache_budget_mb=0.0,
                                 cache_hit_rate=0.0, quant=None, warming=True)
        c, engine = self.cache, self.engine
        return m.StatusReply(
            **common, device=str(engine.device), dtype=str(engine.dtype).removeprefix("torch."),
            queue=max(0, len(self.in_flight) - self.scheduler.active), active=self.scheduler.active,
            cache_slots=c.max_slots, cache_slots_used=len(c.slots), cache_mb=round(c.bytes_used / 2**20, 1),
            cache_budget_mb=round(c.budget_bytes / 2**20, 1), cache_hit_rate=round(c.hit_rate, 4), quant=engine.quant,
            warming=self.warm_up is not None and not self.warm_up.done())

    @contextlib.contextmanager
    def reading_frame(self, size: int) -> Iterator[None]:
        """Count a large frame's body against READING_BYTES while it arrives; ReadRefused past that. Each connection
        may send a frame of MAX_FRAME_BYTES, buffered whole as it arrives: uncounted, 30 clients each stalling 7 MiB
        into a frame held 230 MB of the daemon's memory until --read-timeout, and nothing bounded how many did."""
        if size <= SMALL_FRAME_BYTES:
            yield
            return
        if self.reading + size > READING_BYTES:
            raise ReadRefused(size, self.reading)
        self.reading += size
        try:
            yield
        finally:
            self.reading -= size

    # -- requests ---------------------------------------------------------------------------------------

    def submit(self, conn: Connection, req: m.Generate | m.Fim, received: float | None = None) -> None:
        """Admit a request, or refuse it at once. `received`: when it arrived, if before now (it waited for the
        model to load): its deadline counts from then."""
        def refuse(code: str, message: str, rid: int | None = req.id, busy: m.BusyDetail | None = None) -> None:
            conn.send(m.Error(id=rid, code=code, message=message, busy=busy))  # type: ignore[arg-type]
            log.info("request refused", extra={"fields": {"id": req.id, "code": code, "client": conn.client}})

        def busy(scope: m.BusyScope, limit: int, message: str) -> None:
            refuse("busy", f"{message}; retry shortly", busy=m.BusyDetail(scope, limit))

        def duplicate() -> None:  # answered without its id: that id's frames belong to the request in flight
            refuse("bad_request", f"request id {req.id} is already in flight on this connection; this one was "
                                  "dropped", None)

        if self.stopping is not None and self.stopping.is_set():
            return refuse("shutting_down", "the daemon is shutting down")
        if self.holds(conn, req.id):
            return duplicate()
        # Checked on arrival, the wait for the model included: a request it could never serve (a prompt over
        # --max-prompt-chars) waited for the whole load, holding its text and a place in the queue, to be refused then.
        max_context = self.engine.config.max_context if self.loaded else self.identity.max_context
        budget = self.budget if self.loaded else FimBudget.for_context(max_context) if max_context > 0 else None
        if why := wire_refusal(req, max_context, budget, self.max_prompt_chars):
            return refuse("bad_request", why)
        if not self.loaded:  # the rest is checked, and the request run, once the model has loaded (`_loaded`)
            mine = sum(1 for c, _, _ in self.waiting if c is conn)
            if mine >= self.max_per_connection:
                return busy("connection", self.max_per_connection,
                            f"{requests(mine)} wait for the model to load on this connection (limit "
                            f"{self.max_per_connection} per connection, --max-per-connection)")
            if len(self.waiting) >= self.max_queue:
                return busy("loading", self.max_queue,
                            f"{requests(len(self.waiting))} wait for the model to load (limit {self.max_queue}) "
                            "over every connection to this daemon (--max-queue)")
            self.waiting.append((conn, req, time.perf_counter()))
            return
        from m31r.sampling import SamplingParams  # (torch: only once the model has loaded)

        s = req.sampling
        try:
            sampling = SamplingParams(s.temperature, s.top_k, s.top_p, s.repetition_penalty, req.seed)
        except ValueError as e:
            return refuse("bad_request", str(e))
        if req.beams is not None and (why := beams_refusal(req.beams, sampling)):
            return refuse("bad_request", why)
        # A Fim that supersedes an older one for its document takes that one's place rather than being `busy`.
        superseded = self.by_document.get(req.document) if isinstance(req, m.Fim) and req.document else None
        mine = sum(1 for j in conn.jobs.values() if not j.cancelled and j is not superseded)
        if mine >= self.max_per_connection:  # one connection must not take the whole queue from the others
            return busy("connection", self.max_per_connection,
                        f"{requests(mine)} in flight on this connection (limit {self.max_per_connection} per "
                        "connection, --max-per-connection)")
        live = sum(1 for j in self.in_flight if not j.cancelled and j is not superseded)
        if live >= self.max_queue:
            return busy("daemon", self.max_queue, f"{requests(live)} in flight (limit {self.max_queue}) over every "
                                                  "connection to this daemon (--max-queue)")
        self.requests += 1
        req = as_trained(req)
        job = InFlight(conn, req, sampling, received=received or time.perf_counter())
        if req.deadline_ms is not None:  # counted from arrival: tokenising and queueing spend it too
            job.deadline = job.received + req.deadline_ms / 1000
        if isinstance(req, m.Fim) and req.document:
            if superseded is not None:
                superseded.cancel("superseded by a newer request for the same document")
            self.by_document[req.document] = job
            # (an answer with per-token figures is the model's: a typed-through one has none)
            if self.cache.reuse and sampling.greedy and req.logprobs is None and self._answer_typed_through(conn, job):
                return
        conn.jobs[req.id] = job
        self.in_flight.add(job)
        task = asyncio.ensure_future(self._prepare(job))
        self.preparing.add(task)
        task.add_done_callback(self.preparing.discard)

    def holds(self, conn: Connection, rid: int) -> bool:
        """Whether `conn`'s request `rid` is in flight or waits for the model: an Error with its id would end that
        request in the client (which routes by id) while the daemon went on serving it for nobody."""
        return rid in conn.jobs or any(c is conn and r.id == rid for c, r, _ in self.waiting)

    def drop_waiting(self, conn: Connection) -> None:
        """Forget the requests a closed connection left waiting for the model: nobody reads their answers, and kept,
        they counted against --max-queue until the model loaded, so that other clients were refused `busy`."""
        self.waiting = [w for w in self.waiting if w[0] is not conn]

    def cancel_waiting(self, conn: Connection, rid: int) -> bool:
        """Cancel a request that came before the model loaded; False if there is none of that id."""
        for k, (c, r, _) in enumerate(self.waiting):
            if c is conn and r.id == rid:
                del self.waiting[k]
                conn.send(m.Error(id=rid, code="cancelled", message="cancelled by the client"))
                return True
        return False

    def _loaded(self, loading: concurrent.futures.Future) -> None:
        """On the event loop, once the model has loaded (or failed to): run or refuse the requests that waited."""
        waiting, self.waiting = self.waiting, []
        if (e := loading.exception()) is not None:
            known = isinstance(e, ValueError | OSError | BundleError)
            self.load_error = str(e) if known else f"{type(e).__name__}: {e}"
            log.error("cannot load the model: %s", self.load_error)
            # `shutting_down`, not `internal` (a bug, after which the daemon keeps serving): the daemon stops now,
            # and a bundle that cannot load is not the daemon's bug (the message says what to do about it).
            for conn, req, _ in waiting:
                conn.send(m.Error(id=req.id, code="shutting_down",
                                  message=f"cannot load the model: {self.load_error}"))
            return self.request_stop("cannot load the model")
        self.loaded = True
        for conn, req, received in waiting:
            if not conn.writer.is_closing():
                self.submit(conn, req, received)

    async def _prepare(self, job: InFlight) -> None:
        """Tokenise the request's prompt on a worker thread, then queue it for the inference thread."""
        from m31r.engine import ContextOverflowError
        from m31rd.scheduler import Request

        loop = asyncio.get_running_loop()
        pool = self.prompt_pools[prompt_chars(job.wire) > SMALL_PROMPT_CHARS]
        try:
            built = await loop.run_in_executor(pool, build_unless_cancelled, self.engine, self.budget, job)
        except ContextOverflowError as e:
            return self._answer(job, overflow_error(job.rid, e), True)
        except ValueError as e:
            return self._answer(job, m.Error(id=job.rid, code="bad_request", message=str(e)), True)
        except Exception as e:
            log.exception("building a prompt failed")
            return self._answer(job, m.Error(id=job.rid, code="internal", message=f"cannot build the prompt: {e!r}"),
                                True)
        # Cancelled, superseded or its client left while it waited for a worker (`built` None: never tokenised) or
        # while it was tokenised.
        if built is None or job.cancellation.reason is not None:
            why = job.cancellation
            return self._answer(job, m.Error(id=job.rid, code=why.code, message=why.reason or ""), True)  # type: ignore[arg-type]
        ids, max_tokens, heal, job.truncated = built
        job.heal = heal
        lookahead = self.lookahead if job.wire.lookahead is None else job.wire.lookahead
        fim = isinstance(job.wire, m.Fim)
        job.beams = request_beams(job.wire, job.sampling, self.beams)
        request = Request(ids, max_tokens, job.sampling, stop=request_stops(job.wire), heal=heal, document=job.document,
                          deadline=job.deadline, lookahead=lookahead, received=job.received,
                          beams=job.beams, top_logprobs=job.wire.logprobs or 0,
                          cancellation=job.cancellation,
                          repeat_context=line_context(job.wire.prefix if fim else job.wire.prompt),
                          start_stops=request_start_stops(job.wire),
                          min_probability=job.wire.min_probability if fim else None)
        self.scheduler.submit(request, lambda event: loop.call_soon_threadsafe(self._deliver, job, event))

    def _deliver(self, job: InFlight, event: Event) -> None:
        """A scheduler event, as the frame it becomes (runs on the event loop)."""
        from m31rd.scheduler import Failed, Finished

        if isinstance(event, Finished):
            e = event
            first = None if e.first_token_ms is None else round(e.first_token_ms, 2)
            self._answer(job, m.Done(
                id=job.rid, finish_reason=e.finish_reason,  # type: ignore[arg-type]
                usage=m.Usage(prompt_tokens=e.prompt_tokens, cached_tokens=e.cached_tokens,
                              completion_tokens=e.completion_tokens, healed_tokens=e.healed_tokens,
                              decode_steps=e.decode_steps, draft_tokens=e.drafted, accepted_tokens=e.accepted),
                timings=m.Timings(queue_ms=round(e.queue_ms, 2), prefill_ms=round(e.prefill_ms, 2),
                                  first_token_ms=first, total_ms=round(e.total_ms, 2)),
                alternatives=list(e.alternatives), logprob=_round(e.logprob),
                line_logprob=_round(e.line_logprob), logprob_by_line=[round(x, 4) for x in e.logprob_by_line],
                stopped_by=e.stopped_by if e.finish_reason == "stop" else None,  # type: ignore[arg-type]
                stop_sequence=e.stop_sequence if e.finish_reason == "stop" else None, truncated=job.truncated), True)
        elif isinstance(event, Failed) and event.overflow is not None:
            self._answer(job, overflow_error(job.rid, event.overflow), True)
        elif isinstance(event, Failed):
            self._answer(job, m.Error(id=job.rid, code=event.code, message=event.message), True)  # type: ignore[arg-type]
        else:
            job.text += event.text
            if event.id is not None:  # (None: text held back, released at the end, not a token)
                job.tokens.append(event.id)
            self._answer(job, self._token(job, event), False)

    def _token(self, job: InFlight, piece: Piece) -> m.Token:
        if job.wire.logprobs is None or piece.id is None:
            return m.Token(id=job.rid, text=piece.text, token=piece.id)
        assert self.engine is not None
        tok = self.engine.tokenizer

        def text(t: int) -> str:  # a special token (the end of the completion) by its name
            b = tok.token_bytes[t]
            return b.decode("utf-8", "replace") if b is not None else tok.hf.id_to_token(t) or ""

        top = [m.TokenChoice(t, text(t), round(lp, 4)) for t, lp in piece.top]
        return m.Token(id=job.rid, text=piece.text, token=piece.id,
                       logprob=None if piece.logprob is None else round(piece.logprob, 4), top_logprobs=top)

    def _answer_typed_through(self, conn: Connection, job: InFlight) -> bool:
        req = job.wire
        assert isinstance(req, m.Fim)
        shape = answer_shape(req, job.sampling, request_beams(req, job.sampling, self.beams))
        rest = typed_through(self.typed.get(req.document), req, shape)
        stops = request_stops(req)
        answer = None if rest is None else clip(rest, req.max_tokens, stops, req.min_probability or 0.0)
        if rest is None or answer is None:
            return False
        # The whole rest is kept, not the part this request's limits allow: a later request may allow more.
        self._remember(req.document, rest)
        del self.by_document[req.document]
        text, finish_reason, stopped_by, stop_sequence = answer
        alternatives = clip_alternatives(rest, text, req.max_tokens, stops)
        ms = round((time.perf_counter() - job.received) * 1000, 3)
        if text:
            conn.send(m.Token(id=req.id, text=text))
        conn.send(m.Done(id=req.id, finish_reason=finish_reason, usage=m.Usage(),  # type: ignore[arg-type]
                         timings=m.Timings(first_token_ms=ms if text else None, total_ms=ms), source="typed_through",
                         alternatives=alternatives, logprob=rest.logprob,
                         line_logprob=rest.by_line[0] if rest.by_line else rest.logprob,
                         logprob_by_line=list(rest.by_line), stopped_by=stopped_by,  # type: ignore[arg-type]
                         stop_sequence=stop_sequence))
        log.info("request", extra={"fields": {"id": req.id, "kind": "fim", "client": conn.client,
                                              "source": "typed_through", "total_ms": ms}})
        return True

    def _remember(self, document: str, typed: Typed) -> None:
        """Keep `typed` as the document's last suggestion; forget the least recently used documents' past
        TYPED_DOCUMENTS, or past TYPED_CHARS of name, prefix and suffix in all (the newest is always kept). Each holds
        its request's whole prefix and suffix: counted by documents alone, a client going through documents of 2 Mi
        characters grew the daemon by up to 8 MB a document, 2 GB at 256."""
        self.typed[document] = typed
        self.typed.move_to_end(document)
        chars = sum(len(d) + len(t.prefix) + len(t.suffix) for d, t in self.typed.items())
        while len(self.typed) > TYPED_DOCUMENTS or (len(self.typed) > 1 and chars > TYPED_CHARS):
            d, t = self.typed.popitem(last=False)
            chars -= len(d) + len(t.prefix) + len(t.suffix)

    def _answer(self, job: InFlight, msg: msgspec.Struct, final: bool) -> None:
        """Send a request's frame; after its last one, forget the request and log it (runs on the event loop)."""
        if job not in self.in_flight:  # already answered (_end_unserved): its last frame was sent
            return
        conn = job.conn
        conn.send(msg)
        if not final:
            return
        conn.jobs.pop(job.rid, None)
        self.in_flight.discard(job)
        req = job.wire
        if isinstance(req, m.Fim) and req.document and self.by_document.get(req.document) is job:
            del self.by_document[req.document]
        fields: dict = {"id": job.rid, "kind": type(req).__name__.lower(), "client": conn.client}
        if isinstance(msg, m.Done):
            if isinstance(req, m.Fim) and req.document and job.sampling.greedy:
                assert self.engine is not None  # (a Done comes from the model)
                cut = msg.finish_reason == "deadline" or msg.stopped_by in ("sequence", "repeat")
                ends = token_ends(self.engine.tokenizer, job.tokens, job.heal, job.text, msg.usage.healed_tokens, cut)
                if ends is None:  # not answered typed through, nor from the document's suggestion before it
                    self.typed.pop(req.document, None)
                else:
                    self._remember(req.document, Typed(
                        req.prefix, req.suffix, job.text, msg.finish_reason, ends, msg.logprob,
                        tuple(msg.logprob_by_line), msg.stopped_by, msg.stop_sequence, tuple(request_stops(req)),
                        answer_shape(req, job.sampling, job.beams), req.max_tokens, req.min_probability or 0.0,
                        tuple(msg.alternatives)))
            fields.update(msgspec.to_builtins(msg.usage), **msgspec.to_builtins(msg.timings),
                          finish_reason=msg.finish_reason, beams=job.beams)
        elif isinstance(msg, m.Error):
            fields.update(code=msg.code)
        handle = job.cancellation
        if handle.at is not None:  # how fast a cancel took effect
            fields.update(model_calls=handle.calls, calls_after_cancel=handle.calls_after,
                          cancel_ms=round((time.perf_counter() - handle.at) * 1000, 2))
        fields["rss_mb"] = round(self.process.memory_info().rss / 2**20, 1)
        log.info("request", extra={"fields": fields})

    # -- lifecycle --------------------------------------------------------------------------------------

    def _end_unserved(self) -> None:
        """A stop before the scheduler's rounds began (the model loading or warming up): nothing will ever run the
        requests that wait for the model or sit in the scheduler's queue, so each is answered `shutting_down` now.
        Before, their connections were closed with no answer (a client saw "connection lost"), during warm-up only
        after the grace period and 2 s more."""
        why = "the daemon is shutting down; it stopped before its model was ready"
        waiting, self.waiting = self.waiting, []
        for conn, req, _ in waiting:
            conn.send(m.Error(id=req.id, code="shutting_down", message=why))
        for job in list(self.in_flight):
            job.cancel(why, "shutting_down")  # one still being tokenised then stops there
            self._answer(job, m.Error(id=job.rid, code="shutting_down", message=why), True)

    def _serve_scheduler(self) -> None:
        """The scheduler's rounds, on the torch thread, queued behind the model's load and warm-up, and begun once
        the event loop has announced readiness (`on_ready`: READY=1, the "ready" log), so that no request is answered
        before the daemon says it is ready."""
        while not self.announced.wait(0.05):
            if self.closing.is_set():
                return
        with self.rounds_lock:  # a stop either comes first (no rounds: `serve` answers the requests) or finds them
            if self.scheduler is None or self.closing.is_set():
                return
            self.rounds_began = True
        self.scheduler.serve()

    async def _watch_socket(self, path: Path, ours: tuple[int, int]) -> None:
        """Stop once the socket file this daemon made is gone or another file took its place (a temp-folder cleaner, a
        removed runtime folder and a daemon started there since): no client can reach this daemon again, `m31r stop`
        included, and it held the socket's lock, so that a daemon started for the next request refused to start
        ("another m31rd is already serving") and the model's memory stayed taken until someone killed the process.
        Stopping lets the next request's autostart bring up a daemon that can be reached."""
        while True:
            await asyncio.sleep(SOCKET_CHECK_S)
            try:
                if (now := file_identity(path)) != ours:
                    break
            except OSError:  # cannot tell: keep serving
                continue
        what = "was removed" if now is None else "was replaced by another file"
        log.warning("the socket file %s %s: no client can reach this daemon any more; stopping", path, what)
        self.request_stop(f"the socket file {what}")

    async def _refuse(self, conn: Connection, open_now: int) -> None:
        """Refuse a connection past max_connections: each holds a descriptor and buffers, so there is a limit, and
        a client past it is told `busy` rather than left waiting. Past REFUSING refusals at once (a flood), the
        connection is closed without a word: the spare descriptors are for the daemon's own files."""
        if self.refusing >= REFUSING:
            conn.writer.transport.abort()
            return
        log.warning("refused a connection: %d connections open, the limit", open_now)
        self.refusing += 1
        try:
            await conn.refuse(m.Error(id=None, code="busy", message=(
                f"{open_now} connections are open to this daemon, the most it serves at once (at most "
                f"{MAX_CONNECTIONS}, fewer where its limit on open files is low); close unused clients or retry "
                "shortly")))
        finally:
            self.refusing -= 1

    def request_stop(self, reason: str) -> None:
        if self.stopping is not None and not self.stopping.is_set():
            self.stop_reason = reason
            self.stopping.set()

    async def serve(self, sock: socket.socket, owned_path: Path | None, loading: concurrent.futures.Future,
                    warming: concurrent.futures.Future | None = None, on_ready=None, on_serving=None) -> None:
        """Serve until a stop is requested. `loading` (the engine being built and attached) and `warming` (its
        warm-up) run on the torch thread, in that order: until both end, Status says `warming`, and requests wait
        (for the model here, then in the scheduler's queue, which the torch thread takes up after warm-up); then
        `on_ready` runs. A model that fails to load stops the daemon (`load_error`)."""
        self.stopping = asyncio.Event()
        self.warm_up = warming
        self.announced = threading.Event()  # set once `ready` below has ended, whichever way
        self.scheduler_done = self.torch_thread.submit(self._serve_scheduler)
        conns: set[asyncio.Task] = set()

        async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            conn = Connection(self, reader, writer)
            try:
                if len(conns) >= self.max_connections:
                    return await self._refuse(conn, len(conns))
                conns.add(task)
                await conn.serve()
            except asyncio.CancelledError:
                # Only shutdown cancels these tasks. Ending normally keeps asyncio's stream callback from
                # printing a (non-JSON) traceback for a cancelled connection task on stderr.
                pass
            finally:
                conns.discard(task)

        server = await asyncio.start_unix_server(on_connect, sock=sock, limit=2**16)
        if on_serving:
            on_serving()

        async def ready() -> None:
            try:
                with contextlib.suppress(Exception):  # `_loaded` reads the failure from the future
                    await asyncio.wrap_future(loading)
                self._loaded(loading)
                if not self.loaded:
                    return
                if warming is not None:
                    await asyncio.wrap_future(warming)
                if on_ready and not self.stopping.is_set():
                    on_ready()
            finally:
                self.announced.set()

        readying = asyncio.ensure_future(ready())
        ours = None
        with contextlib.suppress(OSError):
            ours = file_identity(owned_path) if owned_path is not None else None
        watching = asyncio.ensure_future(self._watch_socket(owned_path, ours)) if ours is not None else None
        await self.stopping.wait()
        if watching is not None:
            watching.cancel()
        with self.rounds_lock:
            self.closing.set()
            rounds = self.rounds_began  # if not, none will run: the scheduler serves nothing of what it was given
        readying.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await readying
        log.info("stopping", extra={"fields": {"reason": self.stop_reason,
                                               "in_flight": len(self.in_flight) + len(self.waiting)}})
        server.close()  # stop accepting; connections already open keep being served
        if not rounds:
            self._end_unserved()
        deadline = time.monotonic() + self.grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for job in list(self.in_flight):
            job.cancel("the daemon is shutting down", "shutting_down")
        t_cancel = time.monotonic()
        while self.in_flight and time.monotonic() - t_cancel < 2.0:
            await asyncio.sleep(0.01)
        if self.scheduler is not None:
            self.scheduler.stop()
        if self.scheduler_done is not None and self.scheduler_done.running():
            await asyncio.to_thread(concurrent.futures.wait, [self.scheduler_done], 5.0)
        for task in [*conns, *self.preparing]:
            task.cancel()
        await asyncio.gather(*conns, *self.preparing, return_exceptions=True)
        for pool in self.prompt_pools:
            pool.shutdown(wait=False, cancel_futures=True)
        if owned_path is not None and ours is not None:
            with contextlib.suppress(OSError):
                if file_identity(owned_path) == ours:  # (another's socket there now is left alone)
                    owned_path.unlink()

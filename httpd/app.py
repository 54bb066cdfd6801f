"""The Starlette application: endpoints, streaming, cancellation, error mapping.

Request path: HTTP body → msgspec Struct (400 naming the field when it does not fit) → one of the daemon slots
(Admission: the daemon takes only so many requests from one connection, so more wait their turn here) → a daemon
request on the shared connection → tokens → JSON or Server-Sent Events. The HTTP status waits for the daemon's
first event, so an error the daemon reports (busy, context overflow) is a proper status, streaming or not.

While a request waits on the daemon, a watcher listens for `http.disconnect`: a client that leaves (or a
request that runs past the timeout, or whose work fails) cancels its daemon request, streaming or not. A cancelled
request is drained in the background so its answer never lingers on the connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from m31r_http import schemas as s
from m31r_http.fim_templates import split_fim
from m31r_http.metrics import Metrics, MetricsMiddleware
from m31r_http.security import EXPOSED_HEADERS, GuardMiddleware, HostPolicy, error_body, error_body_for, served_path
from m31r_protocol import Client, DaemonError, DaemonUnavailable, Sampling, Stream, policy
from m31r_protocol.messages import Done, Snippet, Token, Usage, scored_tokens
from m31r_protocol.reconnect import DaemonLink, Unavailable, link_config
from m31r_protocol.version import VERSION

log = logging.getLogger("m31r_http")

ENDPOINTS = ("/", "/generate", "/completion", "/fim", "/v1/completions", "/v1/models", "/health", "/metrics",
             "/openapi.json", "/api/generate", "/api/show", "/api/tags", "/api/version", "/infill", "/v1/health",
             "/v1beta/server_setting", "/v1/events", "/v1/fim/completions")
ALIASES = ("m31r",)  # names a request may use for the daemon's model, besides the model's own name
OPENAI_DEFAULT_MAX_TOKENS = 16  # OpenAI's own default for /v1/completions
DRAIN_TIMEOUT = 30.0  # how long a cancelled request's answer is awaited before it is forgotten
# Every HTTP request shares one daemon connection, and the daemon takes at most --max-per-connection (16 by
# default) requests from one connection: this server has at most that many in the daemon at once, and lets more
# wait their turn, up to WAITING_LINE of them (each within the request timeout); past that, 503 busy.
DAEMON_SLOTS = 16
WAITING_LINE = 64


@dataclass(frozen=True)
class ServeSettings:
    socket: str | Path | None = None  # None: the default daemon socket
    autostart: bool = True  # start a daemon when none answers
    bundle: str | Path | None = None  # the bundle an autostarted daemon loads (None: the daemon's default)
    allowed_hosts: tuple[str, ...] = ()
    cors_origins: tuple[str, ...] = ()
    token: str | None = None
    max_body: int = 1 << 20
    max_tokens_cap: int = 512
    request_timeout: float = 60.0
    body_timeout: float | None = 30.0  # a request's body must arrive within this of its headers (None: no limit)

    def __post_init__(self) -> None:
        # An origin as browsers send it, without a trailing slash (`--cors-origin http://localhost:5173/`): the one
        # form every layer compares (the guard, the CORS middleware, the connection's refusals).
        object.__setattr__(self, "cors_origins", tuple(o.rstrip("/") for o in self.cors_origins))


# -- errors ---------------------------------------------------------------------------------------------------


def error_response(status: int, code: str, message: str, *, param: str | None = None,
                   retry_after: int | None = None, headers: dict[str, str] | None = None) -> Response:
    body = error_body(status, code, message, param)
    h = dict(headers or {})
    if retry_after is not None:
        h["Retry-After"] = str(retry_after)
    return Response(body, status, headers=h, media_type="application/json")


def daemon_error_status(e: DaemonError) -> tuple[int, int | None]:
    """HTTP status (and Retry-After) for an Error the daemon answered with."""
    if e.code == "busy":
        return 503, 1
    if e.code == "shutting_down" or (e.code == "cancelled" and "shutting down" in e.message):
        return 503, 2
    return {"context_overflow": 400, "bad_request": 400, "cancelled": 409, "frame_too_large": 413,
            "internal": 502}.get(e.code, 503), None


def daemon_busy(e: DaemonError) -> str:
    """The daemon's `busy` in words an HTTP client can act on: it cannot see the connection the daemon speaks of. From
    the Error's detail, not its wording; an older daemon's, which has none, is passed on as it is."""
    if e.busy is None:
        return e.message
    if e.busy.scope == "connection":  # a daemon started with a --max-per-connection under DAEMON_SLOTS
        return (f"the daemon takes fewer requests at once from this server than the {DAEMON_SLOTS} it sends (the "
                f"daemon's --max-per-connection is {e.busy.limit}); retry shortly")
    waiting = "wait for the model to load" if e.busy.scope == "loading" else "in flight"
    return (f"the daemon is busy: its queue is full ({e.busy.limit} requests {waiting}, its --max-queue), with this "
            "server's requests and other clients' (editors, other servers); retry shortly")


@dataclass(frozen=True)
class Fields:
    """An endpoint's names for what a context overflow is about (None: the endpoint has no such field)."""

    prompt: str = "prompt"
    max_tokens: str = "max_tokens"
    truncate: str | None = "truncate"
    max_tokens_default: str | None = None  # how max_tokens was chosen when not as sent (None: it was sent)


def overflow_error(e: DaemonError, fields: Fields) -> tuple[str, str | None]:
    """A context_overflow in this endpoint's names, with the ways out it has (the daemon's message names some it
    lacks), and the field to blame: the prompt when it fills the context alone, else max_tokens. From the Error's
    detail, not its wording; an older daemon's, which has none, is passed on as it is."""
    if e.overflow is None:
        return e.message, None
    n, k, ctx = e.overflow.prompt_tokens, e.overflow.max_tokens, e.overflow.max_context
    given = f"{k}, {fields.max_tokens_default}" if fields.max_tokens_default else f"{k}"
    what = f"prompt ({n} tokens) + {fields.max_tokens} ({given}) = {n + k} exceeds the model's context of {ctx} tokens"
    cut = f", or send {fields.truncate}: true to keep the prompt's end" if fields.truncate and k < ctx else ""
    if n >= ctx:
        return f"{what}: the prompt alone fills it; shorten the prompt{cut}", fields.prompt
    return f"{what}: lower {fields.max_tokens} to at most {ctx - n}, or shorten the prompt{cut}", fields.max_tokens


HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def snippets(context: list[s.ContextSnippet]) -> list[Snippet]:
    return [Snippet(c.text, c.path) for c in context]


def model_names(model: str) -> list[str]:
    """The names a request may use for `model` ("name@version", the daemon's id): that id first, then the name
    without its version, then the aliases."""
    return list(dict.fromkeys((model, model.split("@", 1)[0], *ALIASES)))


def error_at(path: str, status: int, code: str, message: str, param: str | None = None,
             retry_after: int | None = None, headers: dict[str, str] | None = None,
             body: bytes | None = None) -> Response:
    """An error in the shape the clients of `path` read (security.error_body_for), or as `body` has it."""
    h = dict(headers or {})
    if retry_after is not None:
        h["Retry-After"] = str(retry_after)
    return Response(body if body is not None else error_body_for(path, status, code, message, param), status,
                    headers=h, media_type="application/json")


def _error_for(request: Request, status: int, code: str, message: str, param: str | None = None,
               headers: dict[str, str] | None = None) -> Response:
    return error_at(request.url.path, status, code, message, param, headers=headers)


# Endpoints clients of other servers look for, and what this one offers instead (a 404's message says it).
NOT_SERVED = {
    "/v1/chat/completions": "chat is not served: this code model has no chat template; use POST /v1/completions "
                            "(`suffix` for fill-in-the-middle)",
    "/api/chat": "chat is not served: this code model has no chat template; use POST /api/generate (`suffix` for "
                 "fill-in-the-middle)",
}


MAX_SHOWN_PATH = 200  # characters of a path an error message repeats


def shown_path(path: str) -> str:
    """`path` as an error message repeats it: a URL of many kilobytes (a client's bug, or a probe) is not sent back
    whole."""
    return path if len(path) <= MAX_SHOWN_PATH else f"{path[:MAX_SHOWN_PATH]}… ({len(path):,} characters)"


SENT_PATH = "m31r.sent_path"  # scope key: the path as the request sent it, where TrailingSlash served it without "/"
# Where a completion is asked for: the hint of a 405 at `/` (a plugin given the server's address without its path).
COMPLETION_ENDPOINTS = "/v1/completions, /api/generate, /infill or /v1/fim/completions"


def not_found(method: str, path: str, sent: str) -> str:
    """Why `path` (`sent` as the request wrote it) is a 404: named as sent (`GET /foo/` is not told that `/foo` is no
    endpoint, nor `/health//` that `/health/` is none, which is served), with a doubled slash pointed out (a client's
    base URL ending with a slash, joined to a path that starts with one)."""
    if path in NOT_SERVED:
        return f"{sent}: {NOT_SERVED[path]}"
    inner = sent.rstrip("/")  # (a doubled slash at the end is no base URL's)
    doubled = "; it has a doubled slash: does the client's base URL end with a slash?" if "//" in inner else ""
    return f"{method} {shown_path(sent)} is not an endpoint of this server (GET /openapi.json lists them){doubled}"


async def http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = HTTP_CODES.get(exc.status_code, f"http_{exc.status_code}")
    message = str(exc.detail)
    path = request.url.path
    sent = request.scope.get(SENT_PATH, path)
    if exc.status_code == 404 and message == "Not Found":  # Starlette's: no route (an endpoint's own 404 has words)
        message = not_found(request.method, path, sent)
    elif exc.status_code == 413 and message == "Content Too Large":  # Starlette's, for a body sent without a length
        limit = request.app.state.service.settings.max_body
        message = f"the request body exceeds this server's limit of {limit} bytes (m31r serve --max-body)"
    elif exc.status_code == 405 and message == "Method Not Allowed" and (allow := (exc.headers or {}).get("Allow")):
        # Starlette's said only that: a plugin told to POST to the server's bare address learnt nothing from it.
        *others, last = sorted(allow.split(", "))  # (Starlette's are a set's, in no fixed order)
        allowed = f"{', '.join(others)} and {last}" if others else last
        message = f"{request.method} {shown_path(sent)}: this endpoint answers {allowed} only"
        if path == "/" and request.method == "POST":
            message += f" (Ollama's check that a server runs); to complete code, POST to {COMPLETION_ENDPOINTS}"
    return _error_for(request, exc.status_code, code, message, headers=dict(exc.headers or {}))


async def invalid_request(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, s.InvalidRequest)
    return _error_for(request, exc.status, exc.code, exc.message, exc.param)


async def internal_error(request: Request, exc: Exception) -> Response:
    """A bug: still JSON in the API's error shape, never a bare text 500 (Starlette logs the traceback)."""
    return _error_for(request, 500, "internal", f"the server hit an internal error: {type(exc).__name__}")


# -- one daemon request behind one HTTP request ---------------------------------------------------------------


# What an option's name may hold as it is in the X-M31R-Ignored-Options header: visible ASCII but the list's comma and
# the escape's percent sign. Anything else (a line break would end the header and lose the whole response) is
# percent-encoded, UTF-8 bytes.
HEADER_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in ",%")


IGNORED_HEADER_MAX = 4096  # bytes: HTTP clients refuse a response whose header block passes 16 KiB (Node, h11)


def ignored_header(ignored: list[str]) -> tuple[tuple[bytes, bytes], ...]:
    """The X-M31R-Ignored-Options header naming the request fields a foreign API's endpoint did not act on (none
    when it acted on all): those servers ignore what they do not know, so a client is told here instead.

    At most IGNORED_HEADER_MAX bytes of it: a body may name thousands of unknown options, or one of a megabyte, and a
    header that long makes the client drop the whole answer. Past the limit the list ends with `(N more)`, which no
    name can be mistaken for: a name's spaces are percent-encoded."""
    if not ignored:
        return ()
    names: list[str] = []
    size = 0
    for i, name in enumerate(ignored):
        quoted = urllib.parse.quote(name, safe=HEADER_SAFE)
        if size + len(quoted) > IGNORED_HEADER_MAX - 32:  # (room for the tail)
            names.append(f"({len(ignored) - i} more)")
            break
        names.append(quoted)
        size += len(quoted) + 2
    return ((b"x-m31r-ignored-options", ", ".join(names).encode()),)


class Renderer:
    """How one endpoint turns the daemon's answer into bytes. `live`: forward text chunks as they come."""

    live = True
    every_token = False  # stream a chunk for every token, those without text too (their figures are asked for)
    media_type = b"text/event-stream; charset=utf-8"  # of a streamed answer
    headers: tuple[tuple[bytes, bytes], ...] = ()  # extra response headers

    def connected(self, client: Client) -> None:
        """The daemon connection the answer comes from is known (its Welcome names the model)."""

    def prelude(self) -> bytes:
        """Sent right after the stream's headers."""
        return b""

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        """One piece of streamed text, with the daemon's frame it came in (per-token figures, when asked for)."""
        raise NotImplementedError

    def final(self, g: Generation) -> bytes:
        """The stream's closing events."""
        raise NotImplementedError

    def body(self, g: Generation) -> bytes:
        """The whole answer as JSON (no streaming)."""
        raise NotImplementedError

    def error_event(self, status: int, code: str, message: str) -> bytes:
        return b"event: error\ndata: " + error_body(status, code, message) + b"\n\n"

    def error_json(self, path: str, status: int, code: str, message: str, param: str | None = None) -> bytes:
        """An error answered before streaming began: in the shape of the path's clients, unless the request's shape
        says otherwise (llama.cpp's /completion request on this server's /completion path)."""
        return error_body_for(path, status, code, message, param)


def _sse(event: str, data: msgspec.Struct) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + msgspec.json.encode(data) + b"\n\n"


def _tops(frame: Token) -> list[s.TopToken]:
    return [s.TopToken(c.token, c.text, c.logprob) for c in frame.top_logprobs]


def token_figures(frames: list[Token]) -> list[s.TokenLogprob]:
    """Each token's figures, from the daemon's Token frames (of a request with `logprobs`): what the native, OpenAI
    and Ollama answers list."""
    return [s.TokenLogprob(f.text, f.token, f.logprob, _tops(f)) for f in scored_tokens(frames)]


def _result(g: Generation, logprobs: bool = False) -> s.GenerateResponse:
    d = g.done
    assert d is not None
    return s.GenerateResponse(tokens=token_figures(g.frames) if logprobs else None,
        text=g.text, finish_reason=d.finish_reason,
        usage=d.usage, timings=d.timings, alternatives=d.alternatives, logprob=d.logprob, line_logprob=d.line_logprob,
        logprob_by_line=d.logprob_by_line, stopped_by=d.stopped_by, stop_sequence=d.stop_sequence,
        truncated=d.truncated)


class NativeRenderer(Renderer):
    def __init__(self, logprobs: bool = False):
        self.every_token = self.logprobs = logprobs

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        if self.logprobs and frame is not None and frame.logprob is not None:
            return _sse("chunk", s.StreamChunk(text, frame.logprob, _tops(frame)))
        return _sse("chunk", s.StreamChunk(text))

    def final(self, g: Generation) -> bytes:
        return _sse("done", _result(g, self.logprobs))

    def body(self, g: Generation) -> bytes:
        return msgspec.json.encode(_result(g, self.logprobs))


def _line_count(text: str) -> int:
    """Lines of a completion: a break at its end ends its last line, it opens none."""
    return text.count("\n") + 1 - text.endswith("\n")


class CompletionRenderer(Renderer):
    """The editor policy's post-processing needs the whole completion: one chunk at the end."""

    live = False

    def __init__(self, plan: policy.Plan, cursor: int, min_probability: float):
        self.plan, self.cursor, self.min_probability = plan, cursor, min_probability

    def response(self, g: Generation) -> s.CompletionResponse:
        r = _result(g)
        unsure = not policy.confident(policy.first_line_logprob(g.text, r.line_logprob, r.logprob_by_line),
                                      self.min_probability)
        sure = policy.confident_lines(g.text, r.logprob_by_line, self.min_probability,
                                      whole_lines=self.plan.cursor.at_line_head)
        shown, ended = policy.to_postprocess(g.text, sure, r.stop_sequence, r.finish_reason)
        sug = None if unsure else policy.postprocess(self.plan, shown, ended)
        text, start, end = (sug.text, sug.start, sug.end) if sug is not None else ("", self.cursor, self.cursor)
        others = [] if unsure else policy.alternatives(self.plan, sug, r.alternatives,
                                                       policy.ended_by_line_break(r.stop_sequence))
        return s.CompletionResponse(text=text, finish_reason=r.finish_reason, usage=r.usage, timings=r.timings,
                                    start=start, end=end, multiline=self.plan.multiline,
                                    alternatives=[s.Alternative(o.text, o.start, o.end) for o in others],
                                    line_logprob=r.line_logprob, unsure=unsure,
                                    lines_cut=0 if unsure else _line_count(g.text) - _line_count(sure))

    def final(self, g: Generation) -> bytes:
        r = self.response(g)
        return (_sse("chunk", s.StreamChunk(r.text)) if r.text else b"") + _sse("done", r)

    def body(self, g: Generation) -> bytes:
        return msgspec.json.encode(self.response(g))


def top_by_key(tops: list[s.TopToken]) -> dict[str, float]:
    """A step's alternatives keyed as OpenAI keys them, by text, one entry each: tokens that are part of a character
    all read U+FFFD (and two tokens may read alike), so such a one is keyed `token:<id>` instead."""
    out: dict[str, float] = {}
    for c in tops:
        key = c.text if "\ufffd" not in c.text and c.text not in out else f"token:{c.token}"
        while key in out:  # (a token whose text is `token:<id>` itself)
            key += "#"
        out[key] = c.logprob
    return out


def openai_logprobs(frames: list[Token], offset: int) -> s.OpenAILogprobs:
    """token_figures in OpenAI's legacy form, the text offsets counted from `offset`."""
    out = s.OpenAILogprobs([], [], [], [])
    for t in token_figures(frames):
        out.tokens.append(t.text)
        out.token_logprobs.append(t.logprob)
        out.top_logprobs.append(top_by_key(t.top_logprobs))
        out.text_offset.append(offset)
        offset += len(t.text)
    return out


def prompt_read(u: Usage) -> int:
    """The prompt's tokens as every adapter's usage counts them: those prefilled and those that wrote its healed end
    again (a prompt or cursor inside a word), which finish the prompt. The completion's count, what max_tokens
    bounds, is the rest; together they are the context the answer took."""
    return u.prompt_tokens + u.healed_tokens


def usage_of(g: Generation) -> s.OpenAIUsage:
    """A finished generation's token counts, as OpenAI's API (and Mistral's, which copies it) reports them."""
    assert g.done is not None
    u = g.done.usage
    prompt = prompt_read(u)
    return s.OpenAIUsage(prompt, u.completion_tokens, prompt + u.completion_tokens)


def finish_reason(g: Generation) -> s.OpenAIFinishReason:
    assert g.done is not None
    return "length" if g.done.finish_reason == "length" else "stop"


class OpenAIRenderer(Renderer):
    def __init__(self, include_usage: bool = False, echo: str = "", logprobs: int | None = None):
        self.id = "cmpl-" + secrets.token_hex(12)
        self.created = int(time.time())
        self.include_usage, self.echo = include_usage, echo
        self.logprobs = logprobs  # the likeliest tokens to list at each step; None: no figures
        self.every_token = logprobs is not None
        self.offset = len(echo)  # where the next streamed token starts in the choice's text
        self.model = ""

    def connected(self, client: Client) -> None:
        self.model = client.welcome.model

    def prelude(self) -> bytes:
        return b"data: " + self._completion([s.OpenAIChoice(self.echo)]) + b"\n\n" if self.echo else b""

    def _completion(self, choices: list[s.OpenAIChoice], usage: s.OpenAIUsage | None = None) -> bytes:
        return msgspec.json.encode(s.OpenAICompletion(id=self.id, created=self.created, model=self.model,
                                                      choices=choices, usage=usage))

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        lp = None
        if self.logprobs is not None and frame is not None:
            lp = openai_logprobs([frame], self.offset)
            self.offset += len(text)
        return b"data: " + self._completion([s.OpenAIChoice(text, logprobs=lp)]) + b"\n\n"

    def final(self, g: Generation) -> bytes:
        out = b"data: " + self._completion([s.OpenAIChoice("", finish_reason=finish_reason(g))]) + b"\n\n"
        if self.include_usage:
            out += b"data: " + self._completion([], usage_of(g)) + b"\n\n"
        return out + b"data: [DONE]\n\n"

    def body(self, g: Generation) -> bytes:
        lp = None if self.logprobs is None else openai_logprobs(g.frames, len(self.echo))
        return self._completion([s.OpenAIChoice(self.echo + g.text, finish_reason=finish_reason(g), logprobs=lp)],
                                usage_of(g))

    def error_event(self, status: int, code: str, message: str) -> bytes:
        return b"data: " + error_body(status, code, message) + b"\n\n"


class Failed(Exception):
    """The request ends with this HTTP error (or, once streaming, an error event)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None,
                 param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after
        self.param = param


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Admission:
    """The daemon slots this server's requests share (DAEMON_SLOTS), and the bounded line of those waiting for one:
    the daemon would refuse a request past its per-connection limit, which no HTTP client can see."""

    def __init__(self, slots: int = DAEMON_SLOTS, line: int = WAITING_LINE):
        self.slots, self.line = slots, line
        self.free = asyncio.Semaphore(slots)
        self.taken = self.waiting = 0

    async def acquire(self) -> None:
        """A slot, once one is free (the caller's timeout bounds the wait); Failed (503 busy) when the line is full."""
        if self.free.locked() and self.waiting >= self.line:
            raise Failed(503, "busy", f"this server has its {self.slots} requests in the daemon (the most the daemon "
                                      f"takes from it at once) and {self.waiting} more waiting their turn, the most it "
                                      "holds; retry shortly", 1)
        self.waiting += 1
        try:
            await self.free.acquire()
        finally:
            self.waiting -= 1
        self.taken += 1

    def release(self) -> None:
        self.taken -= 1
        self.free.release()


class Generation:
    """One HTTP request's daemon request, as the ASGI response that runs it: wait for a daemon slot, connect,
    submit, wait for the first event, answer — all under a disconnect watcher and the request timeout."""

    def __init__(self, svc: Service, endpoint: str, start: Callable[[Client], Awaitable[Stream]],
                 renderer: Renderer, stream: bool, fields: Fields = Fields()):
        self.svc, self.endpoint, self.start, self.renderer, self.stream = svc, endpoint, start, renderer, stream
        self.fields = fields  # the request's names, for a context overflow's message
        self.t0 = time.perf_counter()
        self.loaded = self.t0  # when the daemon connection was ready
        self.deadline = self.t0 + svc.settings.request_timeout
        self.client: Client | None = None
        self.daemon: Stream | None = None
        self.frames: list[Token] = []  # the daemon's Token frames so far: their texts make up the answer
        self.done: Done | None = None
        self.ended = False  # the daemon request is over (done or error)
        self.responded = False  # response headers sent (or being sent)
        self.started = False  # streaming's headers sent: errors are events from here on
        self.slot = False  # holds one of the daemon slots (Admission)
        self.submitting: asyncio.Future[Stream] | None = None  # the daemon request being sent

    @property
    def text(self) -> str:
        return "".join(f.text for f in self.frames)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._work(send))
        gone = asyncio.ensure_future(_disconnected(receive))
        reason: str | None = None
        error: BaseException | None = None
        try:
            finished, _ = await asyncio.wait({work, gone}, timeout=max(0.0, self.deadline - time.perf_counter()),
                                             return_when=asyncio.FIRST_COMPLETED)
            if work in finished:
                if (error := work.exception()) is None:
                    return
                reason = "error"  # a bug, or a response the server could not send: the daemon request must end too
            else:
                reason = "disconnect" if gone in finished else "timeout"
        except asyncio.CancelledError:
            reason = "shutdown"
            raise
        finally:
            gone.cancel()
            if reason is not None:
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await work
                self._abandon(reason)
            elif self.slot:
                self._release()
        if reason == "timeout":
            message = f"the request ran past the server's {self.svc.settings.request_timeout:g}s timeout"
            await self._fail(send, Failed(504, "timeout", message))
        elif error is not None:
            log.error("request failed", exc_info=error, extra={"fields": {"path": self.endpoint}})
            if self.responded and not self.started:
                raise error  # a whole answer half sent: only closing the connection tells the client
            try:
                await self._fail(send, Failed(500, "internal",
                                              f"the server hit an internal error: {type(error).__name__}"))
            except Exception:
                raise error from None

    # -- the work ---------------------------------------------------------------------------------------------

    async def _respond(self, send: Send, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.responded = True
        await send({"type": "http.response.start", "status": status, "headers": headers})

    async def _work(self, send: Send) -> None:
        try:
            first = await self._begin()
        except Failed as f:
            return await self._fail(send, f)
        if self.client is not None:
            self.renderer.connected(self.client)
        if not self.stream:
            try:
                piece = first
                while piece is not None:
                    piece = await self._next()
            except Failed as f:
                return await self._fail(send, f)
            body = self.renderer.body(self)
            await self._respond(send, 200, [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                *self.renderer.headers])
            await send({"type": "http.response.body", "body": body})
            return
        self.started = True  # from here on, errors are events
        await self._respond(send, 200, [
            (b"content-type", self.renderer.media_type), (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"), *self.renderer.headers])
        live, every = self.renderer.live, self.renderer.every_token
        if prelude := self.renderer.prelude():
            await send({"type": "http.response.body", "body": prelude, "more_body": True})
        # With every token's figures, each token's chunk waits for the next frame: text held back and released at
        # the end (a stop sequence's start that did not complete) has no token of its own and joins the one before,
        # as in the whole answer (scored_tokens), so the chunks' tokens are the answer's.
        held: Token | None = None
        try:
            piece = first
            while piece is not None:
                frame = self.frames[-1]
                if live and every:
                    if held is not None and (frame.token is None or frame.logprob is None):
                        held = msgspec.structs.replace(held, text=held.text + frame.text)
                    else:
                        if held is not None:
                            await self._chunk(send, held)
                        held = frame
                elif live and piece:
                    await self._chunk(send, frame)
                piece = await self._next()
        except Failed as f:
            return await self._fail(send, f)
        if held is not None:
            await self._chunk(send, held)
        await send({"type": "http.response.body", "body": self.renderer.final(self), "more_body": False})

    async def _chunk(self, send: Send, frame: Token) -> None:
        await send({"type": "http.response.body", "body": self.renderer.chunk(frame.text, frame), "more_body": True})

    async def _begin(self) -> str | None:
        """Wait for a daemon slot, connect, submit, and wait for the daemon's first event: its text, or None if it
        ended at once."""
        await self.svc.admission.acquire()
        self.slot = True
        up = self.svc.upstream
        try:
            self.client = await up.get(max(0.0, self.deadline - time.perf_counter()))
        except Unavailable as e:
            raise Failed(503, "unavailable", str(e), e.retry_after) from None
        self.loaded = time.perf_counter()
        try:
            # Shielded: a timeout or disconnect while the request is being sent must not lose a request the daemon
            # may already have (its slot would be freed under it); _abandon cancels it once it is known.
            self.submitting = asyncio.ensure_future(self.start(self.client))
            self.daemon = await asyncio.shield(self.submitting)
        except DaemonUnavailable as e:
            up.lost(self.client)
            raise Failed(503, "unavailable", str(e), 1) from None
        except DaemonError as e:  # refused before it was sent (a field this daemon lacks, text that is not UTF-8)
            status, retry = daemon_error_status(e)
            raise Failed(status, e.code, e.message, retry) from None
        except UnicodeEncodeError as e:
            raise Failed(400, "invalid", f"the request's text is not valid Unicode: {e}") from None
        except s.InvalidRequest as e:  # a check that needs the daemon's answer (the model's name)
            raise Failed(e.status, e.code, e.message, param=e.param) from None
        return await self._next()

    async def _next(self) -> str | None:
        """The daemon's next text chunk, or None once it is done."""
        assert self.daemon is not None
        if self.ended:
            return None
        try:
            tok = await anext(self.daemon)
        except StopAsyncIteration:
            self._end()
            self.done = d = self.daemon.done
            assert d is not None
            m, ep = self.svc.metrics, self.endpoint
            m.prompt_tokens.labels(ep).inc(prompt_read(d.usage))
            m.cached_tokens.labels(ep).inc(d.usage.cached_tokens)
            m.completion_tokens.labels(ep).inc(d.usage.completion_tokens)
            if not self.frames:
                m.first_token.labels(ep).observe(time.perf_counter() - self.t0)
            return None
        except DaemonError as e:
            self._end()
            status, retry = daemon_error_status(e)
            message, param = e.message, None
            if e.code == "busy":
                message = daemon_busy(e)
            elif e.code == "context_overflow":
                message, param = overflow_error(e, self.fields)
            raise Failed(status, e.code, message, retry, param) from None
        except DaemonUnavailable as e:
            self._end()
            if self.client is not None:
                self.svc.upstream.lost(self.client)
            raise Failed(503, "unavailable", f"the daemon went away: {e}", 1) from None
        if not self.frames:
            self.svc.metrics.first_token.labels(self.endpoint).observe(time.perf_counter() - self.t0)
        self.frames.append(tok)
        return tok.text

    async def _fail(self, send: Send, f: Failed) -> None:
        if not self.started:
            body = self.renderer.error_json(self.endpoint, f.status, f.code, f.message, f.param)
            resp = error_at(self.endpoint, f.status, f.code, f.message, f.param, f.retry_after, body=body)
            await self._respond(send, resp.status_code, resp.raw_headers)
            await send({"type": "http.response.body", "body": resp.body})
            return
        await send({"type": "http.response.body", "body": self.renderer.error_event(f.status, f.code, f.message),
                    "more_body": False})

    def _end(self) -> None:
        """The daemon request is over: its slot is free for the next."""
        self.ended = True
        self._release()

    def _release(self) -> None:
        if self.slot:
            self.slot = False
            self.svc.admission.release()

    def _abandon(self, reason: str) -> None:
        """The client left, time ran out or the work failed: cancel the daemon request and drain its answer in the
        background. Its slot is given back once the Cancel is sent: the daemon counts only live requests against its
        limits, and reads the Cancel before any request sent after it."""
        self.svc.metrics.cancelled.labels(self.endpoint, reason).inc()
        log.info("request cancelled", extra={"fields": {"path": self.endpoint, "reason": reason}})
        if self.daemon is not None and not self.ended:
            self.svc.spawn(self._drain(self.daemon))
        elif self.daemon is None and self.submitting is not None:  # left while the request was being sent
            self.svc.spawn(self._drain_submitted(self.submitting))
        else:
            self._release()

    async def _drain(self, daemon: Stream) -> None:
        try:
            await self.svc.drain(daemon)
        finally:
            self._release()

    async def _drain_submitted(self, submitting: asyncio.Future[Stream]) -> None:
        try:
            daemon = await submitting
        except Exception:  # it never reached the daemon
            self._release()
            return
        await self._drain(daemon)


# -- the service ----------------------------------------------------------------------------------------------


class Service:
    def __init__(self, settings: ServeSettings, upstream: DaemonLink | None = None):
        self.settings = settings
        self.metrics = Metrics(ENDPOINTS)
        self.admission = Admission()
        self.upstream = upstream or DaemonLink(
            link_config(settings.socket, autostart=settings.autostart, bundle=settings.bundle), client_name="m31r-http",
            log=log, on_connect=lambda client: self.metrics.reconnects.inc())
        self.openapi = msgspec.json.encode(s.openapi(max_tokens_cap=settings.max_tokens_cap, version=VERSION,
                                                     token=settings.token is not None))
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def drain(self, stream: Stream) -> None:
        """Cancel a daemon request nobody waits for, and read its answer so it leaves the connection's table."""
        outcome = "lost"
        try:
            await stream.cancel()
            async with asyncio.timeout(DRAIN_TIMEOUT):
                async for _ in stream:
                    pass
            outcome = "finished"
        except DaemonError as e:
            outcome = "cancelled" if e.code == "cancelled" else "error"
        except (DaemonUnavailable, TimeoutError, OSError):
            outcome = "lost"
        self.metrics.cancel_outcomes.labels(outcome).inc()

    async def shutdown(self) -> None:
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=2.0)
        await self.upstream.close()

    # -- request helpers ----------------------------------------------------------------------------------

    async def read(self, request: Request, type_: type[Any], refusals: dict[str, str] | None = None) -> Any:
        return s.decode(await request.body(), type_, refusals)

    @staticmethod
    def check_model(client: Client, model: str | None) -> None:
        """InvalidRequest unless `model` (None: not given) names the daemon's model or an alias of it: a 404
        `model_not_found`, as OpenAI answers it (its client raises NotFoundError) and GET /v1/models/{model} does."""
        names = model_names(client.welcome.model)
        if model is not None and model not in names:
            raise s.InvalidRequest(f"model: {model!r} is not served here; use one of {', '.join(map(repr, names))} "
                                   "(GET /v1/models)", "model", "model_not_found", status=404)

    def check_cap(self, max_tokens: int) -> None:
        cap = self.settings.max_tokens_cap
        if max_tokens > cap:
            raise s.InvalidRequest(f"max_tokens: {max_tokens} exceeds this server's cap of {cap} "
                                   "(m31r serve --max-tokens-cap)", "max_tokens")

    @staticmethod
    def sampling(temperature: float, top_k: int = 0, top_p: float = 1.0) -> Sampling:
        # Tiny values overflow in the daemon's float32 sampling (t → inf logits, top_p → 0.0 drops every token);
        # these bounds change nothing else: under them only the most likely token survives either way.
        return Sampling(temperature=temperature if temperature >= s.GREEDY_BELOW else 0.0, top_k=top_k,
                        top_p=max(top_p, s.MIN_TOP_P))

    # -- endpoints ----------------------------------------------------------------------------------------

    async def generate(self, request: Request) -> Generation:
        r: s.GenerateRequest = await self.read(request, s.GenerateRequest)
        self.check_cap(r.max_tokens)
        sampling = self.sampling(r.temperature, r.top_k, r.top_p)
        return Generation(self, "/generate", lambda c: c.generate(
            r.prompt, max_tokens=r.max_tokens, sampling=sampling, stop=r.stop, seed=r.seed, truncate=r.truncate,
            deadline_ms=r.deadline_ms or None, beams=r.beams, logprobs=r.logprobs),
            NativeRenderer(r.logprobs is not None), r.stream)

    async def fim(self, request: Request) -> Generation:
        r: s.FimRequest = await self.read(request, s.FimRequest)
        self.check_cap(r.max_tokens)
        sampling = self.sampling(r.temperature, r.top_k, r.top_p)
        document = f"http:{r.path}" if r.path else ""
        return Generation(self, "/fim", lambda c: c.fim(
            r.prefix, r.suffix, document=document, max_tokens=r.max_tokens, sampling=sampling, stop=r.stop,
            seed=r.seed, deadline_ms=r.deadline_ms or None, beams=r.beams, context=snippets(r.context),
            logprobs=r.logprobs),
            NativeRenderer(r.logprobs is not None), r.stream, Fields("prefix", truncate=None))

    async def completion(self, request: Request) -> Generation:
        r: s.CompletionRequest = await self.read(request, s.CompletionRequest)
        self.check_cap(r.max_tokens)
        try:
            opts = policy.Options(multiline=r.multiline, max_tokens=r.max_tokens, deadline_ms=r.deadline_ms or None,
                                  max_lines=r.max_lines)
            plan = policy.plan(r.prefix + r.suffix, len(r.prefix), opts)
        except ValueError as e:
            raise s.InvalidRequest(str(e)) from None
        sampling = self.sampling(r.temperature, r.top_k, r.top_p)
        # Its own document namespace: an editor's LSP requests for the same file are not superseded by these.
        document = f"http:{r.path}" if r.path else ""
        return Generation(self, "/completion", lambda c: c.fim(
            **plan.fim_kwargs(), document=document, sampling=sampling, seed=r.seed, beams=r.beams,
            context=snippets(r.context), min_probability=r.min_probability or None),
            CompletionRenderer(plan, len(r.prefix), r.min_probability), r.stream, Fields("prefix", truncate=None))

    async def openai_completions(self, request: Request) -> Generation:
        r: s.OpenAICompletionRequest = await self.read(request, s.OpenAICompletionRequest, s.OPENAI_REFUSALS)
        # (null, as OpenAI reads it: the start of a new document, which is what an empty prompt is here)
        prompt = "" if r.prompt is None else r.prompt if isinstance(r.prompt, str) else r.prompt[0]
        # Past --max-tokens-cap, capped rather than refused: editor plugins send their own large defaults (Continue
        # 4096, others 2048) that their users never see, and a refusal leaves them with no completion at all.
        # llama.cpp's server caps n_predict at its -n the same way, vLLM at its generation config's max_new_tokens;
        # the answer says `length` where the cap ended it. (A context overflow is still the 400 OpenAI answers.)
        max_tokens = min(OPENAI_DEFAULT_MAX_TOKENS if r.max_tokens is None else r.max_tokens,
                         self.settings.max_tokens_cap)
        sampling = self.sampling(r.temperature or 0.0, 0, 1.0 if r.top_p is None else r.top_p)
        stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])
        if r.stream_options is not None and not r.stream:  # as OpenAI answers it
            raise s.InvalidRequest("stream_options: only allowed when stream is true", "stream_options")
        if r.stream_options is not None and r.stream_options.include_obfuscation:
            raise s.InvalidRequest("stream_options.include_obfuscation: this server does not pad its chunks with an "
                                   "`obfuscation` field (OpenAI's guard against network side channels): it must be "
                                   "false or left out", "stream_options.include_obfuscation")
        if r.logprobs is not None and r.echo:
            raise s.InvalidRequest("logprobs: with echo it would need the prompt's log-probabilities, which this "
                                   "server does not compute: send one or the other", "logprobs")
        renderer = OpenAIRenderer(include_usage=bool(r.stream_options and r.stream_options.include_usage),
                                  echo=prompt if r.echo else "", logprobs=r.logprobs)
        text, suffix = prompt, r.suffix
        if suffix is None and (layout := split_fim(prompt)) is not None:
            # Another model's FIM layout in one prompt, as plugins send where the server takes no `suffix`
            # (Continue's openai provider, llm-ls, minuet's llama.cpp recipe): to this model the markers are plain
            # text, so it is served as the fill-in-the-middle it was built from (`echo` still gives the prompt). Zed's
            # open_ai_compatible_api provider sends every one of its formats this way, GLM-4's among them.
            _, text, suffix = layout
        if suffix is None and not text:
            suffix = ""  # nothing to continue: write the start of a file instead

        def start(c: Client) -> Awaitable[Stream]:
            self.check_model(c, r.model)
            n = max_tokens
            if suffix is not None and r.max_tokens is not None and r.max_tokens > n:
                # Capped here, so to what the daemon serves a fill-in-the-middle too (half the context, the FIM
                # endpoints' cap): a cap above that turned the plugin's 4096 into a 400 naming a figure never sent.
                n = min(n, c.welcome.max_context // 2)
            kw = dict(max_tokens=n, sampling=sampling, stop=stop, seed=r.seed, logprobs=r.logprobs)
            return c.fim(text, suffix, **kw) if suffix is not None else c.generate(text, **kw)

        capped = (f"this server's cap (m31r serve --max-tokens-cap), as {r.max_tokens} was more"
                  if r.max_tokens is not None and r.max_tokens > max_tokens else None)
        return Generation(self, "/v1/completions", start, renderer, bool(r.stream),
                          Fields(truncate=None, max_tokens_default=capped))

    async def models(self, request: Request) -> Response:
        try:
            client = await self.upstream.get(2.0)
        except Unavailable as e:
            return error_response(503, "unavailable", str(e), retry_after=e.retry_after)
        model, *aliases = model_names(client.welcome.model)
        body = s.OpenAIModelList([s.OpenAIModel(id=model, created=0, aliases=aliases)])
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def model(self, request: Request) -> Response:
        """One model, as OpenAI's `GET /v1/models/{model}` (the OpenAI client's models.retrieve): the served model
        under any name a request may use for it, else a 404."""
        name = request.path_params["model"]
        try:
            client = await self.upstream.get(2.0)
        except Unavailable as e:
            return error_response(503, "unavailable", str(e), retry_after=e.retry_after)
        model, *aliases = names = model_names(client.welcome.model)
        if name not in names:
            return error_response(404, "model_not_found", f"model: {name!r} is not served here; use one of "
                                  f"{', '.join(map(repr, names))} (GET /v1/models)", param="model")
        return Response(msgspec.json.encode(s.OpenAIModel(id=model, created=0, aliases=aliases)),
                        media_type="application/json")

    async def health(self, request: Request) -> Response:
        st = await self.upstream.status(wait=1.0, timeout=2.0)
        w = self.upstream.welcome
        if st is None or w is None:
            err = self.upstream.last_error if not self.upstream.connected else "the daemon did not answer in time"
            return Response(msgspec.json.encode(s.HealthUnavailable("unavailable", err)), 503,
                            headers={"Retry-After": "1"}, media_type="application/json")
        body = s.HealthResponse(status="ok", model=st.model, fingerprint=st.fingerprint, max_context=w.max_context,
                                daemon_version=w.daemon_version, device=st.device, dtype=st.dtype, queue=st.queue,
                                active=st.active, uptime_s=st.uptime_s, warming=st.warming)
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def metrics_endpoint(self, request: Request) -> Response:
        self.metrics.observe_daemon(await self.upstream.status(wait=0.5, timeout=1.0))
        data, content_type = self.metrics.exposition()
        return Response(data, headers={"Content-Type": content_type})

    async def openapi_endpoint(self, request: Request) -> Response:
        w = self.upstream.welcome
        if w is None:
            return Response(self.openapi, media_type="application/json")
        doc = s.with_fim_limit(s.with_models(msgspec.json.decode(self.openapi), model_names(w.model)),
                               w.max_context // 2)
        return Response(msgspec.json.encode(doc), media_type="application/json")


class TrailingSlash:
    """Serves a path with one trailing slash as the path without it (`/` itself stays): Starlette's answer to it was a
    bare 307 to the slashless path, which curl without -L does not follow and some clients follow without the POST
    body. Outermost, so that the refusals before routing have the endpoint's error shape and metrics its route."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and (served := served_path(path)) != path:
            # In place, as Starlette's router updates it: the server's scope is where connection.py marks a request
            # whose connection it closed (security.CLOSED_BY_SERVER).
            scope["path"], scope[SENT_PATH] = served, path
            if (raw := scope.get("raw_path")) and raw.endswith(b"/"):
                scope["raw_path"] = raw[:-1]
        await self.app(scope, receive, send)


def create_app(settings: ServeSettings | None = None, *, upstream: DaemonLink | None = None) -> Starlette:
    from m31r_http import codestral, llamacpp, ollama, tabby

    settings = settings or ServeSettings()
    svc = Service(settings, upstream)

    @asynccontextmanager
    async def lifespan(app: Starlette):
        svc.upstream.warm_up()
        yield
        await svc.shutdown()

    limit = settings.max_body  # per route, so that a 413 goes through the JSON error handler
    routes = [
        Route("/generate", svc.generate, methods=["POST"], max_body_size=limit),
        Route("/completion", llamacpp.completion_endpoint(svc), methods=["POST"], max_body_size=limit),  # (+llama's)
        Route("/fim", svc.fim, methods=["POST"], max_body_size=limit),
        Route("/v1/completions", tabby.completions_endpoint(svc), methods=["POST"], max_body_size=limit),  # (+Tabby's)
        Route("/v1/models", svc.models, methods=["GET"], max_body_size=limit),
        Route("/v1/models/{model}", svc.model, methods=["GET"], max_body_size=limit),
        Route("/health", svc.health, methods=["GET"], max_body_size=limit),
        Route("/metrics", svc.metrics_endpoint, methods=["GET"], max_body_size=limit),
        Route("/openapi.json", svc.openapi_endpoint, methods=["GET"], max_body_size=limit),
        *ollama.routes(svc, limit),
        *llamacpp.routes(svc, limit),
        *tabby.routes(svc, limit),
        *codestral.routes(svc, limit),
    ]  # (the modules of other servers' APIs build on this one's Generation: imported here, not at the top)
    middleware = [
        Middleware(TrailingSlash),
        Middleware(MetricsMiddleware, metrics=svc.metrics),
        Middleware(GuardMiddleware, hosts=HostPolicy(settings.allowed_hosts), origins=settings.cors_origins,
                   token=settings.token, max_body=settings.max_body, body_timeout=settings.body_timeout),
    ]
    if settings.cors_origins:
        # An allowed origin is trusted: any request header (client libraries add their own, such as the OpenAI JS
        # SDK's x-stainless-*, and a preflight naming one not listed would fail), and Chrome's Private Network Access
        # preflight (a public page asking for localhost) is granted, since naming the origin is the user's consent.
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(settings.cors_origins),
                                     allow_methods=["GET", "POST"], allow_headers=["*"], allow_private_network=True,
                                     expose_headers=list(EXPOSED_HEADERS), max_age=600))
    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={HTTPException: http_exception, s.InvalidRequest: invalid_request,
                                        **ollama.EXCEPTION_HANDLERS, Exception: internal_error})
    app.router.redirect_slashes = False  # (TrailingSlash serves the one slash; a path with more is a 404, not a 307)
    app.state.service = svc
    return app

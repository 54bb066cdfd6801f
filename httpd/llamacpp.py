"""llama.cpp server's `POST /infill` on `m31r serve`, so that llama.cpp's own editor plugins (llama.vim, llama.vscode)
work against it unchanged: their users switch by pointing the plugin's endpoint here.

What the plugins send (llama.vim `autoload/llama.vim` llama#fim and s:ring_update; llama.vscode
`src/llama-server.ts` createRequestPayload): `input_prefix` (the lines above the cursor line), `prompt` (the cursor
line before the cursor), `input_suffix`, `input_extra` (chunks of other files, `{text, filename}`, oldest first),
`n_predict`, `n_indent`, `t_max_predict_ms`, `stop` (llama.vim), sampling options, `response_fields` (llama.vim), and
options of llama.cpp's server that mean nothing here (`id_slot`, `cache_prompt`, `samplers`, `t_max_prompt_ms`,
`n_cmpl`, `lora`). `n_predict: 0` with only `input_extra` is their cache-warming request. What they read: `content`
(both), `tokens_cached`, `timings/*` (llama.vim, through `response_fields`; llama.vscode's status bar, with
`generation_settings.n_ctx` and `truncated`).

How it maps onto the daemon's Fim (as ollama.py does for Ollama's API):
- prefix = input_prefix + prompt, suffix = input_suffix; `input_extra`'s last MAX_SNIPPETS chunks are the Fim's
  `context`, the newest first (the daemon lays its first snippet nearest the code, as llama.cpp lays its last).
- No `document`: neither plugin names the file being edited (`input_extra`'s filenames are those of chunks, the
  current file's among them, and `id_slot` is always 0), so a newer request supersedes no older one and typing
  through a suggestion is not answered from it, as they are for /fim's `path` and Tabby's `filepath`. (llama.vim
  stops its older request itself, closing its connection, which cancels it here.)
- Greedy unless `temperature` is above 0: the plugins send top_k/top_p for llama.cpp's sampler chain, which samples;
  here those apply only with a temperature.
- n_predict is capped, as llama.cpp's server caps it, at --max-tokens-cap and the daemon's FIM limit (half the
  context); negative or absent means that cap. 0 prefills the prompt and answers nothing (llama.cpp's meaning).
- `n_indent` and `t_max_predict_ms` are llama.cpp's stop rules, which the daemon lacks: they are applied here to the
  daemon's tokens as they come (Ruled), and the daemon's request is cancelled where they end the answer, so they save
  its time as in llama.cpp. Unlike llama.cpp, the line n_indent stops at is dropped whole (llama.cpp keeps its
  leading whitespace, which llama.vim would show as a line of spaces), and t_max_predict_ms ends the answer right
  after the line end (llama.cpp keeps the rest of that token).
- `n_cmpl` (llama.vscode asks for 3) gets one completion: greedy copies would be alike, and a beam search, which
  could give distinct ones, cannot end at t_max_predict_ms. llama.vscode reads a single answer as well as a list.
- Unknown fields are ignored, as llama.cpp's server ignores them; those not honoured are named in the
  X-M31R-Ignored-Options header (except `model`, `id_slot` and `cache_prompt`, whose effect is had anyway: one model,
  no slots, and the daemon always reuses its prefix cache).
- Errors have llama.cpp's shape, `{"error": {"code": <status>, "message", "type"}}`; mid-stream, a `data:` line of it.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from m31r_http import schemas as s
from m31r_http.app import Fields, Generation, Renderer, Service, ignored_header
from m31r_http.security import llamacpp_error_body
from m31r_protocol import Client, Stream
from m31r_protocol.limits import MAX_SNIPPETS
from m31r_protocol.messages import Done, Snippet, Timings, Token, Usage

# Fields acted on, and those whose effect is had anyway (not named as ignored).
HONOURED = frozenset(s.InfillRequest.__struct_fields__) | {"id_slot", "cache_prompt"}


class Ruled:
    """The daemon's stream under llama.cpp's stop rules that the daemon lacks: `n_indent` (end before a line, after the
    first, indented by fewer spaces or tabs than it; a blank line counts as indented by its whitespace, as in
    llama.cpp) and `t_max_predict_ms` (end at the first line end written that long after the first token). Text
    that a rule may yet drop (a line whose indentation is not known yet) is held back until it is known, so a
    stream never sends what the answer leaves out. Where a rule ends the answer, the daemon's request is cancelled,
    and `done` is made here: the daemon's usage and timings never come, so the prompt's figures are unknown (0)."""

    def __init__(self, inner: Stream, n_indent: int, t_max_predict_ms: int):
        self.inner, self.n_indent, self.t_max = inner, n_indent, t_max_predict_ms / 1000
        self.id = inner.id
        self.done: Done | None = None
        self.rule: str | None = None  # the rule that ended the answer
        self.text = ""  # the daemon's text so far
        self.sent = 0  # how much of it was passed on
        self.end: int | None = None  # where the answer ends, once it has
        self.scan = 0  # where to look for the next line end (the first line is never judged)
        self.open: int | None = None  # the start of a line whose indentation is not known yet
        self.tokens = 0
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.cancelled = False

    def __aiter__(self) -> Ruled:
        return self

    async def __anext__(self) -> Token:
        if self.cancelled:  # (the server's cancel: the daemon's stream says so)
            return await anext(self.inner)
        while self.done is None:
            try:
                tok = await anext(self.inner)
            except StopAsyncIteration:
                self.done, self.end = self.inner.done, len(self.text)
                break
            now = time.perf_counter()
            if self.t_first is None:
                self.t_first = now
            self.tokens += tok.token is not None
            self.text += tok.text
            cut = self._indent_cut()
            if cut is None and self.t_max > 0 and "\n" in tok.text and now - self.t_first > self.t_max:
                cut, self.rule = self.text.rfind("\n") + 1, "t_max_predict_ms"
            if cut is not None:
                await self.inner.cancel()
                self.done, self.end = self._cut_done(now), cut
                break
            safe = self.open if self.open is not None else len(self.text)
            if safe > self.sent:
                return self._pass(tok, safe)
        assert self.end is not None
        if self.sent < self.end:
            return self._pass(None, self.end)
        raise StopAsyncIteration

    def _indent_cut(self) -> int | None:
        """Where n_indent ends the answer (the start of the line it drops), or None; moves `open` and `scan` on."""
        if self.n_indent <= 0:
            return None
        text = self.text
        while True:
            if self.open is None:
                nl = text.find("\n", self.scan)
                if nl < 0:
                    self.scan = len(text)
                    return None
                self.open = nl + 1
            start = p = self.open
            while p < len(text) and text[p] in " \t":
                p += 1
            if p == len(text):  # only whitespace so far: not known yet
                return None
            if p - start < self.n_indent:
                self.rule = "n_indent"
                return start
            self.open, self.scan = None, p

    def _pass(self, tok: Token | None, upto: int) -> Token:
        piece, self.sent = self.text[self.sent:upto], upto
        return msgspec.structs.replace(tok, text=piece) if tok is not None else Token(id=self.id, text=piece)

    def _cut_done(self, now: float) -> Done:
        first_ms = ((self.t_first or now) - self.t0) * 1000
        return Done(id=self.id, finish_reason="stop", usage=Usage(completion_tokens=self.tokens),
                    timings=Timings(prefill_ms=first_ms, first_token_ms=first_ms, total_ms=(now - self.t0) * 1000))

    async def cancel(self) -> None:
        self.cancelled = True
        await self.inner.cancel()


def pick(obj: dict[str, Any], fields: list[str]) -> dict[str, Any]:
    """llama.cpp's `response_fields`: only these fields, `a/b` (field b of a) under the name `a/b`; a field that is
    not there is left out."""
    out: dict[str, Any] = {}
    for name in fields:
        value: Any = obj
        for part in name.split("/"):
            if not isinstance(value, dict) or part not in value:
                break
            value = value[part]
        else:
            out[name] = value
    return out


def _rate(n: int, ms: float) -> tuple[float, float]:
    """Milliseconds a token and tokens a second (0 where there is nothing to divide by)."""
    return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)


class InfillRenderer(Renderer):
    """llama.cpp's answer: one JSON object, or `data: {...}` lines, a chunk each, the last the whole object's fields
    (`content` empty), as llama.cpp's /infill streams (no `[DONE]`)."""

    def __init__(self, settings: s.InfillSettings, fields: list[str], ignored: list[str]):
        self.settings, self.fields = settings, fields
        self.predicted = 0
        self.headers = ignored_header(ignored)

    def connected(self, client: Client) -> None:
        self.settings.model = client.welcome.model

    def _final(self, g: Generation, content: str) -> bytes:
        d = g.done
        assert d is not None
        u, t = d.usage, d.timings
        ruled = isinstance(g.daemon, Ruled) and g.daemon.rule is not None
        prompt_n = max(0, u.prompt_tokens - u.cached_tokens)
        predicted_ms = max(0.0, t.total_ms - t.queue_ms - t.prefill_ms)
        (p_tok, p_sec), (g_tok, g_sec) = _rate(prompt_n, t.prefill_ms), _rate(u.completion_tokens, predicted_ms)
        timings = s.InfillTimings(cache_n=u.cached_tokens, prompt_n=prompt_n, prompt_ms=t.prefill_ms,
                                  prompt_per_token_ms=p_tok, prompt_per_second=p_sec,
                                  predicted_n=u.completion_tokens, predicted_ms=predicted_ms,
                                  predicted_per_token_ms=g_tok, predicted_per_second=g_sec)
        # A stop the request gave is llama.cpp's "word", named; the daemon's own (the code after the cursor written
        # again, a repeated line) end the infill as the model's end would.
        word = d.stop_sequence if d.stopped_by == "sequence" and d.stop_sequence in self.settings.stop else None
        stop_type = "limit" if ruled or d.finish_reason != "stop" else "word" if word is not None else "eos"
        answer = s.InfillResponse(content=content, model=self.settings.model, tokens_predicted=u.completion_tokens,
                                  tokens_evaluated=u.prompt_tokens, generation_settings=self.settings,
                                  has_new_line="\n" in g.text, stop_type=stop_type, stopping_word=word or "",
                                  tokens_cached=u.cached_tokens, timings=timings)
        if not self.fields:
            return msgspec.json.encode(answer)
        return msgspec.json.encode(pick(msgspec.to_builtins(answer), self.fields))

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        tokens = [frame.token] if frame is not None and frame.token is not None else []
        self.predicted += len(tokens)
        event = s.InfillChunk(content=text, tokens=tokens, tokens_predicted=self.predicted)
        return b"data: " + msgspec.json.encode(event) + b"\n\n"

    def final(self, g: Generation) -> bytes:
        return b"data: " + self._final(g, "") + b"\n\n"

    def body(self, g: Generation) -> bytes:
        return self._final(g, g.text)

    def error_event(self, status: int, code: str, message: str) -> bytes:
        return b"data: " + llamacpp_error_body(status, code, message) + b"\n\n"


def context(extra: list[s.InfillExtra]) -> list[Snippet]:
    """input_extra (oldest first, the last nearest the code in llama.cpp's prompt) as a Fim's context (best first,
    the first nearest): the newest MAX_SNIPPETS, newest first."""
    return [Snippet(c.text, c.filename) for c in reversed(extra[-MAX_SNIPPETS:])]


def stop_as_list(raw: Any) -> Any:
    """The body with its `stop` a list: llama.cpp reads only an array, and passes over a string or null rather than
    refusing it (a 400 here left such a client with no completion). Null is no stop sequence, as there; a string is
    the one it names, as OpenAI's API and Ollama's read one."""
    if isinstance(raw, dict) and (raw.get("stop") is None or isinstance(raw["stop"], str)) and "stop" in raw:
        return {**raw, "stop": [] if raw["stop"] is None else [raw["stop"]]}
    return raw


async def infill(svc: Service, request: Request) -> Generation:
    """POST /infill: the request as the daemon's Fim (module docstring), answered as llama.cpp answers."""
    body = await request.body()
    raw = stop_as_list(s.parse(body))
    r: s.InfillRequest = s.convert(raw, s.InfillRequest)  # (so `raw` is an object)
    ignored = sorted(k for k in raw if k not in HONOURED)
    asked = r.n_predict if r.n_predict is not None else r.max_tokens if r.max_tokens is not None else -1
    greedy = r.temperature <= 0
    sampling = msgspec.structs.replace(
        svc.sampling(0.0 if greedy else r.temperature, max(0, r.top_k), r.top_p),
        repetition_penalty=r.repeat_penalty)
    seed = r.seed if r.seed is not None and r.seed >= 0 else None
    settings = s.InfillSettings(n_ctx=0, n_predict=0, model="", temperature=max(0.0, r.temperature),
                                top_k=max(0, r.top_k), top_p=r.top_p, repeat_penalty=r.repeat_penalty,
                                seed=-1 if seed is None else seed, stop=r.stop, stream=r.stream,
                                n_indent=max(0, r.n_indent), t_max_predict_ms=max(0, r.t_max_predict_ms))
    renderer = InfillRenderer(settings, r.response_fields, ignored)
    snippets = context(r.input_extra)

    async def submit(c: Client, max_tokens: int) -> Stream:
        inner = await c.fim(r.input_prefix + r.prompt, r.input_suffix, max_tokens=max_tokens, sampling=sampling,
                            stop=r.stop, seed=seed, context=snippets)
        if settings.n_indent or settings.t_max_predict_ms:
            return Ruled(inner, settings.n_indent, settings.t_max_predict_ms)  # (a Stream in all Generation uses)
        return inner

    def start(c: Client) -> Awaitable[Stream]:
        ctx = c.welcome.max_context
        limit = min(svc.settings.max_tokens_cap, ctx // 2)
        settings.n_ctx, settings.n_predict = ctx, limit if asked < 0 else min(asked, limit)
        return submit(c, settings.n_predict)

    return Generation(svc, "/infill", start, renderer, r.stream, Fields("input_prefix", "n_predict", truncate=None))


def routes(svc: Service, max_body: int) -> list[Route]:
    async def endpoint(request: Request) -> Response | Generation:
        return await infill(svc, request)

    return [Route("/infill", endpoint, methods=["POST"], max_body_size=max_body)]

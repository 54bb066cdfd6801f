"""llama.cpp server's `POST /infill` on `m31r serve`, so that llama.cpp's own editor plugins (llama.vim, llama.vscode)
work against it unchanged: their users switch by pointing the plugin's endpoint here. And llama.cpp server's own
`POST /completion` request, for clients written for that server (Continue's llama.cpp provider), on the path of this
server's editor-policy endpoint (last section).

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
- `truncated` is the daemon's: true where the prompt lost text to fit the context (the prefix's lines far above the
  cursor, the suffix's far below, a long cursor line's start; a plain /completion prompt's start), as llama.cpp's
  was where it cut a prompt. Unknown (false) where an n_indent or t_max_predict_ms cut ended the daemon's request.
- Errors have llama.cpp's shape, `{"error": {"code": <status>, "message", "type"}}`; mid-stream, a `data:` line of it.

llama.cpp's `POST /completion` (`{prompt, n_predict, stream, stop, temperature, cache_prompt, ...}`; Continue's
llama.cpp provider lays out a fill-in-the-middle prompt in the model's FIM template itself and streams the answer):
- Told from this server's own /completion request by the body: an object with `prompt` and neither `prefix` nor
  `suffix` is llama.cpp's (this server's refuses `prompt` as an unknown field); one with `prompt` and either is a
  400 (whose request it is is unclear); any other body, one that is no JSON object included, is this server's.
- A prompt that is exactly another model's FIM layout (fim_templates.split_fim, as /v1/completions reads one) is the
  daemon's Fim; other text a Generate (an empty prompt: a Fim with nothing around the cursor, the start of a file). A
  list of one string is that string; token ids, several prompts and multimodal objects are refused (400).
- The options, caps (n_predict at --max-tokens-cap, for a Fim at half the context; negative or absent: that cap; 0
  only prefills), stop rules, answer and stream are /infill's, the answer with llama.cpp's `prompt` (as sent). A
  Generate's n_predict is also capped to keep the prompt in the context: all of one that surely fits in half of it,
  else its end (the daemon cuts its start), as ollama.fit_num_predict does.
- Errors have llama.cpp's shape once the body is known to be llama.cpp's; before (no JSON, nesting too deep, a body
  over --max-body, the token and Host checks), this server's, as for its own /completion.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from m31r_http import schemas as s
from m31r_http.app import Fields, Generation, Renderer, Service, ignored_header, prompt_read
from m31r_http.fim_templates import split_fim
from m31r_http.ollama import fit_num_predict
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


def llamacpp_error(status: int, code: str, message: str, param: str | None = None) -> bytes:
    """An error in llama.cpp's shape, which has no `param`: the field is named in the message."""
    return llamacpp_error_body(status, code, f"{param}: {message}" if param and not message.startswith(param)
                               else message)


class InfillRenderer(Renderer):
    """llama.cpp's answer: one JSON object, or `data: {...}` lines, a chunk each, the last the whole object's fields
    (`content` empty), as llama.cpp's /infill and /completion stream (no `[DONE]`). `prompt`: /completion's, which
    its answer repeats (None: /infill's answer, which has none)."""

    def __init__(self, settings: s.InfillSettings, fields: list[str], ignored: list[str], prompt: str | None = None):
        self.settings, self.fields, self.prompt = settings, fields, prompt
        self.predicted = 0
        self.headers = ignored_header(ignored)

    def connected(self, client: Client) -> None:
        self.settings.model = client.welcome.model

    def _final(self, g: Generation, content: str) -> bytes:
        d = g.done
        assert d is not None
        u, t = d.usage, d.timings
        ruled = isinstance(g.daemon, Ruled) and g.daemon.rule is not None
        # A healed word's tokens are the prompt's (app.prompt_read), as in the other adapters' usage: so
        # tokens_evaluated + tokens_predicted is the context the answer took, and prompt_n is still tokens_evaluated
        # less the cached ones. (Their time is the generation's: they were decoded one by one.)
        evaluated = prompt_read(u)
        prompt_n = max(0, evaluated - u.cached_tokens)
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
        kw: dict[str, Any] = dict(
            content=content, model=self.settings.model, tokens_predicted=u.completion_tokens,
            tokens_evaluated=evaluated, generation_settings=self.settings, has_new_line="\n" in g.text,
            stop_type=stop_type, stopping_word=word or "", tokens_cached=u.cached_tokens, timings=timings,
            truncated=d.truncated)
        answer = (s.InfillResponse(**kw) if self.prompt is None
                  else s.LlamaCppCompletionResponse(**kw, prompt=self.prompt))
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

    def error_json(self, path: str, status: int, code: str, message: str, param: str | None = None) -> bytes:
        return llamacpp_error(status, code, message, param)  # (on /completion too, whose path's shape is OpenAI's)


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


class Options:
    """What llama.cpp's options shared by /infill and /completion ask of the daemon."""

    def __init__(self, svc: Service, r: s.LlamaCppOptions):
        self.asked = r.n_predict if r.n_predict is not None else r.max_tokens if r.max_tokens is not None else -1
        greedy = r.temperature <= 0
        self.sampling = msgspec.structs.replace(
            svc.sampling(0.0 if greedy else r.temperature, max(0, r.top_k), r.top_p),
            repetition_penalty=r.repeat_penalty)
        self.seed = r.seed if r.seed is not None and r.seed >= 0 else None
        self.settings = s.InfillSettings(
            n_ctx=0, n_predict=0, model="", temperature=max(0.0, r.temperature), top_k=max(0, r.top_k), top_p=r.top_p,
            repeat_penalty=r.repeat_penalty, seed=-1 if self.seed is None else self.seed, stop=r.stop,
            stream=r.stream, n_indent=max(0, r.n_indent), t_max_predict_ms=max(0, r.t_max_predict_ms))

    def n_predict(self, ctx: int, limit: int) -> int:
        """The tokens to ask for, under `limit` (the server's and the context's), noted in the settings as sent."""
        self.settings.n_ctx, self.settings.n_predict = ctx, limit if self.asked < 0 else min(self.asked, limit)
        return self.settings.n_predict

    def ruled(self, inner: Stream) -> Stream:
        """The daemon's stream under n_indent and t_max_predict_ms, where the request has them."""
        if self.settings.n_indent or self.settings.t_max_predict_ms:
            return Ruled(inner, self.settings.n_indent, self.settings.t_max_predict_ms)  # (a Stream in all uses)
        return inner


async def infill(svc: Service, request: Request) -> Generation:
    """POST /infill: the request as the daemon's Fim (module docstring), answered as llama.cpp answers."""
    body = await request.body()
    raw = stop_as_list(s.parse(body))
    r: s.InfillRequest = s.convert(raw, s.InfillRequest)  # (so `raw` is an object)
    ignored = sorted(k for k in raw if k not in HONOURED)
    opts = Options(svc, r)
    renderer = InfillRenderer(opts.settings, r.response_fields, ignored)
    snippets = context(r.input_extra)

    async def start(c: Client) -> Stream:
        ctx = c.welcome.max_context
        n = opts.n_predict(ctx, min(svc.settings.max_tokens_cap, ctx // 2))
        return opts.ruled(await c.fim(r.input_prefix + r.prompt, r.input_suffix, max_tokens=n, sampling=opts.sampling,
                                      stop=r.stop, seed=opts.seed, context=snippets))

    return Generation(svc, "/infill", start, renderer, r.stream, Fields("input_prefix", "n_predict", truncate=None))


# -- /completion ----------------------------------------------------------------------------------------------

COMPLETION_HONOURED = frozenset(s.LlamaCppCompletionRequest.__struct_fields__) | {"id_slot", "cache_prompt"}


def llamacpp_fields(body: bytes) -> dict | None:
    """A /completion body's fields when it is llama.cpp's request (an object with `prompt`, which this server's own
    refuses as unknown), else None (this server's editor-policy request, or a body that is no JSON object, which that
    endpoint refuses). InvalidRequest where it also has this server's `prefix` or `suffix`: whose it is is unclear."""
    if b"prompt" not in body:  # this server's request is not parsed twice (an escaped key, `\u0070rompt`, is not seen)
        return None
    try:
        raw = s.parse(body)
    except s.InvalidRequest:
        return None  # (the editor-policy endpoint says what is wrong with it)
    if not isinstance(raw, dict) or "prompt" not in raw:
        return None
    if mixed := [k for k in ("prefix", "suffix") if k in raw]:
        raise s.InvalidRequest(
            f"the body has both llama.cpp's `prompt` and this server's `{'` and `'.join(mixed)}`: POST /completion "
            "takes llama.cpp server's request ({\"prompt\": ...}) or this server's editor-policy one ({\"prefix\": "
            "..., \"suffix\": ...}), not one mixing both; send one of them", "prompt")
    return raw


def refuse_prompt(prompt: Any) -> None:
    """InvalidRequest for the `prompt` shapes llama.cpp takes that this server does not: token ids (the daemon
    tokenizes text itself), several prompts (llama.cpp answers them with a list), multimodal objects."""
    items = prompt if isinstance(prompt, list) else [prompt]
    if any(isinstance(x, int) and not isinstance(x, bool) or isinstance(x, list) for x in items):
        raise s.InvalidRequest("prompt: token ids are not supported: this server takes the prompt as text (the "
                               "daemon tokenizes it); send it as a string", "prompt")
    if any(isinstance(x, dict) for x in items):
        raise s.InvalidRequest("prompt: an object prompt (`prompt_string`, `multimodal_data`) is not supported: send "
                               "the prompt as a string", "prompt")
    if isinstance(prompt, list) and len(prompt) > 1:
        raise s.InvalidRequest(f"prompt: one prompt a request: a list of {len(prompt)} prompts is not supported; send "
                               "each in a request of its own (or one string)", "prompt")


async def completion(svc: Service, raw: dict) -> Generation:
    """POST /completion with llama.cpp's request (its body parsed by llamacpp_fields): a prompt in another model's
    FIM layout as the daemon's Fim, other text as a Generate, answered as llama.cpp answers (module docstring)."""
    refuse_prompt(raw["prompt"])
    raw = stop_as_list(raw)
    r: s.LlamaCppCompletionRequest = s.convert(raw, s.LlamaCppCompletionRequest)
    prompt = r.prompt if isinstance(r.prompt, str) else r.prompt[0]
    ignored = sorted(k for k in raw if k not in COMPLETION_HONOURED)
    opts = Options(svc, r)
    renderer = InfillRenderer(opts.settings, r.response_fields, ignored, prompt)
    layout = split_fim(prompt)
    prefix, suffix = (layout[1], layout[2]) if layout is not None else (prompt, None if prompt else "")
    # (an empty prompt has nothing to continue: the start of a file is written, as /v1/completions writes it)

    async def start(c: Client) -> Stream:
        ctx, cap = c.welcome.max_context, svc.settings.max_tokens_cap
        kw = dict(sampling=opts.sampling, stop=r.stop, seed=opts.seed)
        if suffix is not None:  # the daemon's FIM limit: half the context (it fits the prompt in the rest)
            return opts.ruled(await c.fim(prefix, suffix, max_tokens=opts.n_predict(ctx, min(cap, ctx // 2)), **kw))
        # A prompt and its completion share the context: n_predict is capped to keep the prompt, all of one that
        # surely fits in half the context, else its end (the daemon cuts its start), as Ollama's API here does;
        # llama.cpp stops where its context is full, and answers `limit` as this does.
        n = opts.n_predict(ctx, fit_num_predict(cap, ctx, prefix, True))
        return opts.ruled(await c.generate(prefix, max_tokens=n, truncate=True, **kw))

    return Generation(svc, "/completion", start, renderer, r.stream,
                      Fields("prompt", "n_predict", truncate=None))


def completion_endpoint(svc: Service) -> Callable[[Request], Awaitable[Response | Generation]]:
    """/completion: llama.cpp's request to `completion` (its refusals in llama.cpp's shape), all others to this
    server's editor-policy endpoint, unchanged."""

    async def endpoint(request: Request) -> Response | Generation:
        body = await request.body()  # (kept by the request: the editor-policy endpoint reads it again)
        if (raw := llamacpp_fields(body)) is None:
            return await svc.completion(request)
        try:
            return await completion(svc, raw)
        except s.InvalidRequest as e:
            return Response(llamacpp_error(e.status, e.code, e.message, e.param), e.status,
                            media_type="application/json")

    return endpoint


def routes(svc: Service, max_body: int) -> list[Route]:
    async def endpoint(request: Request) -> Response | Generation:
        return await infill(svc, request)

    return [Route("/infill", endpoint, methods=["POST"], max_body_size=max_body)]

"""Ollama's API on `m31r serve`: `POST /api/generate`, `POST /api/show`, `GET /api/tags`, `GET /api/version`, and
`GET /` (or HEAD) answering "Ollama is running", so that editor plugins written for a local Ollama (Continue's
autocomplete, llama-coder, Twinny) and tools that check for one work unchanged.

Where it follows Ollama and where it does not:
- `suffix` (even empty) makes a request fill-in-the-middle. A prompt that is exactly another model family's FIM
  layout (what llama-coder, Twinny and Zed send) is split back into prefix and suffix (`fim_templates.py`;
  fim_layout drops the space llama-coder and Twinny put after CodeLlama's <SUF>). No prompt template is ever
  applied, so `raw` changes nothing.
- Options honoured: num_predict, temperature, top_k, top_p, seed, stop. Every other option is ignored, as Ollama
  ignores options it does not know (plugins send num_ctx, num_thread, repeat_penalty by habit); the response's
  `X-M31R-Ignored-Options` header names them (percent-encoded where a name holds what a header cannot carry).
- Defaults are this project's: greedy (temperature 0, top_k and top_p off) unless asked, not Ollama's 0.8.
  num_predict left out, 0 or negative ("no limit": Ollama's runner limits only a positive one, and leaves 0 out of
  llama-server's request): min(--max-tokens-cap, half the context). num_predict over the
  cap is capped to it, as Ollama refuses none (Continue sends 4096); `truncate: false` refuses it. A prompt too long
  for the context loses its start, as Ollama's does (`truncate: false` refuses).
  A num_predict too large for the context with the prompt is capped to what fits, keeping the prompt (at least half
  the context of it), where Ollama would shift its context and go on; `truncate: false` refuses it (fit_num_predict).
- `logprobs: true` gives each chunk (and a whole answer) Ollama's `logprobs` list: each token's text, natural-log
  probability and UTF-8 bytes, with `top_logprobs` (0 to 20) of the likeliest tokens at its step.
- Fields asking for what this model cannot do (system, template, context, images, format, think, image generation)
  are refused with 400; unknown top-level fields are ignored, as Ollama's JSON decoding does.
- A JSON null is the field left out, as Go's decoder reads it (without_nulls; a null option is its default, as
  Options.FromMap skips it).
- An empty prompt (and no `suffix`) answers `done_reason: "load"`, or `"unload"` with a zero `keep_alive` (0, "0",
  "0s", ...), as one JSON object whether streamed or not, as routes.go does; the daemon keeps its model either way.
  A `keep_alive` Ollama could not read (a boolean, "5", "forever") is its 400.
- Errors have Ollama's shape, `{"error": "message"}`: 400 bad input, 404 unknown model, 503 busy or unavailable;
  mid-stream, one `{"error": ...}` line ends the stream.
"""

from __future__ import annotations

import re
import time
from collections.abc import Awaitable
from datetime import UTC, datetime
from fractions import Fraction
from pathlib import Path
from typing import Annotated, Any

import msgspec
from msgspec import Meta, Struct
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from m31r_http import schemas as s
from m31r_http.app import Fields, Generation, Renderer, Service, ignored_header, model_names, prompt_read, token_figures
from m31r_http.fim_templates import split_fim
from m31r_protocol import Client, Stream
from m31r_protocol.limits import MAX_LOGPROBS
from m31r_protocol.messages import StatusReply, Token
from m31r_protocol.reconnect import Unavailable

OLLAMA_VERSION = "0.12.0"  # the Ollama release whose API this follows: clients gate features on it
RUNNING = "Ollama is running"  # Ollama's answer at `/`: clients that detect an Ollama server compare it word for word
HONOURED = frozenset({"num_predict", "temperature", "top_k", "top_p", "seed", "stop"})
# What /api/show reports as the prompt template. Continue looks for `.Suffix` in it to decide that a model
# does fill-in-the-middle; this is the layout the daemon builds (README "Fill-in-the-middle layout").
TEMPLATE = ("{{- if .Suffix }}<|fim_suffix|>{{ .Suffix }}<|fim_prefix|>{{ .Prompt }}<|fim_middle|>"
            "{{- else }}{{ .Prompt }}{{- end }}")
NDJSON = b"application/x-ndjson"


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error as Ollama answers one (clients read `error` as a string)."""
    return Response(msgspec.json.encode({"error": message}), status, headers=headers, media_type="application/json")


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, round(seconds * 1e9))


# -- requests ---------------------------------------------------------------------------------------------------


class Options(Struct):
    """The options honoured (unknown keys are ignored when decoding, as Ollama ignores them)."""

    num_predict: int | None = None
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_k: Annotated[int, Meta(ge=0, le=s.INT32)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=s.INT63)] | None = None  # negative: a random seed (Ollama's -1)
    stop: str | s.Stop | None = None


class GenerateRequest(Struct, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    prompt: str = ""
    suffix: str | None = None
    raw: bool = False
    stream: bool = True
    options: dict[str, Any] | None = None
    keep_alive: Any = None  # validated as Ollama's (keep_alive_is_zero): the daemon keeps its model loaded anyway
    truncate: bool = True
    # What this server cannot do: accepted only empty.
    system: str = ""
    template: str = ""
    context: list[int] | None = None
    images: list[str] | None = None
    format: Any = None
    think: Any = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] = 0
    width: int | None = None
    height: int | None = None
    steps: int | None = None


REFUSED = {
    "system": "a system prompt needs a chat template, and this code model has none",
    "template": "prompt templates are not supported: send the text before the cursor as `prompt` and the text "
                "after it as `suffix`",
    "context": "`context` (an earlier response's conversation memory) is not supported",
    "images": "this model reads text only",
    "format": "structured output (`format`) is not supported",
    "think": "this model does not think: `think` must be false or left out",
    "width": "image generation is not supported",
    "height": "image generation is not supported",
    "steps": "image generation is not supported",
}


class ShowRequest(Struct, kw_only=True):
    model: str | None = None
    name: str | None = None  # the field's name before Ollama 0.5
    verbose: bool = False


def check_model(client: Client, model: str) -> str:
    """The model's name for `model` (a name or alias, `:latest` allowed), or InvalidRequest (404, as Ollama)."""
    names = model_names(client.welcome.model)
    base, _, tag = model.partition(":")
    if base not in names or tag not in ("", "latest"):
        listed = ", ".join(f'"{n}"' for n in names)
        raise s.InvalidRequest(f'model "{model}" not found: this server serves {listed}', "model",
                               "model_not_found", status=404)
    return model


def without_nulls(raw: Any) -> Any:
    """The body with its top-level nulls left out. Ollama's Go decoder reads a JSON null as the field's zero value,
    which is its default (`"system": null` is no system prompt, `"stream": null` streams, `"options": null` is none),
    so clients that write every field, null where unset, are served as if they had left it out."""
    return {k: v for k, v in raw.items() if v is not None} if isinstance(raw, dict) else raw


# time.ParseDuration's units, in nanoseconds (Go accepts both micro signs).
GO_UNITS = {"ns": 1, "us": 10**3, "\u00b5s": 10**3, "\u03bcs": 10**3, "ms": 10**6, "s": 10**9, "m": 60 * 10**9,
            "h": 3600 * 10**9}
_GO_NUMBER = re.compile(r"(\d*)(?:\.(\d*))?")
_GO_UNIT = re.compile(r"[^\d.]*")
KEEP_ALIVE_HELP = ("send seconds as a number (negative: keep the model loaded) or a duration such as \"5m\", "
                   "\"1h30m\" or \"0\" (Go's time.ParseDuration; units ns, us, ms, s, m, h)")


def go_duration_ns(text: str) -> int:
    """Go's time.ParseDuration of `text` in nanoseconds (each term truncated, as Go's), or ValueError saying why."""
    rest, negative = text, False
    if rest[:1] in ("-", "+"):
        negative, rest = rest[0] == "-", rest[1:]
    if rest == "0":  # Go's one unitless duration
        return 0
    if not rest:
        raise ValueError("it is empty")
    total = 0
    while rest:
        number = _GO_NUMBER.match(rest)
        assert number is not None  # (the pattern matches the empty string)
        whole, fraction = number.group(1), number.group(2) or ""
        if not whole and not fraction:
            raise ValueError(f"a number was expected at {rest!r}")
        rest = rest[number.end():]
        unit = _GO_UNIT.match(rest).group(0)  # type: ignore[union-attr]
        if unit not in GO_UNITS:
            raise ValueError(f"unknown unit {unit!r}" if unit else "a number has no unit")
        rest = rest[len(unit):]
        total += int((int(whole or 0) + Fraction(int(fraction or 0), 10 ** len(fraction))) * GO_UNITS[unit])
        if total > 2**63 - (not negative):
            raise ValueError("it overflows a Go duration (about 292 years)")
    return -total if negative else total


def keep_alive_is_zero(value: Any) -> bool:
    """Whether `keep_alive` asks to unload the model now (a zero duration), read as Ollama's api.Duration reads it:
    a number is seconds (negative: forever), a string a Go duration (negative: forever); another type, or a string
    Go cannot parse, is the 400 Ollama answers. Left out (or null) it is no request to unload."""
    if value is None:
        return False
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        kind = "a boolean" if isinstance(value, bool) else "an object" if isinstance(value, dict) else "a list"
        raise s.InvalidRequest(f"keep_alive: {kind} is not a duration: {KEEP_ALIVE_HELP}", "keep_alive")
    if isinstance(value, str):
        try:
            return go_duration_ns(value) == 0
        except ValueError as e:
            raise s.InvalidRequest(f"keep_alive: {value!r} is not a duration ({e}): {KEEP_ALIVE_HELP}",
                                   "keep_alive") from None
    return 0 <= value * 1e9 < 1  # Go: time.Duration(t * float64(time.Second)), truncated (1e308: no overflow here)


INTEGERS = ("num_predict", "top_k", "seed")  # the honoured options that Ollama reads as integers


def _options(raw: dict[str, Any] | None) -> tuple[Options, list[str]]:
    """The honoured options, validated, and the names of those ignored.

    Ollama decodes `options` as untyped JSON, where every number is a float64, and sets an integer option to the
    float truncated (api/types.go, Options.FromMap): `"num_predict": 64.0` (what Python's json and Emacs write for a
    float that holds 64) is 64 there, so it is here too, where msgspec alone would refuse a float for an int."""
    raw = raw or {}
    typed = {k: int(v) if k in INTEGERS and isinstance(v, float) else v for k, v in raw.items()}
    try:
        opts = msgspec.convert(typed, Options)
    except msgspec.ValidationError as e:
        text = str(e)
        field = text.rsplit("$.", 1)[-1].rstrip("`") if "$." in text else ""
        param = f"options.{field}" if field else "options"
        raise s.InvalidRequest(f"{param}: {text}", param) from None
    if opts.num_predict is not None and opts.num_predict < -2:
        raise s.InvalidRequest(f"options.num_predict: {opts.num_predict} is not a length: use 1 or more, or 0, -1 or "
                               "-2 for this server's cap (min(--max-tokens-cap, half the context))",
                               "options.num_predict")
    return opts, sorted(k for k in raw if k not in HONOURED)


def fim_layout(prompt: str) -> tuple[str, str] | None:
    """(prefix, suffix) when `prompt` is another model's FIM layout (split_fim), else None.

    CodeLlama's own layout is `<PRE> {prefix} <SUF>{suffix} <MID>` (Ollama's template, Continue's, cmp-ai's), but
    llama-coder and Twinny write `<SUF> {suffix}`: a space the code does not have, on every request. Where a line end
    (or the prompt's end) follows it, the cursor is at a line's end, where editors complete most, and the space is
    dropped: with CodeLlama's own layout it would be trailing whitespace of the cursor's line. Before other text it
    is ambiguous (the code may have a space there) and is kept. Twinny's Codestral layout starts with the line ends
    that follow its (optional) file context, `\n\n[SUFFIX]`: with no file context they are the layout's too."""
    prompt = prompt[2:] if prompt.startswith("\n\n[SUFFIX]") else prompt
    layout = split_fim(prompt)
    if layout is None:
        return None
    name, prefix, suffix = layout
    if name == "codellama" and suffix.startswith(" ") and suffix[1:2] in ("", "\n", "\r"):
        suffix = suffix[1:]
    return prefix, suffix


def fit_num_predict(n: int, max_context: int, prompt: str | None, truncate: bool) -> int:
    """The tokens to ask of the daemon for num_predict `n` with this prompt (None: a FIM request).

    Ollama fails no request for its num_predict: it cuts a prompt to the context and shifts the context while it
    generates. The daemon generates within one context, prompt included, and refuses what does not fit. So with
    `truncate` (Ollama's default) `n` is capped to keep the prompt: all of one that surely fits in half the context,
    else its last half-context (what Ollama's shift keeps), the answer ending `length` where the context is full, as
    Ollama's does with `shift: false`. A FIM request may have half the context whatever its prompt (the daemon's
    limit: the rest holds the code around the cursor). With `truncate: false`, an `n` past those limits for any
    prompt is refused, naming it (one too large for this prompt alone is the daemon's context_overflow)."""
    half = max_context // 2
    if prompt is None:
        limit = hard = half
        why = (f"is more than a fill-in-the-middle completion may have with this model: {half} tokens, half its "
               f"context (the rest holds the code around the cursor); ask for at most {half}")
    else:
        # Every token stands for at least one byte of the text, so a prompt of b bytes is at most b tokens.
        limit, hard = max_context - min(len(prompt.encode()), half), max_context - 1
        why = (f"leaves no room for the prompt in the model's context of {max_context} tokens, which the prompt and "
               f"the completion share; ask for fewer than {max_context} tokens less the prompt's")
    if truncate:
        return min(n, limit)
    if n > hard:
        raise s.InvalidRequest(f"options.num_predict: {n} {why}, or leave truncate on (the default) to have it capped "
                               "to what fits", "options.num_predict")
    return n


# -- responses --------------------------------------------------------------------------------------------------


def _figure(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def ollama_logprobs(frames: list[Token]) -> list[dict]:
    """token_figures as Ollama lists them."""
    return [{**_figure(t.text, t.logprob), "top_logprobs": [_figure(c.text, c.logprob) for c in t.top_logprobs]}
            for t in token_figures(frames)]


class OllamaRenderer(Renderer):
    """Newline-delimited JSON objects, the last with `done: true`, the counts, and durations in nanoseconds."""

    media_type = NDJSON

    def __init__(self, model: str, ignored: list[str], logprobs: bool = False):
        self.model = model  # echoed as the request named it, as Ollama does
        self.headers = ignored_header(ignored)
        self.every_token = self.logprobs = logprobs

    def _line(self, obj: dict) -> bytes:
        return msgspec.json.encode(obj) + b"\n"

    def _done(self, g: Generation, response: str) -> dict:
        d = g.done
        assert d is not None
        u, t = d.usage, d.timings
        return {"model": self.model, "created_at": _now(), "response": response, "done": True,
                "done_reason": "length" if d.finish_reason == "length" else "stop",
                "total_duration": _ns(time.perf_counter() - g.t0), "load_duration": _ns(g.loaded - g.t0),
                "prompt_eval_count": prompt_read(u), "prompt_eval_duration": _ns(t.prefill_ms / 1000),
                "eval_count": u.completion_tokens,
                "eval_duration": _ns(max(0.0, t.total_ms - t.queue_ms - t.prefill_ms) / 1000)}

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        line = {"model": self.model, "created_at": _now(), "response": text, "done": False}
        if self.logprobs and frame is not None:
            line["logprobs"] = ollama_logprobs([frame])
        return self._line(line)

    def final(self, g: Generation) -> bytes:
        return self._line(self._done(g, ""))

    def body(self, g: Generation) -> bytes:
        done = self._done(g, g.text)
        if self.logprobs:
            done["logprobs"] = ollama_logprobs(g.frames)
        return msgspec.json.encode(done)

    def load(self, reason: str = "load") -> dict:
        """Ollama's answer to an empty prompt: the model is loaded (here: the daemon answers), or with keep_alive 0
        unloaded (here: the daemon keeps it, which nothing a client sees tells apart)."""
        return {"model": self.model, "created_at": _now(), "response": "", "done": True, "done_reason": reason}

    def error_event(self, status: int, code: str, message: str) -> bytes:
        return self._line({"error": message})


def _details(st: StatusReply) -> dict:
    quant = st.quant or st.dtype
    return {"parent_model": "", "format": "safetensors", "family": "m31r", "families": ["m31r"],
            "parameter_size": "", "quantization_level": quant.upper()}


def _bundle_files(bundle: str) -> tuple[int, str]:
    """The bundle's size in bytes and when it last changed (0 and now when it cannot be read from here)."""
    try:
        files = [p.stat() for p in Path(bundle).iterdir() if p.is_file()]
    except OSError:
        return 0, _now()
    if not files:
        return 0, _now()
    changed = max(f.st_mtime for f in files)
    return sum(f.st_size for f in files), datetime.fromtimestamp(changed, UTC).isoformat().replace("+00:00", "Z")


# -- endpoints --------------------------------------------------------------------------------------------------


class Ollama:
    def __init__(self, svc: Service):
        self.svc = svc

    async def _client(self) -> Client:
        try:
            return await self.svc.upstream.get(self.svc.settings.request_timeout)
        except Unavailable as e:
            raise _Unavailable(str(e), e.retry_after) from None

    async def _status(self) -> StatusReply:
        st = await self.svc.upstream.status(wait=2.0, timeout=2.0)
        if st is None:
            raise _Unavailable(f"the daemon is unavailable: {self.svc.upstream.last_error}", 1)
        return st

    async def generate(self, request: Request) -> Response | Generation:
        svc = self.svc
        r: GenerateRequest = s.convert(without_nulls(s.parse(await request.body())), GenerateRequest)
        unload = keep_alive_is_zero(r.keep_alive)
        for name, why in REFUSED.items():
            if getattr(r, name):
                raise s.InvalidRequest(f"{name}: {why}", name)
        if r.top_logprobs and not r.logprobs:
            raise s.InvalidRequest("top_logprobs: it lists alternatives beside each token's log-probability, so it "
                                   "needs logprobs: true", "top_logprobs")
        opts, ignored = _options(r.options)
        cap = svc.settings.max_tokens_cap
        n = opts.num_predict
        if n is not None and n > cap:
            # Ollama refuses no num_predict, and plugins send large ones by default (Continue 4096, Twinny 512,
            # llama-coder 256): capped, as fit_num_predict caps one too long for the context; refused only where the
            # client asked for refusals over truncation.
            if not r.truncate:
                raise s.InvalidRequest(f"options.num_predict: {n} exceeds this server's cap of {cap} "
                                       "(m31r serve --max-tokens-cap): lower it, or leave truncate on (the default) to "
                                       "have it capped", "options.num_predict")
            n = cap
        sampling = svc.sampling(opts.temperature or 0.0, opts.top_k or 0, 1.0 if opts.top_p is None else opts.top_p)
        seed = opts.seed if opts.seed is not None and opts.seed >= 0 else None
        stop = [opts.stop] if isinstance(opts.stop, str) else list(opts.stop or [])
        prefix, suffix = r.prompt, r.suffix
        if suffix is None and (layout := fim_layout(r.prompt)) is not None:
            prefix, suffix = layout
        renderer = OllamaRenderer(r.model, ignored, r.logprobs)
        if suffix is None and not prefix:
            # Ollama loads the model and says so, or with keep_alive 0 unloads it: one JSON object, streamed or not
            # (routes.go answers both with c.JSON). With a suffix there is a cursor to complete at: served as FIM.
            check_model(await self._client(), r.model)
            return Response(msgspec.json.encode(renderer.load("unload" if unload else "load")), headers=dict(
                (k.decode(), v.decode()) for k, v in renderer.headers), media_type="application/json")

        def start(c: Client) -> Awaitable[Stream]:
            check_model(c, r.model)
            ctx = c.welcome.max_context
            # 0 is no limit, as in Ollama (its runner checks `numPredict > 0`), not an empty answer.
            max_tokens = n if n is not None and n > 0 else min(cap, ctx // 2)
            max_tokens = fit_num_predict(max_tokens, ctx, prefix if suffix is None else None, r.truncate)
            kw = dict(max_tokens=max_tokens, sampling=sampling, stop=stop, seed=seed,
                      logprobs=r.top_logprobs if r.logprobs else None)
            if suffix is not None:
                return c.fim(prefix, suffix, **kw)
            return c.generate(prefix, truncate=r.truncate, **kw)

        default = None if n is not None and n > 0 else (
            "the default, as none was given: the smaller of this server's cap and half the context")
        return Generation(svc, "/api/generate", start, renderer, r.stream,
                          Fields(max_tokens="options.num_predict", max_tokens_default=default))

    async def show(self, request: Request) -> Response:
        r: ShowRequest = s.convert(without_nulls(s.parse(await request.body())), ShowRequest)
        model = r.model or r.name
        if not model:
            raise s.InvalidRequest("model: required", "model")
        client = await self._client()
        check_model(client, model)
        st = await self._status()
        ctx = client.welcome.max_context
        _, modified = _bundle_files(st.bundle)
        body = {"license": "", "modelfile": f"# served by m31r from its bundle\nFROM {st.model}\n",
                "parameters": f"num_ctx {ctx}", "template": TEMPLATE, "details": _details(st),
                "model_info": {"general.architecture": "m31r", "m31r.context_length": ctx},
                "capabilities": ["completion", "insert"], "modified_at": modified}
        return Response(msgspec.json.encode(body), media_type="application/json")

    async def tags(self, request: Request) -> Response:
        st = await self._status()
        size, modified = _bundle_files(st.bundle)
        # Ollama's names have no "@version" (it marks a digest there): the listing leaves the daemon's id out.
        names = [n for n in model_names(st.model) if "@" not in n]
        models = [{"name": f"{name}:latest", "model": f"{name}:latest", "modified_at": modified, "size": size,
                   "digest": st.fingerprint, "details": _details(st)} for name in names]
        return Response(msgspec.json.encode({"models": models}), media_type="application/json")

    async def running(self, request: Request) -> Response:
        """Ollama's answer at `/` (GET and HEAD), word for word: the ollama CLI's heartbeat (`HEAD /`) wants a 200,
        and front ends that detect a local Ollama compare the text."""
        return PlainTextResponse(RUNNING)

    async def version(self, request: Request) -> Response:
        return Response(msgspec.json.encode({"version": OLLAMA_VERSION}), media_type="application/json")


class _Unavailable(Exception):
    """No daemon: 503 with Retry-After, in Ollama's error shape."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.message, self.retry_after = message, retry_after


async def _unavailable(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, _Unavailable)
    return error_response(503, exc.message, {"Retry-After": str(exc.retry_after)})


EXCEPTION_HANDLERS = {_Unavailable: _unavailable}


def routes(svc: Service, max_body: int) -> list[Route]:
    o = Ollama(svc)
    return [
        Route("/", o.running, methods=["GET"], max_body_size=max_body),  # (GET routes answer HEAD too)
        Route("/api/generate", o.generate, methods=["POST"], max_body_size=max_body),
        Route("/api/show", o.show, methods=["POST"], max_body_size=max_body),
        Route("/api/tags", o.tags, methods=["GET"], max_body_size=max_body),
        Route("/api/version", o.version, methods=["GET"], max_body_size=max_body),
    ]

"""Tabby's API on `m31r serve`, so that Tabby's editor plugins (tabby-agent, under Tabby's VS Code, IntelliJ and
Vim/Neovim extensions) use it as their Tabby server: their users switch by changing the endpoint.

What tabby-agent does (TabbyML/tabby `clients/tabby-agent/src`: `http/tabbyApiClient.ts`, `codeCompletion/index.ts`,
`codeCompletion/buildRequest.ts`, `codeCompletion/solution.ts`, `config/index.ts`):
- `GET /v1/health` (`POST` where GET is a 405) at start-up, every 30 s while unreachable or unauthorized, every
  minute once ready. Any 2xx is "ready"; 401/403 "unauthorized". It offers completion when `model` is set and chat
  when `chat_model` is (never here), and reads `version.git_describe` (it throws where `version` is absent) and
  `device` (its latency hint).
- `GET /v1beta/server_setting` when git_describe is Tabby 0.9.0 or later: `disable_client_side_telemetry: true`
  turns off the usage reports it otherwise sends to TabbyML.
- `POST /v1/completions` `{language, segments: {prefix, suffix, filepath, git_url, declarations,
  relevant_snippets_from_changed_files, relevant_snippets_from_recently_opened_files}, temperature}` (temperature
  only when the user asks for more choices: several requests at 0.8). It reads `id` and `choices[0].{index, text}`:
  the text inserted at the cursor (it computes replace ranges and scope limits itself). Errors: only the status
  (429 is its rate limit); Tabby answers them with no body.
- `POST /v1/events?select_kind=line` `{type, completion_id, choice_index, view_id, elapsed}`: telemetry, answered
  200 and dropped here (nothing is kept or sent anywhere).
- `Authorization: Bearer <token>` when its `[server] token` is set; a server without --token ignores it.

How a completion maps onto the daemon's Fim (as ollama.py and llamacpp.py do for theirs):
- prefix and suffix as they are; where either has "\\r\\n", the prompt is given "\\n" and the answer "\\r\\n", as Tabby
  does. The declarations, then the changed files' snippets, then the opened files' (Tabby's order of priority), the
  first MAX_SNIPPETS of them, are the Fim's `context`, best first.
- Greedy unless `temperature` is above 0 (Tabby's default is 0.1). At most 64 tokens (Tabby's max_decoding_tokens
  default), capped at --max-tokens-cap and the daemon's FIM limit (half the context).
- Stop words: Tabby's for Rust with `language: rust` (a blank line, a line comment or a top-level keyword at a line's
  start), matched in the completion (Tabby also matches them across the prompt's end); for any other language only
  the blank line (this is a Rust model: other languages' keyword lists are not carried).
- `filepath` (relative to the repository's root, or the workspace's) names the Fim's `document`, with `git_url` (the
  repository's remote, where there is one) so that two repositories' files of the same path are two documents: as
  for /fim's `path`, the daemon answers a newer request for the file in place of an older one still running (409
  `cancelled` for that one) and answers the user typing through a suggestion from it. The key has its own namespace
  (`tabby:`), so Tabby's requests never supersede the language server's or /fim's for the same file. Without
  `filepath` there is no document, and `git_url` (otherwise Tabby's repository search, which this server has not)
  is not used.
- `clipboard` is not used; unknown fields are ignored, as Tabby ignores them; both (and an unused `git_url`) are
  named in X-M31R-Ignored-Options. `mode: "next_edit_suggestion"` and `debug_options` are refused (400).
- Errors in the shape of /v1/completions' OpenAI errors (Tabby's have no body; tabby-agent reads the status). A busy
  daemon is a 503 with Retry-After, not Tabby's rate-limit 429: tabby-agent (`utils/error.ts`, `fetchCompletion`,
  `codeCompletion/index.ts` and `status.ts`) logs either as a failed request and checks /v1/health at once (200
  while the daemon is up: it stays ready), and a 429 also sets its "rateLimitExceeded" status, a warning ("Too Many
  Requests") in the editor's status bar until a completion next succeeds; a momentary busy daemon is better left
  unshown. (408 and 499 it counts as timeouts; 401 and 403 as unauthorized.)
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import re
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from m31r_http import schemas as s
from m31r_http.app import Fields, Generation, Renderer, Service, error_response, ignored_header
from m31r_protocol import Client, Stream
from m31r_protocol.limits import MAX_SNIPPETS
from m31r_protocol.messages import Snippet
from m31r_protocol.version import VERSION

TABBY_VERSION = "0.31.2"  # the Tabby release whose API this follows: tabby-agent gates features on it
MAX_TOKENS = 64  # Tabby's default max_decoding_tokens
BLANK_LINE = "\n\n"  # Tabby's stop words for every language begin with it
# Tabby's stop words for Rust (crates/tabby-common/assets/languages.toml): its line comment and top-level keywords.
RUST_STOPS = [BLANK_LINE, "\n//", *(f"\n{k}" for k in ("fn", "trait", "impl", "enum", "pub", "extern", "static",
                                                        "unsafe", "use"))]
MAX_KEY = 4096  # the longest document key kept as it is (/fim's `path` may be this long)
HONOURED = frozenset({"segments", "language", "temperature", "seed", "mode", "debug_options"})
SEGMENTS_HONOURED = frozenset({"prefix", "suffix", "filepath", "declarations", "relevant_snippets_from_changed_files",
                               "relevant_snippets_from_recently_opened_files"})  # (and git_url with a filepath)
DEVICES = {"mps": "metal"}  # torch's device names where Tabby's differ
ARCHES = {"amd64": "x86_64", "arm64": "aarch64"}  # Python's machine names where Rust's (Tabby's `arch`) differ
_LONE_LF = re.compile(r"(?<!\r)\n")


def tabby_fields(body: bytes) -> dict | None:
    """A /v1/completions body's fields when it is Tabby's (an object with `segments` and no `prompt`, which OpenAI's
    needs), else None."""
    if b"segments" not in body:  # an OpenAI request is not parsed twice (a key escaped as `\u0073egments`, which no
        return None  # client writes, is not seen)
    try:
        raw = s.parse(body)
    except s.InvalidRequest:
        return None  # (the OpenAI endpoint says what is wrong with it)
    return raw if isinstance(raw, dict) and "segments" in raw and "prompt" not in raw else None


def ignored_fields(raw: dict) -> list[str]:
    """The request's fields that change nothing here: unknown ones, and segments' not used (`segments.clipboard`;
    `segments.git_url` without a filepath, where it names no document)."""
    out = [k for k in raw if k not in HONOURED]
    seg = raw.get("segments")
    if isinstance(seg, dict):
        used = SEGMENTS_HONOURED | ({"git_url"} if seg.get("filepath") else set())
        out += [f"segments.{k}" for k in seg if k not in used and seg[k] is not None]
    return sorted(out)


def document(seg: s.TabbySegments) -> str:
    """The daemon's document key for the file being edited, "" where the request names none. Tabby's own namespace,
    so the language server's or /fim's requests for the file are not superseded by Tabby's; the repository's remote
    with the path, which is relative to the repository's root (JSON: no two pairs give one key). A key longer than
    /fim's longest `path` is hashed: the daemon keeps hundreds of keys, and neither field is bounded."""
    if not seg.filepath:
        return ""
    key = msgspec.json.encode([seg.git_url or "", seg.filepath])
    return f"tabby:{key.decode()}" if len(key) <= MAX_KEY else f"tabby:sha256:{hashlib.sha256(key).hexdigest()}"


def context(seg: s.TabbySegments, crlf: bool) -> list[Snippet]:
    """The segments' snippets in Tabby's order of priority (best first), the first MAX_SNIPPETS, as a Fim's context."""
    found = [*(seg.declarations or []), *(seg.relevant_snippets_from_changed_files or []),
             *(seg.relevant_snippets_from_recently_opened_files or [])][:MAX_SNIPPETS]
    return [Snippet(lf(d.body) if crlf else d.body, d.filepath) for d in found]


def lf(text: str) -> str:
    return text.replace("\r\n", "\n")


class TabbyRenderer(Renderer):
    """Tabby's answer: one JSON object holding the completion as its one choice (Tabby's completions never stream)."""

    live = False

    def __init__(self, crlf: bool, ignored: list[str]):
        self.id = f"cmpl-{uuid.uuid4()}"  # (Tabby's form; tabby-agent echoes it in its events)
        self.crlf = crlf
        self.headers = ignored_header(ignored)

    def body(self, g: Generation) -> bytes:
        text = _LONE_LF.sub("\r\n", g.text) if self.crlf else g.text
        return msgspec.json.encode(s.TabbyCompletionResponse(id=self.id, choices=[s.TabbyChoice(0, text)]))


async def completion(svc: Service, raw: dict) -> Generation:
    """POST /v1/completions with Tabby's request (its body parsed by tabby_fields): the daemon's Fim (module
    docstring), answered as Tabby answers."""
    r: s.TabbyCompletionRequest = s.convert(raw, s.TabbyCompletionRequest, s.TABBY_REFUSALS)
    seg = r.segments
    suffix = seg.suffix or ""
    crlf = "\r\n" in seg.prefix or "\r\n" in suffix
    prefix, suffix = (lf(seg.prefix), lf(suffix)) if crlf else (seg.prefix, suffix)
    snippets = context(seg, crlf)
    stop = RUST_STOPS if (r.language or "").lower() == "rust" else [BLANK_LINE]
    sampling = svc.sampling(r.temperature or 0.0)
    renderer = TabbyRenderer(crlf, ignored_fields(raw))
    doc = document(seg)

    def start(c: Client) -> Awaitable[Stream]:
        max_tokens = min(MAX_TOKENS, svc.settings.max_tokens_cap, c.welcome.max_context // 2)
        return c.fim(prefix, suffix, document=doc, max_tokens=max_tokens, sampling=sampling, stop=stop, seed=r.seed,
                     context=snippets)

    return Generation(svc, "/v1/completions", start, renderer, False, Fields("segments.prefix", truncate=None))


@functools.cache
def cpu() -> tuple[str, str, int]:
    """This machine's architecture (Rust's name for it, as Tabby reports it), CPU model and logical CPU count."""
    machine = platform.machine().lower()
    info = ""
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and value.strip():
                info = value.strip()
                break
    except OSError:
        pass
    return ARCHES.get(machine, machine), info or platform.processor() or "unknown", os.cpu_count() or 1


async def health(svc: Service, request: Request) -> Response:
    """GET or POST /v1/health: Tabby's health state, from the daemon's status; 503 while it does not answer."""
    st = await svc.upstream.status(wait=1.0, timeout=2.0)
    if st is None or svc.upstream.welcome is None:
        err = svc.upstream.last_error if not svc.upstream.connected else "the daemon did not answer in time"
        return error_response(503, "unavailable", err or "the daemon is unavailable", retry_after=1)
    device = st.device.split(":", 1)[0]
    device = DEVICES.get(device, device)
    arch, info, count = cpu()
    body = s.TabbyHealth(model=st.model, device=device, cuda_devices=[],
                         models=s.TabbyModels(s.TabbyModelHealth(s.TabbyLocalModel(st.model, device))),
                         arch=arch, cpu_info=info, cpu_count=count,
                         version=s.TabbyVersion("", "", "", f"v{TABBY_VERSION}-m31r-{VERSION}"))
    return Response(msgspec.json.encode(body), media_type="application/json")


async def server_setting(request: Request) -> Response:
    return Response(msgspec.json.encode(s.TabbyServerSetting(disable_client_side_telemetry=True)),
                    media_type="application/json")


async def events(request: Request) -> Response:
    """POST /v1/events: checked as Tabby checks it (400 for what it would refuse), then dropped."""
    s.decode(await request.body(), s.TabbyEvent)
    return Response(status_code=200)


def completions_endpoint(svc: Service) -> Callable[[Request], Awaitable[Generation]]:
    """/v1/completions: Tabby's requests to `completion`, all others to the OpenAI endpoint, unchanged."""

    async def endpoint(request: Request) -> Generation:
        body = await request.body()  # (kept by the request: the OpenAI endpoint reads it again)
        if (raw := tabby_fields(body)) is not None:
            return await completion(svc, raw)
        return await svc.openai_completions(request)

    return endpoint


def routes(svc: Service, max_body: int) -> list[Route]:
    async def health_endpoint(request: Request) -> Response:
        return await health(svc, request)

    return [
        Route("/v1/health", health_endpoint, methods=["GET", "POST"], max_body_size=max_body),
        Route("/v1beta/server_setting", server_setting, methods=["GET"], max_body_size=max_body),
        Route("/v1/events", events, methods=["POST"], max_body_size=max_body),
    ]

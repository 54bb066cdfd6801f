"""Mistral's Codestral fill-in-the-middle API, `POST /v1/fim/completions`, on `m31r serve`, so that editors written
for Codestral work against it unchanged: their users switch by pointing the API's base URL here.

What the clients send and read:
- Zed's edit predictions, provider "codestral" (zed-industries/zed `crates/codestral/src/codestral.rs`:
  fetch_completion, refresh; settings `edit_predictions.codestral.{api_url, model, max_tokens}`, defaults in
  `assets/settings/default.json`): POST `{api_url}/v1/fim/completions` `{model, prompt, suffix, max_tokens,
  temperature: 0.2, top_p: 1.0, stream: false}` (suffix left out when empty; max_tokens its setting, 150 by default,
  350 where unset; model `codestral-latest` by default), with `Authorization: Bearer <its Codestral API key>`; with no
  key it sends nothing. It reads `choices[0].message.content`, the text inserted at the cursor, and its struct needs
  `id`, `object`, `model`, `created`, `usage.{prompt_tokens, completion_tokens, total_tokens}` and each choice's
  `index`, `finish_reason`, `message.role`: one missing fails the answer. A non-2xx is logged with its body.
- Continue, provider "mistral" with `apiBase` (continuedev/continue `core/llm/llms/Mistral.ts`, `OpenAI.ts`
  _streamFim, `packages/openai-adapters/src/apis/OpenAI.ts` fimStream): POST `{apiBase}fim/completions` `{model,
  prompt, suffix, max_tokens, temperature, top_p, frequency_penalty, presence_penalty, stop, stream: true}` (those
  it has no value for left out; suffix "\\n" at the file's end), bearer and `x-api-key` headers. It reads each SSE
  chunk's `choices[0].delta.content` (appended as it is) and `id`, until `data: [DONE]`.
- minuet-ai.nvim, provider "codestral" (`lua/minuet/backends/codestral.lua`, `common.lua`; its `end_point`):
  `{model, stream, prompt, suffix, max_tokens, stop}`; reads `choices[1].message.content`, `.delta.content` streaming.

How it maps onto the daemon's Fim (as llamacpp.py and tabby.py do for theirs):
- prefix = prompt, suffix = suffix; a suffix left out is empty, still a Fim (Zed leaves it out where its excerpt ends
  at the cursor), whose prompt the daemon fits to the context.
- Greedy unless `temperature` is above 0, this project's rule. Mistral's default depends on the model; Zed always
  sends 0.2, so its predictions are sampled (each its own seed unless `random_seed` is sent).
- max_tokens is capped, not refused, at --max-tokens-cap and the daemon's FIM limit (half the context): the clients
  send their own (Zed 150 by default). Left out, it is that cap.
- `model` is not checked (there is one model, and the clients default to `codestral-latest`; in Continue the name
  also picks its Codestral prompt conventions); the answer names the daemon's model.
- Unknown fields, and those not honoured (`min_tokens`, Continue's penalties, Mistral's `metadata`), are ignored and
  named in X-M31R-Ignored-Options; Mistral refuses unknown fields (422), which here would only break clients.
- Answers in Mistral's shapes: a chat completion whose one choice's message is the completion; streamed, chunks
  whose `delta` holds the text (the first the role, the last `finish_reason` and `usage`), then `data: [DONE]`.
- Errors in Mistral's shape, `{"object": "error", "message", "type", "param", "code"}` (a body that does not fit is
  a 400, as on the other endpoints, where Mistral's own validation answers 422); mid-stream, a `data:` line of it.
  The guard's refusals made before routing (401, 403, a 413 for a body declared too large, a 408) have it too
  (security.error_body_for). The clients read only the status of an error.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable

import msgspec
from starlette.requests import Request
from starlette.routing import Route

from m31r_http import schemas as s
from m31r_http.app import Fields, Generation, Renderer, Service, finish_reason, ignored_header, usage_of
from m31r_http.security import codestral_error_body
from m31r_protocol import Client, Stream
from m31r_protocol.messages import Token

PATH = "/v1/fim/completions"
HONOURED = frozenset(s.CodestralRequest.__struct_fields__) - {"min_tokens"}


class CodestralRenderer(Renderer):
    """Mistral's answer: a chat completion, or `data: {...}` chat-completion chunks ending with `data: [DONE]`."""

    def __init__(self, ignored: list[str]):
        self.id = secrets.token_hex(16)  # (Mistral's ids are 32 hex digits)
        self.created = int(time.time())
        self.model = ""
        self.headers = ignored_header(ignored)

    def connected(self, client: Client) -> None:
        self.model = client.welcome.model

    def _event(self, delta: s.CodestralDelta, finish: s.OpenAIFinishReason | None = None,
               usage: s.OpenAIUsage | None = None) -> bytes:
        chunk = s.CodestralChunk(id=self.id, object="chat.completion.chunk", created=self.created, model=self.model,
                                 choices=[s.CodestralStreamChoice(0, delta, finish)], usage=usage)
        return b"data: " + msgspec.json.encode(chunk) + b"\n\n"

    def prelude(self) -> bytes:
        return self._event(s.CodestralDelta(role="assistant", content=""))

    def chunk(self, text: str, frame: Token | None = None) -> bytes:
        return self._event(s.CodestralDelta(content=text))

    def final(self, g: Generation) -> bytes:
        return self._event(s.CodestralDelta(content=""), finish_reason(g), usage_of(g)) + b"data: [DONE]\n\n"

    def body(self, g: Generation) -> bytes:
        choice = s.CodestralChoice(0, s.CodestralMessage("assistant", g.text), finish_reason(g))
        return msgspec.json.encode(s.CodestralResponse(id=self.id, object="chat.completion", model=self.model,
                                                       usage=usage_of(g), created=self.created, choices=[choice]))

    def error_event(self, status: int, code: str, message: str) -> bytes:
        return b"data: " + codestral_error_body(status, code, message) + b"\n\n"


async def fim_completions(svc: Service, request: Request) -> Generation:
    """POST /v1/fim/completions: the request as the daemon's Fim (module docstring), answered as Mistral answers."""
    body = await request.body()
    raw = s.parse(body)
    r: s.CodestralRequest = s.convert(raw, s.CodestralRequest)  # (refused in Mistral's shape: app.invalid_request)
    renderer = CodestralRenderer(sorted(k for k, v in raw.items() if k not in HONOURED and v is not None))
    sampling = svc.sampling(r.temperature or 0.0, 0, 1.0 if r.top_p is None else r.top_p)
    stop = [r.stop] if isinstance(r.stop, str) else list(r.stop or [])

    def start(c: Client) -> Awaitable[Stream]:
        limit = min(svc.settings.max_tokens_cap, c.welcome.max_context // 2)
        max_tokens = limit if r.max_tokens is None else min(r.max_tokens, limit)
        return c.fim(r.prompt, r.suffix or "", max_tokens=max_tokens, sampling=sampling, stop=stop,
                     seed=r.random_seed)

    return Generation(svc, PATH, start, renderer, bool(r.stream), Fields(truncate=None))


def routes(svc: Service, max_body: int) -> list[Route]:
    async def endpoint(request: Request) -> Generation:
        return await fim_completions(svc, request)

    return [Route(PATH, endpoint, methods=["POST"], max_body_size=max_body)]

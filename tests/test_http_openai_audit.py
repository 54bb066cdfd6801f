"""`/v1/completions` against what OpenAI's own API takes, for the values its clients send that this server refused:
OpenAI's OpenAPI document (openai/openai-openapi, openapi.yaml: CreateCompletionRequest, ChatCompletionStreamOptions)
and the `openai` SDKs built from it (openai-python's completion_create_params.py types every one of these).

Each request is the JSON the SDK writes for it (its params as given, None as null), sent to the real server in front
of the shared real daemon, and each answer is checked for what the SDK's parser reads. The SDK itself is not needed.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from test_http import Server, healthy_server, sse_events

pytestmark = pytest.mark.timeout(120)

INT64 = 2**63  # OpenAI's `seed` is an int64: -2**63 to 2**63 - 1


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory) -> Iterator[Server]:
    yield from healthy_server(tmp_path_factory, "openai-audit", shared_daemon[1])


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def complete(http: httpx.Client, **body: object) -> dict:
    """A non-streamed completion that must succeed, checked for the fields openai's Completion model reads."""
    r = http.post("/v1/completions", json={"model": "m31r", "max_tokens": 6, **body})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and isinstance(out["created"], int) and out["id"]
    [choice] = out["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length") and "logprobs" in choice
    u = out["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    return out


def test_stream_options_include_obfuscation_false(http):
    """openai's stream_options type has `include_obfuscation` beside `include_usage` (false: no random padding field
    on the chunks, which this server never adds): a stream asking for that was refused as an unknown field."""
    body = {"model": "m31r", "prompt": "fn main() {", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "include_obfuscation": False}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert all(e is None for e, _ in events) and events[-1][1] == "[DONE]"
    chunks = [json.loads(d) for _, d in events[:-1]]
    *text_chunks, last = chunks
    # As the spec says: every chunk has `usage` null but the last before [DONE], whose `choices` is empty.
    assert last["choices"] == [] and last["usage"]["completion_tokens"] <= 6
    assert all(c["usage"] is None and len(c["choices"]) == 1 for c in text_chunks)
    whole = complete(http, prompt="fn main() {")
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == whole["choices"][0]["text"]
    assert last["usage"] == whole["usage"]


def test_stream_options_include_obfuscation_true_is_refused(http):
    """Padding the stream is not done here: asked for, it is refused naming the field, not ignored."""
    body = {"prompt": "fn", "stream": True, "stream_options": {"include_obfuscation": True}}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "stream_options.include_obfuscation" and err["type"] == "invalid_request_error"
    assert "include_obfuscation" in err["message"] and set(err) == {"message", "type", "param", "code"}


def test_top_p_zero(http):
    """OpenAI's top_p runs 0 to 1, 0 included: at 0 only the likeliest token is left, as greedy decoding keeps."""
    prompt = "fn add(a: u32, b: u32) -> u32 {"
    greedy = complete(http, prompt=prompt, temperature=0)
    for temperature in (None, 1.0):
        nucleus = complete(http, prompt=prompt, temperature=temperature, top_p=0, seed=7)
        assert nucleus["choices"][0]["text"] == greedy["choices"][0]["text"]
    r = http.post("/v1/completions", json={"prompt": "fn", "top_p": -0.1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"


def test_negative_seed(http):
    """OpenAI's seed is any int64, negative ones included: the daemon takes it as its 64 bits, so a negative seed
    samples reproducibly like any other."""
    body = {"prompt": "fn main() {", "temperature": 1.5, "max_tokens": 12}
    for seed in (-1, -INT64, INT64 - 1):
        first = complete(http, **body, seed=seed)["choices"][0]["text"]
        assert complete(http, **body, seed=seed)["choices"][0]["text"] == first
    for seed in (-INT64 - 1, INT64):
        r = http.post("/v1/completions", json={**body, "seed": seed})
        assert r.status_code == 400 and r.json()["error"]["param"] == "seed", r.text


def test_prompt_null(http):
    """OpenAI's prompt is nullable, `<|endoftext|>` by default: no prompt is the start of a new document, which is
    what an empty prompt is here (the SDK sends `prompt=None` as null)."""
    empty = complete(http, prompt="")
    assert complete(http, prompt=None)["choices"][0]["text"] == empty["choices"][0]["text"]
    echo = complete(http, prompt=None, echo=True)
    assert echo["choices"][0]["text"] == empty["choices"][0]["text"]
    r = http.post("/v1/completions", json={"model": "m31r", "max_tokens": 2})  # required, as OpenAI's
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"

"""Mistral's Codestral FIM API (`POST /v1/fim/completions`) on `m31r serve`, for the editors that speak it: requests
built field for field as Zed's edit predictions build them (zed-industries/zed `crates/codestral/src/codestral.rs`:
CodestralRequest, fetch_completion) and as Continue's "mistral" provider does (continuedev/continue
`packages/openai-adapters/src/apis/OpenAI.ts` fimStream, `core/llm/llms/OpenAI.ts` _streamFim; its Codestral
template's stop words), against a real server in front of a real daemon on the tiny random-weight bundle.

A random-weight model writes noise, so answers are compared with /fim's for the same request (greedy, or sampled with
the same seed: the same input gives the same text). What reaches the daemon is checked on a protocol-speaking stand-in
that records it (test_llamacpp_api's WritingDaemon), still through the real server.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest
from test_http import Server, healthy_server, token_server
from test_llamacpp_api import WritingDaemon

from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

CAP = 48  # the server's --max-tokens-cap: Zed's 150 and Continue's max_tokens are capped to it
PREFIX = "use std::fmt;\n\nfn main() {\n    let total = add(1, 2);\n    println!("
SUFFIX = ");\n}\n"
# Continue's Codestral template (core/autocomplete/templating/AutocompleteTemplate.ts, codestralMultifileFimTemplate)
# lays other files in the prefix, each after a `+++++ path` line; its stop words, then getStopTokens' common ones.
CONTINUE_PREFIX = "+++++ src/lib.rs \npub fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n\n+++++ src/main.rs\n" + PREFIX
CONTINUE_STOP = ["[PREFIX]", "[SUFFIX]", "\n+++++ ", "/src/", "#- coding: utf-8", "```"]
ZED_KEYS = {"id", "object", "model", "usage", "created", "choices"}  # Zed's CodestralResponse: every one required


def zed_request(prompt: str = PREFIX, suffix: str = SUFFIX, max_tokens: int | None = None) -> dict:
    """Zed's CodestralRequest as serde writes it: None fields left out (suffix when empty; stop, random_seed and
    min_tokens always); max_tokens its `edit_predictions.codestral.max_tokens` setting (150 in Zed's default settings,
    350 where unset); temperature 0.2 and top_p 1.0 always; the model its setting (codestral-latest by default)."""
    body: dict = {"model": "codestral-latest", "prompt": prompt}
    if suffix:
        body["suffix"] = suffix
    return {**body, "max_tokens": 150 if max_tokens is None else max_tokens, "temperature": 0.2, "top_p": 1.0,
            "stream": False}


def continue_request(**options: object) -> dict:
    """Continue's fimStream body, JSON.stringify'd: what it has no value for (undefined) left out, here temperature,
    top_p and the penalties unless the model's completionOptions set them; max_tokens its completionOptions'."""
    return {"model": "codestral-latest", "prompt": CONTINUE_PREFIX, "suffix": SUFFIX, "max_tokens": 4096,
            **options, "stop": CONTINUE_STOP, "stream": True}


# Zed's and Continue's headers: a bearer token (Continue adds x-api-key too).
ZED_HEADERS = {"content-type": "application/json", "authorization": "Bearer zed-key"}
CONTINUE_HEADERS = {"accept": "application/json", "x-api-key": "continue-key", "authorization": "Bearer continue-key"}


def events(r: httpx.Response) -> list[str]:
    """A stream's `data:` payloads, as Continue's streamSse reads them."""
    assert r.headers["content-type"].startswith("text/event-stream"), r.text
    return [line[len("data: "):] for line in r.text.split("\n\n") if line.startswith("data: ")]


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "codestral", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def test_zed_edit_prediction(http, tiny_bundle):
    """Zed's request, field for field: answered with every field Zed's CodestralResponse requires, the completion
    as the one choice's message; with a seed, /fim's text for the same sampled request (Zed's 0.2), capped at CAP."""
    r = http.post("/v1/fim/completions", json=zed_request(), headers=ZED_HEADERS)
    assert r.status_code == 200, r.text
    a = r.json()
    assert set(a) == ZED_KEYS and a["object"] == "chat.completion" and a["model"] == tiny_bundle.model_id
    assert re.fullmatch(r"[0-9a-f]{32}", a["id"]) and isinstance(a["created"], int) and a["created"] > 0
    [choice] = a["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    u = a["usage"]
    assert 0 < u["completion_tokens"] <= CAP and u["prompt_tokens"] > 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert "x-m31r-ignored-options" not in r.headers
    seeded = http.post("/v1/fim/completions", json={**zed_request(), "random_seed": 3}, headers=ZED_HEADERS).json()
    whole = http.post("/fim", json={"prefix": PREFIX, "suffix": SUFFIX, "temperature": 0.2, "top_p": 1.0,
                                    "seed": 3, "max_tokens": CAP}).json()
    assert seeded["choices"][0]["message"]["content"] == whole["text"]
    assert seeded["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    # the cursor at the excerpt's end: no suffix sent
    r = http.post("/v1/fim/completions", json=zed_request(suffix=""), headers=ZED_HEADERS)
    assert r.status_code == 200 and set(r.json()) == ZED_KEYS, r.text


def test_continue_autocomplete_streams(http, tiny_bundle):
    """Continue's request (stream: true, no temperature: greedy): Mistral's chat-completion chunks, each with a
    `delta.content` string (Continue appends it as it is), the first the role, the last finish_reason and usage, one
    id throughout, then `data: [DONE]`; their text is /fim's for the same prompt, stop words and cap."""
    r = http.post("/v1/fim/completions", json=continue_request(), headers=CONTINUE_HEADERS)
    assert r.status_code == 200, r.text
    *chunks, done = events(r)
    assert done == "[DONE]" and len(chunks) >= 2
    chunks = [json.loads(c) for c in chunks]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]} and {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert {c["model"] for c in chunks} == {tiny_bundle.model_id}
    assert chunks[0]["choices"] == [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]
    for c in chunks[1:-1]:
        [choice] = c["choices"]
        assert choice["finish_reason"] is None and set(choice["delta"]) == {"content"} and "usage" not in c
    [last] = chunks[-1]["choices"]
    assert last["delta"] == {"content": ""} and last["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"]["content"] for c in chunks)
    whole = http.post("/fim", json={"prefix": CONTINUE_PREFIX, "suffix": SUFFIX, "stop": CONTINUE_STOP,
                                    "max_tokens": CAP}).json()
    assert text == whole["text"] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert "x-m31r-ignored-options" not in r.headers
    # completionOptions with penalties: ignored, and said so
    r = http.post("/v1/fim/completions", json=continue_request(frequency_penalty=0.5, presence_penalty=0),
                  headers=CONTINUE_HEADERS)
    assert r.status_code == 200 and events(r)[-1] == "[DONE]"
    assert r.headers["x-m31r-ignored-options"] == "frequency_penalty, presence_penalty"


@pytest.mark.parametrize(("body", "param"), [
    ({"model": "codestral-latest", "suffix": SUFFIX}, "prompt"),
    ({**zed_request(), "temperature": 5}, "temperature"),
    ({**zed_request(), "max_tokens": -1}, "max_tokens"),
    ({**zed_request(), "stop": [1]}, "stop[0]"),
    ({**zed_request(), "stream": True, "random_seed": -4}, "random_seed"),
])
def test_errors_have_mistrals_shape(http, body, param):
    r = http.post("/v1/fim/completions", json=body)
    err = r.json()
    assert r.status_code == 400 and set(err) == {"object", "message", "type", "param", "code"}, r.text
    assert err["object"] == "error" and err["type"] == "invalid_request_error" and err["param"] == param
    assert err["code"] == "invalid" and param in err["message"]
    r = http.post("/v1/fim/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == "bad_json"


def test_metrics_and_openapi(http):
    http.post("/v1/fim/completions", json=zed_request(max_tokens=1))
    metrics = http.get("/metrics").text
    assert re.search(r'm31r_http_requests_total\{endpoint="/v1/fim/completions",status="200"\} [1-9]', metrics)
    doc = http.get("/openapi.json").json()
    assert "/v1/fim/completions" in doc["paths"]
    assert {"CodestralRequest", "CodestralResponse", "CodestralChunk", "CodestralError"} <= set(
        doc["components"]["schemas"])


def test_token_and_host(shared_daemon, tmp_path):
    """The editors' API key, sent as a bearer token, is the server's --token-file token (any key passes a server
    without one); the Host check holds. These refusals come before routing, in Mistral's shape all the same."""
    with token_server(tmp_path, shared_daemon[1]) as srv:
        url = f"{srv.url}/v1/fim/completions"
        r = httpx.post(url, json=zed_request(max_tokens=1), headers=ZED_HEADERS, timeout=30)
        assert r.status_code == 401 and r.json() == {
            "object": "error", "message": "the bearer token is not this server's (its --token-file)",
            "type": "invalid_request_error", "param": None, "code": "unauthorized"}
        r = httpx.post(url, json=zed_request(max_tokens=1), headers={"authorization": "Bearer s3cret"}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1, r.text
        r = httpx.post(url, json=zed_request(max_tokens=1),
                       headers={"authorization": "Bearer s3cret", "host": "evil.example"}, timeout=30)
        assert r.status_code == 403 and r.json()["object"] == "error" and r.json()["code"] == "forbidden_host"


def test_no_daemon_is_a_503(tmp_path):
    """No daemon: a 503 with Retry-After, in Mistral's shape, streaming or not (a stream's status waits for the
    daemon)."""
    srv = Server(tmp_path, tmp_path / "none.sock")  # --no-autostart, and nothing listens there
    try:
        for body in (zed_request(), continue_request()):
            r = httpx.post(f"{srv.url}/v1/fim/completions", json=body, timeout=30)
            err = r.json()
            assert r.status_code == 503 and "retry-after" in r.headers, r.text
            assert err["object"] == "error" and err["code"] == "unavailable" and "daemon" in err["message"]
            assert err["type"] == "server_error"
    finally:
        srv.stop()


# -- what reaches the daemon, on scripted tokens --------------------------------------------------------------------


PIECES = ["let x = 1;", "\n", "    x"]


@pytest.fixture
def recording(tmp_path):
    daemon = WritingDaemon(tmp_path / "w.sock", PIECES)
    srv = Server(tmp_path, daemon.path)  # (the default cap, 512: the daemon's FIM limit, 256, is what caps)
    try:
        yield srv, daemon
    finally:
        srv.stop()
        daemon.close()


def sent_fims(daemon: WritingDaemon) -> list[pm.Fim]:
    return [m for m in daemon.received if isinstance(m, pm.Fim)]


def test_what_reaches_the_daemon(recording):
    """Zed's request: prompt and suffix as they are, sampled at Zed's 0.2 with top_p 1, its 150 tokens, no stop words,
    no seed; where unset, its 350 are capped at the daemon's FIM limit (half of 512). Continue's: greedy (no
    temperature sent), its stop words, its max_tokens capped. A stop string is one stop word; min_tokens is ignored
    and said so; the model name is not checked."""
    srv, daemon = recording
    url = f"{srv.url}/v1/fim/completions"
    r = httpx.post(url, json=zed_request(), headers=ZED_HEADERS, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "let x = 1;\n    x", r.text
    assert r.json()["model"] == "scripted" and r.json()["usage"] == {"prompt_tokens": 9, "completion_tokens": 3,
                                                                      "total_tokens": 12}
    r = httpx.post(url, json=continue_request(), headers=CONTINUE_HEADERS, timeout=30)
    text = "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in events(r)[:-1])
    assert r.status_code == 200 and text == "let x = 1;\n    x"
    r = httpx.post(url, json={"model": "anything", "prompt": "fn", "stop": "\n", "min_tokens": 2,
                              "random_seed": 11, "max_tokens": 5}, timeout=30)
    assert r.status_code == 200 and r.headers["x-m31r-ignored-options"] == "min_tokens", r.text
    assert httpx.post(url, json=zed_request(max_tokens=350), timeout=30).status_code == 200
    zed, cont, plain, unset = sent_fims(daemon)
    assert (zed.prefix, zed.suffix, zed.max_tokens, zed.stop, zed.seed) == (PREFIX, SUFFIX, 150, [], None)
    assert unset.max_tokens == 256
    assert (zed.sampling.temperature, zed.sampling.top_p) == (pytest.approx(0.2), 1.0)
    assert (cont.prefix, cont.suffix, cont.max_tokens, cont.stop) == (CONTINUE_PREFIX, SUFFIX, 256, CONTINUE_STOP)
    assert cont.sampling.temperature == 0
    assert (plain.prefix, plain.suffix, plain.max_tokens, plain.stop, plain.seed) == ("fn", "", 5, ["\n"], 11)

"""llama.cpp server's own `POST /completion` request on `m31r serve`'s /completion (whose own request is M31R's
editor-policy one), for clients written for llama.cpp's server: Continue's llama.cpp provider (core/llm/llms/
LlamaCpp.ts: `{prompt, stream: true, n_predict, stop, temperature, ...}`, the prompt laid out in a FIM template by
Continue itself), and plain-text clients. A real server in front of the shared real daemon on the tiny random-weight
bundle: answers are compared with /fim's and /generate's for the same input (greedy: the same text).
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_http import Server, healthy_server

pytestmark = pytest.mark.timeout(120)

CAP = 500  # --max-tokens-cap: above half the tiny model's context (512), so the context's caps are the ones seen
HALF_CONTEXT = 256
PREFIX = "fn main() {\n    let total = add(1, 2);\n    println!("
SUFFIX = ");\n}\n"
# Continue's default template (stableCodeFimTemplate, for a model it has no template of its own for) and its stops.
CONTINUE_PROMPT = f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
CONTINUE_STOPS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>", "</fim_middle>",
                  "</code>"]


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "llamacpp_completion", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def events(text: str) -> list[dict]:
    return [json.loads(e.removeprefix("data: ")) for e in text.split("\n\n") if e]


def test_continues_fim_prompt_is_a_fim(http):
    """Continue's request, field for field (JSON.stringify leaves out its undefined options): streamed as llama.cpp
    streams (`data:` lines, the last `stop: true` with the answer's fields, no [DONE]); the FIM layout is split back
    into the prefix and suffix it was built from (the same prompt tokens and, greedy, the same text as /fim's); its
    4096 is capped at half the context, the daemon's FIM limit."""
    body = {"prompt": CONTINUE_PROMPT, "stream": True, "n_predict": 4096, "stop": CONTINUE_STOPS, "temperature": 0,
            "cache_prompt": True, "min_p": 0.05}
    r = http.post("/completion", json=body, headers={"authorization": "Bearer undefined"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    *chunks, last = events(r.text)
    assert chunks and all(e["stop"] is False for e in chunks) and last["stop"] is True and last["content"] == ""
    assert r.headers["x-m31r-ignored-options"] == "min_p"  # (cache_prompt's effect is had anyway)
    whole = http.post("/fim", json={"prefix": PREFIX, "suffix": SUFFIX, "max_tokens": HALF_CONTEXT,
                                    "stop": CONTINUE_STOPS}).json()
    assert "".join(e["content"] for e in chunks) == whole["text"]
    assert last["tokens_evaluated"] == whole["usage"]["prompt_tokens"] + whole["usage"]["healed_tokens"]
    assert last["prompt"] == CONTINUE_PROMPT
    assert last["generation_settings"]["n_predict"] == HALF_CONTEXT and last["generation_settings"]["n_ctx"] == 512
    assert last["stop_type"] == ("limit" if whole["finish_reason"] == "length" else "eos")
    a = http.post("/completion", json={**body, "stream": False}).json()  # the whole answer: the same
    assert a["content"] == whole["text"] and a["tokens_predicted"] == last["tokens_predicted"] and a["stop"] is True


def test_plain_text_is_continued(http):
    """A prompt in no FIM layout is continued, as /generate continues it; n_predict as llama.cpp reads it: a figure
    (the answer `limit` where it ended it), negative for the server's cap, 0 for a prefill that writes nothing."""
    prompt = "fn add(a: u32, b: u32) -> u32 {\n"
    gen = http.post("/generate", json={"prompt": prompt, "max_tokens": 8}).json()
    a = http.post("/completion", json={"prompt": prompt, "n_predict": 8}).json()
    assert a["content"] == gen["text"], (a, gen)
    assert a["tokens_evaluated"] == gen["usage"]["prompt_tokens"] + gen["usage"]["healed_tokens"], (a, gen)
    assert a["prompt"] == prompt and a["model"] and a["generation_settings"]["n_predict"] == 8
    assert a["stop_type"] == ("limit" if gen["finish_reason"] == "length" else "eos")
    assert http.post("/completion", json={"prompt": [prompt], "n_predict": 8}).json()["content"] == gen["text"]
    a = http.post("/completion", json={"prompt": prompt, "n_predict": -1}).json()
    # (capped to the room beside the prompt: each token stands for at least one of its bytes)
    assert a["generation_settings"]["n_predict"] == min(CAP, 512 - len(prompt.encode()))
    a = http.post("/completion", json={"prompt": prompt, "n_predict": 0}).json()
    assert a["content"] == "" and a["tokens_predicted"] == 0 and a["tokens_evaluated"] > 0


def test_a_long_prompt_with_no_limit_is_answered(http):
    """A prompt of ~300 tokens with llama.cpp's n_predict -1 (no limit): the server's cap, 500, does not fit beside
    it in the context of 512. Capped to what keeps the prompt's end, as llama.cpp stops where its context is full:
    an answer, not a context overflow."""
    prompt = "fn a() {}\n" * 30
    a = http.post("/completion", json={"prompt": prompt, "n_predict": -1})
    assert a.status_code == 200, a.text
    a = a.json()
    assert a["tokens_evaluated"] + a["generation_settings"]["n_predict"] <= 512 and a["tokens_predicted"] > 0


def test_a_stop_word_is_named(http):
    """A stop the request gave that ended the answer is stop_type "word", named in stopping_word."""
    prompt = "fn main() {\n"
    whole = http.post("/generate", json={"prompt": prompt, "max_tokens": 32}).json()["text"]
    assert len(whole) >= 3, whole
    stop = whole[1:3]
    a = http.post("/completion", json={"prompt": prompt, "n_predict": 32, "stop": ["\u2603", stop]}).json()
    assert (a["content"], a["stop_type"], a["stopping_word"]) == (whole[: whole.index(stop)], "word", stop), a


def test_the_editor_policy_request_is_unchanged(http):
    """This server's own request is still served as before, its errors in its own shape."""
    a = http.post("/completion", json={"prefix": PREFIX, "suffix": SUFFIX}).json()
    assert {"text", "start", "end", "multiline"} <= set(a) and "content" not in a
    err = http.post("/completion", json={"suffix": SUFFIX}).json()["error"]
    assert err["param"] == "prefix" and err["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "words"), [
    ({"prompt": [12, 34, 56]}, "token ids are not supported"),
    ({"prompt": [12, "fn", 56]}, "token ids are not supported"),
    ({"prompt": ["fn a", "fn b"]}, "a list of 2 prompts is not supported"),
    ({"prompt": {"prompt_string": "fn", "multimodal_data": []}}, "object prompt"),
    ({"prompt": "fn", "n_predict": "many"}, "n_predict"),
    ({"prompt": "fn", "stop": ["a"] * 33}, "stop"),
    ({"prompt": None}, "prompt"),
])
def test_llamacpps_request_is_refused_in_its_shape(http, body, words):
    r = http.post("/completion", json=body)
    assert r.status_code == 400 and r.json() == {"error": {"code": 400, "type": "invalid_request_error",
                                                           "message": r.json()["error"]["message"]}}, r.text
    assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("mixed", [{"prefix": "fn"}, {"suffix": "}"}, {"prefix": "fn", "suffix": "}"}])
def test_a_body_mixing_both_requests_is_a_400(http, mixed):
    err = http.post("/completion", json={"prompt": "fn", **mixed}).json()["error"]
    assert err["param"] == "prompt" and "mixing both" in err["message"] and all(k in err["message"] for k in mixed)


def test_openapi(http):
    """The document says which requests /completion takes (test_http's schemathesis test checks the server
    against it)."""
    op = http.get("/openapi.json").json()["paths"]["/completion"]["post"]
    refs = [s["$ref"] for s in op["requestBody"]["content"]["application/json"]["schema"]["anyOf"]]
    assert refs == ["#/components/schemas/CompletionRequest", "#/components/schemas/LlamaCppCompletionRequest"]


def test_no_daemon_is_llamacpps_503(tmp_path):
    """An error the daemon's absence causes, once the request is known to be llama.cpp's, has llama.cpp's shape, as
    on /infill (streamed or not: the status comes before any event)."""
    srv = Server(tmp_path, tmp_path / "none.sock")  # --no-autostart, and nothing listens there
    try:
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/completion", json={"prompt": "fn", "stream": stream}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 503 and err["code"] == 503 and err["type"] == "unavailable_error", r.text
    finally:
        srv.stop()

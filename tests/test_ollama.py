"""Ollama's API on `m31r serve`, driven by the real `ollama` client from PyPI (what Ollama plugins' authors use
to test against Ollama), against a real server in front of a real daemon serving the tiny random-weight bundle.

A random-weight model writes noise, so answers are compared with the native endpoints' for the same request
(greedy: the same input gives the same text), not with expected text.
"""

from __future__ import annotations

import asyncio
import json
from datetime import datetime

import httpx
import ollama
import pytest
from test_http import Server, healthy_server

from m31r_protocol import Client

pytestmark = pytest.mark.timeout(120)

CAP = 64
PREFIX, SUFFIX = "fn add(a: u32, b: u32) -> u32 {\n    ", "\n}\n"


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "ollama", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=30)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def native(http: httpx.Client, **body) -> dict:
    """The same request through the native endpoints: /fim with a suffix, else /generate."""
    r = http.post("/fim" if "suffix" in body else "/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def check_final(part: ollama.GenerateResponse, max_tokens: int) -> None:
    assert part.done is True and part.done_reason in ("stop", "length")
    assert 0 < part.eval_count <= max_tokens and part.prompt_eval_count > 0
    # Nanoseconds, as Ollama reports them: a request on the tiny model takes between 0.1 ms and 60 s.
    assert 1e5 < part.total_duration < 60e9 and part.prompt_eval_duration > 0 and part.eval_duration > 0
    assert part.load_duration >= 0 and part.total_duration >= part.prompt_eval_duration + part.eval_duration
    datetime.fromisoformat(part.created_at.replace("Z", "+00:00"))


def test_version_tags_show(client, http, tiny_bundle):
    version = http.get("/api/version").json()["version"]
    assert tuple(map(int, version.split("."))) >= (0, 5, 0)
    name = tiny_bundle.model_id.split("@")[0]
    models = client.list().models
    assert [m.model for m in models] == [f"{name}:latest", "m31r:latest"]
    assert all(m.digest == tiny_bundle.fingerprint and m.size > 0 and m.details.format == "safetensors"
               for m in models)
    show = client.show("m31r")
    assert ".Suffix" in show.template and "insert" in show.capabilities  # Continue's test for FIM support
    assert show.parameters == "num_ctx 512" and show.modelinfo["m31r.context_length"] == 512
    with pytest.raises(ollama.ResponseError) as e:
        client.show("llama3")
    assert e.value.status_code == 404 and "not found" in e.value.error


@pytest.mark.parametrize("fim", [False, True])
def test_generate(client, http, fim):
    """Non-streaming and streaming, with and without `suffix`: the same text as the native endpoint."""
    kw = {"suffix": SUFFIX} if fim else {}
    expected = native(http, prefix=PREFIX, max_tokens=8, **kw) if fim else native(http, prompt=PREFIX, max_tokens=8)
    one = client.generate(model="m31r", prompt=PREFIX, options={"num_predict": 8}, **kw)
    assert one.model == "m31r" and one.response == expected["text"]
    check_final(one, 8)
    assert one.eval_count == expected["usage"]["completion_tokens"]
    assert one.prompt_eval_count == expected["usage"]["prompt_tokens"] + expected["usage"]["healed_tokens"]
    assert one.done_reason == ("length" if expected["finish_reason"] == "length" else "stop")

    parts = list(client.generate(model="m31r:latest", prompt=PREFIX, options={"num_predict": 8}, stream=True, **kw))
    assert len(parts) >= 3 and all(p.done is False and p.response for p in parts[:-1])
    assert parts[-1].response == "" and "".join(p.response for p in parts) == expected["text"]
    check_final(parts[-1], 8)
    assert parts[-1].eval_count == one.eval_count and parts[-1].done_reason == one.done_reason


def test_logprobs(client, http):
    """`logprobs: true` lists each token with its log-probability, UTF-8 bytes and `top_logprobs` alternatives, in a
    whole answer and on each streamed chunk (the ollama client reads them as its own types)."""
    one = client.generate(model="m31r", prompt=PREFIX, options={"num_predict": 8}, logprobs=True, top_logprobs=2)
    assert one.logprobs and "".join(t.token for t in one.logprobs) == one.response
    assert len(one.logprobs) == one.eval_count
    for t in one.logprobs:
        assert t.logprob <= 0 and 1 <= len(t.top_logprobs) <= 2
        assert t.top_logprobs[0].logprob >= t.top_logprobs[-1].logprob
    parts = list(client.generate(model="m31r", prompt=PREFIX, options={"num_predict": 8}, logprobs=True, stream=True))
    streamed = [t for p in parts for t in (p.logprobs or [])]
    assert [t.logprob for t in streamed] == [t.logprob for t in one.logprobs]
    assert all(t.top_logprobs == [] for t in streamed)  # top_logprobs 0: none listed
    body = {"model": "m31r", "prompt": PREFIX, "stream": False, "options": {"num_predict": 8}}
    raw = http.post("/api/generate", json={**body, "logprobs": True, "top_logprobs": 2}).json()["logprobs"]
    assert all(bytes(t["bytes"]) == t["token"].encode() for t in raw)  # (a field the ollama client leaves out)
    assert all(bytes(a["bytes"]) == a["token"].encode() for t in raw for a in t["top_logprobs"])
    plain = http.post("/api/generate", json=body).json()
    assert "logprobs" not in plain and plain["response"] == one.response


def test_stream_is_ndjson_by_default(http):
    with http.stream("POST", "/api/generate", json={"model": "m31r", "prompt": "fn", "options": {
            "num_predict": 4}}) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert [x["done"] for x in lines] == [False] * (len(lines) - 1) + [True]
    assert {"model", "created_at", "response", "done"} <= set(lines[0])


def test_options(client, http):
    # Sampling with a seed is reproducible and differs from greedy; top_k and top_p are honoured, not refused.
    opts = {"num_predict": 12, "temperature": 1.0, "seed": 5, "top_k": 50, "top_p": 0.95}
    a = client.generate(model="m31r", prompt="fn", options=opts).response
    assert a == client.generate(model="m31r", prompt="fn", options=opts).response
    assert a == native(http, prompt="fn", max_tokens=12, temperature=1.0, seed=5, top_k=50, top_p=0.95)["text"]
    # Stop sequences end the text before them.
    full = client.generate(model="m31r", prompt="fn", options={"num_predict": 12}).response
    assert len(full) >= 4
    cut = client.generate(model="m31r", prompt="fn", options={"num_predict": 12, "stop": [full[2:4]]})
    assert cut.response == full[: full.index(full[2:4])] and cut.done_reason == "stop"
    # Options this server does not implement are ignored, as Ollama ignores unknown ones, and named.
    r = http.post("/api/generate", json={"model": "m31r", "prompt": "fn", "stream": False, "options": {
        "num_predict": 12, "num_ctx": 4096, "repeat_penalty": 1.1, "mirostat": 0}})
    assert r.status_code == 200 and r.json()["response"] == full
    assert r.headers["x-m31r-ignored-options"] == "mirostat, num_ctx, repeat_penalty"
    # num_predict left out: generation runs on (here to the tiny model's stop or half its context, 256 > CAP).
    r = client.generate(model="m31r", prompt="fn")
    assert r.eval_count == CAP or r.done_reason == "stop"


@pytest.mark.parametrize("kw", [{}, {"suffix": SUFFIX}])
def test_num_predict_zero_is_no_limit(client, kw):
    """Ollama limits only a positive num_predict (its runner checks `numPredict > 0`; today's leaves a 0 out of
    llama-server's request): 0 runs on as the default does, rather than answering nothing."""
    default = client.generate(model="m31r", prompt=PREFIX, **kw)
    zero = client.generate(model="m31r", prompt=PREFIX, options={"num_predict": 0}, **kw)
    assert zero.eval_count > 0 and zero.eval_count == default.eval_count and zero.response == default.response


def test_integer_options_written_as_floats(http):
    """Ollama reads `options` untyped (every number a float64) and truncates one given to an integer option: `64.0`,
    as Python's json or Emacs write a float, or even `8.7`, is taken, not refused."""
    def answer(**opts: float) -> dict:
        r = http.post("/api/generate", json={"model": "m31r", "prompt": "fn", "stream": False, "options": {
            "temperature": 1.0, **opts}})
        assert r.status_code == 200, r.text
        return r.json()

    ints = answer(num_predict=8, top_k=50, seed=5)
    floats = answer(num_predict=8.0, top_k=50.0, seed=5.0)
    assert floats["response"] == ints["response"] and floats["eval_count"] == ints["eval_count"]
    assert answer(num_predict=8.7, top_k=50.2, seed=5.9)["response"] == ints["response"]


def test_ignored_option_names_that_a_header_cannot_carry(http):
    """An option's name is the client's to choose: one with a line break (or anything else a header cannot carry) is
    percent-encoded in X-M31R-Ignored-Options, streaming or not, instead of losing the whole response."""
    body = {"model": "m31r", "prompt": "fn main() {\n", "options": {"num_predict": 4, "bad\r\nx": 1, "é": 2,
                                                                    "num_ctx": 8, "a, b%": 3}}
    for stream in (False, True):
        r = http.post("/api/generate", json={**body, "stream": stream})
        assert r.status_code == 200, r.text
        assert r.headers["x-m31r-ignored-options"] == "a%2C%20b%25, bad%0D%0Ax, num_ctx, %C3%A9"
        assert json.loads(r.text.splitlines()[-1])["done"] is True


def test_streamed_logprobs_are_the_answers(http, shared_daemon):
    """Text held back and released at the end (the start of a stop sequence that did not come) joins the token before
    it in a stream's `logprobs`, as in a whole answer: the streamed tokens are the answer's."""
    async def frames() -> list:
        async with await Client.connect(shared_daemon[1]) as c:
            return [f async for f in await c.generate("x", max_tokens=3, stop=["xq"], logprobs=0)]

    assert asyncio.run(frames())[-1].token is None  # the case at hand: text released at the end, no token of its own
    body = {"model": "m31r", "prompt": "x", "logprobs": True, "options": {"num_predict": 3, "stop": ["xq"]}}
    whole = http.post("/api/generate", json={**body, "stream": False}).json()
    lines = [json.loads(line) for line in http.post("/api/generate", json=body).text.splitlines()]
    streamed = [t for line in lines for t in line.get("logprobs", [])]
    assert "".join(t["token"] for t in whole["logprobs"]) == whole["response"]
    assert streamed == whole["logprobs"]
    assert "".join(line["response"] for line in lines) == whole["response"]


def test_guard_errors_have_ollamas_shape_and_cors(shared_daemon, tmp_path):
    """What the guard refuses before routing (token, Host, Origin, declared size) has Ollama's error shape under
    /api/ and OpenAI's elsewhere, and an allowed origin's page can read it; it can read X-M31R-Ignored-Options too."""
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    origin = "http://localhost:5173"
    srv = Server(tmp_path, shared_daemon[1], "--token-file", str(token), "--cors-origin", origin,
                 "--max-body", "1024")
    auth = {"authorization": "Bearer s3cret"}
    try:
        srv.wait_healthy(**auth)
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=srv.url, timeout=30).generate(model="m31r", prompt="fn")
        assert e.value.status_code == 401 and e.value.error == "a bearer token is required"
        for headers, body, status, words in (
                ({"origin": origin}, {}, 401, "bearer token"),
                ({"origin": origin, **auth}, {"prompt": "x" * 2000}, 413, "exceeds this server's limit"),
                ({"origin": origin, "host": "evil.example", **auth}, {}, 403, "not a loopback name")):
            r = httpx.post(f"{srv.url}/api/generate", json={"model": "m31r", **body}, headers=headers)
            assert r.status_code == status and words in r.json()["error"], r.text
            assert r.headers["access-control-allow-origin"] == origin
            r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "x", **body}, headers=headers)
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
            assert r.headers["access-control-allow-origin"] == origin
        r = httpx.post(f"{srv.url}/api/generate", json={"model": "m31r"}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403 and "not allowed" in r.json()["error"]
        assert "access-control-allow-origin" not in r.headers
        r = httpx.post(f"{srv.url}/api/generate", headers={"origin": origin, **auth}, json={
            "model": "m31r", "prompt": "fn", "stream": False, "options": {"num_predict": 2, "num_ctx": 8}})
        assert r.status_code == 200 and r.headers["x-m31r-ignored-options"] == "num_ctx"
        exposed = {h.strip().lower() for h in r.headers["access-control-expose-headers"].split(",")}
        assert {"x-m31r-ignored-options", "retry-after"} <= exposed
    finally:
        srv.stop()


def test_fim_layouts_of_other_models(client, http):
    """llama-coder and Twinny lay out FIM prompts for the model they expect: served as real FIM requests."""
    expected = native(http, prefix=PREFIX, suffix=SUFFIX, max_tokens=8)["text"]
    for prompt in (f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>", f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>",
                   f"<｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>", f"[SUFFIX]{SUFFIX}[PREFIX]{PREFIX}"):
        r = client.generate(model="m31r", prompt=prompt, raw=True, options={"num_predict": 8, "stop": ["<EOT>"]})
        assert r.response == expected, prompt


def test_load_request(client):
    """An empty prompt is how Ollama clients load a model: answered at once."""
    r = client.generate(model="m31r")
    assert r.done is True and r.done_reason == "load" and r.response == ""


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"model": "llama3", "prompt": "fn"}, 404, 'model "llama3" not found'),
    ({"model": "m31r:7b", "prompt": "fn"}, 404, "not found"),
    ({"model": "llama3", "prompt": ""}, 404, "not found"),
    ({"prompt": "fn"}, 400, "model"),
    ({"model": "m31r", "prompt": "fn", "options": {"num_predict": -3}}, 400, "options.num_predict"),
    ({"model": "m31r", "prompt": "fn", "options": {"temperature": "hot"}}, 400, "options.temperature"),
    ({"model": "m31r", "prompt": "fn", "options": {"stop": [1]}}, 400, "options.stop"),
    ({"model": "m31r", "prompt": "fn", "system": "be brief"}, 400, "system"),
    ({"model": "m31r", "prompt": "fn", "images": ["aGk="]}, 400, "images"),
    ({"model": "m31r", "prompt": "fn", "format": "json"}, 400, "format"),
    ({"model": "m31r", "prompt": "fn", "think": True}, 400, "think"),
    ({"model": "m31r", "prompt": "fn", "context": [1, 2]}, 400, "context"),
    ({"model": "m31r", "prompt": "fn", "top_logprobs": 2}, 400, "needs logprobs: true"),
    ({"model": "m31r", "prompt": "fn", "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
])
def test_errors(client, http, body, status, words):
    """Errors have Ollama's shape ({"error": "..."}), which the client turns into a ResponseError."""
    for stream in (False, True):
        r = http.post("/api/generate", json={**body, "stream": stream})
        assert r.status_code == status and words in r.json()["error"], r.text
    if "model" in body:  # (the client itself refuses a request without one)
        with pytest.raises(ollama.ResponseError) as e:
            client.generate(**body)
        assert e.value.status_code == status and words in e.value.error


def test_bad_json_unknown_paths_deep_nesting(http):
    for raw in (b"{", b"[" * 5000 + b"]" * 5000, b'{"model": "m31r", "options": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        r = http.post("/api/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and isinstance(r.json()["error"], str), r.text[:200]
    r = http.post("/api/chat", json={})
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    assert http.get("/api/generate").status_code == 405


def test_a_number_past_a_float_names_its_option(http):
    """Not msgspec's `$[...][...]`, which names nothing."""
    r = http.post("/api/generate", content=b'{"model": "m31r", "prompt": "fn", "options": {"temperature": 1e999}}',
                  headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("options.temperature: the number is out of range")


def test_no_daemon_is_a_503(tmp_path):
    srv = Server(tmp_path, tmp_path / "none.sock")  # --no-autostart, and nothing listens there
    try:
        for method, path, body in (("GET", "/api/tags", None), ("POST", "/api/show", {"model": "m31r"}),
                                   ("POST", "/api/generate", {"model": "m31r", "prompt": "fn"})):
            r = httpx.request(method, f"{srv.url}{path}", json=body, timeout=30)
            assert r.status_code == 503 and "retry-after" in r.headers, (path, r.text)
            assert isinstance(r.json()["error"], str) and "daemon" in r.json()["error"]
        assert httpx.get(f"{srv.url}/api/version").status_code == 200  # needs no daemon
    finally:
        srv.stop()


# -- num_predict and the context ----------------------------------------------------------------------------------

LONG = "fn a() {}\n" * 120  # far more than half the tiny model's context (512 tokens)
MEDIUM = "fn a() {}\n" * 20  # some tens of tokens


@pytest.fixture(scope="module")
def wide(shared_daemon, tmp_path_factory):
    """A server whose --max-tokens-cap (1000) lets num_predict reach the tiny model's context (512) and past it."""
    srv = Server(tmp_path_factory.mktemp("wide"), shared_daemon[1], "--max-tokens-cap", "1000")
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


def test_an_overflow_with_the_default_num_predict_says_it_was_the_default(wide):
    """With `truncate: false` a prompt that leaves less room than the default num_predict (half the context) is the
    daemon's context_overflow: its message names the prompt's length, the limit and the default as such (the client
    sent no num_predict, so "options.num_predict (256)" alone puzzled), and how much num_predict fits."""
    prompt = "fn a() {}\n" * 30  # 300 bytes: about as many tokens (byte-level), so 256 more do not fit in 512
    for stream in (False, True):
        r = httpx.post(f"{wide.url}/api/generate", json={"model": "m31r", "prompt": prompt, "truncate": False,
                                                         "stream": stream}, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and isinstance(err, str), r.text
        assert ("+ options.num_predict (256, the default, as none was given: the smaller of this server's cap and "
                "half the context) = ") in err and "exceeds the model's context of 512 tokens" in err, err
        most = int(err.split("lower options.num_predict to at most ")[1].split(",")[0])
        ok = httpx.post(f"{wide.url}/api/generate", timeout=30, json={
            "model": "m31r", "prompt": prompt, "truncate": False, "stream": False, "options": {"num_predict": most}})
        assert ok.status_code == 200, ok.text  # the way out it names works


@pytest.mark.parametrize(("prompt", "suffix", "num_predict", "max_tokens"), [
    ("fn", None, 512, 510),  # a short prompt is kept whole: the rest of the context is generated
    ("fn", None, 1000, 510),
    (LONG, None, 512, 256),  # a long one keeps its last half-context
    (LONG, None, 300, 256),
    (PREFIX, SUFFIX, 512, 256),  # fill-in-the-middle: half the context, the daemon's limit
])
def test_num_predict_past_the_context_is_capped(wide, prompt, suffix, num_predict, max_tokens):
    """Ollama refuses no num_predict for its length (it shifts its context and goes on): with truncation on, the
    default, the tokens asked of the daemon are capped so that the prompt's end and the completion fit. The answer
    is the native endpoint's for that many tokens, streamed or not."""
    client = ollama.Client(host=wide.url, timeout=30)
    with httpx.Client(base_url=wide.url, timeout=30) as http:
        expected = (native(http, prefix=prompt, suffix=suffix, max_tokens=max_tokens) if suffix is not None
                    else native(http, prompt=prompt, max_tokens=max_tokens, truncate=True))
    kw = {"suffix": suffix} if suffix is not None else {}
    r = client.generate(model="m31r", prompt=prompt, options={"num_predict": num_predict}, **kw)
    assert r.response == expected["text"] and r.eval_count == expected["usage"]["completion_tokens"]
    assert r.prompt_eval_count == expected["usage"]["prompt_tokens"] + expected["usage"]["healed_tokens"]
    assert r.prompt_eval_count + r.eval_count <= 512
    assert r.done_reason == ("length" if expected["finish_reason"] == "length" else "stop")
    parts = list(client.generate(model="m31r", prompt=prompt, options={"num_predict": num_predict}, stream=True, **kw))
    assert "".join(p.response for p in parts) == r.response and parts[-1].eval_count == r.eval_count


@pytest.mark.parametrize(("body", "words"), [
    ({"prompt": "fn", "options": {"num_predict": 512}}, "options.num_predict: 512 leaves no room for the prompt in "
                                                        "the model's context of 512 tokens"),
    ({"prompt": "fn", "options": {"num_predict": 1000}}, "options.num_predict: 1000 leaves no room"),
    ({"prompt": PREFIX, "suffix": SUFFIX, "options": {"num_predict": 300}},
     "options.num_predict: 300 is more than a fill-in-the-middle completion may have with this model: 256 tokens"),
    ({"prompt": MEDIUM, "options": {"num_predict": 500}}, "options.num_predict"),  # the daemon's context_overflow
])
def test_num_predict_past_the_context_without_truncation_is_refused(wide, body, words):
    """With `truncate: false`, a num_predict that cannot fit is a 400 in Ollama's shape naming num_predict and the
    limit, and the way to have it capped."""
    for stream in (False, True):
        r = httpx.post(f"{wide.url}/api/generate", json={"model": "m31r", "truncate": False, "stream": stream, **body},
                       timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and words in err, r.text
        assert "leave truncate on" in err or body["prompt"] == MEDIUM  # (the daemon's overflow words its own way out)

"""`m31r serve` against the real servers' behaviour, session 42: Ollama's null fields and keep_alive matrix, OpenAI's
max_tokens past the server's cap, and an audit of disconnects, concurrent requests for one document and large bodies.

Real components throughout: a daemon of its own on the tiny random-weight bundle (prompt-lookup drafting off, so a
long answer takes one model call a token and a disconnect lands well inside it), `m31r serve` processes, httpx and
the `ollama` and `openai` clients. Where a test needs a request still running when the client acts, an answer that
finished first is inconclusive and the attempt is repeated; what is asserted is the daemon's own record (its log line
for the request, its status), never a duration.
"""

from __future__ import annotations

import json
import threading

import httpx
import ollama
import openai
import pytest
from daemon_util import start_daemon, stop_daemon
from test_http import daemon_status, healthy_server, sse_events, wait_for

pytestmark = pytest.mark.timeout(180)

CAP = 64  # the `small` server's --max-tokens-cap
WIDE = 500  # the `wide` server's: nearly the tiny model's whole context (512), for answers that run a while
PREFIX, SUFFIX = "fn add(a: u32, b: u32) -> u32 {\n    ", "\n}\n"


@pytest.fixture(scope="module")
def daemon(tiny_bundle, tmp_path_factory):
    """The module's daemon (a socket in a fresh folder, 0700 as the daemon makes it), stopped after."""
    sock = tmp_path_factory.mktemp("s42") / "run" / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--lookahead", "0")
    yield proc, sock
    stop_daemon(proc)


@pytest.fixture(scope="module")
def small(daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s42small", daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture(scope="module")
def wide(daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s42wide", daemon[1], "--max-tokens-cap", str(WIDE))


@pytest.fixture
def http(small):
    with httpx.Client(base_url=small.url, timeout=60) as c:
        yield c


def answer(http: httpx.Client, body: dict) -> dict:
    r = http.post("/api/generate", json={"stream": False, **body})
    assert r.status_code == 200, r.text
    return r.json()


# -- Ollama: a JSON null is the field left out ------------------------------------------------------------------

NULLS = ["system", "template", "context", "images", "format", "think", "raw", "stream", "truncate", "logprobs",
         "top_logprobs", "suffix", "options", "keep_alive", "prompt"]


@pytest.mark.parametrize("field", NULLS)
def test_ollama_null_fields_are_left_out(http, field):
    """Go's decoder leaves a field at its zero value for a null, which is Ollama's default for each of these (a
    pointer field, `stream` and `keep_alive`, stays nil: streaming, no unload). The answer is the one without it."""
    body = {"model": "m31r", "prompt": PREFIX, "options": {"num_predict": 8}}
    expected = answer(http, {k: v for k, v in body.items() if k != field})
    r = http.post("/api/generate", json={**body, field: None, **({"stream": False} if field != "stream" else {})})
    assert r.status_code == 200, r.text
    if field == "stream":  # null streams, as a left-out `stream` does
        assert r.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(x) for x in r.text.splitlines()]
        assert "".join(x["response"] for x in lines) == expected["response"] and lines[-1]["done"] is True
        return
    got = r.json()
    assert got["response"] == expected["response"] and got["done_reason"] == expected["done_reason"], got
    if field == "suffix":  # not fill-in-the-middle, as `suffix: ""` is
        assert got["prompt_eval_count"] == expected["prompt_eval_count"]


def test_ollama_null_options_and_everything_null_at_once(http, small):
    body = {"model": "m31r", "prompt": PREFIX, "stream": False}
    expected = answer(http, {**body, "options": {"num_predict": 8}})
    nulls = {f: None for f in NULLS if f not in ("prompt", "stream", "options")}
    got = answer(http, {**body, **nulls, "options": {"num_predict": 8, "temperature": None, "top_k": None,
                                                     "top_p": None, "seed": None, "stop": None}})
    assert got["response"] == expected["response"]
    # num_predict null is the default (what a left-out num_predict gets): here the server's cap
    default = answer(http, {**body, "options": {"num_predict": None}})
    assert default["response"] == answer(http, {**body, "options": {}})["response"] and default["eval_count"] <= CAP
    # /api/show reads nulls the same way (its `verbose` is a Go bool)
    r = http.post("/api/show", json={"model": "m31r", "verbose": None, "name": None})
    assert r.status_code == 200 and ".Suffix" in r.json()["template"], r.text
    assert ollama.Client(host=small.url).generate(model="m31r", prompt=PREFIX, options={"num_predict": 8},
                                                  system=None).response == expected["response"]


def test_ollama_model_null_is_a_missing_model(http):
    r = http.post("/api/generate", json={"model": None, "prompt": "fn"})
    assert r.status_code == 400 and "model" in r.json()["error"], r.text


# -- Ollama: keep_alive and the empty prompt ----------------------------------------------------------------------

# keep_alive as Ollama's api.Duration reads it: a number is seconds (truncated to nanoseconds, negative: forever),
# a string Go's time.ParseDuration (negative: forever). Zero unloads.
ZERO = [0, 0.0, 1e-10, "0", "-0", "+0", "0s", "0ms", "0h0m0s", "0.0s", ".0s", "0.1ns", "00m"]
NOT_ZERO = [None, 1, 0.5, 300, 1e308, -1, -0.5, -1e308, "5m", "1h30m", "-1m", "1ns", "1.5h", "3\u00b5s", "2\u03bcs",
            "-1s"]


@pytest.mark.parametrize("keep_alive", ZERO + NOT_ZERO, ids=repr)
@pytest.mark.parametrize("stream", [None, False, True])
def test_empty_prompt_loads_or_unloads(http, keep_alive, stream):
    """routes.go: an empty prompt with a zero keep_alive answers `unload`, else `load`; both with c.JSON, one object
    whatever `stream` says (the model stays loaded here either way: nothing a client sees tells them apart)."""
    body = {"model": "m31r:latest", **({} if keep_alive is None else {"keep_alive": keep_alive}),
            **({} if stream is None else {"stream": stream})}
    r = http.post("/api/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text
    got = json.loads(r.text)  # one JSON value, not lines of them
    assert set(got) == {"model", "created_at", "response", "done", "done_reason"}, got
    reason = "unload" if keep_alive in ZERO and keep_alive is not None else "load"
    assert got == {**got, "model": "m31r:latest", "response": "", "done": True, "done_reason": reason}


def test_unload_through_the_ollama_client(small):
    """What `ollama stop` and the Python client send to unload (keep_alive=0), streamed or not."""
    c = ollama.Client(host=small.url)
    assert c.generate(model="m31r", keep_alive=0).done_reason == "unload"
    [part] = list(c.generate(model="m31r", keep_alive=0, stream=True))
    assert part.done_reason == "unload" and part.done is True
    assert c.generate(model="m31r", keep_alive="10m").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as e:
        c.generate(model="llama3", keep_alive=0)
    assert e.value.status_code == 404


def test_keep_alive_zero_with_a_prompt_or_suffix_still_completes(http):
    """Ollama unloads after answering a prompt; the answer is the ordinary one. A suffix makes a request
    fill-in-the-middle here (README "Ollama"), so an empty prompt with one is a completion at a file's start."""
    body = {"model": "m31r", "prompt": PREFIX, "options": {"num_predict": 8}}
    assert answer(http, {**body, "keep_alive": 0})["response"] == answer(http, body)["response"]
    fim = {"model": "m31r", "prompt": "", "suffix": SUFFIX, "options": {"num_predict": 8}}
    got = answer(http, {**fim, "keep_alive": 0})
    assert got["done_reason"] in ("stop", "length") and "eval_count" in got
    assert got["response"] == answer(http, fim)["response"]


@pytest.mark.parametrize("keep_alive", ["bogus", "10", "", "1d", "5m3", "1.s.", "-", ".s", True, False, {}, [0],
                                        "9999999999h"], ids=repr)
def test_a_keep_alive_ollama_cannot_read_is_a_400(http, keep_alive):
    """Ollama's binding fails on these (Go's time.ParseDuration, or a type api.Duration refuses): a 400 naming the
    field, before anything else (an empty prompt's load answer included)."""
    for prompt in ("", PREFIX):
        r = http.post("/api/generate", json={"model": "m31r", "prompt": prompt, "keep_alive": keep_alive})
        assert r.status_code == 400 and r.json()["error"].startswith("keep_alive: "), r.text
        assert "duration" in r.json()["error"]


# -- OpenAI: max_tokens past the server's cap --------------------------------------------------------------------


def test_openai_max_tokens_past_the_cap_is_capped(small):
    """Editor plugins send 2048 or 4096 by default: capped to --max-tokens-cap, as llama.cpp's server caps n_predict
    at its -n (and vLLM at its max_new_tokens), rather than a 400 that leaves the user with no completion."""
    c = openai.OpenAI(base_url=f"{small.url}/v1", api_key="none", max_retries=0)
    at_cap = c.completions.create(model="m31r", prompt="fn main() {", max_tokens=CAP)
    for asked in (CAP + 1, 2048, 4096, 2**31 - 1):
        got = c.completions.create(model="m31r", prompt="fn main() {", max_tokens=asked)
        assert got.choices[0].text == at_cap.choices[0].text and got.usage.completion_tokens <= CAP
        assert got.choices[0].finish_reason == at_cap.choices[0].finish_reason
    streamed = c.completions.create(model="m31r", prompt="fn main() {", max_tokens=4096, stream=True)
    assert "".join(ch.choices[0].text for ch in streamed if ch.choices) == at_cap.choices[0].text
    # fill-in-the-middle too (here the cap is below the daemon's FIM limit, half the context)
    fim = c.completions.create(model="m31r", prompt=PREFIX, suffix=SUFFIX, max_tokens=4096)
    assert fim.choices[0].text == c.completions.create(model="m31r", prompt=PREFIX, suffix=SUFFIX,
                                                       max_tokens=CAP).choices[0].text
    doc = httpx.get(f"{small.url}/openapi.json").json()["components"]["schemas"]["OpenAICompletionRequest"]
    assert doc["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 2**31 - 1  # what the server takes, documented


def test_a_capped_max_tokens_that_overflows_the_context_says_so(wide):
    """Capped, it may still not fit beside the prompt: the 400 OpenAI answers, which says the figure was the cap."""
    prompt = "fn a() {}\n" * 30  # 300 tokens: 300 + 500 > 512
    r = httpx.post(f"{wide.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4096}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_overflow" and err["param"] == "max_tokens", err
    assert f"max_tokens ({WIDE}, this server's cap (m31r serve --max-tokens-cap), as 4096 was more)" in err["message"]


def test_openai_max_tokens_still_refuses_what_no_request_may_ask(http):
    for bad in (-1, 2**31, "many"):
        r = http.post("/v1/completions", json={"prompt": "fn", "max_tokens": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# -- audit: a client that leaves mid-stream ----------------------------------------------------------------------


def request_lines(proc) -> list[dict]:
    """The daemon's per-request log lines so far (one when a request ends: finished, failed or cancelled)."""
    return [d for d in map(json.loads, [x for x in list(proc.log_lines) if x.startswith("{")])
            if d.get("msg") == "request"]


LONG = [  # a streamed answer of hundreds of tokens, from each API that streams
    ("/api/generate", {"model": "m31r", "prompt": "fn main() {", "options": {"num_predict": WIDE}}),
    ("/v1/completions", {"prompt": "fn main() {", "max_tokens": WIDE, "stream": True}),
    ("/v1/completions", {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 256, "stream": True}),
    ("/infill", {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 256, "stream": True}),
    ("/v1/fim/completions", {"model": "codestral-latest", "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 256,
                             "stream": True}),
    ("/generate", {"prompt": "fn main() {", "max_tokens": WIDE, "stream": True}),
    ("/fim", {"prefix": PREFIX, "suffix": SUFFIX, "max_tokens": 256, "stream": True}),
]


def disconnect_after_first_chunk(proc, url: str, path: str, body: dict) -> dict:
    """Stream `body`, leave after the first chunk, and return the daemon's log line for the request once it ends."""
    seen = len(request_lines(proc))
    with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith(("{", "data: ", "event: ")), first
    assert wait_for(lambda: len(request_lines(proc)) > seen, timeout=30), "the daemon never ended the request"
    return request_lines(proc)[seen]


@pytest.mark.parametrize(("path", "body"), LONG, ids=[f"{p}-{i}" for i, (p, _) in enumerate(LONG)])
def test_a_disconnect_mid_stream_cancels_the_daemon_request(daemon, wide, path, body):
    """After the first chunk the client closes its connection. The daemon's own record says the request was
    cancelled, with at most the one model call already under way after the Cancel arrived, and none is left active."""
    proc, sock = daemon
    for _attempt in range(3):
        line = disconnect_after_first_chunk(proc, wide.url, path, body)
        if line.get("code") == "cancelled":
            assert line["calls_after_cancel"] <= 1, line  # the Cancel took effect within one scheduler round
            assert wait_for(lambda: daemon_status(sock).active == 0, timeout=30)
            return
        assert line.get("finish_reason") in ("length", "stop"), line  # it finished before the client left
    pytest.fail("each answer was over before its client left")


# -- audit: concurrent requests for the same document ------------------------------------------------------------


def in_thread(call) -> tuple[threading.Thread, dict]:
    """`call()` started on a thread of its own; its result lands in the dict's "r"."""
    out: dict = {}
    thread = threading.Thread(target=lambda: out.update(r=call()))
    thread.start()
    return thread, out


def supersede(url: str, older: str, body: dict) -> tuple[dict | None, httpx.Response, httpx.Response]:
    """`body` to `older`, then a newer request for its path and one for another path while it runs (to /fim): the
    older one's error (None where it finished first), the newer answer and the other path's."""
    fim = {k: body[k] for k in ("prefix", "suffix", "path")} | {"max_tokens": 4}
    other_body = {**fim, "path": "src/other.rs"}
    with httpx.Client(base_url=url, timeout=60) as c, httpx.Client(base_url=url, timeout=60) as c2, \
            httpx.Client(base_url=url, timeout=60) as c3:
        if body["stream"]:
            with c.stream("POST", older, json=body) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)  # it is generating
                bystander, other = in_thread(lambda: c3.post("/fim", json=other_body))
                newer = c2.post("/completion", json=fim)
                events = sse_events("\n".join([*lines, ""]))
            bystander.join()
            err = json.loads(events[-1][1])["error"] if events[-1][0] == "error" else None
            return err, newer, other["r"]
        first, out = in_thread(lambda: c.post(older, json=body))
        # the older request is in the daemon once the daemon counts one active (its status, not a wait for time)
        wait_for(lambda: daemon_active(url) or not first.is_alive(), timeout=30, step=0.001)
        bystander, other = in_thread(lambda: c3.post("/fim", json=other_body))
        newer = c2.post("/fim", json=fim)
        first.join()
        bystander.join()
        if out["r"].status_code == 200:
            return None, newer, other["r"]
        assert out["r"].status_code == 409, out["r"].text
        return out["r"].json()["error"], newer, other["r"]


def daemon_active(url: str) -> bool:
    r = httpx.get(f"{url}/health", timeout=30)
    return r.status_code == 200 and r.json()["active"] > 0


@pytest.mark.parametrize(("older", "stream"), [("/fim", True), ("/fim", False), ("/completion", False)])
def test_a_newer_request_for_the_same_path_supersedes_the_older(wide, older, stream):
    """Newest wins per document (`path`, shared by /fim and /completion): the older answer ends `cancelled`
    (superseded; a 409, or an error event once streaming), the newer one is served; a request for another path is
    left alone. (A streamed /completion sends nothing before its end: the policy needs the whole text.)"""
    body = {"prefix": PREFIX, "suffix": SUFFIX, "max_tokens": 256, "path": "src/lib.rs", "stream": stream}
    if older == "/completion":  # a long multi-line answer, which no confidence floor ends early
        body |= {"prefix": "fn main() {", "suffix": "", "multiline": "always", "max_lines": 1000,
                 "min_probability": 0}
    for _attempt in range(3):
        err, newer, other = supersede(wide.url, older, body)
        if err is None:
            continue  # it finished before the newer request came
        assert err["code"] == "cancelled" and "superseded" in err["message"], err
        assert newer.status_code == 200 and other.status_code == 200, (newer.text, other.text)
        return
    pytest.fail("the older request always finished before the newer one came")


# -- audit: large bodies -----------------------------------------------------------------------------------------


def test_large_bodies(small):
    """A body just under --max-body (1 MiB) is read and served as each API serves a prompt longer than the context
    (Ollama keeps its end, OpenAI's is a context_overflow 400, FIM keeps the code nearest the cursor); past the limit
    it is a 413 in the endpoint's error shape, with a Content-Length or chunked."""
    big = "fn a() {}\n" * 95_000
    with httpx.Client(base_url=small.url, timeout=120) as c:
        got = c.post("/api/generate", json={"model": "m31r", "prompt": big, "stream": False,
                                            "options": {"num_predict": 4}})
        assert got.status_code == 200 and got.json()["eval_count"] == 4 and got.json()["prompt_eval_count"] <= 512
        r = c.post("/v1/completions", json={"prompt": big, "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_overflow"
        r = c.post("/v1/completions", json={"prompt": big, "suffix": "}", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] <= 512
        r = c.post("/api/generate", json={"model": "m31r", "prompt": big * 2})
        assert r.status_code == 413 and "exceeds this server's limit" in r.json()["error"]
        r = c.post("/api/generate", content=(b"x" * 10_000 for _ in range(200)),
                   headers={"content-type": "application/json"})
        assert r.status_code == 413 and isinstance(r.json()["error"], str)
        r = c.post("/v1/completions", json={"prompt": big * 2})
        assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/api/generate", {"model": "m31r", "prompt": "fn", "stream": False}, "options"),
    ("/api/generate", {"model": "m31r", "prompt": "fn", "stream": True}, "options"),
    ("/infill", {"input_prefix": "fn", "input_suffix": "}", "n_predict": 2}, None),
    ("/v1/fim/completions", {"model": "codestral-latest", "prompt": "fn", "suffix": "}", "max_tokens": 2}, None),
])
def test_thousands_of_ignored_fields_do_not_make_the_answer_unreadable(http, path, body, where):
    """Fields a foreign API ignores are named in X-M31R-Ignored-Options; a body (under --max-body) naming 20,000 of
    them, or one of 100 KB, made a header line clients refuse (h11, which httpx uses, and Node allow 16 KiB of
    headers; Python's http.client 64 KiB a line), so the answer was lost. The header keeps to 4 KiB, ending with
    how many more there were."""
    many = {f"opt_{i:05}": 1 for i in range(20_000)}
    for unknown, listed_first in ((many, "opt_00000"), ({"x" * 100_000: 1, "num_ctx": 1}, None)):
        sent = {**body, "options": {**unknown, "num_predict": 2}} if where else {**body, **unknown}
        r = http.post(path, json=sent)
        assert r.status_code == 200, r.text[:300]
        header = r.headers["x-m31r-ignored-options"]
        assert len(header) <= 4096, len(header)
        names = header.split(", ")
        more = int(names[-1].removeprefix("(").removesuffix(" more)"))
        assert len(names) - 1 + more == len(unknown) and names[0] == (listed_first or names[0])

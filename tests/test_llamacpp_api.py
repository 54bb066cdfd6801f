"""llama.cpp server's `POST /infill` on `m31r serve`, for llama.cpp's editor plugins: requests built field for field
as llama.vim (`autoload/llama.vim`: llama#fim, s:ring_update) and llama.vscode (`src/llama-server.ts`:
createRequestPayload) build them, against a real server in front of a real daemon on the tiny random-weight bundle.

A random-weight model writes noise, so answers are compared with /fim's for the same request (greedy: the same input
gives the same text). llama.cpp's stop rules that the daemon lacks (n_indent, t_max_predict_ms) need text with lines
and a known pace, which noise has not: those tests script the daemon's tokens (a protocol-speaking stand-in, as
test_http's StalledDaemon), still through the real server.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from test_http import Server, StalledDaemon, healthy_server, token_server

from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

CAP = 64  # the server's --max-tokens-cap: the plugins' n_predict (128) is capped to it, as llama.cpp's server caps
PREFIX = "fn main() {\n    let total = add(1, 2);\n"
MIDDLE = "    println!("  # the cursor line before the cursor
SUFFIX = ");\n}\n"
EXTRA = [{"text": f"pub fn helper_{i}(x: u32) -> u32 {{\n    x + {i}\n}}\n", "filename": f"src/h{i}.rs"}
         for i in range(10)]  # oldest first, as both plugins keep their ring of chunks
LLAMA_VIM_FIELDS = ["content", "timings/prompt_n", "timings/prompt_ms", "timings/prompt_per_token_ms",
                    "timings/prompt_per_second", "timings/predicted_n", "timings/predicted_ms",
                    "timings/predicted_per_token_ms", "timings/predicted_per_second", "truncated", "tokens_cached"]


def llama_vim(prefix: str, middle: str, suffix: str, extra: list[dict], indent: int) -> dict:
    """llama.vim's llama#fim request, field for field (its defaults: n_predict 128, stop_strings [], t_max_prompt_ms
    500, the first request's t_max_predict_ms 250). Its `model` is always sent (its check is on the option's name,
    never empty) and is '' by default; its ring chunks carry their `time` (a reltime list)."""
    return {
        "id_slot": 0, "input_prefix": prefix, "input_suffix": suffix,
        "input_extra": [{"text": c["text"], "time": [1732, 1234], "filename": c["filename"]} for c in extra],
        "prompt": middle, "n_predict": 128, "stop": [], "n_indent": indent, "top_k": 40, "top_p": 0.90,
        "samplers": ["top_k", "top_p", "infill"], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 500,
        "t_max_predict_ms": 250, "response_fields": LLAMA_VIM_FIELDS, "model": "",
    }


def llama_vim_ring_update(extra: list[dict]) -> dict:
    """llama.vim's s:ring_update request: no samplers, n_predict 0 (prefill the chunks), response_fields ['']."""
    return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": extra, "prompt": "", "n_predict": 0,
            "temperature": 0.0, "samplers": [], "stream": False, "cache_prompt": True, "t_max_prompt_ms": 1,
            "t_max_predict_ms": 1, "response_fields": [""], "model": ""}


def llama_vscode(prefix: str, middle: str, suffix: str, extra: list[dict], nindent: int, prep: bool = False) -> dict:
    """llama.vscode's createRequestPayload, field for field (its defaults: n_predict 128, max_parallel_completions 3,
    t_max_prompt_ms 500, t_max_predict_ms 2500; no LoRA, no model name). `prep`: its updateExtraContext request."""
    chunks = [{"text": c["text"], "time": 1732000000000, "filename": f"/projects/demo/{c['filename']}"} for c in extra]
    if prep:
        return {"id_slot": 0, "input_prefix": "", "input_suffix": "", "input_extra": chunks, "prompt": "",
                "n_predict": 0, "samplers": [], "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1}
    body = {"id_slot": 0, "input_prefix": prefix, "input_suffix": suffix, "input_extra": chunks, "prompt": middle,
            "n_predict": 128, "n_cmpl": 3, "top_k": 40, "top_p": 0.99, "stream": False,
            "samplers": ["top_k", "top_p", "infill"], "cache_prompt": True}
    if nindent:  # (`...(nindent && { n_indent: nindent })`)
        body["n_indent"] = nindent
    return {**body, "t_max_prompt_ms": 500, "t_max_predict_ms": 2500}


def context(extra: list[dict], path_prefix: str = "") -> list[dict]:
    """What input_extra should reach the daemon as: the newest 8 chunks, newest first (nearest the code)."""
    return [{"text": c["text"], "path": path_prefix + c["filename"]} for c in reversed(extra[-8:])]


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "llamacpp", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def fim(http: httpx.Client, prefix: str, suffix: str, ctx: list[dict]) -> dict:
    r = http.post("/fim", json={"prefix": prefix, "suffix": suffix, "context": ctx, "max_tokens": CAP})
    assert r.status_code == 200, r.text
    return r.json()


def cut_of(content: str, whole: str) -> None:
    """`content` is /fim's text, or its start cut at a line's start (where n_indent or t_max_predict_ms ended it)."""
    assert whole.startswith(content) and (content == whole or content.endswith("\n")), (content, whole)


def test_llama_vim(http):
    """llama.vim's completion request: it checks the raw answer with two regexes before decoding it, reads `content`,
    `tokens_cached` and the `timings/...` keys response_fields unnests, and needs all six of those it tests with
    has_key to show its figures."""
    # (llama.vim sends its api_key header even when the key is empty: `len("g:llama_config.api_key")` is a string's)
    r = http.post("/infill", content=json.dumps(llama_vim(PREFIX, MIDDLE, SUFFIX, EXTRA, indent=4)),
                  headers={"content-type": "application/json", "authorization": "Bearer"})
    assert r.status_code == 200, r.text
    assert re.match(r"^\s*\{", r.text) and re.search(r'"content"\s*:"', r.text)  # llama.vim's checks, as written
    body = r.json()
    assert list(body) == LLAMA_VIM_FIELDS
    assert body["truncated"] is False and body["tokens_cached"] >= 0
    assert body["timings/predicted_n"] > 0 and body["timings/prompt_n"] >= 0
    assert all(isinstance(body[f"timings/{k}"], float) for k in ("prompt_ms", "predicted_ms", "predicted_per_second"))
    cut_of(body["content"], fim(http, PREFIX + MIDDLE, SUFFIX, context(EXTRA))["text"])
    assert r.headers["x-m31r-ignored-options"] == "samplers, t_max_prompt_ms"


def test_llama_vscode(http):
    """llama.vscode's completion request (n_cmpl 3: one answer, which it reads as it reads llama.cpp's single one):
    it reads `content`; its status bar `tokens_cached`, `generation_settings.n_ctx` and `timings`."""
    body = llama_vscode(PREFIX, MIDDLE, SUFFIX, EXTRA, nindent=4)
    r = http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    a = r.json()
    assert isinstance(a, dict) and "content" in a and a["stop"] is True and a["truncated"] is False
    assert a["generation_settings"]["n_ctx"] == 512 and a["generation_settings"]["n_predict"] == CAP  # capped
    assert a["generation_settings"]["n_indent"] == 4 and a["generation_settings"]["temperature"] == 0
    t = a["timings"]
    assert t["predicted_n"] == a["tokens_predicted"] > 0 and t["prompt_n"] == a["tokens_evaluated"] - a["tokens_cached"]
    assert t["predicted_ms"] > 0 and t["predicted_per_second"] > 0 and a["stop_type"] in ("eos", "limit")
    whole = fim(http, PREFIX + MIDDLE, SUFFIX, context(EXTRA, "/projects/demo/"))
    cut_of(a["content"], whole["text"])
    # input_extra reached the daemon as the Fim's context, the newest 8 newest first: the same prompt as /fim's
    assert a["tokens_evaluated"] == whole["usage"]["prompt_tokens"] + whole["usage"]["healed_tokens"]
    assert r.headers["x-m31r-ignored-options"] == "n_cmpl, samplers, t_max_prompt_ms"
    # ...and without it the prompt is shorter
    r = http.post("/infill", json={**body, "input_extra": []})
    assert r.status_code == 200 and r.json()["tokens_evaluated"] < a["tokens_evaluated"]


def test_warm_up_requests(http):
    """The plugins' requests that only send the ring of chunks (n_predict 0): answered, nothing written, the daemon
    prefilling the chunks (its request counts the prompt)."""
    r = http.post("/infill", json=llama_vim_ring_update(EXTRA))
    assert r.status_code == 200 and r.json() == {}  # response_fields [""] names no field, as in llama.cpp
    r = http.post("/infill", json=llama_vscode("", "", "", EXTRA, 0, prep=True))
    a = r.json()
    assert r.status_code == 200 and a["content"] == "" and a["tokens_predicted"] == 0 and a["tokens_evaluated"] > 0


def test_stream(http):
    """`stream: true`: `data: {...}` lines of content, then one with `stop: true` and the response's fields, as
    llama.cpp streams /infill; together the same text as the whole answer."""
    body = {**llama_vscode(PREFIX, MIDDLE, SUFFIX, EXTRA, nindent=0), "t_max_predict_ms": 0}
    whole = http.post("/infill", json=body).json()
    r = http.post("/infill", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line.removeprefix("data: ")) for line in r.text.split("\n\n") if line]
    *chunks, last = events
    assert chunks and all(e["stop"] is False and e["index"] == 0 for e in chunks)
    assert "".join(e["content"] for e in chunks) == whole["content"]
    assert last["stop"] is True and last["content"] == "" and last["tokens_predicted"] == whole["tokens_predicted"]
    assert last["generation_settings"]["stream"] is True
    # response_fields apply to the stream's last event, as to a whole answer
    r = http.post("/infill", json={**body, "stream": True, "response_fields": ["timings/predicted_n", "stop"]})
    last = json.loads(r.text.strip().split("\n\n")[-1].removeprefix("data: "))
    assert last == {"timings/predicted_n": whole["tokens_predicted"], "stop": True}


@pytest.mark.parametrize(("body", "param"), [
    ({"input_prefix": 5}, "input_prefix"),
    ({"input_extra": [{"filename": "a.rs"}]}, "input_extra[0].text"),
    ({"stop": ["x"] * 33}, "stop"),
    ({"top_p": 2}, "top_p"),
])
def test_errors_have_llamacpps_shape(http, body, param):
    r = http.post("/infill", json={"input_prefix": "fn", **body})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == 400 and err["type"] == "invalid_request_error", r.text
    assert param in err["message"] and set(err) == {"code", "message", "type"}
    r = http.post("/infill", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == 400


def test_health_metrics_openapi(http):
    """llama.vscode's health check reads `status` ("ok"); the endpoint has its metrics label and its OpenAPI entry."""
    assert http.get("/health").json()["status"] == "ok"
    http.post("/infill", json={"input_prefix": "fn", "n_predict": 1})
    assert re.search(r'm31r_http_requests_total\{endpoint="/infill",status="200"\} [1-9]', http.get("/metrics").text)
    doc = http.get("/openapi.json").json()
    assert "/infill" in doc["paths"] and "InfillRequest" in doc["components"]["schemas"]


def test_guard_errors_have_llamacpps_shape(shared_daemon, tmp_path):
    """The token (the plugins' api_key, sent as a bearer token) and the Host check hold on /infill, refusing in
    llama.cpp's shape."""
    with token_server(tmp_path, shared_daemon[1]) as srv:
        r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn", "n_predict": 1})
        assert r.status_code == 401 and r.json() == {"error": {
            "code": 401, "message": "a bearer token is required", "type": "authentication_error"}}
        r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn", "n_predict": 1},
                       headers={"authorization": "Bearer s3cret", "host": "evil.example"})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn", "n_predict": 1},
                       headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 1


def test_no_daemon_is_a_503(tmp_path):
    srv = Server(tmp_path, tmp_path / "none.sock")  # --no-autostart, and nothing listens there
    try:
        for stream in (False, True):
            r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn", "stream": stream}, timeout=30)
            err = r.json()["error"]
            assert r.status_code == 503 and "retry-after" in r.headers, r.text
            assert err["code"] == 503 and err["type"] == "unavailable_error" and "daemon" in err["message"]
    finally:
        srv.stop()


# -- llama.cpp's stop rules, on scripted tokens ---------------------------------------------------------------


class WritingDaemon(StalledDaemon):
    """Speaks the daemon's protocol and answers every Fim with `pieces` as Token frames, `delay` seconds apart, then
    Done; a Cancel stops it (the Cancel is recorded). With `hold` it sends the first request that many pieces, then
    waits (up to 10 s) for a Cancel before going on: a test of a cut can then tell a cancelled request from one
    that had already ended."""

    model = "scripted"
    capabilities = ("context",)

    def __init__(self, path: Path, pieces: list[str], delay: float = 0.0, hold: int | None = None):
        self.pieces, self.delay, self.hold = pieces, delay, hold
        self.cancelled: set[int] = set()
        super().__init__(path)

    def on_cancel(self, msg: pm.Cancel) -> None:
        self.cancelled.add(msg.id)

    def on_request(self, msg: pm.Generate | pm.Fim, send: Callable[[object], None]) -> None:
        if isinstance(msg, pm.Fim):
            threading.Thread(target=self._write, args=(msg, send), daemon=True).start()

    def _write(self, req: pm.Fim, send: Callable[[object], None]) -> None:
        for i, piece in enumerate(self.pieces):
            time.sleep(self.delay)
            if i == self.hold and req.id == min(r.id for r in self.received if isinstance(r, pm.Fim)):
                _eventually(lambda: req.id in self.cancelled, timeout=10.0)
            if req.id in self.cancelled:
                return
            send(pm.Token(id=req.id, text=piece, token=i))
        send(pm.Done(id=req.id, finish_reason="stop", usage=pm.Usage(prompt_tokens=9, completion_tokens=len(
            self.pieces)), timings=pm.Timings(prefill_ms=1.0, total_ms=2.0)))


BLOCK = ["x = 1;", "\n", "        ", "y = 2;\n", "    ", "}", "\n", "z();\n"]  # a block, then its closing line


@pytest.fixture
def writing(tmp_path):
    def make(pieces: list[str], delay: float = 0.0, hold: int | None = None) -> tuple[Server, WritingDaemon]:
        daemon = WritingDaemon(tmp_path / f"w{len(made)}.sock", pieces, delay, hold)
        srv = Server(tmp_path, daemon.path)
        made.append((srv, daemon))
        return srv, daemon

    made: list[tuple[Server, WritingDaemon]] = []
    yield make
    for srv, daemon in made:
        srv.stop()
        daemon.close()


@pytest.mark.parametrize("stream", [False, True])
def test_n_indent_ends_before_a_line_indented_less(writing, stream):
    """n_indent 8 (the cursor line's indentation, as the plugins send it): the answer ends before the first line
    indented less, which is left out whole; a stream never sends any of it (the line's whitespace is held until
    its indentation is known); the daemon's request is cancelled there."""
    srv, daemon = writing(BLOCK, hold=6)  # the adapter has what it needs after six pieces
    body = {"input_prefix": "fn f() {\n    if a {\n", "prompt": "        ", "input_suffix": "\n}\n", "n_indent": 8,
            "stream": stream}
    r = httpx.post(f"{srv.url}/infill", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(e.removeprefix("data: ")) for e in r.text.split("\n\n") if e]
        content, last = "".join(e["content"] for e in events), events[-1]
    else:
        content = last = r.json()
        content = last["content"]
    assert content == "x = 1;\n        y = 2;\n" and last["stop_type"] == "limit"
    assert last["tokens_predicted"] == 6  # the daemon's tokens up to the one that showed the indentation
    fims = [m for m in daemon.received if isinstance(m, pm.Fim)]
    assert [f.prefix for f in fims] == ["fn f() {\n    if a {\n        "] and fims[0].max_tokens == 256
    assert _eventually(lambda: {f.id for f in fims} <= daemon.cancelled)
    # without n_indent, the whole answer
    r = httpx.post(f"{srv.url}/infill", json={**body, "n_indent": 0, "stream": False}, timeout=30)
    assert r.json()["content"] == "".join(BLOCK) and r.json()["stop_type"] == "eos"


def test_n_indent_ends_at_a_blank_line(writing):
    """A blank line is indented by its whitespace, as llama.cpp counts it: under n_indent it ends the answer."""
    srv, _ = writing(["a();\n", "\n", "        b();\n"])
    r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn f() {\n", "prompt": "        ", "n_indent": 8},
                   timeout=30)
    assert r.json()["content"] == "a();\n"


def test_t_max_predict_ms_ends_at_a_line_end(writing):
    """t_max_predict_ms: once that long has passed since the first token, the answer ends at the next line end
    (the first line is kept whole however long it takes)."""
    pieces = ["let a", " = 1;", "\nlet b = 2;", "\nlet c", " = 3;\n", "let d = 4;\n"]
    srv, daemon = writing(pieces, delay=0.15)
    r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn f() {\n", "t_max_predict_ms": 200}, timeout=30)
    a = r.json()
    assert a["content"] == "let a = 1;\n" and a["stop_type"] == "limit", a
    r = httpx.post(f"{srv.url}/infill", json={"input_prefix": "fn f() {\n", "t_max_predict_ms": 5000}, timeout=30)
    assert r.json()["content"] == "".join(pieces)


def _eventually(check, timeout: float = 5.0) -> bool:
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.02)
    return True


def test_a_stop_word_is_named(http):
    """A stop the request gave that ended the infill is llama.cpp's stop_type "word", named in stopping_word (the
    daemon's Done.stop_sequence); one that never came leaves llama.cpp's "eos" or "limit" and no word."""
    whole = fim(http, PREFIX + MIDDLE, SUFFIX, [])["text"]
    assert len(whole) >= 3, whole
    stop = whole[1:3]
    body = {"input_prefix": PREFIX, "prompt": MIDDLE, "input_suffix": SUFFIX, "n_predict": CAP,
            "stop": ["\u2603", stop]}
    a = http.post("/infill", json=body).json()
    assert (a["content"], a["stop_type"], a["stopping_word"]) == (whole[: whole.index(stop)], "word", stop), a
    a = http.post("/infill", json={**body, "stop": ["\u2603"]}).json()
    assert a["content"] == whole and a["stop_type"] in ("eos", "limit") and a["stopping_word"] == "", a

"""`m31r serve` end to end: the real server process (uvicorn) in front of a real m31rd serving the tiny
random-weight bundle, driven by real HTTP clients (httpx, the `openai` package, schemathesis). Nothing is mocked,
except in the timeout test, where a stalled daemon is the point.

A random-weight model writes noise: greedy decoding loops on one token. Tests compare outputs with each other
(stream vs. not, /completion vs. the shared policy applied to /fim) rather than with expected text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
import schemathesis
from daemon_util import start_daemon, stop_daemon
from hypothesis import HealthCheck, given, settings
from prometheus_client.parser import text_string_to_metric_families
from schemathesis.config import SchemathesisConfig

from m31r_http import schemas as s
from m31r_protocol import Client, policy
from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

CAP = 500  # --max-tokens-cap of the main server: a whole tiny context, for requests that must run a while
MAX_BODY = 64 * 1024
SERVE = [sys.executable, "-m", "m31r.cli", "serve"]
RUST = """fn count(text: &str) -> usize {
    let mut n = 0;
    for word in text.split_whitespace() {
        n += word.len();
        @
    }
    n
}
""".replace("@", "")  # a whitespace-only line inside the loop


# -- processes --------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


class Server:
    """A `m31r serve` subprocess; its stderr (JSON log lines) goes to a file, so a full pipe never blocks it."""

    def __init__(self, tmp: Path, sock: Path, *args: str, ready_timeout: float = 30.0, autostart: bool = False,
                 env: dict[str, str] | None = None):
        # free_port()'s port is free when it answers, not when the server binds it a second later: another program
        # may take it meanwhile. The server then says so and exits, and starts again on another port.
        for _ in range(3):
            if self._start(tmp, sock, args, ready_timeout, autostart, env):
                return
        raise RuntimeError(f"m31r serve found its port in use three times: {self.log.read_text()[-2000:]}")

    def _start(self, tmp: Path, sock: Path, args: tuple[str, ...], ready_timeout: float, autostart: bool,
               env: dict[str, str] | None) -> bool:
        """Start the server and wait until it listens; False if its port was taken before it could bind it."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"serve-{self.port}.log"
        cmd = [*SERVE, "--port", str(self.port), "--socket", str(sock), *args]
        if not autostart:
            cmd.append("--no-autostart")
        with open(self.log, "wb") as logf:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=logf, stderr=logf,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        t0 = time.monotonic()
        while time.monotonic() - t0 < ready_timeout:
            log = self.log.read_text()
            if self.proc.poll() is not None:
                if f"cannot listen on 127.0.0.1:{self.port}: the port is in use" in log:
                    return False
                raise RuntimeError(f"m31r serve exited with {self.proc.returncode}: {log[-2000:]}")
            # Its "serving" line comes once it holds the port: before that, the program that took the port would
            # answer the probe.
            if '"msg": "serving"' in log:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    return True
                except OSError:
                    pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"m31r serve not listening after {ready_timeout}s: {self.log.read_text()[-2000:]}")

    def wait_healthy(self, timeout: float = 30.0, **headers: str) -> dict:
        t0 = time.monotonic()
        while True:
            r = httpx.get(f"{self.url}/health", headers=headers, timeout=5)
            if r.status_code == 200 or time.monotonic() - t0 > timeout:
                assert r.status_code == 200, r.text
                return r.json()
            time.sleep(0.1)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def healthy_server(tmp_path_factory, name: str, sock: Path, *args: str) -> Iterator[Server]:
    """A module's `m31r serve` on `sock`, healthy before its tests run and stopped after them: a fixture's body
    (`yield from`)."""
    srv = Server(tmp_path_factory.mktemp(name), sock, *args)
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


TOKEN = "s3cret"  # token_server's


@contextlib.contextmanager
def token_server(tmp: Path, sock: Path) -> Iterator[Server]:
    """`m31r serve --token-file` holding TOKEN (private, as the server requires), healthy, stopped after."""
    token = tmp / "token"
    token.write_text(f"{TOKEN}\n")
    token.chmod(0o600)
    srv = Server(tmp, sock, "--token-file", str(token))
    try:
        srv.wait_healthy(authorization=f"Bearer {TOKEN}")
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def daemon(tiny_bundle, tmp_path_factory):
    """A daemon whose queue (16) is small enough for the load test to hit `busy`. A dict: the restart test
    replaces its process. Without prompt-lookup drafts (HTTP requests cannot turn them off): they finish the tiny
    model's looping CAP tokens in ~50 ms, and the disconnect tests need their request still running once the client's
    hang-up has gone through the server to the daemon; drafts never change what is written."""
    sock = tmp_path_factory.mktemp("httpd") / "d.sock"
    extra = ("--max-queue", "16", "--cache-mb", "16", "--lookahead", "0")
    d = {"sock": sock, "bundle": tiny_bundle.path, "extra": extra,
         "proc": start_daemon(tiny_bundle.path, sock, *extra)}
    yield d
    stop_daemon(d["proc"])


@pytest.fixture(scope="module")
def server(daemon, tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("http"), daemon["sock"], "--max-tokens-cap", str(CAP), "--max-body",
                 str(MAX_BODY), "--request-timeout", "60")
    srv.wait_healthy()
    yield srv
    assert srv.stop() in (0, -15), srv.log.read_text()[-2000:]  # uvicorn re-raises SIGTERM


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def daemon_status(sock: Path) -> pm.StatusReply:
    async def go() -> pm.StatusReply:
        async with await Client.connect(sock) as c:
            return await c.status()

    return asyncio.run(go())


def scrape(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(smp.name, tuple(sorted(smp.labels.items()))): smp.value
            for fam in text_string_to_metric_families(r.text) for smp in fam.samples}


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """(event, data) of each Server-Sent Event in a response body."""
    out = []
    for block in raw.split("\n\n"):
        if not block.strip():
            continue
        event, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                event = value
            elif field == "data":
                data.append(value)
        out.append((event, "\n".join(data)))
    return out


def wait_for(pred, timeout: float = 10.0, step: float = 0.05):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if v := pred():
            return v
        time.sleep(step)
    return pred()


# -- the process ------------------------------------------------------------------------------------------------


def test_never_imports_torch(server):
    code = ("import sys, m31r.cli, m31r_http.app, m31r_http.server, m31r_http.ollama; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    maps = Path(f"/proc/{server.proc.pid}/maps")
    if maps.exists():  # the running server, after serving requests
        assert "libtorch" not in maps.read_text()


def test_health_and_models(http, tiny_bundle):
    h = msgspec.json.decode(http.get("/health").content, type=s.HealthResponse)
    assert h.status == "ok" and h.model == tiny_bundle.model_id and h.fingerprint == tiny_bundle.fingerprint
    assert h.max_context == 512 and h.warming is False  # the fixture waits for a warm daemon
    models = msgspec.json.decode(http.get("/v1/models").content, type=s.OpenAIModelList)
    assert [m.id for m in models.data] == [tiny_bundle.model_id]
    name = tiny_bundle.model_id.split("@")[0]
    assert models.data[0].aliases == [name, "m31r"] and name != tiny_bundle.model_id
    doc = http.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.1") and {"/generate", "/completion", "/fim", "/v1/completions"} <= set(
        doc["paths"])
    assert doc["components"]["schemas"]["GenerateRequest"]["properties"]["max_tokens"]["maximum"] == CAP
    openai_req = doc["components"]["schemas"]["OpenAICompletionRequest"]["properties"]
    assert openai_req["max_tokens"]["anyOf"][0]["maximum"] == 2**31 - 1  # above the cap: capped, not refused
    assert openai_req["model"]["anyOf"][0]["enum"] == [tiny_bundle.model_id, name, "m31r"]
    # A fill-in-the-middle completion may have half the model's context (512 here): the daemon refuses more.
    fim_max = doc["components"]["schemas"]["FimRequest"]["properties"]["max_tokens"]["maximum"]
    assert fim_max == 256 < CAP
    [rule] = doc["components"]["schemas"]["OpenAICompletionRequest"]["allOf"]
    assert rule["then"]["properties"]["max_tokens"]["anyOf"][0]["maximum"] == 256
    r = http.post("/fim", json={"prefix": "fn a() {", "suffix": "}", "max_tokens": 257})
    assert r.status_code == 400 and "half its context" in r.json()["error"]["message"]


# -- native endpoints -------------------------------------------------------------------------------------------


def test_generate(http):
    body = {"prompt": "fn main() {", "max_tokens": 12}
    r = http.post("/generate", json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    g = msgspec.json.decode(r.content, type=s.GenerateResponse)
    assert g.usage.completion_tokens <= 12 and g.usage.prompt_tokens > 0
    assert g.finish_reason in ("stop", "length") and g.timings.total_ms > 0
    again = msgspec.json.decode(http.post("/generate", json=body).content, type=s.GenerateResponse)
    assert again.text == g.text  # greedy by default: same input, same output
    # Stop sequences end the text before them.
    if g.text:
        cut = http.post("/generate", json={**body, "stop": [g.text[2:4] or g.text[:1]]}).json()
        assert cut["finish_reason"] == "stop" and len(cut["text"]) < len(g.text)


def test_generate_stream_sse(http):
    body = {"prompt": "fn main() {", "max_tokens": 12}
    plain = http.post("/generate", json=body).json()
    r = http.post("/generate", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert [e for e, _ in events[:-1]] == ["chunk"] * (len(events) - 1) and events[-1][0] == "done"
    chunks = [msgspec.json.decode(d, type=s.StreamChunk).text for _, d in events[:-1]]
    done = msgspec.json.decode(events[-1][1], type=s.GenerateResponse)
    assert "".join(chunks) == done.text == plain["text"]
    assert len(chunks) >= 2 and all(chunks)
    assert done.usage.completion_tokens == plain["usage"]["completion_tokens"]


def test_native_deadlines_reach_the_daemon(http):
    """deadline_ms on /generate and /fim is the daemon's hard deadline: a request that would run for a second or
    more ends early with finish_reason `deadline`."""
    for path, body in (("/generate", {"prompt": "fn main() {", "max_tokens": 480}),
                       ("/fim", {"prefix": "fn main() {\n    let x = ", "suffix": "\n}\n", "max_tokens": 64})):
        r = http.post(path, json={**body, "deadline_ms": 1})
        assert r.status_code == 200, r.text
        out = msgspec.json.decode(r.content, type=s.GenerateResponse)
        assert out.finish_reason == "deadline" and out.usage.completion_tokens < body["max_tokens"], out
    assert http.post("/generate", json={"prompt": "fn", "deadline_ms": -1}).status_code == 400


def test_fim(http):
    body = {"prefix": "fn add(a: u32, b: u32) -> u32 {\n    ", "suffix": "\n}\n", "max_tokens": 10}
    r = http.post("/fim", json=body)
    assert r.status_code == 200, r.text
    f = msgspec.json.decode(r.content, type=s.GenerateResponse)
    assert f.usage.completion_tokens <= 10
    events = sse_events(http.post("/fim", json={**body, "stream": True}).text)
    assert events[-1][0] == "done"
    assert "".join(json.loads(d)["text"] for e, d in events if e == "chunk") == f.text
    assert http.post("/fim", json={"prefix": "", "max_tokens": 3}).status_code == 200  # empty file


def test_beams_reach_the_daemon(http, daemon):
    """`beams` on /generate, /fim and /completion is the daemon's beam width: the same text as the socket's for each
    width, the daemon's --beams when absent on a line-end stop; outside 1..8, or with a temperature, a 400."""
    prefix, suffix = "fn area(w: f64, h: f64) -> f64 {\n    let result = w * h", ";\n    result\n}\n"

    async def socket_answer(**kw) -> list:
        async with await Client.connect(daemon["sock"]) as c:
            text, done = await (await c.fim(prefix, suffix, max_tokens=12, stop=["\n"], **kw)).collect()
            return [text, done.alternatives]

    body = {"prefix": prefix, "suffix": suffix, "max_tokens": 12, "stop": ["\n"]}
    for beams in (1, 2, 3):
        got = http.post("/fim", json={**body, "beams": beams})
        assert got.status_code == 200, got.text
        assert [got.json()["text"], got.json()["alternatives"]] == asyncio.run(socket_answer(beams=beams))
    got = http.post("/fim", json=body).json()
    assert [got["text"], got["alternatives"]] == asyncio.run(socket_answer())
    got = http.post("/generate", json={"prompt": prefix, "max_tokens": 8, "beams": 2})
    assert got.status_code == 200, got.text
    got = http.post("/completion", json={"prefix": prefix, "suffix": suffix, "beams": 3, "deadline_ms": 0,
                                         "min_probability": 0})
    assert got.status_code == 200, got.text
    c = msgspec.json.decode(got.content, type=s.CompletionResponse)
    plan = policy.plan(prefix + suffix, len(prefix), policy.Options(deadline_ms=None))

    async def planned() -> list:
        async with await Client.connect(daemon["sock"]) as client:
            text, done = await (await client.fim(**plan.fim_kwargs(), beams=3)).collect()
            return [text, done.alternatives]

    raw = asyncio.run(planned())
    shown = [policy.postprocess(plan, x) for x in [raw[0], *raw[1]]]
    want = [x for i, x in enumerate(shown) if x is not None and x not in shown[:i]]
    assert [(c.text, c.start, c.end), *[(a.text, a.start, a.end) for a in c.alternatives]] == [
        (x.text, x.start, x.end) for x in want]
    for bad in ({"beams": 0}, {"beams": 9}, {"beams": 2, "temperature": 0.5}):
        got = http.post("/fim", json={**body, **bad})
        assert got.status_code == 400, (bad, got.text)


def test_context_snippets_reach_the_daemon(http, daemon):
    """`context` on /fim and /completion is the Fim's context: the same answer and prompt size as the socket's; more
    snippets than the protocol takes, or a snippet without text, is a 400."""
    from m31r_protocol.limits import MAX_SNIPPETS
    from m31r_protocol.messages import Snippet

    prefix, suffix = "fn main() {\n    let p = Point { x: 1, y: 2 };\n    let n = p.", ";\n}\n"
    context = [{"path": "src/point.rs", "text": "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n"}]

    async def socket_answer(ctx: list) -> tuple[str, int]:
        async with await Client.connect(daemon["sock"]) as c:
            text, done = await (await c.fim(prefix, suffix, max_tokens=8, beams=1,
                                            context=[Snippet(x["text"], x["path"]) for x in ctx])).collect()
            return text, done.usage.prompt_tokens

    got = http.post("/fim", json={"prefix": prefix, "suffix": suffix, "max_tokens": 8, "beams": 1, "context": context})
    assert got.status_code == 200, got.text
    text, prompt_tokens = asyncio.run(socket_answer(context))
    assert (got.json()["text"], got.json()["usage"]["prompt_tokens"]) == (text, prompt_tokens)
    assert prompt_tokens > asyncio.run(socket_answer([]))[1]
    got = http.post("/completion", json={"prefix": prefix, "suffix": suffix, "context": context, "deadline_ms": 0})
    assert got.status_code == 200, got.text
    for bad in ([context[0]] * (MAX_SNIPPETS + 1), [{"path": "a.rs"}]):
        got = http.post("/fim", json={"prefix": prefix, "context": bad})
        assert got.status_code == 400 and "context" in got.text, got.text


def test_completion_applies_the_shared_policy(http):
    """/completion = policy.plan → the daemon → policy.postprocess (m31r_protocol.policy); checked against the policy
    applied to /fim's raw text for the same plan (sampled with a fixed seed, so there is something to keep)."""
    blank = RUST.index("        \n    }") + 8  # the end of a whitespace-only line
    cursors = [RUST.index("n += ") + 5, RUST.index("{\n") + 2, RUST.index("word.len()") + 4, blank, len(RUST)]
    shown = 0
    for off in cursors:
        for multiline in ("always", "auto"):
            common = {"temperature": 1.0, "seed": 7, "max_tokens": 24}  # the tiny model is sure of nothing: no floor
            floor = {"min_probability": 0}
            r = http.post("/completion", json={"prefix": RUST[:off], "suffix": RUST[off:], "multiline": multiline,
                                               "deadline_ms": 0, **common, **floor})
            assert r.status_code == 200, r.text
            c = msgspec.json.decode(r.content, type=s.CompletionResponse)
            p = policy.plan(RUST, off, policy.Options(multiline=multiline, max_tokens=24, deadline_ms=None))
            raw = http.post("/fim", json={"prefix": p.prefix, "suffix": p.suffix, "stop": p.stop,
                                          "max_tokens": p.max_tokens, **common}).json()["text"]
            sug = policy.postprocess(p, raw)
            expected = (sug.text, sug.start, sug.end) if sug else ("", off, off)
            assert (c.text, c.start, c.end) == expected, (off, multiline, raw)
            assert c.multiline == p.multiline
            shown += bool(c.text)
    assert shown, "no cursor produced a suggestion: the comparison above proved little"
    # Streaming: the post-processed suggestion as one chunk, then done with the same response.
    off = cursors[0]
    body = {"prefix": RUST[:off], "suffix": RUST[off:], "temperature": 1.0, "seed": 7, "max_tokens": 24,
            "min_probability": 0}
    plain = http.post("/completion", json=body).json()
    events = sse_events(http.post("/completion", json={**body, "stream": True}).text)
    assert events[-1][0] == "done" and json.loads(events[-1][1]) == {**plain, "timings": json.loads(
        events[-1][1])["timings"]}
    assert "".join(json.loads(d)["text"] for e, d in events if e == "chunk") == plain["text"]


def test_completion_suggests_nothing_the_model_is_unsure_of(http):
    """/fim passes the daemon's log-probabilities through; /completion suggests nothing where the first line's is
    below min_probability (the language server's default floor unless given), and says so."""
    off = RUST.index("n += ") + 5
    noise = {"temperature": 1.0, "seed": 7, "max_tokens": 24}  # as test_completion_applies_the_shared_policy
    fim = http.post("/fim", json={"prefix": RUST[:off], "suffix": RUST[off:], "stop": ["\n"], **noise}).json()
    assert fim["logprob"] < 0 and fim["line_logprob"] >= fim["logprob"]
    body = {"prefix": RUST[:off], "suffix": RUST[off:], "multiline": "never", **noise}
    shown = http.post("/completion", json={**body, "min_probability": 0}).json()
    assert shown["text"] and not shown["unsure"] and shown["line_logprob"] == pytest.approx(fim["line_logprob"])
    assert math.exp(fim["line_logprob"]) < policy.MIN_PROBABILITY  # the tiny random model: far below the floor
    for floor in ({}, {"min_probability": 0.5}):
        hidden = http.post("/completion", json={**body, **floor}).json()
        assert hidden["unsure"] and hidden["text"] == "" and hidden["alternatives"] == []
        assert (hidden["start"], hidden["end"]) == (off, off)
    assert http.post("/completion", json={**body, "min_probability": 1.5}).status_code == 400


def test_native_logprobs(http):
    """`logprobs` on /generate and /fim: `tokens` in the answer (together the text, each with its log-probability and
    the likeliest tokens at its step) and the same figures on each streamed chunk, one a token; not with beams."""
    body = {"prefix": RUST[:40], "suffix": RUST[40:], "max_tokens": 12, "logprobs": 2}
    r = http.post("/fim", json=body).json()
    assert "".join(t["text"] for t in r["tokens"]) == r["text"] and len(r["tokens"]) == r["usage"]["completion_tokens"]
    ended = r["finish_reason"] == "stop"  # the end token's figure is in logprob, not in a token of the text
    total = sum(t["logprob"] for t in r["tokens"])
    assert total >= r["logprob"] - 1e-3 and (ended or total == pytest.approx(r["logprob"], abs=1e-3))
    for t in r["tokens"]:
        assert 1 <= len(t["top_logprobs"]) <= 2 and t["top_logprobs"][0]["token"] == t["token"]  # greedy
    events = sse_events(http.post("/fim", json={**body, "stream": True}).text)
    chunks = [json.loads(d) for e, d in events if e == "chunk"]
    assert [c["logprob"] for c in chunks] == [t["logprob"] for t in r["tokens"]]
    assert json.loads(events[-1][1])["tokens"] == r["tokens"]
    plain = http.post("/fim", json={**body, "logprobs": None}).json()
    assert plain["tokens"] is None and plain["text"] == r["text"]
    g = http.post("/generate", json={"prompt": "fn main() {", "max_tokens": 6, "logprobs": 0}).json()
    assert all(t["top_logprobs"] == [] for t in g["tokens"]) and "".join(t["text"] for t in g["tokens"]) == g["text"]
    beam = http.post("/fim", json={**body, "beams": 3}).json()  # a beam search's answer, with its steps' figures
    assert "".join(t["text"] for t in beam["tokens"]) == beam["text"] and all(t["top_logprobs"] for t in beam["tokens"])


def test_completion_cuts_the_lines_the_model_is_unsure_of(http):
    """/fim gives each line's log-probability; /completion leaves out the lines from the one at which the
    probability of the lines so far falls under min_probability, and counts them (policy.confident_lines)."""
    off = len(RUST)
    p = policy.plan(RUST, off, policy.Options(multiline="always", max_tokens=48, deadline_ms=None))
    for seed in range(1, 40):  # the tiny random model writes a line break now and then: a seed whose answer has one
        noise = {"temperature": 1.0, "seed": seed, "max_tokens": 48}
        fim = http.post("/fim", json={"prefix": p.prefix, "suffix": p.suffix, "stop": p.stop, **noise}).json()
        raw, by_line = fim["text"], fim["logprob_by_line"]
        assert len(by_line) == raw.count("\n") + 1 and by_line[0] == fim["line_logprob"]
        whole = policy.postprocess(p, raw)
        if whole is not None and whole.text.count("\n") >= 1 and by_line[1] < -0.01:
            break
    else:
        raise AssertionError("no seed gave a suggestion of two lines")
    floor = math.exp(by_line[0] + by_line[1] / 2)
    body = {"prefix": RUST[:off], "suffix": RUST[off:], "multiline": "always", **noise}
    c = http.post("/completion", json={**body, "min_probability": 0}).json()
    assert c["text"] == whole.text and c["lines_cut"] == 0
    c = http.post("/completion", json={**body, "min_probability": floor}).json()
    cut = policy.postprocess(p, raw.split("\n", 1)[0])
    assert cut is not None and c["text"] == cut.text != whole.text and not c["unsure"]
    assert c["lines_cut"] == raw.count("\n")


# -- OpenAI-compatible ------------------------------------------------------------------------------------------


def test_openai_client(server, tiny_bundle):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)
    assert [m.id for m in client.models.list()] == [tiny_bundle.model_id]
    c = client.completions.create(model="m31r", prompt="fn main() {", max_tokens=8)
    assert c.object == "text_completion" and c.model == tiny_bundle.model_id and c.id.startswith("cmpl-")
    assert len(c.choices) == 1 and c.choices[0].finish_reason in ("stop", "length")
    assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
    chunks = list(client.completions.create(model="m31r", prompt="fn main() {", max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == c.usage.completion_tokens
    fim = client.completions.create(model="m31r", prompt="fn add(a: u32) -> u32 {\n    ", suffix="\n}\n",
                                    max_tokens=6)
    assert fim.usage.completion_tokens <= 6
    echo = client.completions.create(model="m31r", prompt="fn main() {", max_tokens=8, echo=True)
    assert echo.choices[0].text == "fn main() {" + c.choices[0].text
    # Per-token figures: the tokens make up the text, each with its log-probability and the likeliest at its step.
    lp = client.completions.create(model="m31r", prompt="fn main() {", max_tokens=8, logprobs=2).choices[0]
    assert lp.text == c.choices[0].text and "".join(lp.logprobs.tokens) == lp.text
    assert len(lp.logprobs.token_logprobs) == c.usage.completion_tokens == len(lp.logprobs.top_logprobs)
    assert all(x <= 0 for x in lp.logprobs.token_logprobs) and all(len(t) <= 2 for t in lp.logprobs.top_logprobs)
    chunks = client.completions.create(model="m31r", prompt="fn main() {", max_tokens=8, logprobs=2, stream=True)
    streamed = [ch.choices[0] for ch in chunks if ch.choices and ch.choices[0].logprobs]
    assert [x for ch in streamed for x in ch.logprobs.token_logprobs] == lp.logprobs.token_logprobs
    assert [x for ch in streamed for x in ch.logprobs.text_offset] == lp.logprobs.text_offset
    # What the server cannot honour is refused, the way OpenAI refuses: 400, an error object naming the field; a
    # model not served is OpenAI's 404 model_not_found.
    with pytest.raises(openai.NotFoundError) as nf:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="fn", max_tokens=2)
    assert nf.value.code == "model_not_found" and nf.value.param == "model"
    for kwargs, param in (({"max_tokens": -1}, "max_tokens"), ({"n": 2}, "n"), ({"logprobs": 6}, "logprobs"),
                          ({"best_of": 3}, "best_of"), ({"extra_body": {"top_k": 5}}, "top_k")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": tiny_bundle.model_id, "prompt": "fn", "max_tokens": 2, **kwargs})
        assert e.value.status_code == 400 and e.value.param == param and param in e.value.message
        assert e.value.type == "invalid_request_error"


def _daemon_frames(sock: Path, **kw) -> list[pm.Token]:
    """The daemon's frames for a Generate (to see text held back and released at the end: a frame with no token)."""

    async def go() -> list[pm.Token]:
        async with await Client.connect(sock) as c:
            return [f async for f in await c.generate(**kw)]

    return asyncio.run(go())


def test_streamed_figures_are_the_answers(http, daemon):
    """With logprobs, a stream's tokens are the whole answer's, text held back and released at the end included (it
    joins the token before it, as in the answer): joined, they are the text, with the same figures and offsets."""
    frames = _daemon_frames(daemon["sock"], prompt="x", max_tokens=3, stop=["xq"], logprobs=0)
    assert frames[-1].token is None and frames[-1].text, frames  # the case at hand: text released at the end
    body = {"prompt": "x", "max_tokens": 3, "stop": ["xq"], "logprobs": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    streamed = [json.loads(d)["choices"][0] for _, d in events[:-1]]
    assert "".join(c["text"] for c in streamed) == whole["text"] == "".join(f.text for f in frames)
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for c in streamed if c["logprobs"] for x in c["logprobs"][key]] == whole["logprobs"][key], key
    native = http.post("/generate", json=body).json()
    chunks = [json.loads(d) for e, d in sse_events(http.post("/generate", json={**body, "stream": True}).text)
              if e == "chunk"]
    assert [(c["text"], c["logprob"]) for c in chunks] == [(t["text"], t["logprob"]) for t in native["tokens"]]
    assert "".join(c["text"] for c in chunks) == native["text"] == whole["text"]


def test_openai_top_logprobs_keep_every_alternative(http):
    """Tokens that are part of a character all read U+FFFD: OpenAI's `top_logprobs`, keyed by text, keys them
    `token:<id>`, so every step keeps all of its alternatives."""
    body = {"prompt": "é", "max_tokens": 12, "logprobs": 5}
    steps = http.post("/generate", json=body).json()["tokens"]
    assert any(sum(c["text"] == "\ufffd" for c in t["top_logprobs"]) >= 2 for t in steps)  # the case at hand
    lp = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert len(lp["top_logprobs"]) == len(steps)
    for got, step in zip(lp["top_logprobs"], steps, strict=True):
        want = {c["text"] if "\ufffd" not in c["text"] else f"token:{c['token']}": c["logprob"]
                for c in step["top_logprobs"]}
        assert got == want and len(got) == len(step["top_logprobs"])
    events = sse_events(http.post("/v1/completions", json={**body, "stream": True}).text)
    streamed = [json.loads(d)["choices"][0]["logprobs"] for _, d in events[:-1]]
    assert [x for c in streamed if c for x in c["top_logprobs"]] == lp["top_logprobs"]


def test_openai_wire_format(http, tiny_bundle):
    r = http.post("/v1/completions", json={"model": "m31r", "prompt": ["fn"], "max_tokens": 4, "stop": "\n",
                                           "logprobs": None, "presence_penalty": 0, "frequency_penalty": 0,
                                           "logit_bias": {}, "n": 1, "best_of": 1, "user": "u1"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and isinstance(body["created"], int)
    assert body["choices"][0]["logprobs"] is None and body["choices"][0]["index"] == 0
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    r = http.post("/v1/completions", json={"prompt": "fn", "max_tokens": 4, "stop": ["\n"], "stream": True})
    events = sse_events(r.text)
    assert all(e is None for e, _ in events) and events[-1][1] == "[DONE]"
    chunks = [msgspec.json.decode(d, type=s.OpenAICompletion) for _, d in events[:-1]]
    assert chunks[-1].choices[0].finish_reason == body["choices"][0]["finish_reason"]
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-1]) and chunks[-1].usage is None
    assert "".join(ch.choices[0].text for ch in chunks) == body["choices"][0]["text"]
    # Every name of the model is accepted, and a request may leave it out (there is one model).
    for model in (tiny_bundle.model_id, tiny_bundle.model_id.split("@")[0], None):
        r = http.post("/v1/completions", json={"model": model, "prompt": "fn", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == tiny_bundle.model_id, r.text


# -- errors -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/generate", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/generate", {"prompt": "x", "max_tokenz": 3}, "max_tokenz"),
    ("/generate", {"max_tokens": 3}, "prompt"),
    ("/generate", {"prompt": ""}, "prompt"),
    ("/generate", {"prompt": "x", "max_tokens": CAP + 1}, "max_tokens"),
    ("/generate", {"prompt": "x", "temperature": 3}, "temperature"),
    ("/generate", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/generate", {"prompt": "x", "stop": ["a"] * 33}, "stop"),
    ("/fim", {"prefix": 1}, "prefix"),
    ("/completion", {"prefix": "x", "multiline": "sometimes"}, "multiline"),
    ("/completion", {"prefix": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, 2]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 3}, "n"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 0, "echo": True}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -1}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "top_k": 5}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "stream": False, "stream_options": {"include_usage": False}}, "stream_options"),
])
def test_400_names_the_field(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = msgspec.json.decode(r.content, type=s.ErrorResponse).error
    assert err.param == param and param.split(".")[-1] in err.message and err.type == "invalid_request_error"


def test_refusals_say_why(http):
    err = http.post("/v1/completions", json={"prompt": "x", "n": 2}).json()["error"]
    assert err["message"].startswith("this server returns one choice per request: n must be 1")
    err = http.post("/v1/completions", json={"prompt": "x", "model": "gpt-4"}).json()["error"]
    assert err["code"] == "model_not_found" and "'m31r'" in err["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10_000})  # capped, as llama.cpp's server caps
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= CAP


def test_400_bad_json(http):
    for raw in (b"{", b"[1]", b"\xff", b""):
        r = http.post("/generate", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] in ("bad_json", "invalid")


@pytest.mark.parametrize(("path", "raw", "param"), [
    ("/generate", b'{"prompt": "x", "max_tokens": 1e400}', "max_tokens"),
    ("/v1/completions", b'{"prompt": "x", "temperature": -1E999}', "temperature"),
    ("/fim", b'{"prefix": "x", "context": [{"text": "a"}, {"text": 1e309}]}', "context[1].text"),
    ("/completion", b'[2e308]', None),
])
def test_a_number_past_a_float_names_its_field(http, path, raw, param):
    """A number no 64-bit float holds is a 400 naming its field; msgspec (reading untyped JSON) says `$[...]`, which
    was passed on as the message and as `param: "[...]"`."""
    r = http.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid" and err["param"] == param and "[...]" not in err["message"]
    assert "out of range" in err["message"] and err["message"].startswith(f"{param}: " if param else "the number")


@pytest.mark.parametrize("path", ["/generate", "/fim", "/completion", "/v1/completions"])
def test_deeply_nested_json_is_a_400(http, path):
    """JSON nested thousands deep used to be a RecursionError: a bare text 500."""
    for depth in (1_000, 10_000):  # (10,000 deep still fits the test server's --max-body)
        for raw in (b"[" * depth + b"]" * depth, b'{"prompt": ' + b'{"a":' * depth + b"1" + b"}" * (depth + 1)):
            r = http.post(path, content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, (depth, r.text[:200])
            err = r.json()["error"]
            assert err["code"] == "too_deep" and "nested too deeply" in err["message"]


def test_413(http):
    big = {"prompt": "x" * (MAX_BODY + 1)}
    r = http.post("/generate", json=big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert f"exceeds this server's limit of {MAX_BODY} bytes" in r.json()["error"]["message"]
    # No Content-Length (chunked): Starlette's streaming limit, still JSON, and saying what the limit is (its message
    # was "Content Too Large" alone).
    r = http.post("/generate", content=iter([json.dumps(big).encode()]))
    assert r.status_code == 413 and r.json()["error"]["code"] == "too_large"
    assert r.json()["error"]["message"] == (f"the request body exceeds this server's limit of {MAX_BODY} bytes "
                                            "(m31r serve --max-body)"), r.text


def test_403_host_and_origin(http, server):
    for host in ("evil.example", "evil.example:80", "127.0.0.1.nip.io", "192.168.1.10"):
        r = http.get("/health", headers={"host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden_host", host
    for host in ("localhost", f"localhost:{server.port}", f"127.0.0.1:{server.port}", "[::1]:1", "app.localhost"):
        assert http.get("/health", headers={"host": host}).status_code == 200, host
    # No CORS by default: a browser page's request (it carries an Origin) is refused before any work.
    r = http.post("/generate", json={"prompt": "x", "max_tokens": 1}, headers={"origin": "http://localhost:3000"})
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_404_405(http):
    r = http.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = http.get("/generate")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert http.delete("/health").status_code == 405
    assert http.post("/health").status_code == 405


def test_context_overflow_400(http):
    r = http.post("/generate", json={"prompt": "fn a() {}\n" * 60, "max_tokens": 400})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_overflow"
    r = http.post("/generate", json={"prompt": "fn a() {}\n" * 60, "max_tokens": 400, "stream": True})
    assert r.status_code == 400  # the status waits for the daemon's first event
    ok = http.post("/generate", json={"prompt": "fn a() {}\n" * 60, "max_tokens": 4, "truncate": True})
    assert ok.status_code == 200


def test_context_overflow_says_what_the_endpoint_can_do(http):
    """The way out an overflow's message names is one the endpoint has (/v1/completions takes no `truncate`), and
    `param` is the field to blame: the prompt when it fills the context alone, else max_tokens."""
    fits, too_long = "fn a() {}\n" * 30, "fn a() {}\n" * 60
    err = http.post("/v1/completions", json={"prompt": too_long, "max_tokens": 400}).json()["error"]
    assert err["code"] == "context_overflow" and err["param"] == "prompt", err
    assert "shorten the prompt" in err["message"] and "truncat" not in err["message"]
    err = http.post("/v1/completions", json={"prompt": fits, "max_tokens": 400}).json()["error"]
    assert err["param"] == "max_tokens" and "truncat" not in err["message"], err
    most = int(re.search(r"lower max_tokens to at most (\d+), or shorten the prompt", err["message"]).group(1))
    assert http.post("/v1/completions", json={"prompt": fits, "max_tokens": most}).status_code == 200  # true, too
    assert http.post("/v1/completions", json={"prompt": fits, "max_tokens": most + 1}).status_code == 400
    err = http.post("/generate", json={"prompt": fits, "max_tokens": 400}).json()["error"]
    assert err["param"] == "max_tokens" and "send truncate: true" in err["message"], err


# -- cancellation -----------------------------------------------------------------------------------------------


def _outcome(http, outcome: str) -> float:
    return scrape(http).get(("m31r_http_cancel_outcomes_total", (("outcome", outcome),)), 0.0)


def test_disconnect_mid_stream_cancels(http, server, daemon):
    before = _outcome(http, "cancelled")
    with httpx.Client(base_url=server.url, timeout=30) as c, c.stream(
            "POST", "/generate", json={"prompt": "fn main() {", "max_tokens": CAP, "stream": True}) as r:
        assert r.status_code == 200
        first = next(r.iter_lines())
        assert first.startswith("event: chunk")
    # The connection is closed: the server cancels, and the daemon ends the request early (it answers the
    # Cancel with `cancelled`, not with a finished generation).
    assert wait_for(lambda: _outcome(http, "cancelled") >= before + 1), scrape(http)
    assert wait_for(lambda: daemon_status(daemon["sock"]).active == 0)
    m = scrape(http)
    assert m[("m31r_http_cancelled_total", (("endpoint", "/generate"), ("reason", "disconnect")))] >= 1


def test_disconnect_non_streaming_cancels(http, server, daemon):
    before = _outcome(http, "cancelled")
    gone_before = scrape(http).get(("m31r_http_requests_total", (("endpoint", "/generate"), ("status", "499"))), 0)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as c:
            task = asyncio.ensure_future(c.post("/generate", json={"prompt": "fn main() {", "max_tokens": CAP}))
            async with await Client.connect(daemon["sock"]) as dc:  # wait until the daemon is generating
                t0 = time.monotonic()
                while (await dc.status()).active == 0 and time.monotonic() - t0 < 10 and not task.done():
                    await asyncio.sleep(0.005)
            assert not task.done(), "the request finished before it could be abandoned"
            task.cancel()  # closes the connection
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    assert wait_for(lambda: _outcome(http, "cancelled") >= before + 1), scrape(http)
    assert wait_for(lambda: daemon_status(daemon["sock"]).active == 0)
    gone = scrape(http)[("m31r_http_requests_total", (("endpoint", "/generate"), ("status", "499")))]
    assert gone == gone_before + 1


# -- metrics ----------------------------------------------------------------------------------------------------


def test_metrics_counters_move(http):
    key = ("m31r_http_requests_total", (("endpoint", "/fim"), ("status", "200")))
    before = scrape(http)
    http.post("/fim", json={"prefix": "fn ", "max_tokens": 5})
    after = scrape(http)
    assert after[key] == before.get(key, 0) + 1
    comp = ("m31r_completion_tokens_total", (("endpoint", "/fim"),))
    assert after[comp] > before.get(comp, 0)
    assert after[("m31r_prompt_tokens_total", (("endpoint", "/fim"),))] > 0
    assert ("m31r_cached_tokens_total", (("endpoint", "/fim"),)) in after
    assert after[("m31r_http_first_token_seconds_count", (("endpoint", "/fim"),))] >= 1
    assert after[("m31r_http_request_duration_seconds_count", (("endpoint", "/fim"),))] >= 1
    assert after[("m31r_daemon_up", ())] == 1
    assert after[("m31r_daemon_queue_depth", ())] >= 0 and after[("m31r_daemon_rss_bytes", ())] > 1e6
    assert 0 <= after[("m31r_daemon_cache_hit_ratio", ())] <= 1
    assert ("m31r_http_requests_total", (("endpoint", "/metrics"), ("status", "200"))) in after


# -- load -------------------------------------------------------------------------------------------------------


def post_at_once(url: str, path: str, bodies: list[dict]) -> list[httpx.Response]:
    """Each body POSTed on a connection of its own, all at once."""
    async def go() -> list[httpx.Response]:
        limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
            return await asyncio.gather(*(c.post(path, json=b) for b in bodies))

    return asyncio.run(go())


def test_more_clients_than_the_daemon_takes_from_one_connection(server, daemon):
    """Every HTTP request shares the server's one daemon connection, which the daemon lets carry 16 requests: more
    clients at once than that wait their turn instead of a 503."""
    responses = post_at_once(server.url, "/v1/completions",
                             [{"prompt": f"fn f{i}() {{\n", "max_tokens": 100} for i in range(24)])
    assert [r.status_code for r in responses] == [200] * 24, [r.text for r in responses if r.status_code != 200]


def test_a_daemon_full_of_other_clients_requests_is_a_503(http, daemon):
    """Another client (here a socket one) fills the daemon's queue: a 503 `busy` whose message speaks of the daemon's
    queue, not of a connection the HTTP client cannot see."""
    async def go() -> httpx.Response | None:
        async with await Client.connect(daemon["sock"]) as c:
            # 16 (its --max-queue) beam searches of 400 tokens: the tiny model ends 16 plain ones in under a second,
            # and on a loaded machine they could all end before the daemon had read the 16th and the status after it
            streams = [await c.generate(f"fn f{i}() {{", max_tokens=400, beams=8) for i in range(16)]
            try:
                async with asyncio.timeout(10):
                    while (await c.status()).queue < 16:
                        await asyncio.sleep(0.01)
            except TimeoutError:
                return None  # some ended first: try again
            r = await asyncio.to_thread(http.post, "/v1/completions", json={"prompt": "fn", "max_tokens": 2})
            for st in streams:
                await st.cancel()
            return r if r.status_code == 503 else None

    for _ in range(5):
        if (r := asyncio.run(go())) is not None:
            break
        assert wait_for(lambda: daemon_status(daemon["sock"]).queue == 0)
    assert r is not None, "the daemon's queue never held 16 requests at once"
    err = r.json()["error"]
    assert r.status_code == 503 and err["code"] == "busy" and r.headers["retry-after"] == "1", r.text
    assert err["message"].startswith("the daemon is busy: its queue is full (16 requests in flight, its --max-queue)")
    assert "connection" not in err["message"]
    assert wait_for(lambda: daemon_status(daemon["sock"]).queue == 0)


def test_load_100_concurrent_clients(server, daemon):
    responses = post_at_once(server.url, "/generate", [{"prompt": f"fn f{i}() {{", "max_tokens": 200}
                                                       for i in range(100)])
    ok = busy = 0
    for r in responses:
        if r.status_code == 200:
            g = msgspec.json.decode(r.content, type=s.GenerateResponse)
            assert g.usage.completion_tokens <= 200
            ok += 1
        else:
            assert r.status_code == 503, r.text
            assert r.json()["error"]["code"] == "busy" and int(r.headers["retry-after"]) >= 1
            assert "16 requests in the daemon" in r.json()["error"]["message"]  # the server's own limit
            busy += 1
    # 100 at once: 16 in the daemon (its queue holds 16), 64 waiting their turn, the rest answered `busy` at once.
    assert ok >= 80 and busy >= 1 and ok + busy == 100
    st = daemon_status(daemon["sock"])  # the daemon is still up, and idle again
    assert wait_for(lambda: daemon_status(daemon["sock"]).queue == 0) and st.pid == daemon["proc"].pid
    assert httpx.get(f"{server.url}/health").status_code == 200


# -- security options -------------------------------------------------------------------------------------------


def test_token_and_cors_allow_list(daemon, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    token_file.chmod(0o644)
    bad = subprocess.run([*SERVE, "--token-file", str(token_file), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 1 and "chmod 600" in bad.stderr
    token_file.chmod(0o600)
    origin = "http://localhost:5173"
    srv = Server(tmp_path, daemon["sock"], "--token-file", str(token_file), "--cors-origin", origin)
    try:
        auth = {"authorization": "Bearer s3cret-token"}
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
        assert r.json()["error"]["message"] == "a bearer token is required"
        # A token that is sent but wrong (an editor left with an old one) is told so: "required" would send its user
        # looking for a header that is there.
        for wrong in ("Bearer wrong", "bearer s3cret", "Bearer s3cret-token2"):
            r = httpx.get(f"{srv.url}/health", headers={"authorization": wrong})
            assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer")
            assert r.json()["error"] == {"code": "unauthorized", "type": "invalid_request_error", "param": None,
                                         "message": "the bearer token is not this server's (its --token-file)"}
        for unsent in ("Basic czNjcmV0LXRva2Vu", "s3cret-token", "Bearer"):
            r = httpx.get(f"{srv.url}/health", headers={"authorization": unsent})
            assert r.status_code == 401 and r.json()["error"]["message"] == "a bearer token is required", unsent
        srv.wait_healthy(**auth)
        pre = httpx.options(f"{srv.url}/generate", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
        # A browser app on the OpenAI JS SDK names its own headers; Chrome asks a public page's access to localhost
        # (Private Network Access). Both preflights pass for an allowed origin, and the evil one's still fail.
        sdk = "content-type, authorization, x-stainless-os, x-stainless-lang, x-stainless-retry-count"
        for extra in ({"access-control-request-headers": sdk}, {"access-control-request-private-network": "true"}):
            pre = httpx.options(f"{srv.url}/v1/completions", headers={
                "origin": origin, "access-control-request-method": "POST", **extra})
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin, pre.text
            pre = httpx.options(f"{srv.url}/v1/completions", headers={
                "origin": "http://evil.example", "access-control-request-method": "POST", **extra})
            assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
        pre = httpx.options(f"{srv.url}/v1/completions", headers={
            "origin": origin, "access-control-request-method": "POST", "access-control-request-headers": sdk})
        assert {h.strip() for h in sdk.split(",")} <= {
            h.strip().lower() for h in pre.headers["access-control-allow-headers"].split(",")}
        assert httpx.options(f"{srv.url}/v1/completions", headers={
            "origin": origin, "access-control-request-method": "POST",
            "access-control-request-private-network": "true"}).headers["access-control-allow-private-network"] == "true"
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn", "max_tokens": 2},
                       headers={"origin": origin, **auth})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn", "max_tokens": 2},
                       headers={"origin": "http://evil.example", **auth})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert httpx.get(f"{srv.url}/openapi.json", headers=auth).json()["security"] == [{"bearer": []}]
    finally:
        assert srv.stop() in (0, -15)


def test_bundle_needs_autostart_and_a_folder(tmp_path):
    r = subprocess.run([*SERVE, "--bundle", str(tmp_path), "--no-autostart", "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "no effect with --no-autostart" in r.stderr
    r = subprocess.run([*SERVE, "--bundle", str(tmp_path / "missing"), "--port", str(free_port())],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--bundle" in r.stderr and "does not exist" in r.stderr


def test_refuses_a_remote_bind_without_allow_remote():
    r = subprocess.run([*SERVE, "--host", "0.0.0.0", "--port", str(free_port())], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "--allow-remote" in r.stderr


def test_a_port_in_use_is_one_clear_error_and_starts_no_daemon(tiny_bundle, tmp_path):
    """The port is bound before the app starts (its start-up would autostart a daemon): another program on it is one
    line and exit 1, with no daemon started on --socket and none of uvicorn's start-up lines."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        sock = tmp_path / "never.sock"
        r = subprocess.run([*SERVE, "--port", str(port), "--socket", str(sock), "--bundle", str(tiny_bundle.path)],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.returncode == 1
    assert r.stderr.splitlines()[-1] == (f"error: cannot listen on 127.0.0.1:{port}: the port is in use (another m31r "
                                         "serve, or another program?): choose another with --port")
    assert "Started server process" not in r.stderr and "starting the m31r daemon" not in r.stderr
    assert not sock.exists() and not (tmp_path / "state").exists()


def test_autostart(tiny_bundle, tmp_path):
    """Without --no-autostart, the server starts a daemon when none answers (here: at startup) on --socket, with
    --bundle, and requests wait for it within their timeout."""
    sock = tmp_path / "auto.sock"
    # $M31R_BUNDLE names no bundle: the daemon can only have loaded the tiny one from --bundle.
    srv = Server(tmp_path, sock, "--bundle", str(tiny_bundle.path), autostart=True,
                 env={"M31R_BUNDLE": str(tmp_path / "no-such-bundle"), "XDG_STATE_HOME": str(tmp_path / "state")})
    try:
        r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn", "max_tokens": 2}, timeout=90)
        assert r.status_code == 200, r.text
        st = daemon_status(sock)  # the daemon answers on --socket
        assert Path(st.bundle).resolve() == Path(tiny_bundle.path).resolve() and st.model == tiny_bundle.model_id
    finally:
        srv.stop()

        async def stop_it() -> None:
            async with await Client.connect(sock) as c:
                await c.shutdown()
                await asyncio.wait_for(c.closed.wait(), 30)

        asyncio.run(stop_it())
    log = srv.log.read_text()
    assert "starting the m31r daemon" in log and "connected to the daemon" in log


def test_security_helpers(tmp_path):
    from m31r_http.security import HostPolicy, host_of, is_loopback, load_token
    from m31r_http.server import check_bind

    assert [host_of(h) for h in ("localhost:8731", "[::1]:8731", "::1", "Example.COM.")] == [
        "localhost", "::1", "::1", "example.com"]
    assert all(map(is_loopback, ("localhost", "127.0.0.1", "127.1.2.3", "::1", "a.localhost", "LOCALHOST.")))
    assert not any(map(is_loopback, ("0.0.0.0", "10.0.0.1", "example.com", "localhost.example.com", "::")))
    assert HostPolicy(["box.lan"]).allows("box.lan:8731") and not HostPolicy().allows("box.lan")
    assert not HostPolicy().allows(None) and HostPolicy(["*"]).allows("anything")
    assert check_bind("127.0.0.1", False) and check_bind("localhost", False)
    assert check_bind("0.0.0.0", True) is False
    with pytest.raises(ValueError, match="--allow-remote"):
        check_bind("192.168.1.2", False)
    tok = tmp_path / "tok"
    with pytest.raises(ValueError, match="No such file"):
        load_token(tok)
    tok.write_text("  abc  \n")
    tok.chmod(0o640)
    with pytest.raises(ValueError, match="0640"):
        load_token(tok)
    tok.chmod(0o400)
    assert load_token(tok) == "abc"
    tok.chmod(0o600)
    tok.write_text("two words")
    with pytest.raises(ValueError, match="one token"):
        load_token(tok)


# -- timeout, against a daemon that accepts requests and never answers ---------------------------------------


class StalledDaemon:
    """Speaks the handshake; records Generate/Cancel and never generates: a request gets no answer, or the frame
    `answer` makes of it (a daemon's Error, scripted). Subclasses script more through `on_request`/`on_cancel`."""

    model = "stalled"
    capabilities: tuple[str, ...] = ()

    def __init__(self, path: Path, answer: Callable[[pm.Generate | pm.Fim], pm.Error | None] | None = None):
        self.path, self.received, self.answer = path, [], answer
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        enc, dec, lock = pm.encoder(), pm.client_decoder(), threading.Lock()

        def send(msg) -> None:
            body = enc.encode(msg)
            with lock:  # (a subclass may answer from threads of its own)
                conn.sendall(struct.pack(">I", len(body)) + body)

        f = conn.makefile("rb")
        while len(head := f.read(4)) == 4:
            msg = dec.decode(f.read(struct.unpack(">I", head)[0]))
            self.received.append(msg)
            if isinstance(msg, pm.Hello):
                send(pm.Welcome(protocol=pm.PROTOCOL_VERSION, model=self.model, fingerprint="0", max_context=512,
                                capabilities=list(self.capabilities), daemon_version="test"))
            elif isinstance(msg, pm.Cancel):
                self.on_cancel(msg)
                send(pm.Error(id=msg.id, code="cancelled", message="cancelled by the client"))
            elif isinstance(msg, pm.Generate | pm.Fim):
                self.on_request(msg, send)

    def on_request(self, msg: pm.Generate | pm.Fim, send: Callable[[object], None]) -> None:
        if self.answer and (reply := self.answer(msg)) is not None:
            send(reply)

    def on_cancel(self, msg: pm.Cancel) -> None:
        pass

    def close(self) -> None:
        self.sock.close()


def test_request_timeout_cancels(tmp_path):
    stalled = StalledDaemon(tmp_path / "stalled.sock")
    srv = Server(tmp_path, stalled.path, "--request-timeout", "0.5")
    try:
        for stream in (False, True):
            t0 = time.monotonic()
            r = httpx.post(f"{srv.url}/generate", json={"prompt": "fn", "stream": stream}, timeout=30)
            assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
            assert 0.4 < time.monotonic() - t0 < 10
        gens = [m.id for m in stalled.received if isinstance(m, pm.Generate)]
        assert len(gens) == 2
        assert wait_for(lambda: sorted(m.id for m in stalled.received if isinstance(m, pm.Cancel)) == gens)
    finally:
        srv.stop()
        stalled.close()


def test_requests_wait_their_turn_for_the_daemon_within_the_timeout(tmp_path):
    """The server has at most 16 live requests in the daemon and 64 waiting their turn, each within the request
    timeout (504); more are refused at once, 503 with Retry-After, naming the server's limit. A request that times
    out gives its slot back once its Cancel is sent (the daemon counts only live requests), so on a slow machine some
    of those waiting may reach the daemon before their own time runs out: never more than 16 live at once."""
    stalled = StalledDaemon(tmp_path / "deaf.sock")
    srv = Server(tmp_path, stalled.path, "--request-timeout", "3")

    async def one(c: httpx.AsyncClient, i: int) -> tuple[httpx.Response, float]:
        t0 = time.monotonic()
        r = await c.post("/generate", json={"prompt": f"fn f{i}", "max_tokens": 4})
        return r, time.monotonic() - t0

    async def go() -> list[tuple[httpx.Response, float]]:
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, timeout=30, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(16 + 64 + 4)))

    try:
        answers = asyncio.run(go())
        busy = [(r, dt) for r, dt in answers if r.status_code == 503]
        assert len(busy) == 4, [r.status_code for r, _ in answers]
        for r, dt in busy:
            err = r.json()["error"]
            assert err["code"] == "busy" and r.headers["retry-after"] == "1" and dt < 2.5, (err, dt)
            assert "16 requests in the daemon" in err["message"] and "64 more waiting" in err["message"]
        assert all(r.status_code == 504 and r.json()["error"]["code"] == "timeout" for r, _ in answers
                   if r.status_code != 503)
        live = peak = 0
        for msg in list(stalled.received):
            live += isinstance(msg, pm.Generate) - isinstance(msg, pm.Cancel)
            peak = max(peak, live)
        assert peak == 16
    finally:
        srv.stop()
        stalled.close()


# Errors as a daemon words them, each with the detail the adapter words its own from: the prompt names the case.
# The daemon's wording is not this release's (a daemon's message may change); the adapter must not read it.
SCRIPTED_ERRORS = {
    "busy-connection": ("busy", pm.BusyDetail("connection", 4)),
    "busy-daemon": ("busy", pm.BusyDetail("daemon", 32)),
    "busy-loading": ("busy", pm.BusyDetail("loading", 32)),
    "overflow-prompt": ("context_overflow", pm.OverflowDetail(600, 16, 512)),
    "overflow-max-tokens": ("context_overflow", pm.OverflowDetail(300, 400, 512)),
}


def scripted_error(req: pm.Generate | pm.Fim) -> pm.Error:
    """The scripted daemon's answer: the error the prompt names, with its detail unless the prompt starts `old:` (a
    daemon from before the detail, which words it as this release's did)."""
    name = req.prompt if isinstance(req, pm.Generate) else req.prefix
    code, detail = SCRIPTED_ERRORS[name.removeprefix("old:")]
    if name.startswith("old:"):
        message = ("16 requests in flight on this connection (limit 16 per connection, --max-per-connection); retry "
                   "shortly" if code == "busy" else "prompt (600 tokens) + max_tokens (16) = 616 exceeds the model's "
                   "context of 512 tokens; shorten the prompt, lower max_tokens, or ask for truncation")
        return pm.Error(id=req.id, code=code, message=message)
    kind = "busy" if code == "busy" else "overflow"
    return pm.Error(id=req.id, code=code, message=f"la demande est refusée ({name})", **{kind: detail})


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    """A server in front of a daemon that answers every request with the error its prompt names."""
    tmp = tmp_path_factory.mktemp("scripted")
    daemon = StalledDaemon(tmp / "errors.sock", scripted_error)
    srv = Server(tmp, daemon.path)
    yield srv
    srv.stop()
    daemon.close()


def test_daemon_errors_are_worded_from_their_detail(scripted):
    """The adapter words busy and context_overflow from the Error's detail, never from the daemon's message (here in
    another wording altogether): which limit was hit, and the way out this endpoint has, in its own field names."""
    def post(path: str, prompt: str, **body) -> tuple[int, dict]:
        r = httpx.post(f"{scripted.url}{path}", json={"prompt": prompt, **body}, timeout=30)
        return r.status_code, r.json()

    status, body = post("/generate", "busy-connection")
    assert status == 503 and body["error"]["code"] == "busy", body
    assert body["error"]["message"] == ("the daemon takes fewer requests at once from this server than the 16 it sends "
                                        "(the daemon's --max-per-connection is 4); retry shortly")
    status, body = post("/generate", "busy-daemon")
    assert status == 503 and body["error"]["message"] == (
        "the daemon is busy: its queue is full (32 requests in flight, its --max-queue), with this server's requests "
        "and other clients' (editors, other servers); retry shortly"), body
    status, body = post("/generate", "busy-loading")
    assert status == 503 and "its queue is full (32 requests wait for the model to load" in body["error"]["message"]
    status, body = post("/generate", "overflow-prompt")
    assert status == 400 and body["error"]["code"] == "context_overflow" and body["error"]["param"] == "prompt"
    assert body["error"]["message"] == (
        "prompt (600 tokens) + max_tokens (16) = 616 exceeds the model's context of 512 tokens: the prompt alone "
        "fills it; shorten the prompt, or send truncate: true to keep the prompt's end")
    status, body = post("/v1/completions", "overflow-max-tokens", max_tokens=400)
    assert status == 400 and body["error"]["param"] == "max_tokens", body
    assert body["error"]["message"] == (
        "prompt (300 tokens) + max_tokens (400) = 700 exceeds the model's context of 512 tokens: lower max_tokens to "
        "at most 212, or shorten the prompt")  # /v1/completions has no `truncate`
    status, body = post("/api/generate", "overflow-max-tokens", model="m31r", stream=False,
                        options={"num_predict": 400})
    assert status == 400 and body["error"].startswith(  # Ollama's names
        "prompt (300 tokens) + options.num_predict (400) = 700 exceeds the model's context of 512 tokens: lower "
        "options.num_predict to at most 212"), body


def test_an_older_daemons_errors_pass_through(scripted):
    """A daemon from before the Error's detail: its busy and context_overflow messages are passed on as they are,
    with the same statuses (nothing is parsed out of them)."""
    r = httpx.post(f"{scripted.url}/generate", json={"prompt": "old:busy-connection"}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["message"] == ("16 requests in flight on this connection (limit 16 per connection, "
                                            "--max-per-connection); retry shortly")
    r = httpx.post(f"{scripted.url}/generate", json={"prompt": "old:overflow-prompt"}, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_overflow" and err["param"] is None, err
    assert err["message"] == ("prompt (600 tokens) + max_tokens (16) = 616 exceeds the model's context of 512 tokens; "
                              "shorten the prompt, lower max_tokens, or ask for truncation")


# -- schemathesis -----------------------------------------------------------------------------------------------


# (schemathesis' own pytest integration, `schemathesis.pytest.from_fixture`, breaks on pytest 9: its lazy schema
# reads `request.node._nodeid`. The same generation and checks through the public strategy API instead.)


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_schemathesis(server, mode):
    """Generated requests, valid and invalid, for every operation (10 each, derandomized): no 5xx, documented
    statuses, headers and content types, bodies (SSE events included) that fit the documented schemas, valid
    data accepted and invalid data refused."""
    # Invalid data may also be refused 413: a string past its maxLength can take the body past the size limit.
    statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429", "5xx"]
    config = SchemathesisConfig.from_dict({"checks": {"negative_data_rejection": {"expected-statuses": statuses}}})
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json", config=config)
    operations = [result.ok() for result in schema.get_all_operations()]
    # Every documented operation but the document itself, which schemathesis leaves out.
    assert {op.path for op in operations} == set(schema.raw_schema["paths"]) - {"/openapi.json"}
    for op in operations:
        if mode == schemathesis.GenerationMode.NEGATIVE and not op.body:
            continue  # nothing to get wrong in a GET without parameters

        @given(case=op.as_strategy(mode))
        @settings(max_examples=10, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case) -> None:
            case.call_and_validate(base_url=server.url)

        check()


# -- last: it restarts the daemon under the module's server ---------------------------------------------------


def test_daemon_restart_reconnects(http, daemon):
    assert http.post("/generate", json={"prompt": "fn", "max_tokens": 2}).status_code == 200
    connects = scrape(http)[("m31r_daemon_connects_total", ())]
    stop_daemon(daemon["proc"])
    r = http.get("/health")
    assert r.status_code == 503 and r.json()["status"] == "unavailable" and "retry-after" in r.headers
    r = http.post("/generate", json={"prompt": "fn", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable" and "retry-after" in r.headers
    assert scrape(http)[("m31r_daemon_up", ())] == 0
    daemon["proc"] = start_daemon(daemon["bundle"], daemon["sock"], *daemon["extra"])
    assert wait_for(lambda: http.get("/health").status_code == 200, timeout=30)
    assert http.post("/generate", json={"prompt": "fn", "max_tokens": 2}).status_code == 200
    assert scrape(http)[("m31r_daemon_connects_total", ())] == connects + 1

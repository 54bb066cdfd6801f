"""Tabby's API on `m31r serve`, for Tabby's editor plugins (tabby-agent): requests built field for field as tabby-agent
builds them (TabbyML/tabby `clients/tabby-agent/src`: `http/tabbyApiClient.ts` connect, healthCheck,
updateServerProvidedConfig, fetchCompletion, postEvent; `codeCompletion/buildRequest.ts`; `codeCompletion/index.ts`),
against a real server in front of a real daemon on the tiny random-weight bundle.

A random-weight model writes noise, so answers are compared with /fim's for the same request (greedy: the same input
gives the same text). What reaches the daemon (the snippets' order and cut, the stop words, CRLF) is checked on a
protocol-speaking stand-in that records it (test_llamacpp_api's WritingDaemon), still through the real server.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re

import httpx
import pytest
from test_http import Server, healthy_server, token_server, wait_for
from test_llamacpp_api import WritingDaemon

from m31r_protocol import Client
from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

CAP = 128  # the server's --max-tokens-cap: above Tabby's 64, which is what a Tabby request gets
PREFIX = "use std::fmt;\n\nfn main() {\n    let total = add(1, 2);\n    println!("
SUFFIX = ");\n}\n"
RUST_STOPS = ["\n\n", "\n//", "\nfn", "\ntrait", "\nimpl", "\nenum", "\npub", "\nextern", "\nstatic", "\nunsafe",
              "\nuse"]
# tabby-agent's user agent: `${envInfo} ${tabbyAgentInfo} ${ideInfo} ${tabbyPluginInfo}`
AGENT_HEADERS = {"user-agent": "Node.js/v20.18.0 tabby-agent/1.9.0-dev vscode/1.95.3 TabbyML.vscode-tabby/1.9.4"}
REPO = "https://github.com/example/demo.git"


def declarations(n: int) -> list[dict]:
    return [{"filepath": f"src/d{i}.rs", "body": f"pub fn add{i}(a: u32, b: u32) -> u32 {{\n    a + b + {i}\n}}"}
            for i in range(n)]


def changed(n: int) -> list[dict]:
    return [{"filepath": f"src/c{i}.rs", "body": f"let c{i} = add(1, {i});", "score": 0.9 - i / 10} for i in range(n)]


def opened(n: int) -> list[dict]:
    return [{"filepath": f"src/o{i}.rs", "body": f"struct O{i};", "score": 1} for i in range(n)]


def agent_request(prefix: str = PREFIX, suffix: str = SUFFIX, temperature: float | None = None,
                  n: tuple[int, int, int] = (2, 2, 2), filepath: str = "src/main.rs", git_url: str | None = REPO,
                  language: str = "rust") -> dict:
    """tabby-agent's fetchCompletion body: `{language, segments: buildRequest(...), temperature}` where buildRequest
    gives prefix, suffix, filepath (relative to the git root), git_url (the origin remote; left out outside a git
    repository) and the three snippet lists (left out when empty); temperature is undefined, so left out, but for
    its "more choices" requests (0.8)."""
    d, c, o = n
    segments = {"prefix": prefix, "suffix": suffix, "filepath": filepath}
    if git_url is not None:
        segments["git_url"] = git_url
    if d:
        segments["declarations"] = declarations(d)
    if c:
        segments["relevant_snippets_from_changed_files"] = changed(c)
    if o:
        segments["relevant_snippets_from_recently_opened_files"] = opened(o)
    body = {"language": language, "segments": segments}
    if temperature is not None:
        body["temperature"] = temperature
    return body


def snippet_context(n: tuple[int, int, int]) -> list[dict]:
    """What the snippets reach the daemon as: declarations, then changed, then opened files', the first 8."""
    d, c, o = n
    found = [*declarations(d), *changed(c), *opened(o)][:8]
    return [{"text": x["body"], "path": x["filepath"]} for x in found]


def semver_coerce(version: str) -> tuple[int, int, int] | None:
    """node-semver's coerce (tabby-agent gates /v1beta/server_setting on it): the first run of 1 to 3 dotted numbers."""
    m = re.search(r"(?:^|[^\d])(\d{1,16})(?:\.(\d{1,16}))?(?:\.(\d{1,16}))?(?:$|[^\d])", version)
    return None if m is None else tuple(int(g or 0) for g in m.groups())  # type: ignore[return-value]


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "tabby", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60, headers=AGENT_HEADERS) as c:
        yield c


def test_agent_connects(http, tiny_bundle):
    """tabby-agent's connect(): GET /v1/health (ready on a 2xx; completion offered when `model` is set, chat when
    `chat_model` is; it reads version.git_describe and device), then, the version being 0.9.0 or later,
    GET /v1beta/server_setting, whose disable_client_side_telemetry turns its usage reports to TabbyML off."""
    r = http.get("/v1/health")
    assert r.status_code == 200, r.text
    h = r.json()
    assert h["model"] == tiny_bundle.model_id and "chat_model" not in h and h["webserver"] is None
    assert h["device"] == "cpu" and h["cuda_devices"] == []  # (the test daemon runs on the CPU)
    assert h["models"] == {"completion": {"local": {"model_id": tiny_bundle.model_id, "device": "cpu"}}}
    assert h["arch"] and h["cpu_info"] and isinstance(h["cpu_count"], int) and h["cpu_count"] >= 1
    assert set(h["version"]) == {"build_date", "build_timestamp", "git_sha", "git_describe"}
    assert h["version"]["git_describe"].startswith("v0.") and "-m31r-" in h["version"]["git_describe"]
    assert semver_coerce(h["version"]["git_describe"]) >= (0, 9, 0)
    assert http.post("/v1/health").json() == h  # (its fallback where GET is a 405; older Tabby clients' method)
    r = http.get("/v1beta/server_setting")
    assert r.status_code == 200 and r.json() == {"disable_client_side_telemetry": True}


def test_agent_completion(http):
    """tabby-agent's completion request, field for field: answered as Tabby answers (`id`, one choice at index 0,
    the text to insert at the cursor), the same text as /fim's for the same prefix, suffix, snippets (the Fim's
    context, in Tabby's order), Tabby's stop words for Rust and its 64 tokens."""
    r = http.post("/v1/completions", json=agent_request())
    assert r.status_code == 200, r.text
    a = r.json()
    assert set(a) == {"id", "choices", "mode"} and a["mode"] == "standard" and a["id"].startswith("cmpl-")
    [choice] = a["choices"]
    assert choice["index"] == 0
    whole = http.post("/fim", json={"prefix": PREFIX, "suffix": SUFFIX, "context": snippet_context((2, 2, 2)),
                                    "stop": RUST_STOPS, "max_tokens": 64})
    assert whole.status_code == 200 and choice["text"] == whole.json()["text"]
    assert "x-m31r-ignored-options" not in r.headers  # (filepath and git_url name the document: see below)
    # its "more choices" requests sample (temperature 0.8, no seed): answered, each its own id
    again = http.post("/v1/completions", json=agent_request(temperature=0.8))
    assert again.status_code == 200 and len(again.json()["choices"]) == 1 and again.json()["id"] != a["id"]
    # an editor without snippets (the lists left out) and a language other than Rust
    r = http.post("/v1/completions", json={**agent_request(n=(0, 0, 0)), "language": "python"})
    whole = http.post("/fim", json={"prefix": PREFIX, "suffix": SUFFIX, "stop": ["\n\n"], "max_tokens": 64})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == whole.json()["text"]


def test_openai_requests_unchanged(http):
    """/v1/completions is also the OpenAI endpoint: a request with `prompt` is answered as before, beside Tabby's."""
    assert http.post("/v1/completions", json=agent_request()).status_code == 200
    r = http.post("/v1/completions", json={"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 8})
    assert r.status_code == 200, r.text
    a = r.json()
    assert a["object"] == "text_completion" and a["usage"]["completion_tokens"] <= 8
    whole = http.post("/fim", json={"prefix": PREFIX, "suffix": SUFFIX, "max_tokens": 8}).json()
    assert a["choices"][0]["text"] == whole["text"] and "x-m31r-ignored-options" not in r.headers
    # `prompt` makes it OpenAI's, which refuses what it does not know, as it did
    r = http.post("/v1/completions", json={**agent_request(), "prompt": PREFIX})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] in ("language", "segments") and "unknown field" in err["message"]


def test_newest_request_for_a_file_wins(server, shared_daemon):
    """tabby-agent names the file it completes in (`filepath`, relative to the repository whose remote is `git_url`):
    the daemon holds its requests for one file as one document, so a newer request supersedes an older one still
    running (a 409 `cancelled` saying so, as for /fim's `path`), while another file's, or the same path in another
    repository, runs on. (tabby-agent also closes its older request itself; a second editor on the file may not.)"""
    sock = shared_daemon[1]

    async def attempt(i: int) -> bool:
        """True once the first request was superseded; False where it ended before the second came (retried)."""
        prefix = f"fn attempt_{i}() {{\n" + "    let value = compute(1, 2, 3);\n" * 8 + "    let x = "
        path = f"src/newest_{i}.rs"

        def post(text: str, filepath: str = path, git_url: str = REPO) -> asyncio.Future[httpx.Response]:
            body = agent_request(prefix=text, suffix=";\n}\n", n=(0, 0, 0), filepath=filepath, git_url=git_url,
                                 language="python")  # (python: only the blank line stops it)
            return asyncio.ensure_future(c.post("/v1/completions", json=body))

        async def held(n: int, first: asyncio.Future) -> bool:
            """Wait until the daemon holds n requests; False if the first ended before."""
            while not first.done():
                st = await dc.status()
                if st.active + st.queue >= n:
                    return True
                await asyncio.sleep(0.002)
            return False

        async with httpx.AsyncClient(base_url=server.url, timeout=60, headers=AGENT_HEADERS) as c, \
                await Client.connect(sock) as dc:
            first = post(prefix)
            others = []
            if await held(1, first):
                others = [post(prefix, filepath=f"src/other_{i}.rs"), post(prefix, git_url=REPO + ".fork")]
                if await held(3, first):
                    others.append(post(prefix + "2"))
            done = await asyncio.gather(first, *others)
        for r in done[1:]:  # another file's, the same path in another repository's, and the newest: answered
            assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text
        if len(others) < 3 or done[0].status_code == 200:
            return False  # the first ended before the newest came
        err = done[0].json()["error"]
        assert done[0].status_code == 409 and err["code"] == "cancelled" and "superseded" in err["message"], err
        return True

    for i in range(10):  # on a starved machine the first request may end before the newest arrives
        if asyncio.run(attempt(i)):
            break
    else:
        pytest.fail("the older request for the file was never superseded")


def test_typing_through_a_suggestion_is_answered_from_it(http, shared_daemon):
    """A request for the same file whose prefix has gained the start of the last suggestion (the user typed it) is
    answered with the rest of that suggestion by the daemon, without the model (typed-through)."""
    def typed_through() -> int:
        return sum(json.loads(line).get("source") == "typed_through" for line in list(shared_daemon[0].log_lines)
                   if line.startswith("{"))

    for i in range(5):  # a prefix whose suggestion has text left once its first character is typed
        prefix = f"{PREFIX}{i}"
        r = http.post("/v1/completions", json=agent_request(prefix=prefix, filepath="src/typed.rs"))
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        if len(text) >= 2:
            break
    else:
        pytest.fail("no suggestion long enough to type through")
    before = typed_through()
    r = http.post("/v1/completions", json=agent_request(prefix=prefix + text[0], filepath="src/typed.rs"))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == text[1:], r.text
    assert wait_for(lambda: typed_through() == before + 1, timeout=5), "not answered from the last suggestion"


def test_events_accepted_and_dropped(http):
    """tabby-agent's postEvent: `?select_kind=line` and the event's body; 200 with nothing to read (parsed as text).
    What Tabby refuses (an unknown type, a body not of its shape) is a 400."""
    for event in ({"type": "view", "completion_id": "cmpl-1", "choice_index": 0, "view_id": "view-1"},
                  {"type": "select", "select_kind": "line", "completion_id": "cmpl-1", "choice_index": 0,
                   "view_id": "view-1", "elapsed": 1234},
                  {"type": "dismiss", "completion_id": "cmpl-1", "choice_index": 0, "view_id": "view-1",
                   "elapsed": 50}):
        r = http.post("/v1/events", params={"select_kind": "line"} if "select_kind" in event else None, json=event)
        assert r.status_code == 200 and r.content == b"", r.text
    r = http.post("/v1/events", json={"type": "share", "completion_id": "cmpl-1", "choice_index": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "type"
    r = http.post("/v1/events", json={"type": "view"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "completion_id"


@pytest.mark.parametrize(("change", "param", "words"), [
    (lambda b: b["segments"].pop("prefix"), "segments.prefix", "prefix"),
    (lambda b: b["segments"].update(declarations=[{"body": "fn a() {}"}]), "segments.declarations[0].filepath",
     "filepath"),
    (lambda b: b.update(mode="next_edit_suggestion"), "mode", "next edit suggestions are not supported"),
    (lambda b: b.update(debug_options={"raw_prompt": "fn"}), "debug_options", "not supported"),
    (lambda b: b.update(temperature=5), "temperature", "<= 2"),
])
def test_errors(http, change, param, words):
    """Tabby answers errors with a status and no body (tabby-agent reads only the status): here they are 400s in the
    shape of the endpoint's OpenAI errors, naming the field."""
    body = agent_request()
    change(body)
    r = http.post("/v1/completions", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and words in err["message"], r.text


def test_metrics_and_openapi(http):
    http.get("/v1/health")
    http.post("/v1/events", json={"type": "view", "completion_id": "cmpl-1", "choice_index": 0})
    metrics = http.get("/metrics").text
    for path in ("/v1/health", "/v1/events"):
        assert re.search(rf'm31r_http_requests_total\{{endpoint="{path}",status="200"\}} [1-9]', metrics), path
    doc = http.get("/openapi.json").json()
    assert {"/v1/health", "/v1beta/server_setting", "/v1/events"} <= set(doc["paths"])
    schemas = doc["components"]["schemas"]
    assert {"TabbyCompletionRequest", "TabbyCompletionResponse", "TabbyHealth", "TabbyEvent"} <= set(schemas)
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {"$ref": "#/components/schemas/TabbyCompletionRequest"} in body["anyOf"]


def test_token_and_host(shared_daemon, tmp_path):
    """tabby-agent sends `Authorization: Bearer <its [server] token>` when one is set: without it every endpoint is a
    401 (the agent's "unauthorized" state); the Host check holds as on every endpoint."""
    with token_server(tmp_path, shared_daemon[1]) as srv:
        auth = {**AGENT_HEADERS, "authorization": "Bearer s3cret"}
        for method, path, body in (("GET", "/v1/health", None), ("GET", "/v1beta/server_setting", None),
                                   ("POST", "/v1/completions", agent_request()),
                                   ("POST", "/v1/events", {"type": "view", "completion_id": "c", "choice_index": 0})):
            r = httpx.request(method, f"{srv.url}{path}", json=body, headers=AGENT_HEADERS, timeout=30)
            assert r.status_code == 401, (path, r.text)
            r = httpx.request(method, f"{srv.url}{path}", json=body, headers=auth, timeout=30)
            assert r.status_code == 200, (path, r.text)
        r = httpx.get(f"{srv.url}/v1/health", headers={**auth, "host": "evil.example"})
        assert r.status_code == 403


def test_no_daemon_is_a_503(tmp_path):
    """No daemon: the health check is a 503 (the agent's "noConnection", retried every 30 s), as is a completion."""
    srv = Server(tmp_path, tmp_path / "none.sock")  # --no-autostart, and nothing listens there
    try:
        r = httpx.get(f"{srv.url}/v1/health", timeout=30)
        assert r.status_code == 503 and "retry-after" in r.headers and "daemon" in r.json()["error"]["message"]
        r = httpx.post(f"{srv.url}/v1/completions", json=agent_request(), timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable", r.text
    finally:
        srv.stop()


@pytest.fixture
def recording(tmp_path):
    daemon = WritingDaemon(tmp_path / "w.sock", ["let x = 1;", "\n", "    x"])
    srv = Server(tmp_path, daemon.path)
    try:
        yield srv, daemon
    finally:
        srv.stop()
        daemon.close()


def sent_fim(daemon: WritingDaemon) -> pm.Fim:
    [fim] = [m for m in daemon.received if isinstance(m, pm.Fim)]
    return fim


def test_what_reaches_the_daemon(recording):
    """The Fim a Tabby request becomes: the snippets in Tabby's order of priority (declarations, changed files',
    opened files'), the first 8; Tabby's stop words for Rust; 64 tokens; greedy; the request's seed."""
    srv, daemon = recording
    r = httpx.post(f"{srv.url}/v1/completions", json={**agent_request(n=(5, 3, 5)), "seed": 7}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"] == [{"index": 0, "text": "let x = 1;\n    x"}], r.text
    fim = sent_fim(daemon)
    assert (fim.prefix, fim.suffix, fim.max_tokens, fim.stop, fim.seed) == (PREFIX, SUFFIX, 64, RUST_STOPS, 7)
    assert [{"text": c.text, "path": c.path} for c in fim.context] == snippet_context((5, 3, 5))
    assert [c.path for c in fim.context] == [*(f"src/d{i}.rs" for i in range(5)), "src/c0.rs", "src/c1.rs",
                                             "src/c2.rs"]
    assert fim.sampling.temperature == 0
    assert fim.document == 'tabby:["https://github.com/example/demo.git","src/main.rs"]'  # the file, in its repository
    assert "x-m31r-ignored-options" not in r.headers


def test_document_key(recording):
    """The daemon's document is Tabby's own (a /fim or language-server request for the same file is not superseded by
    it), the file's path and its repository's remote; outside a git repository (no git_url) the path alone; and
    without a filepath there is none, git_url then changing nothing (X-M31R-Ignored-Options names it). A key longer
    than /fim's longest path is hashed."""
    srv, daemon = recording
    long = "src/" + "a" * 5000 + ".rs"
    hashed = "tabby:sha256:" + hashlib.sha256(json.dumps([REPO, long], separators=(",", ":")).encode()).hexdigest()
    for segments, document, ignored in (({"git_url": None}, 'tabby:["","src/main.rs"]', None),
                                        ({"filepath": None}, "", "segments.git_url"),
                                        ({"filepath": ""}, "", "segments.git_url"),
                                        ({"filepath": long}, hashed, None)):  # (a key past 4096 characters)
        body = agent_request(n=(0, 0, 0))
        body["segments"].update(segments)
        body["segments"] = {k: v for k, v in body["segments"].items() if v is not None}
        daemon.received.clear()
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.headers.get("x-m31r-ignored-options") == ignored, r.text
        assert sent_fim(daemon).document == document


def test_crlf(recording):
    """A document with CRLF line ends: the prompt is given LF and the answer CRLF, as Tabby does."""
    srv, daemon = recording
    body = agent_request(prefix=PREFIX.replace("\n", "\r\n"), suffix=SUFFIX.replace("\n", "\r\n"), n=(1, 0, 0))
    body["segments"]["declarations"][0]["body"] = "fn a() {\r\n}"
    r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "let x = 1;\r\n    x", r.text
    fim = sent_fim(daemon)
    assert (fim.prefix, fim.suffix, fim.context[0].text) == (PREFIX, SUFFIX, "fn a() {\n}")

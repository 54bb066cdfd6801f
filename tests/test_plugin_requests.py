"""Editor plugins that can complete code through a local Ollama or OpenAI-compatible server, replayed against
`m31r serve`: each plugin's request built field for field and header for header as its own source builds it, its
answer parsed as its own source parses it, and the text it gets compared with /fim's for the same prefix, suffix,
token budget and stop strings (greedy, so the same input gives the same text; the tiny random-weight model writes
noise, so any difference in what reaches the daemon shows). Each plugin's own post-processing of the text (indentation,
bracket balance, dropping its stop words) is editor-side and the same whatever the server, so it is not repeated.

Sources read (function names, so a later version can be checked the same way):
- Continue (continuedev/continue): core/llm/llms/Ollama.ts (ensureModelInfo, _getGenerateOptions, _streamFim,
  _streamComplete), core/llm/llms/OpenAI.ts (_legacystreamComplete, _getHeaders), core/llm/index.ts (streamFim,
  streamComplete, the 4096-token default maxTokens), core/autocomplete/ (CompletionProvider: temperature 0.01 unless
  set; CompletionStreamer: supportsFim() ? streamFim : streamComplete(raw); templating/AutocompleteTemplate.ts: the
  `<fim_prefix>` template for an unknown model; templating/formatting.ts: the path comment before the prefix),
  packages/fetch/src/stream.ts (streamResponse, streamSse).
- minuet-ai.nvim (milanglacier/minuet-ai.nvim): lua/minuet/backends/openai_base.lua (complete_openai_fim_base),
  backends/openai_fim_compatible.lua (get_text_fn), utils.lua (stream_decode, make_curl_args, add_language_comment),
  config.lua (default_fim_template), README.md's Ollama and recipes.md's llama.cpp configurations.
- llm.nvim / llm-ls (huggingface): llm.nvim lua/llm/config.lua (default_request_bodies, fim tokens), llm-ls
  crates/llm-ls/src/backend.rs (build_body, build_headers, parse_*_text), main.rs (build_prompt, build_url,
  format_generations).
- Twinny (twinnydotdev/twinny): src/extension/provider-options.ts (createStreamRequestBodyFim),
  providers/completion.ts (buildFimRequest, getPromptHeader), fim-templates.ts (the CodeLlama default), llm.ts
  (the line parser), utils.ts (getFimDataFromProvider, safeParseJsonResponse), package.json (defaults).
- llama-coder (ex3ndr/llama-coder): src/prompts/autocomplete.ts, processors/models.ts (adaptPrompt), config.ts (a
  "custom" model always gets the CodeLlama layout: it reads the format setting as `cutom.format`),
  modules/ollamaCheckModel.ts, lineGenerator.ts.
- cmp-ai (tzachar/cmp-ai): lua/cmp_ai/backends/ollama.lua, backends/tabby.lua, requests.lua.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator

import httpx
import pytest
from test_http import Server, StalledDaemon, healthy_server

from m31r_http.tabby import RUST_STOPS
from m31r_protocol import messages as pm

pytestmark = pytest.mark.timeout(120)

CAP = 64  # the server's --max-tokens-cap: below what Continue (4096) and Twinny (512) ask for
HALF_CONTEXT = 256  # the tiny model's FIM limit (half its context of 512)
PREFIX = "fn add(a: u32, b: u32) -> u32 {\n    let sum = a"
SUFFIX = "\n    sum\n}\n"  # the cursor at a line's end, as inline completion mostly has it
CONTINUE_STOPS = ["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<|endoftext|>", "</fim_middle>",
                  "</code>", "/src/", "#- coding: utf-8", "```"]  # its stableCode template's, then its common ones
CONTINUE_PREFIX = "\n// src/main.rs\n" + PREFIX  # formatSnippets with no snippets: the file's path as a comment
TWINNY_HEADER = "\n/* Language: Rust (rust) */\n/* File uri: file:///home/dev/demo/src/main.rs (rust) */\n"
MINUET_PREFIX = "// language: rust\n// indentation: use 4 spaces for a tab\n" + PREFIX


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "plugins", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def fim(http: httpx.Client, prefix: str, suffix: str, max_tokens: int, stop: list[str] | None = None) -> str:
    """/fim's greedy text for the same request: what each plugin should get."""
    r = http.post("/fim", json={"prefix": prefix, "suffix": suffix, "max_tokens": max_tokens, "stop": stop or []})
    assert r.status_code == 200, r.text
    return r.json()["text"]


def post(http: httpx.Client, path: str, body: dict, headers: dict[str, str]) -> httpx.Response:
    """The request as the plugin sends it: its own serialisation of the body (compact JSON, as JSON.stringify and
    serde_json write it) and exactly its headers (httpx adds only Host, Content-Length and its defaults)."""
    r = http.post(path, content=json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode(),
                  headers=headers)
    assert r.status_code == 200, r.text
    return r


# -- the plugins' parsers, ported ------------------------------------------------------------------------------


def ndjson_lines(raw: str) -> Iterator[dict]:
    """Continue's, Twinny's and llama-coder's reading of Ollama's stream: split at "\\n", JSON-parse each line."""
    for line in raw.split("\n"):
        if line.strip():
            yield json.loads(line)


def continue_ollama(raw: str, fim_path: bool) -> str:
    """Continue's Ollama _streamFim (yields `response` when the key is there, throws on `error`) or _streamComplete
    (throws on `error`, yields `response ?? ""`)."""
    out = ""
    for j in ndjson_lines(raw):
        if "error" in j and (not fim_path or "response" not in j):
            raise AssertionError(j["error"])
        out += j["response"] if fim_path else (j.get("response") or "")
    return out


def continue_sse(raw: str) -> str:
    """Continue's streamSse (packages/fetch): `data:` lines parsed, `data: [DONE]` or `: ping` ends the stream, an
    `error` field throws; _legacystreamComplete keeps `choices[0].text` when truthy and finish_reason is not "eos"."""
    out = ""
    for line in raw.split("\n"):
        if line.startswith(("data:[DONE]", "data: [DONE]", ": ping")):
            break
        if line.startswith("data:"):
            data = json.loads(line[6:] if line.startswith("data: ") else line[5:])
            assert not data.get("error"), data
            text = (data.get("choices") or [{}])[0].get("text")
            if text and data.get("finish_reason") != "eos":
                out += text
    return out


def minuet_stream(raw: str) -> str:
    """minuet's utils.stream_decode: each line with a leading `data:` removed, JSON-decoded (lines that do not decode,
    `[DONE]` among them, are skipped), `choices[1].text` kept when a non-empty string."""
    out = []
    for line in raw.split("\n"):
        try:
            text = json.loads(re.sub(r"^data:", "", line))["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            continue
        if isinstance(text, str) and text:
            out.append(text)
    return "".join(out)


def twinny(raw: str, stop_words: list[str]) -> str:
    """Twinny's llm() transform (lines; a `data:` prefix is cut) and onData (getFimDataFromProvider: `response` for
    its Ollama provider), ending at a stop word, which removeStopWords then drops."""
    completion = ""
    for line in raw.split("\n"):
        try:
            data = json.loads(line.split("data:")[1] if line.startswith("data:") else line)
        except ValueError:
            continue
        completion += data.get("response") or ""
        if any(w in completion for w in stop_words):
            break
    for w in stop_words:
        completion = completion.replace(w, "")
    return completion


# -- Continue --------------------------------------------------------------------------------------------------


def test_continue_ollama(http, server):
    """Continue with `provider: ollama`: /api/show (its FIM test: `.Suffix` in the template; num_ctx from the
    parameters), then _streamFim: prefix and suffix apart, num_predict its default 4096 (over any cap: capped, as
    Ollama refuses no num_predict), the template's stop words, num_ctx, keep_alive 1800 seconds, no `stream`."""
    show = post(http, "/api/show", {"name": "m31r"}, {"Content-Type": "application/json"}).json()
    assert ".Suffix" in show["template"]
    params = dict(re.match(r"^(\S+)\s+((?:\".*\")|\S+)$", ln).groups() for ln in show["parameters"].split("\n"))
    num_ctx = int(params["num_ctx"])
    body = {"model": "m31r", "prompt": CONTINUE_PREFIX, "suffix": SUFFIX,
            "options": {"temperature": 0, "num_predict": 4096, "stop": CONTINUE_STOPS, "num_ctx": num_ctx},
            "keep_alive": 1800}
    r = post(http, "/api/generate", body, {"Content-Type": "application/json"})
    assert continue_ollama(r.text, fim_path=True) == fim(http, CONTINUE_PREFIX, SUFFIX, CAP, CONTINUE_STOPS)


def test_continue_ollama_before_show_answers(http):
    """Until /api/show has answered, Continue's supportsFim() is false: its first completion is streamComplete with
    the `<fim_prefix>` template (its default for a model it does not know) and `raw: true`, num_ctx its default 8192.
    That layout is split back into prefix and suffix."""
    prompt = f"<fim_prefix>{CONTINUE_PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    body = {"model": "m31r", "prompt": prompt, "raw": True,
            "options": {"temperature": 0, "num_predict": 4096, "stop": CONTINUE_STOPS, "num_ctx": 8192},
            "keep_alive": 1800}
    r = post(http, "/api/generate", body, {"Content-Type": "application/json"})
    assert continue_ollama(r.text, fim_path=False) == fim(http, CONTINUE_PREFIX, SUFFIX, CAP, CONTINUE_STOPS)


def test_continue_openai(http):
    """Continue with `provider: openai`, `apiBase: http://127.0.0.1:PORT/v1/`: supportsFim() is false, so
    autocomplete sends the `<fim_prefix>` template as one prompt to the legacy `completions` endpoint (toChatBody's
    fields less `messages`, then `stream: true`), with `api-key: ""` and no Authorization when no key is set. The
    layout is split back into prefix and suffix. (Its default maxTokens, 4096, is over the cap and refused: the
    configuration sets `defaultCompletionOptions.maxTokens`.)"""
    prompt = f"<fim_prefix>{CONTINUE_PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    body = {"model": "m31r", "max_tokens": CAP, "temperature": 0, "stream": True, "stop": CONTINUE_STOPS,
            "prompt": prompt}
    r = post(http, "/v1/completions", body, {"Content-Type": "application/json", "api-key": ""})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert continue_sse(r.text) == fim(http, CONTINUE_PREFIX, SUFFIX, CAP, CONTINUE_STOPS)


# -- minuet-ai.nvim --------------------------------------------------------------------------------------------


def minuet_headers() -> dict[str, str]:
    """complete_openai_fim_base's headers: the API key is the value of the variable it names ('TERM', its README's
    advice for a server that needs none)."""
    return {"Content-Type": "application/json", "Accept": "application/json",
            "Authorization": "Bearer xterm-256color"}


def test_minuet_openai_fim_compatible(http):
    """minuet's `openai_fim_compatible` provider as its README configures it for Ollama (`optional = {max_tokens =
    56, top_p = 0.9}`), end_point http://127.0.0.1:PORT/v1/completions: the default template puts the language and
    indentation comments before the prefix and sends `suffix`."""
    body = {"model": "m31r", "stream": True, "max_tokens": 56, "top_p": 0.9, "prompt": MINUET_PREFIX,
            "suffix": SUFFIX}
    r = post(http, "/v1/completions", body, minuet_headers())
    assert minuet_stream(r.text) == fim(http, MINUET_PREFIX, SUFFIX, 56)


def test_minuet_with_a_template_of_fim_tokens(http):
    """minuet's llama.cpp recipe (recipes.md): `suffix = false` and a prompt laid out in Qwen's FIM tokens. The
    layout is split back into prefix and suffix."""
    body = {"model": "m31r", "stream": True, "max_tokens": 56, "top_p": 0.9,
            "prompt": f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"}
    r = post(http, "/v1/completions", body, minuet_headers())
    assert minuet_stream(r.text) == fim(http, PREFIX, SUFFIX, 56)


# -- llm.nvim / llm-ls -----------------------------------------------------------------------------------------

LLM_LS_HEADERS = {"user-agent": "llm-ls/0.5.3; rust/unknown; ide/neovim", "content-type": "application/json"}
LLM_LS_PROMPT = f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"  # build_prompt with llm.nvim's fim tokens


@pytest.mark.parametrize("backend", ["openai", "llamacpp"])
def test_llm_ls_openai_and_llamacpp(http, backend):
    """llm-ls's `openai` and `llamacpp` backends (url http://127.0.0.1:PORT; build_url adds /v1/completions): the
    request body of the configuration (llm.nvim's default for openai: temperature and top_p; none for llamacpp) with
    prompt, model and `stream: false`; parse_openai_text/parse_llamacpp_text read `choices[].text`, and
    format_generations clears tokens_to_clear."""
    request_body = {"temperature": 0, "top_p": 0.95} if backend == "openai" else {}
    body = {**request_body, "prompt": LLM_LS_PROMPT, "model": "m31r", "stream": False}
    r = post(http, "/v1/completions", body, LLM_LS_HEADERS)
    texts = [c["text"].replace("<|endoftext|>", "") for c in r.json()["choices"]]
    assert texts == [fim(http, PREFIX, SUFFIX, 16)]  # OpenAI's default max_tokens: llm-ls sends none


def test_llm_ls_ollama(http):
    """llm-ls's `ollama` backend (build_url adds /api/generate): llm.nvim's default body `options` with prompt, model
    and `stream: false`; parse_ollama_text reads `response`."""
    body = {"options": {"temperature": 0, "top_p": 0.95}, "prompt": LLM_LS_PROMPT, "model": "m31r", "stream": False}
    r = post(http, "/api/generate", body, LLM_LS_HEADERS)
    assert r.json()["response"].replace("<|endoftext|>", "") == fim(http, PREFIX, SUFFIX, CAP)


# -- Twinny ----------------------------------------------------------------------------------------------------


def test_twinny(http):
    """Twinny's FIM provider `ollama` (path /api/generate, template "automatic": for a model name that names no
    family, getDefaultFimPromptTemplate, CodeLlama's layout as Twinny writes it, `<PRE> \\n{header}{prefix} <SUF>
    {suffix} <MID>`, a space after <SUF> too). Its defaults: temperature 0.2 (0 here), numPredictFim 512 (over the
    cap: capped), keepAlive "5m", an empty Authorization header when no key is set. The space Twinny puts after <SUF>
    is the layout's, not the code's: the suffix reaches the daemon without it."""
    prompt = f"<PRE> \n{TWINNY_HEADER}{PREFIX} <SUF> {SUFFIX} <MID>"
    body = {"model": "m31r", "prompt": prompt, "stream": True, "keep_alive": "5m",
            "options": {"temperature": 0, "num_predict": 512}}
    r = post(http, "/api/generate", body, {"Content-Type": "application/json", "Authorization": ""})
    assert twinny(r.text, ["<EOT>"]) == fim(http, "\n" + TWINNY_HEADER + PREFIX, SUFFIX, CAP)


# -- llama-coder -----------------------------------------------------------------------------------------------


def test_llama_coder(http):
    """llama-coder with model "custom" and custom.model "m31r:latest": ollamaCheckModel wants that exact name in
    /api/tags (else it offers to download the model), and a custom model always gets the CodeLlama layout as
    llama-coder writes it (`<PRE> {prefix} <SUF> {suffix} <MID>`), `raw: true`, its stop words, num_predict 256, no
    `stream`. lineGenerator splits the body at "\\n"; each line's `response` is appended."""
    names = [m["name"] for m in http.get("/api/tags").json()["models"]]
    assert "m31r:latest" in names and "m31r" not in names  # the name to configure
    body = {"model": "m31r:latest", "prompt": f"<PRE> {PREFIX} <SUF> {SUFFIX} <MID>", "raw": True,
            "options": {"stop": ["<END>", "<EOD>", "<EOT>"], "num_predict": 256, "temperature": 0}}
    r = post(http, "/api/generate", body, {"Content-Type": "application/json"})
    text = "".join(tok["response"] for tok in ndjson_lines(r.text))
    assert text == fim(http, PREFIX, SUFFIX, CAP, ["<END>", "<EOD>", "<EOT>"])


# -- cmp-ai ----------------------------------------------------------------------------------------------------


def test_cmp_ai_ollama(http):
    """cmp-ai's Ollama backend (base_url http://127.0.0.1:PORT/api/generate), its default prompt CodeLlama's own
    layout (`<PRE> {before} <SUF>{after} <MID>`), `stream: false`, `options` as configured; it reads `done` and
    `response` (with <EOT> removed) from the one JSON answer curl prints."""
    body = {"model": "m31r", "prompt": f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>", "stream": False,
            "options": {"temperature": 0}}
    answer = post(http, "/api/generate", body, {"Content-Type": "application/json"}).json()
    assert answer.get("error") is None and answer["done"] is True
    assert answer["response"].replace("<EOT>", "") == fim(http, PREFIX, SUFFIX, CAP)


def test_cmp_ai_tabby(http):
    """cmp-ai's Tabby backend (base_url http://127.0.0.1:PORT/v1/completions; TABBY_API_KEY must be set, to anything
    without --token-file): `{language, segments: {prefix, suffix, filepath}}`; it reads `choices[1].text`. Tabby's
    Rust stop words and 64 tokens apply."""
    body = {"language": "rust", "segments": {"prefix": PREFIX, "suffix": SUFFIX, "filepath": "/home/dev/demo/main.rs"}}
    r = post(http, "/v1/completions", body, {"Authorization": "Bearer anything", "Content-Type": "application/json"})
    assert r.json()["choices"][0]["text"] == fim(http, PREFIX, SUFFIX, min(64, CAP), RUST_STOPS)


# -- the plugins' own defaults ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body"), [
    ("/api/generate", {"model": "m31r", "prompt": CONTINUE_PREFIX, "suffix": SUFFIX, "keep_alive": 1800,
                       "options": {"temperature": 0.01, "num_predict": 4096, "stop": CONTINUE_STOPS, "num_ctx": 512}}),
    ("/api/generate", {"model": "m31r", "prompt": f"<PRE> \n{TWINNY_HEADER}{PREFIX} <SUF> {SUFFIX} <MID>",
                       "stream": True, "keep_alive": "5m", "options": {"temperature": 0.2, "num_predict": 512}}),
    ("/api/generate", {"model": "m31r:latest", "prompt": f"<PRE> {PREFIX} <SUF> {SUFFIX} <MID>", "raw": True,
                       "options": {"stop": ["<END>", "<EOD>", "<EOT>"], "num_predict": 256, "temperature": 0.2}}),
    ("/api/generate", {"options": {"temperature": 0.2, "top_p": 0.95}, "prompt": LLM_LS_PROMPT, "model": "m31r",
                       "stream": False}),
    ("/v1/completions", {"temperature": 0.2, "top_p": 0.95, "prompt": LLM_LS_PROMPT, "model": "m31r",
                         "stream": False}),
], ids=["continue", "twinny", "llama-coder", "llm-ls-ollama", "llm-ls-openai"])
def test_default_sampling_is_accepted(http, path, body):
    """With each plugin's own default temperature (sampled, so not compared): answered, with text."""
    r = post(http, path, body, {"Content-Type": "application/json"})
    if path == "/v1/completions":
        assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    else:
        last = list(ndjson_lines(r.text))[-1]
        assert last["done"] is True and last["eval_count"] > 0


# -- the exact Fim each layout becomes, against a scripted daemon ----------------------------------------------


class RecordingDaemon(StalledDaemon):
    """Speaks the daemon's protocol, records each request and answers it with one token: the Fim a plugin's request
    becomes, field for field, which a noise-writing model may not show in its text."""

    model = "scripted"

    def on_request(self, msg: pm.Generate | pm.Fim, send: Callable[[object], None]) -> None:
        send(pm.Token(id=msg.id, text="x", token=0))
        send(pm.Done(id=msg.id, finish_reason="stop", usage=pm.Usage(prompt_tokens=9, completion_tokens=1),
                     timings=pm.Timings(prefill_ms=1.0, total_ms=2.0)))


@pytest.fixture(scope="module")
def recording(tmp_path_factory) -> Iterator[tuple[Server, RecordingDaemon]]:
    tmp = tmp_path_factory.mktemp("recording")
    daemon = RecordingDaemon(tmp / "d.sock")
    srv = Server(tmp, daemon.path, "--max-tokens-cap", str(CAP))
    try:
        yield srv, daemon
    finally:
        srv.stop()
        daemon.close()


@pytest.mark.parametrize(("prompt", "prefix", "suffix"), [
    # llama-coder's and Twinny's CodeLlama layout: a space after <SUF> that is not the code's
    (f"<PRE> {PREFIX} <SUF> {SUFFIX} <MID>", PREFIX, SUFFIX),
    (f"<PRE> \n{TWINNY_HEADER}{PREFIX} <SUF> {SUFFIX} <MID>", "\n" + TWINNY_HEADER + PREFIX, SUFFIX),
    (f"<PRE> {PREFIX} <SUF>  <MID>", PREFIX, ""),  # at the end of a file
    (f"<PRE> {PREFIX} <SUF> \r\n}}\r\n <MID>", PREFIX, "\r\n}\r\n"),
    # CodeLlama's own layout (cmp-ai, Continue, Ollama's template): the suffix as it is
    (f"<PRE> {PREFIX} <SUF>{SUFFIX} <MID>", PREFIX, SUFFIX),
    (f"<PRE> {PREFIX} <SUF> + b;\n <MID>", PREFIX, " + b;\n"),  # mid-line: the space may be the code's, kept
    (f"<fim_prefix>{PREFIX}<fim_suffix> {SUFFIX}<fim_middle>", PREFIX, " " + SUFFIX),  # other layouts: as they are
    # Twinny's Codestral layout: `{file context}\n\n[SUFFIX]…`, the file context empty unless turned on
    (f"\n\n[SUFFIX]{SUFFIX}[PREFIX]{TWINNY_HEADER}{PREFIX}", TWINNY_HEADER + PREFIX, SUFFIX),
], ids=["llama-coder", "twinny", "llama-coder-file-end", "llama-coder-crlf", "codellama-own", "codellama-mid-line",
        "starcoder", "twinny-codestral"])
def test_the_fim_each_ollama_layout_becomes(recording, prompt, prefix, suffix):
    """The prefix and suffix each plugin's layout reaches the daemon as, and a num_predict over the cap capped."""
    srv, daemon = recording
    body = {"model": "m31r", "prompt": prompt, "raw": True, "stream": False, "options": {"num_predict": 4096}}
    r = httpx.post(f"{srv.url}/api/generate", json=body, timeout=30)
    assert r.status_code == 200 and r.json()["response"] == "x", r.text
    sent = [m for m in daemon.received if isinstance(m, pm.Fim)][-1]
    assert (sent.prefix, sent.suffix) == (prefix, suffix)
    assert sent.max_tokens == CAP  # Continue's 4096: capped to the server's cap


def test_a_num_predict_over_the_cap_without_truncation_is_refused(recording):
    """`truncate: false` asks for refusals over truncation: a num_predict over the cap is one, naming both ways out."""
    srv, _ = recording
    r = httpx.post(f"{srv.url}/api/generate", timeout=30, json={"model": "m31r", "prompt": "fn", "truncate": False,
                                                                "options": {"num_predict": CAP + 1}})
    assert r.status_code == 400 and f"cap of {CAP}" in r.json()["error"] and "truncate" in r.json()["error"], r.text


@pytest.mark.parametrize(("prompt", "echo"), [
    (f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>", False),
    (f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>", True),
], ids=["starcoder", "qwen-echo"])
def test_the_fim_an_openai_prompt_layout_becomes(recording, prompt, echo):
    """A FIM layout in /v1/completions' prompt (no `suffix`) is the Fim it was built from; `echo` gives the prompt."""
    srv, daemon = recording
    r = httpx.post(f"{srv.url}/v1/completions", json={"model": "m31r", "prompt": prompt, "echo": echo}, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == (prompt if echo else "") + "x", r.text
    sent = [m for m in daemon.received if isinstance(m, pm.Fim | pm.Generate)][-1]
    assert isinstance(sent, pm.Fim) and (sent.prefix, sent.suffix) == (PREFIX, SUFFIX)


# -- Zed's `ollama` and `open_ai_compatible_api` edit-prediction providers ---------------------------------------
#
# zed-industries/zed crates/edit_prediction/src/fim.rs (request_prediction, infer_prompt_format, format_fim_prompt,
# fim_stop_tokens, clean_fim_completion), ollama.rs (make_request, OllamaGenerateResponse), open_ai_compatible.rs
# (send_custom_server_request), crates/cloud_llm_client (RawCompletionRequest, RawCompletionResponse), and
# crates/zed/src/zed/edit_prediction_registry.rs: with `prompt_format: "infer"` (the default), a model name no
# family is inferred from (`m31r`) gives no provider at all, so the format must be set. The prefix and suffix are the
# file's text around the cursor in a window of about 512 tokens: the whole of this small file.

# Each `prompt_format` Zed writes a FIM prompt in: its template and its stop words (fim_stop_tokens; Zed releases
# before these per-format lists sent all 14 of clean_fim_completion's words, which the servers take as well).
ZED_FORMATS: dict[str, tuple[Callable[[str, str], str], list[str]]] = {
    "code_llama": (lambda p, s: f"<PRE> {p} <SUF>{s} <MID>", ["<PRE>", "<SUF>", "<MID>"]),
    "star_coder": (lambda p, s: f"<fim_prefix>{p}<fim_suffix>{s}<fim_middle>",
                   ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>"]),
    "deepseek_coder": (lambda p, s: f"<｜fim▁begin｜>{p}<｜fim▁hole｜>{s}<｜fim▁end｜>",
                       ["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"]),
    "qwen": (lambda p, s: f"<|fim_prefix|>{p}<|fim_suffix|>{s}<|fim_middle|>",
             ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]),
    "code_gemma": (lambda p, s: f"<|fim_prefix|>{p}<|fim_suffix|>{s}<|fim_middle|>",
                   ["<|file_separator|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"]),
    "codestral": (lambda p, s: f"[SUFFIX]{s}[PREFIX]{p}", ["[PREFIX]", "[SUFFIX]"]),
    "glm": (lambda p, s: f"<|code_prefix|>{p}<|code_suffix|>{s}<|code_middle|>",
            ["<|endoftext|>", "<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>"]),
}
ZED_END_TOKENS = ["<|endoftext|>", "<|file_separator|>", "<|fim_pad|>", "<|fim_prefix|>", "<|fim_middle|>",
                  "<|fim_suffix|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<PRE>", "<SUF>", "<MID>",
                  "[PREFIX]", "[SUFFIX]"]


def zed_clean(text: str) -> str:
    """clean_fim_completion: the text cut at each of its end tokens found, in its order."""
    for token in ZED_END_TOKENS:
        if (pos := text.find(token)) >= 0:
            text = text[:pos]
    return text


def zed_ollama(raw: str) -> str:
    """ollama.rs make_request: one JSON object (stream false), deserialised into OllamaGenerateResponse, which needs
    `created_at` (the prediction's id) and `response` as strings."""
    j = json.loads(raw)
    assert isinstance(j["created_at"], str) and isinstance(j["response"], str), j
    return j["response"]


def zed_openai(raw: str) -> str:
    """send_custom_server_request: the body deserialised into RawCompletionResponse (id, object, created as u64,
    model, choices[{text, finish_reason: string or null}], usage{prompt_tokens, completion_tokens, total_tokens} as
    u32: one missing or mistyped fails the prediction); the first choice's text, or "" with none."""
    j = json.loads(raw)
    assert all(isinstance(j[k], str) for k in ("id", "object", "model")), j
    assert isinstance(j["created"], int) and j["created"] >= 0, j
    assert all(isinstance(j["usage"][k], int) for k in ("prompt_tokens", "completion_tokens", "total_tokens")), j
    for c in j["choices"]:
        assert isinstance(c["text"], str) and (c.get("finish_reason") is None or isinstance(c["finish_reason"], str))
    return j["choices"][0]["text"] if j["choices"] else ""


@pytest.mark.parametrize("fmt", list(ZED_FORMATS))
def test_zed_ollama(http, fmt):
    """Zed with `provider: "ollama"`: POST {api_url}/api/generate, only Content-Type, `{model, prompt, raw: true,
    stream: false, options: {num_predict: max_output_tokens, temperature: 0.2, stop}}` (temperature 0 here, to
    compare). Its default max_output_tokens, 256, is over the cap: capped."""
    template, stops = ZED_FORMATS[fmt]
    body = {"model": "m31r", "prompt": template(PREFIX, SUFFIX), "raw": True, "stream": False,
            "options": {"num_predict": 256, "temperature": 0, "stop": stops}}
    r = post(http, "/api/generate", body, {"Content-Type": "application/json"})
    assert zed_clean(zed_ollama(r.text)) == zed_clean(fim(http, PREFIX, SUFFIX, CAP, stops))


@pytest.mark.parametrize("fmt", list(ZED_FORMATS))
def test_zed_open_ai_compatible_api(http, fmt):
    """Zed with `provider: "open_ai_compatible_api"`: POST to api_url as it is (the full URL, here
    http://127.0.0.1:PORT/v1/completions), Content-Type and a bearer token only where a key is set, `{model, prompt,
    max_tokens: max_output_tokens, stop}`: no temperature (greedy here), no suffix, no stream."""
    template, stops = ZED_FORMATS[fmt]
    body = {"model": "m31r", "prompt": template(PREFIX, SUFFIX), "max_tokens": CAP, "stop": stops}
    r = post(http, "/v1/completions", body, {"Content-Type": "application/json", "Authorization": "Bearer key"})
    assert zed_clean(zed_openai(r.text)) == zed_clean(fim(http, PREFIX, SUFFIX, CAP, stops))


def test_zed_defaults_are_accepted(http):
    """Zed's own defaults, answered and parsed as Zed parses them: Ollama's temperature 0.2 (sampled, so not
    compared) with older releases' 14 stop words, and /v1/completions with those 14 too."""
    prompt = ZED_FORMATS["code_llama"][0](PREFIX, SUFFIX)
    body = {"model": "m31r", "prompt": prompt, "raw": True, "stream": False,
            "options": {"num_predict": 256, "temperature": 0.2, "stop": ZED_END_TOKENS}}
    zed_ollama(post(http, "/api/generate", body, {"Content-Type": "application/json"}).text)
    body = {"model": "m31r", "prompt": prompt, "max_tokens": CAP, "stop": ZED_END_TOKENS}
    assert zed_openai(post(http, "/v1/completions", body, {"Content-Type": "application/json"}).text) == zed_clean(
        fim(http, PREFIX, SUFFIX, CAP, ZED_END_TOKENS))


@pytest.mark.parametrize("fmt", list(ZED_FORMATS))
@pytest.mark.parametrize("path", ["/api/generate", "/v1/completions"])
@pytest.mark.parametrize(("prefix", "suffix"), [(PREFIX, SUFFIX), (PREFIX + " ", ""), ("", "fn main() {}\n")],
                         ids=["mid-file", "file-end", "file-start"])
def test_the_fim_each_zed_format_becomes(recording, fmt, path, prefix, suffix):
    """Each of Zed's formats, on each endpoint, reaches the daemon as the prefix and suffix Zed built it from: at a
    file's end (an empty suffix, a space before the cursor) and start too."""
    srv, daemon = recording
    template, stops = ZED_FORMATS[fmt]
    if path == "/api/generate":
        body = {"model": "m31r", "prompt": template(prefix, suffix), "raw": True, "stream": False,
                "options": {"num_predict": 256, "temperature": 0.2, "stop": stops}}
    else:
        body = {"model": "m31r", "prompt": template(prefix, suffix), "max_tokens": CAP, "stop": stops}
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert zed_clean(zed_ollama(r.text) if path == "/api/generate" else zed_openai(r.text)) == "x"
    sent = [m for m in daemon.received if isinstance(m, pm.Fim | pm.Generate)][-1]
    assert isinstance(sent, pm.Fim) and (sent.prefix, sent.suffix) == (prefix, suffix)
    assert sent.stop == stops

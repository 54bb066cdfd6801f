"""The HTTP adapters' counts after session 48's token healing accounting (tests/test_healing_budget_s48.py).

A prompt (or cursor) inside a word is healed: the daemon leaves the word's tokens out of the prompt and the model
writes them again first. Those tokens finish the prompt: no Token frame carries them, `completion_tokens` (what
max_tokens bounds) counts the tokens after them and `usage.healed_tokens` counts them. Each adapter must count them
as the prompt's, as OpenAI's usage does, so that its prompt and completion figures still add up to the context the
answer took (Ollama's prompt_eval_count and llama.cpp's tokens_evaluated dropped them), and its per-token arrays
must still spell its text. With the tiny byte-vocabulary model, `fn main` heals `main` as four tokens.
"""

from __future__ import annotations

import json

import httpx
import pytest
from test_http import healthy_server, scrape, sse_events

pytestmark = pytest.mark.timeout(120)

PROMPT, SUFFIX, N = "fn main", "\n", 3


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s48h", shared_daemon[1])


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def native(http) -> dict[str, dict]:
    """The daemon's own answers, through the native endpoints: a plain prompt and a cursor, both inside `main`."""
    gen = http.post("/generate", json={"prompt": PROMPT, "max_tokens": N, "logprobs": 1}).json()
    fim = http.post("/fim", json={"prefix": PROMPT, "suffix": SUFFIX, "max_tokens": N}).json()
    for a in (gen, fim):  # the premise: the word was healed, and max_tokens bounded only the tokens after it
        assert a["usage"]["healed_tokens"] == 4 and a["usage"]["completion_tokens"] == N, a
        assert a["finish_reason"] == "length" and a["text"]
    assert [t["text"] for t in gen["tokens"]] == list(gen["text"])  # no frame for the healed tokens
    return {"gen": gen, "fim": fim}


def read(u: dict) -> int:
    return u["prompt_tokens"] + u["healed_tokens"]


def test_openai_counts_and_logprobs_spell_the_text(http, native):
    gen = native["gen"]
    a = http.post("/v1/completions", json={"model": "m31r", "prompt": PROMPT, "max_tokens": N, "logprobs": 1}).json()
    choice, usage = a["choices"][0], a["usage"]
    assert choice["text"] == gen["text"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (read(gen["usage"]), N)
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["token_logprobs"]) == N
    assert lp["text_offset"] == [0, 1, 2]
    echo = http.post("/v1/completions", json={"model": "m31r", "prompt": PROMPT, "max_tokens": N, "echo": True}).json()
    assert echo["choices"][0]["text"] == PROMPT + gen["text"]  # the healed word once, not twice
    # Streamed, with every token's figures and the usage chunk: the same tokens, offsets and counts.
    r = http.post("/v1/completions", json={"model": "m31r", "prompt": PROMPT, "max_tokens": N, "logprobs": 0,
                                           "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(d) for _, d in sse_events(r.text) if d != "[DONE]"]
    chunks = [e["choices"][0] for e in events if e["choices"] and e["choices"][0]["logprobs"]]
    assert "".join(c["text"] for c in chunks) == gen["text"]
    assert [off for c in chunks for off in c["logprobs"]["text_offset"]] == lp["text_offset"]
    assert events[-1]["usage"] == usage
    # Mistral's FIM answer (Codestral) shares OpenAI's usage.
    c = http.post("/v1/fim/completions", json={"model": "codestral-latest", "prompt": PROMPT, "suffix": SUFFIX,
                                               "max_tokens": N}).json()
    assert c["choices"][0]["message"]["content"] == native["fim"]["text"]
    assert (c["usage"]["prompt_tokens"], c["usage"]["completion_tokens"]) == (read(native["fim"]["usage"]), N)


@pytest.mark.parametrize("fim", [False, True])
def test_ollama_counts_the_healed_word_as_prompt(http, native, fim):
    """prompt_eval_count counted only the tokens prefilled: `fn main` read as 3 prompt tokens and 3 evaluated,
    where OpenAI's usage for the same request says 7 and 3, and prompt_eval_count + eval_count fell short of the
    context the answer took by the healed word."""
    ref = native["fim" if fim else "gen"]
    body = {"model": "m31r", "prompt": PROMPT, "options": {"num_predict": N}, "logprobs": True,
            **({"suffix": SUFFIX} if fim else {})}
    one = http.post("/api/generate", json={**body, "stream": False}).json()
    assert one["response"] == ref["text"] and one["done_reason"] == "length"
    assert (one["prompt_eval_count"], one["eval_count"]) == (read(ref["usage"]), N)
    assert len(one["logprobs"]) == N and "".join(t["token"] for t in one["logprobs"]) == one["response"]
    lines = [json.loads(x) for x in http.post("/api/generate", json=body).text.splitlines()]
    assert "".join(x["response"] for x in lines) == ref["text"] and sum(len(x.get("logprobs", [])) for x in lines) == N
    assert (lines[-1]["prompt_eval_count"], lines[-1]["eval_count"]) == (read(ref["usage"]), N)


@pytest.mark.parametrize("path", ["/infill", "/completion"])
def test_llamacpp_counts_the_healed_word_as_prompt(http, native, path):
    """tokens_predicted (and predicted_n, and the streamed token ids) are what n_predict bounded; tokens_evaluated
    and prompt_n include the healed word, as the other adapters' usage does. The n_indent rule (Ruled, which counts
    the streamed tokens itself) sees the same tokens."""
    ref = native["fim" if path == "/infill" else "gen"]
    body = ({"input_prefix": "", "prompt": PROMPT, "input_suffix": SUFFIX} if path == "/infill"
            else {"prompt": PROMPT}) | {"n_predict": N, "n_indent": 1}
    a = http.post(path, json=body).json()
    assert a["content"] == ref["text"] and a["stop_type"] == "limit"
    assert a["tokens_predicted"] == a["timings"]["predicted_n"] == N
    assert a["tokens_evaluated"] == read(ref["usage"]) and a["tokens_cached"] == ref["usage"]["cached_tokens"]
    assert a["timings"]["prompt_n"] == a["tokens_evaluated"] - a["tokens_cached"]
    events = [json.loads(d) for _, d in sse_events(http.post(path, json={**body, "stream": True}).text)]
    *chunks, last = events
    assert "".join(e["content"] for e in chunks) == ref["text"]
    assert len([t for e in chunks for t in e["tokens"]]) == chunks[-1]["tokens_predicted"] == N
    assert (last["tokens_predicted"], last["tokens_evaluated"]) == (N, read(ref["usage"]))


def test_metrics_count_the_healed_word_as_prompt(http, native):
    """The server's token counters add up as its answers' usage does (before, a healed word was in neither)."""
    key = ("m31r_prompt_tokens_total", (("endpoint", "/fim"),))
    done = ("m31r_completion_tokens_total", (("endpoint", "/fim"),))
    before = scrape(http)
    a = http.post("/fim", json={"prefix": PROMPT, "suffix": SUFFIX, "max_tokens": N}).json()
    after = scrape(http)
    assert after[key] - before.get(key, 0) == read(a["usage"]) == read(native["fim"]["usage"])
    assert after[done] - before.get(done, 0) == N

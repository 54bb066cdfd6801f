"""max_tokens after token healing (session 48): the tokens that write a healed prompt end again finish the prompt.

Before, they counted against max_tokens: `m31r generate "fn main" --max-tokens 2` spent both tokens on ` main`
again and answered nothing, and an editor's 16-token line request lost one token per healed word to the word it had
already typed. Now max_tokens counts the tokens after them, the context's room bounds them, no Token frame carries
them (their text is the prompt's), and `Usage.healed_tokens` says how many there were.
"""

from __future__ import annotations

import json

import openai
import pytest
from test_cli import cli
from test_http import healthy_server

from m31r.beams import beam_generate
from m31r.engine import Outcome
from m31r.fim import heal_prompt

pytestmark = pytest.mark.timeout(120)


def run(engine, ids, heal, max_tokens, **kw) -> tuple[Outcome, list]:
    res = Outcome(prompt_tokens=0)
    pieces = list(engine.generate(ids, max_tokens=max_tokens, result=res, heal=heal, **kw))
    return res, pieces


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_max_tokens_counts_the_tokens_after_the_healed_text(tiny_engine, max_tokens):
    """The tiny model's byte vocabulary writes the healed `main` in four tokens: every one of them used to count."""
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode("fn main"))
    assert heal == "main"
    res, pieces = run(tiny_engine, ids, heal, max_tokens)
    assert (res.healing_tokens, res.completion_tokens, res.finish_reason) == (4, max_tokens, "length")
    assert len(res.tokens) == len(res.logprobs) == 4 + max_tokens
    assert [p.id for p in pieces] == res.tokens[4:]  # the healing tokens are not streamed
    assert "".join(p.text for p in pieces) == res.text != ""
    # The same text as the unhealed prompt's max_tokens tokens, where one byte token spells each healed byte.
    whole, _ = run(tiny_engine, tiny_engine.tokenizer.encode("fn main"), "", max_tokens)
    assert (res.text, res.tokens[4:]) == (whole.text, whole.tokens)


def test_the_contexts_room_bounds_the_healing_tokens(tiny_engine):
    """A prompt that leaves exactly max_tokens of room: the healing tokens take theirs from it, so the completion
    ends at the context's end ("length", fewer tokens) instead of writing past it."""
    ctx = tiny_engine.config.max_context
    text = "x" * (ctx - 40) + " total"
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(text))
    assert heal == "total"
    max_tokens = ctx - len(ids)
    res, _ = run(tiny_engine, ids, heal, max_tokens)
    assert res.finish_reason == "length" and res.healing_tokens == 5
    assert len(ids) + len(res.tokens) == ctx and res.completion_tokens == max_tokens - 5
    with pytest.raises(ValueError, match="context"):  # and the request itself must still fit
        run(tiny_engine, ids, heal, max_tokens + 1)


def test_a_beam_search_counts_as_generate_does(tiny_engine):
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode("fn main"))
    for width in (1, 3):
        res = Outcome(prompt_tokens=0)
        pieces = list(beam_generate(tiny_engine, ids, width=width, max_tokens=3, result=res, heal=heal))
        assert (res.healing_tokens, res.completion_tokens) == (4, 3) and res.finish_reason == "length"
        assert [p.id for p in pieces if p.id is not None] == res.tokens[4:] and len(res.tokens) == 7
        if width == 1:  # greedy decoding, token for token
            greedy, _ = run(tiny_engine, ids, heal, 3)
            assert (res.tokens, res.text) == (greedy.tokens, greedy.text)


def test_the_cli_answers_max_tokens_of_text(shared_daemon):
    _, sock = shared_daemon
    r = cli("generate", "fn main", "--json", "--max-tokens", "2", "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["text"] != "" and len(out["tokens"]) == 2
    assert (out["usage"]["completion_tokens"], out["usage"]["healed_tokens"]) == (2, 4)
    assert out["finish_reason"] == "length"


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s48", shared_daemon[1])


def test_openai_usage_counts_the_healed_tokens_as_the_prompts(server, shared_daemon, tiny_engine):
    """OpenAI's completion_tokens never exceeds the max_tokens asked for; the healed tokens are prompt tokens."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    c = client.completions.create(model="m31r", prompt="fn main", max_tokens=3)
    ids, _ = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode("fn main"))
    assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(ids) + 4, 3)
    assert c.usage.total_tokens == len(ids) + 4 + 3 and c.choices[0].finish_reason == "length"
    assert c.choices[0].text != ""

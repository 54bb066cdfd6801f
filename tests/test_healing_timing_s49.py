"""A healed prompt's timings: the tokens that write its healed end again finish reading the prompt (they are counted
as the prompt's: Usage.healed_tokens, the HTTP adapters' prompt counts), so their time is the prompt's too.
`prefill_ms` runs until the first token after them; before, their decode steps counted as the answer's, and the
adapters' generation rates (Ollama's eval_duration, llama.cpp's predicted_ms) divided the answer's tokens by the
healing's time as well."""

from __future__ import annotations

import anyio
import pytest

from m31r.engine import Outcome
from m31r.fim import heal_prompt
from m31r_protocol import Client

pytestmark = pytest.mark.timeout(60)


def test_engine_counts_the_healing_steps_as_the_prompts(tiny_engine):
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode("fn main"))
    res = Outcome(prompt_tokens=0)
    list(tiny_engine.generate(ids, max_tokens=4, result=res, heal=heal))
    assert heal and res.healing_tokens >= 1 and res.completion_tokens == 4
    assert res.prefill_ms == res.first_token_ms < res.total_ms
    plain = Outcome(prompt_tokens=0)
    list(tiny_engine.generate(tiny_engine.tokenizer.encode("fn main("), max_tokens=4, result=plain))
    assert plain.healing_tokens == 0 and plain.prefill_ms < plain.first_token_ms  # the first token's step after it


def test_daemon_timings_of_a_healed_generate(shared_daemon):
    _, sock = shared_daemon

    async def go():
        async with await Client.connect(sock) as c:
            return await (await c.generate("fn main", max_tokens=4)).collect()

    _, done = anyio.run(go)
    t = done.timings
    assert done.usage.healed_tokens >= 1 and done.usage.completion_tokens == 4
    # first_token_ms counts from the request's arrival, prefill_ms from its start: the same moment here.
    assert t.first_token_ms == pytest.approx(t.queue_ms + t.prefill_ms, abs=0.03)

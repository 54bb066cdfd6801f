"""Beam search's limits against greedy `Engine.generate` (m31r.beams): a deadline that passes during prefill or
mid-search ends a search as it ends greedy decoding (a late line end cuts the text there), and a Cancel frame mid-search
ends the daemon's request with `cancelled` and leaves its caches as an identical request needs them.

The deadline is driven by a fake clock (time.perf_counter) that jumps past it while a chosen model call runs: no test
here depends on how fast anything is."""

from __future__ import annotations

import asyncio
import time

import pytest
from test_beams import fim_prompts
from test_daemon import Daemon, raw, recv, send

from m31r_protocol import messages as m

NEWLINES = "gfl,dqxvxdyvls;c.\n"  # the tiny model (seed 0) answers this with line ends, token after token


def drive(engine, gen, late_at: int, clock: dict) -> list[tuple[int | None, str]]:
    """Run a batched generator to its end on `engine`, the clock jumping past the deadline while its `late_at`-th
    decode step runs (0: while its first prefill chunk runs). The pieces it streamed."""
    from m31r.engine import Chunk, Decode

    pieces, steps, sent = [], 0, None
    try:
        while True:
            call = gen.send(sent)
            if isinstance(call, Chunk):
                if late_at == 0:
                    clock["now"] = 20.0
                sent = engine.run([], [call])[1][0]
            elif isinstance(call, Decode | list):
                steps += 1
                if steps == late_at:
                    clock["now"] = 20.0
                rows = engine.run(call if isinstance(call, list) else [call], [])[0]
                sent = rows if isinstance(call, list) else rows[0]
            else:
                pieces.append((call.id, call.text))
                sent = None
    except StopIteration:
        pass
    return pieces


def late_run(engine, monkeypatch, ids: list[int], late_at: int, width: int | None, **kw):
    """The pieces and Outcome of generate (width None) or a beam search, its deadline (10.0 on a clock that starts at
    0; past already where late_at is -1) passing at `late_at` (drive)."""
    from m31r.beams import beam_generate
    from m31r.engine import Outcome

    clock = {"now": 20.0 if late_at < 0 else 0.0}
    monkeypatch.setattr(time, "perf_counter", lambda: clock["now"])
    res = Outcome(prompt_tokens=0)
    if width is None:
        gen = engine.generate(ids, deadline=10.0, batched=True, result=res, **kw)
    else:
        gen = beam_generate(engine, ids, width=width, deadline=10.0, batched=True, result=res, **kw)
    pieces = drive(engine, gen, late_at, clock)
    monkeypatch.undo()
    return pieces, res


def usage(res) -> tuple:
    return (res.text, res.finish_reason, res.stopped_by, res.stop_sequence, res.tokens, res.completion_tokens,
            res.healing_tokens, res.decode_steps, len(res.logprobs))


def case(engine, name: str) -> tuple[list[int], dict]:
    ids, heal, context = fim_prompts(engine)[1]
    newlines = engine.tokenizer.encode(NEWLINES)
    return {
        "newlines": (newlines, dict(max_tokens=8)),
        "newlines-at-max-tokens": (newlines, dict(max_tokens=3)),  # the late step is the last max_tokens allows
        "newlines-stop-held-back": (newlines, dict(max_tokens=8, stop=["\n}"])),  # each "\n" held back a token
        "healed-fim": (ids, dict(max_tokens=8, heal=heal, repeat_context=context, stop=["\n"])),
    }[name]


@pytest.mark.parametrize("name", ["newlines", "newlines-at-max-tokens", "newlines-stop-held-back", "healed-fim"])
@pytest.mark.parametrize("late_at", [-1, 0, 1, 2, 3])
def test_width_one_past_the_deadline_is_greedy_decoding(tiny_engine, monkeypatch, late_at, name):
    """Width 1 is greedy decoding token for token (m31r.beams), past the deadline too: the same pieces, text,
    finish_reason and usage, whether the deadline had passed before the request, passes during prefill, or passes
    mid-search, where a line end in the late token (or held back before it) ends the text at that line end. Before,
    the search kept that line end and what followed it ('\\n\\n\\n\\n' for generate's '\\n\\n\\n')."""
    ids, kw = case(tiny_engine, name)
    greedy = late_run(tiny_engine, monkeypatch, ids, late_at, None, lookahead=0, **kw)
    searched = late_run(tiny_engine, monkeypatch, ids, late_at, 1, **kw)
    assert searched[0] == greedy[0]
    assert usage(searched[1]) == usage(greedy[1])
    # To float rounding: a search's log-probabilities are differences of its sums.
    assert searched[1].logprobs == pytest.approx(greedy[1].logprobs, abs=1e-5)
    assert searched[1].alternatives == []


def test_a_late_line_end_ends_a_wider_search_there(tiny_engine, monkeypatch):
    """At width 3 the deadline passing during the third step answers the likeliest hypothesis, four tokens long (the
    first and one a step), its last a line end picked past the deadline: the text ends before it, as generate's
    would, and the search names no runners-up."""
    ids = tiny_engine.tokenizer.encode(NEWLINES)
    full, done = late_run(tiny_engine, monkeypatch, ids, 99, 3, max_tokens=8)  # never late: the whole search
    assert done.finish_reason == "length" and done.text == "\n" * 8  # the model's answer here: line ends only
    pieces, res = late_run(tiny_engine, monkeypatch, ids, 3, 3, max_tokens=8)
    assert res.finish_reason == "deadline" and res.stopped_by is None
    assert res.text == "\n\n\n" and "".join(t for _, t in pieces) == res.text
    assert res.tokens == done.tokens[:4] and res.completion_tokens == 4 and res.decode_steps == 3
    assert res.alternatives == [] and len(res.logprobs) == 4
    # A deadline passed before the request: no model call, no text.
    pieces, res = late_run(tiny_engine, monkeypatch, ids, -1, 3, max_tokens=8)
    assert pieces == [] and res.finish_reason == "deadline" and res.tokens == [] and res.decode_steps == 0


async def test_a_cancel_frame_mid_search_ends_it_and_leaves_the_caches_usable(shared_daemon, tiny_engine):
    """A Cancel sent while a beam search runs (the daemon reports it active) is answered `cancelled` within a model
    call of it; the next identical request then streams the engine's own search on fresh caches, twice alike."""
    from m31r.beams import beam_generate
    from m31r.engine import Outcome
    from m31r.fim import heal_prompt, line_context
    from m31r_protocol.client import Client

    daemon = Daemon(*shared_daemon)
    prompt, width, max_tokens = "fn cancel_me() {", 8, 480  # 480 steps of 8 rows: still running when the cancel comes
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(prompt))
    res = Outcome(prompt_tokens=0)
    expected = [(p.id, p.text) for p in beam_generate(tiny_engine, ids, width=width, max_tokens=max_tokens, heal=heal,
                                                      repeat_context=line_context(prompt), result=res)]
    assert res.finish_reason == "length" and res.decode_steps == len(res.tokens) - 1

    rid = 494_949
    reader, writer = await raw(daemon.socket)
    try:
        await send(writer, m.Generate(id=rid, prompt=prompt, max_tokens=max_tokens, beams=width))
        async with await Client.connect(daemon.socket) as c:
            while (await c.status()).active == 0:  # started: the search is at work (nothing streams before its end)
                await asyncio.sleep(0.005)
        await send(writer, m.Cancel(id=rid))
        msg = await asyncio.wait_for(recv(reader), 30)
        assert isinstance(msg, m.Error) and msg.id == rid and msg.code == "cancelled", msg
        (line,) = await daemon.await_logs(lambda x: x.get("id") == rid and x["msg"] == "request")
        assert line["code"] == "cancelled" and "finish_reason" not in line, line
        assert line["calls_after_cancel"] in (0, 1) and line["model_calls"] < max_tokens, line
        for again in (rid + 1, rid + 2):
            await send(writer, m.Generate(id=again, prompt=prompt, max_tokens=max_tokens, beams=width))
            pieces = []
            while isinstance(msg := await asyncio.wait_for(recv(reader), 30), m.Token):
                pieces.append((msg.token, msg.text))
            assert isinstance(msg, m.Done) and msg.finish_reason == "length", msg
            assert pieces == expected and msg.usage.decode_steps == res.decode_steps
    finally:
        writer.close()

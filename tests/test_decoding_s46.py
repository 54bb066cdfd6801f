"""Stops, session 46's audit, through the real shared daemon (and `m31r serve` in front of it).

- An empty stop sequence was dropped without a word; it is refused as bad_request, and by the HTTP schema (400 naming
  `stop`), as vLLM's OpenAI server refuses it.
"""

from __future__ import annotations

import httpx
import pytest
from test_http import Server

from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError

pytestmark = pytest.mark.timeout(120)

PROMPT = "fn main"  # healed: the prompt ends before `main`, which the first tokens write again


async def run(sock, **kw) -> tuple[list[m.Token], m.Done]:
    async with await Client.connect(sock) as c:
        stream = await c.generate(PROMPT, **kw)
        frames = [t async for t in stream]
        assert stream.done is not None
        return frames, stream.done


@pytest.mark.parametrize("stop", [[""], ["\n", ""]])
async def test_an_empty_stop_sequence_is_refused(shared_daemon, stop: list[str]) -> None:
    with pytest.raises(DaemonError) as e:
        await run(shared_daemon[1], max_tokens=4, stop=stop)
    assert e.value.code == "bad_request"
    assert f"stop[{len(stop) - 1}] is an empty string" in e.value.message, e.value.message
    async with await Client.connect(shared_daemon[1]) as c:  # the daemon serves on
        with pytest.raises(DaemonError, match="stop\\[0\\] is an empty string"):
            await (await c.fim("fn f() {\n    ", "\n}\n", max_tokens=2, stop=[""])).collect()


def test_openai_completions_refuse_an_empty_stop_with_400(shared_daemon, tmp_path) -> None:
    srv = Server(tmp_path, shared_daemon[1])
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            for stop, param in (("", "stop"), (["\n", ""], "stop[1]")):
                r = http.post("/v1/completions", json={"model": "m31r", "prompt": "fn main", "max_tokens": 2,
                                                       "stop": stop})
                assert r.status_code == 400, r.text
                err = r.json()["error"]
                assert "of length >= 1" in err["message"] and err["param"] == param, err  # (the schema says so too)
            ok = http.post("/v1/completions", json={"model": "m31r", "prompt": "fn main", "max_tokens": 2,
                                                    "stop": "\n"})
            assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


def test_beam_search_sees_a_stop_inside_an_added_token_that_is_text(tiny_config, tmp_path) -> None:
    """An added token that is text (DeepSeek-Coder's `ø`) has no token_bytes: the search read it as no text, so a
    stop inside it did not finish the hypothesis, which then ran on and was ranked as a longer one."""
    import torch
    from tokenizers import AddedToken

    from m31r.beams import Hypothesis, _extend
    from m31r.bundle import init_bundle
    from m31r.engine import Engine, TextPath
    from m31r.stops import StopMatcher
    from m31r.tokenizer import build_byte_tokenizer

    hf = build_byte_tokenizer(tiny_config.vocab_size - 1)
    hf.add_tokens([AddedToken("END;", special=False, normalized=False)])
    engine = Engine(init_bundle(tiny_config, tmp_path / "bundle", seed=0, dtype=torch.float32, tokenizer=hf))
    tok = engine.tokenizer.hf.token_to_id("END;")
    assert engine.tokenizer.token_bytes[tok] is None and tok not in engine.stop_ids
    ids = engine.tokenizer.encode("x = ")
    assert TextPath(engine.tokenizer, ids, "", ["D;"], None, ()).step(tok) == ("EN", True)  # what generate shows
    root = Hypothesis(0.0, [], 0, b"", False, 0, b"", StopMatcher(["D;"]))
    assert _extend(engine, root, tok, -1.0).end == "sequence"
    assert _extend(engine, root, engine.tokenizer.encode("E")[0], -1.0).end == ""  # a plain byte: no stop yet

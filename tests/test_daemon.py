"""A real m31rd in a subprocess, on a real socket, with the real client: streaming equals the engine, concurrency,
cancellation, hostile clients, busy, newest-wins, deadlines, typed-through, socket safety, lifecycle, cache
determinism while typing, and the JSON log.

Daemons are expensive on a shared machine, so there are three, each shared by the tests of this module:
`warm` (default options), `cold` (`--cache-mb 0 --max-queue 2 --max-active 1 --read-timeout 1`: the no-cache
reference, the small queue for `busy` and a short frame timeout) and `life` (lifecycle tests; the SIGTERM test ends it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import math
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from daemon_util import DAEMON, start_daemon, stop_daemon
from devices import DEVICES

from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError
from m31r_protocol.framing import HEADER, pack, read_frame

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
MARKER = "ZEBRA_PROMPT_MARKER_31"  # sent in prompts; must never reach the log


@dataclass
class Daemon:
    proc: subprocess.Popen
    socket: Path

    @property
    def lines(self) -> list[str]:
        return self.proc.log_lines  # type: ignore[attr-defined]  # drained by daemon_util.start_daemon

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in list(self.lines)]

    def wait_logs(self, pred, n: int = 1, timeout: float = 30) -> list[dict]:
        """The parsed log lines that satisfy `pred`, once there are at least `n` of them (lines arrive late: on a
        loaded machine the daemon and the thread draining its stderr may wait seconds for a CPU; every caller waits
        for lines that must come, so the timeout only bounds a hang)."""
        t0 = time.monotonic()
        while len(found := [x for x in self.logs() if pred(x)]) < n and time.monotonic() - t0 < timeout:
            time.sleep(0.05)
        return found

    async def await_logs(self, pred, n: int = 1, timeout: float = 30) -> list[dict]:
        """wait_logs without blocking the test's event loop."""
        t0 = time.monotonic()
        while len(found := [x for x in self.logs() if pred(x)]) < n and time.monotonic() - t0 < timeout:
            await asyncio.sleep(0.02)
        return found


def launch(bundle: Path, sock: Path, *extra: str) -> Daemon:
    return Daemon(start_daemon(bundle, sock, *extra), sock)


@pytest.fixture(scope="module")
def daemons(tiny_bundle, tmp_path_factory):
    """The module's own two daemons, started (and stopped) side by side to halve the wait."""
    cold = tmp_path_factory.mktemp("cold") / "m31rd.sock"
    # `life` starts on top of a stale socket file: a daemon that died without cleaning up.
    life = tmp_path_factory.mktemp("life") / "run" / "m31rd.sock"
    life.parent.mkdir(mode=0o700)  # a stale socket in a private folder: the folder rule passes
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(life))
    stale.close()
    assert stat.S_ISSOCK(life.lstat().st_mode)
    specs = {"cold": (cold, "--cache-mb", "0", "--max-queue", "2", "--max-active", "1", "--read-timeout", "1",
                      "--lookahead", "3"),
             "life": (life, "--dtype", "auto", "--quant", "auto")}  # the daemon's own precision defaults
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = {name: pool.submit(launch, tiny_bundle.path, *spec) for name, spec in specs.items()}
    started = {name: f.result() for name, f in futures.items() if f.exception() is None}
    try:
        assert len(started) == len(specs), [f.exception() for f in futures.values()]
        yield started
    finally:
        for d in started.values():
            if d.proc.poll() is None:
                d.proc.send_signal(signal.SIGTERM)
        for d in started.values():
            stop_daemon(d.proc)


@pytest.fixture(scope="module")
def warm(shared_daemon) -> Daemon:
    """Default options: the session's shared daemon (conftest.py), which other modules use too; its socket is in
    a run/ folder it created. Tests here pick out their own log lines by request id or client name."""
    return Daemon(*shared_daemon)


@pytest.fixture(scope="module")
def cold(daemons) -> Daemon:
    """No prefix cache (the reference for cache determinism), a queue of two (for `busy`), prompt-lookup drafts on
    (--lookahead 3: what it streams must not change)."""
    return daemons["cold"]


@pytest.fixture(scope="module")
def life(daemons) -> Daemon:
    """Lifecycle tests: started over a stale socket file; the SIGTERM test, last, ends it."""
    return daemons["life"]


# -- helpers ------------------------------------------------------------------------------------------------


@dataclass
class Out:
    text: str
    pieces: list[tuple[int | None, str]]
    finish_reason: str
    done: m.Done | None = None

    @property
    def tokens(self) -> list[int]:
        return [t for t, _ in self.pieces if t is not None]


def reference(engine, prompt: str | list[int], max_tokens: int, sampling=None, stop=(), heal: str = "",
              repeat_context: str | None = None) -> Out:
    """What the engine itself streams for a prompt, in this process, with a fresh cache. A text prompt is healed
    as the daemon heals a Generate's (m31r.fim.heal_prompt), and its lines are the repeated-line stop's context, as
    the daemon's (m31r.fim.line_context)."""
    from m31r.engine import Outcome
    from m31r.fim import heal_prompt, line_context

    if isinstance(prompt, str):
        repeat_context = line_context(prompt)
        prompt, heal = heal_prompt(engine.tokenizer, engine.tokenizer.encode(prompt))
    res = Outcome(prompt_tokens=0)
    pieces = [(t.id, t.text) for t in engine.generate(prompt, max_tokens=max_tokens, sampling=sampling, stop=stop,
                                                      result=res, heal=heal, repeat_context=repeat_context)]
    return Out(res.text, pieces, res.finish_reason)


def fim_reference(engine, prefix: str, suffix: str, max_tokens: int, sampling=None) -> Out:
    from m31r.fim import FimBudget, build_fim_prompt

    budget = FimBudget.for_context(engine.config.max_context).with_reserve(max_tokens)
    p = build_fim_prompt(engine.tokenizer, prefix, suffix, budget)
    return reference(engine, p.ids, max_tokens, sampling, heal=p.heal)


def fim_outcome(engine, prefix: str, suffix: str, max_tokens: int):
    """The engine's Outcome for a FIM request as the daemon runs it (the repeated-line stop included)."""
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    p = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    res = Outcome(prompt_tokens=0)
    for _ in engine.generate(p.ids, max_tokens=max_tokens, result=res, heal=p.heal,
                             repeat_context=line_context(prefix)):
        pass
    return res


async def run(stream, timeout: float = 30) -> Out:
    pieces = []

    async def consume() -> None:
        async for t in stream:
            pieces.append((t.token, t.text))

    await asyncio.wait_for(consume(), timeout)
    assert stream.done is not None
    return Out("".join(p for _, p in pieces), pieces, stream.done.finish_reason, stream.done)


async def expect_error(stream, code: str, timeout: float = 10) -> DaemonError:
    with pytest.raises(DaemonError) as e:
        await run(stream, timeout)
    assert e.value.code == code, e.value
    return e.value


async def raw(sock: Path, hello: bool = True) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    if hello:
        await send(writer, m.Hello(protocol=m.PROTOCOL_VERSION, client="raw"))
        assert isinstance(await recv(reader), m.Welcome)
    return reader, writer


async def send(writer: asyncio.StreamWriter, msg: object) -> None:
    writer.write(pack(msgspec.msgpack.encode(msg)))
    await writer.drain()


async def recv(reader: asyncio.StreamReader, timeout: float = 10) -> msgspec.Struct | None:
    body = await asyncio.wait_for(read_frame(reader), timeout)
    return None if body is None else m.server_decoder().decode(body)


async def until_idle(sock: Path, timeout: float = 30) -> m.StatusReply:
    """Poll status until nothing is active or queued; fails if that takes longer than `timeout` (by default a
    bound on a hang: whatever a test leaves running ends within a second where nothing else holds the CPU)."""
    t0 = time.monotonic()
    async with await Client.connect(sock) as c:
        while True:
            st = await c.status()
            if st.active == 0 and st.queue == 0:
                return st
            assert time.monotonic() - t0 < timeout, f"still busy after {timeout}s: {st}"
            await asyncio.sleep(0.02)


async def still_serves(sock: Path) -> None:
    async with await Client.connect(sock) as c:
        out = await run(await c.generate("fn ok", max_tokens=2))
        assert out.done.usage.completion_tokens == 2


GEN_PROMPTS = ["fn main", "let v = vec![1, 2, 3];\n", "impl Foo {\n    pub fn bar(&self) -> u32 {",
               "use std::collections::HashMap;\n\n" + "// a comment line that pads the prompt\n" * 4 + "fn é🦀() {"]
FIM_CASES = [("fn main() {\n    let x = ", ";\n}\n"), ("", ""), ("struct P {\n", "}\n"),
             ("fn add(a: i32, b: i32) -> i32 {\n" * 6 + "    a +", "\n}\n" * 3)]


# -- streaming equals the engine ----------------------------------------------------------------------------


async def test_generate_streams_what_the_engine_streams(warm, tiny_engine):
    from m31r.fim import heal_prompt
    from m31r.sampling import SamplingParams

    async with await Client.connect(warm.socket) as c:
        for prompt in GEN_PROMPTS:
            out = await run(await c.generate(prompt, max_tokens=12))
            ref = reference(tiny_engine, prompt, 12)
            assert out.pieces == ref.pieces and out.text == ref.text and out.finish_reason == ref.finish_reason
            healed, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(prompt))
            assert out.done.usage.prompt_tokens == len(healed) < len(tiny_engine.tokenizer.encode(prompt))
            # The healed text is written again, neither streamed nor counted in max_tokens: usage says how many.
            assert prompt.endswith(heal) and all(text for _, text in out.pieces[:1])
            assert len(out.pieces) == out.done.usage.completion_tokens == 12 and out.done.usage.healed_tokens > 0
            assert out.done.source == "model"
        # Seeded sampling is reproducible too, and a stop sequence ends the stream the same way.
        sampling = SamplingParams(temperature=1.0, seed=11)
        full = reference(tiny_engine, GEN_PROMPTS[1], 12, sampling).text
        stop = full[min(5, len(full) - 2):][:2]  # two characters from the middle of what it writes
        ref = reference(tiny_engine, GEN_PROMPTS[1], 12, sampling, stop=[stop])
        assert len(stop) == 2 and ref.finish_reason == "stop" and stop not in ref.text
        sampled = await run(await c.generate(GEN_PROMPTS[1], max_tokens=12, sampling=m.Sampling(temperature=1.0),
                                             seed=11, stop=[stop]))
        assert sampled.pieces == ref.pieces and sampled.finish_reason == "stop"


async def test_fim_streams_what_the_engine_streams(warm, tiny_engine):
    async with await Client.connect(warm.socket) as c:
        for (prefix, suffix), n in zip(FIM_CASES, [10, 6, 10, 80], strict=True):  # 80 > the usual reserve (64)
            out = await run(await c.fim(prefix, suffix, max_tokens=n))
            ref = fim_reference(tiny_engine, prefix, suffix, n)
            assert out.pieces == ref.pieces and out.finish_reason == ref.finish_reason
        assert out.finish_reason == "stop" or out.done.usage.completion_tokens == 80  # honoured, not cut to 64
        # More than half the context: refused, with the limit, rather than silently cut.
        half = tiny_engine.config.max_context // 2
        await run(await c.fim(*FIM_CASES[0], max_tokens=half))
        err = await expect_error(await c.fim(*FIM_CASES[0], max_tokens=half + 1), "bad_request")
        assert f"{half}, half its context" in err.message


async def test_text_is_read_as_the_model_learned_it(warm, tiny_engine):
    """The model learned from LF-only text: a file with CRLF (or lone CR) line ends is read as LF, so it gets the
    completion its LF twin gets (with CR LF served as it was, make eval's single-line exact match fell from 52% to
    16%). Project context too, and a plain prompt."""
    from m31r_protocol.messages import Snippet

    def crlf(s: str) -> str:
        return s.replace("\n", "\r\n")

    async with await Client.connect(warm.socket) as c:
        for prefix, suffix in FIM_CASES:
            want = await run(await c.fim(prefix, suffix, max_tokens=12))
            assert want.pieces == fim_reference(tiny_engine, prefix, suffix, 12).pieces
            for ends in (crlf, lambda s: s.replace("\n", "\r")):
                got = await run(await c.fim(ends(prefix), ends(suffix), max_tokens=12))
                assert got.pieces == want.pieces and got.done.usage.prompt_tokens == want.done.usage.prompt_tokens
            if prefix.endswith("\n"):  # a cursor between the CR and the LF of a CR LF: the same one line end
                got = await run(await c.fim(crlf(prefix)[:-1], "\n" + crlf(suffix), max_tokens=12))
                assert got.pieces == want.pieces and got.done.usage.prompt_tokens == want.done.usage.prompt_tokens
        snippet = Snippet(path="src/a.rs", text="fn a() {\n    1\n}\n")
        want = await run(await c.fim(*FIM_CASES[0], max_tokens=8, context=[snippet]))
        got = await run(await c.fim(*map(crlf, FIM_CASES[0]), max_tokens=8,
                                    context=[Snippet(path=snippet.path, text=crlf(snippet.text))]))
        assert got.pieces == want.pieces
        want = await run(await c.generate("fn main() {\n    let x = 1;\n", max_tokens=8))
        got = await run(await c.generate("fn main() {\r\n    let x = 1;\r\n", max_tokens=8))
        assert got.pieces == want.pieces
        # A byte order mark, and spaces at the ends of whole lines (blank lines indented as editors leave them): read
        # without them, as the corpus has none. The cursor's line keeps what was typed: `let y = ` ends in a space.
        clean = ("fn main() {\n\n    let x = 1;\n    let y = ", ";\n\n}\n")
        dirty = ("\ufefffn main() {  \n    \n    let x = 1;\t\n    let y = ", ";  \n    \n}\n")
        want = await run(await c.fim(*clean, max_tokens=12))
        got = await run(await c.fim(*dirty, max_tokens=12))
        assert got.pieces == want.pieces and got.done.usage.prompt_tokens == want.done.usage.prompt_tokens
        assert want.pieces != (await run(await c.fim(clean[0].rstrip(), clean[1], max_tokens=12))).pieces
        want = await run(await c.generate(clean[0], max_tokens=8))
        assert (await run(await c.generate(dirty[0], max_tokens=8))).pieces == want.pieces


async def test_a_confidence_floor_ends_the_fim_at_the_token_that_crosses_it(warm, tiny_engine):
    """Fim.min_probability: the daemon stops at the token that takes the completion's probability so far under the
    floor (Engine.generate), the same tokens as the engine's run without it, up to there."""
    import math

    prefix, suffix = FIM_CASES[0]
    free = fim_outcome(tiny_engine, prefix, suffix, 24)
    sums = [sum(free.logprobs[: i + 1]) for i in range(len(free.tokens))]
    k = 3  # a floor that the fourth token's figure crosses: the tiny model is sure of nothing
    floor = math.exp((sums[k - 1] + sums[k]) / 2)
    async with await Client.connect(warm.socket) as c:
        out = await run(await c.fim(prefix, suffix, max_tokens=24, min_probability=floor, document="floor"))
        h = free.healing_tokens  # (not streamed)
        assert [t for t, _ in out.pieces if t is not None] == free.tokens[h: k + 1] and out.finish_reason == "stop"
        assert out.done.usage.completion_tokens == k + 1 - h < free.completion_tokens
        full = await run(await c.fim(prefix, suffix, max_tokens=24, min_probability=0.0))
        assert [t for t, _ in full.pieces if t is not None] == free.tokens[h:]


async def test_fim_context_snippets_lead_the_prompt(warm, tiny_engine):
    """A Fim's context snippets go before its prompt as m31r.context lays them out, within the room the prompt leaves;
    the answer is the engine's for that prompt. More snippets than the protocol allows are refused."""
    from m31r.context import context_ids, context_room
    from m31r.fim import FimBudget, build_fim_prompt
    from m31r_protocol.limits import MAX_SNIPPETS

    prefix, suffix = FIM_CASES[0]
    snippets = [m.Snippet("pub struct Point {\n    pub x: i64,\n}\n", "src/point.rs"),
                m.Snippet("fn norm(p: &Point) -> i64 { p.x.abs() }\n" * 40, "src/norm.rs"), m.Snippet("let z = 1;")]
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    p = build_fim_prompt(tiny_engine.tokenizer, prefix, suffix, budget)
    head = context_ids(tiny_engine.tokenizer, snippets, context_room(budget, p))
    assert head and len(head) <= context_room(budget, p)
    assert tiny_engine.tokenizer.decode(head).count("src/point.rs") == 1
    assert "src/norm.rs" not in tiny_engine.tokenizer.decode(head)  # too long for the room: left out
    ref = reference(tiny_engine, head + p.ids, 10, heal=p.heal)
    async with await Client.connect(warm.socket) as c:
        out = await run(await c.fim(prefix, suffix, max_tokens=10, context=snippets))
        assert out.pieces == ref.pieces and out.done.usage.prompt_tokens == len(head) + len(p.ids)
        plain = await run(await c.fim(prefix, suffix, max_tokens=10))
        assert plain.done.usage.prompt_tokens == len(p.ids)
        many = [m.Snippet("x")] * (MAX_SNIPPETS + 1)
        err = await expect_error(await c.fim(prefix, suffix, max_tokens=2, context=many), "bad_request")
        assert f"context has {MAX_SNIPPETS + 1} snippets; at most {MAX_SNIPPETS}" in err.message
    await still_serves(warm.socket)


async def test_line_completions_are_beam_searched(warm, tiny_engine):
    """A greedy Fim stopped at a line end that does not choose its width gets the daemon's --beams (4): it streams
    the engine's beam search of that width. One that chooses gets its own width (1: greedy decoding); a Generate may
    choose too. Longer completions stay greedy."""
    from m31r.beams import beam_generate
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, heal_prompt, line_context
    from m31rd.main import BEAMS
    from m31rd.server import request_stops

    def beam_reference(ids: list[int], heal: str, width: int, stop: list[str], context: str | None) -> list:
        res = Outcome(prompt_tokens=0)
        pieces = [(p.id, p.text) for p in beam_generate(tiny_engine, ids, width=width, max_tokens=12, stop=stop,
                                                        heal=heal, repeat_context=context, result=res)]
        alternatives[len(alternatives)] = res.alternatives
        return pieces

    alternatives: dict[int, list[str]] = {}

    budget = FimBudget.for_context(tiny_engine.config.max_context)
    differs = 0
    async with await Client.connect(warm.socket) as c:
        assert "beams" in c.welcome.capabilities
        for prefix, suffix in [FIM_CASES[0], FIM_CASES[3], ("let words = [\"a\", \"b", "\"];\n")]:
            p = build_fim_prompt(tiny_engine.tokenizer, prefix, suffix, budget)
            stops = request_stops(m.Fim(id=0, prefix=prefix, suffix=suffix, stop=["\n"]))
            searched = beam_reference(p.ids, p.heal, BEAMS, stops, line_context(prefix))
            out = await run(await c.fim(prefix, suffix, max_tokens=12, stop=["\n"]))
            assert out.pieces == searched and out.done.alternatives == alternatives[len(alternatives) - 1]
            for width in (1, 2):
                out = await run(await c.fim(prefix, suffix, max_tokens=12, stop=["\n"], beams=width))
                assert out.pieces == beam_reference(p.ids, p.heal, width, stops, line_context(prefix))
                assert out.done.alternatives == alternatives[len(alternatives) - 1]
            greedy = fim_reference(tiny_engine, prefix, suffix, 12)
            differs += greedy.pieces != searched
            out = await run(await c.fim(prefix, suffix, max_tokens=12))  # no line-end stop: greedy
            assert out.pieces == greedy.pieces and out.done.alternatives == []
        for prompt in GEN_PROMPTS[:3]:
            ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode(prompt))
            out = await run(await c.generate(prompt, max_tokens=12, beams=3))
            assert out.pieces == beam_reference(ids, heal, 3, [], None)
    assert differs  # the search answered something greedy decoding does not
    assert any(alternatives.values())  # and some searches had runners-up to send


async def test_lookahead_streams_the_same_text(warm, cold, tiny_engine):
    """Prompt-lookup decoding over the socket: with drafts (a daemon's --lookahead, and asked for) a request streams
    what it streams without them (lookahead 0) and what the engine streams, in fewer decode steps."""
    long_fim = ("fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n" * 4 + "fn sub(a: i32, b: i32) -> i32 {\n", "\n}\n")
    accepted = 0
    async with await Client.connect(warm.socket) as c:
        for prefix, suffix in [*FIM_CASES, long_fim]:
            ref = fim_reference(tiny_engine, prefix, suffix, 40)
            off = await run(await c.fim(prefix, suffix, max_tokens=40, lookahead=0))
            assert off.pieces == ref.pieces and off.done.usage.draft_tokens == 0
            for k in (None, 2, 7, 50):  # None: the daemon's default (off); past the decode width: clamped
                on = await run(await c.fim(prefix, suffix, max_tokens=40, lookahead=k))
                assert on.pieces == ref.pieces and on.finish_reason == ref.finish_reason, (prefix, k)
                u = on.done.usage
                assert u.decode_steps + u.accepted_tokens == max(0, u.completion_tokens + u.healed_tokens - 1)
                assert u.accepted_tokens <= u.draft_tokens
                accepted += u.accepted_tokens
        for prompt in GEN_PROMPTS:
            on = await run(await c.generate(prompt, max_tokens=30, lookahead=4))
            assert on.pieces == reference(tiny_engine, prompt, 30).pieces
    assert accepted > 0
    drafted = 0
    async with await Client.connect(cold.socket) as c:  # --lookahead 3: requests that do not choose get drafts
        for prefix, suffix in [*FIM_CASES, long_fim]:
            on = await run(await c.fim(prefix, suffix, max_tokens=40))
            assert on.pieces == fim_reference(tiny_engine, prefix, suffix, 40).pieces
            drafted += on.done.usage.draft_tokens
    assert drafted > 0


@pytest.mark.parametrize("device", DEVICES)
async def test_bf16_daemon_streams_what_its_engine_streams(tiny_bundle, tmp_path, device):
    """A bf16 daemon on each device this machine has (CUDA where there is one) streams exactly what an in-process
    engine of the same precision streams, cold and again from its warm prefix cache."""
    from m31r.engine import Engine

    engine = Engine(tiny_bundle.path, device=device, dtype="bfloat16", chunk_size=8)  # the daemon's chunk size
    sock = tmp_path / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--device", device, "--dtype", "bfloat16")
    try:
        async with await Client.connect(sock) as c:
            for _ in range(2):
                for prompt in GEN_PROMPTS:
                    out = await run(await c.generate(prompt, max_tokens=12))
                    assert out.pieces == reference(engine, prompt, 12).pieces, prompt
            st = await c.status()
            assert st.dtype == "bfloat16"
        # Slots hold what their contexts need (whole 64-position blocks), not a whole context each.
        block = 2 * engine.config.n_layers * engine.config.kv_heads * 64 * engine.config.head_dim * 2  # bf16
        longest = max(len(engine.tokenizer.encode(p)) for p in GEN_PROMPTS) + 12
        assert st.cache_slots_used >= 1
        assert 0 < st.cache_mb * 2**20 <= st.cache_slots_used * -(-longest // 64) * block + 0.1 * 2**20
        assert st.cache_mb <= st.cache_budget_mb
    finally:
        stop_daemon(proc)


# -- concurrency --------------------------------------------------------------------------------------------


async def test_many_requests_on_one_connection(warm, tiny_engine):
    jobs = [("g", p, 8 + i) for i, p in enumerate(GEN_PROMPTS)] + [("f", c, 6 + i) for i, c in enumerate(FIM_CASES)]
    async with await Client.connect(warm.socket) as c:
        streams = [await (c.generate(x, max_tokens=n) if k == "g" else c.fim(*x, max_tokens=n)) for k, x, n in jobs]
        outs = await asyncio.gather(*(run(s) for s in streams))
    for (k, x, n), out in zip(jobs, outs, strict=True):
        ref = reference(tiny_engine, x, n) if k == "g" else fim_reference(tiny_engine, *x, n)
        assert out.pieces == ref.pieces, (k, x)


async def test_many_connections(warm, tiny_engine):
    async def one_client(i: int) -> list[Out]:
        async with await Client.connect(warm.socket, client=f"c{i}") as c:
            streams = [await c.generate(GEN_PROMPTS[(i + j) % len(GEN_PROMPTS)], max_tokens=6 + j) for j in range(3)]
            return await asyncio.gather(*(run(s) for s in streams))

    results = await asyncio.gather(*(one_client(i) for i in range(4)))
    for i, outs in enumerate(results):
        for j, out in enumerate(outs):
            assert out.pieces == reference(tiny_engine, GEN_PROMPTS[(i + j) % len(GEN_PROMPTS)], 6 + j).pieces
    await until_idle(warm.socket)


# -- cancellation and clients that go away ------------------------------------------------------------------


async def test_cancel_mid_stream(warm):
    async with await Client.connect(warm.socket) as c:
        # No drafts: they would finish the tiny model's looping 400 tokens before the cancel could arrive.
        s = await c.generate("fn main() {", max_tokens=400, lookahead=0)
        got = [await asyncio.wait_for(s.__anext__(), 10) for _ in range(2)]
        t0 = time.monotonic()
        await s.cancel()
        with pytest.raises(DaemonError) as e:
            async for t in s:
                got.append(t)
        assert e.value.code == "cancelled" and "client" in e.value.message
        assert time.monotonic() - t0 < 3.0 and len(got) < 400
        # The connection and the daemon carry on.
        assert (await run(await c.generate("fn", max_tokens=3))).done.usage.completion_tokens == 3
    await until_idle(warm.socket)


async def test_cancel_drops_the_tokens_not_read_yet(warm):
    """A caller that cancels is handed nothing more of the answer: tokens that arrived before the cancel but were
    not read yet are dropped with the rest, and the next read ends the stream as cancelled."""
    async with await Client.connect(warm.socket) as c:
        s = await c.generate("fn main() {", max_tokens=400, lookahead=0)
        first = await asyncio.wait_for(s.__anext__(), 10)
        t0 = time.monotonic()
        while s.queue.qsize() < 3:  # tokens the daemon sent that this caller has not read
            assert time.monotonic() - t0 < 10, "the daemon sent no more tokens"
            await asyncio.sleep(0.01)
        await s.cancel()
        after = []
        with pytest.raises(DaemonError) as e:
            async for t in s:
                after.append(t.text)
        assert e.value.code == "cancelled" and after == [], after
        assert s.tokens == [first.token] and s.done is None
    await until_idle(warm.socket)


CLIENT_SCRIPT = """
import asyncio, sys
from m31r_protocol import Client

async def main():
    c = await Client.connect(sys.argv[1])
    s = await c.generate("fn main() {", max_tokens=400)
    await s.__anext__()
    print("streaming", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


async def test_client_killed_mid_stream(warm):
    p = await asyncio.create_subprocess_exec(sys.executable, "-c", CLIENT_SCRIPT, str(warm.socket), env=ENV,
                                             stdout=asyncio.subprocess.PIPE)
    try:
        assert await asyncio.wait_for(p.stdout.readline(), 30) == b"streaming\n"
    finally:
        p.kill()
        await p.wait()
    assert p.returncode == -signal.SIGKILL
    await until_idle(warm.socket)
    await still_serves(warm.socket)


async def test_a_vanished_client_stops_generation_within_one_round(warm):
    """The request's log line says how fast the cancel took effect: the round already running may finish (one more
    model call), no further one starts. `make soak` checks this over 10,000 vanishing clients."""
    rid = 424_242
    reader, writer = await raw(warm.socket)
    # No drafts (the daemon's default --lookahead 3 accepts nearly all of the tiny model's loops: 400 tokens in ~100
    # model calls), so the request is still running when the daemon sees the abort, even on a loaded machine.
    await send(writer, {"type": "generate", "id": rid, "prompt": "fn main() {", "max_tokens": 400, "lookahead": 0})
    for _ in range(3):
        assert isinstance(await recv(reader), m.Token)
    writer.transport.abort()  # gone mid-stream, tokens left unread
    (line,) = await warm.await_logs(lambda x: x.get("id") == rid and x["msg"] == "request")
    assert line["code"] == "cancelled" and "finish_reason" not in line, line
    assert line["calls_after_cancel"] in (0, 1) and line["model_calls"] >= 3, line  # a prefill chunk and two steps
    assert 0 <= line["cancel_ms"] < 2000, line
    await until_idle(warm.socket)


async def test_client_closes_without_reading_while_prefilling(warm):
    """EOF seen while jobs are queued or prefilling cancels them at once, not after they finish.

    Each job has 256 prompt tokens to prefill and 256 tokens to decode without drafts, so a job the EOF did not
    cancel runs on for many rounds and logs a finish_reason instead of `cancelled`. (With 8 tokens to decode, the
    first job could finish before the daemon's event loop, waiting its turn for the GIL on a loaded 2-core machine,
    read the EOF: CI failed that way.)
    """
    long_prompt = "    let value = compute(alpha, beta, gamma);\n" * 20  # ~900 tokens: truncated to 256
    for base, close in ((987_000, "close"), (987_100, "half-close")):
        reader, writer = await raw(warm.socket)
        ids = {base + i for i in range(3)}
        for rid in sorted(ids):
            writer.write(pack(msgspec.msgpack.encode(
                {"type": "generate", "id": rid, "prompt": long_prompt, "max_tokens": 256, "truncate": True,
                 "lookahead": 0})))
        await writer.drain()
        t0 = time.monotonic()
        if close == "close":
            writer.transport.abort()  # gone, nothing read
        else:
            writer.write_eof()  # no more requests: the daemon treats EOF as a disconnect
        # After an abort the daemon may lose the unread rest of the buffer once a write fails, so at least one
        # of the three reached it; after a half-close all three did.
        ended = await warm.await_logs(lambda x, ids=ids: x.get("id") in ids and x["msg"] == "request",
                               n=1 if close == "close" else 3)
        assert ended and time.monotonic() - t0 < 3, ended
        assert all(x.get("code") == "cancelled" and "finish_reason" not in x for x in ended), json.dumps(ended)
        await until_idle(warm.socket, timeout=3)
        if close == "half-close":
            while await recv(reader) is not None:  # nothing but (maybe) tokens, then EOF
                pass
            writer.close()
    await still_serves(warm.socket)


# -- hostile frames -----------------------------------------------------------------------------------------


async def test_oversize_frame(warm):
    for hello in (True, False):  # after the handshake, and as the very first frame
        reader, writer = await raw(warm.socket, hello=hello)
        writer.write(HEADER.pack(m.MAX_FRAME_BYTES + 1))  # no body: the daemon must not wait for it
        await writer.drain()
        err = await recv(reader)
        assert isinstance(err, m.Error) and err.code == "frame_too_large" and err.id is None
        assert await recv(reader) is None  # closed
        writer.close()
    await still_serves(warm.socket)


async def test_truncated_frame(warm):
    reader, writer = await raw(warm.socket)
    writer.write(HEADER.pack(100) + b"0123456789")
    writer.write_eof()
    assert await recv(reader) is None
    writer.close()
    await still_serves(warm.socket)


async def test_garbage_frames(warm):
    invalid_utf8 = b"\x83\xa4type\xa8generate\xa2id\x01\xa6prompt\xa2\xed\xa0"  # a str field that is not UTF-8
    for hello, body in [(True, b"\xc1\xc1 not msgpack"), (False, b"\xc1\xc1"), (True, invalid_utf8)]:
        reader, writer = await raw(warm.socket, hello=hello)
        writer.write(pack(body))
        await writer.drain()
        err = await recv(reader)
        assert isinstance(err, m.Error) and err.code == "bad_request" and err.id is None, err
        assert await recv(reader) is None
        writer.close()
    await still_serves(warm.socket)


async def test_a_frame_that_stalls_midway_is_cut_off_but_an_idle_connection_stays(cold):
    """--read-timeout 1: a frame whose first bytes came must be complete within a second (before or after the
    handshake, stalled in the length or in the body); a connection that sends nothing between frames is left be."""
    idle_r, idle_w = await raw(cold.socket)
    stalled = []
    for hello, partial in [(False, b"\x00\x00"), (True, b"\x00"), (True, HEADER.pack(100) + b"0123456789")]:
        reader, writer = await raw(cold.socket, hello=hello)
        writer.write(partial)
        await writer.drain()
        stalled.append((reader, writer))
    for reader, writer in stalled:
        err = await recv(reader)
        assert isinstance(err, m.Error) and err.code == "bad_request" and err.id is None, err
        assert "not complete after 1 s" in err.message and "--read-timeout" in err.message
        assert await recv(reader) is None  # closed
        writer.close()
    # The idle connection has now been silent longer than the timeout: it still works.
    await send(idle_w, m.Status(id=5))
    assert isinstance(await recv(idle_r), m.StatusReply)
    idle_w.close()


async def test_bad_fields_get_an_error_and_the_connection_stays(warm):
    bad = {
        11: {"type": "generate", "id": 11, "prompt": "fn", "max_tokens": -1},
        12: {"type": "generate", "id": 12, "prompt": "fn", "sampling": {"temperature": -1.0}},
        13: {"type": "generate", "id": 13, "prompt": "fn", "max_tokens": "ten"},
        14: {"type": "fim", "id": 14, "prefix": "x", "deadline_ms": -5},
        22: {"type": "generate", "id": 22, "prompt": "fn", "deadline_ms": -1},
        23: {"type": "fim", "id": 23, "prefix": "x", "lookahead": -1},
        24: {"type": "fim", "id": 24, "prefix": "x", "beams": 0},
        25: {"type": "generate", "id": 25, "prompt": "fn", "beams": 9},
        26: {"type": "fim", "id": 26, "prefix": "x", "beams": 2, "sampling": {"temperature": 0.5}},
        27: {"type": "fim", "id": 27, "prefix": "x", "beams": 3, "sampling": {"repetition_penalty": 1.2}},
        28: {"type": "fim", "id": 28, "prefix": "x", "min_probability": 1.5},
        30: {"type": "fim", "id": 30, "prefix": "x", "max_tokens": 257},  # past half the tiny model's context
        31: {"type": "fim", "id": 31, "prefix": "x", "stop": [str(i) for i in range(33)]},  # 32 at most
        32: {"type": "generate", "id": 32, "prompt": "fn", "stop": ["x" * 1025]},  # of 1,024 characters at most
        33: {"type": "generate", "id": 33, "prompt": "fn", "stop": ["x" * 1024] * 16 + ["y"]},  # 16,384 in all
        29: {"type": "generate", "id": 29, "prompt": "fn", "min_probability": 0.05},  # a Fim's only
        15: {"type": "generate", "id": 15, "prompt": "fn", "bogus": True},
        16: {"type": "nonsense", "id": 16},
        17: {"type": "generate", "id": 17, "prompt": "fn", "sampling": {"temperature": float("nan")}},
        18: {"type": "generate", "id": 18, "prompt": ""},
        19: {"type": "generate", "id": 19, "prompt": "fn", "max_tokens": 10**6},
        20: {"type": "fim", "id": 20, "prefix": 5},
        21: {"type": "generate", "id": 21, "prompt": "fn", "sampling": {"top_p": 0.0}},
    }
    reader, writer = await raw(warm.socket)
    for msg in bad.values():
        await send(writer, msg)
    await send(writer, m.Hello(protocol=m.PROTOCOL_VERSION))  # a second Hello is a bad request, not fatal
    await send(writer, m.Generate(id=99, prompt="fn main", max_tokens=3))
    errors, anonymous = {}, []
    while not isinstance(msg := await recv(reader), m.Done):
        assert isinstance(msg, m.Error | m.Token), msg
        if isinstance(msg, m.Error):
            assert msg.code == "bad_request", msg
            if msg.id is None:
                anonymous.append(msg)
            else:
                errors[msg.id] = msg
    assert msg.id == 99 and msg.usage.completion_tokens == 3
    assert sorted(errors) == sorted(bad) and len(anonymous) == 1
    await send(writer, m.Status(id=100))
    assert isinstance(await recv(reader), m.StatusReply)
    writer.close()


async def test_a_plugins_many_stop_sequences_are_taken(warm):
    """An editor plugin's stop list (Continue sends 12 to 14 of its template's, Zed 14) with the user's own on top:
    32 sequences, 16,384 characters in all, are matched like any others (17 were refused)."""
    stops = [f"\nfn stop_{i:02d}".ljust(512, "x") for i in range(32)]
    assert len(stops) == 32 and sum(map(len, stops)) == 16384 and max(map(len, stops)) <= 1024
    reader, writer = await raw(warm.socket)
    await send(writer, m.Fim(id=1, prefix="fn main() {\n", suffix="\n}\n", max_tokens=4, stop=stops))
    while isinstance(msg := await recv(reader), m.Token):
        pass
    assert isinstance(msg, m.Done) and msg.id == 1, msg
    writer.close()


async def test_duplicate_in_flight_id(warm):
    reader, writer = await raw(warm.socket)
    # 400 tokens without drafts (300 with them took ~30 ms): still running when the Cancel below arrives, a round
    # trip after the refusal.
    await send(writer, m.Generate(id=7, prompt="fn main() {", max_tokens=400, lookahead=0))
    await send(writer, m.Generate(id=7, prompt="other", max_tokens=3))
    msg = await recv(reader)
    while isinstance(msg, m.Token):
        msg = await recv(reader)
    # Refused without its id (the frames of id 7 are the request in flight's), which goes on.
    assert isinstance(msg, m.Error) and msg.id is None and msg.code == "bad_request" and "in flight" in msg.message
    await send(writer, m.Cancel(id=7))
    while isinstance(msg := await recv(reader), m.Token):
        assert msg.id == 7
    assert isinstance(msg, m.Error) and msg.code == "cancelled"
    await send(writer, m.Generate(id=7, prompt="fn", max_tokens=2))  # the id is free again
    while isinstance(msg := await recv(reader), m.Token):
        pass
    assert isinstance(msg, m.Done) and msg.id == 7
    writer.close()


async def test_real_daemon_refuses_another_protocol_version(warm):
    reader, writer = await raw(warm.socket, hello=False)
    await send(writer, m.Hello(protocol=m.PROTOCOL_VERSION + 1))
    err = await recv(reader)
    assert isinstance(err, m.Error) and err.code == "unsupported_version"
    assert await recv(reader) is None
    writer.close()


# -- scheduling policies ------------------------------------------------------------------------------------


async def test_queue_full_answers_busy_at_once(cold):
    async with await Client.connect(cold.socket) as c:
        # No drafts (cold runs --lookahead 3: 400 tokens in ~100 model calls, the first could end before the status
        # below): both accepted requests are still at work after the four refusals and the status round trip.
        streams = [await c.generate("fn main() {", max_tokens=400, lookahead=0) for _ in range(6)]
        t0 = time.monotonic()
        for s in streams[2:]:  # --max-queue 2: two in flight, the rest refused
            err = await expect_error(s, "busy", timeout=5)
            assert "limit 2" in err.message and err.busy == m.BusyDetail("daemon", 2) and err.overflow is None
        assert time.monotonic() - t0 < 2
        st = await c.status()  # the two accepted ones are still at work: (at most) one running, one waiting
        assert st.active + st.queue == 2 and st.active <= 1, st
        for s in streams[:2]:
            await s.cancel()
        for s in streams[:2]:
            await expect_error(s, "cancelled")
    await until_idle(cold.socket)


async def test_one_connection_cannot_fill_the_queue(warm):
    """--max-per-connection 16 (of --max-queue 32): a client that floods the daemon gets `busy` for its own extra
    requests, and another connection is still served."""
    async with await Client.connect(warm.socket) as hog, await Client.connect(warm.socket) as other:
        streams = [await hog.generate("fn main() {", max_tokens=400) for _ in range(20)]
        admitted = await other.generate("fn ok", max_tokens=2)
        for s in streams[16:]:
            err = await expect_error(s, "busy", timeout=5)
            assert "16 requests in flight on this connection (limit 16 per connection" in err.message, err
            assert err.busy == m.BusyDetail("connection", 16), err.busy
        for s in streams[:16]:
            await s.cancel()
        out = await run(admitted)
        assert out.done.usage.completion_tokens == 2
    await until_idle(warm.socket)


async def test_busy_counts_one_request_as_one(tiny_bundle, tmp_path: Path):
    """Limits of 1 said "1 requests in flight"."""
    sock = tmp_path / "run" / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--max-queue", "1", "--max-per-connection", "1", "--max-active", "1")
    try:
        async with await Client.connect(sock) as a, await Client.connect(sock) as b:
            first = await a.generate("fn main() {", max_tokens=400, lookahead=0)  # no drafts: still running below
            mine = await expect_error(await a.generate("fn x", max_tokens=2), "busy", timeout=5)
            theirs = await expect_error(await b.generate("fn x", max_tokens=2), "busy", timeout=5)
            await first.cancel()
            await expect_error(first, "cancelled")
    finally:
        stop_daemon(proc)
    assert mine.message.startswith("1 request in flight on this connection (limit 1 per connection"), mine
    assert theirs.message.startswith("1 request in flight (limit 1)"), theirs


async def test_context_overflow_carries_its_figures(warm, tiny_engine):
    """A context_overflow carries the figures a front end words its own advice from (m31r_http), the very ones the
    message states; other errors carry no detail."""
    ctx = tiny_engine.config.max_context
    fits, too_long = "fn a() {}\n" * 30, "fn a() {}\n" * 60  # the second fills the context alone
    n_fits, n_long = (len(tiny_engine.tokenizer.encode(p)) for p in (fits, too_long))
    assert n_fits < ctx <= n_long
    async with await Client.connect(warm.socket) as c:
        for prompt, n, k in ((fits, n_fits, ctx - n_fits + 1), (too_long, n_long, 4)):  # k: past the room left
            err = await expect_error(await c.generate(prompt, max_tokens=k), "context_overflow")
            assert err.overflow == m.OverflowDetail(n, k, ctx) and err.busy is None, err.overflow
            said = f"prompt ({n} tokens) + max_tokens ({k}) = {n + k} exceeds the model's context of {ctx} tokens"
            assert said in err.message, err.message
        err = await expect_error(await c.generate("", max_tokens=2), "bad_request")
        assert err.overflow is None and err.busy is None
    await still_serves(warm.socket)


async def test_a_prompt_over_the_character_limit_is_refused_untokenised(warm):
    limit = 1 << 21  # --max-prompt-chars' default
    async with await Client.connect(warm.socket) as c:
        err = await expect_error(await c.generate("x" * (limit + 1), max_tokens=2, truncate=True), "bad_request")
        assert f"the prompt has {limit + 1} characters; this daemon takes at most {limit}" in err.message
        assert "--max-prompt-chars" in err.message
        err = await expect_error(await c.fim("x" * limit, "y", max_tokens=2), "bad_request")
        assert f"prefix, suffix and context have {limit + 1} characters" in err.message
    await still_serves(warm.socket)


async def test_a_huge_prompt_does_not_hold_up_other_clients(warm, tiny_config, tiny_engine):
    """A prompt under the limit that takes the tokenizer a second or more is tokenised off the inference thread
    (and without the GIL): requests from other clients keep being answered meanwhile."""
    from m31r.fim import heal_split

    byte_tok = tiny_engine.tokenizer
    big = ("fn main() { let x = 1; }\n" * 60_000)[:1_500_000]
    async with await Client.connect(warm.socket) as a, await Client.connect(warm.socket) as b:
        stream = await a.generate(big, max_tokens=2, truncate=True)
        pending = asyncio.ensure_future(run(stream, timeout=60))
        waits = []
        while not pending.done():
            t0 = time.perf_counter()
            out = await run(await b.generate("fn ok", max_tokens=1))
            waits.append(time.perf_counter() - t0)
            assert out.done.usage.completion_tokens == 1
        done = (await pending).done
    # Truncated to the context, from the left, then healed at its end (the byte vocabulary: a token a character).
    kept = tiny_config.max_context - 2
    assert done.usage.prompt_tokens == kept - len(heal_split(byte_tok, byte_tok.encode(big[-kept:]))[1])
    tokenising_s = done.timings.queue_ms / 1000  # the big request's wait: its tokenising
    assert tokenising_s > 0.4, done.timings  # it really was slow to tokenise...
    assert len(waits) >= 3 and max(waits) < tokenising_s / 2, (waits, done.timings)  # ...and held nobody up


async def test_newest_request_for_a_document_wins(warm, tiny_engine):
    prefix, suffix = "fn main() {\n" + "    let a = 1;\n" * 10 + "    let b = ", ";\n}\n"
    async with await Client.connect(warm.socket) as c:
        for attempt in range(5):  # on a starved machine the first request may finish before the second arrives
            doc = f"doc-newest-{attempt}"
            first = await c.fim(prefix, suffix, document=doc, max_tokens=64)
            await asyncio.wait_for(first.__anext__(), 10)
            second = await c.fim(prefix + "2", suffix, document=doc, max_tokens=8)
            other = await c.fim(prefix, suffix, document=f"other-{attempt}", max_tokens=8)  # unaffected
            try:
                await run(first)
            except DaemonError as e:
                assert e.code == "cancelled" and "superseded" in e.message, e
                superseded = True
            else:
                superseded = False
            assert (await run(second)).pieces == fim_reference(tiny_engine, prefix + "2", suffix, 8).pieces
            assert (await run(other)).pieces == fim_reference(tiny_engine, prefix, suffix, 8).pieces
            if superseded:
                break
        else:
            pytest.fail("the older request for the document was never superseded")


def _newline_seed(engine) -> tuple[int, Out]:
    """A seed whose sampled FIM completion has a line end after some text. The random tiny model greedily repeats
    the cursor's last character, so it never writes a newline at a FIM cursor; a seeded sample does, reproducibly.
    (The tiny vocabulary has no token of text and a line end: the line end is a token of its own.)"""
    from m31r.sampling import SamplingParams

    for seed in range(40):
        ref = fim_reference(engine, *DEADLINE_FIM, 64, SamplingParams(temperature=1.0, seed=seed))
        nl = next((i for i, (_, piece) in enumerate(ref.pieces) if "\n" in piece), None)
        if nl is not None and nl > 1 and ref.text.index("\n") > 0:
            return seed, ref
    pytest.fail("no seed gives a completion with a newline inside a token after some text")


DEADLINE_FIM = ("fn main() {\n    let x = ", "\n}\n")


def test_the_engine_makes_no_model_call_past_the_deadline(tiny_engine):
    """Engine.generate(deadline=...), driven round by round as the scheduler drives it, with the clock passing the
    deadline between two rounds: the token computed in that round is the last one (cut at its line end if it holds
    one), no further model call is asked for, and a deadline spent before prefill gives no token at all."""
    from m31r.engine import Chunk, Decode, Outcome
    from m31r.fim import FimBudget, build_fim_prompt
    from m31r.sampling import SamplingParams

    seed, ref = _newline_seed(tiny_engine)
    nl = next(i for i, (_, piece) in enumerate(ref.pieces) if "\n" in piece)
    assert nl > 1
    p = build_fim_prompt(tiny_engine.tokenizer, *DEADLINE_FIM, FimBudget.for_context(tiny_engine.config.max_context))

    def drive(late_at: int, stop: tuple[str, ...] = ()) -> tuple[list[tuple[int | None, str]], Outcome]:
        """Run the generation with the clock passing the deadline while the call that yields token `late_at`
        runs (the rounds before it take milliseconds; the deadline is a second away, then slept past)."""
        res, pieces = Outcome(prompt_tokens=0), []
        deadline = time.perf_counter() + 1.0
        gen = tiny_engine.generate(p.ids, max_tokens=64, sampling=SamplingParams(temperature=1.0, seed=seed),
                                   result=res, batched=True, heal=p.heal, deadline=deadline, stop=stop)
        out = None
        while True:
            try:
                ev = gen.send(out)
            except StopIteration:
                return pieces, res
            out = None
            if isinstance(ev, Chunk):
                out = tiny_engine.run([], [ev])[1][0]
            elif isinstance(ev, Decode):
                out = tiny_engine.run([ev], [])[0][0]
                if len(pieces) == late_at:
                    assert time.perf_counter() < deadline, "the rounds before the deadline took a second"
                    time.sleep(max(0.0, deadline - time.perf_counter()) + 0.01)
            else:
                pieces.append((ev.id, ev.text))

    # Past the deadline at the token holding the line end: the text ends at the line end.
    pieces, res = drive(nl)
    cut = ref.pieces[nl][1].index("\n")  # (0 with the tiny vocabulary: that token's piece is then empty)
    assert pieces == [*ref.pieces[:nl], (ref.pieces[nl][0], ref.pieces[nl][1][:cut])]
    assert res.finish_reason == "deadline" and res.text == ref.text[: ref.text.index("\n")]
    # The same where a stop sequence starting with a line end holds it back (every Fim with a line below the cursor
    # has one: m31r.fim.suffix_stop): the held line end, released at the end, is cut there too.
    held, res = drive(nl, ("\n\x00never",))
    assert held == pieces and res.text == ref.text[: ref.text.index("\n")] and res.finish_reason == "deadline"
    # Past it at a token without one: that token is the last, and no further call is made.
    pieces, res = drive(1)
    assert pieces == ref.pieces[:2] and res.finish_reason == "deadline" and res.completion_tokens == 2
    # Spent before the prefill: no model call, no token.
    res = Outcome(prompt_tokens=0)
    gen = tiny_engine.generate(p.ids, max_tokens=64, result=res, batched=True, deadline=time.perf_counter())
    assert list(gen) == [] and res.finish_reason == "deadline" and res.completion_tokens == 0


async def test_a_deadline_is_hard(warm):
    """A request with a small deadline and a large max_tokens ends with finish_reason "deadline" within about one
    round of the deadline, whether or not a line end came, and the next request is served at once."""
    margin = 0.25
    async with await Client.connect(warm.socket) as c:
        # Without a deadline this request runs at least three times as long as the deadline below (at most 150 ms:
        # the tiny model's 480 tokens take from ~40 ms on a fast CPU to ~0.3 s; without drafts, which the tiny
        # model's loops would accept nearly all of). Times are the daemon's own (Done.timings, from the request's
        # arrival, as its deadline counts): the test's clock also counts the waits of a client starved of CPU, and a
        # deadline set from an inflated run could outlast the real one, which then ends with "length"; the faster
        # of two runs, for a daemon that waited for the CPU during one.
        fulls = [await run(await c.generate("fn main() {", max_tokens=480, lookahead=0)) for _ in range(2)]
        full, full_ms = fulls[0], min(f.done.timings.total_ms for f in fulls)
        deadline_ms = min(150, int(full_ms / 3))
        assert full.finish_reason == "length" and deadline_ms >= 5, full_ms
        out = await run(await c.generate("fn main() {", max_tokens=480, deadline_ms=deadline_ms, lookahead=0))
        assert out.finish_reason == "deadline" and out.done.timings.total_ms < deadline_ms + margin * 1000, out.done
        assert out.done.usage.completion_tokens < 480 and full.text.startswith(out.text)
        # Fim too: 64 tokens take longer than 1 ms.
        out = await run(await c.fim(*DEADLINE_FIM, max_tokens=64, deadline_ms=1))
        assert out.finish_reason == "deadline" and out.done.timings.total_ms < 1 + margin * 1000, out.done
        assert out.done.usage.completion_tokens < 64
        # The inference thread moved on: the next request does not wait behind the one that ran out of time.
        nxt = await run(await c.generate("fn ok", max_tokens=2))
        assert nxt.finish_reason == "length" and nxt.done.timings.queue_ms < margin * 1000, nxt.done
    await until_idle(warm.socket)


async def test_a_deadline_spent_in_the_queue_gets_done_without_tokens(cold):
    """--max-active 1: a request queued behind a long one is answered `deadline`, with no tokens, when its time
    runs out, not when it reaches the head; deadline_ms 0 is spent on arrival."""
    async with await Client.connect(cold.socket) as c:
        # The waiting request's deadline is a quarter of how long the long one runs alone (at most 100 ms): the tiny
        # model's 480 tokens, one a step (no drafts), take from ~40 ms on a fast CPU to ~0.3 s. By the daemon's clock
        # (the faster of two runs): the test's own counts a starved client's waits, and a deadline set from it could
        # outlast the long request, so that the waiting one started and got tokens.
        alones = [await run(await c.generate("fn main() {", max_tokens=480, lookahead=0)) for _ in range(2)]
        deadline_ms = min(100, int(min(a.done.timings.total_ms for a in alones) / 4))
        assert all(a.finish_reason == "length" for a in alones) and deadline_ms >= 5, [a.done for a in alones]
        long = await c.generate("fn main() {", max_tokens=480, lookahead=0)
        waiting = await c.generate("fn x", max_tokens=8, deadline_ms=deadline_ms)
        out = await run(waiting, timeout=10)
        assert out.finish_reason == "deadline" and out.pieces == [] and out.done.usage.completion_tokens == 0
        assert out.done.usage.prompt_tokens > 0 and out.done.timings.queue_ms >= deadline_ms
        assert long.done is None  # still running: the expired one did not wait for it
        await long.cancel()
        out = await run(await c.fim("fn ", "", max_tokens=8, deadline_ms=0))
        assert out.finish_reason == "deadline" and out.pieces == []
    await until_idle(cold.socket)


async def test_typed_through(warm, tiny_engine):
    from m31r.engine import line_logprobs

    prefix, suffix = "fn main() {\n    let total: u64 = values.iter().sum", "();\n}\n"
    async with await Client.connect(warm.socket) as c:
        first = await run(await c.fim(prefix, suffix, document="doc-typed", max_tokens=8))
        text = first.text
        assert first.done.source == "model" and len(text) >= 2
        # How sure the model was: the engine's own log-probabilities of the same completion, summed.
        want = fim_outcome(tiny_engine, prefix, suffix, 8)
        assert first.done.logprob == pytest.approx(sum(want.logprobs), abs=1e-3) and first.done.logprob < 0
        assert first.done.line_logprob == pytest.approx(
            line_logprobs(tiny_engine.tokenizer.token_bytes, want.tokens, want.logprobs)[0], abs=1e-3)
        assert first.done.line_logprob >= first.done.logprob
        # Each line's figure: as many as the text has lines, the first the line_logprob, all of them the logprob.
        by_line = first.done.logprob_by_line
        assert len(by_line) == text.count("\n") + 1 and by_line[0] == first.done.line_logprob
        assert sum(by_line) == pytest.approx(first.done.logprob, abs=1e-3)
        for k in (1, 2):  # the user types the suggestion's first characters, with the same settings
            out = await run(await c.fim(prefix + text[:k], suffix, document="doc-typed", max_tokens=8))
            assert out.done.source == "typed_through" and out.text == text[k:]
            assert out.done.usage.completion_tokens == 0
            assert out.done.logprob == first.done.logprob  # lower bounds for the rest: the whole's, the line's
            assert out.done.logprob_by_line == by_line[text[:k].count("\n") :]
            assert out.done.line_logprob == out.done.logprob_by_line[0]
        # Typing something else asks the model again.
        out = await run(await c.fim(prefix + text[:2] + "Q", suffix, document="doc-typed", max_tokens=8))
        assert out.done.source == "model"
        assert out.pieces == fim_reference(tiny_engine, prefix + text[:2] + "Q", suffix, 8).pieces


async def test_logprobs_come_with_each_token(warm, tiny_engine):
    """A request's `logprobs` puts on each Token frame its token's log-probability and that many of the likeliest
    tokens at its step: the engine's own figures, the greedy token first among them, summing to Done.logprob. Without
    it the frames carry neither; with a beam search, or over the limit, it is refused; and such a request is answered
    by the model, not typed through."""
    prefix, suffix, doc = "fn main() {\n    let total: u64 = values.iter().sum", "();\n}\n", "doc-logprobs"
    want = fim_outcome(tiny_engine, prefix, suffix, 8)
    async with await Client.connect(warm.socket) as c:
        stream = await c.fim(prefix, suffix, max_tokens=8, logprobs=3)
        frames = [t async for t in stream]
        # The tokens writing the healed `sum` again are not streamed; Done's logprob counts them (each the only one
        # possible: 0).
        h = want.healing_tokens
        assert [t.token for t in frames] == want.tokens[h:] and len(frames) == 8 and h > 0
        assert [t.logprob for t in frames] == pytest.approx(want.logprobs[h: h + 8], abs=1e-3)
        assert sum(t.logprob for t in frames) + sum(want.logprobs[:h]) == pytest.approx(stream.done.logprob, abs=1e-3)
        for t in frames:
            # greedy: the likeliest first; at most 3 (fewer where the healing masks leave fewer tokens possible)
            assert 1 <= len(t.top_logprobs) <= 3 and t.top_logprobs[0].token == t.token
            assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-3)
            assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
            for x in t.top_logprobs:
                b = tiny_engine.tokenizer.token_bytes[x.token]
                assert x.text == (b.decode("utf-8", "replace") if b is not None else "<|endoftext|>"), x
                assert math.isfinite(x.logprob)
            assert len(t.top_logprobs) == 3  # (not the healing tokens': each the only one possible, not streamed)
        plain = [t async for t in await c.fim(prefix, suffix, max_tokens=8)]
        assert [t.token for t in plain] == want.tokens[h: h + 8]
        assert all(t.logprob is None and t.top_logprobs == [] for t in plain)
        chosen = [t async for t in await c.fim(prefix, suffix, max_tokens=8, logprobs=0)]
        assert [t.logprob for t in chosen] == [t.logprob for t in frames] and all(not t.top_logprobs for t in chosen)
        e = await expect_error(await c.fim(prefix, suffix, max_tokens=8, logprobs=21), "bad_request")
        assert "between 0 and 20" in e.message
        # A beam search's answer carries the figures of its own steps: the same answer as without them.
        beam = await c.fim(prefix, suffix, max_tokens=8, beams=3, logprobs=2)
        found = [t async for t in beam]
        without = await run(await c.fim(prefix, suffix, max_tokens=8, beams=3))
        assert [t.token for t in found] == without.tokens and beam.done.logprob == without.done.logprob
        scored = [t for t in found if t.token is not None]
        total, ended = sum(t.logprob for t in scored), beam.done.finish_reason == "stop"  # (no frame: the end)
        assert total >= beam.done.logprob - 1e-3 and (ended or total == pytest.approx(beam.done.logprob, abs=1e-3))
        assert all(1 <= len(t.top_logprobs) <= 2 and t.logprob <= t.top_logprobs[0].logprob + 1e-3 for t in scored)
        first = await run(await c.fim(prefix, suffix, document=doc, max_tokens=8))
        again = await c.fim(prefix + first.text[:1], suffix, document=doc, max_tokens=8, logprobs=0)
        frames = [t async for t in again]
        assert again.done.source == "model" and all(t.logprob is not None for t in frames if t.token is not None)


async def test_typed_through_honours_max_tokens_and_stop(warm, tiny_engine):
    """A typed-through answer obeys the new request's limits: at most max_tokens of the suggestion's tokens (a
    partly typed one counts as one), ending before its first stop sequence, as the model would have stopped."""
    prefix, suffix, doc = "fn scale(x: f32) -> f32 {\n    let y = x", ";\n    y\n}\n", "doc-typed-limits"
    async with await Client.connect(warm.socket) as c:
        first = await run(await c.fim(prefix, suffix, document=doc, max_tokens=13))
        # The first token writes the healed `x` again (m31r.fim's token healing): it is not streamed.
        assert first.done.usage.healed_tokens == 1
        texts = [p for _, p in first.pieces]
        assert first.done.source == "model" and len(texts) >= 5 and all(texts), first.pieces

        async def typed(k: int, **limits) -> Out:
            out = await run(await c.fim(prefix + first.text[:k], suffix, document=doc, **limits))
            assert out.done.source == "typed_through"
            return out

        k = len(texts[0])  # the first token typed
        out = await typed(k, max_tokens=2)
        assert out.text == texts[1] + texts[2] and out.finish_reason == "length"
        rest = first.text[k + 1 :]
        stop = rest[2:4]
        out = await typed(k + 1, max_tokens=12, stop=["\x00never", stop])
        assert out.text == rest[: rest.index(stop)] and out.finish_reason == "stop"
        out = await typed(k + 2, max_tokens=0)  # (each request types one more character: typed-through needs one)
        assert out.text == "" and out.pieces == [] and out.finish_reason == "length"
        # The limits cut the answer, not what the daemon remembers: a later request may have more.
        left = sum(e > k + 3 for e in itertools.accumulate(len(t) for _, t in first.pieces))  # tokens not typed
        out = await typed(k + 3, max_tokens=left)
        assert out.text == first.text[k + 3 :] and out.finish_reason == first.finish_reason == "length"
        # Allowed more than the first request was, the model answers: the rest ended at the first one's limit.
        want = fim_reference(tiny_engine, prefix + first.text[: k + 4], suffix, 14)
        out = await run(await c.fim(prefix + first.text[: k + 4], suffix, document=doc, max_tokens=14))
        assert out.done.source == "model" and out.pieces == want.pieces


async def test_typed_through_only_where_the_earlier_answer_is_this_ones(warm, tiny_engine):
    """An answer the earlier request's own settings ended or shaped is not typed through to a request without them:
    a confidence floor it lacks, another beam width or other project context. The model answers those, and what it
    answers is what a fresh document gets."""
    from m31r_protocol.messages import Snippet

    prefix, suffix = "fn scale(x: f32) -> f32 {\n    let y = x", ";\n    y\n}\n"
    async with await Client.connect(warm.socket) as c:
        # (A stop sequence the new request lacks: test_typed_through_counts_a_partly_typed_token_as_one. The tiny
        # model writes one character over and over, so no stop it meets leaves text before it.)
        cases = {
            "floor": dict(min_probability=0.999),
            "beams": dict(beams=2),
            "context": dict(context=[Snippet(path="src/a.rs", text="fn a() {}\n")]),
        }
        ran = []
        for name, earlier in cases.items():
            doc = f"doc-shape-{name}"
            first = await run(await c.fim(prefix, suffix, document=doc, max_tokens=16, **earlier))
            if not first.text:
                continue  # (nothing to type through: the floor may end it at once)
            ran.append(name)
            typed = prefix + first.text[:1]
            # Beams and context shaped the whole answer: even with the same limits it is not this request's. The
            # floor and the stop ended it: a request without them would go on.
            n = 16
            want = fim_reference(tiny_engine, typed, suffix, n)
            out = await run(await c.fim(typed, suffix, document=doc, max_tokens=n))
            assert out.done.source == "model", name
            assert out.pieces == want.pieces, name
        assert {"beams", "context"} <= set(ran)
    # (A deadline's cut: test_typed_through_counts_a_partly_typed_token_as_one; the tiny model outruns any deadline.)


def test_typed_through_counts_a_partly_typed_token_as_one():
    """(The tiny model's tokens are single bytes, so the daemon test above never types into a token.)"""
    from m31rd.server import Typed, clip, typed_through

    def cut(*args) -> tuple[str, str] | None:  # the answer's text and finish reason
        answer = clip(*args)
        return None if answer is None else answer[:2]

    last = Typed("let x = ", "", "foo.bar()", "length", (3, 4, 7, 9))  # tokens "foo" "." "bar" "()"
    rest = typed_through(last, m.Fim(id=1, prefix="let x = fo", suffix=""))
    assert rest is not None and rest.text == "o.bar()" and rest.ends == (1, 2, 5, 7)
    assert cut(rest, 2, []) == ("o.", "length")
    assert cut(rest, 4, []) == ("o.bar()", "length") and cut(rest, 9, ["("]) == ("o.bar", "stop")
    assert cut(rest, 3, ["r()"]) == ("o.bar", "length")  # a stop beyond the limit is never reached
    assert cut(rest, 5, []) is None  # the rest ended at the earlier request's limit: this one allows more
    assert cut(dataclasses.replace(rest, finish_reason="deadline"), 5, []) is None  # or at its deadline
    assert cut(dataclasses.replace(rest, max_tokens=6), 5, []) == ("o.bar()", "length")  # not more than it was
    for stopped_by, stops, answered in [("end", (), True), ("repeat", (), True), ("unsure", (), False),
                                        ("sequence", ("\n",), False)]:
        ended = dataclasses.replace(rest, finish_reason="stop", stopped_by=stopped_by, stops=stops,
                                    min_probability=0.05)
        assert (cut(ended, 5, []) == ("o.bar()", "stop")) is answered, stopped_by
    assert cut(ended, 5, [], 0.05) is None and cut(ended, 5, ["\n"], 0.05) == ("o.bar()", "stop")
    ended = dataclasses.replace(ended, stopped_by="unsure")
    assert cut(ended, 5, [], 0.05) == ("o.bar()", "stop")  # the same floor: the answer the editor had
    ended = dataclasses.replace(rest, finish_reason="stop", stopped_by="sequence", stops=("\n",))
    assert cut(ended, 5, ["\n", ";"]) == ("o.bar()", "stop")  # this request stops there too


def test_typed_through_keeps_the_runners_up_still_open():
    """A beam search's runners-up that the typed text agrees with stay beside the answer, less what was typed and cut
    at this request's stops, so an editor cycling through them does not lose them on a keystroke."""
    from m31rd.server import Typed, clip_alternatives, typed_through

    last = Typed("x = ", "", "foo(a)", "stop", (3, 6), max_tokens=8,
                 alternatives=("foo(b)", "bar()", "f", "foo(a);\nz", "foo(a)"))
    rest = typed_through(last, m.Fim(id=1, prefix="x = fo", suffix=""))
    assert rest is not None and rest.text == "o(a)" and rest.alternatives == ("o(b)", "o(a);\nz", "o(a)")
    # the answer itself is not repeated among them; a stop cuts them as it cuts the answer
    assert clip_alternatives(rest, "o(a)", 8, []) == ["o(b)", "o(a);\nz"]
    assert clip_alternatives(rest, "o(a)", 8, [";"]) == ["o(b)"]
    assert clip_alternatives(rest, "o(a)", 8, ["o"]) == []  # cut to nothing
    assert clip_alternatives(rest, "o(a)", 7, []) == []  # a lower limit would cut them where their tokens end


async def test_typed_through_answers_with_the_beam_runners_up(warm):
    prefix, suffix, doc = "fn main() {\n    let total: u64 = values.iter().sum", "();\n}\n", "doc-typed-beams"
    async with await Client.connect(warm.socket) as c:
        first = await run(await c.fim(prefix, suffix, document=doc, max_tokens=8, beams=4))
        assert first.done.source == "model" and len(first.text) >= 2 and first.done.alternatives
        k = 1
        typed = first.text[:k]
        out = await run(await c.fim(prefix + typed, suffix, document=doc, max_tokens=8, beams=4))
        assert out.done.source == "typed_through" and out.text == first.text[k:]
        want = [a[k:] for a in first.done.alternatives if a.startswith(typed) and len(a) > k and a[k:] != out.text]
        assert out.done.alternatives == want and want  # (the tiny model's runners-up share its first character)


def test_typed_through_leaves_out_the_figures_of_the_lines_typed():
    from m31rd.server import Typed, typed_through

    last = Typed("", "", "ab\ncd\nef", "length", (3, 6, 8), -6.0, (-1.0, -2.0, -3.0))
    assert typed_through(last, m.Fim(id=1, prefix="a", suffix="")).by_line == (-1.0, -2.0, -3.0)
    assert typed_through(last, m.Fim(id=1, prefix="ab\nc", suffix="")).by_line == (-2.0, -3.0)


# -- socket safety and lifecycle ----------------------------------------------------------------------------


def test_socket_permissions(warm):
    assert stat.S_IMODE(warm.socket.stat().st_mode) == 0o600
    assert stat.S_IMODE(warm.socket.parent.stat().st_mode) == 0o700  # the daemon created this folder
    assert stat.S_ISSOCK(warm.socket.stat().st_mode)


def refused_daemon(bundle: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `m31r daemon` where it must refuse to start: it fails before loading the model, or times out."""
    return subprocess.run([*DAEMON, "--bundle", str(bundle), "--threads", "1", *args], capture_output=True, text=True,
                          env=env or ENV, timeout=60)


@pytest.mark.parametrize("mode", [0o1777, 0o755, 0o770], ids=oct)
def test_a_socket_folder_others_can_use_is_refused_and_keeps_its_mode(tiny_bundle, tmp_path, mode):
    """`--socket /tmp/m.sock`: a folder others can write to (or look into) could hold someone else's socket in our
    place. The daemon refuses it, and never chmods it (that would change /tmp for everyone)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    r = refused_daemon(tiny_bundle.path, "--socket", str(shared / "m.sock"))
    assert r.returncode != 0 and f"mode {mode:04o}" in r.stderr and "must be 0700" in r.stderr, r.stderr
    assert stat.S_IMODE(shared.stat().st_mode) == mode
    assert not (shared / "m.sock").exists()
    # The way out it offers is safe wherever the folder is: a folder of one's own inside it. `chmod 700 /tmp` (or
    # `chmod 700 /`, for `--socket /tmp`), which it used to offer, would lock every other user out of /tmp.
    assert f"such as {shared / 'm31r' / 'm31rd.sock'}" in r.stderr and "chmod" not in r.stderr, r.stderr


def test_a_socket_folder_at_home_that_others_can_read_gets_the_chmod_advice(tiny_bundle, tmp_path):
    """Inside the home folder, a folder others can look into is most likely the user's own: there `chmod 700` is
    offered as well."""
    home = tmp_path / "home"
    (home / "socks").mkdir(parents=True, mode=0o755)
    os.chmod(home / "socks", 0o755)
    r = refused_daemon(tiny_bundle.path, "--socket", str(home / "socks" / "m.sock"), env={**ENV, "HOME": str(home)})
    assert r.returncode != 0 and f"run `chmod 700 {home / 'socks'}` if only you use it" in r.stderr, r.stderr
    assert stat.S_IMODE((home / "socks").stat().st_mode) == 0o755


@pytest.mark.skipif(os.geteuid() != 0, reason="making a folder owned by another user needs root")
def test_a_squatted_default_socket_folder_is_refused(tiny_bundle, tmp_path):
    """No XDG_RUNTIME_DIR: the socket lives in $TMPDIR/m31r-<uid>/. Another user who made that folder first
    (mode 0700, so only they can look inside) would own whatever socket appears in it: the daemon refuses."""
    squatted = tmp_path / f"m31r-{os.getuid()}"
    squatted.mkdir(mode=0o700)
    os.chown(squatted, 65534, 65534)
    env = {k: v for k, v in ENV.items() if k not in ("XDG_RUNTIME_DIR", "M31R_SOCKET")}
    r = refused_daemon(tiny_bundle.path, env={**env, "TMPDIR": str(tmp_path)})
    assert r.returncode != 0 and f"{squatted} belongs to uid 65534" in r.stderr, r.stderr
    st = squatted.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (65534, 0o700)
    assert list(squatted.iterdir()) == []


@pytest.mark.parametrize("fate", ["removed", "replaced"])
def test_a_daemon_whose_socket_file_is_gone_stops(tiny_bundle, tmp_path: Path, fate: str):
    """A daemon whose socket file was removed (a temp-folder cleaner), or replaced (its folder removed and another
    daemon started there), can be reached by no client, `m31r stop` included, and its lock kept a new daemon from
    starting on the path: it stops by itself, lets go of the lock, and leaves a socket that is not its own alone."""
    import fcntl

    sock = tmp_path / "run" / "m31rd.sock"
    d = launch(tiny_bundle.path, sock)
    stand_in = None
    try:
        async def connected() -> Client:
            return await Client.connect(sock)

        loop = asyncio.new_event_loop()
        client = loop.run_until_complete(connected())
        sock.unlink()
        if fate == "replaced":
            stand_in = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            stand_in.bind(str(sock))
            theirs = sock.lstat().st_ino
        assert d.proc.wait(15) == 0, "".join(d.lines)[-2000:]
        loop.run_until_complete(asyncio.wait_for(client.closed.wait(), 5))  # its clients were told: hung up
        loop.run_until_complete(client.close())
        loop.close()
        d.wait_logs(lambda x: x["msg"] == "stopped")
        (warned,) = [x for x in d.logs() if x["level"] == "warning" and "socket file" in x["msg"]]
        assert f"{sock} was {fate}" in warned["msg"], warned
        assert d.logs()[-1]["reason"].startswith(f"the socket file was {fate}")
        if fate == "replaced":
            assert sock.lstat().st_ino == theirs  # not removed at the stop: another's
        else:
            assert not sock.exists()
        lock = os.open(sock.with_name(sock.name + ".lock"), os.O_RDWR)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: a new daemon may start on the path
        finally:
            os.close(lock)
    finally:
        stop_daemon(d.proc)
        if stand_in is not None:
            stand_in.close()


def test_stale_socket_is_replaced(life):
    assert life.proc.poll() is None
    asyncio.run(still_serves(life.socket))


@pytest.mark.skipif(os.geteuid() != 0, reason="connecting as another user needs root")
def test_other_users_are_refused(life):
    folder = life.socket.parent
    os.chmod(folder, 0o755)  # open the doors for this test daemon only: the uid check must still refuse
    os.chmod(life.socket, 0o666)
    hello = pack(msgspec.msgpack.encode(m.Hello(protocol=m.PROTOCOL_VERSION)))
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody and connect
        code = 0
        try:
            os.close(r)
            os.chdir(folder)  # a relative path: /tmp's parents need not be searchable by nobody
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(life.socket.name)
            with contextlib.suppress(OSError):  # the daemon may refuse and hang up before reading anything
                s.sendall(hello)
            data = b""
            # Linux reports a peer that closed with our hello unread as a reset, after the data it sent.
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(65536):
                    data += chunk
            os.write(w, data)
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            os.write(w, b"EXC" + repr(e).encode())
            code = 1
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    try:
        assert os.waitstatus_to_exitcode(status) == 0, data
        (size,) = HEADER.unpack(data[:4])
        err = m.server_decoder().decode(data[4 : 4 + size])
        assert isinstance(err, m.Error) and err.code == "forbidden", err
        assert len(data) == 4 + size  # nothing else, then closed
    finally:
        os.chmod(folder, 0o700)
        os.chmod(life.socket, 0o600)
    assert life.wait_logs(lambda x: x["msg"].startswith("refused a connection from uid 65534"))
    asyncio.run(still_serves(life.socket))


def test_auto_precision_is_resolved_and_reported(life):
    """`life` runs the daemon's default precision (m31r.precision: fp32 activations with int8 weights where the fp32
    kernels run and pass their self-check). The ready log and Status say which it chose, and it serves."""
    import torch

    from m31r.engine import auto_precision

    want = auto_precision(torch.device("cpu"), "auto", "auto", None)  # test_quant checks the rules themselves
    ready = life.wait_logs(lambda x: x.get("msg") == "ready")[0]
    assert (ready["dtype"], ready["quant"]) == want
    native_families = ("avx512", "avx512vnni", "avx2vnni", "avx2", "neon", "eager")
    warm = life.wait_logs(lambda x: x.get("msg") == "warm")[0]  # before ready: the probe and a short generation
    assert warm["decode_widths"] and warm["decode_widths"][-1] == 8 and warm["ts"] <= ready["ts"]
    assert warm["kernels"] in native_families and warm["kernels_why"]  # which, and why
    assert {"native_attention", "native_int8", "native_int4", "native_float"} <= warm.keys()
    assert warm["precision_why"].startswith("dtype ")  # how auto resolved
    if warm["native_int8"]:
        assert warm["int8_kernel"] and warm["int8_check"].startswith("int8 self-check passed")

    async def ask() -> tuple[str, str | None, str]:
        async with await Client.connect(life.socket) as c:
            st = await c.status()
            text, _ = await (await c.generate("fn main() {", max_tokens=6)).collect()
            return st.dtype, st.quant, text

    dtype, quant, text = asyncio.run(ask())
    assert (dtype, quant) == want and text


def test_second_daemon_on_a_live_socket_refuses_to_start(life, tiny_bundle):
    t0 = time.monotonic()
    r = subprocess.run([*DAEMON, "--bundle", str(tiny_bundle.path), "--socket", str(life.socket), "--threads", "1"],
                       capture_output=True, text=True, env=ENV, timeout=60)
    assert r.returncode != 0 and "already" in r.stderr, r.stderr
    # The way out names the socket: a bare `m31r stop` stops the daemon on the default socket, not this one.
    assert f"(stop it with `m31r stop --socket {life.socket}`)" in r.stderr, r.stderr
    assert time.monotonic() - t0 < 30  # it fails before loading the model
    assert life.socket.exists()
    asyncio.run(still_serves(life.socket))


def test_sigterm_with_requests_in_flight(life):
    async def scenario() -> tuple[str, int]:
        async with await Client.connect(life.socket) as c:
            s = await c.generate("fn main() {", max_tokens=300)
            await asyncio.wait_for(s.__anext__(), 10)
            life.proc.send_signal(signal.SIGTERM)
            try:
                out = await run(s, timeout=20)
                outcome = "done", out.done.usage.completion_tokens
            except DaemonError as e:
                assert e.code == "shutting_down", e  # not `cancelled`: nobody cancelled it
                outcome = e.code, 0
            await asyncio.wait_for(c.closed.wait(), 20)  # then the daemon hangs up
            return outcome

    outcome, _ = asyncio.run(scenario())
    assert outcome in ("done", "shutting_down")
    assert life.proc.wait(30) == 0
    assert not life.socket.exists()
    life.wait_logs(lambda x: x["msg"] == "stopped")
    logs = life.logs()  # every line is JSON, the shutdown included
    assert [x["msg"] for x in logs if x["msg"] in ("stopping", "stopped")] == ["stopping", "stopped"]
    assert logs[-1]["reason"] == "signal SIGTERM"


# -- cache determinism while typing -------------------------------------------------------------------------

BS = "\b"
TYPING = [
    (  # typing a statement, Enter, a typo fixed with backspace
        "use std::collections::HashMap;\n\nfn count(words: &[&str]) -> HashMap<&str, usize> {\n"
        "    let mut map = HashMap::new();\n    for w in words {\n        ",
        "\n    }\n    map\n}\n",
        "*map.entry(w).or_insert(0) += 1;\n        lex" + BS + BS + "et z" + BS + "n = 2;",
    ),
    (  # the cursor in the middle of a file: a long fixed suffix
        "struct Point {\n    x: f64,\n    y: f64,\n}\n\nimpl Point {\n    fn norm(&self) -> f64 {\n        ",
        "\n    }\n}\n\nfn main() {\n    let p = Point { x: 3.0, y: 4.0 };\n    println!(\"{}\", p.norm());\n}\n",
        "(self.x * self.x + self" + BS + "f.y * self.y).sqrt()\n    ",
    ),
    (  # a short file that grows past the first cache chunk
        "fn f() {",
        "}\n",
        "\n    let abc = 1;\n    let d = abc * 2;\n    abc +" + BS + "* d" + BS + "3",
    ),
]


async def typing_session(sock: Path, document: str, prefix: str, suffix: str, keys: str) -> list[Out]:
    outs = []
    async with await Client.connect(sock) as c:
        for key in keys:
            prefix = prefix[:-1] if key == BS else prefix + key
            outs.append(await run(await c.fim(prefix, suffix, document=document, max_tokens=6)))
    return outs


def stable_heads(engine, prefix: str, suffix: str, keys: str) -> list[int]:
    """Per keystroke, the prompt tokens before the cursor line's text (what typing on that line leaves alone)."""
    from m31r.fim import FimBudget, build_fim_prompt

    budget, heads = FimBudget.for_context(engine.config.max_context), []
    for key in keys:
        prefix = prefix[:-1] if key == BS else prefix + key
        p = build_fim_prompt(engine.tokenizer, prefix, suffix, budget)
        heads.append(len(p.ids) - p.line_tokens)
    return heads


@pytest.mark.parametrize("case", range(len(TYPING)))
async def test_cache_hits_give_the_same_output_as_no_cache(warm, cold, tiny_engine, case):
    prefix, suffix, keys = TYPING[case]
    doc = f"typing-{case}.rs"
    hot, ref = await asyncio.gather(typing_session(warm.socket, doc, prefix, suffix, keys),
                                    typing_session(cold.socket, doc, prefix, suffix, keys))
    assert all(r.done.source == "model" and r.done.usage.cached_tokens == 0 for r in ref)
    model = [i for i, h in enumerate(hot) if h.done.source == "model"]
    assert len(model) >= len(keys) * 2 // 3
    for i in model:
        h, r = hot[i], ref[i]
        assert (h.pieces, h.finish_reason, h.done.usage.prompt_tokens) == (
            r.pieces, r.finish_reason, r.done.usage.prompt_tokens), f"keystroke {i}"
        assert 0 <= h.done.usage.cached_tokens < h.done.usage.prompt_tokens
    # Reuse happens in whole 32-token chunks: every keystroke whose unchanged head, and the head of the
    # previous model request for the document, hold a whole chunk must be a cache hit.
    heads = stable_heads(tiny_engine, prefix, suffix, keys)
    eligible = [i for j, i in zip(model, model[1:], strict=False) if heads[i] >= 32 and heads[j] >= 32]
    missed = [(i, keys[i], hot[i].done.usage) for i in eligible if hot[i].done.usage.cached_tokens == 0]
    assert not missed
    assert len(eligible) >= (len(model) * 2 // 3 if case < 2 else 8)


# -- the log ------------------------------------------------------------------------------------------------


async def test_json_log_lines(warm):
    async with await Client.connect(warm.socket, client="logtest") as c:
        await run(await c.generate(MARKER, max_tokens=2))
        await run(await c.fim("fn " + MARKER, MARKER, document=MARKER, max_tokens=2))
        await expect_error(await c.generate(MARKER, max_tokens=-1), "bad_request")
    await warm.await_logs(lambda x: x.get("client") == "logtest", n=3)
    logs = warm.logs()  # raises if any line is not JSON
    assert not any(MARKER in line for line in warm.lines)
    assert any(x["msg"] == "ready" and x["load_ms"] > 0 for x in logs)
    mine = [x for x in logs if x.get("client") == "logtest"]
    requests = [x for x in mine if x["msg"] == "request"]
    assert {x["kind"] for x in requests} == {"generate", "fim"}
    for x in requests:
        for key in ("id", "kind", "prompt_tokens", "cached_tokens", "completion_tokens", "queue_ms", "prefill_ms",
                    "first_token_ms", "total_ms", "finish_reason", "rss_mb", "ts", "level"):
            assert key in x, (key, x)
        assert x["completion_tokens"] == 2 and x["level"] == "info"
    assert any(x.get("code") == "bad_request" for x in mine)

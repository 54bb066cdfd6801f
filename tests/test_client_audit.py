"""An audit of m31r_protocol's client side: many streams on one connection, streams dropped or read slowly,
cancellation at each await point, a daemon that misbehaves (a scripted peer speaking the real framing), close() with
streams open, the blocking client from threads, and the stdlib codec against msgspec for every message kind.

A real daemon (conftest `shared_daemon`) wherever it can show the behaviour; the scripted peer where the daemon would
have to break the protocol, or stop reading, on cue."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import struct
import subprocess
import sys
import time
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgspec
import pytest
import uvloop
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_protocol import WELCOME, FakeDaemon, recv, send

from m31r_protocol import blocking
from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError, DaemonUnavailable
from m31r_protocol.framing import pack, read_frame
from m31r_protocol.limits import MAX_FRAME_BYTES
from m31r_protocol.minipack import packb, unpackb

PROMPT = "fn main() {"
LONG = dict(max_tokens=400, lookahead=0)  # the tiny model's 400 tokens, no drafts: still running on a cancel
_names = itertools.count()
STATUS = dict(model="fake", fingerprint="0" * 16, bundle="/nowhere", device="cpu", dtype="float32", pid=4242,
              uptime_s=1.0, queue=0, active=0, requests=0, cache_slots=1, cache_slots_used=0, cache_mb=0.0,
              cache_budget_mb=0.0, cache_hit_rate=0.0, rss_mb=1.0)
DONE = dict(finish_reason="length", usage=m.Usage(), timings=m.Timings())
RUNNERS = pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
HANG_GUARD_S = 60  # not a timing assertion: only turns a hang (the bug) into a failure instead of a stuck run


def client_name() -> str:
    """A Hello name of this test's own, to find its requests' lines in the shared daemon's log."""
    return f"audit-{time.monotonic_ns()}-{next(_names)}"


async def request_line(proc: Any, client: str, rid: int) -> dict:
    """The daemon's log line for request `rid` of `client` (written once the request ends)."""
    while True:
        for line in list(proc.log_lines):
            x = json.loads(line)
            if x.get("msg") == "request" and x.get("client") == client and x.get("id") == rid:
                return x
        await asyncio.sleep(0.02)


def read_loops() -> list[asyncio.Task]:
    """The client read loops still running in this event loop (a closed client leaves none)."""
    return [t for t in asyncio.all_tasks() if "_read_loop" in t.get_coro().__qualname__ and not t.done()]


# -- a scripted peer --------------------------------------------------------------------------------------------

Runner = Callable[[Coroutine], Any]
Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Peer(FakeDaemon):
    """test_protocol's fake daemon that welcomes (unless `welcome` is False), then runs `script` and hangs up; a test
    can wait for the Hello, and leaving waits for every connection's script to end."""

    def __init__(self, path: Path, script: Script, welcome: bool = True):
        super().__init__(path, self._run)
        self.script, self.welcome = script, welcome
        self.hello = asyncio.Event()
        self.handlers: list[asyncio.Task] = []

    async def _run(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.handlers.append(asyncio.current_task())  # type: ignore[arg-type]
        self.hello.set()
        try:
            if self.welcome:
                await send(writer, WELCOME)
            await self.script(reader, writer)
        except ConnectionError:  # the client went away: what the test looks at is on the client's side
            pass

    async def __aexit__(self, *exc: object) -> None:
        await super().__aexit__(*exc)
        await asyncio.gather(*self.handlers, return_exceptions=True)


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "peer.sock"


async def requests(reader: asyncio.StreamReader, n: int) -> list[msgspec.Struct]:
    return [await recv(reader) for _ in range(n)]


async def test_many_streams_on_one_connection_get_their_own_interleaved_events(sock: Path) -> None:
    """40 requests in flight, their tokens sent in a shuffled interleaving: each stream reads its own, in order."""
    n, per = 40, 25

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ids = [r.id for r in await requests(reader, n)]
        events = [(rid, k) for rid in ids for k in range(per)]
        random.Random(0).shuffle(events)
        events.sort(key=lambda e: e[1])  # (a stream's own tokens stay in order; streams interleave)
        chunks = [rid for rid, _ in events]
        random.Random(1).shuffle(ids)
        for rid in chunks:
            writer.write(pack(msgspec.msgpack.encode(m.Token(id=rid, text=f"{rid}.", token=rid))))
        for rid in ids:
            writer.write(pack(msgspec.msgpack.encode(m.Done(id=rid, **DONE))))
        await writer.drain()
        await reader.read()

    async with Peer(sock, script), await Client.connect(sock) as c:
        streams = [await c.generate(f"p{i}") for i in range(n)]
        texts = await asyncio.gather(*(s.collect() for s in streams))
        for s, (text, done) in zip(streams, texts, strict=True):
            assert (text, s.tokens, done.id) == (f"{s.id}." * per, [s.id] * per, s.id)
        assert not c._streams


@pytest.mark.parametrize("misbehaviour, says", [
    (struct.pack(">I", 100) + b"\x00" * 10, "connection to the daemon lost: 10 bytes read on a total of 100"),
    (struct.pack(">I", MAX_FRAME_BYTES + 1), f"exceeds the {MAX_FRAME_BYTES}-byte limit"),
    (pack(b"\xc1 not msgpack"), "connection to the daemon lost: MessagePack data is malformed"),
    (pack(msgspec.msgpack.encode({"type": "token", "id": "1", "text": "x"})), "lost: Expected `int`"),
    (pack(b"\x91" * 5000 + b"\xc0"), "connection to the daemon lost"),
], ids=["cut-mid-frame", "oversize", "undecodable", "invalid", "deeply-nested"])
async def test_a_broken_frame_ends_every_stream_saying_so(sock: Path, misbehaviour: bytes, says: str) -> None:
    """A frame cut short, over the limit, or not a message ends every request on the connection with
    DaemonUnavailable saying why (never a hang, never a dead read loop nobody hears of); a new request is refused."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        a, _ = await requests(reader, 2)
        await send(writer, m.Token(id=a.id, text="a1", token=1))
        writer.write(misbehaviour)
        await writer.drain()

    async with Peer(sock, script), await Client.connect(sock) as c:
        sa, sb = await c.generate("a"), await c.generate("b")
        assert (await sa.__anext__()).text == "a1"
        for s in (sa, sb):
            with pytest.raises(DaemonUnavailable, match=says):
                await asyncio.wait_for(s.__anext__(), HANG_GUARD_S)
        await asyncio.wait_for(c.closed.wait(), HANG_GUARD_S)
        with pytest.raises(DaemonUnavailable, match="closed"):
            await c.generate("c")
        assert not read_loops()


async def test_a_done_for_an_unknown_id_and_a_duplicate_done_are_dropped(sock: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        a, b = await requests(reader, 2)
        for msg in [m.Done(id=999, **DONE), m.Token(id=b.id, text="b1", token=1), m.Done(id=a.id, **DONE),
                    m.Done(id=a.id, **DONE), m.Error(id=a.id, code="internal", message="late"),
                    m.Token(id=a.id, text="late"), m.Token(id=b.id, text="b2", token=2), m.Done(id=b.id, **DONE)]:
            await send(writer, msg)
        while (msg := await recv(reader)) is not None:
            if isinstance(msg, m.Status):
                await send(writer, m.StatusReply(id=msg.id, **STATUS))

    async with Peer(sock, script), await Client.connect(sock) as c:
        sa, sb = await c.generate("a"), await c.generate("b")
        assert await asyncio.wait_for(sa.collect(), HANG_GUARD_S) == ("", m.Done(id=sa.id, **DONE))
        assert (await asyncio.wait_for(sb.collect(), HANG_GUARD_S))[0] == "b1b2"
        assert (await c.status()).pid == 4242  # the connection is still good
        with pytest.raises(StopAsyncIteration):  # and an ended stream stays ended
            await sa.__anext__()


@pytest.mark.parametrize("answer", [m.Token(id=1, text="x", token=1), m.Done(id=1, **DONE), m.ShutdownReply(id=1)],
                         ids=["token", "done", "shutdown-reply"])
async def test_a_wrong_reply_to_status_is_a_daemon_error(sock: Path, answer: msgspec.Struct) -> None:
    """Status answered with another kind of message: DaemonError("internal") naming it, not an AssertionError (nor,
    under `python -O`, the wrong message handed on)."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert isinstance(await recv(reader), m.Status)
        await send(writer, answer)
        await reader.read()

    async with Peer(sock, script), await Client.connect(sock) as c:
        with pytest.raises(DaemonError, match=f"request 1 with {type(answer).__name__}, not StatusReply") as e:
            await c.status()
        assert e.value.code == "internal" and not c._streams


async def test_a_connection_error_from_the_daemon_ends_the_streams_with_its_code(sock: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await requests(reader, 1)
        await send(writer, m.Error(id=None, code="shutting_down", message="the daemon is stopping"))

    async with Peer(sock, script), await Client.connect(sock) as c:
        s = await c.generate("a")
        with pytest.raises(DaemonError) as e:
            await asyncio.wait_for(s.__anext__(), HANG_GUARD_S)
        assert e.value.code == "shutting_down"


async def stuck_in_drain(c: Client, prompt_bytes: int = 4_000_000) -> asyncio.Task:
    """A request being sent to a peer that reads nothing: its task waits in drain() with most of it unsent."""
    task = asyncio.create_task(c.generate("y" * prompt_bytes))
    while c._writer.transport.get_write_buffer_size() == 0:
        await asyncio.sleep(0)
    assert not task.done()
    return task


@RUNNERS
def test_close_with_streams_open_and_a_daemon_reading_nothing_ends_them_all(sock: Path, run: Runner) -> None:
    """close() while a request waits to be sent to a daemon that reads nothing (stopped): each stream, and the send,
    end with "closed", and close() returns (a graceful close waited for the unsent bytes forever)."""
    run(close_scenario(sock))


async def close_scenario(sock: Path) -> None:
    release = asyncio.Event()

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        with contextlib.suppress(asyncio.IncompleteReadError):
            while await read_frame(reader) is not None:
                pass

    async with Peer(sock, script):
        c = await Client.connect(sock)
        open_streams = [await c.generate("a"), await c.fim("b", "c")]
        sending = await stuck_in_drain(c)
        try:
            await asyncio.wait_for(c.close(), HANG_GUARD_S)
        finally:
            release.set()
        for s in open_streams:
            with pytest.raises(DaemonUnavailable, match=r"client was closed \(Client.close\)"):
                await asyncio.wait_for(s.__anext__(), HANG_GUARD_S)
        with pytest.raises(DaemonUnavailable, match=r"client was closed \(Client.close\)"):
            await asyncio.wait_for(sending, HANG_GUARD_S)
        assert not read_loops()
        await c.close()  # twice is fine


@RUNNERS
def test_a_request_cancelled_while_being_sent_is_cancelled_on_the_daemon(sock: Path, run: Runner) -> None:
    """A task cancelled in the middle of sending its request (drain() waiting on a slow daemon): the request's bytes
    are already on their way, so the daemon must be told to cancel it; one cancelled before its turn to write (waiting
    for the lock) was never sent, and nothing is sent for it."""
    run(cancel_in_send_scenario(sock))


async def cancel_in_send_scenario(sock: Path) -> None:
    release = asyncio.Event()
    got: list[msgspec.Struct] = []

    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await release.wait()
        while (msg := await recv(reader)) is not None:
            got.append(msg)
            if isinstance(msg, m.Status):
                await send(writer, m.StatusReply(id=msg.id, **STATUS))

    async with Peer(sock, script), await Client.connect(sock) as c:
        sending = await stuck_in_drain(c)
        waiting = asyncio.create_task(c.generate("never sent"))
        await asyncio.sleep(0)
        waiting.cancel()  # (before the lock, which the other's cancel frees, is handed to it)
        sending.cancel()
        for task in (sending, waiting):
            with pytest.raises(asyncio.CancelledError):
                await task
        release.set()
        await c.status()
        assert [type(msg) for msg in got] == [m.Generate, m.Cancel, m.Status], got
        assert got[1].id == got[0].id
        assert not c._streams


async def test_a_connect_cancelled_during_the_handshake_leaves_nothing(sock: Path) -> None:
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert await reader.read() == b""  # the client hung up: end of stream, nothing more sent

    async with (peer := Peer(sock, script, welcome=False)):
        task = asyncio.create_task(Client.connect(sock))
        await peer.hello.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert all(t.done() and t.exception() is None for t in peer.handlers)
    assert not read_loops()


# -- against the real daemon -----------------------------------------------------------------------------------


async def test_concurrent_streams_on_one_connection_match_sequential_answers(shared_daemon) -> None:
    _, sock = shared_daemon
    prompts = [f"fn f{i}() {{" for i in range(6)]
    async with await Client.connect(sock) as c:
        alone = [(await (await c.generate(p, max_tokens=24, lookahead=0)).collect())[0] for p in prompts]
        streams = [await c.generate(p, max_tokens=24, lookahead=0) for p in prompts]
        together = await asyncio.gather(*(s.collect() for s in streams))
        assert [t for t, _ in together] == alone
        assert not c._streams


async def test_dropped_streams_are_collected_and_cancelled_without_blocking_others(shared_daemon) -> None:
    """Streams nobody reads nor holds are freed, and their requests cancelled in the daemon, while a stream beside
    them is served whole."""
    proc, sock = shared_daemon
    name = client_name()
    async with await Client.connect(sock, client=name) as c:
        beside = await c.generate(PROMPT, max_tokens=60, lookahead=0)
        dropped = [await c.generate(PROMPT, **LONG) for _ in range(4)]
        ids, refs = [s.id for s in dropped], [weakref.ref(s) for s in dropped]
        await dropped[0].__anext__()  # one with a token read, the others unread
        del dropped  # freed at once (no reference cycle to wait for a gc.collect() with): the tiny model's 400
        assert all(r() is None for r in refs)  # tokens take ~0.1 s, and the cancels must reach the daemon before
        for rid in ids:
            assert (line := await request_line(proc, name, rid)).get("code") == "cancelled", (rid, line)
        assert (await beside.collect())[1].usage.completion_tokens == 60
        assert not c._streams


async def test_a_slow_reader_does_not_hold_up_other_streams_and_its_queue_is_bounded(shared_daemon) -> None:
    """The connection is never paused for one slow stream (that would stall the others): the slow stream's events
    queue up in the client, bounded by its own max_tokens."""
    _, sock = shared_daemon
    async with await Client.connect(sock) as c:
        slow = await c.generate(PROMPT, max_tokens=300, lookahead=0)
        fast = await c.generate("struct S {", max_tokens=20, lookahead=0)
        assert (await fast.collect())[1].usage.completion_tokens == 20
        while slow.open:  # its Done has not arrived yet
            await asyncio.sleep(0.01)
        assert slow.queue.qsize() <= 300 + 2  # its tokens, held-back text released at the end, its Done
        n = 0
        async for _ in slow:
            n += 1
            await asyncio.sleep(0)
        u = slow.done.usage if slow.done is not None else None
        assert u is not None and (u.completion_tokens, u.healed_tokens) == (300, 1) and len(slow.tokens) == 300


async def test_cancelling_the_task_awaiting_the_first_token_cancels_the_request(shared_daemon) -> None:
    proc, sock = shared_daemon
    name = client_name()
    async with await Client.connect(sock, client=name) as c:
        s = await c.generate(PROMPT, **LONG)
        first = asyncio.create_task(s.__anext__())
        await asyncio.sleep(0)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        assert (line := await request_line(proc, name, s.id)).get("code") == "cancelled", line
        with pytest.raises(DaemonError, match="cancelled"):
            await s.__anext__()
    assert not read_loops()


def test_the_blocking_client_from_many_threads(shared_daemon) -> None:
    proc, sock = shared_daemon
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: blocking.welcome_and_status(sock, timeout=30), range(24)))
    assert all(w["type"] == "welcome" and s["type"] == "status_reply" and s["pid"] == proc.pid for w, s in replies)


@pytest.mark.parametrize("reply", [b"\x91" * 5000 + b"\xc0", b"\xdd\xff\xff\xff\xff", b"\xc7\x01\x01x"],
                         ids=["deeply-nested", "huge-array", "ext"])
async def test_the_blocking_client_refuses_a_malformed_reply_with_a_value_error(sock: Path, reply: bytes) -> None:
    """`m31r status` falls back to the full client on OSError or ValueError: anything else was a traceback."""
    async def script(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await recv(reader)
        writer.write(pack(reply))
        await writer.drain()
        await reader.read()

    async with Peer(sock, script):
        with pytest.raises(ValueError):
            await asyncio.to_thread(blocking.status, sock, 30)


def test_importing_the_clients_imports_no_torch() -> None:
    code = ("import sys, m31r_protocol.client, m31r_protocol.reconnect, m31r_protocol.blocking; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- minipack against msgspec ----------------------------------------------------------------------------------

I = msgspec.inspect  # noqa: E741


def strategy(t: msgspec.inspect.Type) -> st.SearchStrategy:
    """Values of the protocol's field type `t`, from msgspec's own view of the Structs (so a new field is covered)."""
    if isinstance(t, I.BoolType):
        return st.booleans()
    if isinstance(t, I.IntType):
        return st.integers(-(2**63), 2**64 - 1)
    if isinstance(t, I.FloatType):
        return st.floats(allow_nan=False)
    if isinstance(t, I.StrType):
        return st.text(max_size=40)
    if isinstance(t, I.NoneType):
        return st.none()
    if isinstance(t, I.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, I.ListType):
        return st.lists(strategy(t.item_type), max_size=4)
    if isinstance(t, I.UnionType):
        return st.one_of(*(strategy(u) for u in t.types))
    if isinstance(t, I.StructType):
        return st.builds(t.cls, **{f.name: strategy(f.type) for f in t.fields})
    raise AssertionError(f"no strategy for {t}")


KINDS = [*m.ClientMessage.__args__, *m.ServerMessage.__args__]  # type: ignore[attr-defined]
FAST = settings(max_examples=40, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_minipack_decodes_every_message_as_msgspec_does(kind: type) -> None:
    decoder = msgspec.msgpack.Decoder(m.ClientMessage if kind in m.ClientMessage.__args__ else m.ServerMessage)

    @FAST
    @given(strategy(I.type_info(kind)))
    def check(msg: msgspec.Struct) -> None:
        data = m.encoder().encode(msg)
        assert unpackb(data) == msgspec.msgpack.decode(data)
        assert decoder.decode(packb(unpackb(data))) == msg  # and what it writes back is the same message

    check()


def canonical(value: object) -> bytes:
    return msgspec.msgpack.encode(value)  # (compares NaN as equal to itself)


def holds_extension(value: object) -> bool:
    """Whether msgspec read an extension type (Ext, or the timestamp's datetime) somewhere in `value`."""
    if isinstance(value, list):
        return any(map(holds_extension, value))
    if isinstance(value, dict):
        return any(map(holds_extension, [*value, *value.values()]))
    return not isinstance(value, None | bool | int | float | str | bytes)


@FAST
@given(st.one_of(st.binary(max_size=40), st.builds(lambda b, i, x: b[:i] + x + b[i:],
                                                   st.sampled_from([m.encoder().encode(WELCOME), packb(STATUS)]),
                                                   st.integers(0, 300), st.binary(max_size=6))))
def test_minipack_reads_what_msgspec_reads_and_refuses_the_rest_with_a_value_error(data: bytes) -> None:
    """Any bytes: minipack's value is msgspec's, or minipack raises ValueError (UnicodeDecodeError is one), the
    exception `m31r status` falls back on; it refuses more than msgspec only for extension types, which no message
    holds."""
    try:
        theirs: object = msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # (msgspec raises the latter for invalid UTF-8)
        theirs = e
    try:
        ours = unpackb(data)
    except ValueError:
        assert isinstance(theirs, ValueError) or holds_extension(theirs), theirs
        return
    assert canonical(ours) == canonical(theirs)


def test_minipack_refuses_deep_nesting_with_a_value_error() -> None:
    """msgspec and a naive recursive decoder both raise RecursionError here, which no caller expects."""
    with pytest.raises(ValueError, match="nested"):
        unpackb(b"\x91" * 5000 + b"\xc0")
    assert unpackb(b"\x91" * 60 + b"\xc0") == msgspec.msgpack.decode(b"\x91" * 60 + b"\xc0")

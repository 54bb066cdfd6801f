"""The socket protocol without a model: framing, message round trips, the checked-in schema, the client's
handshake against fake daemons, and that clients never import torch."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from m31r_protocol import messages as m
from m31r_protocol.client import Client, DaemonError, DaemonUnavailable, ForeignDaemon, connect_or_start
from m31r_protocol.framing import HEADER, FrameNotBegun, FrameTooLarge, pack, read_frame

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}


def feed(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


# -- framing ------------------------------------------------------------------------------------------------


def test_pack_is_big_endian_length_then_body() -> None:
    assert pack(b"abc") == b"\x00\x00\x00\x03abc"
    assert pack(b"") == b"\x00\x00\x00\x00"
    assert HEADER.size == 4


async def test_read_frames_back_to_back_then_clean_eof() -> None:
    bodies = [b"one", b"", b"x" * 70_000, b"last"]
    reader = feed(b"".join(pack(b) for b in bodies))
    assert [await read_frame(reader) for _ in bodies] == bodies
    assert await read_frame(reader) is None  # EOF between frames is a clean end
    assert await read_frame(reader) is None


@pytest.mark.parametrize("data", [b"\x00\x00", pack(b"abcdef")[:7], HEADER.pack(10)], ids=["header", "body", "nobody"])
async def test_truncated_frame_raises(data: bytes) -> None:
    with pytest.raises(asyncio.IncompleteReadError):
        await read_frame(feed(data))


async def test_oversize_frame_refused_before_its_body_is_read() -> None:
    # No body and no EOF follow the header: a reader that waited for the body would hang here.
    reader = feed(HEADER.pack(m.MAX_FRAME_BYTES + 1), eof=False)
    with pytest.raises(FrameTooLarge) as e:
        await asyncio.wait_for(read_frame(reader), 2)
    assert (e.value.size, e.value.limit) == (m.MAX_FRAME_BYTES + 1, m.MAX_FRAME_BYTES)
    assert str(m.MAX_FRAME_BYTES) in str(e.value)


async def test_frame_limit_is_inclusive() -> None:
    assert await read_frame(feed(pack(b"y" * 16)), limit=16) == b"y" * 16
    with pytest.raises(FrameTooLarge):
        await read_frame(feed(pack(b"y" * 17)), limit=16)



async def test_a_frame_must_begin_within_begin_within_and_reserve_holds_its_body() -> None:
    """The daemon's Hello deadline and its bound on bytes being read, as read_frame's hooks."""
    with pytest.raises(FrameNotBegun) as e:
        await read_frame(feed(b"", eof=False), begin_within=0.05)
    assert e.value.timeout == 0.05
    held: list[tuple[str, int]] = []

    @contextlib.contextmanager
    def reserve(size: int):
        held.append(("in", size))
        yield
        held.append(("out", size))

    assert await read_frame(feed(pack(b"abc")), begin_within=1, reserve=reserve) == b"abc"
    assert held == [("in", 3), ("out", 3)]

    def refuse(size: int):
        raise OverflowError(size)

    with pytest.raises(OverflowError):  # refused before the body is read: none follows here, and none is awaited
        await asyncio.wait_for(read_frame(feed(HEADER.pack(5), eof=False), reserve=refuse), 2)

# -- messages -----------------------------------------------------------------------------------------------

CLIENT_MESSAGES = [
    m.Hello(protocol=m.PROTOCOL_VERSION),
    m.Hello(protocol=7, client="nvim"),
    m.Generate(id=1, prompt="fn main"),
    m.Generate(id=2, prompt="é🦀\n", max_tokens=0, sampling=m.Sampling(temperature=0.7, top_k=5, top_p=0.9,
                                                                          repetition_penalty=1.1),
               stop=["\n\n", "}"], seed=-3, truncate=True),
    m.Fim(id=3, prefix="fn f() {\n    "),
    m.Fim(id=2**63, prefix="a", suffix="b", document="file:///x.rs", max_tokens=9, sampling=m.Sampling(top_k=1),
          stop=[";"], seed=5, deadline_ms=0),
    m.Cancel(id=3),
    m.Status(id=4),
    m.Shutdown(id=5),
]
SERVER_MESSAGES = [
    m.Welcome(protocol=1, model="m", fingerprint="f" * 16, max_context=512, capabilities=list(m.CAPABILITIES),
              daemon_version="0.1.0"),
    m.Token(id=1, text="x", token=88),
    m.Token(id=1, text="held back"),
    m.Done(id=1, finish_reason="length", usage=m.Usage(3, 1, 2), timings=m.Timings(0.1, 0.2, None, 0.5)),
    m.Done(id=2, finish_reason="deadline", usage=m.Usage(), timings=m.Timings(first_token_ms=1.5),
           source="typed_through"),
    *[m.Error(id=i, code=code, message=code) for i, code in enumerate(m.ERROR_CODES)],
    m.Error(id=None, code="frame_too_large", message="too big"),
    m.Error(id=6, code="busy", message="full", busy=m.BusyDetail("loading", 32)),
    m.Error(id=7, code="context_overflow", message="too long", overflow=m.OverflowDetail(600, 16, 512)),
    m.StatusReply(id=9, model="m", fingerprint="f", bundle="/b", device="cpu", dtype="float32", pid=1, uptime_s=1.0,
                  queue=0, active=0, requests=3, cache_slots=4, cache_slots_used=1, cache_mb=1.0,
                  cache_budget_mb=512.0, cache_hit_rate=0.5, rss_mb=100.0),
    m.ShutdownReply(id=10),
]


@pytest.mark.parametrize("msg", CLIENT_MESSAGES, ids=lambda x: type(x).__name__)
def test_client_message_round_trip(msg: msgspec.Struct) -> None:
    body = m.encoder().encode(msg)
    assert m.client_decoder().decode(body) == msg
    assert msgspec.msgpack.decode(body)["type"] == type(msg).__struct_config__.tag


@pytest.mark.parametrize("msg", SERVER_MESSAGES, ids=lambda x: type(x).__name__)
def test_server_message_round_trip(msg: msgspec.Struct) -> None:
    body = m.encoder().encode(msg)
    assert m.server_decoder().decode(body) == msg


def test_every_message_kind_is_covered() -> None:
    kinds = {type(x) for x in CLIENT_MESSAGES + SERVER_MESSAGES}
    assert kinds == set(m.ClientMessage.__args__) | set(m.ServerMessage.__args__)  # type: ignore[attr-defined]


def test_error_codes_are_a_closed_documented_set() -> None:
    assert set(m.ERROR_CODES) == {"bad_request", "forbidden", "unsupported_version", "frame_too_large", "busy",
                                  "context_overflow", "cancelled", "shutting_down", "internal"}
    with pytest.raises(msgspec.ValidationError):
        m.server_decoder().decode(msgspec.msgpack.encode({"type": "error", "id": 1, "code": "oops", "message": ""}))


def test_an_errors_detail_is_optional_both_ways() -> None:
    """A daemon from before the Error's detail sends none (its frames decode with None), and a client from before it
    ignores it: the server messages do not forbid unknown fields, as the client messages do."""
    old = msgspec.msgpack.encode({"type": "error", "id": 1, "code": "busy", "message": "full"})
    assert m.server_decoder().decode(old) == m.Error(id=1, code="busy", message="full", busy=None, overflow=None)
    assert m.encoder().encode(m.Error(id=1, code="busy", message="full")) == old  # no detail: the same bytes

    class OldError(msgspec.Struct, tag="error"):  # Error as a client from before the detail has it
        id: int | None
        code: str
        message: str

    new = m.encoder().encode(m.Error(id=2, code="context_overflow", message="long",
                                     overflow=m.OverflowDetail(600, 16, 512)))
    assert msgspec.msgpack.decode(new, type=OldError) == OldError(2, "context_overflow", "long")


@pytest.mark.parametrize("raw", [
    {"type": "generate", "id": 1, "prompt": "x", "bogus": 1},  # unknown field
    {"type": "generate", "id": 1, "prompt": "x", "max_tokens": "ten"},  # wrong type
    {"type": "generate", "prompt": "x"},  # missing id
    {"type": "fim", "id": 1, "prefix": "x", "sampling": {"temp": 1}},
    {"type": "welcome", "protocol": 1},  # a daemon message sent by a client
    {"type": "nope", "id": 1},
    [1, 2, 3],
])
def test_client_decoder_rejects_invalid_messages(raw: object) -> None:
    with pytest.raises(msgspec.ValidationError):
        m.client_decoder().decode(msgspec.msgpack.encode(raw))


def test_schema_json_is_up_to_date() -> None:
    r = subprocess.run([sys.executable, "-m", "m31r_protocol.schema", "--check"], capture_output=True, text=True,
                       env=ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    schema = json.loads((REPO / "protocol" / "schema.json").read_text())
    assert schema["protocol_version"] == m.PROTOCOL_VERSION and schema["max_frame_bytes"] == m.MAX_FRAME_BYTES
    assert set(m.ERROR_CODES) <= set(json.dumps(schema["$defs"]["Error"]).replace('"', " ").split())


# -- fake daemons -------------------------------------------------------------------------------------------

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
WELCOME = m.Welcome(protocol=m.PROTOCOL_VERSION, model="fake", fingerprint="0" * 16, max_context=512,
                    capabilities=list(m.CAPABILITIES), daemon_version="0")
STATUS = dict(model="fake", fingerprint="0" * 16, bundle="/nowhere", device="cpu", dtype="float32", pid=4242,
              uptime_s=1.0, queue=0, active=0, requests=0, cache_slots=1, cache_slots_used=0, cache_mb=0.0,
              cache_budget_mb=0.0, cache_hit_rate=0.0, rss_mb=1.0, quant="int8", threads=2, warming=True)


async def send(writer: asyncio.StreamWriter, msg: object) -> None:
    writer.write(pack(msgspec.msgpack.encode(msg)))
    await writer.drain()


async def recv(reader: asyncio.StreamReader) -> msgspec.Struct | None:
    body = await read_frame(reader)
    return None if body is None else m.client_decoder().decode(body)


class FakeDaemon:
    def __init__(self, path: Path, handler: Handler):
        self.path, self.handler = path, handler
        self.hellos: list[m.Hello] = []

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            hello = await recv(reader)
            assert isinstance(hello, m.Hello)
            self.hellos.append(hello)
            await self.handler(reader, writer)
        finally:
            writer.close()

    async def __aenter__(self) -> FakeDaemon:
        self.server = await asyncio.start_unix_server(self._serve, path=str(self.path))
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


async def welcome_then_status(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await send(writer, WELCOME)
    while (msg := await recv(reader)) is not None:
        if isinstance(msg, m.Status):
            await send(writer, m.StatusReply(id=msg.id, **STATUS))


@pytest.fixture
def sock(tmp_path: Path) -> Path:
    return tmp_path / "fake.sock"


@pytest.mark.parametrize("reply", [
    m.Welcome(protocol=m.PROTOCOL_VERSION + 1, model="fake", fingerprint="0", max_context=1, capabilities=[],
              daemon_version="9"),
    {"type": "welcome", "protocol": m.PROTOCOL_VERSION + 1, "shape": "a future welcome we cannot decode"},
    m.Error(id=None, code="unsupported_version", message="client speaks 1, this daemon speaks 2"),
], ids=["welcome", "undecodable-welcome", "error"])
async def test_client_refuses_a_daemon_of_another_protocol_version(sock: Path, reply: object) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send(writer, reply)

    async with FakeDaemon(sock, handler) as fake:
        with pytest.raises(DaemonError) as e:
            await Client.connect(sock, client="pytest")
    assert e.value.code == "unsupported_version"
    assert fake.hellos == [m.Hello(protocol=m.PROTOCOL_VERSION, client="pytest")]


@pytest.mark.parametrize("body", [b"\xc1 not msgpack", b"\xa2\xed\xa0", msgspec.msgpack.encode({"type": "token"})])
async def test_client_reports_a_garbled_handshake_reply(sock: Path, body: bytes) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(pack(body))
        await writer.drain()

    async with FakeDaemon(sock, handler):
        with pytest.raises(DaemonError) as e:
            await Client.connect(sock)
    assert e.value.code == "bad_request"


async def test_client_without_a_daemon(sock: Path) -> None:
    with pytest.raises(DaemonUnavailable):
        await Client.connect(sock)

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        pass

    async with FakeDaemon(sock, hang_up):
        with pytest.raises(DaemonUnavailable):
            await Client.connect(sock)


async def test_client_routes_interleaved_events_and_reports_a_lost_connection(sock: Path) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send(writer, WELCOME)
        a, b, c = await recv(reader), await recv(reader), await recv(reader)
        assert isinstance(a, m.Generate) and isinstance(b, m.Fim) and isinstance(c, m.Generate)
        done = dict(finish_reason="length", usage=m.Usage(), timings=m.Timings())
        for msg in [m.Token(id=b.id, text="b1", token=1), m.Token(id=a.id, text="a1", token=2),
                    m.Token(id=b.id, text="b2", token=3), m.Done(id=b.id, **done), m.Token(id=a.id, text="a2"),
                    m.Error(id=a.id, code="cancelled", message="stop"), m.Token(id=c.id, text="c1", token=4)]:
            await send(writer, msg)
        # then the connection drops with c in flight

    async with FakeDaemon(sock, handler), await Client.connect(sock) as client:
        sa = await client.generate("a")
        sb = await client.fim("b", "s", document="d")
        sc = await client.generate("c")
        text, done = await asyncio.wait_for(sb.collect(), 5)
        assert (text, sb.tokens, done.finish_reason) == ("b1b2", [1, 3], "length")
        got = []
        with pytest.raises(DaemonError) as e:
            async for t in sa:
                got.append(t.text)
        assert (got, sa.tokens, e.value.code) == (["a1", "a2"], [2], "cancelled")
        assert (await sc.__anext__()).text == "c1"
        with pytest.raises(DaemonUnavailable):
            await asyncio.wait_for(sc.__anext__(), 5)


# What each daemon generation listed: today's, then yesterday's (context and logprobs taken but not yet named), then
# one from before the confidence floor, then one from before beam search.
TODAY = list(m.CAPABILITIES)
NAMELESS = [c for c in TODAY if c not in ("context", "logprobs")]
NO_FLOOR = [c for c in NAMELESS if c != "min_probability"]
NO_BEAMS = [c for c in NO_FLOOR if c != "beams"]


def answer_each(received: list[msgspec.Struct], caps: list[str]) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send(writer, msgspec.structs.replace(WELCOME, capabilities=caps))
        while (msg := await recv(reader)) is not None:
            received.append(msg)
            await send(writer, m.Done(id=msg.id, finish_reason="stop", usage=m.Usage(), timings=m.Timings()))
    return handler


@pytest.mark.parametrize("caps", [TODAY, NAMELESS, NO_FLOOR, NO_BEAMS],
                         ids=["today", "nameless", "no-floor", "no-beams"])
async def test_optional_fields_go_only_to_a_daemon_that_takes_them(sock: Path, caps: list[str]) -> None:
    """A daemon started from an older install refuses fields it does not know. The client leaves out the hints
    (beams, context, the confidence floor: the answer is only less good or ends later) and refuses logprobs, which
    the caller asked to see, itself, saying how to restart the daemon; it sends nothing then."""
    snippet = m.Snippet(path="src/a.rs", text="fn a() {}")
    received: list[msgspec.Struct] = []
    async with FakeDaemon(sock, answer_each(received, caps)), await Client.connect(sock) as client:
        hinted = await client.fim("a", "b", beams=2, context=[snippet], min_probability=0.05)
        await asyncio.wait_for(hinted.collect(), 5)
        await asyncio.wait_for((await client.generate("a", beams=2)).collect(), 5)
        if caps in (TODAY, NAMELESS):
            await asyncio.wait_for((await client.fim("a", logprobs=3)).collect(), 5)
            await asyncio.wait_for((await client.generate("a", logprobs=3)).collect(), 5)
        else:
            for ask in (client.fim("a", logprobs=3), client.generate("a", logprobs=3)):
                with pytest.raises(DaemonError) as e:
                    await ask
                assert e.value.code == "bad_request" and "lacks logprobs" in e.value.message
                assert "`m31r stop`" in e.value.message
        missing = client.missing
    fim, gen = received[:2]
    assert isinstance(fim, m.Fim) and isinstance(gen, m.Generate)
    floor = caps in (TODAY, NAMELESS)
    assert (fim.min_probability, fim.context) == ((0.05, [snippet]) if floor else (None, []))
    assert fim.beams == gen.beams == (None if caps is NO_BEAMS else 2)
    assert [getattr(r, "logprobs", None) for r in received[2:]] == ([3, 3] if floor else [])
    assert missing == [c for c in TODAY if c not in caps and (not floor or c not in ("context", "logprobs"))]


async def test_an_outdated_daemon_is_named_with_the_way_out(sock: Path, tmp_path: Path) -> None:
    """`m31r doctor` warns, `m31r fim` notes it on stderr (and still answers), the language server tells the user
    once however often it reconnects."""
    from m31r import doctor
    from m31r_lsp.daemon_link import EditorLink
    from m31r_protocol.capabilities import restart_hint
    from m31r_protocol.reconnect import link_config

    received: list[msgspec.Struct] = []

    async def old_daemon(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await send(writer, msgspec.structs.replace(WELCOME, capabilities=NO_FLOOR))
        while (msg := await recv(reader)) is not None:
            received.append(msg)
            if isinstance(msg, m.Status):
                await send(writer, m.StatusReply(id=msg.id, **STATUS))
            else:
                await send(writer, m.Token(id=msg.id, text="x", token=1))
                await send(writer, m.Done(id=msg.id, finish_reason="stop", usage=m.Usage(), timings=m.Timings()))

    async with FakeDaemon(sock, old_daemon):
        ctx = doctor.Context(sock, "--socket", tmp_path, "--bundle")
        check = await asyncio.to_thread(doctor.check_daemon, ctx)
        assert check.level == "warn" and "lacks min_probability, context, logprobs" in check.detail, check
        assert "pid 4242 serves fake" in check.detail

        p = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "m31r.cli", "fim", "--prefix", "fn a", "--socket", str(sock), "--no-autostart",
            env=ENV, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
        assert (p.returncode, out.decode().strip()) == (0, "x"), err.decode()
        assert "note: the running daemon is older than this m31r (it lacks min_probability" in err.decode()

        told: list[str] = []
        link = EditorLink(link_config(sock, autostart=False), tell=told.append)
        try:
            for _ in range(2):
                client = await link.get(5)
                link.lost(client)
            await link.get(5)
        finally:
            await link.close()
        assert link.connects == 3 and len(told) == 3  # the rest: each lost connection, once
        hint = restart_hint(["min_probability", "context", "logprobs"])
        assert [t for t in told if "older" in t] == [f"m31r: {hint}."]
        assert "(it lacks min_probability, context, logprobs): `m31r stop` ends it" in told[0]


async def test_text_that_is_not_unicode_is_refused_by_the_client(sock: Path) -> None:
    """A lone surrogate (a Python str may hold one: bytes that were not UTF-8, read with surrogateescape, or JSON's
    \\ud800) cannot go into MessagePack: a clear bad_request, nothing sent, and the connection serves on."""
    received: list[msgspec.Struct] = []
    async with FakeDaemon(sock, answer_each(received, TODAY)), await Client.connect(sock) as client:
        with pytest.raises(DaemonError) as e:
            await client.fim("fn a\udcff", "")
        assert e.value.code == "bad_request" and "lone surrogate at character 4" in e.value.message
        await asyncio.wait_for((await client.fim("fn a", "")).collect(), 5)
    assert [r.prefix for r in received] == ["fn a"]


async def test_a_send_to_a_daemon_gone_since_the_last_read_is_daemon_unavailable() -> None:
    """The daemon's end closed before the client's reader noticed: the write fails (EPIPE), and the caller hears
    DaemonUnavailable, as for a read, so a front end reconnects instead of logging a traceback."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    client = Client(reader, writer, WELCOME)
    theirs.close()
    with pytest.raises(DaemonUnavailable):
        await client.fim("fn a", "")  # no await before the write: the reader has not run yet
    await client.close()


async def test_m31r_status_never_imports_torch(sock: Path) -> None:
    check = "import sys, m31r_protocol, m31r.cli; sys.exit('torch' in sys.modules)"
    r = await asyncio.create_subprocess_exec(sys.executable, "-c", check, env=ENV)
    assert await r.wait() == 0, "importing m31r_protocol / m31r.cli imported torch"
    async with FakeDaemon(sock, welcome_then_status):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-X", "importtime", "-m", "m31r.cli", "status", "--socket", str(sock), env=ENV,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode == 0, err.decode()[-2000:]
    assert json.loads(out) == STATUS
    imported = {line.split("|")[-1].strip() for line in err.decode().splitlines() if line.startswith("import time:")}
    assert "m31r_protocol.client" in imported
    assert not {name for name in imported if name.split(".")[0] in {"torch", "numpy", "m31rd"}}


async def test_m31r_status_fast_path_skips_click_and_asyncio(sock: Path) -> None:
    """The `m31r` entry point answers a plain status over a blocking socket: same JSON, no click, no asyncio, no
    msgspec (each costs the one-shot process milliseconds)."""
    async with FakeDaemon(sock, welcome_then_status):
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-X", "importtime", "-m", "m31r.entry", "status", "--socket", str(sock), env=ENV,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode == 0, err.decode()[-2000:]
    assert json.loads(out) == STATUS
    imported = {line.split("|")[-1].strip() for line in err.decode().splitlines() if line.startswith("import time:")}
    assert "m31r_protocol.blocking" in imported
    heavy = {"click", "asyncio", "torch", "msgspec", "tempfile"}
    assert not {n for n in imported if n.split(".")[0] in heavy or n == "m31r_protocol.client"}
    # No daemon: the fast path gives way to the full CLI, which names the problem.
    r = await asyncio.create_subprocess_exec(sys.executable, "-m", "m31r.entry", "status", "--socket",
                                             str(sock.parent / "nobody.sock"), env=ENV, stderr=asyncio.subprocess.PIPE)
    _, err = await r.communicate()
    assert r.returncode != 0 and "no daemon answers" in err.decode()
    assert "no socket there (no daemon is running)" in err.decode() and "Error" not in err.decode()


async def test_a_stale_socket_file_is_named_as_such(tmp_path: Path) -> None:
    """A socket file nobody listens on (a daemon that was killed) is told apart from a missing one, in words."""
    folder = tmp_path / "s"
    folder.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(folder / "m31rd.sock"))
    stale.close()
    with pytest.raises(DaemonUnavailable, match=r"nothing listens on it \(a daemon that ended left its socket file\)"):
        await Client.connect(folder / "m31rd.sock")


class Squatter:
    """A process of another user (nobody) serving a socket: it answers every connection with a Welcome and
    counts the bytes clients send it. What someone who made /tmp/m31r-<uid>/ first could run."""

    def __init__(self, folder: Path, name: str = "m31rd.sock"):
        self.folder, self.path = folder, folder / name
        self.received: int | None = None

    def _child(self, ready: int, stop: int, result: int) -> None:
        os.chdir(self.folder)  # a relative path: nobody cannot search the test's private parent folders
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        srv.bind(self.path.name)
        srv.listen()
        os.write(ready, b"1")
        conns: list[socket.socket] = []
        received = 0
        while True:
            readable, _, _ = select.select([srv, stop, *conns], [], [])
            if stop in readable:
                break
            if srv in readable:
                conn, _ = srv.accept()
                with contextlib.suppress(OSError):  # a client that hung up at once
                    conn.sendall(pack(msgspec.msgpack.encode(WELCOME)))
                conns.append(conn)
            for conn in [c for c in conns if c in readable]:
                data = b""
                with contextlib.suppress(OSError):
                    data = conn.recv(65536)
                received += len(data)
                if not data:
                    conns.remove(conn)
                    conn.close()
        os.write(result, str(received).encode())

    def __enter__(self) -> Squatter:
        self.folder.mkdir(mode=0o700)
        os.chown(self.folder, 65534, 65534)
        (ready_r, ready_w), (self.stop_r, self.stop_w), (self.res_r, res_w) = os.pipe(), os.pipe(), os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                for fd in (ready_r, self.stop_w, self.res_r):  # the parent's ends: EOF on `stop` must reach us
                    os.close(fd)
                self._child(ready_w, self.stop_r, res_w)
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                os.write(res_w, repr(e).encode())
                code = 1
            finally:
                os._exit(code)
        for fd in (ready_w, self.stop_r, res_w):
            os.close(fd)
        assert os.read(ready_r, 1) == b"1", os.read(self.res_r, 4096)
        os.close(ready_r)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.stop_w)
        with os.fdopen(self.res_r, "rb") as f:
            out = f.read().decode()
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, out
        self.received = int(out)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="serving a socket as another user needs root")


@needs_root
async def test_client_refuses_a_daemon_of_another_user(tmp_path: Path) -> None:
    with Squatter(tmp_path / f"m31r-{os.getuid()}") as squatter:
        with pytest.raises(ForeignDaemon) as e:
            await Client.connect(squatter.path)
        assert e.value.code == "forbidden" and "uid 65534" in e.value.message and str(squatter.path) in e.value.message
        # Not a missing daemon either: connect_or_start must not try to start one over it.
        with pytest.raises(ForeignDaemon):
            await connect_or_start(squatter.path, daemon_args=["--bundle", str(tmp_path / "no-bundle")])
    assert squatter.received == 0  # not even the Hello reached it


@needs_root
async def test_m31r_status_refuses_a_daemon_of_another_user(tmp_path: Path) -> None:
    """Both `m31r status` paths (the blocking fast path, then the full client it falls back to) refuse a squatted
    default socket: no XDG_RUNTIME_DIR, so the socket is $TMPDIR/m31r-<uid>/m31rd.sock."""
    env = {k: v for k, v in ENV.items() if k not in ("XDG_RUNTIME_DIR", "M31R_SOCKET")}
    with Squatter(tmp_path / f"m31r-{os.getuid()}") as squatter:
        p = await asyncio.create_subprocess_exec(sys.executable, "-m", "m31r.entry", "status",
                                                 env={**env, "TMPDIR": str(tmp_path)}, stdout=asyncio.subprocess.PIPE,
                                                 stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(p.communicate(), 60)
    assert p.returncode != 0 and out == b"", err.decode()
    assert "forbidden" in err.decode() and "uid 65534" in err.decode()
    assert squatter.received == 0


async def test_daemon_refuses_a_hello_of_another_version() -> None:
    """The daemon's handshake, in process (test_daemon.py checks the same against a real daemon)."""
    from m31rd.server import Connection

    class StubDaemon:
        enc, dec = m.encoder(), m.client_decoder()
        read_timeout = hello_s = None

        def welcome(self) -> m.Welcome:
            return WELCOME

        def reading_frame(self, size: int) -> contextlib.AbstractContextManager[None]:
            return contextlib.nullcontext()

        def drop_waiting(self, conn: Connection) -> None:
            pass

    class Writer:
        def __init__(self) -> None:
            self.data, self.closed = bytearray(), False
            self.transport = self

        def get_write_buffer_size(self) -> int:
            return 0

        def get_extra_info(self, name: str) -> None:
            return None

        def is_closing(self) -> bool:
            return self.closed

        def write(self, data: bytes) -> None:
            self.data += data

        async def drain(self) -> None:
            pass

        def close(self) -> None:
            self.closed = True

        async def wait_closed(self) -> None:
            pass

    async def handshake(hello: object, then: bytes = b"") -> list[msgspec.Struct]:
        writer = Writer()
        reader = feed(pack(msgspec.msgpack.encode(hello)) + then)
        await Connection(StubDaemon(), reader, writer).serve()  # type: ignore[arg-type]
        assert writer.closed
        out, r = [], feed(bytes(writer.data))
        while (body := await read_frame(r)) is not None:
            out.append(m.server_decoder().decode(body))
        return out

    # A Status follows a refused Hello: it must go unanswered (the stub daemon could not even answer it).
    status = pack(m.encoder().encode(m.Status(id=1)))
    [err] = await handshake(m.Hello(protocol=m.PROTOCOL_VERSION + 1), status)
    assert isinstance(err, m.Error) and err.code == "unsupported_version" and str(m.PROTOCOL_VERSION) in err.message
    [err] = await handshake(m.Status(id=1), status)
    assert isinstance(err, m.Error) and err.code == "bad_request"
    [err] = await handshake(b"\xc1 not msgpack", status)
    assert isinstance(err, m.Error) and err.code == "bad_request"
    assert await handshake(m.Hello(protocol=m.PROTOCOL_VERSION)) == [WELCOME]


async def test_an_autostart_rotates_a_grown_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An autostarted daemon appends to $XDG_STATE_HOME/m31r/m31rd.log, as every one before it did: past
    LOG_FILE_BYTES the file is moved to m31rd.log.1 (replacing an older copy) when the next one starts, so the log
    stays bounded. Here the "daemon" prints a line and exits, which the client reports."""
    from m31r_protocol import client as client_mod

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setattr(client_mod, "LOG_FILE_BYTES", 1000)
    log = client_mod.daemon_log_path()
    log.parent.mkdir(parents=True)
    (log.parent / "m31rd.log.1").write_text("the oldest\n")
    old = "a request line\n" * 100  # 1,500 bytes: past the limit
    log.write_text(old)
    fake = [sys.executable, "-c", "import sys; print('fake daemon up'); sys.exit(3)"]
    sock = tmp_path / "s" / "d.sock"
    with pytest.raises(DaemonUnavailable, match="exited with code 3"):
        await connect_or_start(sock, daemon_command=fake, timeout=30)
    assert (log.parent / "m31rd.log.1").read_text() == old
    assert log.read_text() == "fake daemon up\n"
    # Under the limit, the next start appends to the same file.
    with pytest.raises(DaemonUnavailable):
        await connect_or_start(sock, daemon_command=fake, timeout=30)
    assert log.read_text() == "fake daemon up\n" * 2 and (log.parent / "m31rd.log.1").read_text() == old


async def test_a_failed_autostart_quotes_only_its_own_log_lines(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The log is shared by every autostarted daemon: a start that fails quotes what it wrote, never an earlier
    daemon's last words (a checksum mismatch fixed since would read as this start's reason)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    from m31r_protocol.client import daemon_log_path

    log = daemon_log_path()
    log.parent.mkdir(parents=True)
    log.write_text("an earlier daemon: model.safetensors: checksum mismatch\nserved 3 requests\nstopped\n")
    sock = tmp_path / "s" / "d.sock"
    fake = [sys.executable, "-c", "import sys; print('tokenizer.json is missing'); sys.exit(3)"]
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(sock, daemon_command=fake, timeout=30)
    assert str(info.value) == "the daemon exited with code 3: tokenizer.json is missing"
    silent = [sys.executable, "-c", "import sys; sys.exit(4)"]
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(sock, daemon_command=silent, timeout=30)
    assert str(info.value) == "the daemon exited with code 4: (it wrote nothing to its log)"


async def test_a_socket_that_cannot_be_reached_is_named_and_not_autostarted(tmp_path: Path) -> None:
    """A connect error no daemon would mend (here a file where the socket's folder should be) is SocketUnreachable
    naming the socket and why, for every front end, and connect_or_start starts no daemon for it."""
    from m31r_protocol.client import SocketUnreachable, unreachable

    (tmp_path / "afile").write_text("")
    sock = tmp_path / "afile" / "d.sock"
    started = tmp_path / "started"
    marker = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    with pytest.raises(SocketUnreachable) as info:
        await connect_or_start(sock, daemon_command=marker, timeout=5)
    assert str(info.value) == (f"cannot connect to the daemon on {sock}: Not a directory (a folder on its path is a "
                               "file); choose another socket path (--socket, or M31R_SOCKET)")
    assert not started.exists()
    # Another user's folder (root cannot be refused one, so the wording is checked on the error itself):
    assert "not yours to use" in unreachable(PermissionError(13, "Permission denied"), sock)


def test_a_runtime_dir_of_another_user_is_not_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After `su`, XDG_RUNTIME_DIR still names the first user's folder, where this user can make nothing: the default
    socket then goes where it goes without one, for daemon and clients alike (both call runtime_dir)."""
    import tempfile

    from m31r_protocol.paths import default_socket_path, runtime_dir

    monkeypatch.delenv("M31R_SOCKET", raising=False)
    ours = tmp_path / "ours"
    ours.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(ours))
    assert runtime_dir() == ours / "m31r" and default_socket_path() == ours / "m31r" / "m31rd.sock"
    if os.geteuid() == 0:  # root can give a folder away; anyone else finds one of root's
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 65534, 65534)
    else:
        theirs = Path("/")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(theirs))
    assert runtime_dir() == Path(tempfile.gettempdir()) / f"m31r-{os.getuid()}"
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "missing"))
    assert runtime_dir() == Path(tempfile.gettempdir()) / f"m31r-{os.getuid()}"

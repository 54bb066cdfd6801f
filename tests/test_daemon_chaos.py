"""A real m31rd under hostile and chaotic clients, then checked for what they must not leave behind.

Each round, clients at once: open streams and cancel them, go away mid-frame or stall there, half-close, send a
request and close before the answer, never read, supersede each other on shared documents, type through
suggestions, ask for the most tokens with the smallest deadlines, beam-search and cancel, repeat ids, cancel ids that
never were, and ask for Status in between. After each round the daemon must be idle (nothing active or queued, and
every request it admitted logged as ended), its prefix cache within `--cache-mb`, both of its slots free again, its
log free of errors, and its process must not grow from round to round (RSS, descriptors and threads from /proc,
against generous bounds; no timings asserted).
After the last, greedy requests must answer what they answered before any of it.

A daemon whose soft limit on open files is low (inherited from whoever started it) must still serve many clients
at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest
from daemon_util import DAEMON, start_daemon, stop_daemon

from m31r_protocol import messages as m
from m31r_protocol.blocking import status as blocking_status
from m31r_protocol.client import Client, DaemonError
from m31r_protocol.framing import pack, read_frame

pytestmark = pytest.mark.timeout(240)

ROUNDS = 5
CLIENTS = 42  # per round: three of each kind
RSS_GROWTH_MB = 48  # from the end of the first round to the end of the last: far above what a round's churn leaves
PREFIX = "fn main() {\n" + "    let a = 1;\n" * 8 + "    let b = "
SUFFIX = ";\n}\n"
DOCS = [f"file:///chaos/doc{k}.rs" for k in range(3)]  # shared by every client: they supersede each other


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def descriptors_and_threads(pid: int) -> tuple[int, int]:
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def logs(proc: subprocess.Popen) -> list[dict]:
    return [json.loads(line) for line in list(proc.log_lines)]  # type: ignore[attr-defined]


def frame(msg: dict) -> bytes:
    return pack(msgspec.msgpack.encode(msg))


async def raw(sock: Path, name: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_unix_connection(str(sock))
    writer.write(frame({"type": "hello", "protocol": m.PROTOCOL_VERSION, "client": name}))
    await writer.drain()
    welcome = m.server_decoder().decode(await read_frame(reader))
    assert isinstance(welcome, m.Welcome), welcome
    return reader, writer


async def finals(reader: asyncio.StreamReader, n: int) -> list[m.Done | m.Error | m.StatusReply]:
    """Read until `n` frames that end something (Done, Error, StatusReply) came, or the daemon closed."""
    out: list = []
    while len(out) < n and (body := await read_frame(reader)) is not None:
        msg = m.server_decoder().decode(body)
        if isinstance(msg, m.Done | m.Error | m.StatusReply):
            out.append(msg)
    return out


async def settle(stream) -> None:
    """A stream's end, whichever it is: the chaos decides whether it is Done, cancelled, superseded or busy."""
    with contextlib.suppress(DaemonError):
        await stream.collect()


def check_status(st: m.StatusReply) -> None:
    assert st.cache_mb <= st.cache_budget_mb, st
    assert st.cache_slots_used <= st.cache_slots, st
    assert st.queue >= 0 and 0 <= st.active <= 4, st


# -- the clients ------------------------------------------------------------------------------------------------


async def cancel_streams(sock: Path, name: str, rnd: random.Random) -> None:
    async with await Client.connect(sock, client=name) as c:
        streams = [await c.generate("fn main() {", max_tokens=400, lookahead=rnd.choice([0, 3])) for _ in range(3)]
        await asyncio.sleep(rnd.random() * 0.05)
        for s in streams:
            await s.cancel()
        await settle(await c.generate("fn f", max_tokens=2))  # the connection serves on


async def gone_mid_frame(sock: Path, name: str, rnd: random.Random) -> None:
    _, writer = await raw(sock, name)
    wire = frame({"type": "generate", "id": 1, "prompt": "fn x", "max_tokens": 50})
    writer.write(frame({"type": "generate", "id": 0, "prompt": "fn y", "max_tokens": 300}) +
                 wire[: rnd.randrange(1, len(wire))])
    await writer.drain()
    writer.transport.abort()


async def stall_mid_frame(sock: Path, name: str, rnd: random.Random) -> None:
    """Half a frame, then nothing (a request in flight meanwhile): cut off after --read-timeout, its request ended."""
    reader, writer = await raw(sock, name)
    wire = frame({"type": "generate", "id": 1, "prompt": "fn x", "max_tokens": 50})
    writer.write(frame({"type": "generate", "id": 0, "prompt": "fn y", "max_tokens": 300, "lookahead": 0}) +
                 wire[: rnd.randrange(1, len(wire))])
    await writer.drain()
    got = await finals(reader, 3)  # the request's end, then the frame's Error, then the daemon closes
    assert got and isinstance(got[-1], m.Error) and got[-1].code == "bad_request" and got[-1].id is None, got
    writer.close()


async def half_close(sock: Path, name: str, rnd: random.Random) -> None:
    reader, writer = await raw(sock, name)
    for k in range(3):
        writer.write(frame({"type": "fim", "id": k, "prefix": PREFIX, "suffix": SUFFIX, "max_tokens": 100,
                            "document": rnd.choice(DOCS)}))
    writer.write_eof()
    while await read_frame(reader) is not None:  # the daemon treats EOF as a disconnect: it ends, then closes
        pass
    writer.close()


async def send_and_close(sock: Path, name: str, rnd: random.Random) -> None:
    _, writer = await raw(sock, name)
    writer.write(frame({"type": "generate", "id": 7, "prompt": "impl Foo {", "max_tokens": 300}))
    await writer.drain()
    writer.close()


async def never_read(sock: Path, name: str, rnd: random.Random) -> None:
    """As many streams as a connection may have, with logprobs, never read, then gone."""
    _, writer = await raw(sock, name)
    for k in range(16):
        writer.write(frame({"type": "generate", "id": k, "prompt": "fn main() {" * (k + 1), "max_tokens": 400,
                            "lookahead": 0, "logprobs": 5}))
    await writer.drain()
    await asyncio.sleep(rnd.random() * 0.3)
    writer.transport.abort()


async def cancel_at_once(sock: Path, name: str, rnd: random.Random) -> None:
    """Each request cancelled in the same write that sends it, ids that never were cancelled, Status between."""
    reader, writer = await raw(sock, name)
    wire = b""
    for k in range(8):
        wire += frame({"type": "fim", "id": k, "prefix": PREFIX * (k + 1), "suffix": SUFFIX, "max_tokens": 200,
                       "document": DOCS[k % len(DOCS)]})
        wire += frame({"type": "cancel", "id": k}) + frame({"type": "cancel", "id": 1000 + k})
        wire += frame({"type": "status", "id": 5000 + k})
    writer.write(wire)
    await writer.drain()
    got = await finals(reader, 16)  # a Done or an Error for each request, and the 8 replies
    assert len(got) == 16, got
    for st in got:
        if isinstance(st, m.StatusReply):
            check_status(st)
    writer.close()


async def duplicate_ids(sock: Path, name: str, rnd: random.Random) -> None:
    reader, writer = await raw(sock, name)
    writer.write(b"".join(frame({"type": "generate", "id": 3, "prompt": "fn a", "max_tokens": 30, "deadline_ms": k})
                          for k in range(6)))
    await writer.drain()
    await finals(reader, 2)
    writer.close()


async def supersede(sock: Path, name: str, rnd: random.Random) -> None:
    async with await Client.connect(sock, client=name) as c:
        doc, prefix, streams = rnd.choice(DOCS), PREFIX, []
        for _ in range(4):
            prefix += rnd.choice("ab1 ")
            streams.append(await c.fim(prefix, SUFFIX, document=doc, max_tokens=rnd.choice([8, 64, 256]),
                                       deadline_ms=rnd.choice([None, 5, 200])))
        for s in streams:
            await settle(s)


async def type_through(sock: Path, name: str, rnd: random.Random) -> None:
    # A document of its own: on a shared one another client's answer could always come between, and the test's
    # check that some answers were typed through failed now and then.
    async with await Client.connect(sock, client=name) as c:
        doc, prefix = f"file:///chaos/{name}.rs", PREFIX
        for _ in range(5):
            s = await c.fim(prefix, SUFFIX, document=doc, max_tokens=rnd.choice([8, 16]))
            text = ""
            with contextlib.suppress(DaemonError):
                text, _ = await s.collect()
            prefix += text[:1] or "Z"


async def huge_and_hasty(sock: Path, name: str, rnd: random.Random) -> None:
    """The most tokens a request may ask for, with deadlines from nothing to a few ms."""
    async with await Client.connect(sock, client=name) as c:
        streams = [await c.generate("fn main() {", max_tokens=500, deadline_ms=rnd.choice([0, 1, 3, 20])),
                   await c.fim(PREFIX, SUFFIX, max_tokens=256, deadline_ms=rnd.choice([0, 1, 3, 20]),
                               document=rnd.choice(DOCS))]
        for s in streams:
            await settle(s)


async def beams_cancelled(sock: Path, name: str, rnd: random.Random) -> None:
    async with await Client.connect(sock, client=name) as c:
        streams = [await c.fim(PREFIX + "x" * k, SUFFIX, max_tokens=rnd.choice([4, 40, 256]), stop=["\n"],
                               beams=rnd.choice([2, 3, 8]), document=rnd.choice(DOCS),
                               deadline_ms=rnd.choice([None, 2, 30])) for k in range(3)]
        await asyncio.sleep(rnd.random() * 0.02)
        await streams[0].cancel()
        for s in streams[1:]:
            await settle(s)


async def status_between(sock: Path, name: str, rnd: random.Random) -> None:
    async with await Client.connect(sock, client=name) as c:
        for _ in range(3):
            check_status(await c.status())
            await asyncio.sleep(rnd.random() * 0.05)


async def shut_before_hello(sock: Path, name: str, rnd: random.Random) -> None:
    """Connected, then gone without a word, or with half a Hello."""
    _, writer = await asyncio.open_unix_connection(str(sock))
    if rnd.random() < 0.5:
        writer.write(frame({"type": "hello", "protocol": m.PROTOCOL_VERSION, "client": name})[:3])
    writer.close()


KINDS: list[Callable[[Path, str, random.Random], Awaitable[None]]] = [
    cancel_streams, gone_mid_frame, stall_mid_frame, half_close, send_and_close, never_read, cancel_at_once,
    duplicate_ids, supersede, type_through, huge_and_hasty, beams_cancelled, status_between, shut_before_hello]


async def chaos_round(sock: Path, r: int) -> None:
    rnd = random.Random(r)
    kinds = [KINDS[i % len(KINDS)] for i in range(CLIENTS)]
    rnd.shuffle(kinds)
    results = await asyncio.gather(*(asyncio.wait_for(kind(sock, f"chaos-{r}-{i}", random.Random(rnd.random())), 60)
                                     for i, kind in enumerate(kinds)), return_exceptions=True)
    failed = [(k.__name__, e) for k, e in zip(kinds, results, strict=True)
              if isinstance(e, BaseException) and not isinstance(e, ConnectionError)]
    assert not failed, failed


# -- what must hold afterwards ----------------------------------------------------------------------------------

PROBES = [("generate", dict(prompt="fn main() {\n    let x", max_tokens=24, lookahead=0)),
          ("generate", dict(prompt="impl Foo {\n    pub fn bar(&self) -> u32 {", max_tokens=24, lookahead=3)),
          ("fim", dict(prefix=PREFIX, suffix=SUFFIX, max_tokens=24)),
          ("fim", dict(prefix=PREFIX + "x", suffix=SUFFIX, max_tokens=12, stop=["\n"], beams=3))]


async def answers(sock: Path) -> list[tuple[str, str, list[str]]]:
    """Greedy answers (one at a time: nothing runs beside them), no document: the model's, never typed through."""
    out = []
    async with await Client.connect(sock, client="probe") as c:
        for kind, kw in PROBES:
            text, done = await (await getattr(c, kind)(**kw)).collect()
            assert done.source == "model", done
            out.append((text, done.finish_reason, done.alternatives))
    return out


async def idle(sock: Path, proc: subprocess.Popen) -> m.StatusReply:
    """Status once nothing is active or queued and every request the daemon admitted has its log line (the line is
    written as its last frame is sent: a request left in flight never gets one). Bounded only against a hang."""
    t0 = time.monotonic()
    async with await Client.connect(sock, client="idle") as c:
        while True:
            st = await c.status()
            ended = [x for x in logs(proc) if x["msg"] == "request"]
            if st.active == 0 and st.queue == 0 and len(ended) == st.requests:
                return st
            assert time.monotonic() - t0 < 60, (st, len(ended))
            await asyncio.sleep(0.05)


async def both_slots_free(sock: Path) -> None:
    """With two slots, a short request is answered while a long one holds the other slot. A slot left busy by the
    chaos would make the short one wait for the long one's end (400 tokens): that happening in every try fails."""
    async with await Client.connect(sock, client="slots") as c:
        for _ in range(5):
            long = await c.generate("fn main() {", max_tokens=400, lookahead=0)
            await long.__anext__()  # it holds a slot now
            await (await c.generate("struct P {", max_tokens=2, lookahead=0)).collect()
            ran_beside = long.open  # the long one's last frame has not come yet
            await long.cancel()
            if ran_beside:
                return
    pytest.fail("a short request never ran while a long one held the other slot: a slot stayed busy")


@pytest.fixture(scope="module")
def chaos_daemon(tiny_bundle, tmp_path_factory):
    """Two prefix-cache slots (--cache-mb 0.5 holds two of the tiny model's 0.25 MiB caches): every slot the chaos
    could leave busy matters, and the cache fills, so eviction runs. Up to 4 requests run at once; a frame must
    arrive whole within a second."""
    sock = tmp_path_factory.mktemp("chaos") / "run" / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--cache-mb", "0.5", "--max-active", "4", "--read-timeout", "1")
    yield proc, sock
    stop_daemon(proc)


async def test_chaos_leaves_the_daemon_as_it_was(chaos_daemon):
    proc, sock = chaos_daemon
    before = await answers(sock)
    st = await idle(sock, proc)
    assert st.cache_slots == 2, st
    sizes, held = [], []
    for r in range(ROUNDS):
        await chaos_round(sock, r)
        st = await idle(sock, proc)
        check_status(st)
        assert st.cache_mb <= st.cache_budget_mb == 0.5, st
        await both_slots_free(sock)
        sizes.append(rss_mb(proc.pid))
        held.append(descriptors_and_threads(proc.pid))
    assert await answers(sock) == before
    assert sizes[-1] - sizes[0] < RSS_GROWTH_MB, sizes
    # No connection's descriptor and no thread outlives its round (a few may be on their way out).
    assert held[-1][0] <= held[0][0] + 4 and held[-1][1] <= held[0][1] + 2, held
    assert proc.poll() is None
    lines = logs(proc)
    assert not [x for x in lines if x["level"] not in ("info", "debug")], [x for x in lines if x["level"] != "info"]
    ended = [x for x in lines if x["msg"] == "request"]
    assert any(x.get("code") == "cancelled" for x in ended) and any(x.get("finish_reason") == "deadline"
                                                                  for x in ended)
    assert any(x.get("source") == "typed_through" for x in ended)


# -- open files -------------------------------------------------------------------------------------------------

LOW_OPEN_FILES = 64


# Lowers its soft limit, then becomes the daemon (exec keeps the limit): no preexec_fn in a process with threads.
LOWERED = ("import os, resource, sys; soft = int(sys.argv[1]); hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]; "
           "resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)); "
           "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")


def start_with_open_files(bundle: Path, sock: Path, soft: int) -> subprocess.Popen:
    """start_daemon's daemon, begun with a soft limit of `soft` open files, as a login shell or supervisor with a
    low one would start it."""
    assert DAEMON[0] == sys.executable and DAEMON[1] == "-m", DAEMON
    proc = subprocess.Popen([sys.executable, "-c", LOWERED, str(soft), *DAEMON[1:], "--bundle", str(bundle),
                             "--socket", str(sock), "--threads", "1", "--dtype", "float32", "--quant", "none"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    t0 = time.monotonic()
    while True:
        assert proc.poll() is None, proc.returncode
        with contextlib.suppress(OSError, ValueError):
            if sock.exists() and not blocking_status(sock, timeout=10)["warming"]:
                return proc
        assert time.monotonic() - t0 < 60, "the daemon did not start"
        time.sleep(0.05)


async def test_many_clients_at_once_under_a_low_open_files_limit(tiny_bundle, tmp_path):
    """Each client holds a descriptor of the daemon's. Begun with a soft limit of 64 open files, the daemon closed
    every connection past its ~48th at once (Status and `m31r stop` included) until some went away; it now raises
    its soft limit to the hard one (up to 65,536), so twice that many clients are all served."""
    sock = tmp_path / "run" / "m31rd.sock"
    proc = start_with_open_files(tiny_bundle.path, sock, LOW_OPEN_FILES)
    clients: list[Client] = []
    try:
        for k in range(2 * LOW_OPEN_FILES):
            clients.append(await Client.connect(sock, client=f"many-{k}"))
        answers = await asyncio.gather(*(c.status() for c in clients[::8]))
        assert all(a.pid == proc.pid for a in answers)
        text, done = await (await clients[-1].generate("fn f", max_tokens=3)).collect()
        assert done.usage.completion_tokens == 3
    finally:
        for c in clients:
            await c.close()
        stop_daemon(proc)


HUGE_CHARS = 1_900_000  # near --max-prompt-chars (2 Mi), under the 8 MiB frame as UTF-8 of 4-byte characters


async def test_huge_documents_do_not_grow_the_daemon(chaos_daemon):
    """A greedy Fim's prefix and suffix are kept for its document's typed-through answers. Counted by documents
    alone (256), a client going through documents of 1.9 M characters (held as 4 bytes each) grew the daemon by
    about 7 MB a document, round after round; what is kept is now bounded in characters too."""
    proc, sock = chaos_daemon
    line = "// " + "\U0001f980" * 60 + "\n"
    body = (line * (HUGE_CHARS // len(line) + 1))[:HUGE_CHARS]
    sizes = []
    async with await Client.connect(sock, client="huge") as c:
        for r in range(4):
            for k in range(6):
                prefix = body + f"\nfn f{r}_{k}() {{\n    let x = "
                _, done = await (await c.fim(prefix, SUFFIX, document=f"file:///huge/{r}-{k}.rs",
                                             max_tokens=4)).collect()
                assert done.source == "model"
            sizes.append(rss_mb(proc.pid))
    assert sizes[-1] - sizes[0] < RSS_GROWTH_MB, sizes

"""A real m31rd under clients that never say Hello, crowd it past its connection limit, stall large frames half-sent or
never read their answers: each costs the daemon a bounded amount, is told why where it listens, and the other clients
are served meanwhile.

The module's daemon runs under a limit of SPARE_FILES + CAP open files (soft and hard, as a supervisor may set them),
so that it serves at most CAP connections, and with --read-timeout 2.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest
from daemon_util import DAEMON, stop_daemon

from m31r_protocol import messages as m
from m31r_protocol.blocking import status as blocking_status
from m31r_protocol.client import Client, DaemonError
from m31r_protocol.framing import HEADER, pack, read_frame
from m31rd.server import READING_BYTES, SPARE_FILES

pytestmark = pytest.mark.timeout(180)

CAP = 16
READ_TIMEOUT = 2
# Sets the soft and hard limits on open files, then becomes the daemon (exec keeps them): the daemon cannot raise them.
LIMITED = ("import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_NOFILE, (n, n)); "
           "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])")
LARGE = 7 << 20  # a frame of 7 MiB: READING_BYTES holds 9 of them


class Daemon:
    def __init__(self, proc: subprocess.Popen, socket: Path, log: Path):
        self.proc, self.socket, self.log = proc, socket, log

    def logs(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    async def await_log(self, pred, timeout: float = 60) -> dict:
        """The first log line `pred` accepts, once written; bounded only against a hang."""
        t0 = time.monotonic()
        while not (found := [x for x in self.logs() if pred(x)]):
            assert time.monotonic() - t0 < timeout, "no such log line"
            await asyncio.sleep(0.05)
        return found[0]


@pytest.fixture(scope="module")
def daemon(tiny_bundle, tmp_path_factory) -> Daemon:
    folder = tmp_path_factory.mktemp("conns")
    sock, log = folder / "run" / "m31rd.sock", folder / "m31rd.log"
    assert DAEMON[0] == sys.executable and DAEMON[1] == "-m", DAEMON
    proc = subprocess.Popen([sys.executable, "-c", LIMITED, str(SPARE_FILES + CAP), *DAEMON[1:], "--bundle",
                             str(tiny_bundle.path), "--socket", str(sock), "--threads", "1", "--dtype", "float32",
                             "--quant", "none", "--read-timeout", str(READ_TIMEOUT), "--log-file", str(log)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        t0 = time.monotonic()
        while True:
            assert proc.poll() is None, proc.returncode
            with contextlib.suppress(OSError, ValueError):
                if sock.exists() and not blocking_status(sock, timeout=10)["warming"]:
                    break
            assert time.monotonic() - t0 < 60, "the daemon did not start"
            time.sleep(0.05)
        yield Daemon(proc, sock, log)
    finally:
        stop_daemon(proc)


def frame(msg: dict) -> bytes:
    return pack(msgspec.msgpack.encode(msg))


async def recv(reader: asyncio.StreamReader) -> msgspec.Struct | None:
    """The next frame, or None once the daemon closed (a reset after the frames it sent counts as closed)."""
    try:
        body = await asyncio.wait_for(read_frame(reader), 30)
    except (ConnectionResetError, asyncio.IncompleteReadError):
        return None
    return None if body is None else m.server_decoder().decode(body)


async def connect(sock: Path, hello: bool = True, client: str = "conns"
                  ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection, welcomed with `hello`. Told `busy` for the connection limit, it tries again (for 30 s): the
    connections an earlier test closed count until the daemon has seen them go."""
    t0 = time.monotonic()
    while True:
        reader, writer = await asyncio.open_unix_connection(str(sock))
        if not hello:
            return reader, writer
        writer.write(frame({"type": "hello", "protocol": m.PROTOCOL_VERSION, "client": client}))
        got = await recv(reader)
        if isinstance(got, m.Welcome):
            return reader, writer
        writer.close()
        assert isinstance(got, m.Error) and "the most it serves at once" in got.message, got
        assert time.monotonic() - t0 < 30, got
        await asyncio.sleep(0.05)


async def served(sock: Path) -> None:
    """Another client is answered."""
    async with await Client.connect(sock, client="bystander") as c:
        assert (await c.status()).pid > 0


async def test_a_connection_that_never_says_hello_is_closed_but_an_idle_client_stays(daemon):
    """--read-timeout covered a frame begun and stalled, not one never begun: a connection that sent nothing held
    its descriptor for as long as its client lived. One that has not begun its Hello within --read-timeout of
    connecting is now told so and closed; one idle after its Hello (an editor's) stays."""
    idle_r, idle_w = await connect(daemon.socket)
    silent_r, silent_w = await connect(daemon.socket, hello=False)
    err = await recv(silent_r)
    assert isinstance(err, m.Error) and err.code == "bad_request" and err.id is None, err
    assert f"no hello began within {READ_TIMEOUT} s of connecting" in err.message, err.message
    assert "--read-timeout" in err.message
    assert await recv(silent_r) is None
    silent_w.close()
    idle_w.write(frame({"type": "status", "id": 1}))  # silent for longer than the timeout, and still served
    assert isinstance(await recv(idle_r), m.StatusReply)
    idle_w.close()


async def test_connections_past_the_limit_are_refused_busy_and_the_others_served(daemon):
    """Nothing bounded the connections a daemon served: past its limit on open files accept() failed, and the next
    clients waited unanswered in the listen queue (a client's Hello got no Welcome). It now serves at most
    min(256, open files - 64) at once, and tells the next one `busy` at once."""
    clients: list[Client] = []
    try:
        with pytest.raises(DaemonError) as refused:
            while len(clients) <= CAP:  # (a connection of an earlier test may still be on its way out)
                clients.append(await Client.connect(daemon.socket, client=f"crowd-{len(clients)}"))
        assert refused.value.code == "busy", refused.value
        assert "the most it serves at once" in str(refused.value)
        statuses = await asyncio.gather(*(c.status() for c in clients))
        assert all(s.pid == daemon.proc.pid for s in statuses)
        _, done = await (await clients[0].generate("fn f", max_tokens=3)).collect()
        assert done.usage.completion_tokens == 3
        await clients.pop().close()
        t0 = time.monotonic()
        while True:  # its place is free once the daemon has seen it go
            try:
                clients.append(await Client.connect(daemon.socket, client="after"))
                break
            except DaemonError as e:
                assert e.code == "busy" and time.monotonic() - t0 < 30, e
                await asyncio.sleep(0.05)
        assert (await clients[-1].status()).pid == daemon.proc.pid
    finally:
        for c in clients:
            await c.close()
    await daemon.await_log(lambda x: x["msg"].startswith("refused a connection") and x["level"] == "warning")


async def test_large_frames_read_at_once_are_bounded(daemon):
    """Each connection may send a frame of 8 MiB, buffered whole as it arrives: 30 clients each stalling 7 MiB into
    a frame grew the daemon by 230 MB until --read-timeout cut them off, and more grew it more. At most READING_BYTES
    of large frames are read at once now: a large frame past that is refused `busy` before its body is read, while
    small frames (Status here) are served throughout, and the room comes back as the stalled frames end."""
    conns = [await connect(daemon.socket) for _ in range(READING_BYTES // LARGE + 1)]
    for _, writer in conns:
        writer.write(HEADER.pack(LARGE) + b"\x94" * 10)  # begun, then stalled
        await writer.drain()
    await served(daemon.socket)
    errors = [await recv(reader) for reader, _ in conns]
    for reader, writer in conns:
        assert await recv(reader) is None  # closed
        writer.close()
    busy = [e for e in errors if e.code == "busy"]
    assert len(busy) == 1, errors
    assert busy[0].id is None and "refused unread" in busy[0].message and str(READING_BYTES) in busy[0].message
    stalled = [e for e in errors if e.code == "bad_request"]
    assert len(stalled) == len(conns) - 1 and all("not complete" in e.message for e in stalled), errors
    reader, writer = await connect(daemon.socket)  # a whole large frame is read again
    writer.write(frame({"type": "generate", "id": 9, "prompt": "x" * (LARGE - 100), "max_tokens": 1}))
    err = await recv(reader)
    assert isinstance(err, m.Error) and err.id == 9 and "--max-prompt-chars" in err.message, err
    writer.close()


async def test_a_client_that_never_reads_its_answers_is_dropped(daemon):
    """A client that sent requests and never read kept their frames in the daemon's memory (16 streams of 400
    tokens with 20 likeliest tokens each: megabytes a connection, and connections without end). Past UNREAD_BYTES
    unread, the daemon now cancels its requests and drops the connection; the others are served."""
    reader, writer = await connect(daemon.socket)
    writer.write(b"".join(frame({"type": "generate", "id": k, "prompt": "fn main() {", "max_tokens": 400,
                                 "lookahead": 0, "logprobs": 20}) for k in range(16)))
    await writer.drain()
    await daemon.await_log(lambda x: x["msg"].startswith("dropped the connection of client 'conns'"))
    dones = 0
    while (msg := await recv(reader)) is not None:
        dones += isinstance(msg, m.Done)
    assert dones < 16
    writer.close()
    await daemon.await_log(lambda x: x["msg"] == "request" and x.get("client") == "conns"
                           and x.get("code") == "cancelled")
    await served(daemon.socket)


FLOOD = 20_000  # small requests in one write, each refused at once (beams 9: past the widest)
PROBES = 12


def refused(k: int) -> bytes:
    return frame({"type": "generate", "id": k, "prompt": "fn", "beams": 9})


async def test_a_flood_of_small_frames_does_not_hold_up_other_clients(daemon):
    """Frames already buffered were handled without letting the event loop run: one client's flood of small frames
    ran on for as many as it had buffered (thousands), and every other client waited (a Status, up to 0.9 s). The
    daemon now lets the others in between frames: between two requests another client sends one after the other,
    only a few of the flood's are handled (counted in the log's order, where each refusal has its line)."""
    reader, writer = await connect(daemon.socket, client="flood")

    async def read_all() -> None:
        for _ in range(FLOOD):
            assert await read_frame(reader) is not None

    replies = asyncio.ensure_future(read_all())
    writer.write(b"".join(refused(k) for k in range(FLOOD)))
    probe_r, probe_w = await connect(daemon.socket, client="probe")
    for k in range(PROBES):
        probe_w.write(refused(k))
        err = await recv(probe_r)
        assert isinstance(err, m.Error) and err.id == k and err.code == "bad_request", err
    await replies
    writer.close()
    probe_w.close()
    order = [x["client"] for x in daemon.logs() if x["msg"] == "request refused" and x["client"] in ("flood", "probe")]
    probes = [i for i, c in enumerate(order) if c == "probe"]
    last_flood = max(i for i, c in enumerate(order) if c == "flood")
    gaps = sorted(b - a - 1 for a, b in zip(probes, probes[1:], strict=False) if b < last_flood)
    assert len(gaps) >= PROBES // 2, (gaps, probes, last_flood)
    assert gaps[len(gaps) // 2] < 500, gaps

"""The socket protocol's fuzzer, shared by tests/test_fuzz.py (a few thousand cases in `make test`) and
benchmarks/soak_fuzz.py (a million in `make soak`).

A case is one frame on the wire and what the daemon must answer to it:

  reply    a decodable frame after the handshake: exactly one final answer (Done, Error or StatusReply) for its
           id, none `internal`, and the connection stays open. Valid Generate/Fim (answered Done or a refusal),
           Status, a second Hello, and any message that fails validation (wrong types, missing or unknown
           fields, unknown kinds: `bad_request`).
  silent   a Cancel: no answer of its own.
  close    an undecodable body (bad MessagePack, bad UTF-8, trailing bytes) or a length prefix over the frame limit:
           one Error (`bad_request` or `frame_too_large`), then the daemon closes the connection.
  eof      a frame cut short (a short header, or fewer bytes than its length says), then the client's EOF: the
           daemon closes the connection without an answer.
  stall    a frame cut short, then nothing: after --read-timeout, `bad_request` and the connection closed.

Messages come from hypothesis strategies over the msgspec Structs of m31r_protocol.messages (Shutdown excepted: it
is a valid request to stop). Mutations are plain functions of a `random.Random`, so the soak can make a million
cases from a pool of hypothesis messages quickly, and the test can draw them through `st.randoms()`.
`expect()` decides a case's class by decoding the body with the daemon's own decoder, so a mutation that happens
to yield a valid message is expected to be served as one.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from hypothesis import strategies as st

from m31r_protocol import messages as m
from m31r_protocol.framing import HEADER, pack

MAX_FRAME = m.MAX_FRAME_BYTES
DECODER = m.client_decoder()
ENCODER = m.encoder()
FINAL = (m.Done, m.Error, m.StatusReply)
# A request may be refused with these; `internal` (a daemon bug) and the connection-level codes never answer one.
REQUEST_CODES = {"bad_request", "busy", "context_overflow", "cancelled"}
DUPLICATE = re.compile(r"request id (-?\d+) is already in flight on this connection")
PROBE_PROMPT = "fn main() {\n    let x = "

# -- hypothesis strategies over the message Structs ------------------------------------------------------------

INT64 = st.integers(-(2**63), 2**63 - 1)
ANY_INT = st.integers(-(2**63), 2**64 - 1)  # what MessagePack can carry
SNIPPETS = ["fn main() {\n    ", "let x = ", "impl Foo for Bar {", "    }\n}\n", "// é ü 中文 🦀\n", "\x00\t\r\n", ""]
texts = st.one_of(st.text(max_size=24), st.sampled_from(SNIPPETS), st.text(max_size=300))
ids = st.one_of(st.integers(0, 64), ANY_INT)
# Short (a request that is accepted runs on the model, and its connection waits for it), or out of range (-1, one over
# the tiny model's context, any 64-bit integer).
max_tokens = st.one_of(st.integers(0, 4), st.integers(0, 4), st.integers(0, 4), st.sampled_from([-1, 513]),
                       st.integers(-3, 40), ANY_INT)
floats = st.one_of(st.floats(-2.0, 3.0), st.floats(allow_nan=True, allow_infinity=True))
sampling = st.one_of(
    st.just(m.Sampling()),
    st.builds(m.Sampling, temperature=floats, top_k=st.one_of(st.integers(-2, 400), INT64), top_p=floats,
              repetition_penalty=floats))
seeds = st.one_of(st.none(), st.integers(0, 2**32), ANY_INT)
deadlines = st.one_of(st.none(), st.integers(0, 50), st.integers(-5, 10_000), INT64)
stops = st.lists(st.one_of(st.text(max_size=4), st.sampled_from(["\n", "}", ""])), max_size=3)
documents = st.one_of(st.just(""), st.sampled_from(["doc://a", "doc://b"]), st.text(max_size=12))

generates = st.builds(m.Generate, id=ids, prompt=texts, max_tokens=max_tokens, sampling=sampling, stop=stops,
                      seed=seeds, truncate=st.booleans(), deadline_ms=deadlines)
fims = st.builds(m.Fim, id=ids, prefix=texts, suffix=texts, document=documents, max_tokens=max_tokens,
                 sampling=sampling, stop=stops, seed=seeds, deadline_ms=deadlines)
messages = st.one_of(generates, fims, st.builds(m.Cancel, id=ids), st.builds(m.Status, id=ids),
                     st.builds(m.Hello, protocol=st.one_of(st.just(m.PROTOCOL_VERSION), INT64), client=texts))


# -- mutations: body bytes in, body bytes out (framing mutations make the whole wire frame) -------------------

ODD_VALUES: list = [None, True, False, 0, -1, 2**64 - 1, -(2**63), 1.5, float("nan"), "", "x" * 3, b"\x00\xff",
                    [], [1, "a"], {}, {"id": 1}, [[[[]]]]]
KINDS = ["", "Generate", "GENERATE", "generate ", "token", "done", "welcome", "error", "status_reply",
         "shutdown_reply", "fimm", "\x00", "🦀", 7, None, True, ["generate"], {"type": "generate"}]


def _builtin(msg: msgspec.Struct) -> dict:
    d = msgspec.to_builtins(msg)
    d["type"] = msg.__struct_config__.tag
    return d


def wrong_type(d: dict, rnd: random.Random) -> bytes:
    d = dict(d)
    key = rnd.choice(sorted(d))
    d[key] = rnd.choice(ODD_VALUES)
    return msgspec.msgpack.encode(d)


def missing_field(d: dict, rnd: random.Random) -> bytes:
    d = dict(d)
    del d[rnd.choice(sorted(d))]
    return msgspec.msgpack.encode(d)


def unknown_field(d: dict, rnd: random.Random) -> bytes:
    return msgspec.msgpack.encode({**d, rnd.choice(["extra", "ID", "prompt ", "x" * rnd.randint(1, 40)]):
                                   rnd.choice(ODD_VALUES)})


def unknown_kind(d: dict, rnd: random.Random) -> bytes:
    return msgspec.msgpack.encode({**d, "type": rnd.choice(KINDS)})


def not_a_map(d: dict, rnd: random.Random) -> bytes:
    return msgspec.msgpack.encode(rnd.choice([list(d.values()), list(d), d.get("id"), "generate", None, 3.5,
                                              b"bin", [d]]))


def deep_nesting(d: dict, rnd: random.Random) -> bytes:
    """A field's value nested in arrays (its encoding, None, is the body's last byte): up to 100 deep, or thousands.
    Not in between: whether the daemon's untyped decode salvages the id of such a body depends on the caller's stack
    depth (msgspec counts its nesting against Python's recursion limit), so ids would differ by process."""
    key = rnd.choice(sorted(d))
    body = msgspec.msgpack.encode({**{k: v for k, v in d.items() if k != key}, key: None})
    depth = rnd.randint(1, 100) if rnd.random() < 0.5 else rnd.randint(2_000, 5_000)
    return body[:-1] + b"\x91" * depth + b"\xc0"


def flip_bytes(body: bytes, rnd: random.Random) -> bytes:
    b = bytearray(body)
    for _ in range(rnd.randint(1, 4)):
        i = rnd.randrange(len(b))
        b[i] ^= 1 << rnd.randrange(8) if rnd.random() < 0.5 else rnd.randrange(1, 256)
    return bytes(b)


def splice_bytes(body: bytes, rnd: random.Random) -> bytes:
    i = rnd.randrange(len(body) + 1)
    junk = rnd.randbytes(rnd.randint(1, 8))
    return body[:i] + junk + body[i + rnd.choice([0, 0, 1, 2]):]


def cut_body(body: bytes, rnd: random.Random) -> bytes:
    """The body cut short, framed with its new length: a frame that arrives whole but does not decode."""
    return body[: rnd.randrange(len(body))]


def trailing_bytes(body: bytes, rnd: random.Random) -> bytes:
    return body + rnd.randbytes(rnd.randint(1, 4))


def bad_utf8(d: dict, rnd: random.Random) -> bytes:
    """A str field whose bytes are not UTF-8."""
    junk = rnd.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"a\x80"])
    key = rnd.choice([k for k, v in d.items() if isinstance(v, str)] or ["type"])
    marker = "\ue000" * 3  # replaced by the junk bytes, length fixed up below
    body = msgspec.msgpack.encode({**d, key: marker})
    enc = marker.encode()
    head = bytes([0xA0 | len(enc)])
    assert len(enc) < 32 and head + enc in body
    return body.replace(head + enc, bytes([0xA0 | len(junk)]) + junk, 1)


def random_body(body: bytes, rnd: random.Random) -> bytes:
    return rnd.randbytes(rnd.randint(1, 64))


DICT_MUTATIONS = [wrong_type, missing_field, unknown_field, unknown_kind, not_a_map, deep_nesting, bad_utf8]
BYTE_MUTATIONS = [flip_bytes, splice_bytes, cut_body, trailing_bytes, random_body]


# -- cases --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    wire: bytes  # exactly what is written to the socket
    expect: str  # reply | silent | close | eof | stall
    label: str  # which generator or mutation made it
    rid: int | None = None  # for reply: the id the final answer must carry
    code: str | None = None  # for close and stall: the Error code before the connection closes
    status: bool = False  # for reply: a Status, answered by a StatusReply


def expect(body: bytes, label: str) -> Case | None:
    """The case for a body sent after the handshake, classified as the daemon's decoder sees it (None: a Shutdown,
    which would stop the daemon)."""
    wire = pack(body)
    try:
        msg = DECODER.decode(body)
    except msgspec.ValidationError:
        return Case(wire, "reply", label, rid=_salvage_id(body))
    except (msgspec.DecodeError, UnicodeDecodeError):
        return Case(wire, "close", label, code="bad_request")
    if isinstance(msg, m.Shutdown):
        return None
    if isinstance(msg, m.Cancel):
        return Case(wire, "silent", label)
    if isinstance(msg, m.Hello):
        return Case(wire, "reply", label, rid=None)
    return Case(wire, "reply", label, rid=msg.id, status=isinstance(msg, m.Status))


def _salvage_id(body: bytes) -> int | None:
    with contextlib.suppress(Exception):
        rid = msgspec.msgpack.decode(body).get("id")
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else None  # True is an int
    return None


def message_case(msg: msgspec.Struct) -> Case | None:
    return expect(ENCODER.encode(msg), type(msg).__name__.lower())


def mutated_case(msg: msgspec.Struct, rnd: random.Random, dict_share: float = 0.5) -> Case | None:
    """A mutation of the message's fields (share `dict_share`: these mostly fail validation, and the connection stays
    open) or of its bytes (these mostly do not decode, and end the connection)."""
    if rnd.random() < dict_share:
        fn = rnd.choice(DICT_MUTATIONS)
        body = fn(_builtin(msg), rnd)
    else:
        fn = rnd.choice(BYTE_MUTATIONS)
        body = fn(ENCODER.encode(msg), rnd)
    return expect(body, fn.__name__)


def framing_case(msg: msgspec.Struct, rnd: random.Random) -> Case:
    """Cases about the length prefix: each ends the connection."""
    body = ENCODER.encode(msg)
    kind = rnd.choice(["oversize", "oversize", "truncated", "short_header", "empty"])
    if kind == "oversize":
        size = rnd.choice([MAX_FRAME + 1, rnd.randint(MAX_FRAME + 1, 2**32 - 1), 2**32 - 1])
        return Case(HEADER.pack(size) + body[: rnd.randint(0, len(body))], "close", "oversize_prefix",
                    code="frame_too_large")
    if kind == "truncated":
        extra = rnd.choice([1, 2, rnd.randint(1, 1 << 20)])
        return Case(HEADER.pack(len(body) + extra) + body, "eof", "truncated_frame")
    if kind == "short_header":
        return Case(HEADER.pack(len(body))[: rnd.randint(1, 3)], "eof", "short_header")
    return Case(pack(b""), "close", "empty_body", code="bad_request")


def stall_case(msg: msgspec.Struct, rnd: random.Random) -> Case:
    """A frame cut short by a client that then says nothing: after --read-timeout the daemon answers `bad_request`
    and closes the connection."""
    wire = pack(ENCODER.encode(msg))
    return Case(wire[: rnd.randint(1, len(wire) - 1)], "stall", "stalled_frame", code="bad_request")


def case(msg: msgspec.Struct, rnd: random.Random, plain: float = 0.2, framing: float = 0.03,
         dict_share: float = 0.5) -> Case | None:
    """One case from a message: sent as is (share `plain`), with a broken frame (share `framing`: it ends a
    connection), else mutated (see mutated_case)."""
    r = rnd.random()
    if r < plain:
        return message_case(msg)
    if r < plain + framing:
        return framing_case(msg, rnd)
    return mutated_case(msg, rnd, dict_share)


def handshake_case(msg: msgspec.Struct, rnd: random.Random) -> tuple[Case, str]:
    """A case sent as a connection's first frame, and what must come back: "welcome" (a valid Hello) or the code of
    the Error that precedes the close (anything else is refused)."""
    c = case(msg, rnd) or message_case(m.Status(id=0))
    assert c is not None
    if c.expect == "eof":
        return c, "eof"
    if c.code == "frame_too_large":
        return c, "frame_too_large"
    body = c.wire[HEADER.size:]
    with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError):
        hello = DECODER.decode(body)
        if isinstance(hello, m.Hello):
            return c, "welcome" if hello.protocol == m.PROTOCOL_VERSION else "unsupported_version"
    return c, "bad_request"


# -- a fuzzing connection --------------------------------------------------------------------------------------


@dataclass
class Outcome:
    cases: int = 0
    answers: int = 0
    codes: Counter = field(default_factory=Counter)
    labels: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)


class Frames:
    """Frames read from a stream, a buffer at a time."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader, self.buf = reader, bytearray()
        self.dec = m.server_decoder()

    async def next(self) -> msgspec.Struct | None:
        """The next message, or None at EOF."""
        while True:
            if len(self.buf) >= HEADER.size:
                (n,) = HEADER.unpack_from(self.buf)
                if len(self.buf) >= HEADER.size + n:
                    body = bytes(self.buf[HEADER.size: HEADER.size + n])
                    del self.buf[: HEADER.size + n]
                    return self.dec.decode(body)
            chunk = await self.reader.read(1 << 16)
            if not chunk:
                if self.buf:
                    raise ConnectionError(f"{len(self.buf)} bytes of a cut frame before EOF")
                return None
            self.buf += chunk


async def open_raw(sock: str | Path) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_unix_connection(str(sock), limit=1 << 20)


async def fuzz_connection(sock: str | Path, body: list[Case], end: Case | None = None,
                          first: tuple[Case, str] | None = None, timeout: float = 60.0) -> Outcome:
    """One connection: the handshake (a Hello, or `first`), then `body` (reply/silent cases) written at once while
    the answers are read, then `end` (a close/eof case), checking every answer against the cases."""
    out = Outcome()
    reader, writer = await open_raw(sock)
    frames = Frames(reader)
    try:
        async with asyncio.timeout(timeout):
            if first is not None:
                c, want = first
                out.cases += 1
                out.labels[c.label] += 1
                writer.write(c.wire)
                if want == "eof":
                    writer.write_eof()
                if not await _handshake(frames, want, out, c.label):
                    return out
            else:
                writer.write(pack(ENCODER.encode(m.Hello(protocol=m.PROTOCOL_VERSION, client="fuzz"))))
                if not await _handshake(frames, "welcome", out, "hello"):
                    return out
            await _body(frames, writer, body, out)
            if end is not None:
                await _end(frames, writer, end, out)
    except TimeoutError:
        out.violations.append(f"no answer within {timeout:g} s (a hang)")
    except (ConnectionError, msgspec.DecodeError) as e:
        out.violations.append(f"connection broke: {e!r}")
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    return out


async def _handshake(frames: Frames, want: str, out: Outcome, label: str) -> bool:
    msg = await frames.next()
    if want == "welcome":
        if not isinstance(msg, m.Welcome):
            out.violations.append(f"{label}: handshake answered {msg!r}")
            return False
        return True
    if want == "eof":
        if msg is not None:
            out.violations.append(f"{label}: a cut first frame was answered {msg!r}")
        return False
    out.answers += msg is not None
    if not isinstance(msg, m.Error) or msg.code != want:
        out.violations.append(f"{label}: first frame answered {msg!r}, expected an Error {want}")
    elif (after := await frames.next()) is not None:
        out.violations.append(f"{label}: {after!r} after a refused handshake, expected the connection closed")
    if msg is not None:
        out.codes[getattr(msg, "code", type(msg).__name__)] += 1
    return False


async def _body(frames: Frames, writer: asyncio.StreamWriter, body: list[Case], out: Outcome) -> None:
    want: Counter = Counter()
    status_ids: Counter = Counter()
    for c in body:
        assert c.expect in ("reply", "silent"), c
        out.cases += 1
        out.labels[c.label] += 1
        if c.expect == "reply":
            want[c.rid] += 1
            status_ids[c.rid] += c.status
    writer.write(b"".join(c.wire for c in body))
    got: Counter = Counter()
    while sum(got.values()) < sum(want.values()):
        msg = await frames.next()
        if msg is None:
            out.violations.append(f"closed after {sum(got.values())} of {sum(want.values())} answers")
            return
        if isinstance(msg, m.Token):
            continue
        if not isinstance(msg, FINAL):
            out.violations.append(f"unexpected {msg!r}")
            continue
        out.answers += 1
        # A request reusing the id of one still in flight is refused without an id (that id's frames are the running
        # one's): its message names the id.
        dup = isinstance(msg, m.Error) and msg.id is None and DUPLICATE.match(msg.message)
        got[int(dup.group(1)) if dup else msg.id] += 1
        if isinstance(msg, m.Error):
            out.codes[msg.code] += 1
            if msg.code not in REQUEST_CODES:
                out.violations.append(f"answered {msg.code}: {msg.message}")
        else:
            out.codes[type(msg).__name__] += 1
        if isinstance(msg, m.StatusReply):
            status_ids[msg.id] -= 1
    if got != want:
        out.violations.append(f"answers by id {dict(got - want)} unasked, {dict(want - got)} missing")
    if any(v < 0 for v in status_ids.values()):
        out.violations.append("a StatusReply for a request that was not a Status")


async def _end(frames: Frames, writer: asyncio.StreamWriter, end: Case, out: Outcome) -> None:
    out.cases += 1
    out.labels[end.label] += 1
    writer.write(end.wire)
    await writer.drain()
    if end.expect == "eof":
        writer.write_eof()
        if (msg := await frames.next()) is not None:
            out.violations.append(f"{end.label}: answered {msg!r}, expected the connection closed")
        return
    msg = await frames.next()
    if isinstance(msg, m.Error):
        out.answers += 1
        out.codes[msg.code] += 1
    if not isinstance(msg, m.Error) or msg.code != end.code or msg.id is not None:
        out.violations.append(f"{end.label}: answered {msg!r}, expected an Error {end.code}")
    if (after := await frames.next()) is not None:
        out.violations.append(f"{end.label}: {after!r} after the Error, expected the connection closed")


def split(cases: list[Case]) -> tuple[list[Case], list[Case]]:
    """(cases that keep a connection open, cases that end one)."""
    return ([c for c in cases if c.expect in ("reply", "silent")],
            [c for c in cases if c.expect in ("close", "eof", "stall")])


# -- the probe: a valid request on a new connection ------------------------------------------------------------


def probe(sock: str | Path, timeout: float = 30.0) -> str:
    """A greedy 4-token Generate on a new blocking connection: its text (the same every time, when all is well)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(str(sock))
        s.sendall(pack(ENCODER.encode(m.Hello(protocol=m.PROTOCOL_VERSION, client="probe"))))
        s.sendall(pack(ENCODER.encode(m.Generate(id=1, prompt=PROBE_PROMPT, max_tokens=4))))
        dec = m.server_decoder()
        text = []
        while True:
            msg = dec.decode(_recv_frame(s))
            if isinstance(msg, m.Welcome):
                continue
            if isinstance(msg, m.Token):
                text.append(msg.text)
            elif isinstance(msg, m.Done):
                return "".join(text)
            else:
                raise AssertionError(f"the probe was answered {msg!r}")


def _recv_frame(s: socket.socket) -> bytes:
    head = _recv_exactly(s, HEADER.size)
    return _recv_exactly(s, struct.unpack(">I", head)[0])


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the daemon closed the connection")
        buf += chunk
    return bytes(buf)

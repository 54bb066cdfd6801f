"""The protocol fuzzer (tests/protocol_fuzz.py) against a real daemon on a real socket, a few thousand cases.

hypothesis draws messages over the protocol's Structs and a random source for the mutations (wrong types, missing and
unknown fields, unknown kinds, flipped, spliced and cut bytes, bad UTF-8, deep nesting, oversize and cut frames). Each
example is a batch: one connection, plus one per further frame that ends a connection; after it, a valid request on a
new connection must get the answer it got before any fuzzing. `make soak` runs the same cases a million times over.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest
from daemon_util import start_daemon, stop_daemon
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from protocol_fuzz import (
    DICT_MUTATIONS,
    Case,
    Outcome,
    case,
    expect,
    fuzz_connection,
    handshake_case,
    messages,
    probe,
    split,
)

from m31r_protocol import messages as m

pytestmark = pytest.mark.timeout(120)
EXAMPLES = 100


@pytest.fixture(scope="module")
def daemon(tiny_bundle, tmp_path_factory):
    sock = tmp_path_factory.mktemp("fuzz") / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--read-timeout", "2")
    yield proc, sock
    stop_daemon(proc)


async def one_batch(sock, cases: list[Case], first: tuple[Case, str] | None) -> list[Outcome]:
    """All the frames that keep a connection open on one connection, ended by one that ends it; each further ending
    frame (and a fuzzed first frame) on a connection of its own; the connections at once."""
    body, ends = split(cases)
    plan = [(body, ends[0] if ends else None, None)] + [([], end, None) for end in ends[1:]]
    if first is not None:
        plan.append(([], None, first))
    return await asyncio.gather(*(fuzz_connection(sock, *p, timeout=30) for p in plan))


def test_fuzz_protocol(daemon):
    proc, sock = daemon
    reference = probe(sock)
    total = Outcome()

    # No shrinking: against a live daemon (busy, cache, timing) a failure does not replay exactly, and shrinking
    # one took minutes. The failing example's violations say what went wrong.
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.lists(messages, min_size=2, max_size=12), st.randoms(use_true_random=False), st.integers(0, 9))
    def one(msgs: list[m.Hello], rnd: random.Random, handshake: int) -> None:
        # Four cases per message: drawing messages is what costs (a few ms each on a busy machine), not mutating.
        cases = [c for c in (case(msg, rnd) for msg in msgs for _ in range(4)) if c is not None]
        first = handshake_case(msgs[0], rnd) if handshake == 0 else None
        for out in asyncio.run(one_batch(sock, cases, first)):
            total.cases += out.cases
            total.answers += out.answers
            total.codes.update(out.codes)
            total.labels.update(out.labels)
            assert not out.violations, (out.violations, sorted(out.labels))
        assert proc.poll() is None, "the daemon died"
        assert probe(sock) == reference, "a valid request on a new connection got another answer"

    one()
    assert proc.poll() is None
    # The mix covered what it claims to: every mutation, the framing cases, and plenty of frames.
    assert total.cases >= 2000, total
    assert {f.__name__ for f in DICT_MUTATIONS} <= set(total.labels), total.labels
    assert {"oversize_prefix", "truncated_frame", "generate", "fim", "flip_bytes"} <= set(total.labels)
    assert total.codes["bad_request"] > 500 and total.codes["frame_too_large"] > 0 and total.codes["Done"] > 0
    errors = [line for line in proc.log_lines if json.loads(line)["level"] not in ("info", "debug")]
    assert not errors, errors[:5]


def test_expect_classifies_as_the_daemon_decodes():
    """The classifier behind every case: what the daemon's decoder refuses, closes on, or serves."""
    import msgspec

    assert expect(msgspec.msgpack.encode({"type": "status", "id": 3}), "x").status
    assert expect(msgspec.msgpack.encode({"type": "shutdown", "id": 3}), "x") is None  # never sent: it stops the daemon
    bad = expect(msgspec.msgpack.encode({"type": "generate", "id": 9, "prompt": 5}), "x")
    assert bad is not None and (bad.expect, bad.rid) == ("reply", 9)
    assert expect(msgspec.msgpack.encode({"type": "cancel", "id": 1}), "x").expect == "silent"
    assert expect(b"\xc1", "x").code == "bad_request"  # 0xc1 is never valid MessagePack
    assert expect(msgspec.msgpack.encode({"type": "status", "id": 3}) + b"\x00", "x").expect == "close"


async def test_a_boolean_id_is_not_echoed_back(daemon):
    """Found by the fuzzer: a request with `id: true` failed validation and the daemon answered Error(id=True). True is
    a Python int, but not one on the wire: every client's decoder refused the frame and dropped the connection."""
    import msgspec
    from protocol_fuzz import Frames, open_raw

    from m31r_protocol.framing import pack

    _, sock = daemon
    reader, writer = await open_raw(sock)
    frames = Frames(reader)
    writer.write(pack(msgspec.msgpack.encode({"type": "hello", "protocol": m.PROTOCOL_VERSION})))
    assert isinstance(await frames.next(), m.Welcome)
    for rid in (True, False):
        writer.write(pack(msgspec.msgpack.encode({"type": "generate", "id": rid, "prompt": "fn"})))
        err = await frames.next()  # decoded as every client decodes it: a bool id would raise here
        assert isinstance(err, m.Error) and err.code == "bad_request" and err.id is None, err
    writer.write(pack(msgspec.msgpack.encode({"type": "status", "id": 7})))
    assert isinstance(reply := await frames.next(), m.StatusReply) and reply.id == 7  # the connection still serves
    writer.close()

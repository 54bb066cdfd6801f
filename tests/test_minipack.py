"""The stdlib MessagePack codec of the status fast path against msgspec, the codec of everything else."""

from __future__ import annotations

import math
import random

import msgspec
import pytest

from m31r_protocol import messages as m
from m31r_protocol.minipack import packb, unpackb

INT_EDGES = [0, 1, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1,
             -1, -32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)]


def _values(rng: random.Random, depth: int = 0) -> object:
    kind = rng.choice(["int", "float", "str", "bytes", "none", "bool"] + (["list", "dict"] if depth < 3 else []))
    if kind == "int":
        return rng.choice(INT_EDGES + [rng.randint(-(2**63), 2**64 - 1)])
    if kind == "float":
        return rng.choice([0.0, -0.0, 1.5, -2.25e300, math.inf, rng.uniform(-1e6, 1e6)])
    if kind == "str":
        return "".join(rng.choices("aé€🦀\n\"\\", k=rng.choice([0, 1, 31, 32, 255, 256, 70_000])))
    if kind == "bytes":
        return rng.randbytes(rng.choice([0, 1, 255, 256, 70_000]))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    n = rng.choice([0, 1, 15, 16, 70])
    if kind == "list":
        return [_values(rng, depth + 1) for _ in range(n)]
    return {f"k{i}": _values(rng, depth + 1) for i in range(n)}


@pytest.mark.parametrize("seed", range(40))
def test_round_trips_and_agrees_with_msgspec_both_ways(seed: int) -> None:
    value = _values(random.Random(seed))
    ours = packb(value)
    assert msgspec.msgpack.decode(ours) == value  # msgspec reads what minipack writes
    assert unpackb(msgspec.msgpack.encode(value)) == value  # and minipack reads what msgspec writes
    assert unpackb(ours) == value


def test_every_integer_edge_uses_a_format_msgspec_reads() -> None:
    for n in INT_EDGES:
        assert msgspec.msgpack.decode(packb(n)) == n and unpackb(msgspec.msgpack.encode(n)) == n
    with pytest.raises(ValueError, match="does not fit"):
        packb(2**64)
    with pytest.raises(ValueError, match="does not fit"):
        packb(-(2**63) - 1)


def test_protocol_messages_cross_the_two_codecs() -> None:
    """The fast path's Hello/Status decode as the daemon's typed Structs; a StatusReply reads back as its fields."""
    dec = m.client_decoder()
    assert dec.decode(packb({"type": "hello", "protocol": m.PROTOCOL_VERSION, "client": "x"})) == m.Hello(
        protocol=m.PROTOCOL_VERSION, client="x")
    assert dec.decode(packb({"type": "status", "id": 1})) == m.Status(id=1)
    reply = m.StatusReply(id=1, model="m@1", fingerprint="f", bundle="/b", device="cpu", dtype="bfloat16", pid=7,
                          uptime_s=1.5, queue=0, active=1, requests=3, cache_slots=4, cache_slots_used=1,
                          cache_mb=12.5, cache_budget_mb=1536.0, cache_hit_rate=0.9, rss_mb=600.0, quant="int8")
    assert unpackb(m.encoder().encode(reply)) == {"type": "status_reply", **msgspec.to_builtins(reply)}


@pytest.mark.parametrize("data, match", [
    (b"", "truncated"), (b"\xa5ab", "truncated"), (b"\xcd\x01", "truncated"), (b"\x81\xa1k", "truncated"),
    (b"\x01\x02", "trailing"), (b"\xd4\x01\x02", "unsupported"), (b"\xc1", "unsupported"),
    (b"\x81\x90\x01", "unhashable"),
])
def test_malformed_input_is_a_value_error(data: bytes, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        unpackb(data)


def test_invalid_utf8_and_unknown_types_are_refused() -> None:
    with pytest.raises(UnicodeDecodeError):
        unpackb(b"\xa2\xff\xfe")
    with pytest.raises(TypeError, match="cannot encode set"):
        packb({1, 2})

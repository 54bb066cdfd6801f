"""A small MessagePack codec in the standard library, for the one client that must start in a few milliseconds.

`m31r status` is a new process per call, and importing msgspec costs it ~18 ms of its ~45 ms. This codec covers
what the protocol's messages contain (nil, bool, int, float, str, bin, array, map; no extension types) and is
tested against msgspec both ways. Everything else speaks msgspec through the typed Structs.
"""

from __future__ import annotations

import struct
from typing import Any

_B, _H, _I, _Q = struct.Struct(">B"), struct.Struct(">H"), struct.Struct(">I"), struct.Struct(">Q")
_b, _h, _i, _q = struct.Struct(">b"), struct.Struct(">h"), struct.Struct(">i"), struct.Struct(">q")
_f, _d = struct.Struct(">f"), struct.Struct(">d")
_SIMPLE = {0xC0: None, 0xC2: False, 0xC3: True}
_NUMBERS = {0xCA: _f, 0xCB: _d, 0xCC: _B, 0xCD: _H, 0xCE: _I, 0xCF: _Q, 0xD0: _b, 0xD1: _h, 0xD2: _i, 0xD3: _q}
# bin 8/16/32, str 8/16/32, array 16/32, map 16/32: the struct of the length that follows the type byte
_LENGTHS = {0xC4: _B, 0xC5: _H, 0xC6: _I, 0xD9: _B, 0xDA: _H, 0xDB: _I, 0xDC: _H, 0xDD: _I, 0xDE: _H, 0xDF: _I}
# Arrays and maps nested deeper than this are refused (ValueError): a message nests 3 deep, and a frame of nested
# one-byte arrays would otherwise end in RecursionError, which the callers do not expect (`m31r status` falls back
# to the full client on ValueError and OSError, and printed a traceback).
MAX_DEPTH = 100


def packb(obj: Any) -> bytes:
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(obj: Any, out: bytearray) -> None:
    if obj is None:
        out.append(0xC0)
    elif obj is True or obj is False:
        out.append(0xC3 if obj else 0xC2)
    elif isinstance(obj, int):
        _pack_int(obj, out)
    elif isinstance(obj, float):
        out.append(0xCB)
        out += _d.pack(obj)
    elif isinstance(obj, str):
        data = obj.encode()
        _header(len(data), out, 0xA0, 31, (0xD9, 0xDA, 0xDB))
        out += data
    elif isinstance(obj, bytes | bytearray):
        _header(len(obj), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += obj
    elif isinstance(obj, list | tuple):
        _header(len(obj), out, 0x90, 15, (None, 0xDC, 0xDD))
        for item in obj:
            _pack(item, out)
    elif isinstance(obj, dict):
        _header(len(obj), out, 0x80, 15, (None, 0xDE, 0xDF))
        for key, value in obj.items():
            _pack(key, out)
            _pack(value, out)
    else:
        raise TypeError(f"cannot encode {type(obj).__name__} as MessagePack")


def _header(n: int, out: bytearray, fix: int | None, fix_max: int, codes: tuple[int | None, int, int]) -> None:
    """A length header: the fix format when it fits, else the 8-, 16- or 32-bit length form."""
    if fix is not None and n <= fix_max:
        out.append(fix | n)
    elif codes[0] is not None and n < 1 << 8:
        out += bytes((codes[0], n))
    elif n < 1 << 16:
        out.append(codes[1])
        out += _H.pack(n)
    elif n < 1 << 32:
        out.append(codes[2])
        out += _I.pack(n)
    else:
        raise ValueError(f"length {n} does not fit MessagePack")


def _pack_int(n: int, out: bytearray) -> None:
    if 0 <= n < 128 or -32 <= n < 0:
        out += _b.pack(n) if n < 0 else _B.pack(n)
    elif n >= 0:
        for code, fmt, top in ((0xCC, _B, 1 << 8), (0xCD, _H, 1 << 16), (0xCE, _I, 1 << 32), (0xCF, _Q, 1 << 64)):
            if n < top:
                out.append(code)
                out += fmt.pack(n)
                return
        raise ValueError(f"integer {n} does not fit MessagePack")
    else:
        for code, fmt, bits in ((0xD0, _b, 7), (0xD1, _h, 15), (0xD2, _i, 31), (0xD3, _q, 63)):
            if n >= -(1 << bits):
                out.append(code)
                out += fmt.pack(n)
                return
        raise ValueError(f"integer {n} does not fit MessagePack")


class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = memoryview(data), 0

    def take(self, n: int) -> memoryview:
        end = self.pos + n
        if end > len(self.data):
            raise ValueError("truncated MessagePack data")
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: struct.Struct) -> Any:
        return fmt.unpack(self.take(fmt.size))[0]


def unpackb(data: bytes) -> Any:
    """The value `data` holds; ValueError (UnicodeDecodeError for invalid UTF-8) for anything else."""
    reader = _Reader(data)
    obj = _unpack(reader, 0)
    if reader.pos != len(reader.data):
        raise ValueError("trailing bytes after a MessagePack object")
    return obj


def _unpack(r: _Reader, depth: int) -> Any:
    code = r.unpack(_B)
    if code <= 0x7F:
        return code
    if code >= 0xE0:
        return code - 0x100
    if 0x80 <= code <= 0x9F or code in (0xDC, 0xDD, 0xDE, 0xDF):
        if depth >= MAX_DEPTH:
            raise ValueError(f"MessagePack arrays or maps nested more than {MAX_DEPTH} deep")
        depth += 1
    if 0x80 <= code <= 0x8F:
        return _map(r, code & 0x0F, depth)
    if 0x90 <= code <= 0x9F:
        return [_unpack(r, depth) for _ in range(code & 0x0F)]
    if 0xA0 <= code <= 0xBF:
        return str(r.take(code & 0x1F), "utf-8")
    if code in _SIMPLE:
        return _SIMPLE[code]
    if code in _NUMBERS:
        return r.unpack(_NUMBERS[code])
    if code not in _LENGTHS:
        raise ValueError(f"unsupported MessagePack type 0x{code:02x}")
    n = r.unpack(_LENGTHS[code])
    if code <= 0xC6:
        return bytes(r.take(n))
    if code <= 0xDB:
        return str(r.take(n), "utf-8")
    if code <= 0xDD:
        return [_unpack(r, depth) for _ in range(n)]
    return _map(r, n, depth)


def _map(r: _Reader, n: int, depth: int) -> dict:
    out = {}
    for _ in range(n):
        key = _unpack(r, depth)
        if isinstance(key, list | dict):
            raise ValueError("unhashable MessagePack map key")
        out[key] = _unpack(r, depth)
    return out

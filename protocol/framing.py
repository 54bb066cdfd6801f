"""Length-prefixed frames: a 4-byte big-endian body length, then one MessagePack message.

The length is checked before the body is read, so an oversize frame costs the reader nothing.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from m31r_protocol.limits import MAX_FRAME_BYTES

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable
    from contextlib import AbstractContextManager

HEADER = struct.Struct(">I")


class FrameTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, limit
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")


def pack(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


class FrameTimeout(Exception):
    def __init__(self, timeout: float):
        self.timeout = timeout
        super().__init__(f"a frame began to arrive but was not complete after {timeout:g} s")


class FrameNotBegun(Exception):
    def __init__(self, timeout: float):
        self.timeout = timeout
        super().__init__(f"no frame began within {timeout:g} s")


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES, timeout: float | None = None, *,
                     begin_within: float | None = None,
                     reserve: Callable[[int], AbstractContextManager[object]] | None = None) -> bytes | None:
    """The next frame's body, or None at a clean end of stream (EOF between frames).

    Raises asyncio.IncompleteReadError on a frame cut short, FrameTooLarge before reading an oversize body, and
    FrameTimeout when `timeout` seconds pass between a frame's first byte and its last. Waiting for a first byte
    has no limit unless `begin_within` sets one (FrameNotBegun past it): an idle connection between frames is fine,
    a half-sent frame is not. `reserve(size)`, where given, is held while the body arrives (a reader's bound on the
    bytes it buffers for all its connections: it may raise to refuse the body unread).
    """
    import asyncio  # here, not at the top: the blocking client must not pay for importing asyncio

    try:
        async with asyncio.timeout(begin_within):
            first = await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None
    except TimeoutError:
        if begin_within is None:  # the connection's own (ETIMEDOUT), not a frame that did not begin
            raise
        raise FrameNotBegun(begin_within) from None
    try:
        async with asyncio.timeout(timeout):
            head = first + await reader.readexactly(HEADER.size - 1)
            (size,) = HEADER.unpack(head)
            if size > limit:
                raise FrameTooLarge(size, limit)
            if reserve is None:
                return await reader.readexactly(size)
            with reserve(size):
                return await reader.readexactly(size)
    except TimeoutError:
        if timeout is None:
            raise
        raise FrameTimeout(timeout) from None

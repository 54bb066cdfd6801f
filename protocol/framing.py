"""Length-prefixed frames: a 4-byte big-endian body length, then one MessagePack message.

The length is checked before the body is read, so an oversize frame costs the reader nothing.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

from m31r_protocol.limits import MAX_FRAME_BYTES

if TYPE_CHECKING:
    import asyncio

HEADER = struct.Struct(">I")


class FrameTooLarge(Exception):
    def __init__(self, size: int, limit: int):
        self.size, self.limit = size, limit
        super().__init__(f"frame of {size} bytes exceeds the {limit}-byte limit")


def pack(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


async def read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME_BYTES) -> bytes | None:
    """The next frame's body, or None at a clean end of stream (EOF between frames).

    Raises asyncio.IncompleteReadError on a frame cut short, FrameTooLarge before reading an oversize body.
    """
    import asyncio  # here, not at the top: the blocking client must not pay for importing asyncio

    try:
        head = await reader.readexactly(HEADER.size)
    except asyncio.IncompleteReadError as e:
        if not e.partial:
            return None
        raise
    (size,) = HEADER.unpack(head)
    if size > limit:
        raise FrameTooLarge(size, limit)
    return await reader.readexactly(size)

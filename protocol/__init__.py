"""m31rd's socket protocol: messages, framing and the async client. Importing this never imports torch.

The client's names load on first use (PEP 562), so `m31r_protocol.messages` and `m31r_protocol.blocking` can be
imported without asyncio: `m31r status` answers in a few tens of milliseconds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from m31r_protocol.client import Client, DaemonError, DaemonUnavailable, Stream, connect_or_start
    from m31r_protocol.messages import PROTOCOL_VERSION, Sampling

__all__ = ["PROTOCOL_VERSION", "Client", "DaemonError", "DaemonUnavailable", "Sampling", "Stream", "connect_or_start"]


def __getattr__(name: str) -> Any:
    if name in ("PROTOCOL_VERSION", "Sampling"):
        from m31r_protocol import messages

        return getattr(messages, name)
    if name in __all__:
        from m31r_protocol import client

        return getattr(client, name)
    raise AttributeError(f"module 'm31r_protocol' has no attribute {name!r}")

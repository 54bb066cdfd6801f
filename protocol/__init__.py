"""m31rd's socket protocol: messages, framing and the async client. Importing this never imports torch."""

from m31r_protocol.client import Client, DaemonError, DaemonUnavailable, Stream, connect_or_start
from m31r_protocol.messages import PROTOCOL_VERSION, Sampling

__all__ = ["PROTOCOL_VERSION", "Client", "DaemonError", "DaemonUnavailable", "Sampling", "Stream", "connect_or_start"]

"""The protocol's version and frame limit, importable without msgspec (the blocking status client needs them)."""

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 8 * 1024 * 1024  # a whole large source file fits; anything bigger is refused unread

"""Generate protocol/schema.json from the message Structs: `python -m m31r_protocol.schema [--check]`."""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import msgspec

from m31r_protocol.messages import MAX_FRAME_BYTES, PROTOCOL_VERSION, ClientMessage, ServerMessage

SCHEMA_PATH = Path(__file__).with_name("schema.json")


def _cleaned(node: object) -> object:
    """`node` with each description's docstring indentation removed, as msgspec 0.23 does itself and 0.22 did not:
    the schema is the same text whichever msgspec is installed (`--check` failed on a fresh install of 0.23)."""
    if isinstance(node, dict):
        return {k: inspect.cleandoc(v) if k == "description" and isinstance(v, str) else _cleaned(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_cleaned(v) for v in node]
    return node


def build_schema() -> dict:
    (client, server), components = msgspec.json.schema_components([ClientMessage, ServerMessage])
    client, server, components = _cleaned(client), _cleaned(server), _cleaned(components)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"m31rd socket protocol v{PROTOCOL_VERSION}",
        "description": (
            "Each frame is a 4-byte big-endian length followed by one MessagePack-encoded message, at most "
            f"{MAX_FRAME_BYTES} bytes. Clients send ClientMessage; the daemon answers with ServerMessage."
        ),
        "protocol_version": PROTOCOL_VERSION,
        "max_frame_bytes": MAX_FRAME_BYTES,
        "ClientMessage": client,
        "ServerMessage": server,
        "$defs": components,
    }


def render() -> str:
    return json.dumps(build_schema(), indent=2, sort_keys=True) + "\n"


def main() -> int:
    text = render()
    if "--check" in sys.argv:
        if SCHEMA_PATH.read_text() != text:
            print(f"{SCHEMA_PATH} is out of date: run python -m m31r_protocol.schema", file=sys.stderr)
            return 1
        return 0
    SCHEMA_PATH.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

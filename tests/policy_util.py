"""The tests' shorthand for the completion policy: a document with its cursor marked, and what accepting gives."""

from __future__ import annotations

from m31r_protocol import policy
from m31r_protocol.policy import Options


def accept(doc: str, raw: str, ended_line: bool = False) -> str | None:
    """The document once the suggestion for `raw` at █ is accepted, or None where nothing is shown."""
    offset = doc.index("█")
    text = doc.replace("█", "")
    s = policy.postprocess(policy.plan(text, offset, Options()), raw, ended_line)
    return None if s is None else text[: s.start] + s.text + text[s.end :]

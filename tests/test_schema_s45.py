"""protocol/schema.json is the same text whichever msgspec is installed: msgspec 0.23 strips a docstring's
indentation from the descriptions it writes, 0.22 did not, and a fresh install of 0.23 failed `--check` (CI's lint)."""

from __future__ import annotations

import json

from m31r_protocol.schema import SCHEMA_PATH, build_schema, render


def _descriptions(node: object) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "description" and isinstance(v, str)] + [
            d for v in node.values() for d in _descriptions(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descriptions(v)]
    return []


def test_descriptions_carry_no_docstring_indentation():
    found = _descriptions(build_schema())
    assert len(found) >= 5
    assert not [d for d in found if "\n " in d or d != d.strip()], "a description keeps its docstring's indentation"


def test_the_committed_schema_is_the_generated_one():
    assert SCHEMA_PATH.read_text() == render()
    assert json.loads(render())["$defs"]["TokenChoice"]["description"].startswith("A token the model could write")

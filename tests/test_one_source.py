"""Things written once, or kept identical where they must exist twice.

The service templates ship twice: m31rd/units/ (what `m31r service install` reads, packaged with m31rd) and
configs/systemd/ + configs/launchd/ (where README "Running as a service" points people). They must stay byte-identical;
edit both, or copy one over the other."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "m31rd" / "units"
CONFIGS = [REPO / "configs" / "systemd", REPO / "configs" / "launchd"]


def test_configs_and_packaged_units_are_the_same_files() -> None:
    configs = {p.name: p for folder in CONFIGS for p in sorted(folder.iterdir()) if p.is_file()}
    units = {p.name: p for p in sorted(UNITS.iterdir()) if p.is_file()}
    assert sorted(configs) == sorted(units)
    differ = [name for name in units if units[name].read_bytes() != configs[name].read_bytes()]
    assert not differ, f"configs/ and m31rd/units/ differ in {differ}: copy one over the other"


def test_one_version() -> None:
    """pyproject.toml's version is the only one: the daemon's Welcome, the LSP server and the HTTP adapter read it
    through m31r_protocol.version."""
    from m31r_protocol.version import VERSION

    assert importlib.metadata.version("m31r") == VERSION
    hard_coded = [str(p.relative_to(REPO)) for folder in ("m31r", "m31rd", "protocol", "lsp", "httpd")
                  for p in (REPO / folder).rglob("*.py") if re.search(r'^VERSION = "', p.read_text(), re.M)]
    assert hard_coded == []

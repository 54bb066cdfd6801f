"""Things written once."""

from __future__ import annotations

import importlib.metadata
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_the_service_templates_have_one_copy() -> None:
    """m31rd/units/ (package data, what `m31r service install` reads) is the only place the unit templates live:
    copies elsewhere in the repository drift."""
    names = {p.name for p in (REPO / "m31rd" / "units").iterdir() if p.is_file()}
    assert names == {"m31rd.service", "m31rd.socket", "dev.m31r.m31rd.plist"}
    git = shutil.which("git")
    tracked = git and subprocess.run([git, "ls-files"], cwd=REPO, capture_output=True, text=True).stdout.split()
    if not tracked:
        pytest.skip("not a git checkout")
    copies = [p for p in tracked if Path(p).name in names and not p.startswith("m31rd/units/")]
    assert copies == []


def test_one_version() -> None:
    """pyproject.toml's version is the only one: the daemon's Welcome, the LSP server and the HTTP adapter read it
    through m31r_protocol.version."""
    from m31r_protocol.version import VERSION

    assert importlib.metadata.version("m31r") == VERSION
    hard_coded = [str(p.relative_to(REPO)) for folder in ("m31r", "m31rd", "protocol", "lsp", "httpd")
                  for p in (REPO / folder).rglob("*.py") if re.search(r'^VERSION = "', p.read_text(), re.M)]
    assert hard_coded == []

"""Loading benchmarks/ scripts in tests, as they import each other (by bare name), and the rustc they may need."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUSTC = shutil.which("rustc")
needs_rustc = pytest.mark.skipif(RUSTC is None, reason="rustc is not installed (apt-get install rustc)")


def load(monkeypatch: pytest.MonkeyPatch, name: str):
    """benchmarks/NAME.py, loaded as its scripts import each other (by bare name)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod

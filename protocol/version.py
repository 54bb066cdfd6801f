"""The installed m31r's version, from its one source (pyproject.toml): the daemon's Welcome, the LSP server and the
HTTP adapter all report this."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("m31r")
except PackageNotFoundError:  # running from a source tree that was never installed
    VERSION = "0.0.0"

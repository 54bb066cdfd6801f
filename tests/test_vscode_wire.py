"""The VS Code extension's wire test (plain Node + vscode-jsonrpc) against the real `m31r lsp` and daemon.

`make test` installs the extension's node_modules (`npm ci`) before pytest runs; without Node or them this
test is skipped with the reason.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXT = Path(__file__).resolve().parent.parent / "editors" / "vscode"


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
@pytest.mark.skipif(not (EXT / "node_modules" / "vscode-jsonrpc").is_dir(),
                    reason="editors/vscode/node_modules missing: run `npm ci` there (make test does)")
def test_vscode_wire_protocol_against_real_server(shared_daemon) -> None:
    daemon, sock = shared_daemon
    seen = len(daemon.log_lines)  # the shared daemon's log so far: other tests' requests
    cmd = [sys.executable, "-m", "m31r.cli", "lsp", "--socket", str(sock), "--no-autostart"]
    env = {**os.environ, "M31R_LSP_CMD": json.dumps(cmd), "M31R_LSP_TIMEOUT_MS": "30000"}
    r = subprocess.run(["node", "--test", "test/wire.test.mjs"], cwd=EXT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "# pass 4" in r.stdout and "# skipped 0" in r.stdout and "# fail 0" in r.stdout, r.stdout[-2000:]

    # The daemon really served the editor's requests (its log line comes just after the answer).
    def served() -> bool:
        return any('"kind": "fim"' in line for line in daemon.log_lines[seen:])

    t0 = time.monotonic()
    while not served() and time.monotonic() - t0 < 5:
        time.sleep(0.05)
    assert served(), "".join(daemon.log_lines[seen:])[-2000:]

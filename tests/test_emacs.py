"""A real Emacs drives `m31r lsp`: editors/emacs's ERT suite, batch mode, eglot against the real daemon.

Emacs and eglot come from Debian (`apt-get install emacs-nox elpa-eglot`; .ci/run installs them); the test skips
only when there is no `emacs` on PATH. The suite checks m31r.el's settings, mode line and eglot registration, and
its round trip starts the language server through eglot, asks for an inline completion at a cursor, toggles
completions off and on, and shuts the server down. Through eglot it also accepts a completion with
`completion-at-point` and takes it back with one `undo`, and checks what the user sees with no m31r program, with no
daemon on the socket, and in a 2 MB file.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EMACS = shutil.which("emacs")
REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.skipif(EMACS is None, reason="emacs is not installed (apt-get install emacs-nox elpa-eglot)"),
              pytest.mark.timeout(180)]


def test_emacs_suite_with_eglot_against_the_server(shared_daemon):
    sock = shared_daemon[1]
    cmd = f"{sys.executable} -m m31r_lsp --no-autostart --socket {sock}"
    r = subprocess.run([EMACS, "-batch", "-L", "editors/emacs", "-l", "editors/emacs/m31r-tests.el",
                        "-f", "ert-run-tests-batch-and-exit"], cwd=REPO, env={**os.environ, "M31R_LSP_CMD": cmd},
                       capture_output=True, text=True, timeout=170)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    ran = re.search(r"Ran (\d+) tests, (\d+) results as expected, 0 unexpected", out)
    assert ran and ran.group(1) == ran.group(2) and int(ran.group(1)) >= 7, out[-4000:]
    assert "skipped" not in out[ran.start():], out[-4000:]  # eglot present and the round trip ran
    for name in ("m31r-eglot-roundtrip", "m31r-eglot-accept-then-undo", "m31r-eglot-missing-program-says-so",
                 "m31r-eglot-no-daemon-says-so-once", "m31r-eglot-large-file",
                 "m31r-eglot-rust-modes-open-as-rust"):
        assert re.search(rf"passed\s+\d+/\d+\s+{name}\b", out), out[-4000:]


def test_m31r_el_byte_compiles_without_warnings(tmp_path):
    """What editors/emacs/README.md promises: warnings are errors here (a copy, so no .elc lands in the repo)."""
    shutil.copy(REPO / "editors" / "emacs" / "m31r.el", tmp_path)
    r = subprocess.run([EMACS, "-batch", "-L", str(tmp_path), "--eval", "(setq byte-compile-error-on-warn t)",
                        "-f", "batch-byte-compile", str(tmp_path / "m31r.el")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and (tmp_path / "m31r.elc").exists(), r.stdout + r.stderr

"""`m31r daemon --log-file`: the JSON log lines go to a file the daemon rotates itself (FILE.1 past
LOG_FILE_BYTES), which the launchd agent relies on, since nothing on macOS rotates a user agent's log."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon

from m31r_protocol import logs


def test_the_log_file_is_rotated_past_its_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logs, "LOG_FILE_BYTES", 2000)
    f = tmp_path / "logs" / "m31rd.log"  # its folder is made
    logs.log_json(["m31r-test-rotation"], "info", f)
    log = logging.getLogger("m31r-test-rotation")
    try:
        for i in range(100):  # ~80 bytes a line: several times the limit
            log.info("request", extra={"fields": {"id": i}})
    finally:
        for h in log.handlers:
            h.close()
        log.handlers.clear()
    now, old = f.read_text().splitlines(), f.with_name("m31rd.log.1").read_text().splitlines()
    assert f.stat().st_size <= 2000 and f.with_name("m31rd.log.1").stat().st_size <= 2000
    assert not f.with_name("m31rd.log.2").exists()  # one older copy, no more
    ids = [json.loads(line)["id"] for line in old + now]
    assert ids == list(range(ids[0], 100))  # the newest lines, in order, none lost between the two files


def test_the_daemon_writes_its_log_to_the_file(tiny_bundle, tmp_path: Path) -> None:
    f = tmp_path / "m31rd.log"
    proc = start_daemon(tiny_bundle.path, tmp_path / "d.sock", "--log-file", str(f))
    try:
        lines = [json.loads(line) for line in f.read_text().splitlines()]
        assert lines and all({"ts", "level", "msg"} <= set(x) for x in lines)
        assert {"warm", "ready"} <= {x["msg"] for x in lines}, lines
    finally:
        assert stop_daemon(proc) == 0
    assert json.loads(f.read_text().splitlines()[-1])["msg"] == "stopped"
    assert proc.log_lines == []  # nothing on stderr


def test_a_log_file_that_cannot_be_written_is_one_line(tiny_bundle, tmp_path: Path) -> None:
    """A --log-file whose folder cannot be made (a file in its place; a read-only disk alike) was a traceback from
    the logging module; now one line names the folder, before any socket exists."""
    import subprocess
    import sys

    (tmp_path / "afile").write_text("")
    log = tmp_path / "afile" / "logs" / "m31rd.log"
    sock = tmp_path / "run" / "d.sock"
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(tiny_bundle.path), "--socket",
                           str(sock), "--log-file", str(log)], capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (1, f"m31rd: cannot write the log file {log}: {tmp_path / 'afile'} is "
                                                 f"not a folder; choose another --log-file\n")
    assert not sock.parent.exists()

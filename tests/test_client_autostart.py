"""A client's autostart that fails, and a daemon whose model fails to load, against the real daemon: what the front
ends are told (the reason, once, and only this start's; an error code that says the daemon is going away)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_service import GATED_TORCH  # the daemon with `import torch` held until a file exists

from m31r_protocol import DaemonError, DaemonUnavailable
from m31r_protocol.client import Client, connect_or_start, daemon_log_path

REPO = Path(__file__).resolve().parents[1]


async def test_a_failed_autostart_says_its_own_reason_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every autostarted daemon appends to one log. A start that dies quotes its own `m31rd:` line, once (not with
    the JSON log line that says the same before it), and never an earlier daemon's lines: a bundle missing
    tokenizer.json once read as the previous start's reason."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    sock = tmp_path / "run" / "m31rd.sock"
    earlier = tmp_path / "no-such-bundle"
    with pytest.raises(DaemonUnavailable, match="not a bundle directory"):
        await connect_or_start(sock, daemon_args=["--bundle", str(earlier)], timeout=60)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    for name in ("model.safetensors", "config.yaml", "metadata.json", "checksum.txt"):
        (bundle / name).write_text("")
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(sock, daemon_args=["--bundle", str(bundle)], timeout=60)
    said = str(info.value)
    assert said.startswith(f"the daemon exited with code 1: cannot load the model: {bundle / 'tokenizer.json'}: "
                           "missing from the bundle: restore the bundle"), said
    assert said.count("missing from the bundle") == 1 and "{" not in said and str(earlier) not in said, said
    assert str(earlier) in daemon_log_path().read_text()  # the earlier start's lines are in the log, unquoted


async def test_a_failed_autostart_reads_its_reason_after_the_log_is_moved(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Another client's start may move a grown log to LOG.1 while this start's daemon runs (rotate_log): what the
    daemon wrote is then in LOG.1, and is still its reason (it once read as '(it wrote nothing to its log)')."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    log = daemon_log_path()
    moves = (f"import os, sys; os.replace({str(log)!r}, {str(log)!r} + '.1'); "
             "print('m31rd: cannot listen: the reason'); sys.exit(1)")
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(tmp_path / "run" / "d.sock", daemon_command=[sys.executable, "-c", moves], timeout=30)
    assert str(info.value) == "the daemon exited with code 1: cannot listen: the reason"


async def _connect_when_listening(sock: Path, proc: subprocess.Popen, timeout: float = 30.0) -> Client:
    t0 = time.monotonic()
    while True:
        with contextlib.suppress(DaemonUnavailable):
            return await Client.connect(sock)
        assert proc.poll() is None and time.monotonic() - t0 < timeout, "the daemon never listened"
        await asyncio.sleep(0.05)


def test_requests_waiting_for_a_model_that_cannot_load_end_shutting_down(corrupt_bundle: Path,
                                                                         tmp_path: Path) -> None:
    """A request sent while the model loads waits for it; when the bundle fails to load (here a checksum
    mismatch), the daemon stops: the request ends with `shutting_down` and the reason, not `internal` (a bug, after
    which the daemon would keep serving), which front ends showed as `error: internal: cannot load the model`."""
    sock, gate, err = tmp_path / "run" / "m31rd.sock", tmp_path / "gate", tmp_path / "daemon.err"
    cmd = [sys.executable, "-c", GATED_TORCH, str(gate), "daemon", "--bundle", str(corrupt_bundle), "--socket",
           str(sock), "--threads", "1"]
    with err.open("w") as f:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})

    async def session() -> DaemonError:
        async with await _connect_when_listening(sock, proc) as c:
            stream = await c.generate("fn main() {", max_tokens=4)
            while (await c.status()).queue < 1:  # the request waits for the model
                await asyncio.sleep(0.02)
            gate.touch()
            with pytest.raises(DaemonError) as info:
                await asyncio.wait_for(stream.collect(), 60)
            return info.value

    try:
        error = asyncio.run(session())
    finally:
        gate.touch()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
        proc.kill()
    assert error.code == "shutting_down", error
    assert error.message.startswith("cannot load the model: ") and "checksum mismatch" in error.message, error
    assert proc.returncode == 1 and not sock.exists(), err.read_text()


async def test_front_ends_name_the_socket_they_cannot_reach(tmp_path: Path) -> None:
    """The LSP and HTTP front ends share DaemonLink: a socket whose folder is a file is said with its path and the
    way out (once bare `[Errno 20] Not a directory`), and no daemon is started for it (none could listen there)."""
    from m31r_protocol.reconnect import DaemonLink, Unavailable, link_config

    (tmp_path / "afile").write_text("")
    sock, started = tmp_path / "afile" / "m31rd.sock", tmp_path / "started"
    marker = [sys.executable, "-c", f"open({str(started)!r}, 'w').close()"]
    link = DaemonLink(link_config(sock, daemon_command=marker), client_name="test")
    with pytest.raises(Unavailable) as info:
        await link.get(5)
    await link.close()
    assert str(info.value) == (f"the daemon is unavailable: cannot connect to the daemon on {sock}: Not a "
                               "directory (a folder on its path is a file); choose another socket path (--socket, or "
                               "M31R_SOCKET)")
    assert not started.exists()

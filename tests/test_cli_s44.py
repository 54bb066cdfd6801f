"""The `m31r` commands as a new user meets them (session 44): Ctrl-C while `status` waits on a daemon that does not
answer, a closed pipe after `service install --dry-run`, `fim --file` on a file larger than the daemon takes whole,
and the exit statuses in `m31r --help`. Real processes on real sockets; the shared daemon (idle, running) answers
where one is needed."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

M31R = [sys.executable, "-m", "m31r.cli"]
LINE_STEP = 16  # the daemon keeps the lines above a cursor from a line whose index is a multiple of it


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def test_ctrl_c_while_status_waits_for_a_silent_daemon_exits_130_quietly(tmp_path: Path) -> None:
    """`m31r status` waits up to 2 s on its fast path (m31r.entry) for a daemon that accepts and does not answer (one
    loading its model, one stopped with Ctrl-Z); Ctrl-C there printed a KeyboardInterrupt traceback. The socket's
    listener reads the fast path's Hello first, so the signal comes while that path waits for the Welcome."""
    path = tmp_path / "m31rd.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(1)
        proc = subprocess.Popen([sys.executable, "-m", "m31r.entry", "status", "--socket", str(path)],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            conn, _ = listener.accept()
            with conn:
                hello = b""
                while b"m31r-status" not in hello:  # (the fast path's client name; the click CLI's is another)
                    chunk = conn.recv(4096)
                    assert chunk, hello
                    hello += chunk
                proc.send_signal(signal.SIGINT)
                out, err = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert (proc.returncode, out, err) == (130, b"", b""), err.decode()


def test_a_closed_pipe_ends_service_install_dry_run_quietly(tmp_path: Path) -> None:
    """`m31r service install --dry-run | head -1`: the commands behind user_errors took the closed pipe for bad input
    and said `error: [Errno 32] Broken pipe`, exit 1; every other command ends quietly with 141. The pipe's read end
    is closed up front, so every run meets it; nothing is installed (a dry run, in a home of the test's)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "config")}
    try:
        r = subprocess.run([*M31R, "service", "install", "--kind", "systemd", "--dry-run", "--socket",
                            str(tmp_path / "run" / "m31rd.sock")], stdin=subprocess.DEVNULL, stdout=write_end,
                           stderr=subprocess.PIPE, text=True, timeout=120, env=env)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "")
    assert not (tmp_path / "config").exists()


def _filler(n: int) -> str:
    """Lines that repeat every 160 (LINE_STEP * 10), so the large file's last lines are the small one's: the daemon
    keeps as many of them above the cursor as fit (on a finer step than LINE_STEP where a block does not fit)."""
    return "".join(f"pub const C{i % 160}: u32 = {i % 160};\n" for i in range(n))


@pytest.mark.parametrize("side", ["prefix", "suffix"])
def test_fim_on_a_file_larger_than_the_daemon_takes_completes_as_its_tail_does(shared_daemon, tmp_path: Path,
                                                                             side: str) -> None:
    """A 3 MB file (generated bindings) was sent whole and refused with `bad_request: ... (--max-prompt-chars)`, a
    daemon option: `fim --file` now sends what the daemon keeps, as the language server does, and answers as the
    same cursor in a short file with the same lines around it does (the lines above it in whole blocks of
    LINE_STEP)."""
    _, sock = shared_daemon
    body = "fn main() {\n    \n}\n"
    answers = []
    for n in (LINE_STEP * 6250, LINE_STEP * 10):  # 3.1 MB of filler lines, then 10 kB
        f = tmp_path / f"{side}-{n}.rs"
        f.write_text(_filler(n) + body if side == "prefix" else body + _filler(n))
        line = n + 2 if side == "prefix" else 2
        r = cli("fim", "--file", str(f), "--line", str(line), "--column", "5", "--max-tokens", "4", "--json",
                "--no-autostart", "--socket", str(sock))
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        answers.append((out["tokens"], out["usage"]["prompt_tokens"], out["logprob"]))
    assert f.stat().st_size < 1 << 14 < 1 << 21 < (tmp_path / f"{side}-{LINE_STEP * 6250}.rs").stat().st_size
    assert answers[0] == answers[1]


def test_help_names_the_exit_statuses() -> None:
    """Scripts branch on the exit status: `m31r --help` names each, where the README says them command by command."""
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stdout.split())
    for status in ("0 done", "1 an error", "2 a usage error", "130 Ctrl-C", "141 stdout's reader", "143 SIGTERM"):
        assert status in said, said


def test_a_fim_superseded_by_another_on_the_same_file_says_what_to_do(capsys):
    """Two `m31r fim --file F` at once (a script's `xargs -P`): the daemon answers the newest for a document, and the
    older one's bare "superseded by a newer request for the same document" did not say that document was the file."""
    from m31r import cli
    from m31r_protocol import DaemonError

    async def superseded() -> None:
        raise DaemonError("cancelled", "superseded by a newer request for the same document")

    with pytest.raises(SystemExit) as e:
        cli._run_client(superseded, socket_path=None)
    err = capsys.readouterr().err
    assert e.value.code == 1 and "same --file" in err and "one after another" in err, err

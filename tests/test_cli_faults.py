"""The CLI where the machine gets in the way: a socket it cannot reach, a log folder or an output it cannot write, a
locale that is not UTF-8. Each ends in one line that names what is wrong, never a traceback; a real daemon answers
where one is needed (the shared one, idle and running)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

M31R = [sys.executable, "-m", "m31r.cli"]


def cli(*args: str, env: dict | None = None, input: bytes | None = None, stdout: int | None = subprocess.PIPE,
        fast_path: bool = False) -> subprocess.CompletedProcess:
    """`m31r ARGS` as the console script runs it (m31r.entry, whose `status` skips click), bytes in and out."""
    module = "m31r.entry" if fast_path else "m31r.cli"
    return subprocess.run([sys.executable, "-m", module, *args], stdout=stdout, stderr=subprocess.PIPE, input=input,
                          timeout=120, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def one_error_line(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("args", [["status"], ["stop"], ["generate", "fn", "--no-autostart"], ["generate", "fn"],
                                  ["fim", "--prefix", "fn "]], ids=" ".join)
def test_a_socket_that_cannot_be_reached_is_one_line_naming_it(tmp_path: Path, args: list[str]) -> None:
    """A folder on the socket's path is a file: connect fails with ENOTDIR, which `status` and `stop` let through as
    a traceback and `generate` reported as `[Errno 20] Not a directory`, naming no path."""
    (tmp_path / "afile").write_text("")
    sock = tmp_path / "afile" / "m31rd.sock"
    r = cli(*args, "--socket", str(sock), env={"XDG_STATE_HOME": str(tmp_path / "state")})
    err = one_error_line(r)
    assert err.startswith(f"error: cannot connect to the daemon on {sock}: Not a directory"), err
    assert "--socket, or M31R_SOCKET" in err and r.stdout == b""


def test_an_autostart_whose_log_folder_cannot_be_made_says_which_and_why(tmp_path: Path) -> None:
    """The autostarted daemon's log goes under $XDG_STATE_HOME; where that cannot be made, the error says it is the
    log's folder and how to choose another (it said only `[Errno 20] Not a directory: '...'`)."""
    (tmp_path / "afile").write_text("")
    state = tmp_path / "afile" / "state"
    r = cli("generate", "fn", "--socket", str(tmp_path / "run" / "d.sock"), env={"XDG_STATE_HOME": str(state)})
    err = one_error_line(r)
    assert err.startswith(f"error: cannot start the daemon: {state / 'm31r'}: Not a directory"), err
    assert "the daemon's log" in err and "XDG_STATE_HOME" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("args,fast_path", [(["status"], True), (["status"], False),
                                            (["generate", "fn main", "--max-tokens", "4"], False),
                                            (["generate", "fn main", "--max-tokens", "4", "--json"], False)],
                         ids=["status-fast-path", "status-click", "generate", "generate-json"])
def test_output_to_a_full_disk_is_one_line(shared_daemon, args: list[str], fast_path: bool) -> None:
    """`m31r generate > out.rs` on a full disk (/dev/full: every write fails with ENOSPC) was a traceback."""
    _, sock = shared_daemon
    with open("/dev/full", "wb") as full:
        r = cli(*args, "--socket", str(sock), stdout=full.fileno(), fast_path=fast_path)
    assert one_error_line(r) == "error: cannot write the output: No space left on device\n"


def test_completions_are_utf8_whatever_the_locale(shared_daemon) -> None:
    """A locale whose encoding lacks a completion's characters (ASCII, ISO-8859-1: PYTHONIOENCODING stands in for
    one) ended the stream with a UnicodeEncodeError traceback; stdin was decoded with it too, so UTF-8 source came
    to the model as other characters. Rust source is UTF-8: both sides are UTF-8 whatever the locale."""
    _, sock = shared_daemon
    sampled = ["--max-tokens", "32", "--temperature", "1.5", "--seed", "0", "--socket", str(sock)]
    ref = json.loads(cli("generate", "fn main", "--json", *sampled).stdout)["text"]
    assert any(ord(c) > 127 for c in ref), ref  # the random model's sampled bytes: the case under test
    r = cli("generate", "fn main", *sampled, env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0, r.stderr.decode()
    assert r.stdout.decode("utf-8") == ref
    prompt = 'let s = "é'
    want = json.loads(cli("generate", prompt, "--json", *sampled).stdout)
    got = cli("generate", "-", "--json", *sampled, input=prompt.encode(), env={"PYTHONIOENCODING": "latin-1"})
    assert got.returncode == 0, got.stderr.decode()
    assert json.loads(got.stdout)["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]
    assert json.loads(got.stdout)["text"] == want["text"]


def test_stdin_that_is_not_utf8_is_refused_before_any_daemon(tmp_path: Path) -> None:
    """It went to the daemon as lone surrogates (after starting one), which refused it as bad_request."""
    sock = tmp_path / "run" / "d.sock"
    r = cli("generate", "-", "--no-autostart", "--socket", str(sock), input=b"fn main() { \xff }")
    assert one_error_line(r) == ("error: stdin is not UTF-8 text (byte 0xff at offset 12); the model completes UTF-8 "
                                 "source\n")
    assert not sock.parent.exists()


@pytest.mark.skipif(not Path("/proc/self/mem").exists(), reason="needs Linux's /proc/self/mem")
def test_input_that_cannot_be_read_is_not_called_output(tmp_path: Path) -> None:
    """A read that fails (EIO: a failing disk, a hung-up terminal; /proc/self/mem at offset 0 fails so every time) was
    reported as `error: cannot write the output: Input/output error`: the handler for a stdout that cannot be written
    caught it. It names what could not be read, and no daemon is asked."""
    sock = tmp_path / "run" / "d.sock"
    r = cli("fim", "--file", "/proc/self/mem", "--line", "1", "--column", "1", "--no-autostart", "--socket", str(sock))
    assert one_error_line(r) == "error: cannot read /proc/self/mem: Input/output error\n"
    with open("/proc/self/mem", "rb") as mem:  # this process's memory, read by the child at offset 0
        r = subprocess.run([*M31R, "generate", "-", "--no-autostart", "--socket", str(sock)], stdin=mem,
                           capture_output=True, timeout=120)
    assert one_error_line(r) == "error: cannot read stdin: Input/output error\n"
    assert r.stdout == b"" and not sock.parent.exists()


@pytest.mark.parametrize("args", [["status"], ["stop"]], ids=" ".join)
def test_waiting_on_a_daemon_that_does_not_answer_is_said(tmp_path: Path, args: list[str]) -> None:
    """A socket that accepts and sends no greeting (a socket-activated daemon loading its model, or one that hangs)
    kept `m31r status` and `m31r stop` silent for a minute, as if hung. Now they say, within seconds, what they wait
    for and how long they will."""
    import socket
    import time

    path = tmp_path / "m31rd.sock"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        listener.listen(4)  # connects complete in the backlog; nothing ever answers
        proc = subprocess.Popen([sys.executable, "-m", "m31r.entry", *args, "--socket", str(path)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            start = time.monotonic()
            line = proc.stderr.readline().decode()
            waited = time.monotonic() - start
        finally:
            proc.kill()
            proc.wait()
    assert f"waiting for the daemon on {path} to answer" in line and "a minute" in line, line
    assert waited < 30 and proc.returncode == -9  # said while still waiting, long before the minute is up


@pytest.mark.parametrize("checkpoint", [False, True], ids=["new-run", "resumed-run"])
def test_ctrl_c_before_training_starts_is_one_line(tmp_path: Path, checkpoint: bool) -> None:
    """Ctrl-C while `m31r train model` loads (before its step loop takes over Ctrl-C to save a checkpoint) printed
    only click's `Aborted!` and exited 1. It says what was saved, and exits as a shell reports Ctrl-C. The config is a
    FIFO, so that the command is caught reading it: no data folder is needed, and the timing is certain."""
    import errno
    import signal
    import time

    config = tmp_path / "train.yaml"
    os.mkfifo(config)
    (tmp_path / "data").mkdir()
    run = tmp_path / "run"
    if checkpoint:
        run.mkdir()
        (run / "ckpt.pt").write_bytes(b"an earlier checkpoint")
    proc = subprocess.Popen([*M31R, "train", "model", str(config), "--data", str(tmp_path / "data"), "--run", str(run)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        deadline = time.monotonic() + 120
        while writer is None:  # the FIFO opens for writing once the command opens it to read
            try:
                writer = os.open(config, os.O_WRONLY | os.O_NONBLOCK)
            except OSError as e:
                assert e.errno == errno.ENXIO and proc.poll() is None and time.monotonic() < deadline, proc.poll()
                time.sleep(0.05)
        time.sleep(0.2)  # (in its read, which waits for the config)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if writer is not None:
            os.close(writer)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and out == b"", (proc.returncode, err)
    if checkpoint:
        assert err.decode() == (f"error: interrupted (Ctrl-C) without saving: {run / 'ckpt.pt'} holds the run as of "
                                "its last checkpoint, and the same command resumes it from there\n")
        assert (run / "ckpt.pt").read_bytes() == b"an earlier checkpoint"
    else:
        assert err.decode() == (f"error: interrupted (Ctrl-C): nothing was saved ({run} has no checkpoint yet); the "
                                "same command starts the run again\n")
        assert not run.exists()

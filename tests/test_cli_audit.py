"""The `m31r` client commands as a new user drives them: Ctrl-C mid-stream and while the prompt is read, a socket path
that is a regular file, arguments and file names that are not UTF-8, and every refusal as one line (empty stdout
under --json). A real daemon answers where one is needed (the shared one, idle and running), through a relay on a
real socket where a stream must be caught in its middle."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

M31R = [sys.executable, "-m", "m31r.cli"]
HEADER = struct.Struct(">I")  # a frame: 4-byte big-endian length, then one MessagePack message (protocol/framing.py)


def cli(*args: str | bytes, input: bytes | None = None, env: dict | None = None,
        entry: bool = False) -> subprocess.CompletedProcess:
    """`m31r ARGS` (bytes arguments pass as they are, as a shell passes them), bytes in and out."""
    module = "m31r.entry" if entry else "m31r.cli"
    stdin = {"input": input} if input is not None else {"stdin": subprocess.DEVNULL}  # (never the test run's own)
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, timeout=120,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **stdin)  # type: ignore[call-overload]


def one_error_line(r: subprocess.CompletedProcess) -> str:
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, (r.returncode, err)
    assert err.startswith("error: ") and err.count("\n") == 1, err
    return err.removeprefix("error: ").rstrip("\n")


def take_frame(buf: bytearray) -> bytes | None:
    """The whole frame at `buf`'s start (header included), taken off it; None while it is incomplete."""
    if len(buf) < HEADER.size or len(buf) < (end := HEADER.size + HEADER.unpack_from(buf)[0]):
        return None
    frame = bytes(buf[:end])
    del buf[:end]
    return frame


def decode(frame: bytes) -> dict:
    return msgspec.msgpack.decode(frame[HEADER.size:])


class Relay:
    """A socket between one client and the real daemon that passes the daemon's frames on until the first token with
    text, and holds the rest: the client stays in the middle of its stream for as long as the test needs. What the
    client sends is passed on whole and kept (`sent`); `client_gone` is set when the client has closed."""

    def __init__(self, path: Path, upstream: Path) -> None:
        self.path, self.upstream = path, upstream
        self.sent: list[dict] = []
        self.client_gone = threading.Event()
        self.listener = socket.socket(socket.AF_UNIX)
        self.listener.bind(str(path))
        self.listener.listen(1)
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self.listener.accept()
        daemon = socket.socket(socket.AF_UNIX)
        daemon.connect(str(self.upstream))
        threading.Thread(target=self._down, args=(daemon, client), daemon=True).start()
        buf = bytearray()
        while data := client.recv(65536):
            daemon.sendall(data)
            buf += data
            while (frame := take_frame(buf)) is not None:
                self.sent.append(decode(frame))
        self.client_gone.set()
        with contextlib.suppress(OSError):
            daemon.close()

    @staticmethod
    def _down(daemon: socket.socket, client: socket.socket) -> None:
        buf, holding = bytearray(), False
        with contextlib.suppress(OSError):
            while data := daemon.recv(65536):
                buf += data
                while not holding and (frame := take_frame(buf)) is not None:
                    client.sendall(frame)
                    msg = decode(frame)
                    holding = msg.get("type") == "token" and bool(msg.get("text"))

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def private_dir(tmp_path: Path) -> Path:
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    return d


def read_pty(master: int, until_closed: bool) -> bytes:
    """What the child wrote to the terminal: the first bytes, or all until it closed its side. A child that writes
    nothing for a minute fails the test rather than holding it."""
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        assert ready, f"nothing on the terminal for 60 s after {out!r}"
        try:
            data = os.read(master, 4096)
        except OSError:  # EIO: the child closed its side
            return out
        out += data
        if not data or not until_closed:
            return out


@contextlib.contextmanager
def running(args: list[str], **kwargs: object) -> Iterator[subprocess.Popen]:
    """`m31r ARGS` started, and killed at the end if it is still running (a failed assert must not leave it)."""
    proc = subprocess.Popen([*M31R, *args], env={**os.environ, "PYTHONUNBUFFERED": "1"}, **kwargs)  # type: ignore
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()


def test_ctrl_c_mid_stream_cancels_the_request_and_ends_the_line_on_a_terminal(shared_daemon, private_dir) -> None:
    """Ctrl-C while `generate` streamed to a terminal exited 130 and cancelled the request, but left the half-written
    line open: the shell's prompt went on after the completion's last character."""
    _, sock = shared_daemon
    relay = Relay(private_dir / "relay.sock", sock)
    master, slave = pty.openpty()
    args = ["generate", "fn main() {", "--max-tokens", "200", "--temperature", "1", "--seed", "3", "--no-autostart",
            "--socket", str(relay.path)]
    try:
        with running(args, stdout=slave, stderr=subprocess.PIPE) as proc:
            os.close(slave)
            first = read_pty(master, until_closed=False)  # the first token's text: the relay holds the rest
            assert first and not first.endswith(b"\n"), first
            proc.send_signal(signal.SIGINT)
            rest = read_pty(master, until_closed=True)
            assert proc.wait(60) == 130, proc.returncode
            err = proc.stderr.read()  # type: ignore[union-attr]
        assert err == b"", err
        assert rest == b"\r\n", rest  # the line ended (the terminal writes \n as \r\n), and nothing else
        assert relay.client_gone.wait(60)
        kinds = [m["type"] for m in relay.sent]
        assert kinds == ["hello", "generate", "cancel"], kinds
        assert relay.sent[2]["id"] == relay.sent[1]["id"]
    finally:
        os.close(master)
        relay.close()


def test_ctrl_c_while_the_prompt_is_read_exits_130_quietly(private_dir) -> None:
    """Ctrl-C while `generate` read its prompt from the terminal said click's `Aborted!` and exited 1, as if it had
    failed; a stream cut short by Ctrl-C exits 130, as a shell reports Ctrl-C."""
    master, slave = pty.openpty()
    try:
        with running(["generate", "--no-autostart", "--socket", str(private_dir / "d.sock")], stdin=slave,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE) as proc:
            os.close(slave)
            said = proc.stderr.readline()  # type: ignore[union-attr]
            assert said == b"reading the prompt from stdin; end it with Ctrl-D\n", said
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=60)
        assert (proc.returncode, out, err) == (130, b"", b""), (proc.returncode, out, err)
    finally:
        os.close(master)


@pytest.mark.parametrize("args,entry", [
    (["status"], True), (["status"], False), (["stop"], False), (["generate", "fn"], False),
    (["generate", "fn", "--no-autostart", "--json"], False), (["fim", "--prefix", "fn "], False)],
    ids=["status-fast-path", "status", "stop", "generate-autostart", "generate-json", "fim"])
def test_a_regular_file_as_the_socket_is_named_as_one(private_dir, args: list[str], entry: bool) -> None:
    """A regular file on the socket path refuses connections as a stale socket file does: `status` and `generate
    --no-autostart` called it a socket a daemon had left, and `generate` started a daemon only to hear it refuse the
    path. Every client now names it as `stop` did, before starting anything."""
    path = private_dir / "d.sock"
    path.write_text("not a socket\n")
    r = cli(*args, "--socket", str(path), entry=entry, env={"XDG_STATE_HOME": str(private_dir / "state")})
    assert one_error_line(r) == (f"{path} is not a socket: no daemon can listen there; choose another socket path "
                                 "(--socket, or M31R_SOCKET)")
    assert r.stdout == b"" and not (private_dir / "state").exists()  # no daemon started (nor its log)
    assert path.read_text() == "not a socket\n"


@pytest.mark.parametrize("args,said", [
    ([b"generate", b"fn \xff main"], "PROMPT is not UTF-8 text (byte 0xff at offset 3)"),
    ([b"fim", b"--prefix", b"\xfe fn"], "--prefix is not UTF-8 text (byte 0xfe at offset 0)"),
    ([b"fim", b"--prefix", b"fn ", b"--suffix", b"}\xc3"], "--suffix is not UTF-8 text (byte 0xc3 at offset 1)"),
    ([b"generate", b"fn", b"--stop", b"x\xff", b"--json"], "--stop is not UTF-8 text (byte 0xff at offset 1)")],
    ids=["prompt", "prefix", "suffix", "stop"])
def test_arguments_that_are_not_utf8_are_refused_before_a_daemon_is_asked(private_dir, args: list[bytes],
                                                                          said: str) -> None:
    """Bytes that are not UTF-8 in an argument reached the daemon as lone surrogates: a daemon was asked (or started)
    only to answer bad_request. They are refused as stdin's are, naming the byte and its offset."""
    r = cli(*args, b"--no-autostart", b"--socket", bytes(private_dir / "d.sock"))
    assert one_error_line(r) == f"{said}; the model completes UTF-8 source"
    assert r.stdout == b""


def test_fim_completes_files_whose_names_are_not_utf8(shared_daemon, tmp_path: Path) -> None:
    """The file's path went into the request as its document, and with --context a sibling's as its snippet's path,
    with the names' bytes as lone surrogates: the daemon refused the whole request, so a file so named (or in such a
    folder, or beside such a file with --context) could not be completed at all."""
    _, sock = shared_daemon
    text = "mod helper;\nfn main() {\n    let x = helper();\n}\n"
    cursor = text.index("let")  # line 3, column 5
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/cr\xe9ate/ma\xefn.rs"))  # a folder and a file so named
    crate = tmp_path / "crate"  # a crate with a file so named beside main.rs
    for f in (odd, crate / "src" / "main.rs"):
        f.parent.mkdir(parents=True)
        f.write_text(text)
    (crate / "Cargo.toml").write_text('[package]\nname = "x"\n')
    (crate / "src" / os.fsdecode(b"h\xe9lper.rs")).write_text("pub fn helper() -> u32 {\n    41 + 1\n}\n")

    def fim(*args: str | bytes) -> dict:
        r = cli("fim", *args, "--json", "--max-tokens", "4", "--socket", str(sock))
        assert r.returncode == 0, r.stderr.decode()
        return json.loads(r.stdout)

    want = fim("--prefix", text[:cursor], "--suffix", text[cursor:])
    assert fim("--file", os.fsencode(odd), "--line", "3", "--column", "5")["tokens"] == want["tokens"]
    plain = fim("--file", str(crate / "src" / "main.rs"), "--line", "3", "--column", "5")
    with_context = fim("--file", str(crate / "src" / "main.rs"), "--line", "3", "--column", "5", "--context")
    assert plain["tokens"] == want["tokens"]
    assert with_context["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # the sibling's snippet leads
    # A crate in a folder so named: its files are found from the document's URI (its bytes percent-escaped).
    odd_crate = Path(os.fsdecode(bytes(tmp_path) + b"/cr\xe9ate2"))
    shutil.copytree(crate, odd_crate)
    main_rs = os.fsencode(odd_crate / "src" / "main.rs")
    assert fim("--file", main_rs, "--line", "3", "--column", "5", "--context")["usage"]["prompt_tokens"] == \
        with_context["usage"]["prompt_tokens"]


@pytest.mark.parametrize("args,stdin,said", [
    (["generate", ""], None, "empty prompt: pass text or pipe it on stdin"),
    (["generate"], b"", "empty prompt: pass text or pipe it on stdin"),
    (["generate", "-"], b"fn \x80", "stdin is not UTF-8 text (byte 0x80 at offset 3); the model completes UTF-8 "
                                     "source"),
    (["fim", "--file", "{crlf}", "--line", "5", "--column", "1"], None, "--line 5 is outside {crlf} (3 lines)"),
    (["fim", "--file", "{crlf}", "--line", "0", "--column", "1"], None, "--line 0 is outside {crlf} (3 lines)"),
    (["fim", "--file", "{crlf}", "--line", "2", "--column", "2"], None, "--column 2 is outside line 2 (0 characters)"),
    (["fim", "--file", "{crlf}", "--line", "1", "--column", "-1"], None,
     "--column -1 is outside line 1 (0 characters)"),
    (["fim", "--file", "{latin1}", "--line", "1", "--column", "1"], None,
     "{latin1} is not UTF-8 text (byte 0xe9 at offset 3); the model completes UTF-8 source"),
], ids=["empty-argument", "empty-stdin", "stdin-latin1", "line-past-end", "line-0", "column-past-end",
        "column-negative", "file-latin1"])
def test_refusals_are_one_line_and_leave_json_stdout_empty(private_dir, tmp_path: Path, args: list[str],
                                                           stdin: bytes | None, said: str) -> None:
    """Each refusal of generate/fim, with and without --json: one `error:` line, exit 1, nothing on stdout (never a
    half-written or non-JSON document), and no daemon asked or started."""
    crlf, latin1 = tmp_path / "crlf.rs", tmp_path / "latin1.rs"
    crlf.write_bytes(b"\r\n\r\n\r\n")  # 3 line ends: the cursor may sit on lines 1 to 4, each of 0 characters
    latin1.write_bytes(b"// \xe9t\xe9\n")
    args = [a.format(crlf=crlf, latin1=latin1) for a in args]
    for extra in ([], ["--json"]):
        r = cli(*args, *extra, "--socket", str(private_dir / "d.sock"), input=stdin,
                env={"XDG_STATE_HOME": str(private_dir / "state")})
        assert one_error_line(r) == said.format(crlf=crlf, latin1=latin1)
        assert r.stdout == b"" and not (private_dir / "state").exists()


def test_fim_on_a_file_of_line_ends_only_completes_on_its_last_line(shared_daemon, tmp_path: Path) -> None:
    """A file of CRLF line ends alone has a line after its last line end, where an editor puts the cursor; the
    completion is one JSON document, its prompt the file's lines with LF (as the daemon reads text)."""
    _, sock = shared_daemon
    f = tmp_path / "crlf.rs"
    f.write_bytes(b"\r\n\r\n\r\n")
    r = cli("fim", "--file", str(f), "--line", "4", "--column", "1", "--json", "--max-tokens", "3",
            "--socket", str(sock))
    want = cli("fim", "--prefix", "\n\n\n", "--json", "--max-tokens", "3", "--socket", str(sock))
    assert r.returncode == 0 and want.returncode == 0, (r.stderr, want.stderr)
    assert json.loads(r.stdout)["tokens"] == json.loads(want.stdout)["tokens"]


def test_a_closed_pipe_ends_generate_quietly(shared_daemon) -> None:
    """`m31r generate ... | head -c 5`: exit 141 (or 0 where the output fit in the pipe before the reader left), and
    nothing on stderr."""
    _, sock = shared_daemon
    p = subprocess.Popen([*M31R, "generate", "fn main() {", "--max-tokens", "200", "--temperature", "1", "--seed",
                          "3", "--socket", str(sock)], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)  # type: ignore[union-attr]
    p.stdout.close()  # type: ignore[union-attr]
    err = p.stderr.read()  # type: ignore[union-attr]
    assert p.wait(60) in (0, 141) and b"Traceback" not in err and b"error" not in err, (p.returncode, err)


def commands() -> list[list[str]]:
    """Every command's words (`bundle init`, `status`...), groups included."""
    import click

    from m31r.cli import main

    def walk(cmd: click.Command, words: list[str]) -> list[list[str]]:
        subs = cmd.commands.items() if isinstance(cmd, click.Group) else []
        return [words] + [w for name, sub in subs for w in walk(sub, [*words, name])]

    return walk(main, [])


@pytest.mark.parametrize("words", commands(), ids=lambda w: " ".join(w) or "m31r")
def test_every_help_renders_and_names_its_defaults(words: list[str]) -> None:
    """`--help` of every command renders, and each option that has a default says what it is. The socket's said
    only $M31R_SOCKET and $XDG_RUNTIME_DIR: on a Mac (no XDG_RUNTIME_DIR) the socket is in $TMPDIR/m31r-<uid>."""
    import click
    from click.testing import CliRunner

    from m31r.cli import main

    r = CliRunner().invoke(main, [*words, "--help"], terminal_width=10_000)
    assert r.exit_code == 0 and r.stdout.startswith("Usage: "), r.output
    cmd = main
    for w in words:
        cmd = cmd.commands[w]  # type: ignore[attr-defined]
    for opt in cmd.params:
        if (not isinstance(opt, click.Option) or opt.default is None or opt.is_flag or opt.hidden or opt.required
                or opt.multiple):  # (None: the option is optional, and absent means not given)
            continue
        record = opt.get_help_record(click.Context(cmd, info_name=words[-1]))
        assert record is not None and "default" in record[1].lower(), (words, opt.opts, record)
    if any(opt.name == "socket_path" for opt in cmd.params):
        assert "$TMPDIR/m31r-<uid>/m31rd.sock" in r.stdout, r.stdout


def test_doctor_refuses_a_closed_stdout(tmp_path: Path) -> None:
    """`m31r doctor >&-` ran every check and said nothing (exit 0 or 1 without a word); like `status`, whose output
    is the point, it says there is nowhere to write the report."""
    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", *M31R, "doctor", "--socket", str(tmp_path / "d.sock")],
                       stderr=subprocess.PIPE, timeout=120)
    assert one_error_line(r).startswith("stdout is closed: there is nowhere to write the output")

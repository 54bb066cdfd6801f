"""The `m31r` client commands against a real daemon: generate, fim, status, stop, autostart, and their errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon

M31R = [sys.executable, "-m", "m31r.cli"]


def cli(*args: str, env: dict | None = None, input: str | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], capture_output=True, text=True, input=input, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon


def test_generate_json(daemon, tiny_engine):
    from m31r.engine import Outcome
    from m31r.fim import heal_prompt

    _, sock = daemon
    r = cli("generate", "fn main", "--json", "--max-tokens", "8", "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    [line] = r.stdout.splitlines()
    out = json.loads(line)
    assert {"text", "tokens", "finish_reason", "usage", "timings"} <= set(out)
    ids, heal = heal_prompt(tiny_engine.tokenizer, tiny_engine.tokenizer.encode("fn main"))
    assert heal == "main"  # the daemon heals a prompt that stops inside a word
    ref = Outcome(prompt_tokens=0)
    for _ in tiny_engine.generate(ids, max_tokens=8, result=ref, heal=heal):
        pass
    assert (out["text"], out["tokens"], out["finish_reason"]) == (ref.text, ref.tokens[4:], ref.finish_reason)
    assert out["logprob"] == pytest.approx(sum(ref.logprobs), abs=1e-3)  # how sure the model was, as the engine says
    assert out["usage"]["prompt_tokens"] == len(ids) == len(tiny_engine.tokenizer.encode("fn ")) == 3
    assert (out["usage"]["completion_tokens"], out["usage"]["healed_tokens"]) == (8, 4) == (ref.completion_tokens,
                                                                                          ref.healing_tokens)
    assert len(ref.tokens) == 12  # `main` again, byte by byte (not streamed), and the eight max_tokens asked for
    assert set(out["timings"]) == {"queue_ms", "prefill_ms", "first_token_ms", "total_ms"}
    # Plain mode streams the same text; `-` reads the prompt from stdin.
    plain = cli("generate", "-", "--max-tokens", "8", "--socket", str(sock), input="fn main")
    assert plain.returncode == 0 and plain.stdout == ref.text, plain.stderr
    # A completion the editors would hide (under policy.MIN_PROBABILITY) says so on stderr, never on stdout.
    import math

    from m31r_protocol.policy import MIN_PROBABILITY

    unsure = out["line_logprob"] < math.log(MIN_PROBABILITY)
    assert ("(unsure: the model gives its first line a probability of" in plain.stderr) == unsure
    if unsure:
        assert f"{math.exp(out['line_logprob']):.3f}" in plain.stderr
    assert "unsure" not in r.stderr  # --json carries the figure itself
    # Into one file (`2>&1`), the note starts a line of its own after a completion that ends mid-line.
    both = subprocess.run([*M31R, "generate", "fn main", "--max-tokens", "8", "--socket", str(sock)], text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert both.returncode == 0 and both.stdout.startswith(ref.text)
    assert unsure and not ref.text.endswith("\n")  # the random model's line: both cases below are this one
    assert both.stdout[len(ref.text):].startswith("\n(unsure: ")
    # --logprobs: each token's figure (the engine's) and the likeliest tokens at its step; only with --json.
    r = cli("generate", "fn main", "--json", "--max-tokens", "8", "--logprobs", "2", "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    per = json.loads(r.stdout)["token_logprobs"]
    h = ref.healing_tokens  # the healing tokens are not streamed
    assert [t["token"] for t in per] == ref.tokens[h:] and "".join(t["text"] for t in per) == ref.text
    assert [t["logprob"] for t in per] == pytest.approx(ref.logprobs[h: h + len(per)], abs=1e-3)
    assert all(1 <= len(t["top"]) <= 2 and t["top"][0][0] == t["token"] for t in per)  # greedy: the likeliest
    # A stop sequence the last character might begin holds it back to the end, where it comes without a token of
    # its own: the list joins it to the token before it, so the tokens' texts still make up the answer.
    assert ref.text
    r = cli("generate", "fn main", "--json", "--max-tokens", "8", "--logprobs", "0", "--stop", ref.text[-1] + "\u2603",
            "--socket", str(sock))
    held = json.loads(r.stdout)
    assert held["text"] == ref.text and "".join(t["text"] for t in held["token_logprobs"]) == ref.text
    assert [t["token"] for t in held["token_logprobs"]] == ref.tokens[h:]
    r = cli("generate", "fn main", "--logprobs", "2", "--socket", str(sock))
    assert r.returncode != 0 and "add --json" in r.stderr and r.stdout == ""


def test_generate_truncate_keeps_the_end_of_a_prompt_too_long(daemon, tiny_engine):
    """Past the model's context a prompt fails with context_overflow, whose message says to ask for truncation:
    `--truncate` is how, and the daemon then keeps the prompt's last tokens that fit beside --max-tokens."""
    _, sock = daemon
    prompt = "let x = 1;\n" * 400  # well past the tiny model's context
    assert len(tiny_engine.tokenizer.encode(prompt)) > tiny_engine.config.max_context
    r = cli("generate", "-", "--max-tokens", "4", "--socket", str(sock), input=prompt)
    assert r.returncode == 1 and r.stderr.startswith("error: context_overflow:") and "truncation" in r.stderr
    r = cli("generate", "-", "--max-tokens", "4", "--truncate", "--json", "--socket", str(sock), input=prompt)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert 0 < out["usage"]["prompt_tokens"] <= tiny_engine.config.max_context - 4
    assert out["usage"]["completion_tokens"] == len(out["tokens"]) > 0


def test_fim_file_line_column(daemon, tiny_engine, tmp_path):
    from m31r.beams import beam_generate
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, line_context
    from m31r_protocol import messages as m
    from m31rd.server import request_stops

    _, sock = daemon
    src = "fn main() {\n    let x = 1;\n    let y = x + 2;\n}\n"
    f = tmp_path / "main.rs"
    f.write_text(src)
    r = cli("fim", "--file", str(f), "--line", "3", "--column", "13", "--json", "--max-tokens", "6",
            "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    cursor = src.index("x + 2")  # line 3, column 13 (1-based)
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    p = build_fim_prompt(tiny_engine.tokenizer, src[:cursor], src[cursor:], budget)
    ref = Outcome(prompt_tokens=0)
    for _ in tiny_engine.generate(p.ids, max_tokens=6, result=ref, heal=p.heal):
        pass
    assert (out["text"], out["tokens"], out["source"]) == (ref.text, ref.tokens[ref.healing_tokens:], "model")
    assert ref.healing_tokens == 1  # `x` again: not streamed, not counted in max_tokens
    # The same cursor given as --prefix/--suffix.
    r2 = cli("fim", "--prefix", src[:cursor], "--suffix", src[cursor:], "--json", "--max-tokens", "6",
             "--socket", str(sock))
    assert r2.returncode == 0 and json.loads(r2.stdout)["tokens"] == ref.tokens[1:], r2.stderr
    assert out["alternatives"] == []  # greedy decoding has no runners-up
    # --beams: the engine's search of that width, and its runners-up.
    r3 = cli("fim", "--prefix", src[:cursor], "--suffix", src[cursor:], "--json", "--max-tokens", "6", "--beams", "3",
             "--socket", str(sock))
    assert r3.returncode == 0, r3.stderr
    searched = Outcome(prompt_tokens=0)
    for _ in beam_generate(tiny_engine, p.ids, width=3, max_tokens=6, result=searched, heal=p.heal,
                           stop=request_stops(m.Fim(id=0, prefix=src[:cursor], suffix=src[cursor:])),
                           repeat_context=line_context(src[:cursor])):
        pass
    out3 = json.loads(r3.stdout)
    assert (out3["text"], out3["tokens"], out3["alternatives"]) == (
        searched.text, searched.tokens[searched.healing_tokens:], searched.alternatives)
    bad = cli("fim", "--file", str(f), "--line", "3", "--column", "99", "--socket", str(sock))
    assert bad.returncode != 0 and bad.stderr.startswith("error:") and len(bad.stderr.splitlines()) == 1
    latin1 = tmp_path / "latin1.rs"
    latin1.write_bytes("// caf\u00e9\nfn main() {}\n".encode("latin-1"))
    bad = cli("fim", "--file", str(latin1), "--line", "2", "--column", "4", "--socket", str(sock))
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr == (f"error: {latin1} is not UTF-8 text (byte 0xe9 at offset 6); the model completes UTF-8 "
                          "source\n")


def test_fim_file_context_sends_its_crates_other_files(daemon, tiny_engine, tmp_path):
    """`m31r fim --file --context` leads the prompt with snippets of the file's crate, as the language server does with
    projectContext on; without `--context`, none."""
    from m31r.context import context_ids, context_room
    from m31r.fim import FimBudget, build_fim_prompt
    from m31r_protocol.context import query_words, rank, windows

    _, sock = daemon
    (tmp_path / "Cargo.toml").write_text("[package]\nname = \"demo\"\n")
    (tmp_path / "src").mkdir()
    point = "pub struct Point {\n    pub x: i64,\n    pub y: i64,\n}\n"
    (tmp_path / "src/point.rs").write_text(point)
    src = "fn main() {\n    let p = Point { x: 1, y: 2 };\n    let n = p.x;\n}\n"
    f = tmp_path / "src/main.rs"
    f.write_text(src)
    cursor = src.index("p.x;")
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    p = build_fim_prompt(tiny_engine.tokenizer, src[:cursor], src[cursor:], budget)
    head = context_ids(tiny_engine.tokenizer, rank(query_words(src[:cursor]), [("src/point.rs", windows(point))]),
                       context_room(budget, p))
    assert "// src/point.rs\npub struct Point" in tiny_engine.tokenizer.decode(head)
    for flags, ids in ((("--context",), head + p.ids), ((), p.ids)):
        r = cli("fim", "--file", str(f), "--line", "3", "--column", "13", "--json", "--max-tokens", "6", "--beams", "1",
                "--socket", str(sock), *flags)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        ref = "".join(x.text for x in tiny_engine.generate(ids, max_tokens=6, heal=p.heal))
        assert out["text"] == ref and out["usage"]["prompt_tokens"] == len(ids)
    bad = cli("fim", "--prefix", src[:cursor], "--context", "--socket", str(sock))
    assert bad.returncode != 0 and "--context takes the snippets from the files beside --file" in bad.stderr


def test_status(daemon, tiny_bundle):
    proc, sock = daemon
    r = cli("status", "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)
    assert st["pid"] == proc.pid and st["model"] == tiny_bundle.model_id and st["device"] == "cpu"
    for key in ("dtype", "uptime_s", "queue", "active", "cache_slots", "cache_hit_rate", "rss_mb"):
        assert key in st


@pytest.mark.parametrize("form", ["--socket", "--socket="])
def test_a_tilde_in_socket_is_the_home_folder(daemon, tmp_path, form):
    """`~` in --socket is the home folder also where no shell expanded it: quoted, after `=`, or run by an editor
    without a shell. Taken literally it named a folder `~` in the working directory (and no daemon answered there)."""
    _, sock = daemon
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (home / "d.sock").symlink_to(sock)
    args = ["--socket", "~/d.sock"] if form == "--socket" else ["--socket=~/d.sock"]
    for cmd in (["status", *args], ["generate", "fn", "--max-tokens", "1", "--no-autostart", *args]):
        r = subprocess.run([*M31R, *cmd], capture_output=True, text=True, timeout=120, cwd=cwd,
                           env={**os.environ, "HOME": str(home)})
        assert r.returncode == 0, r.stderr
    assert list(cwd.iterdir()) == []


@pytest.mark.parametrize("args", [["-m", "m31r.entry", "status"], ["-m", "m31r.cli", "status"],
                                  ["-m", "m31r.cli", "stop"], ["-m", "m31r.cli", "generate", "fn", "--no-autostart"]],
                         ids=["status-fast-path", "status-click", "stop", "generate"])
def test_an_empty_socket_path_is_a_usage_error(daemon, args):
    """`--socket ''` was the default socket on `status`'s fast path (which answered with that daemon's status) and the
    working directory through click (`. is not a socket`, `no daemon answers on .`): refused alike instead."""
    _, sock = daemon
    r = subprocess.run([sys.executable, *args, "--socket", ""], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "M31R_SOCKET": str(sock)})
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert "Invalid value for '--socket': an empty path names nothing" in r.stderr, r.stderr


@pytest.mark.parametrize("args", [["generate", "fn", "--no-autostart"], ["fim", "--prefix", "x", "--no-autostart"],
                                  ["status"]], ids=lambda a: a[0])
def test_no_daemon_is_one_line_error(tmp_path, args):
    sock = tmp_path / "nobody-home.sock"
    r = cli(*args, "--socket", str(sock), timeout=60)
    assert r.returncode != 0 and r.stdout == ""
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr
    assert str(sock) in r.stderr and not sock.exists()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie child of a finished CLI process counts as gone.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ", 1)[1].startswith("Z")


def test_autostart(tiny_bundle, tmp_path):
    sock = tmp_path / "auto" / "m31rd.sock"
    env = {"M31R_BUNDLE": str(tiny_bundle.path), "XDG_STATE_HOME": str(tmp_path / "state")}
    pid = None
    try:
        r = cli("generate", "fn main", "--json", "--max-tokens", "4", "--socket", str(sock), env=env)
        assert r.returncode == 0, r.stderr
        usage = json.loads(r.stdout)["usage"]  # stdout holds the JSON and nothing else
        assert (usage["completion_tokens"], usage["healed_tokens"]) == (4, 4)  # `main` again, byte by byte: then 4
        # One line on stderr says why it waits; the daemon answers once warm, and its log says it warmed up first.
        [notice] = r.stderr.splitlines()
        assert notice.startswith("starting the m31r daemon") and str(sock) in notice, r.stderr
        events = [json.loads(x)["msg"] for x in (tmp_path / "state" / "m31r" / "m31rd.log").read_text().splitlines()
                  if x.startswith("{")]
        assert events.index("warm") < events.index("ready") < events.index("request"), events
        st = cli("status", "--socket", str(sock))
        assert st.returncode == 0, st.stderr
        pid = json.loads(st.stdout)["pid"]
        assert Path(json.loads(st.stdout)["bundle"]).resolve() == Path(tiny_bundle.path).resolve()
        assert (tmp_path / "state" / "m31r" / "m31rd.log").exists()
        # A second client uses the running daemon instead of starting another.
        r = cli("generate", "fn", "--max-tokens", "1", "--socket", str(sock), env=env)
        assert r.returncode == 0 and "starting" not in r.stderr, r.stderr
        assert cli("stop", "--socket", str(sock)).returncode == 0
        t0 = time.monotonic()
        while not _gone(pid) and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert _gone(pid) and not sock.exists()
    finally:
        if pid is None and sock.exists():  # failed before Status gave the pid: still end the daemon it started
            cli("stop", "--socket", str(sock))
        elif pid is not None and not _gone(pid):
            os.kill(pid, signal.SIGKILL)


def test_stop(tiny_bundle, tmp_path):
    sock = tmp_path / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock)  # its own: the shared daemon keeps running for other modules
    try:
        r = cli("stop", "--socket", str(sock))
        assert (r.returncode, r.stderr) == (0, "daemon stopped\n")
        assert proc.wait(20) == 0
        assert not sock.exists()
        # Stopping again is not an error, as `systemctl stop` of a stopped unit is not: one line says so.
        r = cli("stop", "--socket", str(sock))
        assert (r.returncode, r.stdout, r.stderr) == (0, "", f"no daemon was running on {sock}\n")
    finally:
        stop_daemon(proc)


def test_an_error_after_part_of_a_completion_starts_a_line_of_its_own(tiny_bundle, tmp_path):
    """The daemon killed mid-stream: the error came right after the half-written line (`    let x = 1error: the
    daemon closed the connection`) where stdout and stderr go to one place (a terminal, `2>&1`), as the `unsure` note
    already did not."""
    sock = tmp_path / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock)  # its own: this one is killed
    try:
        client = subprocess.Popen([*M31R, "generate", "fn main", "--max-tokens", "400", "--temperature", "1.5",
                                   "--seed", "1", "--no-autostart", "--socket", str(sock)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        first = client.stdout.read(1)  # type: ignore[union-attr]
        proc.kill()
        out = first + client.stdout.read()  # type: ignore[union-attr]
        assert client.wait(60) == 1, out
    finally:
        stop_daemon(proc)
    text, sep, err = out.decode().partition("error: ")
    assert sep and err.count("\n") == 1 and "Traceback" not in err, out
    assert text.endswith("\n"), out


def test_stop_with_no_daemon_says_so_and_exits_0(tmp_path):
    """`m31r stop` with nothing to stop exited 1 with `error: no daemon answers on ...: FileNotFoundError`, which
    broke `m31r stop && ...` and scripts that stop before they start. No socket file, no socket folder, or a stale
    socket file nobody listens on: exit 0 and one line naming the path (M31R_SOCKET's when there is no --socket).
    A path that keeps any daemon from being reached is still an error."""
    import socket

    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    stale = run / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))  # a socket file left by a daemon that was killed: nothing accepts on it
    s.close()
    for sock in (run / "none.sock", tmp_path / "no-folder" / "d.sock", stale):
        for args, env in ((["--socket", str(sock)], {}), ([], {"M31R_SOCKET": str(sock)})):
            r = cli("stop", *args, env=env, timeout=60)
            assert (r.returncode, r.stdout, r.stderr) == (0, "", f"no daemon was running on {sock}\n"), (args, env)
    assert stale.exists() and not (tmp_path / "no-folder").exists()  # nothing made or removed
    (run / "afile").write_text("")
    r = cli("stop", "--socket", str(run / "afile"), timeout=60)  # a plain file: no daemon could ever listen there
    assert (r.returncode, r.stderr) == (1, f"error: {run / 'afile'} is not a socket: no daemon can listen there; "
                                           "choose another socket path (--socket, or M31R_SOCKET)\n")


# -- closed pipes and streams, out-of-range options: one line or none, never a traceback -----------------------------


@pytest.mark.parametrize("args", [["-m", "m31r.entry", "status"], ["-m", "m31r.cli", "status"],
                                  ["-m", "m31r.cli", "generate", "fn main", "--max-tokens", "8"]],
                         ids=["status-fast-path", "status-click", "generate"])
def test_a_reader_that_goes_away_ends_the_command_quietly(daemon, args):
    """`m31r status | head -c 1`, `m31r generate ... | head -c 5`: stdout's reader is gone before the output is
    written (the pipe's read end is closed up front, so every run meets it), which ends the command with exit 141
    and nothing on stderr, on the status fast path in m31r.entry as through click."""
    _, sock = daemon
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        r = subprocess.run([sys.executable, *args, "--socket", str(sock)], stdout=write_end, stderr=subprocess.PIPE,
                           text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (r.returncode, r.stderr) == (141, "")


def _closed(redirect: str, *args: str) -> subprocess.CompletedProcess:
    """The CLI run with stdin (`<&-`) or stdout (`>&-`) closed, as a shell leaves them."""
    return subprocess.run(["sh", "-c", f'exec "$@" {redirect}', "sh", *M31R, *args], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=60)


def test_closed_stdin_or_stdout_is_a_one_line_error(tmp_path):
    sock = str(tmp_path / "nobody-home.sock")  # each is refused before any daemon is looked for
    r = _closed("<&-", "generate", "-", "--no-autostart", "--socket", sock)
    assert (r.returncode, r.stderr) == (1, "error: stdin is closed: pass the prompt as an argument, or pipe it on "
                                           "stdin\n")
    stdout_closed = ("error: stdout is closed: there is nowhere to write the output (redirect it to a file or "
                     "/dev/null instead)\n")
    for args in (["generate", "fn", "--no-autostart"], ["fim", "--prefix", "fn ", "--no-autostart"], ["status"]):
        r = _closed(">&-", *args, "--socket", sock)
        assert (r.returncode, r.stderr) == (1, stdout_closed), args
    r = subprocess.run(["sh", "-c", 'exec "$@" >&-', "sh", sys.executable, "-m", "m31r.entry", "status", "--socket",
                        sock], stderr=subprocess.PIPE, text=True, timeout=60)
    assert (r.returncode, r.stderr) == (1, stdout_closed)
    assert not Path(sock).exists()


def test_integers_past_64_bits_are_refused_before_sending(daemon):
    """The protocol (MessagePack) carries -2**63 .. 2**64 - 1: a larger --seed raised OverflowError in the encoder.
    The edges themselves are sent, and the daemon judges them."""
    _, sock = daemon
    for flag, value in (("--seed", 1 << 64), ("--seed", -(1 << 63) - 1), ("--max-tokens", 1 << 64),
                        ("--top-k", 10 ** 30)):
        r = cli("generate", "fn", flag, str(value), "--socket", str(sock))
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert f"Invalid value for '{flag}': {value} does not fit in 64 bits" in r.stderr
        assert "Traceback" not in r.stderr
    for seed in ((1 << 64) - 1, -(1 << 63)):
        r = cli("generate", "fn", "--seed", str(seed), "--temperature", "1", "--max-tokens", "2", "--json",
                "--socket", str(sock))
        assert r.returncode == 0 and json.loads(r.stdout)["usage"]["completion_tokens"] == 2, r.stderr


@pytest.mark.parametrize("flag,value,expected", [
    ("--max-queue", "0", "0 is not in the range x>=1"), ("--max-active", "0", "0 is not in the range x>=1"),
    ("--threads", "-1", "-1 is not in the range x>=1"), ("--decode-width", "0", "0 is not in the range 1<=x<=64"),
    ("--chunk-size", "0", "0 is not in the range x>=1"), ("--cache-mb", "-5", "-5.0 is not in the range x>=0"),
    ("--cache-mb", "nan", "nan is not a finite number"), ("--cache-mb", "inf", "inf is not a finite number"),
    ("--read-timeout", "nan", "nan is not a number"),
])
def test_daemon_options_that_size_nothing_are_usage_errors(tmp_path, flag, value, expected):
    """Refused by click before the daemon starts: no bundle needed (this one does not exist), and no socket made."""
    sock = tmp_path / "run" / "d.sock"
    r = cli("daemon", "--bundle", str(tmp_path / "no-bundle"), "--socket", str(sock), flag, value, timeout=60)
    assert r.returncode == 2 and f"Invalid value for '{flag}': {expected}" in r.stderr, r.stderr
    assert not sock.parent.exists()


@pytest.mark.parametrize("flag", ["--request-timeout", "--body-timeout", "--header-timeout"])
def test_serve_timeouts_that_are_not_numbers_are_usage_errors(tmp_path, flag):
    """FloatRange lets nan through (every comparison with it is false): `serve --request-timeout nan` started, then
    answered every request 504 ("the server's nans timeout"), --body-timeout nan 500, --header-timeout nan nothing.
    Refused by click before anything binds or a daemon is looked for."""
    sock = tmp_path / "run" / "d.sock"
    r = cli("serve", "--port", "0", "--no-autostart", "--socket", str(sock), flag, "nan", timeout=30)
    assert (r.returncode, r.stdout) == (2, ""), r.stderr
    assert f"Invalid value for '{flag}': nan is not a number" in r.stderr, r.stderr
    assert not sock.parent.exists()


def assert_fim_file_cursor(sock: Path, f: Path, line: int, column: int, prefix: str, suffix: str) -> None:
    """`fim --file F --line L --column C` completes exactly as `fim --prefix P --suffix S` does (same prompt)."""
    r = cli("fim", "--file", str(f), "--line", str(line), "--column", str(column), "--json", "--max-tokens", "4",
            "--socket", str(sock))
    assert r.returncode == 0, r.stderr
    ref = cli("fim", "--prefix", prefix, "--suffix", suffix, "--json", "--max-tokens", "4", "--socket", str(sock))
    assert ref.returncode == 0, ref.stderr
    out, want = json.loads(r.stdout), json.loads(ref.stdout)
    assert (out["tokens"], out["usage"]["prompt_tokens"]) == (want["tokens"], want["usage"]["prompt_tokens"])


def test_fim_counts_lines_as_editors_do(daemon, tmp_path):
    """Only \\n, \\r\\n and \\r end a line, as in LSP and editors: str.splitlines also broke at the form feed and
    U+2028 below, so line 2 was `y` (too short for column 4), and the file had 4 lines instead of 2."""
    _, sock = daemon
    src = "// x\x0cy\u2028z\r\nfn main() {}\n"
    f = tmp_path / "main.rs"
    f.write_bytes(src.encode())
    text = f.read_text(encoding="utf-8")  # as the CLI reads it (universal newlines)
    cursor = text.index("main")  # line 2, column 4
    assert_fim_file_cursor(sock, f, 2, 4, text[:cursor], text[cursor:])
    r = cli("fim", "--file", str(f), "--line", "4", "--column", "1", "--socket", str(sock))
    assert (r.returncode, r.stderr) == (1, f"error: --line 4 is outside {f} (2 lines)\n")
    r = cli("fim", "--file", str(f), "--line", "1", "--column", "10", "--socket", str(sock))
    assert (r.returncode, r.stderr) == (1, "error: --column 10 is outside line 1 (8 characters)\n")


def test_fim_refuses_cursor_options_it_would_ignore(tmp_path):
    """`fim --prefix P --line 3` completed at the end of P, ignoring --line (and --column): the user asked for another
    cursor. `--file F --line L --column C --suffix S` ignored S the same way (the suffix is the file's). Both are
    refused before any daemon is asked."""
    f = tmp_path / "a.rs"
    f.write_text("fn main() {\n}\n")
    sock = tmp_path / "run" / "d.sock"
    for args in (["--prefix", "fn ", "--line", "3"], ["--prefix", "fn ", "--suffix", "}", "--column", "2"]):
        r = cli("fim", *args, "--no-autostart", "--socket", str(sock), timeout=60)
        assert (r.returncode, r.stdout, r.stderr) == (1, "", "error: --line and --column place the cursor in --file: "
                                                             "give --file, or --prefix/--suffix without them\n"), args
    r = cli("fim", "--file", str(f), "--line", "1", "--column", "4", "--suffix", "x", "--no-autostart", "--socket",
            str(sock), timeout=60)
    assert (r.returncode, r.stderr) == (1, "error: use either --prefix/--suffix or --file with --line and --column\n")
    assert not sock.parent.exists()


def test_stop_that_outlasts_its_wait_says_so(tiny_bundle, tmp_path, monkeypatch):
    """`m31r stop` waits STOP_WAIT_S (30 s) for the daemon to close; past it, TimeoutError escaped as a traceback.
    Here the wait is 0, so the daemon (which did accept the shutdown, and still exits) outlasts it."""
    from click.testing import CliRunner

    import m31r.cli

    sock = tmp_path / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock)
    try:
        monkeypatch.setattr(m31r.cli, "STOP_WAIT_S", 0.0)
        r = CliRunner().invoke(m31r.cli.main, ["stop", "--socket", str(sock)])
        assert r.exit_code == 1 and r.stdout == "", r.output
        assert r.stderr == ("error: the daemon accepted the shutdown but was still running 0 s later (it finishes "
                            "in-flight requests first); `m31r status` shows whether it is still there\n")
        assert proc.wait(20) == 0
    finally:
        stop_daemon(proc)


def test_fim_places_the_cursor_after_a_byte_order_mark_as_editors_do(daemon, tmp_path):
    """A file saved with a UTF-8 byte-order mark (Windows editors) had it counted as line 1's first character: the
    column an editor shows put the cursor one character early, and the mark went into the prompt, which an editor's
    text (LSP) never holds."""
    _, sock = daemon
    src = "fn main() {\n    let x = 1;\n}\n"
    f = tmp_path / "bom.rs"
    f.write_bytes(b"\xef\xbb\xbf" + src.encode())
    cursor = src.index("{")  # line 1, column 11
    assert_fim_file_cursor(sock, f, 1, 11, src[:cursor], src[cursor:])
    r = cli("fim", "--file", str(f), "--line", "1", "--column", "13", "--socket", str(sock))
    assert (r.returncode, r.stderr) == (1, "error: --column 13 is outside line 1 (11 characters)\n")


@pytest.mark.parametrize(("words", "cword", "want"), [
    ("m31r da", 1, "daemon"), ("m31r daemon --qu", 2, "--quant"), ("m31r bundle qu", 2, "quantize"),
    ("m31r train ex", 2, "export")])
def test_shell_completion_as_the_readme_sets_it_up(words: str, cword: int, want: str) -> None:
    """README's shell completion line: the `m31r` script (its fast path in m31r.entry first) answers bash's
    completion requests with the commands and options that match."""
    m31r = Path(sys.executable).parent / "m31r"
    env = {**os.environ, "COMP_WORDS": words, "COMP_CWORD": str(cword), "_M31R_COMPLETE": "bash_complete"}
    r = subprocess.run([str(m31r)], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0 and r.stdout.splitlines() == [f"plain,{want}"], (r.stdout, r.stderr)

"""What the CLI refuses, and when: a device this machine lacks, a number an option cannot use, an option combination
that cannot work. Each is refused before anything is loaded, read from stdin or started (a daemon, a model), in
words that name the way out; every test runs the real command in a subprocess."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

M31R = [sys.executable, "-m", "m31r.cli"]
REPO = Path(__file__).resolve().parent.parent
TRAIN_CONFIG = REPO / "configs" / "train" / "mini.yaml"
TINY_CONFIG = REPO / "configs" / "model" / "tiny.yaml"


def run(*args: str, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], capture_output=True, text=True, timeout=timeout, **kw)


def _torch_devices() -> tuple[bool, bool]:
    import torch

    return torch.cuda.is_available(), torch.backends.mps.is_available()


CUDA, MPS = _torch_devices()


# -- item: a device this machine lacks ----------------------------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_the_daemon_on_cuda_without_it_is_one_line_before_any_socket_or_model(tmp_path: Path) -> None:
    """It bound the socket, loaded on the torch thread and ended with `AssertionError: Torch not compiled with CUDA
    enabled` among JSON log lines, naming no device the machine has."""
    sock = tmp_path / "run" / "d.sock"
    r = run("daemon", "--device", "cuda", "--socket", str(sock))
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.startswith("error: --device cuda: ") and r.stderr.count("\n") == 1, r.stderr
    assert "this machine has: cpu" in r.stderr and "AssertionError" not in r.stderr
    assert not sock.parent.exists()  # refused before the daemon made its folder


@pytest.mark.parametrize("device,says", [
    ("bogus", "not a device name"), ("cuda:x", "not a device name"), ("", "not a device name"),
    pytest.param("cuda", "no CUDA device", marks=pytest.mark.skipif(CUDA, reason="this machine has CUDA")),
    ("cuda:99", "no CUDA device"),  # no machine here has 100 GPUs, or none at all
    pytest.param("mps", "no MPS device", marks=pytest.mark.skipif(MPS, reason="this machine has MPS")),
])
def test_training_on_a_device_this_machine_lacks_is_one_line_naming_its_devices(tmp_path: Path, device: str,
                                                                                says: str) -> None:
    """`train model --device` takes any string: a malformed one was a torch traceback, a missing GPU an error about
    the data folder (checked first) and then a traceback deep in training."""
    (tmp_path / "data").mkdir()
    r = run("train", "model", str(TRAIN_CONFIG), "--data", str(tmp_path / "data"), "--run", str(tmp_path / "run"),
            "--device", device)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith(f"error: --device {device}: ") and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr and "this machine has: cpu" in r.stderr
    assert not (tmp_path / "run").exists()


# -- item: numbers an option cannot use ---------------------------------------------------------------------------


def _number_cases() -> list:
    """(option's command line, option) for every float option of every command, and the integers with a range: each
    refuses what it cannot use."""
    gen = ["generate", "fn", "--no-autostart", "--socket", "{tmp}/run/d.sock"]
    fim = ["fim", "--prefix", "fn ", "--no-autostart", "--socket", "{tmp}/run/d.sock"]
    corpus = ["train", "corpus", "{tmp}/out", "--source", "{tmp}"]
    textbook = ["train", "textbook", "{tmp}", "--out", "{tmp}/out"]
    model = ["train", "model", str(TRAIN_CONFIG), "--data", "{tmp}", "--run", "{tmp}/run"]
    daemon = ["daemon", "--socket", "{tmp}/run/d.sock"]
    serve = ["serve", "--no-autostart", "--socket", "{tmp}/run/d.sock", "--port", "0"]
    cases = []
    for base, option, values in [
        (gen, "--temperature", ["nan", "inf", "-1"]), (gen, "--top-p", ["nan", "inf", "0", "1.5", "-1"]),
        (fim, "--temperature", ["nan"]), (fim, "--top-p", ["nan"]),
        (corpus, "--val-fraction", ["nan", "inf", "-0.1", "1"]),
        (textbook, "--plain-share", ["nan", "inf", "-1"]),
        (model, "--max-minutes", ["nan", "-1", "0"]), (model, "--max-steps", ["0", "-1"]),
        (["train", "tokenizer", "{tmp}"], "--vocab-size", ["0", "260", str(1 << 30)]),
        (["bundle", "init", str(TINY_CONFIG), "{tmp}/out"], "--seed", [str(2**64), str(-(2**63) - 1)]),
        (daemon, "--cache-mb", ["nan", "inf", "-1"]), (daemon, "--read-timeout", ["nan", "-1"]),
        (serve, "--request-timeout", ["nan", "0"]), (serve, "--body-timeout", ["nan"]),
        (serve, "--header-timeout", ["nan"]),
    ]:
        cases += [pytest.param([*base, option, v], option, id=f"{base[0]}{'-' + base[1] if base[0] == 'train' else ''}"
                               f" {option} {v}") for v in values]
    return cases


@pytest.mark.parametrize("args,option", _number_cases())
def test_a_number_an_option_cannot_use_is_a_usage_error(tmp_path: Path, args: list[str], option: str) -> None:
    """nan passes click's FloatRange (every comparison with it is false) and plain float options take anything:
    `--temperature nan` autostarted a daemon to be told bad_request, `--val-fraction nan` built a corpus with no
    validation split, `--plain-share nan` took every train file, `--max-minutes nan` never stopped."""
    r = run(*[a.replace("{tmp}", str(tmp_path)) for a in args], stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert f"Invalid value for '{option}'" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("option,value", [("--val-fraction", "0"), ("--val-fraction", "0.5")])
def test_a_usable_share_is_still_taken(tmp_path: Path, option: str, value: str) -> None:
    (tmp_path / "src").mkdir()
    r = run("train", "corpus", str(tmp_path / "out"), "--source", str(tmp_path / "src"), option, value)
    assert r.returncode == 0, r.stderr


# -- item: generate reading the prompt from a terminal -------------------------------------------------------------


def _generate_on(stdin: int, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([*M31R, "generate", "--no-autostart", "--socket", str(tmp_path / "run" / "d.sock")],
                            stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _read_until(fd: int, want: bytes, timeout: float) -> bytes:
    got = b""
    end = time.monotonic() + timeout
    while want not in got and time.monotonic() < end:
        if select.select([fd], [], [], 0.2)[0]:
            chunk = os.read(fd, 4096)
            if not chunk:
                break
            got += chunk
    return got


def test_generate_says_it_reads_a_terminal_and_how_to_end_it(tmp_path: Path) -> None:
    """`m31r generate` with no prompt and stdin a terminal waited without a word: it looked hung."""
    main_fd, tty_fd = pty.openpty()
    proc = _generate_on(tty_fd, tmp_path)
    os.close(tty_fd)
    try:
        said = _read_until(proc.stderr.fileno(), b"\n", 60)  # type: ignore[union-attr]
        assert said == b"reading the prompt from stdin; end it with Ctrl-D\n", said
        os.write(main_fd, b"fn main\n\x04")  # the terminal's end of input: the prompt is read, and the daemon sought
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait()
        os.close(main_fd)
    assert proc.returncode == 1 and out == b""
    assert err.decode().startswith("error: no daemon answers on "), err  # the prompt was read: it went on


@pytest.mark.parametrize("source", ["pipe", "file"])
def test_generate_says_nothing_more_when_stdin_is_a_pipe_or_a_file(tmp_path: Path, source: str) -> None:
    prompt = tmp_path / "prompt.rs"
    prompt.write_text("fn main")
    with prompt.open("rb") as f:
        r = subprocess.run([*M31R, "generate", "--no-autostart", "--socket", str(tmp_path / "run" / "d.sock")],
                           stdin=f if source == "file" else None, input=b"fn main" if source == "pipe" else None,
                           capture_output=True, timeout=60)
    assert r.returncode == 1 and r.stderr.decode().startswith("error: no daemon answers on "), r.stderr
    assert r.stderr.count(b"\n") == 1


# -- item: option combinations refused before stdin is read ---------------------------------------------------------


@pytest.mark.parametrize("args", [["generate"], ["generate", "-"], ["generate", "fn"],
                                  ["fim", "--prefix", "fn "]], ids=" ".join)
def test_logprobs_without_json_is_refused_before_stdin_is_read(tmp_path: Path, args: list[str]) -> None:
    """`generate --logprobs N` without --json read all of stdin (a pipe left open: for good) before refusing."""
    proc = subprocess.Popen([*M31R, *args, "--logprobs", "2", "--socket", str(tmp_path / "run" / "d.sock")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=30)  # stdin stays open (communicate would close it): a read of it would never end
        out, err = proc.stdout.read(), proc.stderr.read()  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()  # type: ignore[union-attr]
    assert proc.returncode == 1 and out == b""
    assert err == b"error: --logprobs gives figures in the --json output: add --json\n", err
    assert not (tmp_path / "run").exists()  # no daemon was started either


@pytest.mark.parametrize("value", ["nan", "inf", "-0.1", "1"])
def test_the_corpus_modules_own_command_refuses_a_share_it_cannot_use(tmp_path: Path, value: str) -> None:
    """`python -m m31r.train.corpus --val-fraction nan` built a corpus that held nothing out."""
    r = subprocess.run([sys.executable, "-m", "m31r.train.corpus", str(tmp_path / "out"), str(tmp_path),
                        "--val-fraction", value], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and f"argument --val-fraction: {value} is not a share in [0, 1)" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()

"""The `m31r` commands as a new user meets them (session 46): `fim --file` on a file without a final line end, a
settings file naming a device this machine lacks, a --threads past any CPU's cores, and `bundle init` on a config
far larger than the machine's memory. Each refusal is one line, before any daemon, model or folder is made."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

M31R = [sys.executable, "-m", "m31r.cli"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*M31R, *args], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def test_fim_refuses_a_line_past_a_last_line_without_a_line_end(tmp_path: Path) -> None:
    """`fn main() {}` with no final line end is one line, as an editor shows it: `--line 2` put the cursor at that
    line's end, silently, instead of refusing the line as `--line 3` was. With a final line end, line 2 (empty)
    exists and the cursor is taken (here the next step, the daemon, is missing: no socket there)."""
    sock = tmp_path / "run" / "d.sock"
    for text, line, refused in (("fn main() {}", 2, "--line 2 is outside {f} (1 line)"),
                                ("fn main() {}\r\nx", 3, "--line 3 is outside {f} (2 lines)"),
                                ("fn main() {}\n", 2, None), ("fn main() {}\r", 2, None), ("", 1, None)):
        f = tmp_path / "main.rs"
        f.write_bytes(text.encode())
        r = cli("fim", "--file", str(f), "--line", str(line), "--column", "1", "--no-autostart", "--socket", str(sock))
        want = f"error: {refused.format(f=f)}\n" if refused else f"error: no daemon answers on {sock}: no socket there"
        assert r.returncode == 1 and r.stdout == "" and r.stderr.startswith(want), (text, r.stderr)
    assert not sock.parent.exists()


@pytest.fixture
def config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A config home of the test's own, for this process and the commands it starts; its daemon.toml's path."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "config" / "m31r").mkdir(parents=True)
    return tmp_path / "config" / "m31r" / "daemon.toml"


def test_a_settings_device_this_machine_lacks_names_the_file(config_home: Path, tiny_bundle, tmp_path: Path) -> None:
    """`device = "cuda"` in daemon.toml on a machine without CUDA: every autostarted daemon exited with `error:
    --device cuda: no CUDA device`, an option the user of `m31r generate` never passed, and `m31r doctor` called the
    file ok. Now the daemon's line names the file and setting, as the file's other errors do, and doctor fails it."""
    import torch

    from m31r import doctor

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: `device = \"cuda\"` is a good setting here")
    config_home.write_text('device = "cuda"\n')
    why = (f'{config_home}: `device = "cuda"`: no CUDA device (this torch is built without CUDA'
           if torch.version.cuda is None else f'{config_home}: `device = "cuda"`: no CUDA device (torch finds no')
    r = cli("generate", "fn ", "--socket", str(tmp_path / "run" / "d.sock"),
            env={"M31R_BUNDLE": str(tiny_bundle.path), "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.returncode == 1 and r.stdout == "", r.stderr
    assert r.stderr.splitlines()[-1].startswith(f"error: the daemon exited with code 1: {why}"), r.stderr
    check = doctor.check_settings(doctor.Context(tmp_path / "d.sock", "--socket", tiny_bundle.path, "--bundle"))
    assert check.level == "fail" and check.detail.startswith(why), check


def test_threads_past_any_cpu_are_refused_on_the_command_line_and_in_the_settings(config_home: Path) -> None:
    """`--threads 100000` (or `threads = 100000` in daemon.toml) killed the daemon as it loaded its model: a segfault,
    or `libgomp: Thread creation failed` from 16384, with no `m31rd:` line; beyond 64 bits, `Overflow when unpacking
    long long`. Refused as usage, before anything starts; doctor fails the file."""
    from m31r import daemon_config, doctor
    from m31r.cli import MAX_THREADS

    for n in (MAX_THREADS + 1, 1 << 70):  # (a daemon let through fails on the missing bundle, after torch's import)
        r = cli("daemon", "--threads", str(n), "--bundle", str(config_home.parent / "none"), "--socket",
                str(config_home.parent / "d.sock"))
        assert r.returncode == 2 and r.stdout == "", r.stderr
        assert r.stderr.endswith(f"Error: Invalid value for '--threads': {n} is more threads than any CPU has cores "
                                 f"(at most {MAX_THREADS})\n"), r.stderr
    config_home.write_text("threads = 100000\n")
    assert doctor.Settings.read().error == (f"{config_home}: `threads = 100000`: 100000 is more threads than any CPU "
                                            f"has cores (at most {MAX_THREADS})")
    config_home.write_text(f"threads = {MAX_THREADS}\n")
    assert daemon_config.read_defaults(config_home, *_daemon())["threads"] == MAX_THREADS


def test_a_decode_width_the_warm_up_cannot_probe_is_refused(config_home: Path) -> None:
    """The warm-up runs a forward pass at every width up to --decode-width: `--decode-width 1000000000` kept the daemon
    warming for ever while its memory grew. Refused as usage, on the command line and in daemon.toml."""
    from m31r import doctor
    from m31r.cli import MAX_DECODE_WIDTH

    r = cli("daemon", "--decode-width", str(MAX_DECODE_WIDTH + 1), "--bundle", str(config_home.parent / "none"),
            "--socket", str(config_home.parent / "d.sock"))
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert f"Invalid value for '--decode-width': {MAX_DECODE_WIDTH + 1} is not in the range 1<=x<={MAX_DECODE_WIDTH}" \
        in r.stderr, r.stderr
    config_home.write_text("decode_width = 1000000000\n")
    assert "1000000000 is not in the range" in (doctor.Settings.read().error or "")
    config_home.write_text(f"decode_width = {MAX_DECODE_WIDTH}\n")
    assert daemon_config_defaults(config_home)["decode_width"] == MAX_DECODE_WIDTH


def daemon_config_defaults(path: Path) -> dict:
    from m31r import daemon_config

    return daemon_config.read_defaults(path, *_daemon())


def _daemon() -> tuple:
    import click

    from m31r.cli import daemon

    return daemon, click.Context(daemon)


def test_bundle_init_refuses_a_config_larger_than_the_machines_memory(tmp_path: Path) -> None:
    """`n_layers: 1000000000000` (a slip) built small layer after small layer for hours, no allocation large enough
    to fail, until the machine swapped or the OOM killer ended it. Refused at once, OUT never made."""
    from m31r.cli import main

    config = tmp_path / "huge.yaml"
    config.write_text("n_layers: 1000000000000\nd_model: 16\nn_heads: 2\nffn_hidden: 32\nvocab_size: 300\n")
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["bundle", "init", str(config), str(out), "--seed", "1"])
    assert r.exit_code == 1 and r.stdout == "", r.output
    assert r.stderr.startswith(f"error: {config}: the model has 2,592,000,000,004,816 parameters: its float32 "
                               "weights take 9,655,952.5 GiB, more than this machine's "), r.stderr
    assert r.stderr.endswith(" GiB of memory: check the sizes in the config\n") and r.stderr.count("\n") == 1
    assert not out.exists()

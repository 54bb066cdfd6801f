"""The daemon's settings file ($XDG_CONFIG_HOME/m31r/daemon.toml): a daemon started by a client (autostart), a
service or by hand takes its option defaults from it, an option on the command line still wins, and a file that is
wrong stops the start with one line naming the file and the setting (which an autostarting client repeats). Before,
a daemon that `m31r generate`, an editor or a service started could only run on the built-in defaults."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon
from test_doctor import run_doctor, run_doctor_here

from m31r_protocol.blocking import status

M31R = [sys.executable, "-m", "m31r.cli"]


def settings(config_home: Path, text: str) -> Path:
    path = config_home / "m31r" / "daemon.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def home(tmp_path: Path, tiny_bundle) -> tuple[dict[str, str], Path]:
    """An environment whose config home is `tmp_path/config`, socket in a 0700 folder, bundle the tiny one."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "m31rd.sock"
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config"), "M31R_SOCKET": str(sock),
           "M31R_BUNDLE": str(tiny_bundle.path), "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    return env, sock


def test_an_autostarted_daemon_runs_on_the_settings(home, tmp_path: Path) -> None:
    env, sock = home
    path = settings(tmp_path / "config", 'threads = 1\ndtype = "float32"\nquant = "none"\ncache_mb = 64\n'
                                         "max-queue = 5\n")
    try:
        r = subprocess.run([*M31R, "generate", "fn main", "--max-tokens", "2"], capture_output=True, text=True,
                           timeout=180, env=env)
        assert r.returncode == 0, r.stderr
        st = status(sock, timeout=30)
        assert (st["threads"], st["dtype"], st["quant"], st["cache_budget_mb"]) == (1, "float32", None, 64.0), st
        log = (tmp_path / "state" / "m31r" / "m31rd.log").read_text()
        [ready] = [json.loads(line) for line in log.splitlines() if '"msg": "ready"' in line]
        assert ready["settings"] == str(path)
    finally:
        subprocess.run([*M31R, "stop"], capture_output=True, timeout=60, env=env)


def test_the_command_line_wins_over_the_settings(home, tiny_bundle, tmp_path: Path) -> None:
    env, sock = home
    path = settings(tmp_path / "elsewhere", "cache-mb = 64\nthreads = 2\n")
    # start_daemon passes --threads 1 (and fp32, no quantisation): the file's threads give way, its cache-mb applies.
    proc = start_daemon(tiny_bundle.path, sock, "--config", str(path), env=env)
    try:
        st = status(sock, timeout=30)
        assert (st["threads"], st["cache_budget_mb"]) == (1, 64.0), st
    finally:
        stop_daemon(proc)


BAD = [
    ("threads = 0\n", "`threads = 0`: 0 is not in the range x>=1."),
    ("thread = 2\n", "`thread` is not a daemon setting (did you mean `threads`?"),
    ('threads = "2"\n', '`threads = "2"`: expected a whole number'),
    ("threads = 1.5\n", "`threads = 1.5`: expected a whole number"),
    ("cache_mb = nan\n", "`cache_mb = nan`: nan is not a finite number"),
    ('quant = "int9"\n', "`quant = \"int9\"`: 'int9' is not one of 'auto', 'int8', 'int4', 'none'."),
    ("lookahead = true\n", "`lookahead = true`: expected a whole number"),
    ('socket = "/tmp/x.sock"\n', "`socket` is not read from the daemon settings: the clients must find the socket too"),
    ('bundle = "x"\n', "`bundle` is not read from the daemon settings: the bundle is chosen where the daemon is"),
    ("threads = \n", "are not TOML: "),
]


@pytest.mark.parametrize(("text", "why"), BAD, ids=[t.strip() for t, _ in BAD])
def test_a_wrong_setting_stops_the_start_in_one_line(home, tmp_path: Path, text: str, why: str) -> None:
    env, sock = home
    path = settings(tmp_path / "config", text)
    r = subprocess.run([*M31R, "daemon"], capture_output=True, text=True, timeout=120, env=env)
    assert (r.returncode, r.stdout) == (1, "")
    assert r.stderr.startswith(f"m31rd: {path}: {why}") or r.stderr.startswith(
        f"m31rd: the daemon settings {path} {why}"), r.stderr
    assert r.stderr.count("\n") == 1 and not sock.exists()


def test_an_autostarting_client_says_why_the_daemon_would_not_start(home, tmp_path: Path) -> None:
    env, sock = home
    path = settings(tmp_path / "config", "max_queue = 0\n")
    r = subprocess.run([*M31R, "generate", "fn", "--max-tokens", "2"], capture_output=True, text=True, timeout=120,
                       env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.splitlines()[-1] == (f"error: the daemon exited with code 1: {path}: `max_queue = 0`: 0 is not in "
                                         "the range x>=1."), r.stderr


def test_a_named_settings_file_must_exist_and_help_still_shows(home, tmp_path: Path) -> None:
    env, _ = home
    missing = tmp_path / "nope.toml"
    r = subprocess.run([*M31R, "daemon", "--config", str(missing)], capture_output=True, text=True, timeout=120,
                       env=env)
    assert (r.returncode, r.stderr) == (1, f"m31rd: cannot read the daemon settings {missing}: No such file or "
                                           "directory\n")
    settings(tmp_path / "config", "threads = 0\n")
    r = subprocess.run([*M31R, "daemon", "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and "--config" in r.stdout, r.stderr


def test_the_readmes_example_is_read_as_it_says(tmp_path: Path) -> None:
    import click

    from m31r import daemon_config
    from m31r.cli import daemon

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    example = readme.split("```toml\n", 1)[1].split("```", 1)[0]
    found = daemon_config.read_defaults(settings(tmp_path, example), daemon, click.Context(daemon))
    assert found == {"threads": 4, "quant": "int8", "cache_mb": 512.0, "beams": 1}


def test_doctor_reports_the_settings(tmp_path: Path) -> None:
    path = settings(tmp_path / "config", 'threads = 2\nquant = "int8"\n')  # run_doctor's config home
    _, checks = run_doctor(tmp_path)
    assert isinstance(checks, dict)
    assert checks["settings"]["level"] == "ok"
    assert checks["settings"]["detail"].startswith(f"{path}: daemons started here default to --threads 2, --quant "
                                                   "int8")
    settings(tmp_path / "config", "threads = 0\n")
    # (the same command in this process from here on: each subprocess run cost a torch import, ~2 s)
    code, checks = run_doctor_here(tmp_path)
    assert code == 1 and isinstance(checks, dict) and checks["settings"]["level"] == "fail"
    assert "`threads = 0`: 0 is not in the range x>=1." in checks["settings"]["detail"]
    path.unlink()
    _, checks = run_doctor_here(tmp_path)
    assert isinstance(checks, dict) and checks["settings"] == {
        "name": "settings", "level": "ok", "detail": f"no {path}: daemons run on their defaults and the options they "
                                                     "are given"}


def test_doctor_reports_the_precision_the_settings_choose(tmp_path: Path) -> None:
    """The bf16 line says what a daemon started here serves: the settings file's dtype and quant, not auto's."""
    settings(tmp_path / "config", 'dtype = "float32"\nquant = "none"\n')
    _, checks = run_doctor_here(tmp_path)
    assert isinstance(checks, dict)
    assert "the daemon serves fp32 activations with float weights as daemon.toml sets" in checks["bf16"]["detail"]

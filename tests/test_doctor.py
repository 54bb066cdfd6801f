"""`m31r doctor`: a healthy setup (a real daemon on a tmp socket) as a real subprocess; a corrupted bundle, an unsafe
socket folder and no daemon through the same click command in this process (each subprocess run cost a torch
import, ~2 s). Each run gets its own HOME and XDG_CONFIG_HOME, so the service and editor checks see an empty user
setup instead of this machine's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from m31r import doctor


def user_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("M31R_SOCKET", "M31R_BUNDLE")}
    # A fresh home, but the kernel build cache every other test shares: a build per doctor run cost ~3 s each.
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    env.update(HOME=str(tmp_path / "home"), XDG_CONFIG_HOME=str(tmp_path / "config"), XDG_CACHE_HOME=cache)
    return env


def _parse(code: int, out: str, as_json: bool) -> tuple[int, dict | str]:
    if not as_json:
        return code, out
    parsed = json.loads(out)
    assert parsed["ok"] == (code == 0), "exit status and `ok` agree"
    return code, {c["name"]: c for c in parsed["checks"]}


def run_doctor(tmp_path: Path, *args: str, as_json: bool = True) -> tuple[int, dict | str]:
    """`m31r doctor` as a real subprocess."""
    cmd = [sys.executable, "-m", "m31r.cli", "doctor", *args, *(["--json"] if as_json else [])]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=user_env(tmp_path))
    assert r.returncode in (0, 1), r.stderr  # 1: a check failed; anything else is a crash
    return _parse(r.returncode, r.stdout, as_json)


def run_doctor_here(tmp_path: Path, *args: str) -> tuple[int, dict]:
    """The same command and environment (user_env's) in this process, through click's runner, JSON output."""
    from click.testing import CliRunner

    from m31r.cli import main

    env: dict[str, str | None] = dict(user_env(tmp_path))
    env.update({k: None for k in os.environ if k not in env})  # the runner unsets these for the run
    r = CliRunner().invoke(main, ["doctor", *args, "--json"], env=env, catch_exceptions=False)
    assert r.exit_code in (0, 1), r.output  # 1: a check failed; anything else is a crash
    return _parse(r.exit_code, r.stdout, True)


@pytest.fixture(scope="module")
def daemon(shared_daemon):
    return shared_daemon  # its socket is in a run/ folder the daemon created 0700


def test_healthy_setup_exits_0_and_says_ok(daemon, tiny_bundle, tmp_path: Path) -> None:
    proc, sock = daemon
    code, text = run_doctor(tmp_path, "--socket", str(sock), "--bundle", str(tiny_bundle.path), as_json=False)
    assert code == 0, text
    lines = {line.split()[1]: line for line in text.splitlines()}
    for name in ("bundle", "socket", "daemon"):
        assert lines[name].startswith("ok "), lines[name]
    assert tiny_bundle.model_id in lines["bundle"] and "checksums match" in lines["bundle"]
    assert f"pid {proc.pid} serves {tiny_bundle.model_id}" in lines["daemon"]
    assert "mode 0700" in lines["socket"]
    for name in ("cpu", "compiler", "kernels", "bf16", "service"):
        assert lines[name].split()[0] in ("ok", "warn"), lines[name]  # depends on the machine, never a fail
    # One line per editor found on the machine (Emacs where CI installs it), or one saying none was.
    editors = {"vscode", "neovim", "helix", "emacs", "editors"} & set(lines)
    assert editors and ("editors" not in editors or len(editors) == 1), text
    for name in editors:
        assert lines[name].split()[0] in ("ok", "warn"), lines[name]
    assert "not installed" in lines["service"]  # an empty HOME: no units


def test_the_daemons_request_count_is_worded_for_its_number(tiny_bundle, tmp_path: Path) -> None:
    """A daemon that had served one request was "up 3 s, 1 requests"."""
    from daemon_util import start_daemon, stop_daemon

    sock = tmp_path / "run" / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock)
    try:
        details = []
        for _ in range(2):
            subprocess.run([sys.executable, "-m", "m31r.cli", "generate", "fn", "--max-tokens", "1", "--no-autostart",
                            "--socket", str(sock)], check=True, capture_output=True, timeout=60)
            details.append(run_doctor_here(tmp_path, "--socket", str(sock), "--bundle", str(tiny_bundle.path))[1]
                           ["daemon"]["detail"])
    finally:
        stop_daemon(proc)
    assert details[0].endswith(" s, 1 request") and details[1].endswith(" s, 2 requests"), details


def test_corrupted_bundle_fails_and_says_why(corrupt_bundle: Path, tmp_path: Path) -> None:
    bad = corrupt_bundle
    code, checks = run_doctor_here(tmp_path, "--socket", str(tmp_path / "run" / "d.sock"), "--bundle", str(bad))
    assert code == 1
    assert checks["bundle"]["level"] == "fail"
    assert "model.safetensors" in checks["bundle"]["detail"] and "checksum mismatch" in checks["bundle"]["detail"]
    assert [c for c in checks.values() if c["level"] == "fail"] == [checks["bundle"]]


def test_socket_folder_open_to_others_fails(tiny_bundle, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    code, checks = run_doctor_here(tmp_path, "--socket", str(shared / "d.sock"), "--bundle", str(tiny_bundle.path))
    assert code == 1
    assert checks["socket"]["level"] == "fail"
    assert "0777" in checks["socket"]["detail"] and "0700" in checks["socket"]["detail"]
    # No daemon answers there, and none will start there either: the daemon check said clients "start one on first
    # use", which they cannot (the daemon refuses the folder).
    assert checks["daemon"]["detail"] == (f"none answers on {shared / 'd.sock'}, and none can start there until "
                                          "the socket check passes")


def test_a_folder_as_the_socket_fails_the_daemon_check_too(tiny_bundle, tmp_path: Path) -> None:
    """`--socket DIR`: connecting to a folder is refused (ECONNREFUSED), which the daemon check took for "no daemon
    yet, clients start one on first use"; no daemon can listen on a folder."""
    run = tmp_path / "run"
    (run / "sub").mkdir(parents=True, mode=0o700)
    run.chmod(0o700)
    code, checks = run_doctor_here(tmp_path, "--socket", str(run / "sub"), "--bundle", str(tiny_bundle.path))
    assert code == 1 and checks["socket"]["level"] == "fail"
    assert checks["socket"]["detail"].startswith(f"{run / 'sub'} is a folder, not a socket path: name the socket in "
                                                 f"it, such as {run / 'sub' / 'm31r' / 'm31rd.sock'}")
    assert checks["daemon"] == {"name": "daemon", "level": "warn", "detail": f"none answers on {run / 'sub'}, and "
                                "none can start there until the socket check passes"}


def test_no_daemon_is_a_warning_not_a_failure(tiny_bundle, tmp_path: Path) -> None:
    sock = tmp_path / "run" / "d.sock"
    code, checks = run_doctor_here(tmp_path, "--socket", str(sock), "--bundle", str(tiny_bundle.path))
    assert checks["daemon"]["level"] == "warn" and "none answers" in checks["daemon"]["detail"]
    assert checks["socket"]["level"] == "ok" and "does not exist yet" in checks["socket"]["detail"]
    assert code == 0, [c for c in checks.values() if c["level"] == "fail"]


def test_client_side_checks_do_not_import_torch(tmp_path: Path) -> None:
    code = ("import sys; from pathlib import Path; from m31r import doctor as d; "
            f"ctx = d.Context.create(Path({str(tmp_path / 'd.sock')!r}), Path('release')); "
            "[f(ctx) for f in (d.check_cpu, d.check_socket, d.check_daemon, d.check_service, *d.EDITOR_CHECKS)]; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=user_env(tmp_path))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd units")
def test_half_installed_service_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    units = tmp_path / "systemd" / "user"
    units.mkdir(parents=True)
    (units / "m31rd.socket").write_text("[Socket]\n")
    ctx = doctor.Context.create(tmp_path / "d.sock", tmp_path)
    check = doctor.check_service(ctx)
    assert check.level == "fail" and "m31rd.service" in check.detail
    (units / "m31rd.service").write_text(f"[Service]\nExecStart={tmp_path / 'gone' / 'm31r'} daemon\n")
    check = doctor.check_service(ctx)
    assert check.level == "fail" and "no longer exists" in check.detail


def test_editor_configs_are_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    ctx = doctor.Context.create(tmp_path / "d.sock", tmp_path)
    (tmp_path / "helix").mkdir()
    (tmp_path / "helix" / "languages.toml").write_text('[language-server.rust-analyzer]\ncommand = "rust-analyzer"\n')
    assert doctor.check_helix(ctx).level == "warn"
    shutil.copyfile(Path(__file__).parents[1] / "editors" / "helix" / "languages.toml",
                    tmp_path / "helix" / "languages.toml")
    assert doctor.check_helix(ctx).level == "ok"
    nvim = tmp_path / "nvim" / "lua" / "plugins"
    nvim.mkdir(parents=True)
    (nvim / "lsp.lua").write_text('return { "neovim/nvim-lspconfig" }\n')
    assert doctor.check_neovim(ctx).level == "warn"
    (nvim / "m31r.lua").write_text('return { dir = "~/src/m31r/editors/neovim", opts = {} }\n')
    assert doctor.check_neovim(ctx).level == "ok"


def fake_systemd_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A HOME, config and runtime dir of the test's own, and a systemctl that says enabled and active: the user's
    systemd is never asked."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "run").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    monkeypatch.delenv("M31R_SOCKET", raising=False)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text("#!/bin/sh\ncase \"$*\" in *is-enabled*) echo enabled;; *) echo active;; esac\n")
    (fake / "systemctl").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd units")
def test_service_on_another_socket_than_the_clients_is_a_warning_naming_both(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor said `ok` for a service the clients here never reach (installed before M31R_SOCKET was set, or from a
    shell with another): their first request starts a second daemon beside it. It names the service's socket, and
    where that is not the clients' one, warns with both and the way out."""
    from m31rd import service

    fake_systemd_user(tmp_path, monkeypatch)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "metadata.json").write_text("{}\n")
    mine = tmp_path / "mine" / "m31rd.sock"
    monkeypatch.setenv("M31R_SOCKET", str(mine))
    service.install("systemd", bundle, echo=lambda _: None)
    check = doctor.check_service(doctor.Context.create(None, bundle))  # this shell's clients: $M31R_SOCKET
    assert check.level == "ok" and check.detail.endswith(f"; it listens on {mine}"), check.detail
    monkeypatch.delenv("M31R_SOCKET")  # a shell without it: its clients use the default socket
    default = tmp_path / "run" / "m31r" / "m31rd.sock"
    check = doctor.check_service(doctor.Context.create(None, bundle))
    assert check.level == "warn", check.detail
    assert f"it listens on {mine}, but clients here use {default} (default)" in check.detail
    assert f"set M31R_SOCKET={mine}, or move the service with `m31r service install --force`" in check.detail
    # --socket names the clients' socket as it does for every other check.
    assert doctor.check_service(doctor.Context.create(mine, bundle)).level == "ok"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="systemd units")
def test_service_whose_command_path_has_percent_and_dollar_is_ok(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`m31r service install` escapes % and $ in ExecStart= as systemd wants (%% and $$); doctor read the escaped
    path back as it stood and reported a working service's command as gone."""
    from m31rd import service

    fake_systemd_user(tmp_path, monkeypatch)
    venv = tmp_path / "100% $HOME venv" / "bin"
    venv.mkdir(parents=True)
    exe = venv / "m31r"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    units = tmp_path / "config" / "systemd" / "user"
    units.mkdir(parents=True)
    for name, text in service.render_systemd([str(exe)], bundle).items():
        (units / name).write_text(text)
    escaped = str(exe).replace("%", "%%")  # systemd reads $ as itself in the command
    assert f'ExecStart="{escaped}" daemon' in (units / "m31rd.service").read_text()
    ctx = doctor.Context.create(tmp_path / "run" / "m31r" / "m31rd.sock", bundle)  # the one the units listen on
    check = doctor.check_service(ctx)
    assert check.level == "ok", check.detail
    exe.unlink()  # and a command that really is gone is still reported, under its real name
    check = doctor.check_service(ctx)
    assert check.level == "fail" and f"runs {exe}, which no longer exists" in check.detail


def test_systemd_unquote() -> None:
    assert doctor.systemd_unquote("/a/100%%/$$x") == "/a/100%/$x"
    assert doctor.systemd_unquote("/plain") == "/plain"
    assert doctor.systemd_unquote("%h/bin/m31r") is None  # a specifier: only systemd knows its value
    assert doctor.systemd_unquote("$HOME/m31r") is None


def test_a_socket_folder_that_cannot_be_made_fails(tiny_bundle, tmp_path: Path) -> None:
    """The socket check said `ok: the daemon creates it 0700` for a folder no daemon could make (its nearest existing
    ancestor a file, or not writable: a read-only XDG_RUNTIME_DIR)."""
    (tmp_path / "afile").write_text("")
    sock = tmp_path / "afile" / "m31r" / "d.sock"
    code, checks = run_doctor_here(tmp_path, "--socket", str(sock), "--bundle", str(tiny_bundle.path))
    assert code == 1
    assert checks["socket"]["level"] == "fail", checks["socket"]
    assert f"its folder cannot be created: {tmp_path / 'afile'} is not a folder" in checks["socket"]["detail"]
    assert checks["daemon"]["level"] == "fail" and "a folder on its path is a file" in checks["daemon"]["detail"]

"""Audit of running M31R as a user service (session 44): `m31r service install|uninstall` as a user would run them on
a laptop (odd paths, a daemon already serving, a second install, no reachable systemd) and `m31r doctor`'s checks
each naming the fix. Units are checked by systemd-analyze, daemons are real; HOME, XDG_CONFIG_HOME and
XDG_RUNTIME_DIR are the test's own, so nothing reaches the user's systemd or ~/.config."""

from __future__ import annotations

import os
import plistlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_service import fresh_home, require

from m31r import doctor
from m31rd import service

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty HOME (with a space in its path, as on a laptop's "/Users/Jo Doe"), config and runtime dir, and no
    session bus: the real systemctl, where a test runs it, finds no user manager to change. In a short temporary
    folder, not tmp_path: systemd-analyze also reads the system's user units (gpg-agent's sockets under
    $XDG_RUNTIME_DIR), and refuses them when the runtime dir is too deep for a socket's 108-byte path, as under
    pytest-xdist's per-worker tmp_path."""
    monkeypatch.delenv("DBUS_SESSION_BUS_ADDRESS", raising=False)
    top = Path(tempfile.mkdtemp(prefix="m31r-"))
    try:
        yield fresh_home(top / "Jo Doe", monkeypatch)
    finally:
        shutil.rmtree(top, ignore_errors=True)


def fake_bundle(where: Path) -> Path:
    where.mkdir(parents=True)
    (where / "metadata.json").write_text("{}\n")
    return where


def verify(units: Path) -> subprocess.CompletedProcess[str]:
    """systemd-analyze's verdict on the two units in `units` (it also checks that ExecStart='s command exists)."""
    require("systemd-analyze")
    return subprocess.run(["systemd-analyze", "verify", "--user", "m31rd.socket", "m31rd.service"],
                          capture_output=True, text=True, timeout=60, cwd=units)


def write_units(units: Path, command: list[str], bundle: Path) -> Path:
    units.mkdir(parents=True, exist_ok=True)
    for name, text in service.render_systemd(command, bundle).items():
        (units / name).write_text(text)
    return units / "m31rd.service"


def test_a_command_path_with_a_dollar_runs_under_systemd(home: Path, tmp_path: Path) -> None:
    """systemd expands variables in ExecStart='s arguments, not in its command: the `$$` install wrote into a
    command path (a venv under "$work") named a file that does not exist, and the unit could not start. doctor
    reads the command back as it is."""
    exe = tmp_path / "100% $work venv" / "bin" / "m31r"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    bundle = fake_bundle(tmp_path / "$b")
    unit = write_units(home / "config" / "systemd" / "user", [str(exe)], bundle)
    r = verify(unit.parent)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    [line] = [x for x in unit.read_text().splitlines() if x.startswith("ExecStart=")]
    words = shlex.split(line.removeprefix("ExecStart="))
    assert doctor.systemd_unquote(words[0], escapes="%") == str(exe)
    assert doctor.systemd_unquote(words[-1]) == str(bundle)  # an argument: `$$`, as systemd wants there
    assert doctor._systemd_state(service.unit_paths("systemd")).level != "fail"
    exe.unlink()
    check = doctor._systemd_state(service.unit_paths("systemd"))
    assert check.level == "fail" and f"runs {exe}, which no longer exists" in check.detail, check.detail


@pytest.mark.parametrize("name", ["it's", 'q"uote', "back\\slash", "tab\there"])
def test_a_command_path_systemd_refuses_is_refused_before_writing(home: Path, tmp_path: Path, name: str) -> None:
    """systemd refuses a command path with a quote, a backslash or a control character however it is quoted
    ("Executable name contains special characters"): install wrote such a unit, which never started. Now it says
    why and writes nothing."""
    exe = tmp_path / name / "bin" / "m31r"
    exe.parent.mkdir(parents=True)
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    bundle = fake_bundle(tmp_path / "bundle")
    with pytest.raises(ValueError, match="systemd refuses to run a command whose path holds a quote, a backslash"):
        service.render_systemd([str(exe)], bundle)
    # What the old quoting wrote: systemd refuses it.
    units = tmp_path / "old"
    write_units(units, ["/bin/sh"], bundle)
    old = f"ExecStart={service.systemd_quote(str(exe))}"
    (units / "m31rd.service").write_text((units / "m31rd.service").read_text().replace("ExecStart=/bin/sh", old))
    assert "special characters" in verify(units).stderr


BUNDLE_NAMES = ["my models", "it's", 'say "hi"', "100% %h", "$HOME ${X}", "ünï ☃", "semi;colon", "back\\slash"]


@pytest.mark.parametrize("name", BUNDLE_NAMES)
def test_odd_bundle_and_socket_paths_reach_systemd_and_launchd_as_they_are(home: Path, tmp_path: Path,
                                                                          name: str) -> None:
    """A bundle (and a socket) path with spaces, quotes, systemd's `%` specifiers, `$`, non-ASCII or a backslash:
    the units pass systemd-analyze and spell the path back exactly; the plist round-trips through plistlib."""
    bundle = fake_bundle(tmp_path / name / "bundle")
    sock = home / "s" / name / "d.sock"
    paths = service.install("systemd", bundle, socket=sock, echo=lambda _: None)
    r = verify(paths[0].parent)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    [line] = [x for x in paths[1].read_text().splitlines() if x.startswith("ExecStart=")]
    assert doctor.systemd_unquote(shlex.split(line.removeprefix("ExecStart="))[-1]) == str(bundle.resolve())
    assert service.installed_socket("systemd") == sock
    (plist,) = service.install("launchd", bundle, socket=sock, echo=lambda _: None)
    with plist.open("rb") as f:
        args = plistlib.load(f)["ProgramArguments"]
    assert args[args.index("--bundle") + 1] == str(bundle.resolve()) and args[args.index("--socket") + 1] == str(sock)


def test_a_failing_service_is_not_restarted_for_ever() -> None:
    """A daemon that cannot start (its bundle moved, a bad daemon.toml) exits 1 and Restart=on-failure starts it
    again after RestartSec=2s. systemd's default start limit (5 in 10 s) never tripped, since each try spends
    seconds importing torch first: the unit restarted for ever. Five tries, however slow (8 s each), now fit its
    limit's interval."""
    text = (REPO / "m31rd" / "units" / "m31rd.service").read_text()
    unit = text.split("[Service]")[0]
    settings = dict(re.findall(r"^(StartLimitIntervalSec|StartLimitBurst)=(\d+)\s*$", unit, re.M))
    restart_s = int(re.search(r"^RestartSec=(\d+)s?$", text, re.M).group(1))
    assert len(settings) == 2, "StartLimitIntervalSec= and StartLimitBurst= in [Unit]"
    assert int(settings["StartLimitBurst"]) * (restart_s + 8) <= int(settings["StartLimitIntervalSec"])


def test_reinstalling_with_another_bundle_says_the_running_daemon_keeps_the_old(home: Path, tmp_path: Path) -> None:
    """`install --force --bundle NEW` then `enable --now` left a socket-activated daemon serving the old bundle,
    and install did not say so."""
    service.install("systemd", fake_bundle(tmp_path / "old"), echo=lambda _: None)
    out: list[str] = []
    service.install("systemd", fake_bundle(tmp_path / "new"), force=True, echo=out.append)
    assert ("(m31rd.service changed: a daemon it started runs the old command and bundle until `m31r stop` after "
            "the daemon-reload; the next request starts the new one)") in out, out
    out = []
    service.install("systemd", tmp_path / "new", echo=out.append)  # the same again: nothing to say
    assert not any("m31rd.service changed" in line for line in out), out


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_install_where_a_daemon_already_serves_says_to_stop_it(home: Path, tmp_path: Path, shared_daemon,
                                                               kind: str) -> None:
    """A daemon started by hand (or by a client) on the socket the service is to listen on: on `enable --now`,
    m31rd.socket unlinks its socket file and binds the path, leaving that daemon running for no one; a launchd
    agent's daemon finds the path taken and is retried every 10 s. install now names it and the command that stops
    it, and leaves it running."""
    proc, sock = shared_daemon
    out: list[str] = []
    service.install(kind, fake_bundle(tmp_path / "bundle"), socket=sock, echo=out.append)
    notes = [line for line in out if line.startswith("note:")]
    assert len(notes) == 1 and f"a daemon (pid {proc.pid}) already serves {sock} outside the service" in notes[0]
    assert f"`m31r stop --socket {shlex.quote(str(sock))}` before starting the service" in notes[0]
    assert proc.poll() is None
    out = []
    service.install(kind, tmp_path / "bundle", socket=sock.with_name("none.sock"), force=True, echo=out.append)
    assert not any(line.startswith("note:") for line in out), out


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_a_dry_run_says_it_too(home: Path, tmp_path: Path, shared_daemon, kind: str) -> None:
    """`install --dry-run` showed the files and said nothing of a daemon already on the path (session 47)."""
    proc, sock = shared_daemon
    out: list[str] = []
    paths = service.install(kind, fake_bundle(tmp_path / "bundle"), dry_run=True, socket=sock, echo=out.append)
    notes = [line for line in out if line.startswith("note:")]
    assert len(notes) == 1 and f"a daemon (pid {proc.pid}) already serves {sock} outside the service" in notes[0]
    assert not any(p.exists() for p in paths)


def test_uninstall_that_cannot_reach_systemd_says_so(home: Path, tmp_path: Path) -> None:
    """uninstall removes the files whether or not `systemctl --user disable --now` worked; where no user manager
    answered (a shell under su, ssh without a session) it said nothing, and a listening m31rd.socket stayed loaded
    with no file left to say why."""
    require("systemctl")
    paths = service.install("systemd", fake_bundle(tmp_path / "bundle"), echo=lambda _: None)
    out: list[str] = []
    assert service.uninstall("systemd", echo=out.append) == paths
    assert not any(p.exists() for p in paths)
    assert any(line.startswith("note: `systemctl --user disable --now m31rd.socket m31rd.service` failed") and
               "`systemctl --user stop m31rd.socket m31rd.service`" in line for line in out), out


# -- doctor ----------------------------------------------------------------------------------------------------------


def test_no_compiler_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    check = doctor.check_compiler(None)  # type: ignore[arg-type]  # it reads no context
    assert check.level == "warn" and "install one (`apt-get install gcc`" in check.detail and "set CC" in check.detail


def test_a_kernel_cache_that_cannot_take_the_build_is_a_warning(tmp_path: Path) -> None:
    """A cache folder the build cannot be published to costs the cache, not the kernels: they load from a private
    folder, and every daemon start compiles them again. doctor said `ok`, with that private folder as the path."""
    (tmp_path / "afile").write_text("")
    code = ("from pathlib import Path; from m31r import doctor; "
            "c = doctor.check_kernels(doctor.Context.create(Path('/nonexistent/d.sock'), Path('release'))); "
            "print(c.level); print(c.detail)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "afile"), "XDG_CONFIG_HOME": str(tmp_path / "config"),
           "HOME": str(tmp_path)}
    env.pop("M31R_KERNELS", None)
    env.pop("M31R_NATIVE", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr
    level, detail = r.stdout.split("\n", 1)
    if "native kernels off" in detail:
        pytest.skip(f"no native kernels on this machine: {detail}")
    cache = tmp_path / "afile" / "m31r" / "kernels"
    assert level == "warn", detail
    assert f"not cached: {cache} cannot take the build ({tmp_path / 'afile'} is not a folder)" in detail
    assert "every daemon start compiles them again" in detail and "XDG_CACHE_HOME" in detail


# The daemon, speaking another protocol version (as another m31r's would).
OTHER_VERSION = """
import sys
import m31r_protocol.messages as m
m.PROTOCOL_VERSION += 1
from m31r.cli import main
sys.argv[0] = "m31r"
main()
"""


def test_a_daemon_of_another_version_names_its_pid_and_the_way_out(tiny_bundle, tmp_path: Path) -> None:
    """doctor said "something answers ..., but not as this m31r's daemon does: unexpected handshake reply 'error'"
    for an older m31r's daemon on the socket (after an upgrade, say): not what it is, nor how to end it, which
    `m31r stop` of this m31r cannot (it says Hello first)."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    sock = run / "d.sock"
    cmd = [sys.executable, "-c", OTHER_VERSION, "daemon", "--bundle", str(tiny_bundle.path), "--socket", str(sock),
           "--threads", "1", "--dtype", "float32", "--quant", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    try:
        ctx = doctor.Context.create(sock, tiny_bundle.path)
        t0 = time.monotonic()
        while (check := doctor.check_daemon(ctx)).level != "fail":  # until it listens (a warning before that)
            assert proc.poll() is None and time.monotonic() - t0 < 120, check
            time.sleep(0.1)
        assert check.detail.startswith(f"another m31r's daemon answers on {sock} (client speaks protocol "), check
        if sys.platform.startswith("linux"):
            assert f"`kill {proc.pid}` ends it (gracefully)" in check.detail, check.detail
    finally:
        proc.terminate()
        proc.wait(60)

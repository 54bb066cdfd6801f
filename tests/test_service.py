"""Running the daemon as a user service: unit templates, `m31r service install|uninstall`, systemd socket
activation (systemd-socket-activate) and the READY=1 notification.

systemd-analyze and systemd-socket-activate come from Debian's `systemd` package (`apt-get install systemd`);
the tests that need them are skipped on macOS and fail on a Linux without them."""

from __future__ import annotations

import asyncio
import json
import os
import plistlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from click.testing import CliRunner

from m31rd import service

if TYPE_CHECKING:
    from m31r_protocol.client import Client

REPO = Path(__file__).resolve().parent.parent
UNITS = REPO / "m31rd" / "units"


def require(binary: str) -> None:
    """systemd's tools: skipped where systemd cannot exist (macOS), a failure on Linux where they are just
    not installed, so a CI image without them cannot pass by skipping."""
    if shutil.which(binary):
        return
    if sys.platform.startswith("linux"):
        pytest.fail(f"{binary} is not installed: apt-get install systemd (Debian/Ubuntu)")
    pytest.skip(f"{binary} is part of systemd, which {sys.platform} does not have")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty HOME, XDG_CONFIG_HOME and XDG_RUNTIME_DIR: install/uninstall never touch the real ones."""
    return fresh_home(tmp_path / "home", monkeypatch)


def fresh_home(h: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """`h` made an empty HOME with its config and runtime folders, set as HOME, XDG_CONFIG_HOME and XDG_RUNTIME_DIR."""
    (h / "config").mkdir(parents=True)
    (h / "run").mkdir(mode=0o700)
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(h / "config"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(h / "run"))
    monkeypatch.delenv("M31R_SOCKET", raising=False)
    return h


@pytest.fixture
def fake_bundle(tmp_path: Path) -> Path:
    """Enough of a bundle for install (which only checks metadata.json); the name needs quoting in units."""
    b = tmp_path / "my models" / "100% tiny"
    b.mkdir(parents=True)
    (b / "metadata.json").write_text("{}\n")
    return b


def test_socket_unit_template():
    text = (UNITS / "m31rd.socket").read_text()
    assert "ListenStream=%t/m31r/m31rd.sock" in text
    assert "SocketMode=0600" in text and "DirectoryMode=0700" in text
    service_text = (UNITS / "m31rd.service").read_text()
    assert "Type=notify" in service_text and "Restart=on-failure" in service_text
    assert "ExecStart=@M31R@ daemon --bundle @BUNDLE@" in service_text
    # Only the ExecStart line is filled in: an installed unit's comments show no paths of this machine.
    assert [line for line in service_text.splitlines() if "@" in line] == ["ExecStart=@M31R@ daemon --bundle @BUNDLE@"]


def test_systemd_quote():
    q = service.systemd_quote
    assert q("/usr/bin/m31r") == "/usr/bin/m31r"
    assert q("/a b/c") == '"/a b/c"'
    assert q("100%") == "100%%"
    assert q("$HOME") == "$$HOME"
    assert q('a"b\\c') == '"a\\"b\\\\c"'
    with pytest.raises(ValueError):
        q("a\nb")


def test_install_systemd(home: Path, fake_bundle: Path):
    out: list[str] = []
    paths = service.install("systemd", fake_bundle, echo=out.append)
    unit_dir = home / "config" / "systemd" / "user"
    assert paths == [unit_dir / "m31rd.socket", unit_dir / "m31rd.service"]
    svc = (unit_dir / "m31rd.service").read_text()
    exec_start = next(line for line in svc.splitlines() if line.startswith("ExecStart="))
    cmd = service.m31r_command()
    assert exec_start.startswith(f"ExecStart={cmd[0]} ")
    assert Path(cmd[0]).is_absolute()
    assert f'--bundle "{str(fake_bundle.resolve()).replace("%", "%%")}"' in exec_start
    assert "@" not in exec_start
    assert (unit_dir / "m31rd.socket").read_text() == (UNITS / "m31rd.socket").read_text()
    assert any("systemctl --user daemon-reload && systemctl --user enable --now m31rd.socket" in line for line in out)


def test_rendered_systemd_units_verify_clean(home: Path, fake_bundle: Path):
    require("systemd-analyze")
    paths = service.install("systemd", fake_bundle, echo=lambda _: None)
    r = subprocess.run(["systemd-analyze", "verify", "--user", *map(str, paths)], capture_output=True, text=True,
                       timeout=60, cwd=paths[0].parent)
    assert r.returncode == 0 and not r.stdout.strip() and not r.stderr.strip(), r.stdout + r.stderr


def test_systemd_analyze_does_report_problems(home: Path, tmp_path: Path):
    """Guards the test above: verify must fail loudly on the kind of mistake a template could contain."""
    require("systemd-analyze")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "m31rd.socket").write_text((UNITS / "m31rd.socket").read_text())
    (bad / "m31rd.service").write_text((UNITS / "m31rd.service").read_text()
                                       .replace("@M31R@", "/nonexistent/m31r").replace("@BUNDLE@", "/b")
                                       .replace("Type=notify", "Type=notify\nNoSuchKey=1"))
    r = subprocess.run(["systemd-analyze", "verify", "--user", "m31rd.socket", "m31rd.service"],
                       capture_output=True, text=True, timeout=60, cwd=bad)
    assert r.returncode != 0
    assert "NoSuchKey" in r.stderr and "/nonexistent/m31r" in r.stderr


def test_install_launchd(home: Path, fake_bundle: Path):
    out: list[str] = []
    paths = service.install("launchd", fake_bundle, echo=out.append)
    plist_path = home / "Library" / "LaunchAgents" / "dev.m31r.m31rd.plist"
    assert paths == [plist_path]
    with plist_path.open("rb") as f:
        plist = plistlib.load(f)
    cmd = service.m31r_command()
    sock = home / "run" / "m31r" / "m31rd.sock"
    assert plist["Label"] == "dev.m31r.m31rd"
    log = home / "Library" / "Logs" / "m31r" / "m31rd.log"
    # The daemon writes its log itself and rotates it (nothing on macOS rotates an agent's); launchd's own files
    # catch only what reaches stdout and stderr.
    assert plist["ProgramArguments"] == [*cmd, "daemon", "--bundle", str(fake_bundle.resolve()),
                                          "--socket", str(sock), "--log-file", str(log)]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"Crashed": True}  # not after an exit that would fail again (test_leftovers_s45)
    stderr_log = str(log.with_name("m31rd.stderr.log"))
    assert plist["StandardErrorPath"] == stderr_log and plist["StandardOutPath"] == stderr_log
    assert log.parent.is_dir()  # launchd creates the log file, not its folder
    assert plist["Umask"] == 0o077
    assert not any("@" in str(v) for v in [*plist["ProgramArguments"], plist["StandardErrorPath"]])
    assert any(f"launchctl bootstrap gui/{os.getuid()} {plist_path}" in line for line in out)
    if shutil.which("plutil"):  # macOS
        subprocess.run(["plutil", "-lint", str(plist_path)], check=True, capture_output=True)


def _listen_stream(unit: Path) -> str:
    [line] = [x for x in unit.read_text().splitlines() if x.startswith("ListenStream=")]
    return line.removeprefix("ListenStream=")


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_install_listens_where_the_clients_look(home: Path, fake_bundle: Path, monkeypatch: pytest.MonkeyPatch,
                                                kind: str):
    """The service listens on the socket this shell's clients use: $M31R_SOCKET, or install's --socket. The systemd
    socket unit always listened on %t/m31r/m31rd.sock: with M31R_SOCKET set in the profile, every client looked
    elsewhere, found no daemon and autostarted a second one beside the service."""
    sock = home / "my socks" / "100% d.sock"  # a space and a systemd specifier's %
    monkeypatch.setenv("M31R_SOCKET", str(sock))
    out: list[str] = []
    paths = service.install(kind, fake_bundle, echo=out.append)
    if kind == "systemd":
        assert _listen_stream(paths[0]) == str(sock).replace("%", "%%")
        if shutil.which("systemd-analyze"):  # the path parses as a socket address (tested fully above)
            r = subprocess.run(["systemd-analyze", "verify", "--user", *map(str, paths)], capture_output=True,
                               text=True, timeout=60, cwd=paths[0].parent)
            assert r.returncode == 0 and not r.stderr.strip(), r.stderr
    else:
        with paths[0].open("rb") as f:
            args = plistlib.load(f)["ProgramArguments"]
        assert args[args.index("--socket") + 1] == str(sock)
    assert service.installed_socket(kind) == sock  # what doctor reads back
    assert f"the service listens on {sock} (from $M31R_SOCKET)" in out
    # --socket wins over M31R_SOCKET, its `~` expanded as the clients' --socket has it.
    other = home / "other.sock"
    out = []
    service.install(kind, fake_bundle, socket="~/other.sock", force=True, echo=out.append)
    assert service.installed_socket(kind) == other
    # `enable --now` leaves a socket unit that is already listening where it was: the way to move it is said.
    assert any("systemctl --user restart m31rd.socket" in line for line in out) == (kind == "systemd"), out
    # Without either, the default; systemd spells it %t/m31r/m31rd.sock, so the unit is the template as it was.
    monkeypatch.delenv("M31R_SOCKET")
    service.install(kind, fake_bundle, force=True, echo=lambda _: None)
    assert service.installed_socket(kind) == home / "run" / "m31r" / "m31rd.sock"
    if kind == "systemd":
        assert paths[0].read_text() == (UNITS / "m31rd.socket").read_text()


@pytest.mark.parametrize("source", ["--socket", "M31R_SOCKET"])
def test_the_installed_socket_units_comment_is_true_for_its_path(home: Path, fake_bundle: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, source: str):
    """The unit said "%t is $XDG_RUNTIME_DIR (/run/user/UID): the path every m31r client uses by default" above a
    ListenStream= of another path, as if clients would find the service there without being told."""
    sock = home / "socks" / "d.sock"
    if source == "M31R_SOCKET":
        monkeypatch.setenv("M31R_SOCKET", str(sock))
    service.install("systemd", fake_bundle, socket=sock if source == "--socket" else None, echo=lambda _: None)
    text = (home / "config" / "systemd" / "user" / "m31rd.socket").read_text()
    comments = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert "%t is" not in comments and "uses by default" not in comments, comments
    assert (f"# ListenStream= is {sock}: the socket M31R_SOCKET or `m31r service install --socket` named,\n# not "
            "the default %t/m31r/m31rd.sock ($XDG_RUNTIME_DIR/m31r/m31rd.sock), so m31r clients find it\n# only with "
            "M31R_SOCKET (or --socket) set to it.") in comments, comments
    assert _listen_stream(home / "config" / "systemd" / "user" / "m31rd.socket") == str(sock)
    # The default socket keeps the template's own comment, which is true of it.
    service.install("systemd", fake_bundle, socket=home / "run" / "m31r" / "m31rd.sock", force=True,
                    echo=lambda _: None)
    assert (home / "config" / "systemd" / "user" / "m31rd.socket").read_text() == (UNITS / "m31rd.socket").read_text()


def test_install_refuses_a_socket_no_client_could_share(home: Path, fake_bundle: Path,
                                                        monkeypatch: pytest.MonkeyPatch):
    """A relative M31R_SOCKET names a different socket in each client's working folder; a path too long for a Unix
    socket can never be listened on. Both are refused before anything is written."""
    monkeypatch.setenv("M31R_SOCKET", "m31rd.sock")
    with pytest.raises(ValueError, match="M31R_SOCKET=m31rd.sock is a relative path"):
        service.install("systemd", fake_bundle, echo=lambda _: None)
    monkeypatch.delenv("M31R_SOCKET")
    with pytest.raises(ValueError, match="a Unix socket's path holds at most"):
        service.install("launchd", fake_bundle, socket=home / ("x" * 120) / "d.sock", echo=lambda _: None)
    assert not (home / "config" / "systemd").exists() and not (home / "Library").exists()


def test_cli_service_install_socket(home: Path, fake_bundle: Path):
    from m31r.cli import main

    sock = home / "s" / "d.sock"
    r = CliRunner().invoke(main, ["service", "install", "--kind", "systemd", "--bundle", str(fake_bundle),
                                  "--socket", str(sock)])
    assert r.exit_code == 0, r.output
    assert f"the service listens on {sock} (from --socket)" in r.stdout
    assert _listen_stream(home / "config" / "systemd" / "user" / "m31rd.socket") == str(sock)


def test_uninstall(home: Path, fake_bundle: Path):
    paths = service.install("systemd", fake_bundle, echo=lambda _: None)
    wants = home / "config" / "systemd" / "user" / "sockets.target.wants"
    wants.mkdir()
    (wants / "m31rd.socket").symlink_to(paths[0])  # what `systemctl --user enable` leaves
    (wants / "other.socket").symlink_to(paths[0].with_name("other.socket"))
    removed = service.uninstall("systemd", dry_run=True, stop=False, echo=lambda _: None)
    assert set(removed) == {*paths, wants / "m31rd.socket"} and all(p.exists() for p in paths)
    removed = service.uninstall("systemd", stop=False, echo=lambda _: None)
    assert set(removed) == {*paths, wants / "m31rd.socket"}
    assert not any(p.exists() for p in paths) and not (wants / "m31rd.socket").is_symlink()
    assert (wants / "other.socket").is_symlink()
    assert service.uninstall("systemd", stop=False, echo=lambda _: None) == []

    (plist,) = service.install("launchd", fake_bundle, echo=lambda _: None)
    assert service.uninstall("launchd", stop=False, echo=lambda _: None) == [plist]
    assert not plist.exists()


def test_install_refuses_a_missing_bundle(home: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="not a model bundle"):
        service.install("systemd", tmp_path / "nope", echo=lambda _: None)
    assert not (home / "config" / "systemd").exists()


def test_cli_service(home: Path, fake_bundle: Path):
    from m31r.cli import main

    runner = CliRunner()
    r = runner.invoke(main, ["service", "install", "--kind", "launchd", "--bundle", str(fake_bundle), "--dry-run"])
    assert r.exit_code == 0, r.output
    assert "<key>ProgramArguments</key>" in r.output and "dry run" in r.output
    assert not (home / "Library").exists()
    r = runner.invoke(main, ["service", "install", "--kind", "systemd", "--bundle", str(home / "missing")])
    assert r.exit_code == 1 and "error:" in r.output and "not a model bundle" in r.output
    r = runner.invoke(main, ["service", "install", "--kind", "systemd", "--bundle", str(fake_bundle)])
    assert r.exit_code == 0 and (home / "config" / "systemd" / "user" / "m31rd.service").exists()
    r = runner.invoke(main, ["service", "uninstall", "--kind", "systemd", "--dry-run"])
    assert r.exit_code == 0 and "would remove" in r.output
    assert (home / "config" / "systemd" / "user" / "m31rd.service").exists()


def test_install_again_leaves_the_same_units_alone(home: Path, fake_bundle: Path):
    paths = service.install("systemd", fake_bundle, echo=lambda _: None)
    before = [p.stat().st_mtime_ns for p in paths]
    out: list[str] = []
    assert service.install("systemd", fake_bundle, echo=out.append) == paths
    files = [line for line in out if line.startswith(("unchanged", "wrote", "kept"))]
    assert files == [f"unchanged {p}" for p in paths]
    assert [p.stat().st_mtime_ns for p in paths] == before
    assert sorted(x.name for x in paths[0].parent.iterdir()) == ["m31rd.service", "m31rd.socket"]  # no backups


def test_install_refuses_to_replace_an_edited_unit_unless_forced(home: Path, fake_bundle: Path):
    """A hand edit (here an Environment= line) is the user's: install names the file and writes nothing; --force
    replaces it and keeps the edited one as FILE.bak, saying so."""
    sock, svc = service.install("systemd", fake_bundle, echo=lambda _: None)
    rendered = svc.read_text()
    edited = rendered.replace("[Service]\n", "[Service]\nEnvironment=OMP_NUM_THREADS=4\n")
    assert edited != rendered
    svc.write_text(edited)
    sock.unlink()  # half installed: the missing one is not written either while the other is refused
    with pytest.raises(ValueError, match=rf"{re.escape(str(svc))} differs from what install writes .*--force"):
        service.install("systemd", fake_bundle, echo=lambda _: None)
    assert svc.read_text() == edited and not sock.exists()
    assert not svc.with_name("m31rd.service.bak").exists()
    # --dry-run says what --force would do, and still writes nothing.
    out: list[str] = []
    service.install("systemd", fake_bundle, dry_run=True, force=True, echo=out.append)
    assert f"({svc} differs from this: install moves it to {svc}.bak)" in out and svc.read_text() == edited
    out = []
    service.install("systemd", fake_bundle, force=True, echo=out.append)
    assert svc.read_text() == rendered and svc.with_name("m31rd.service.bak").read_text() == edited
    assert f"kept the previous {svc} as {svc}.bak" in out and f"wrote {sock}" in out
    # Another forced install over another edit keeps both backups.
    svc.write_text(edited + "# again\n")
    service.install("systemd", fake_bundle, force=True, echo=lambda _: None)
    assert svc.with_name("m31rd.service.bak").read_text() == edited
    assert svc.with_name("m31rd.service.bak.1").read_text() == edited + "# again\n"


def test_install_never_replaces_a_link_silently(home: Path, fake_bundle: Path, tmp_path: Path):
    """Units kept elsewhere (a dotfiles repository) and linked in: a link to the same content stays a link; one to
    other content is refused, and --force moves the link itself to FILE.bak, its target untouched."""
    svc = home / "config" / "systemd" / "user" / "m31rd.service"
    rendered = service.render_systemd(service.m31r_command(), fake_bundle.resolve())["m31rd.service"]
    dotfile = tmp_path / "dotfiles" / "m31rd.service"
    dotfile.parent.mkdir()
    dotfile.write_text(rendered)
    svc.parent.mkdir(parents=True)
    svc.symlink_to(dotfile)
    out: list[str] = []
    service.install("systemd", fake_bundle, echo=out.append)
    assert f"unchanged {svc}" in out and svc.is_symlink() and svc.resolve() == dotfile
    mine = rendered + "Environment=RUST_LOG=debug\n"
    dotfile.write_text(mine)
    with pytest.raises(ValueError, match=rf"{re.escape(str(svc))} \(a link\) differs"):
        service.install("systemd", fake_bundle, echo=lambda _: None)
    assert svc.is_symlink() and dotfile.read_text() == mine
    service.install("systemd", fake_bundle, force=True, echo=lambda _: None)
    assert not svc.is_symlink() and svc.read_text() == rendered
    bak = svc.with_name("m31rd.service.bak")
    assert bak.is_symlink() and bak.resolve() == dotfile and dotfile.read_text() == mine


def test_cli_service_install_refusal_and_force(home: Path, fake_bundle: Path):
    from m31r.cli import main

    runner = CliRunner()
    plist = home / "Library" / "LaunchAgents" / "dev.m31r.m31rd.plist"
    args = ["service", "install", "--kind", "launchd", "--bundle", str(fake_bundle)]
    assert runner.invoke(main, args).exit_code == 0
    plist.write_bytes(plist.read_bytes().replace(b"<key>RunAtLoad</key>", b"<key>Nice</key><integer>5</integer>"
                                                 b"<key>RunAtLoad</key>"))
    edited = plist.read_bytes()
    r = runner.invoke(main, args)
    assert r.exit_code == 1 and r.stdout == "" and r.stderr.count("\n") == 1
    assert r.stderr.startswith(f"error: {plist} differs from what install writes") and "--force" in r.stderr
    assert plist.read_bytes() == edited
    r = runner.invoke(main, [*args, "--force"])
    assert r.exit_code == 0 and f"kept the previous {plist} as {plist}.bak" in r.stdout
    assert plist.with_name(plist.name + ".bak").read_bytes() == edited and plist.read_bytes() != edited


def test_service_module_does_not_import_torch():
    code = "import sys, m31r.cli, m31rd.service; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# -- sd_notify and socket activation ------------------------------------------------------------------


@pytest.mark.parametrize("abstract", [False, True])
def test_sd_notify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool):
    from m31rd.sockets import sd_notify

    rx = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"m31r-test-{uuid.uuid4().hex}"
    rx.bind("\0" + name if abstract else str(tmp_path / "notify"))
    rx.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name if abstract else str(tmp_path / "notify"))
    sd_notify("READY=1")
    assert rx.recv(64) == b"READY=1"
    rx.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    sd_notify("READY=1")  # a no-op outside systemd


def socket_activated(sock_path: Path, tiny_bundle, log: Path, env: dict[str, str]) -> subprocess.Popen:
    """systemd-socket-activate listening on `sock_path`, to start `m31r daemon` (its output in `log`) on the first
    connection, with only `env` (and PATH/HOME/USER/TERM, all it passes) in the daemon's environment."""
    cmd = ["systemd-socket-activate", "--listen", str(sock_path), "--fdname", "m31rd",
           *[a for k, v in env.items() for a in ("-E", f"{k}={v}")],
           sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(tiny_bundle.path), "--threads", "1"]
    with log.open("w") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, cwd=REPO)
    t0 = time.monotonic()
    try:
        while not sock_path.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - t0 < 30, "systemd-socket-activate did not listen"
            time.sleep(0.02)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc


def test_socket_activation_and_ready_notification(tiny_bundle, tmp_path: Path):
    """systemd-socket-activate listens, the first connection starts the daemon with the socket as fd 3
    (LISTEN_FDS/LISTEN_PID), a Generate is answered, READY=1 reaches NOTIFY_SOCKET, SIGTERM exits 0 and
    sends STOPPING=1."""
    require("systemd-socket-activate")
    from m31r_protocol import Client

    sock_path = tmp_path / "act.sock"
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(120)
    log = tmp_path / "daemon.log"
    # systemd-socket-activate passes only PATH/HOME/USER/TERM and the -E variables to the child.
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "NOTIFY_SOCKET": str(tmp_path / "notify"),
           "XDG_RUNTIME_DIR": str(runtime)}
    proc = socket_activated(sock_path, tiny_bundle, log, env)
    try:
        time.sleep(0.2)
        assert "Execing" not in log.read_text()  # nothing runs until a client connects

        async def generate() -> tuple[str, object, str]:
            # The connection waits in the backlog while the daemon imports torch and loads the model.
            async with await Client.connect(sock_path, client="test", timeout=120) as c:
                text, done = await (await c.generate("fn main() {\n", max_tokens=4)).collect()
                return text, done, c.welcome.model

        text, done, model = asyncio.run(generate())
        assert model == tiny_bundle.model_id
        assert done.finish_reason == "length" and done.usage.completion_tokens == 4 and text
        assert notify.recv(256) == b"READY=1"
        pid = proc.pid  # systemd-socket-activate execs the daemon in place: LISTEN_PID is this pid
        log_text = log.read_text()
        assert '"socket": "systemd-activated"' in log_text and f'"pid": {pid}' in log_text
        assert not (runtime / "m31r").exists()  # it served fd 3, it did not bind its default socket
    finally:
        proc.terminate()
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert rc == 0, log.read_text()
    assert notify.recv(256) == b"STOPPING=1"
    notify.close()
    assert sock_path.exists()  # the socket belongs to the activator, not the daemon: it is left alone


def test_ready_and_the_first_answer_come_after_warm_up_with_the_daemons_threads(tiny_bundle, tmp_path: Path):
    """READY=1 arrives only once the warm-up has finished (its log line is already written when it comes), while
    Status answers throughout (`warming` until then), and the warm-up ran with --threads (reported in the warm line
    and in `m31r status`), not with every core. A wide --decode-width makes the warm-up's probe long."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify"))
    notify.settimeout(120)
    sock_path, log = tmp_path / "run" / "m31rd.sock", tmp_path / "daemon.log"
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # torch's default: every core
    env.update(PYTHONUNBUFFERED="1", NOTIFY_SOCKET=str(tmp_path / "notify"))
    cmd = [sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(tiny_bundle.path), "--socket", str(sock_path),
           "--threads", "1", "--dtype", "float32", "--quant", "none", "--decode-width", "32", "--kv-dtype", "float32"]
    with log.open("w") as logf:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=logf, env=env, cwd=REPO)

    def warm_logged() -> bool:
        return '"msg": "warm"' in log.read_text()

    try:
        t0 = time.monotonic()
        while not sock_path.exists():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() - t0 < 60, "the daemon never listened"
            time.sleep(0.01)
        from m31r_protocol.blocking import status

        reply = status(sock_path, timeout=60)  # answered at once, during the warm-up or after it
        assert reply["warming"] or warm_logged(), log.read_text()
        assert notify.recv(256) == b"READY=1"
        assert warm_logged()  # READY=1 only once the warm-up has ended
        reply = status(sock_path, timeout=60)
        assert reply["threads"] == 1 and not reply["warming"]
        lines = [json.loads(line) for line in log.read_text().splitlines()]
        [warm] = [x for x in lines if x["msg"] == "warm"]
        assert warm["threads"] == 1 and len(warm["decode_widths"]) > 8
        assert warm["kv_cache"] == "float32"  # as asked (auto would be float16 under the fp32 kernels)
        st = subprocess.run([sys.executable, "-m", "m31r.cli", "status", "--socket", str(sock_path)],
                            capture_output=True, text=True, timeout=60, env=env)
        assert st.returncode == 0 and json.loads(st.stdout)["threads"] == 1, st.stderr
    finally:
        proc.terminate()
        rc = proc.wait(30)
    assert rc == 0 and not sock_path.exists(), log.read_text()
    assert notify.recv(256) == b"STOPPING=1"
    notify.close()


# The daemon, with bind_unix slowed down after it has made the socket file: a client that sees the file and signals
# at once lands in the window where the file exists but the daemon has not yet recorded it as its own to remove.
SLOW_BIND = """
import sys, time
import m31rd.sockets as sockets
bind = sockets.bind_unix
def slow_bind(path):
    sock = bind(path)
    time.sleep(0.5)
    return sock
sockets.bind_unix = slow_bind
from m31r.cli import main
sys.argv[0] = "m31r"
main()
"""


def _terminate_expecting_a_clean_stop(proc: subprocess.Popen, sock_path: Path) -> None:
    """SIGTERM the daemon; it must exit 0, say "stopped" without a traceback and leave no socket file."""
    try:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and not sock_path.exists(), err
    assert '"msg": "stopped"' in err and "Traceback" not in err, err


def test_sigterm_while_the_socket_file_is_made_exits_cleanly(tiny_bundle, tmp_path: Path):
    """A signal that arrives as the socket file appears (the first thing the daemon does, before the model loads)
    never meets the default handler: exit 0, no socket file left."""
    sock_path = tmp_path / "run" / "m31rd.sock"
    cmd = [sys.executable, "-c", SLOW_BIND, "daemon", "--bundle", str(tiny_bundle.path), "--socket", str(sock_path),
           "--threads", "1", "--dtype", "float32", "--quant", "none"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        t0 = time.monotonic()
        while not sock_path.exists():
            assert proc.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.005)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    _terminate_expecting_a_clean_stop(proc, sock_path)


def test_sigterm_during_warm_up_exits_cleanly(tiny_bundle, tmp_path: Path):
    """A daemon stopped while it warms up (its socket already listening) exits 0 and removes its socket."""
    sock_path = tmp_path / "run" / "m31rd.sock"
    cmd = [sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(tiny_bundle.path), "--socket", str(sock_path),
           "--threads", "1", "--dtype", "float32", "--quant", "none", "--decode-width", "64"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        t0 = time.monotonic()
        while not sock_path.exists():
            assert proc.poll() is None and time.monotonic() - t0 < 60
            time.sleep(0.01)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    _terminate_expecting_a_clean_stop(proc, sock_path)


def run_gated_daemon(script: str, bundle: Path, tmp_path: Path, session, *extra: str) -> None:
    """Start `m31r daemon` through `script` (which holds part of the start-up until the file `gate` exists), run
    `await session(proc, sock_path, gate, log)`, then open the gate and stop the daemon: it must exit 0 and leave no
    socket file."""
    sock_path, gate, log = tmp_path / "run" / "m31rd.sock", tmp_path / "gate", tmp_path / "daemon.log"
    cmd = [sys.executable, "-c", script, str(gate), "daemon", "--bundle", str(bundle), "--socket", str(sock_path),
           "--threads", "1", "--dtype", "float32", "--quant", "none", *extra]
    with log.open("w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        asyncio.run(session(proc, sock_path, gate, log))
    finally:
        gate.touch()
        proc.terminate()
        rc = proc.wait(30)
    assert rc == 0 and not sock_path.exists(), log.read_text()


async def connect_once_serving(proc: subprocess.Popen, sock_path: Path, log: Path) -> Client:
    """A client of the gated daemon: the probe for a live daemon makes the socket file once, refusing connections,
    so connects are tried until one is served (within 60 s, while the daemon runs)."""
    from m31r_protocol.client import Client, DaemonUnavailable

    t0 = time.monotonic()
    while True:
        assert proc.poll() is None and time.monotonic() - t0 < 60, log.read_text()
        try:
            return await Client.connect(sock_path, timeout=1.0, welcome_timeout=5.0)
        except DaemonUnavailable:
            await asyncio.sleep(0.02)


# The daemon, with its warm-up held until a file exists: what it answers while warming up, deterministically.
GATED_WARM_UP = """
import sys, time
from pathlib import Path
import m31rd.main as daemon_main
warm, gate = daemon_main._warm_up, Path(sys.argv.pop(1))
def gated(daemon, threads):
    while not gate.exists():
        time.sleep(0.01)
    warm(daemon, threads)
daemon_main._warm_up = gated
from m31r.cli import main
sys.argv[0] = "m31r"
main()
"""


def test_status_answers_during_warm_up_and_requests_wait_for_it(tiny_bundle, tmp_path: Path):
    """Launch → `m31r status` does not wait for warm-up (issue 18's launch figure): Status answers with `warming`
    true, a Generate sent meanwhile is answered only once warm-up has ended, and "ready" is logged only then."""
    from m31r_protocol import messages as m

    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with await connect_once_serving(proc, sock_path, log) as c:
            st = await c.status()
            assert st.warming and st.threads is None  # the warm-up sets the threads it ran with

            async def ask() -> tuple[str, m.Done]:
                return await (await c.generate("fn main() {", max_tokens=4)).collect()

            answer = asyncio.ensure_future(ask())
            await asyncio.sleep(0.5)
            assert not answer.done() and '"msg": "ready"' not in log.read_text()  # queued behind the warm-up
            assert (await c.status()).warming
            gate.touch()
            text, done = await asyncio.wait_for(answer, 60)
            assert done.usage.completion_tokens >= 1, text
            st = await c.status()
            assert not st.warming and st.threads == 1 and st.requests == 1
        assert '"msg": "ready"' in log.read_text()

    run_gated_daemon(GATED_WARM_UP, tiny_bundle.path, tmp_path, session)


# The daemon with `import torch` held until a file exists: what it does before torch, and the model, have loaded.
GATED_TORCH = """
import importlib.machinery, sys, time
from pathlib import Path
gate = Path(sys.argv.pop(1))
class HoldTorch:  # holds torch's module body, not the finder (which runs under the global import lock)
    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader
        class Held:
            def create_module(self, spec):
                return real.create_module(spec)
            def exec_module(self, module):
                while not gate.exists():
                    time.sleep(0.01)
                real.exec_module(module)
        spec.loader = Held()
        return spec
sys.meta_path.insert(0, HoldTorch())
from m31r.cli import main
sys.argv[0] = "m31r"
main()
"""


def test_the_daemon_answers_before_torch_has_loaded(tiny_bundle, tmp_path: Path):
    """Launch → Status does not wait for torch or the model (issue 18's launch figure): the socket serves Hello and
    Status (`warming`, the model's name and fingerprint from the bundle's files) while `import torch` is held;
    a Generate sent meanwhile waits and then completes, and one cancelled meanwhile is answered `cancelled`."""
    from m31r.bundle import open_bundle
    from m31r_protocol import messages as m
    from m31r_protocol.client import DaemonError

    bundle = open_bundle(tiny_bundle.path)

    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with await connect_once_serving(proc, sock_path, log) as c:
            assert (c.welcome.model, c.welcome.fingerprint) == (bundle.model_id, bundle.fingerprint)
            st = await c.status()
            assert st.warming and st.model == bundle.model_id and st.dtype == "float32" and st.quant is None

            async def ask(max_tokens: int) -> tuple[str, m.Done]:
                return await (await c.generate("fn main() {", max_tokens=max_tokens)).collect()

            answer = asyncio.ensure_future(ask(4))
            dropped = await c.generate("fn other() {", max_tokens=4)
            await asyncio.sleep(0.3)
            assert not answer.done() and (await c.status()).queue == 2  # both wait for the model
            await dropped.cancel()
            with pytest.raises(DaemonError, match="cancelled"):
                await dropped.collect()
            assert (await c.status()).queue == 1  # the daemon let the cancelled one go: it never runs (`requests`)
            # A deadline counts from the request's arrival, the wait for the model included.
            hurried = await c.generate("fn hurried() {", max_tokens=4, deadline_ms=200)
            # The wait has the queue's limits: 16 on one connection (--max-per-connection), then `busy`.
            more = [await c.generate("fn more() {", max_tokens=1) for _ in range(14)]
            with pytest.raises(DaemonError, match="busy: 16 requests wait for the model to load") as refused:
                await (await c.generate("fn one_too_many() {", max_tokens=1)).collect()
            assert refused.value.busy == m.BusyDetail("connection", 16)  # this connection's limit, not the queue's
            await asyncio.sleep(0.3)
            gate.touch()
            text, done = await asyncio.wait_for(answer, 60)
            assert done.usage.completion_tokens >= 1, text
            _, late = await asyncio.wait_for(hurried.collect(), 60)
            assert (late.finish_reason, late.usage.completion_tokens) == ("deadline", 0)
            assert late.timings.total_ms >= 200
            for s in more:
                await asyncio.wait_for(s.collect(), 60)
            st = await c.status()
            assert not st.warming and st.requests == 16 and st.dtype == "float32"
        assert '"msg": "ready"' in log.read_text()

    run_gated_daemon(GATED_TORCH, tiny_bundle.path, tmp_path, session)


@pytest.mark.parametrize("held", ["import torch", "warm-up"])
def test_a_stop_before_the_model_is_ready_answers_the_waiting_requests(tiny_bundle, tmp_path: Path, held: str):
    """SIGTERM while the model loads (requests wait for it) or warms up (requests sit in the scheduler's queue, whose
    rounds then never begin): each waiting request is answered `shutting_down` at once. Before, its connection was
    just closed ("connection lost"), during warm-up only after the grace period and 2 s more."""
    from m31r_protocol.client import DaemonError

    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        t0 = time.monotonic()
        async with await connect_once_serving(proc, sock_path, log) as c:
            if held == "warm-up":  # loaded: the request goes to the scheduler's queue, not the wait for the model
                while (await c.status()).cache_budget_mb == 0:
                    assert time.monotonic() - t0 < 60, log.read_text()
                    await asyncio.sleep(0.02)
            streams = [await c.generate("fn main() {", max_tokens=4) for _ in range(2)]
            await asyncio.sleep(0.2)
            assert (await c.status()).warming
            proc.send_signal(signal.SIGTERM)
            t_stop = time.monotonic()
            for s in streams:
                with pytest.raises(DaemonError) as e:
                    await asyncio.wait_for(s.collect(), 20)
                assert e.value.code == "shutting_down" and "before its model was ready" in e.value.message, e.value
            assert time.monotonic() - t_stop < 3.0  # not after the grace period (5 s)

    script = GATED_TORCH if held == "import torch" else GATED_WARM_UP
    run_gated_daemon(script, tiny_bundle.path, tmp_path, session)


def test_requests_a_closed_connection_left_waiting_for_the_model_are_forgotten(tiny_bundle, tmp_path: Path):
    """--max-queue 2: a client that sent two requests while the model loads, then went away, no longer fills the
    queue; another client's request waits for the model and is answered. Before, the gone client's requests counted
    until the model had loaded, and the other was refused `busy` (`2 requests wait for the model to load`)."""
    from m31r_protocol.client import Client

    async def session(proc: subprocess.Popen, sock_path: Path, gate: Path, log: Path) -> None:
        async with await connect_once_serving(proc, sock_path, log) as gone:
            # Held: a Stream dropped unfinished sends Cancel, and a client that went away sent none.
            held = [await gone.generate("fn gone() {", max_tokens=2) for _ in range(2)]
            while (await gone.status()).queue < 2:
                await asyncio.sleep(0.01)
        async with await Client.connect(sock_path, timeout=5.0, welcome_timeout=5.0) as c:
            t1 = time.monotonic()
            while (queued := (await c.status()).queue):  # until the daemon has seen the other connection close
                assert time.monotonic() - t1 < 5, f"{queued} requests of a closed connection still wait"
                await asyncio.sleep(0.01)
            stream = await c.generate("fn main() {", max_tokens=2)
            await asyncio.sleep(0.2)
            gate.touch()
            _, done = await asyncio.wait_for(stream.collect(), 60)
            assert done.usage.completion_tokens == 2
            assert (await c.status()).requests == 1  # the gone client's were never run
        assert all(s.done is None for s in held)

    run_gated_daemon(GATED_TORCH, tiny_bundle.path, tmp_path, session, "--max-queue", "2")


def test_a_model_that_fails_to_load_ends_the_daemon(corrupt_bundle: Path, tmp_path: Path):
    """The daemon listens before its model loads; a bundle the engine refuses still ends it: exit 1, the reason
    on stderr, no socket file left."""
    bad = corrupt_bundle
    sock_path = tmp_path / "run" / "m31rd.sock"
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(bad), "--socket",
                           str(sock_path), "--threads", "1"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "m31rd: cannot load the model:" in proc.stderr and "checksum mismatch" in proc.stderr, proc.stderr
    assert not sock_path.exists()


@pytest.mark.parametrize("fault", ["no folder", "a file missing"])
def test_a_bundle_that_is_not_there_ends_the_daemon_cleanly(tiny_bundle, tmp_path: Path, fault: str):
    """A missing bundle, or one without all its files, is refused before the socket exists: exit 1, one line saying
    why (no traceback), no socket file left for the next start to trip over."""
    bundle = tmp_path / "bundle"
    if fault == "a file missing":
        shutil.copytree(tiny_bundle.path, bundle)
        (bundle / "tokenizer.json").unlink()
    sock_path = tmp_path / "run" / "m31rd.sock"
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(bundle), "--socket",
                           str(sock_path), "--threads", "1"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    want = "not a bundle directory" if fault == "no folder" else "tokenizer.json: missing from the bundle"
    assert "m31rd: cannot load the model:" in proc.stderr and want in proc.stderr, proc.stderr
    assert not sock_path.exists()


def test_one_daemon_per_socket_path_even_when_two_start_at_once(tmp_path: Path):
    """The check for a live daemon, the removal of a stale socket file and the bind are not one step; the lock beside
    the socket makes them one. While another holds it (a daemon starting, or serving), a second daemon refuses
    before touching the path: the stale file it would have replaced stays as it was."""
    import fcntl
    import stat

    from m31rd.sockets import SocketInUse, bind_unix

    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    path = folder / "m31rd.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(path))
    stale.close()
    made = path.stat().st_ctime_ns
    held = os.open(folder / "m31rd.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a daemon starting in another process holds it
    # (nothing answers on the stale file: the claim waits CLAIM_WAIT_S for a holder that may be exiting, cut short here)
    code = ("import sys; from pathlib import Path; from m31rd import sockets; from m31rd.sockets import SocketInUse, "
            "bind_unix\nsockets.CLAIM_WAIT_S = 0.3\n"
            "try:\n    bind_unix(Path(sys.argv[1]))\nexcept SocketInUse as e:\n    sys.exit(str(e))\n")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "already starting or serving" in r.stderr, r.stderr
    assert path.stat().st_ctime_ns == made  # untouched
    os.close(held)
    sock = bind_unix(path)  # the lock is free again: the stale file is replaced
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.connect(str(path))  # a live socket now, where the stale one refused connections
        with pytest.raises(SocketInUse, match="already starting or serving"):
            bind_unix(path)  # (this process holds it now; a second claim in it is refused as well)
    finally:
        sock.close()


@pytest.mark.parametrize("service_state", ["inactive", "active"])
def test_stop_on_a_socket_systemd_holds(tiny_bundle, tmp_path: Path, service_state: str):
    """A connection to a socket that m31rd.socket holds starts the daemon: `m31r stop` with none running started one
    (loading its model) to stop it, and with one running it did not say that systemd starts the next one anyway. Now
    stop asks systemd first. The socket is held by systemd-socket-activate (systemd's own socket activation); no user
    manager runs here to answer `systemctl --user is-active`, so a `systemctl` on PATH answers as one would."""
    require("systemd-socket-activate")
    sock_path = tmp_path / "held.sock"
    config = tmp_path / "config"
    env = {**os.environ, "XDG_CONFIG_HOME": str(config), "M31R_SOCKET": str(sock_path)}
    run = [sys.executable, "-m", "m31r.cli"]
    subprocess.run([*run, "service", "install", "--kind", "systemd", "--bundle", str(tiny_bundle.path)], env=env,
                   check=True, capture_output=True)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "systemctl").write_text(f"#!/bin/sh\nprintf 'active\\n{service_state}\\n'\n")
    (fake / "systemctl").chmod(0o755)
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    log = tmp_path / "daemon.log"
    proc = socket_activated(sock_path, tiny_bundle, log, {"OMP_NUM_THREADS": "1"})
    try:
        r = subprocess.run([*run, "stop"], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        said = f"m31rd.socket listens on {sock_path}, so systemd starts a daemon for the next request"
        if service_state == "inactive":
            assert r.stderr.startswith("no daemon was running; ") and said in r.stderr, r.stderr
            time.sleep(0.5)
            assert "Execing" not in log.read_text() and proc.poll() is None  # nothing was started
        else:
            assert r.stderr.startswith("daemon stopped; ") and said in r.stderr, r.stderr
            assert proc.wait(timeout=30) == 0  # the daemon systemd-socket-activate started was stopped
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)

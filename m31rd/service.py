"""`m31r service install|uninstall`: run the daemon as a per-user service.

Linux: two systemd user units, m31rd.socket (socket activation, by default on %t/m31r/m31rd.sock; 0600 in a 0700 folder)
and m31rd.service (Type=notify), written to $XDG_CONFIG_HOME/systemd/user (default ~/.config/systemd/user).
macOS: a launchd agent, ~/Library/LaunchAgents/dev.m31r.m31rd.plist, started at login.

The templates ship in m31rd/units/, their only copy (package data, so an installed m31rd has them); installing fills
in the absolute path of the m31r command of this environment, the bundle, the socket and (launchd) the log. The socket
is the one this shell's clients use (`--socket`, else $M31R_SOCKET, else the default): a service on any other path
would be missed by every client, and the first request would autostart a second daemon beside it.
This module imports only the standard library: the CLI must not pay for torch.
"""

from __future__ import annotations

import contextlib
import os
import plistlib
import shlex
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

Kind = Literal["systemd", "launchd"]
KINDS: tuple[Kind, ...] = ("systemd", "launchd")
UNITS_DIR = Path(__file__).resolve().parent / "units"
SYSTEMD_UNITS = ("m31rd.socket", "m31rd.service")
LAUNCHD_LABEL = "dev.m31r.m31rd"
LAUNCHD_PLIST = f"{LAUNCHD_LABEL}.plist"

Echo = Callable[[str], None]


def detect_kind() -> Kind:
    if sys.platform == "darwin":
        return "launchd"
    if sys.platform.startswith("linux"):
        return "systemd"
    raise ValueError(f"no service manager support for {sys.platform}; run `m31r daemon` yourself")


def _kind(kind: str | None) -> Kind:
    if kind is None:
        return detect_kind()
    if kind not in KINDS:
        raise ValueError(f"unknown service kind {kind!r}; choose one of {', '.join(KINDS)}")
    return kind  # type: ignore[return-value]


def m31r_command() -> list[str]:
    """The command that runs this environment's m31r: the console script beside the interpreter, else
    `python -m m31r.cli`. The interpreter path is not resolved: a virtualenv's python is a symlink, and
    following it would leave the environment."""
    exe = Path(os.path.abspath(sys.executable))
    script = exe.parent / "m31r"
    if script.is_file() and os.access(script, os.X_OK):
        return [str(script)]
    return [str(exe), "-m", "m31r.cli"]


def unit_dir(kind: Kind) -> Path:
    """Where the user's service manager looks for our files."""
    if kind == "systemd":
        base = os.environ.get("XDG_CONFIG_HOME", "")
        root = Path(base) if os.path.isabs(base) else Path.home() / ".config"
        return root / "systemd" / "user"
    return Path.home() / "Library" / "LaunchAgents"


def unit_paths(kind: Kind) -> list[Path]:
    names = SYSTEMD_UNITS if kind == "systemd" else (LAUNCHD_PLIST,)
    return [unit_dir(kind) / name for name in names]


DEFAULT_LISTEN = "%t/m31r/m31rd.sock"  # m31rd.socket's ListenStream=: the default socket, in the manager's runtime dir


def client_socket(socket: str | Path | None = None) -> Path:
    """The socket this shell's clients use: `socket` (`--socket`), else $M31R_SOCKET, else the default, made absolute
    but not resolved (clients connect through a link on the path too). A relative $M31R_SOCKET is refused: each
    client would look for it in its own working folder, so no service could be where they all look."""
    from m31r_protocol.paths import default_socket_path, socket_path_problem

    if socket is None:
        socket = default_socket_path()
        if not socket.is_absolute():
            raise ValueError(f"M31R_SOCKET={socket} is a relative path: clients look for it relative to their working "
                             "folder, so a service cannot listen where they all look; set an absolute path")
    path = Path(os.path.abspath(Path(socket).expanduser()))
    if why := socket_path_problem(path):
        raise ValueError(why)
    return path


def systemd_runtime_dir() -> Path:
    """What %t means in a user unit: the user manager's runtime dir, $XDG_RUNTIME_DIR of a login session (an assumption
    where this shell has none of its own: /run/user/UID, what pam_systemd makes). One that is another user's (`su`
    keeps the first user's) is not ours: %t was read as that user's folder."""
    base = os.environ.get("XDG_RUNTIME_DIR", "")
    if os.path.isabs(base):
        with contextlib.suppress(OSError):
            st = os.stat(base)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
                return Path(base)
    return Path(f"/run/user/{os.getuid()}")


def systemd_listen(socket: Path) -> str:
    """m31rd.socket's ListenStream= value for `socket`: the template's %t path where that is it (units stay the same
    for everyone on the default), else the path with % escaped (systemd's specifiers). The value is the rest of the
    line, spaces and quotes included, but systemd strips it at both ends and cannot take a newline."""
    if socket == systemd_runtime_dir() / "m31r" / "m31rd.sock":
        return DEFAULT_LISTEN
    text = str(socket)
    if text != text.strip() or "\n" in text or "\r" in text:
        raise ValueError(f"{text!r}: a socket path with a newline or ending in a space cannot be put in a systemd unit")
    return text.replace("%", "%%")


def installed_socket(kind: Kind) -> Path | None:
    """The socket the installed service listens on (ListenStream= of m31rd.socket, or the plist's --socket), None
    where it is not installed or cannot be read: for `m31r doctor`, which compares it with the clients' socket."""
    if kind == "systemd":
        try:
            lines = (unit_dir(kind) / "m31rd.socket").read_text(errors="replace").splitlines()
        except OSError:
            return None
        for line in lines:
            if line.strip().startswith("ListenStream="):
                value = line.split("=", 1)[1].strip()
                if value.startswith("%t/"):
                    value = f"{systemd_runtime_dir()}{value[2:]}"
                if not value.startswith("/") or "%" in value.replace("%%", ""):  # another specifier: systemd's
                    return None
                return Path(value.replace("%%", "%"))
        return None
    try:
        with (unit_dir(kind) / LAUNCHD_PLIST).open("rb") as f:
            args = plistlib.load(f).get("ProgramArguments", [])
        return Path(args[args.index("--socket") + 1])
    except (OSError, ValueError, IndexError, AttributeError, plistlib.InvalidFileException):
        return None


def systemd_states(socket: Path) -> tuple[str, str] | None:
    """(m31rd.socket's state, m31rd.service's state) as `systemctl --user is-active` says them ("active",
    "inactive", ...), where the installed m31rd.socket listens on `socket`; None where it does not, or systemd cannot
    say. A connection to a socket that systemd holds starts the daemon: `m31r stop` asks first."""
    if not sys.platform.startswith("linux") or shutil.which("systemctl") is None:
        return None
    try:
        if installed_socket("systemd") != client_socket(socket):
            return None
        r = subprocess.run(["systemctl", "--user", "is-active", *SYSTEMD_UNITS], capture_output=True, text=True,
                           timeout=5)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None
    states = r.stdout.split()
    return (states[0], states[1]) if len(states) == 2 else None


def launchd_log_path() -> Path:
    return Path.home() / "Library" / "Logs" / "m31r" / "m31rd.log"


def resolve_bundle(bundle: str | Path | None) -> Path:
    """The bundle's absolute path; it must look like a bundle (the daemon verifies it fully at start)."""
    if bundle is None:
        from m31rd.main import default_bundle

        bundle = default_bundle()
    path = Path(bundle).expanduser().resolve()
    if not (path / "metadata.json").is_file():
        raise ValueError(f"{path}: not a model bundle (no metadata.json); pass --bundle DIR")
    return path


# -- rendering ------------------------------------------------------------------------------------------


def systemd_quote(arg: str) -> str:
    """One ExecStart= argument: % and $ escaped (specifiers, variables), quoted where systemd would split
    or unescape it."""
    if "\n" in arg or "\r" in arg:
        raise ValueError(f"{arg!r}: a newline cannot be passed in a systemd unit")
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not any(c.isspace() or c in "\"'\\;" for c in arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_executable(path: str) -> str:
    """ExecStart='s first word, the command: % escaped (specifiers), quoted where it has spaces. Not $: systemd expands
    variables in the arguments only, so a `$$` there named a file that does not exist. A quote, a backslash or a
    control character systemd refuses in it whatever the quoting ("Executable name contains special characters")."""
    if any(c in "\"'\\" or ord(c) < 32 or ord(c) == 127 for c in path):
        raise ValueError(f"{path!r}: systemd refuses to run a command whose path holds a quote, a backslash or a "
                         "control character; install m31r in a virtual environment on a path without them")
    path = path.replace("%", "%%")
    return f'"{path}"' if any(c.isspace() or c == ";" for c in path) else path


def template(name: str) -> str:
    return (UNITS_DIR / name).read_text()


# m31rd.socket's comment on its ListenStream=, true of the default only.
DEFAULT_LISTEN_COMMENT = "# %t is $XDG_RUNTIME_DIR (/run/user/UID): the path every m31r client uses by default.\n"


def render_systemd(command: Sequence[str], bundle: Path, listen: str = DEFAULT_LISTEN, *,
                   from_default: bool = False) -> dict[str, str]:
    """{file name: content} of the two user units; `listen` is m31rd.socket's ListenStream= (systemd_listen). On
    another path than the default, the comment says so: clients do not find that socket unless told. `from_default`:
    that path is the default of a shell with no runtime dir of its own (/tmp/m31r-UID), not one a user named."""
    exec_start = " ".join([systemd_executable(command[0]), *(systemd_quote(a) for a in command[1:])])
    service = template("m31rd.service").replace("@M31R@", exec_start).replace("@BUNDLE@", systemd_quote(str(bundle)))
    socket = template("m31rd.socket")
    if listen != DEFAULT_LISTEN:
        for old in (DEFAULT_LISTEN_COMMENT, f"\nListenStream={DEFAULT_LISTEN}\n"):
            if old not in socket:  # an edited template: a silent no-op would install a unit on the wrong path
                raise ValueError(f"{UNITS_DIR / 'm31rd.socket'} no longer holds {old.strip()!r}")
        # A comment is not read for specifiers: the path as it is, not as ListenStream= escapes it.
        path = listen.replace("%%", "%")
        socket = socket.replace(DEFAULT_LISTEN_COMMENT, (
            f"# ListenStream= is {path}: the default socket of the shell that installed it, which had\n"
            "# no XDG_RUNTIME_DIR of its own, not %t/m31r/m31rd.sock ($XDG_RUNTIME_DIR/m31r/m31rd.sock): m31r clients\n"
            "# of a login session find it only with M31R_SOCKET (or --socket) set to it.\n" if from_default else
            f"# ListenStream= is {path}: the socket M31R_SOCKET or `m31r service install --socket` "
            "named,\n# not the default %t/m31r/m31rd.sock ($XDG_RUNTIME_DIR/m31r/m31rd.sock), so m31r clients find it\n"
            "# only with M31R_SOCKET (or --socket) set to it.\n"))
        socket = socket.replace(f"\nListenStream={DEFAULT_LISTEN}\n", f"\nListenStream={listen}\n")
    return {"m31rd.socket": socket, "m31rd.service": service}


def render_launchd(command: Sequence[str], bundle: Path, socket: Path, log: Path) -> bytes:
    """The agent plist: the template parsed, placeholders replaced value by value (no XML escaping to get
    wrong), written back as a plist."""
    with (UNITS_DIR / LAUNCHD_PLIST).open("rb") as f:
        plist = plistlib.load(f)
    # The daemon writes (and rotates) `log` itself; its stdout and stderr, start-up failures only, go beside it.
    values = {"@BUNDLE@": str(bundle), "@SOCKET@": str(socket), "@LOG@": str(log),
              "@ERRLOG@": str(log.with_name("m31rd.stderr.log"))}
    args: list[str] = []
    for a in plist["ProgramArguments"]:
        if a == "@M31R@":
            args.extend(command)
        else:
            args.append(values.get(a, a))
    plist["ProgramArguments"] = args
    for key, value in plist.items():
        if isinstance(value, str):
            plist[key] = values.get(value, value)
    return plistlib.dumps(plist, sort_keys=False)


# -- install / uninstall --------------------------------------------------------------------------------


def _differs(path: Path, data: bytes) -> bool:
    """Whether `path` holds something other than `data`: a unit edited by hand, another install's, a link to a
    file with other content, or anything unreadable. A missing path does not differ: there is nothing to lose."""
    if not path.exists() and not path.is_symlink():
        return False
    try:
        return not path.is_file() or path.read_bytes() != data
    except OSError:  # a dangling link, a file we may not read
        return True


def _backup_name(path: Path) -> Path:
    """FILE.bak, or FILE.bak.N where earlier backups are in the way (none is ever overwritten): names that end in
    neither a systemd unit type nor .plist, so the service manager does not load the old unit beside the new."""
    bak = path.with_name(path.name + ".bak")
    n = 1
    while bak.exists() or bak.is_symlink():
        bak, n = path.with_name(f"{path.name}.bak.{n}"), n + 1
    return bak


def _write(path: Path, data: bytes, backup: Path | None = None) -> None:
    """Write `data` to `path` atomically; with `backup`, what was at `path` (a link stays a link) moves there first."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    if backup is not None:
        os.rename(path, backup)
    os.replace(tmp, path)


def _daemon_beside(kind: Kind, sock: Path) -> int | None:
    """The pid of a daemon that answers on `sock` outside the service (started by hand, or by a client), or None.
    Enabling the service then goes wrong without a word: m31rd.socket unlinks a socket file in its way and binds
    the path, leaving that daemon running for no one; launchd's agent finds the path taken and exits 1 (not
    relaunched: its KeepAlive restarts crashes only). A path the installed m31rd.socket holds is not probed: a
    connection there would start its daemon."""
    try:
        if not stat.S_ISSOCK(os.lstat(sock).st_mode):
            return None
    except OSError:
        return None
    if kind == "systemd" and (systemd_states(sock) or ("",))[0] == "active":
        return None
    from m31r_protocol.blocking import status

    try:
        pid = status(sock, timeout=2.0).get("pid")
    except (OSError, ValueError):
        return None
    return pid if isinstance(pid, int) else None


def _install_notes(k: str, sock: Path, given: bool, off_default: bool) -> list[str]:
    """What install says after its files: a default socket that login sessions' clients would not look at, and a
    daemon already serving the path outside the service (a dry run says them too)."""
    notes = []
    if off_default:
        login = systemd_runtime_dir() / "m31r" / "m31rd.sock"
        notes.append(f"note: this shell has no XDG_RUNTIME_DIR of its own (unset, or another user's after su), so its "
                     f"default socket is {sock}; clients in a login session (your editor's) look at {login} and would "
                     f"not find the service, and start a daemon of their own: run `m31r service install --force` in "
                     f"such a session, or pass --socket {shlex.quote(str(login))}")
    stop = f"m31r stop --socket {shlex.quote(str(sock))}" if given else "m31r stop"  # what reaches `sock` here
    if (pid := _daemon_beside(k, sock)) is not None:
        notes.append(f"note: a daemon (pid {pid}) already serves {sock} outside the service: `{stop}` before starting "
                     "the service, or " + ("m31rd.socket takes the path from it and it runs on, serving no one"
                                           if k == "systemd" else "(unless it is the agent's own) the agent's daemon "
                                           "finds the path taken and exits, and launchd does not retry it: once the "
                                           f"path is free, `launchctl kickstart gui/{os.getuid()}/{LAUNCHD_LABEL}` "
                                           "starts it"))
    return notes


def install(kind: str | None = None, bundle: str | Path | None = None, dry_run: bool = False, *, force: bool = False,
            socket: str | Path | None = None, echo: Echo = print) -> list[Path]:
    """Write the unit files for `kind` (default: this platform's) and print the command that enables them.

    The service listens on `socket`, by default the path this shell's clients use (client_socket: $M31R_SOCKET, else
    the default, which systemd units spell %t/m31r/m31rd.sock). Returns the paths written (with dry_run: the paths
    that would be written; nothing is written and the content is printed).

    A unit file that differs from what would be written (edited by hand, a link to another file, an older install
    with other paths) is never replaced silently: install refuses, naming it, and writes nothing; with `force` it is
    moved to FILE.bak (said in the output) and replaced. An identical file is left as it is.
    """
    k = _kind(kind)
    bundle_path = resolve_bundle(bundle)
    command = m31r_command()
    sock = client_socket(socket)
    source = "--socket" if socket else "$M31R_SOCKET" if os.environ.get("M31R_SOCKET") else "the default"
    # The default here, yet not %t's path: this shell has no runtime dir of its own (unset; another user's after su).
    off_default = k == "systemd" and source == "the default" and systemd_listen(sock) != DEFAULT_LISTEN
    files: dict[Path, bytes]
    if k == "systemd":
        units = render_systemd(command, bundle_path, systemd_listen(sock), from_default=off_default)
        files = {unit_dir(k) / n: text.encode() for n, text in units.items()}
    else:
        files = {unit_dir(k) / LAUNCHD_PLIST: render_launchd(command, bundle_path, sock, launchd_log_path())}
    differing = [path for path, data in files.items() if _differs(path, data)]
    notes = _install_notes(k, sock, socket is not None, off_default)
    if dry_run:
        for path, data in files.items():
            echo(f"# {path}\n{data.decode()}")
        for path in differing:
            fate = f"moves it to {_backup_name(path)}" if force else "refuses to replace it without --force"
            echo(f"({path} differs from this: install {fate})")
        echo(f"(dry run: nothing written; the service would listen on {sock}, from {source})")
        for note in notes:  # what install would say too: a daemon already on the path, a socket clients miss
            echo(note)
        return list(files)
    if differing and not force:
        one = len(differing) == 1
        what = ", ".join(str(p) + (" (a link)" if p.is_symlink() else "") for p in differing)
        raise ValueError(f"{what} {'differs' if one else 'differ'} from what install writes (edited by hand, a link, "
                         f"or an older install's): nothing written; `--dry-run` shows the new content, `--force` "
                         f"replaces {'it' if one else 'them'}, keeping the old as {differing[0].name}.bak"
                         f"{'' if one else ' etc.'}")
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        if path not in differing and path.exists():  # the same bytes (through a link, too): nothing to do
            echo(f"unchanged {path}")
            continue
        backup = _backup_name(path) if path in differing else None
        _write(path, data, backup)
        if backup is not None:
            echo(f"kept the previous {path} as {backup}")
        echo(f"wrote {path}")
    echo(f"the service listens on {sock} (from {source})")
    for note in notes:
        echo(note)
    stop = f"m31r stop --socket {shlex.quote(str(sock))}" if socket else "m31r stop"  # what reaches `sock` here
    if k == "systemd":
        echo("next: systemctl --user daemon-reload && systemctl --user enable --now m31rd.socket")
        if any(p.name == "m31rd.socket" for p in differing):  # enable --now leaves an active socket where it was
            echo("(m31rd.socket changed: `systemctl --user restart m31rd.socket` moves one already listening, and "
                 "stops its daemon)")
        elif any(p.name == "m31rd.service" for p in differing):  # a daemon it started runs the old ExecStart=
            echo(f"(m31rd.service changed: a daemon it started runs the old command and bundle until `{stop}` "
                 "after the daemon-reload; the next request starts the new one)")
        echo("(the daemon starts on the first connection; logs: journalctl --user -u m31rd)")
    else:
        launchd_log_path().parent.mkdir(parents=True, exist_ok=True)
        plist = unit_dir(k) / LAUNCHD_PLIST
        echo(f"next: launchctl bootstrap gui/{os.getuid()} {plist}")
        echo(f"(already loaded? first: launchctl bootout gui/{os.getuid()}/{LAUNCHD_LABEL}; "
             f"logs: {launchd_log_path()})")
    return list(files)


def _run_quietly(cmd: list[str], echo: Echo) -> bool:
    """Run a service manager's command, saying so; False where it is missing, failed or hung."""
    if shutil.which(cmd[0]) is None:
        return False
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        echo(f"note: {' '.join(cmd)}: {e}")
        return False
    if r.returncode == 0:
        echo(f"ran: {' '.join(cmd)}")
    return r.returncode == 0


def uninstall(kind: str | None = None, dry_run: bool = False, *, stop: bool = True,
              echo: Echo = print) -> list[Path]:
    """Remove the unit files (and systemd's enablement links to them). With `stop`, first ask the service
    manager to stop and disable the service (best effort: a missing or unreachable manager is not an error).
    Returns the paths removed (with dry_run: those that would be)."""
    k = _kind(kind)
    paths = [p for p in unit_paths(k) if p.exists() or p.is_symlink()]
    if k == "systemd":
        # What `systemctl --user disable` removes: links in *.wants/ folders to our units.
        names = set(SYSTEMD_UNITS)
        paths += sorted(p for p in unit_dir(k).glob("*.wants/*") if p.name in names and p.is_symlink())
    if dry_run:
        for p in paths:
            echo(f"would remove {p}")
        return paths
    if stop and paths:
        if k == "systemd":
            cmd = ["systemctl", "--user", "disable", "--now", *SYSTEMD_UNITS]
            if not _run_quietly(cmd, echo) and shutil.which("systemctl"):
                # The files go regardless; a manager that was not reached keeps a listening m31rd.socket (and its
                # daemon) loaded from them until it is told, with nothing left on disk to say why.
                echo(f"note: `{' '.join(cmd)}` failed (no systemd user manager answers here?): where the service "
                     "runs, `systemctl --user stop m31rd.socket m31rd.service` in the session it runs in stops it")
        else:
            _run_quietly(["launchctl", "bootout", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"], echo)
    for p in paths:
        p.unlink(missing_ok=True)
        echo(f"removed {p}")
    if not paths:
        echo(f"nothing to remove in {unit_dir(k)}")
    elif k == "systemd" and stop:
        _run_quietly(["systemctl", "--user", "daemon-reload"], echo)
    return paths

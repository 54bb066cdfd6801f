"""The daemon's listening socket: safe creation, stale-socket recovery, systemd integration (peer checks are in
m31r_protocol.peer, shared with the clients)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import NoReturn

from m31r_protocol.paths import default_socket_path, socket_path_problem

SD_LISTEN_FDS_START = 3
log = logging.getLogger("m31rd")


class SocketInUse(RuntimeError):
    """Another daemon is live on the socket."""


class UnsafeSocketFolder(RuntimeError):
    """The socket's folder could let another user put their own socket in our place."""


_HELD: list[int] = []  # the lock files' descriptors, open for the process's life (the OS lets go when it ends)


def _claim(path: Path) -> None:
    """Hold `<socket>.lock` (beside the socket, in the folder that is ours alone) for as long as this process lives.
    The check for a live daemon, the removal of a stale socket file and the bind are not one step: two daemons
    starting at once on a stale socket both found it stale, and the second removed the first one's new socket, which
    then served no one. Whoever holds the lock is the one daemon on the path; a crash lets go of it.

    A daemon told to stop closes its socket first and lets go of the lock only when its process ends, a second or
    more later: one started meanwhile (`kill PID; m31r daemon`, a restart, a client's autostart after a stop) was
    refused, told to stop a daemon that no longer answered. A holder that does not answer on the socket is waited for
    (CLAIM_WAIT_S at most); one that answers is refused at once. The lock file records its holder's pid, for the
    message when the wait runs out."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        if not _lock(fd):
            _wait_for_holder(fd, path, lock)
        with contextlib.suppress(OSError):  # the pid is for messages only: a lock without it still works
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    _HELD.append(fd)


CLAIM_WAIT_S = 10.0  # how long a starting daemon waits for one that no longer answers (exiting) to let go of the path
_CLAIM_POLL_S = 0.05


def _lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _answers(path: Path) -> bool:
    """Whether a daemon answers on `path` (a file there that is not a socket is no daemon: _bind refuses it)."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return False
    except OSError:  # no socket file (the daemon that made it removed it as it ended)
        return False
    return _is_live(path)


def _wait_for_holder(fd: int, path: Path, lock: Path) -> None:
    """Return once `lock` is ours; refuse (SocketInUse) as soon as a daemon answers on `path`, or once CLAIM_WAIT_S
    has passed with the holder neither answering nor gone. Only reached when the lock is held: no wait otherwise."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    told = False
    while True:
        if _answers(path):  # serving, or a starting one that has bound meanwhile
            raise SocketInUse(f"another m31rd is already starting or serving on {path} (stop it with {_stop(path)})")
        if time.monotonic() >= deadline:
            break
        if not told:
            told = True
            log.info("waiting for the m31rd that holds the socket's lock and no longer answers (exiting) to end",
                     extra={"fields": {"socket": str(path), "holder_pid": _holder(fd)}})
        time.sleep(_CLAIM_POLL_S)
        if _lock(fd):
            return
    pid = _holder(fd)
    who = f"pid {pid}" if pid is not None else "its pid unrecorded"
    raise SocketInUse(
        f"another m31rd ({who}) holds {lock} but has not answered on {path} for {CLAIM_WAIT_S:g} s: it is still "
        f"exiting (one already starting or serving there would answer); start this one again once "
        f"{f'pid {pid}' if pid is not None else 'it'} has ended")


def _holder(fd: int) -> int | None:
    """The pid the lock file records, if that process still runs (a file another program holds may say anything)."""
    try:
        pid = int(os.pread(fd, 32, 0).decode("ascii").strip())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except PermissionError:  # running, as another user: still the holder it records
        return pid
    except (OSError, OverflowError):  # no such process (any more)
        return None
    return pid


def _stop(path: Path) -> str:
    """The command that stops the daemon on `path`: a bare `m31r stop` reaches only the clients' default socket."""
    import shlex

    same = os.path.abspath(path) == os.path.abspath(default_socket_path())
    return "`m31r stop`" if same else f"`m31r stop --socket {shlex.quote(str(path))}`"


def _is_live(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(1.0)
    try:
        s.connect(str(path))
        return True
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True  # something answers in a way we do not understand: do not steal its path
    finally:
        s.close()


def check_folder(folder: Path) -> None:
    """Refuse a socket folder that is not ours alone: owned by this user, mode 0700 (no group or other bits).

    Anyone who can write to the folder, or who made it (`/tmp/m31r-<uid>` created by someone else first), can put
    their own socket where clients look for ours. Such a folder is refused, never chmodded: it may be shared (/tmp,
    a home or project folder), and changing its mode would change it for everyone who uses it."""
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid():
        st = os.stat(folder)  # our own symlink: judge what it points to
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeSocketFolder(f"socket folder {folder} is not a directory (or is a symlink someone else made)")
    if st.st_uid != os.getuid():
        raise UnsafeSocketFolder(
            f"socket folder {folder} belongs to uid {st.st_uid}, not to you (uid {os.getuid()}): someone else may "
            f"have made it to intercept completions; remove it, or choose another socket path (--socket)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        raise UnsafeSocketFolder(
            f"socket folder {folder} has mode {stat.S_IMODE(st.st_mode):04o}; it must be 0700 (yours alone), or other "
            f"users could put their own socket in its place. Choose a socket path in a folder of your own, such as "
            f"{folder / 'm31r' / 'm31rd.sock'} (--socket, or M31R_SOCKET; the daemon makes a missing folder 0700)"
            f"{_chmod_advice(folder, st)}")


def _chmod_advice(folder: Path, st: os.stat_result) -> str:
    """`chmod 700` as a second way out, only for a folder that is likely the user's alone: one inside the home folder
    and not a shared scratch folder. Offered for /tmp (or for /, the folder of `--socket /tmp`), it would lock every
    other user, and the system's own services, out of it."""
    shared = stat.S_IMODE(st.st_mode) & (stat.S_ISVTX | stat.S_IWOTH)
    try:
        at_home = Path(os.path.abspath(folder)).is_relative_to(Path.home()) and Path.home() != Path("/")
    except RuntimeError:  # no home folder to be found
        at_home = False
    return f", or run `chmod 700 {folder}` if only you use it" if at_home and not shared else ""


def bind_unix(path: Path) -> socket.socket:
    """A listening socket at `path`, created 0600; a stale socket file is replaced, a live one is refused.

    A parent folder that does not exist yet is created 0700 (the default one, $XDG_RUNTIME_DIR/m31r, is). One that
    exists must already be this user's alone (check_folder); its mode is never changed. A folder that cannot be
    made or written (a read-only XDG_RUNTIME_DIR, another user's) is an OSError whose message names it and the way
    out, not errno's few words."""
    if why := socket_path_problem(path):
        raise OSError(why)
    try:
        return _bind(path)
    except OSError as e:  # SocketInUse and UnsafeSocketFolder, RuntimeErrors, say their own
        raise OSError(f"cannot make the socket {path}: {why_not(e, path)}; choose a socket path in a folder you can "
                      f"write to (--socket, or M31R_SOCKET)") from None


def why_not(e: OSError, target: Path) -> str:
    """Why `target` (a socket, a log file) or a folder on its way could not be made: the path it failed on where that
    is another (a folder, the lock file), and for a file where a folder should be, that file."""
    where = Path(os.fsdecode(e.filename)) if e.filename is not None else target
    if isinstance(e, FileExistsError | NotADirectoryError):
        blocker = next((p for p in (where, *where.parents) if os.path.lexists(p) and not p.is_dir()), where)
        return f"{blocker} is not a folder"
    return f"{e.strerror or e}" if where == target else f"{where}: {e.strerror or e}"


def _bind(path: Path) -> socket.socket:
    try:
        path.parent.mkdir(parents=True, mode=0o700)
        os.chmod(path.parent, 0o700)  # mkdir's mode is masked by the umask
    except FileExistsError:
        pass
    check_folder(path.parent)
    _claim(path)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise SocketInUse(f"{path} exists and is not a socket; refusing to replace it")
        if _is_live(path):
            raise SocketInUse(f"another m31rd is already serving on {path} (stop it with {_stop(path)})")
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is created 0600: no window where others could connect
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def activated_socket() -> socket.socket | None:
    """The socket systemd passed us (LISTEN_FDS/LISTEN_PID), if this process was socket-activated.

    Passed sockets that m31rd cannot serve end the process (SystemExit, the reason on stderr and in the log) instead
    of being served wrongly: a second ListenStream= (LISTEN_FDS=2) left its clients waiting for ever in a backlog no
    one accepts from, Accept=yes (a connection, not a listener) left the first client waiting for ever, and a TCP
    ListenStream= ended the daemon in a traceback about asyncio. Nothing has been made yet to clean up."""
    if os.environ.get("LISTEN_PID") != str(os.getpid()):
        return None
    fds = os.environ.get("LISTEN_FDS", "0")
    for var in ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES"):
        os.environ.pop(var, None)  # children must not think the socket is theirs
    try:
        n = int(fds)
    except ValueError:
        _refuse_activation(f"LISTEN_FDS={fds!r} is not a number of sockets")
    if n < 1:
        return None
    if n > 1:
        names = "; ".join(_describe(fd) for fd in range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + n))
        _refuse_activation(f"systemd passed {n} sockets ({names}) and m31rd serves one: clients of the others would "
                           "wait for ever; leave one ListenStream= in m31rd.socket")
    try:
        sock = socket.socket(fileno=SD_LISTEN_FDS_START)
    except OSError as e:
        _refuse_activation(f"LISTEN_FDS=1 but fd {SD_LISTEN_FDS_START} is no open socket ({e.strerror or e})")
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) if hasattr(socket, "SO_ACCEPTCONN") else 1
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        what = _describe(SD_LISTEN_FDS_START)
        sock.detach()  # (the fd stays open: it is systemd's socket, and closing ours changes nothing for it)
        _refuse_activation(f"systemd passed {what}; m31rd serves only a listening Unix stream socket: "
                           "m31rd.socket needs ListenStream= set to a path, and no Accept=yes")
    sock.setblocking(False)
    return sock


def _describe(fd: int) -> str:
    """A passed fd in a few words, for the refusal: its kind and address."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            kind = {socket.AF_UNIX: "Unix", socket.AF_INET: "TCP/IP", socket.AF_INET6: "TCP/IPv6"}.get(
                s.family, str(s.family))
            typ = {socket.SOCK_STREAM: "stream", socket.SOCK_DGRAM: "datagram",
                   socket.SOCK_SEQPACKET: "seqpacket"}.get(s.type, str(s.type))
            if s.type != socket.SOCK_DGRAM and hasattr(socket, "SO_ACCEPTCONN"):
                accepts = s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                typ = f"{typ}, {'listening' if accepts else 'a connection (Accept=yes?)'}"
            addr = s.getsockname()
            where = os.fsdecode(addr) if isinstance(addr, str | bytes) else ":".join(map(str, addr[:2]))
            return f"fd {fd}: {kind} {typ}, on {where or 'no address'}"
    except OSError as e:
        return f"fd {fd}: no socket ({e.strerror or e})"


def _refuse_activation(why: str) -> NoReturn:
    log.error("cannot serve the socket systemd passed: %s", why)
    raise SystemExit(f"m31rd: cannot serve the socket systemd passed: {why}")


def sd_notify(message: str) -> None:
    """Tell systemd (Type=notify) about our state; a no-op outside systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())

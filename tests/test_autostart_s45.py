"""An autostarted daemon is no descendant of the client that started it: editors kill a stopped language server's
whole process tree (VS Code's language client walks `pgrep -P` from the server's pid and SIGKILLs each), and with
`m31r lsp` as the daemon's parent that killed the daemon every editor and CLI shares. What the client's wait for it
says is unchanged: its exit code and reason, and now also a daemon killed by a signal, and a lost exit status."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from m31r_protocol import DaemonUnavailable
from m31r_protocol.client import Client, connect_or_start

REPO = Path(__file__).resolve().parents[1]
M31R = [sys.executable, "-m", "m31r.cli"]

# A client that autostarts a daemon and stays, as `m31r lsp` does: it says "ready" once connected.
CLIENT = """
import asyncio, sys
from m31r_protocol.client import connect_or_start

async def main():
    client = await connect_or_start(sys.argv[1], daemon_args=["--bundle", sys.argv[2], "--threads", "1"], timeout=120)
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _descendants(pid: int) -> list[int]:
    """`pid`'s process tree below it, parents first, found as terminateProcess.sh does: children by parent pid."""
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], list(children.get(pid, []))
    while todo:
        found.append(todo.pop(0))
        todo.extend(children.get(found[-1], []))
    return found


def test_killing_the_clients_process_tree_leaves_the_daemon_serving(tiny_bundle, tmp_path: Path) -> None:
    run = Path(tempfile.mkdtemp(prefix="m31r-autostart-"))  # 0700, and short: a socket path has a length limit
    sock = run / "m31rd.sock"
    env = {**os.environ, "M31R_SOCKET": str(sock), "XDG_STATE_HOME": str(tmp_path / "state"), "PYTHONUNBUFFERED": "1"}
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(sock), str(tiny_bundle.path)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline() == "ready\n"
        tree = _descendants(client.pid)
        for pid in tree:  # (a process that ended meanwhile is no error)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        client.kill()
        client.wait(30)

        async def ask() -> str:
            async with await Client.connect(sock) as c:
                _, done = await (await c.generate("fn main() {", max_tokens=3)).collect()
                return done.finish_reason

        assert asyncio.run(ask()) in ("length", "stop"), f"the daemon went with its client's tree {tree}"
    finally:
        client.kill()
        client.wait(30)
        client.stdout.close()
        r = subprocess.run([*M31R, "stop"], capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
        shutil.rmtree(run, ignore_errors=True)
    assert (r.returncode, r.stderr) == (0, "daemon stopped\n")


async def test_the_daemon_gets_only_its_own_fds(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Stdin /dev/null, stdout and stderr the log, and no other fd (none of the pipe that carries its exit status)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    fds = ("import os, sys\n"
           "def is_open(fd):\n"
           "    try:\n"
           "        os.fstat(fd)\n"
           "    except OSError:\n"
           "        return False\n"
           "    return True\n"
           "null = os.stat(os.devnull)\n"
           "stdin = os.fstat(0)\n"
           "print('m31rd: extra fds', [fd for fd in range(3, 1024) if is_open(fd)], 'stdin is /dev/null',\n"
           "      (stdin.st_dev, stdin.st_ino) == (null.st_dev, null.st_ino))\n"
           "sys.exit(5)\n")
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(tmp_path / "run" / "d.sock", daemon_command=[sys.executable, "-c", fds], timeout=30)
    assert str(info.value) == "the daemon exited with code 5: extra fds [] stdin is /dev/null True"


async def test_a_daemon_killed_at_start_up_is_said_killed_by_its_signal(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not "exited with code -9" (Popen's way), nor 137 (a shell's): the signal, by name."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    dies = "import os, signal; print('m31rd: loading', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(tmp_path / "run" / "d.sock", daemon_command=[sys.executable, "-c", dies], timeout=30)
    assert str(info.value) == "the daemon was killed by SIGKILL: loading"


async def test_a_lost_exit_status_is_said_and_not_waited_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process waiting for the daemon, killed, takes its exit status with it: the client still sees the daemon
    end (by its pid) and says so, rather than waiting for the timeout. The fake daemon kills its parent unless that
    parent is this client (as when the daemon was this process's child)."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    orphan = (f"import os, signal, sys\nif os.getppid() != {os.getpid()}:\n    os.kill(os.getppid(), signal.SIGKILL)\n"
              "print('m31rd: the reason', flush=True)\nsys.exit(7)\n")
    with pytest.raises(DaemonUnavailable) as info:
        await connect_or_start(tmp_path / "run" / "d.sock", daemon_command=[sys.executable, "-c", orphan], timeout=60)
    assert str(info.value) == ("the daemon ended, its exit status unknown (the shell that waited for it was killed): "
                               "the reason")

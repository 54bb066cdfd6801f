"""The `m31r` command. `m31r status` is answered here without importing click, asyncio or msgspec (about 30 ms in
all, most of it the interpreter starting); everything else, and any status that does not simply succeed (no
daemon, a daemon still loading), goes to the click CLI in m31r.cli, which reports errors properly. m31r.cli never
imports this module: it is the console script's entry, in front of the CLI."""

from __future__ import annotations

import sys


def _status_socket(args: list[str]) -> str | None | bool:
    """The --socket of a plain `status` invocation (None: the default socket); False for anything else."""
    if args[:1] != ["status"]:
        return False
    rest = args[1:]
    if not rest:
        return None
    if len(rest) == 2 and rest[0] == "--socket":
        socket = rest[1]
    elif len(rest) == 1 and rest[0].startswith("--socket="):
        socket = rest[0].removeprefix("--socket=")
    else:
        return False
    return socket or False  # empty: the click CLI refuses it (taken here, it would have meant the default socket)


def quick_status(socket: str | None) -> bool:
    """Print the daemon's status; False where the click CLI must answer instead (it says why, in one line)."""
    from m31r_protocol import blocking
    from m31r_protocol.paths import default_socket_path

    if sys.stdout is None:  # stdout closed (`>&-`): the CLI refuses with a message
        return False
    try:
        reply = blocking.status(socket or default_socket_path())
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    try:
        print(blocking.status_json(reply), flush=True)
    except BrokenPipeError:  # `m31r status | head -c 1`: ends as every command does on a closed pipe
        from m31r.cli import closed_pipe_exit

        closed_pipe_exit()
    except OSError as e:  # `m31r status > file` on a full disk
        from m31r.cli import output_failed

        output_failed(e)
    return True


def main() -> None:
    socket = _status_socket(sys.argv[1:])
    try:
        if socket is not False and quick_status(socket):
            return
        from m31r.cli import main as cli
    except KeyboardInterrupt:  # Ctrl-C while a daemon that does not answer (loading, stopped) is waited for
        sys.exit(130)  # quietly, as the click CLI's INTERRUPTED_EXIT (not imported here: it costs click's import)
    cli()


if __name__ == "__main__":
    main()

"""The daemon's settings file: `m31r daemon`'s option defaults from `$XDG_CONFIG_HOME/m31r/daemon.toml`.

A daemon is usually started by something else: the first `m31r generate`, an editor's `m31r lsp`, `m31r serve`, a
systemd or launchd service. None of them passes --threads, --quant or --device, so without this file every such
daemon ran on the defaults. Keys are the daemon's long options (`threads = 4`, `quant = "int8"`; `cache_mb` reads
as `cache-mb`); an option on the command line wins over the file. The bundle and the socket are not read from here:
the clients and the service name those (--bundle, --socket, M31R_BUNDLE, M31R_SOCKET), and a file that disagreed
with them would start a daemon where no client looks. Read once at start, as the model is: a change applies to the
next daemon (`m31r stop`).
"""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Any

import click

# Chosen by the clients and services that start a daemon, not by the daemon's settings.
NOT_HERE = {
    "bundle": "the bundle is chosen where the daemon is started (--bundle, M31R_BUNDLE, `m31r service install "
              "--bundle`)",
    "socket": "the clients must find the socket too: set M31R_SOCKET (or --socket) instead",
    "log-file": "an autostarted daemon logs to the state folder's m31rd.log, a service to its own log",
    "config": "a settings file cannot name another",
}


class DaemonConfigError(ValueError):
    """The settings file cannot be read, or one of its settings is not one the daemon takes."""


def default_path() -> Path:
    """$XDG_CONFIG_HOME/m31r/daemon.toml (default ~/.config/...; a relative XDG_CONFIG_HOME is ignored, as the XDG
    specification says)."""
    base = os.environ.get("XDG_CONFIG_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".config") / "m31r" / "daemon.toml"


def read_defaults(path: Path, command: click.Command, ctx: click.Context) -> dict[str, Any]:
    """The file's settings as click's default_map for `command` ({parameter name: value}), each checked as the
    command line's would be: DaemonConfigError names the file, the setting and what is wrong."""
    try:
        with path.open("rb") as f:
            table = tomllib.load(f)
    except OSError as e:
        raise DaemonConfigError(f"cannot read the daemon settings {path}: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise DaemonConfigError(f"the daemon settings {path} are not TOML: {e}") from None
    options = {opt[2:]: p for p in command.params if isinstance(p, click.Option) for opt in p.opts
               if opt.startswith("--")}
    defaults: dict[str, Any] = {}
    for key, value in table.items():
        name = key.replace("_", "-")
        if name in NOT_HERE:
            raise DaemonConfigError(f"{path}: `{key}` is not read from the daemon settings: {NOT_HERE[name]}")
        param = options.get(name)
        if param is None:
            known = sorted(set(options) - set(NOT_HERE))
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean `{close[0]}`? " if close else ""
            raise DaemonConfigError(f"{path}: `{key}` is not a daemon setting ({hint}the settings are the daemon's "
                                    f"options: {', '.join(known)})")
        defaults[param.name] = _checked(path, key, value, param, ctx)  # type: ignore[index]
    return defaults


def device_error(path: Path, device: str) -> str | None:
    """What is wrong with the file's `device` on this machine (no CUDA, no Apple GPU), worded as the file's other
    errors: the option's own check names `--device`, which the user of an autostarted daemon never passed. Imports
    torch, except for `cpu`. Checked where the file's device is the one used, not while reading it: a file written
    for a GPU machine must not stop `m31r daemon --device cpu`."""
    from m31r.cli_common import device_problem

    why = device_problem(device)
    return f"{path}: `device = {_toml(device)}`: {why}" if why else None


def _checked(path: Path, key: str, value: object, param: click.Option, ctx: click.Context) -> object:
    """`value` converted and range-checked by the option's own type and callback."""
    kind = param.type
    if isinstance(kind, click.types.IntParamType):
        takes, want = int, "a whole number"
    elif isinstance(kind, click.types.FloatParamType):
        takes, want = int | float, "a number"
    else:
        takes = str
        want = "one of " + ", ".join(f'"{c}"' for c in kind.choices) if isinstance(kind, click.Choice) else "a string"
    if isinstance(value, bool) or not isinstance(value, takes):
        raise DaemonConfigError(f"{path}: `{key} = {_toml(value)}`: expected {want}")
    try:
        return param.process_value(ctx, value)
    except click.BadParameter as e:
        raise DaemonConfigError(f"{path}: `{key} = {_toml(value)}`: {e.message}") from None


def _toml(value: object) -> str:
    """`value` as TOML writes it (true, "int8", 4), for messages that quote the user's line back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value) if isinstance(value, int | float) else "[...]" if isinstance(value, list) else "{...}"

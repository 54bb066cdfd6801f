"""What the `m31r` commands share: one-line errors and exit statuses, option checks, a bundle's summary line.

Standard library and click only, as m31r.cli: its start-up cost is every command's."""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 1) -> NoReturn:
    """One line on stderr and a non-zero exit: users see what is wrong, not a traceback."""
    one_line = " ".join(part.strip() for part in message.splitlines() if part.strip())
    click.echo(f"error: {one_line}", err=True)
    sys.exit(code)


def _is_user_error(e: BaseException) -> bool:
    """Errors that describe bad input (a bundle, a config, an argument), as opposed to bugs. Not a closed pipe: its
    reader gone (`m31r service install --dry-run | head -1`), which m31r.cli's group ends quietly as every command's
    (taken here, it was `error: [Errno 32] Broken pipe` and exit 1).

    Checked through sys.modules so that catching BundleError never forces an import of torch.
    """
    if isinstance(e, BrokenPipeError):
        return False
    if isinstance(e, ValueError | OSError):  # ConfigError and ContextOverflowError are ValueErrors
        return True
    bundle = sys.modules.get("m31r.bundle")
    return bundle is not None and isinstance(e, bundle.BundleError)


def user_errors(fn: F) -> F:
    """Turn user-facing errors raised by a command into `error: <message>` + exit 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            if not _is_user_error(e):
                raise
            fail(str(e) or type(e).__name__)

    return wrapper  # type: ignore[return-value]


TERMINATED_EXIT = 128 + 15  # 128 + SIGTERM: what a shell reports for a program that `kill` or `timeout` ended


@contextlib.contextmanager
def sigterm_ends(said: str) -> Iterator[None]:
    """Inside, SIGTERM (from `timeout`, a service manager) ends the command through an exception, as Ctrl-C does, so
    that the clean-up of what it was writing runs (the default action ends the process on the spot); then `said`, in
    one line, exit TERMINATED_EXIT. A SIGTERM this process ignores stays ignored."""
    import signal
    import threading

    def terminated(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second one must not cut the clean-up short
        raise SystemExit(TERMINATED_EXIT)

    previous = signal.getsignal(signal.SIGTERM)  # (None: not set from Python, so the default)
    ours = threading.current_thread() is threading.main_thread() and previous != signal.SIG_IGN
    if ours:
        signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    except SystemExit as e:
        if e.code == TERMINATED_EXIT:
            fail(said, TERMINATED_EXIT)
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


INTERRUPTED_EXIT = 128 + 2  # 128 + SIGINT: what a shell reports for a program that Ctrl-C ended

CLOSED_PIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a program whose reader went away (`yes | head`)


def closed_pipe_exit() -> NoReturn:
    """stdout's reader is gone (`m31r generate ... | head -c 5`): not an error worth a message. stdout and stderr
    are pointed at /dev/null first, so that the interpreter's last flush of what is still buffered cannot fail
    again (Python would print a warning and exit 120). `m31r status`'s fast path (m31r.entry) ends the same way."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):  # None, or no file behind it
                os.dup2(devnull, stream.fileno())
    sys.exit(CLOSED_PIPE_EXIT)


# What writing the output fails with, a closed pipe aside: a full disk or quota, a file past its size limit, a
# device error. Connecting to the daemon never does.
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def output_failed(e: OSError) -> NoReturn:
    """stdout cannot take the output (`m31r generate > out.rs` on a full disk): one line and exit 1, not a traceback.
    stdout is pointed at /dev/null first, so that the interpreter's last flush cannot fail again."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    fail(f"cannot write the output: {e.strerror or e}")


def finite(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """FloatRange lets nan through (every comparison with it is false), and inf is no size, share or sampling
    setting a command can use."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number", ctx, param)
    return value


def a_number(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    """FloatRange lets nan through too: a timeout of nan fails every request that starts its clock (asyncio cannot
    schedule it), a time budget of nan is never spent; inf is a working "no limit" and stays allowed."""
    if value is not None and math.isnan(value):
        raise click.BadParameter(f"{value} is not a number", ctx, param)
    return value


def check_device(device: str) -> None:
    """Refuse a device torch cannot use on this machine, in one line naming the ones it can, before anything loads:
    torch refuses only at its first tensor there (the daemon's model load, the trainer's model), as `AssertionError:
    Torch not compiled with CUDA enabled` or a traceback, naming no device the machine has."""
    if why := device_problem(device):
        fail(f"--device {device}: {why}")


def device_problem(device: str) -> str | None:
    """Why torch cannot use `device` on this machine (naming the devices it can), or None. Imports torch, except for
    `cpu`: the daemon listens before torch is imported, which a check would delay."""
    if device == "cpu":
        return None
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    cuda = ["cuda" + (f" (cuda:0 to cuda:{count - 1})" if count > 1 else "")] if count else []
    has = f"this machine has: {', '.join(['cpu', *cuda, *(['mps'] if torch.backends.mps.is_available() else [])])}"
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return f"not a device name ({has})"
    if dev.type == "cuda" and not count:
        why = "this torch is built without CUDA" if torch.version.cuda is None else "torch finds no CUDA GPU"
        return f"no CUDA device ({why}); {has}"
    if dev.type == "cuda" and dev.index is not None and dev.index >= count:
        return f"no CUDA device {dev.index}; {has}"
    if dev.type == "mps" and not torch.backends.mps.is_available():
        return f"no MPS device (Apple GPUs only); {has}"
    if dev.type not in ("cpu", "cuda", "mps"):
        return f"m31r runs on cpu, cuda or mps, not {dev.type}; {has}"
    return None


class UserPath(click.Path):
    """click.Path with a leading `~` expanded to the home folder. A shell expands it only in an unquoted word's start
    (not in `--socket=~/x.sock`), and an editor that runs `m31r lsp --socket ~/x.sock` without a shell not at all:
    taken literally, `~` would be a folder of that name in the working directory."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value == "":  # Path("") is the working directory: not what `--socket "$UNSET_VAR"` meant
            self.fail("an empty path names nothing: leave the option out for the default", param, ctx)
        if isinstance(value, str):
            value = os.path.expanduser(value)
        return super().convert(value, param, ctx)


def bundle_summary(b: Any) -> str:
    """One line identifying a bundle: what scripts and humans need to know it is the right one."""
    meta = b.metadata
    q = meta.get("quantization")
    kind = f"{q['method']}" + (f" (group {q['group_size']})" if q.get("group_size") else "") + " weights" if q else ""
    return (f"ok {b.model_id}: {meta['parameter_count']:,} params, {kind + ', ' if kind else ''}{meta['dtype']}, "
            f"fingerprint {b.fingerprint}, {b.path}")

"""`m31r doctor`: check this machine's setup and explain it, one line per check (ok / warn / fail).

Each check is a plain function of a Context that returns one Check (or None: nothing to report, e.g. an editor
that is not installed). warn means "works, but slower or not set up"; only fail makes the command exit non-zero.
The checks reuse the code that decides at run time (m31r.native, m31r.engine.fast_bf16, m31r.bundle,
m31rd.sockets.check_folder, the blocking status client, m31rd.service), so doctor says what the daemon would do.
torch is imported only by the checks that need it (kernels, bf16, bundle); no model is built (the bundle's
weights are mapped, to check that they are finite).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from m31r.cpu import ARM_FEATURES, X86_FEATURES, cpu_info

Level = Literal["ok", "warn", "fail"]
VSCODE_EXTENSION = "m31r.m31r"  # publisher.name in editors/vscode/package.json


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    detail: str


@dataclass(frozen=True)
class Settings:
    """The settings file every daemon started here reads (m31r.daemon_config), read once for the checks."""

    path: Path
    found: dict | None  # the options' defaults it sets; None where there is no such file
    error: str | None = None  # why `m31r daemon` would refuse it

    @classmethod
    def read(cls) -> Settings:
        import click

        from m31r import daemon_config
        from m31r.cli import daemon

        path = daemon_config.default_path()
        if not path.is_file():
            return cls(path, None)
        try:
            return cls(path, daemon_config.read_defaults(path, daemon, click.Context(daemon)))
        except daemon_config.DaemonConfigError as e:
            return cls(path, {}, str(e))


@dataclass(frozen=True)
class Context:
    """What the checks look at: the socket, bundle and settings a client or daemon started here would use."""

    socket: Path
    socket_source: str
    bundle: Path
    bundle_source: str
    settings: Settings = field(default_factory=Settings.read)

    @classmethod
    def create(cls, socket: Path | None = None, bundle: Path | None = None) -> Context:
        from m31r_protocol.paths import default_socket_path
        from m31rd.main import default_bundle

        sock_src = "--socket" if socket else "$M31R_SOCKET" if os.environ.get("M31R_SOCKET") else "default"
        bundle_src = "--bundle" if bundle else "$M31R_BUNDLE" if os.environ.get("M31R_BUNDLE") else "default"
        return cls(socket or default_socket_path(), sock_src, bundle or default_bundle(), bundle_src)


def _run(cmd: list[str], timeout: float = 10.0) -> subprocess.CompletedProcess[str] | None:
    """The command's result, or None where it is missing, hangs or cannot start."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return None


def _config_home() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME", "")
    return Path(base) if os.path.isabs(base) else Path.home() / ".config"


# -- the CPU and what runs on it --------------------------------------------------------------------------------

def check_cpu(ctx: Context) -> Check:
    name, flags, arch = cpu_info()
    if not flags:
        return Check("cpu", "warn", f"{name} ({arch}): its features could not be read")
    table = ARM_FEATURES if arch in ("aarch64", "arm64") else X86_FEATURES
    have = [label for flag, label in table.items() if flag in flags]
    lacks = [label for flag, label in table.items() if flag not in flags]
    detail = f"{name} ({arch}): {' '.join(have) or 'none of the features that matter'}"
    if lacks:
        detail += f"; no {' '.join(lacks)}"
    basic = {"avx2", "fma"} if table is X86_FEATURES else {"asimd"}
    if not basic <= flags:
        return Check("cpu", "warn", detail + " (torch runs its slowest kernels here)")
    return Check("cpu", "ok", detail)


def check_compiler(ctx: Context) -> Check:
    from m31r.native import cc_problem, compiler

    cc = compiler()
    if cc is None and (why := cc_problem()) is not None:  # "or set CC" to a user who did, naming nothing wrong with it
        return Check("compiler", "warn", f"no C compiler: CC={os.environ.get('CC', '').strip()} cannot be used ({why}) "
                                         "and there is no cc, gcc or clang on PATH, so the native kernels cannot be "
                                         "built; fix CC, or install a compiler (`apt-get install gcc`, "
                                         "`xcode-select --install` on macOS)")
    if cc is None:
        return Check("compiler", "warn", "no C compiler (cc, gcc, clang or $CC): the native kernels cannot be built; "
                                         "install one (`apt-get install gcc`, `xcode-select --install` on macOS) or "
                                         "set CC")
    if (why := cc_problem()) is not None:  # a typo in CC: the kernels build all the same, with another compiler
        return Check("compiler", "warn", f"CC={os.environ.get('CC', '').strip()} is not used: {why}; the native "
                                         f"kernels build with {cc} (fix or unset CC)")
    return Check("compiler", "ok", f"{cc} (builds the native kernels, m31r/kernels*.c, on the first engine load)")


def configured_precision(settings: Settings) -> tuple[str, str, str]:
    """The --dtype and --quant a daemon started here runs with unless told otherwise: the settings file's where it
    sets them, else auto (a file it refuses: check_settings fails); and how to say where they come from."""
    found = settings.found or {}
    dtype, quant = found.get("dtype", "auto"), found.get("quant", "auto")
    return dtype, quant, "by default" if dtype == quant == "auto" else f"as {settings.path.name} sets"


def check_kernels(ctx: Context) -> Check:
    from m31r import native

    why = native.unavailable()
    if why is None:
        import torch

        from m31r.precision import resolve

        # the family for the daemon's activations; built once (~0.3 s) into the cache the daemon uses
        dtype_opt, quant_opt, _ = configured_precision(ctx.settings)
        dtype = getattr(torch, resolve(torch.device("cpu"), dtype_opt, quant_opt, None).dtype)
        kernels = native.load(dtype)
        if kernels is None:
            why = "the build failed (run `m31r daemon --log-level info` to see the compiler's message)"
        else:
            detail = f"{kernels.describe()}, {kernels.reason} ({kernels.path})"
            if kernels.name == "avx512" and not kernels.int8:
                detail += "; int8 layers on torch's kernel (no AVX512-BF16)"
            cache = native.cache_dir()
            if kernels.path.parent != cache:  # built in a private folder: the cache could not take the build
                why = _cannot_create(cache) or "read-only, full or not yours?"
                return Check("kernels", "warn", f"{detail}; not cached: {cache} cannot take the build ({why}), so "
                                                "every daemon start compiles them again: make it writable, or set "
                                                "XDG_CACHE_HOME to a folder you can write")
            return Check("kernels", "ok", detail)
    return Check("kernels", "warn", f"native kernels off: {why}; decode attention runs in eager torch, quantized "
                                    "layers on torch's kernels (slower)")


def check_bf16(ctx: Context) -> Check:
    import torch

    from m31r.engine import fast_bf16
    from m31r.precision import resolve

    dtype, quant, source = configured_precision(ctx.settings)
    p = resolve(torch.device("cpu"), dtype, quant, None)  # builds or finds the kernels check_kernels loaded
    weights = {"int8": "int8 weights", "int4": "int4 weights", None: "float weights"}[p.quant]
    act = {"bfloat16": "bf16", "float16": "fp16"}.get(p.dtype, "fp32")
    serves = f"the daemon serves {act} activations with {weights} {source}"
    if fast_bf16(torch.device("cpu")):
        extra = "" if p.dtype == "bfloat16" else (
            ", int8 prefill chunks as bf16 GEMMs (`--prefill-gemm`)" if p.quant == "int8" else "")
        return Check("bf16", "ok", f"native (AVX512-BF16 or AMX): {serves}{extra}")
    return Check("bf16", "warn", f"emulated by torch on this CPU (slower than fp32): {serves}")


# -- the daemon's settings file ------------------------------------------------------------------------------------


def check_settings(ctx: Context) -> Check:
    """The settings file every daemon started here reads (m31r.daemon_config), checked as `m31r daemon` checks it."""
    from m31r import daemon_config
    from m31r.cli import daemon

    path, found = ctx.settings.path, ctx.settings.found
    if found is None:
        return Check("settings", "ok", f"no {path}: daemons run on their defaults and the options they are given")
    if ctx.settings.error is not None:
        why = ctx.settings.error
        return Check("settings", "fail", f"{why}; every daemon started here refuses to start until it is fixed")
    if not found:
        return Check("settings", "ok", f"{path} sets nothing: daemons run on their defaults")
    if "device" in found and (why := daemon_config.device_error(path, found["device"])):  # said ok; no daemon started
        return Check("settings", "fail", f"{why}; every daemon started here without --device refuses to start until "
                                         "it is fixed")
    names = {p.name: p.opts[0] for p in daemon.params}
    shown = ", ".join(f"{names[k]} {v}" for k, v in found.items())
    return Check("settings", "ok", f"{path}: daemons started here default to {shown} (a running daemon read it "
                                   "when it started)")


# -- the model bundle ---------------------------------------------------------------------------------------------


def check_bundle(ctx: Context) -> Check:
    from m31r.bundle import BundleError, load_weights, open_bundle

    try:
        b = open_bundle(ctx.bundle)  # checksums, config, tokenizer, tensor shapes
        load_weights(b)  # mapped, not copied: only so that NaN or infinite weights fail here as they would at load
    except (BundleError, OSError, ValueError) as e:
        return Check("bundle", "fail", f"{ctx.bundle} ({ctx.bundle_source}): {e}")
    meta = b.metadata
    q = b.quantization
    quant = (f"{q['method']} weights" + (f" (group {q['group_size']})" if q.get("group_size") else "")) if q \
        else "float weights"
    return Check("bundle", "ok", f"{b.path} ({ctx.bundle_source}): {b.model_id}, {meta['parameter_count']:,} params, "
                                 f"{meta['dtype']}, {quant}, fingerprint {b.fingerprint}; checksums match")


# -- the socket and the daemon ------------------------------------------------------------------------------------


def check_socket(ctx: Context) -> Check:
    import stat

    from m31r_protocol.paths import socket_path_problem
    from m31rd.sockets import UnsafeSocketFolder, check_folder

    folder = ctx.socket.parent
    where = f"{ctx.socket} ({ctx.socket_source})"
    if why := socket_path_problem(ctx.socket):
        return Check("socket", "fail", why)
    if not os.path.lexists(folder):
        if why := _cannot_create(folder):
            return Check("socket", "fail", f"{where}: its folder cannot be created: {why}; choose a socket path in a "
                                           "folder you can write to (--socket, or M31R_SOCKET)")
        return Check("socket", "ok", f"{where}: its folder does not exist yet; the daemon creates it 0700")
    try:
        check_folder(folder)  # the daemon's own test: ours alone, no group or other bits
    except UnsafeSocketFolder as e:
        return Check("socket", "fail", f"{where}: {e}")
    if os.path.lexists(ctx.socket) and not stat.S_ISSOCK(os.lstat(ctx.socket).st_mode):
        return Check("socket", "fail", f"{where} exists and is not a socket: the daemon will not replace it")
    mode = stat.S_IMODE(os.stat(folder).st_mode)
    return Check("socket", "ok", f"{where}: folder owned by you, mode {mode:04o}")


def _cannot_create(folder: Path) -> str | None:
    """Why the daemon could not make `folder` (its nearest existing ancestor is a file, or not writable: a read-only
    XDG_RUNTIME_DIR, another user's), or None."""
    parent = folder
    while not os.path.lexists(parent):
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a folder"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable (a read-only file system, or another user's folder)"
    return None


def check_daemon(ctx: Context) -> Check:
    from m31r_protocol import blocking
    from m31r_protocol.capabilities import missing, restart_hint
    from m31r_protocol.connecting import QueueFull
    from m31r_protocol.paths import MAX_SOCKET_PATH_BYTES, socket_path_problem
    from m31r_protocol.peer import ForeignPeer

    if len(os.fsencode(ctx.socket)) > MAX_SOCKET_PATH_BYTES:
        return Check("daemon", "fail", f"none can listen on {ctx.socket}: the path is too long (the socket check says "
                                       "how long it may be)")
    cannot_start = Check("daemon", "warn", f"none answers on {ctx.socket}, and none can start there until the socket "
                                           "check passes")
    if socket_path_problem(ctx.socket):  # a folder: the socket check fails it, and says what to name instead
        return cannot_start
    try:
        welcome, s = blocking.welcome_and_status(ctx.socket, timeout=2.0)
    except ForeignPeer as e:
        return Check("daemon", "fail", str(e))
    except QueueFull as e:
        return Check("daemon", "warn", str(e))
    except (FileNotFoundError, ConnectionRefusedError):
        if check_socket(ctx).level == "fail":  # an unsafe folder, a file on the path: no daemon starts there
            return cannot_start
        return Check("daemon", "warn", f"none answers on {ctx.socket}: `m31r generate`, `fim`, `lsp` and `serve` "
                                       "start one on first use")
    except NotADirectoryError:
        return Check("daemon", "fail", f"none can listen on {ctx.socket}: a folder on its path is a file")
    except PermissionError as e:
        return Check("daemon", "fail", f"{ctx.socket}: {e.strerror or e}: the socket is not yours to use")
    except TimeoutError:
        return Check("daemon", "warn", f"{ctx.socket} accepts connections but gave no status within 2 s (a daemon "
                                       "still loading, or a service starting?)")
    except (OSError, ValueError, UnicodeDecodeError) as e:
        if other := _other_version(ctx.socket):
            return Check("daemon", "fail", other)
        return Check("daemon", "fail", f"something answers on {ctx.socket}, but not as this m31r's daemon does: {e}")
    quant = f", {s['quant']} weights" if s.get("quant") else ""
    n = s.get("requests")
    serves = (f"pid {s.get('pid')} serves {s.get('model')} ({s.get('device')}, {s.get('dtype')}{quant}) from "
              f"{s.get('bundle')}; up {s.get('uptime_s', 0):.0f} s, {n} request{'' if n == 1 else 's'}")
    caps = welcome.get("capabilities")
    if isinstance(caps, list) and (lacks := missing([str(c) for c in caps])):
        return Check("daemon", "warn", f"{serves}; {restart_hint(lacks)}")
    return Check("daemon", "ok", serves)


def _other_version(path: Path) -> str | None:
    """Where a daemon of another protocol version answers on `path` (an older or newer m31r's, the service's after an
    upgrade), what it said and the way out, else None. The status probe says only "unexpected handshake reply"; the
    full client reads the daemon's refusal. This m31r cannot stop it (`m31r stop` says Hello first), so its pid."""
    import asyncio
    import socket

    from m31r_protocol.client import Client, DaemonError
    from m31r_protocol.peer import peer_pid

    async def hello() -> None:
        async with await Client.connect(path, client="m31r-doctor", timeout=2.0, welcome_timeout=2.0):
            pass

    try:
        asyncio.run(hello())
    except DaemonError as e:
        if e.code != "unsupported_version":
            return None
        said = e.message
    except Exception:  # noqa: BLE001 - the caller reports the status probe's own error
        return None
    else:
        return None
    kill = "stop it with the m31r that started it"
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(2.0)
            s.connect(str(path))
            if (pid := peer_pid(s)) is not None:
                kill = f"`kill {pid}` ends it (gracefully)"
    except OSError:
        pass
    return (f"another m31r's daemon answers on {path} ({said}), and this one cannot stop it: {kill}, and the next "
            "request starts this install's; a service installed from that m31r starts its own again until "
            "`m31r service install --force` here")


# -- the service units --------------------------------------------------------------------------------------------


def check_service(ctx: Context) -> Check:
    from m31rd import service

    try:
        kind = service.detect_kind()
    except ValueError as e:
        return Check("service", "warn", str(e))
    paths = service.unit_paths(kind)
    present = [p for p in paths if p.exists()]
    if not present:
        return Check("service", "warn", f"not installed (`m31r service install` runs the daemon as a {kind} user "
                                        "service; clients start one on demand without it)")
    if len(present) < len(paths):
        missing = ", ".join(str(p) for p in paths if p not in present)
        return Check("service", "fail", f"half installed: {missing} is missing; run `m31r service install` again")
    state = _systemd_state(paths) if kind == "systemd" else _launchd_state(paths[0])
    return _with_its_socket(state, service.installed_socket(kind), ctx)


def _with_its_socket(state: Check, served: Path | None, ctx: Context) -> Check:
    """The service check, saying which socket the service listens on: one other than the clients' here (a service
    installed before M31R_SOCKET was set, or from another shell) is never reached, and their first request starts a
    second daemon beside it."""
    if served is None:
        return Check(state.name, state.level, f"{state.detail}; which socket it listens on cannot be read")
    if os.path.abspath(served) == os.path.abspath(ctx.socket):
        return Check(state.name, state.level, f"{state.detail}; it listens on {served}")
    return Check(state.name, "fail" if state.level == "fail" else "warn",
                 f"{state.detail}; it listens on {served}, but clients here use {ctx.socket} ({ctx.socket_source}): "
                 f"they never reach it and start a daemon of their own; set M31R_SOCKET={shlex.quote(str(served))}, "
                 "or move the service with `m31r service install --force` here (then restart it)")


def systemd_unquote(word: str, escapes: str = "%$") -> str | None:
    """Undo service.systemd_quote's escaping of one ExecStart= word that shlex has unquoted: `%%` is a `%`, `$$` a
    `$`. None where a lone `%` (a specifier such as %h) or `$` (a variable) is left, which only systemd can expand.
    The command (the first word) takes escapes="%": systemd expands no variables there (service.systemd_executable)."""
    out, i = [], 0
    while i < len(word):
        c = word[i]
        if c in escapes:
            if word[i + 1:i + 2] != c:
                return None
            i += 1
        out.append(c)
        i += 1
    return "".join(out)


def _systemd_state(paths: list[Path]) -> Check:
    from m31rd.service import unit_dir

    for line in paths[1].read_text(errors="replace").splitlines():  # m31rd.service: does its command still exist?
        if line.startswith("ExecStart="):
            try:  # systemd_quote's quoting is a subset of the shell's
                exe = systemd_unquote(shlex.split(line.removeprefix("ExecStart="))[0], escapes="%")
            except (ValueError, IndexError):
                return Check("service", "fail", f"{paths[1]}: cannot read its ExecStart= line")
            if exe is not None and not os.path.exists(exe):
                return Check("service", "fail", f"{paths[1]} runs {exe}, which no longer exists: run "
                                                "`m31r service install --force` (it keeps the old unit as .bak)")
    if shutil.which("systemctl") is None:
        return Check("service", "warn", f"units installed in {unit_dir('systemd')}; systemctl not found")
    enabled = _run(["systemctl", "--user", "is-enabled", "m31rd.socket"])
    active = _run(["systemctl", "--user", "is-active", "m31rd.socket"])
    if enabled is None or active is None or "bus" in (enabled.stderr + active.stderr).lower():
        return Check("service", "warn", f"units installed in {unit_dir('systemd')}; no systemd user manager answers")
    state = f"m31rd.socket {enabled.stdout.strip() or 'unknown'}, {active.stdout.strip() or 'unknown'}"
    if enabled.returncode != 0 or active.returncode != 0:
        return Check("service", "warn", f"{state}: `systemctl --user enable --now m31rd.socket` starts it")
    return Check("service", "ok", f"{state} (the daemon starts on the first connection)")


def _launchd_state(plist: Path) -> Check:
    from m31rd.service import LAUNCHD_LABEL

    out = _run(["launchctl", "print", f"gui/{os.getuid()}/{LAUNCHD_LABEL}"])
    if out is None or out.returncode != 0:
        return Check("service", "warn", f"{plist} installed but not loaded: `launchctl bootstrap gui/{os.getuid()} "
                                        f"{plist}` loads it")
    return Check("service", "ok", f"{LAUNCHD_LABEL} loaded ({plist})")


# -- editors: only those found are reported -----------------------------------------------------------------------


def _mentions_m31r(files: list[Path], limit: int = 2000) -> Path | None:
    """The first of `files` (at most `limit`, each under 1 MB) that mentions m31r."""
    for f in files[:limit]:
        try:
            if f.is_file() and f.stat().st_size < 1 << 20 and "m31r" in f.read_text(errors="replace").lower():
                return f
        except OSError:
            continue
    return None


def check_vscode(ctx: Context) -> Check | None:
    code = shutil.which("code")
    if code is not None:
        out = _run([code, "--list-extensions"], timeout=20)
        if out is not None and out.returncode == 0:
            if VSCODE_EXTENSION in out.stdout.lower().split():
                return Check("vscode", "ok", f"extension {VSCODE_EXTENSION} installed")
            return Check("vscode", "warn", "the M31R extension is not installed: `make vsix`, then "
                                           "`code --install-extension editors/vscode/m31r.vsix`")
    ext_dir = Path.home() / ".vscode" / "extensions"
    if not ext_dir.is_dir():
        return None if code is None else Check("vscode", "warn", "`code --list-extensions` did not answer")
    found = sorted(ext_dir.glob(f"{VSCODE_EXTENSION}-*"))
    if found:
        return Check("vscode", "ok", f"extension installed in {found[-1]}")
    return Check("vscode", "warn", f"the M31R extension is not in {ext_dir}: `make vsix`, then "
                                   "`code --install-extension editors/vscode/m31r.vsix`")


def check_neovim(ctx: Context) -> Check | None:
    conf = _config_home() / "nvim"
    if not conf.is_dir():
        return Check("neovim", "warn", "nvim found but no config folder: see editors/neovim/README.md") \
            if shutil.which("nvim") else None
    files = sorted(p for p in conf.rglob("*") if p.suffix in (".lua", ".vim"))
    hit = _mentions_m31r(files)
    if hit:
        return Check("neovim", "ok", f"{hit} sets up m31r")
    return Check("neovim", "warn", f"no file in {conf} mentions m31r: see editors/neovim/README.md")


def check_helix(ctx: Context) -> Check | None:
    conf = _config_home() / "helix"
    langs = conf / "languages.toml"
    if not langs.is_file():
        if conf.is_dir() or shutil.which("hx") or shutil.which("helix"):
            return Check("helix", "warn", f"no {langs}: merge editors/helix/languages.toml into it")
        return None
    if _mentions_m31r([langs]):
        return Check("helix", "ok", f"{langs} has the m31r language server")
    return Check("helix", "warn", f"{langs} has no m31r language server: merge editors/helix/languages.toml")


def check_emacs(ctx: Context) -> Check | None:
    home = Path.home()
    inits = [home / ".emacs", home / ".emacs.el", home / ".emacs.d" / "init.el", _config_home() / "emacs" / "init.el"]
    present = [p for p in inits if p.is_file()]
    if not present:
        return Check("emacs", "warn", "emacs found but no init file: see editors/emacs/README.md") \
            if shutil.which("emacs") else None
    hit = _mentions_m31r(present)
    if hit:
        return Check("emacs", "ok", f"{hit} loads m31r")
    return Check("emacs", "warn", f"{', '.join(map(str, present))} does not mention m31r: see "
                                  "editors/emacs/README.md")


EDITOR_CHECKS: tuple[Callable[[Context], Check | None], ...] = (check_vscode, check_neovim, check_helix, check_emacs)
CHECKS: tuple[Callable[[Context], Check | None], ...] = (
    check_cpu, check_compiler, check_kernels, check_bf16, check_settings, check_bundle, check_socket, check_daemon,
    check_service,
)


def _safely(fn: Callable[[Context], Check | None], ctx: Context) -> Check | None:
    """A check that breaks is reported as a fail naming the error, never as a traceback that hides the others."""
    try:
        return fn(ctx)
    except Exception as e:  # every other check must still run
        return Check(fn.__name__.removeprefix("check_"), "fail", f"the check itself failed: {type(e).__name__}: {e}")


def run_checks(ctx: Context) -> list[Check]:
    results = [c for fn in CHECKS if (c := _safely(fn, ctx)) is not None]
    editors = [c for fn in EDITOR_CHECKS if (c := _safely(fn, ctx)) is not None]
    if not editors:
        editors = [Check("editors", "warn", "no VS Code, Neovim, Helix or Emacs setup found (see editors/README.md)")]
    return results + editors


def failed(checks: list[Check]) -> bool:
    return any(c.level == "fail" for c in checks)


def render_text(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.level:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def render_json(checks: list[Check]) -> str:
    return json.dumps({"ok": not failed(checks), "checks": [asdict(c) for c in checks]}, indent=2)

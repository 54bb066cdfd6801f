"""`m31r daemon`: load the bundle, listen, warm up while answering Status, serve until SIGTERM/SIGINT or a Shutdown
request."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from m31r_protocol.logs import log_json

log = logging.getLogger("m31rd")
# Prompt-lookup drafts per decode step by default (docs/speed.md "Prompt-lookup decoding"): a lone stream's typing
# answers come sooner and its p95 holds; a decode beside other streams runs without drafts (Engine.run), so throughput
# holds.
LOOKAHEAD = 3
# The beam width of greedy line completions that do not choose (m31r.beams; README "Beam search for line completions").
BEAMS = 3
# Open files the daemon asks for (raise_open_files_limit): a descriptor per client connection, with room to spare.
OPEN_FILES = 1 << 16
MACOS_OPEN_MAX = 10240  # OPEN_MAX: what macOS's setrlimit takes for RLIMIT_NOFILE whatever the hard limit says


def setup_logging(level: str, file: Path | None = None) -> None:
    log_json(["m31rd"], level, file)


def default_bundle() -> Path:
    """$M31R_BUNDLE, else the release/ bundle that ships with m31r: the data package `m31r_release`, which is the
    checkout's release/ folder under an editable install and a copy in site-packages under a wheel's (there is no
    release/ beside an installed package)."""
    env = os.environ.get("M31R_BUNDLE")
    if env:
        return Path(os.path.expanduser(env))  # `~` quoted in a profile, as M31R_SOCKET's
    spec = importlib.util.find_spec("m31r_release")
    if spec is not None and spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(__file__).resolve().parent.parent / "release"  # a source tree on sys.path, not installed


@dataclass
class DaemonOptions:
    bundle: Path
    socket: Path
    device: str = "cpu"
    dtype: str = "auto"
    kv_dtype: str = "auto"  # see Engine: float16 where the fp32 kernels read it
    prefill_gemm: str = "auto"  # see Engine: bf16 GEMMs for int8 prefill chunks where bf16 is native
    threads: int | None = None
    cache_mb: float = 1536
    max_queue: int = 32
    max_per_connection: int = 16
    max_prompt_chars: int = 1 << 21
    read_timeout: float = 10.0
    max_active: int = 8
    chunk_size: int = 8
    decode_width: int = 8
    lookahead: int = LOOKAHEAD
    beams: int = BEAMS
    quant: str | None = "auto"  # auto | int8 | int4 | none (see m31r.engine.auto_precision)
    grace_s: float = 5.0
    log_level: str = "info"
    log_file: Path | None = None  # stderr when None
    settings: Path | None = None  # the settings file the options' defaults came from (m31r.daemon_config), if any


def raise_open_files_limit(want: int = OPEN_FILES) -> int | None:
    """Raise the soft limit on open files towards `want` (never past the hard limit), and return it (None where
    there is no such limit). Every client connection holds a descriptor: at an inherited soft limit (1024 on most
    Linux logins, 256 on macOS, less under some supervisors) a burst of clients left the daemon closing every new
    connection at once, `m31r status` and `m31r stop` included, until some went away. The hard limit is the
    system's word on what a process may have; the soft one is only a default."""
    try:
        import resource
    except ImportError:  # no such limits here
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        for limit in (target, min(target, MACOS_OPEN_MAX)):  # macOS refuses more than its own per-process maximum
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
                break
            except (ValueError, OSError):
                continue
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


def run(opts: DaemonOptions) -> int:
    try:
        setup_logging(opts.log_level, opts.log_file)
    except OSError as e:  # --log-file in a folder that cannot be made or written: say so, before any socket exists
        from m31rd.sockets import why_not

        print(f"m31rd: cannot write the log file {opts.log_file}: {why_not(e, opts.log_file)}; choose another "
              f"--log-file", file=sys.stderr)
        return 1
    # Before any socket file exists: a client that sees the file and signals must never meet the default handler,
    # which kills the process and leaves the file behind.
    start_up = _StartUp()
    try:
        return _run(opts, start_up)
    except _Interrupted as e:
        start_up.defer()  # a second signal must not cut the clean-up short
        if start_up.owned is not None:
            start_up.owned.unlink(missing_ok=True)
        log.info("stopped", extra={"fields": {"reason": str(e)}})
        return 0


def _run(opts: DaemonOptions, start_up: _StartUp) -> int:
    """Listen at once and serve while the model loads: importing torch and building the engine (~1–2 s) happen on
    the torch thread while the event loop already answers Hello and Status (`warming`), so a launch is seen to be up
    in a fraction of that (docs/speed.md "Medium shape": launch → status). Requests wait for the model, then run
    warm."""
    from m31r.checksums import BundleError, check_present, verify_in_background
    from m31rd.server import BundleIdentity, Daemon
    from m31rd.sockets import SocketInUse, UnsafeSocketFolder, activated_socket, bind_unix, sd_notify
    from m31rd.torch_thread import TorchThread

    t0 = time.perf_counter()
    open_files = raise_open_files_limit()  # before the first client can connect
    try:  # before the socket: a daemon that cannot load must leave no socket file (and say why, not how)
        check_present(opts.bundle)
    except BundleError as e:
        log.error("cannot load the model: %s", e)
        print(f"m31rd: cannot load the model: {e}", file=sys.stderr)
        return 1
    sock = activated_socket()
    owned = None
    if sock is None:
        try:
            with start_up.held():
                sock = bind_unix(opts.socket)
                start_up.owned = owned = opts.socket
        except (SocketInUse, UnsafeSocketFolder, OSError) as e:
            log.error("cannot listen: %s", e)
            print(f"m31rd: {e}", file=sys.stderr)
            return 1
    # Hashing the weights needs no torch: it runs on the other core while the torch thread imports torch.
    verified = verify_in_background(opts.bundle)
    torch_thread = TorchThread()  # every torch call from here on runs there (see torch_thread)
    daemon = Daemon(torch_thread, BundleIdentity.read(opts.bundle), cache_mb=opts.cache_mb,
                    max_queue=opts.max_queue, max_active=opts.max_active, grace_s=opts.grace_s,
                    max_per_connection=opts.max_per_connection, max_prompt_chars=opts.max_prompt_chars,
                    read_timeout=opts.read_timeout or None, lookahead=opts.lookahead, beams=opts.beams,
                    device=opts.device,
                    dtype=opts.dtype)
    load_ms = 0.0

    def load() -> None:
        nonlocal load_ms
        from m31r.engine import Engine

        daemon.attach(Engine(opts.bundle, device=opts.device, dtype=opts.dtype, kv_dtype=opts.kv_dtype,
                             prefill_gemm=opts.prefill_gemm, threads=opts.threads, chunk_size=opts.chunk_size,
                             quant=opts.quant, decode_width=opts.decode_width, verified=verified))
        load_ms = (time.perf_counter() - t0) * 1000

    # Loading, then warm-up, then the scheduler's rounds (Daemon.serve queues those): the torch thread runs them in
    # order, so the first request runs on a warm engine. READY=1 and the "ready" log mean ready to complete.
    loading = torch_thread.submit(load)
    warming = torch_thread.submit(_warm_up, daemon, opts.threads)
    start_up.defer()

    def on_serving() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, daemon.request_stop, f"signal {signal.Signals(sig).name}")
        if start_up.pending:
            daemon.request_stop(start_up.pending)

    def on_ready() -> None:
        engine = daemon.engine
        sd_notify("READY=1")
        log.info("ready", extra={"fields": {
            "model": engine.bundle.model_id, "fingerprint": engine.bundle.fingerprint, "device": opts.device,
            "dtype": str(engine.dtype).removeprefix("torch."), "quant": engine.quant, "threads": daemon.threads,
            "socket": str(owned or "systemd-activated"), **({"settings": str(opts.settings)} if opts.settings else {}),
            "load_ms": round(load_ms, 1), "open_files": open_files,
            "ready_ms": round((time.perf_counter() - t0) * 1000, 1), "cache_slots": daemon.cache.max_slots,
            "pid": os.getpid()}})

    try:
        import uvloop

        uvloop.run(daemon.serve(sock, owned, loading, warming, on_ready, on_serving))
    except ImportError:
        asyncio.run(daemon.serve(sock, owned, loading, warming, on_ready, on_serving))
    torch_thread.close(5.0)
    if daemon.load_error is not None:
        print(f"m31rd: cannot load the model: {daemon.load_error}", file=sys.stderr)
        return 1
    sd_notify("STOPPING=1")
    log.info("stopped", extra={"fields": {"reason": daemon.stop_reason}})
    return 0


class _Interrupted(BaseException):
    """SIGTERM or SIGINT before the daemon serves: nothing to drain, just leave. A BaseException, as
    KeyboardInterrupt is, so that no `except Exception` on the way (imports, model loading) swallows it."""


class _StartUp:
    """SIGTERM/SIGINT until the event loop takes them over: until the socket is bound, leave at once (_Interrupted);
    from then on (the model loads on the torch thread while the loop starts), stop as soon as the loop runs
    (`pending`). `owned` is the socket file this process made, which leaving removes."""

    def __init__(self) -> None:
        self.owned: Path | None = None
        self.pending: str | None = None  # the first signal that was held or came after warm-up
        self._interrupt = True
        self._held = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: object) -> None:
        self.pending = self.pending or f"signal {signal.Signals(signum).name}"
        if self._interrupt and not self._held:
            raise _Interrupted(f"{self.pending} during start-up")

    @contextmanager
    def held(self) -> Iterator[None]:
        """A signal waits for the end of the block, then interrupts: for a socket file and the record of whose it
        is, which a signal must not come between."""
        self._held = True
        try:
            yield
        finally:
            self._held = False
        if self._interrupt and self.pending:
            raise _Interrupted(f"{self.pending} during start-up")

    def defer(self) -> None:
        """From now on a signal is only recorded (`pending`): the daemon stops once its loop runs."""
        self._interrupt = False


def _warm_up(daemon, threads: int | None) -> None:
    """Probe the decode widths and run one short generation through a cache slot, so the first real request pays
    no first-call costs. A failure is logged, not fatal: requests then pay those costs themselves.

    Runs on the torch thread with the daemon's --threads (set again here, so that nothing run since the engine
    loaded can have changed it): on a busy machine, OpenMP teams wider than the cores free make every op of the
    probe wait for descheduled workers."""
    if daemon.engine is None or daemon.closing.is_set():  # the model did not load, or the daemon is stopping
        return
    import torch

    if threads:
        torch.set_num_threads(threads)
    daemon.threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        engine = daemon.engine
        widths = engine.decode_widths
        ids = engine.tokenizer.encode("fn main() {\n    let x = 1;\n")
        slot = daemon.cache.acquire(ids, "")
        try:  # the slot goes back whatever happens: with one slot, a lost one would hold every request for ever
            for _ in engine.generate(ids, max_tokens=2, cache=slot.cache):
                pass
        finally:
            slot.cache.reset()
            daemon.cache.release(slot, 0, 0)
    except Exception:
        log.exception("warm-up failed")
        return
    follow = _govern_threads(engine, daemon.threads)
    log.info("warm", extra={"fields": {"warm_ms": round((time.perf_counter() - t0) * 1000, 1),
                                       "threads": daemon.threads, "threads_follow_load": follow,
                                       "decode_widths": widths,
                                       "chunks_share_passes": engine.fuse,
                                       **engine.kernel_report}})


def thread_check_ids(engine) -> list[int]:
    """The prompt _govern_threads checks: the widest prefill chunk and a short one (chunk_layout: max_chunk, then
    chunk_size), and chunks of other sizes for its half. Prompts are prefilled in chunks of up to max_chunk, whose
    GEMMs may split their work across threads otherwise than a short chunk's: a 96-token check saw only chunks of 64
    and 32."""
    want = min(engine.max_chunk + engine.chunk_size, engine.config.max_context - engine.decode_width - 2)
    line = engine.tokenizer.encode("fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * 2).collect();\n")
    return (line * (want // max(1, len(line)) + 1))[:want]


def _govern_threads(engine, ceiling: int) -> str:
    """Let the thread count follow the CPUs other processes leave free (m31rd.torch_thread.ThreadGovernor): under a
    `cargo build` an OpenMP team as wide as the machine stalls every decode step at its barriers. Only where the
    model's logits are the same bits at 1 thread and at `ceiling` (checked here on the kinds of pass a request runs:
    long and short prefill chunks, decodes of one row, of two streams and of the widest draft rows), so that no output
    depends on the machine's load. Returns what was decided, for the warm-up's log."""
    import torch

    from m31r.engine import Decode
    from m31rd.torch_thread import ThreadGovernor

    if engine.device.type != "cpu":
        return f"no: the model runs on {engine.device.type}"
    governor = ThreadGovernor.where_supported(ceiling)
    if governor is None:
        return "no: one thread" if ceiling < 2 else "no: no /proc/stat to read the load from"
    ids = thread_check_ids(engine)

    def logits(threads: int) -> list[torch.Tensor]:
        torch.set_num_threads(threads)
        caches = [engine.new_cache(), engine.new_cache()]
        try:
            out = [x for x in engine.prefill(caches[0], ids, 0) if x is not None]
            out += [x for x in engine.prefill(caches[1], ids[: len(ids) // 2 + 1], 0) if x is not None]
            out.append(engine.decode_rows(caches[:1], [int(out[0].argmax())]))
            out.append(engine.decode_rows(caches, [int(out[-1].argmax()), int(out[1].argmax())]))
            wide = Decode(caches[0], ids[1], drafts=ids[2 : engine.decode_width + 1])
            return out + engine.run([wide], [])[0]
        finally:
            for c in caches:
                c.reset()

    try:
        one, many = logits(1), logits(ceiling)
    except Exception:  # as the warm-up's own failures: logged, and the thread count stays as it is
        log.exception("checking the logits across thread counts failed")
        return "no: the check failed"
    finally:
        torch.set_num_threads(ceiling)
    if not all(torch.equal(a, b) for a, b in zip(one, many, strict=True)):
        return f"no: the logits at 1 and at {ceiling} threads differ"
    engine.before_pass = governor.adjust
    return "yes"

"""The `m31r` console script.

Startup cost matters: daemon clients (`status`, `stop`, completions from an editor) must answer in well under
50 ms, so this module imports only the standard library and click. torch and everything that imports it
(m31r.bundle, m31r.engine, m31r.hf_import) are imported inside the commands that need them.

Layout: the top-level group, then one section per command or group of commands; the `bundle` and `train` groups
live in m31r.cli_bundle and m31r.cli_train, and what the commands share in m31r.cli_common. Add a command by adding
a section; keep its heavy imports inside the function body.
"""

from __future__ import annotations

import codecs
import contextlib
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from m31r.cli_bundle import bundle
from m31r.cli_common import (
    CLOSED_PIPE_EXIT,
    INTERRUPTED_EXIT,
    OUTPUT_ERRNOS,
    TERMINATED_EXIT,
    F,
    UserPath,
    a_number,
    check_device,
    closed_pipe_exit,
    fail,
    finite,
    output_failed,
    user_errors,
)
from m31r.cli_train import train


class _Main(click.Group):
    """The top-level group: a closed stdout pipe ends any command quietly with CLOSED_PIPE_EXIT (click's own
    handling would exit 1, like a failure); output that cannot be written is one line."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except BrokenPipeError:
            closed_pipe_exit()
        except KeyboardInterrupt:  # Ctrl-C outside a client's stream (reading the prompt): click said `Aborted!`, 1
            sys.exit(INTERRUPTED_EXIT)
        except OSError as e:
            if e.filename is None and e.errno in OUTPUT_ERRNOS:
                output_failed(e)
            raise


def need_stdout() -> None:
    """Commands whose output is the point refuse to run with stdout closed (`>&-`: sys.stdout is None), before
    they ask the daemon for anything. They write UTF-8 whatever the locale: Rust source is UTF-8, and a locale's
    narrower encoding (ISO-8859-1, ASCII) would end a completion with a traceback at its first other character."""
    if sys.stdout is None:
        fail("stdout is closed: there is nowhere to write the output (redirect it to a file or /dev/null instead)")
    with contextlib.suppress(AttributeError, ValueError):  # not a TextIOWrapper: it takes str as it is
        sys.stdout.reconfigure(encoding="utf-8")


def read_stdin() -> str:
    """The prompt on stdin, decoded as UTF-8 whatever the locale (as `fim --file` reads its file): the locale's
    encoding would turn UTF-8 into other characters (ISO-8859-1) or pass bytes that are not UTF-8 on to the
    daemon as lone surrogates."""
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        fail("stdin is closed: pass the prompt as an argument, or pipe it on stdin")
    raw = getattr(sys.stdin, "buffer", None)
    try:
        data = raw.read() if raw is not None else sys.stdin.read().encode("utf-8", "surrogateescape")
    except OSError as e:  # not left to _Main, which would call an EIO here output that cannot be written
        fail(f"cannot read stdin: {e.strerror or e}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        fail(f"stdin is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start}); the model completes "
             "UTF-8 source")


def refuse_non_utf8(what: str, text: str) -> None:
    """An argument that is not UTF-8 (its bytes arrive as lone surrogates) is refused as stdin is, before a daemon is
    asked (or started) only to answer bad_request: the wire carries UTF-8 alone."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        at, code = len(text[:e.start].encode("utf-8")), ord(text[e.start])  # (U+DC80-U+DCFF: a byte, escaped)
        bad = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        fail(f"{what} is not UTF-8 text ({bad} at offset {at}); the model completes UTF-8 source")


# What scripts branch on, said where they look (the README says it only command by command).
EXIT_STATUSES = (f"Exit status: 0 done; 1 an error (one `error:` line on stderr), or `doctor` found a failing check; "
                 f"2 a usage error; {INTERRUPTED_EXIT} Ctrl-C; {CLOSED_PIPE_EXIT} stdout's reader went away "
                 f"(`| head`); {TERMINATED_EXIT} SIGTERM.")


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_STATUSES)
@click.version_option(package_name="m31r", prog_name="m31r")
def main() -> None:
    """M31R: local, offline Rust code completion."""


main.add_command(bundle)  # make, check, convert model bundles (m31r.cli_bundle)
main.add_command(train)  # corpus → tokenizer → model → release bundle (m31r.cli_train)


# ------------------------------------------------------------------------------------------------------------
# daemon: the long-lived process that owns the model
# ------------------------------------------------------------------------------------------------------------


# Where a socket is by default (m31r_protocol.paths): without a runtime dir of this user's (macOS, after `su`), the
# temp dir; the help said only the first two, so a Mac's user looked for the socket in the wrong place.
DEFAULT_SOCKET_HELP = ("$M31R_SOCKET, else $XDG_RUNTIME_DIR/m31r/m31rd.sock, else (no XDG_RUNTIME_DIR of yours) "
                       "$TMPDIR/m31r-<uid>/m31rd.sock")
socket_option = click.option("--socket", "socket_path", type=UserPath(path_type=Path), default=None,
                             help=f"Daemon socket (default: {DEFAULT_SOCKET_HELP}).")


# More threads than any CPU m31r runs on has: past it a typo (`--threads 40000`) killed the daemon as it loaded (OpenMP
# could not create the team: `libgomp: Thread creation failed`, or a segfault), with no `m31rd:` line to say why.
MAX_THREADS = 1024
# The warm-up probes every decode width up to this one, a forward pass each: a slip (`--decode-width 1000000000`) kept
# the daemon warming for ever while its memory grew. 64 rows is eight streams each with a beam search of 8.
MAX_DECODE_WIDTH = 64


def _not_too_many_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    if value is not None and value > MAX_THREADS:
        raise click.BadParameter(f"{value} is more threads than any CPU has cores (at most {MAX_THREADS})", ctx, param)
    return value


def _daemon_settings(ctx: click.Context, param: click.Parameter, path: Path | None) -> Path | None:
    """Read the settings file (--config, else the default one where it exists) into the options' defaults, before
    the other options are parsed: an option given on the command line still wins. A bad file ends the start in one
    `m31rd:` line (the line an autostarting client repeats)."""
    from m31r import daemon_config

    if path is None and not (path := daemon_config.default_path()).is_file():
        return None
    try:
        ctx.default_map = {**(ctx.default_map or {}), **daemon_config.read_defaults(path, ctx.command, ctx)}
    except daemon_config.DaemonConfigError as e:
        click.echo(f"m31rd: {e}", err=True)
        sys.exit(1)
    ctx.meta["m31r.settings"] = path  # (for the daemon's "ready" log line)
    return path


@main.command()
@click.option("--config", type=UserPath(dir_okay=False, path_type=Path), default=None, is_eager=True,
              expose_value=False, callback=_daemon_settings,
              help="Daemon settings file: TOML whose keys are these options' names (threads = 4, quant = \"int8\"); "
                   "the command line wins over it. Default: $XDG_CONFIG_HOME/m31r/daemon.toml (~/.config/...) where "
                   "it exists.")
@click.option("--bundle", "bundle_dir", type=UserPath(path_type=Path), default=None,
              help="Model bundle directory (default: $M31R_BUNDLE or the bundled release/).")
@socket_option
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default="auto",
              show_default=True, help="Activation precision. auto: float32 where a native fp32 kernel family runs "
              "(AVX2, NEON: closer to fp32's output and faster to decode), else bfloat16 on a GPU or where the CPU "
              "runs it natively (AVX512-BF16, AMX), else float32 (`m31r doctor` says which).")
@click.option("--kv-dtype", type=click.Choice(["auto", "float16", "float32", "bfloat16"]), default="auto",
              show_default=True, help="KV-cache precision. auto: float16 where the fp32 kernels read it (half the "
              "bytes per decoded token), else the activation dtype, which may also be named.")
@click.option("--prefill-gemm", type=click.Choice(["auto", "float32"]), default="auto", show_default=True,
              help="Prefill GEMMs of int8 layers on float32 activations. auto: bfloat16 where the CPU runs it natively "
              "(AVX512-BF16, AMX; faster cold prompts), else float32, which may also be named.")
@click.option("--threads", type=click.IntRange(min=1), default=None, callback=_not_too_many_threads,
              help=f"torch intra-op threads (default: all cores; at most {MAX_THREADS}).")
@click.option("--cache-mb", type=click.FloatRange(min=0), default=1536, show_default=True, callback=finite,
              help="Budget for prefix-cache KV slots (each a full context; pages fill as the context grows): it also "
                   "bounds concurrent requests. 0 disables reuse across requests, and with it concurrency: one "
                   "working buffer, one request at a time.")
@click.option("--max-queue", type=click.IntRange(min=1), default=32, show_default=True,
              help="Requests in flight before new ones are answered `busy`.")
@click.option("--max-per-connection", type=click.IntRange(min=1), default=16, show_default=True,
              help="Requests one connection may have in flight before its new ones are answered `busy`, so that one "
                   "client cannot fill the whole queue.")
@click.option("--max-prompt-chars", type=click.IntRange(min=1), default=1 << 21, show_default=True,
              help="Largest Generate prompt (or Fim prefix + suffix) in characters; longer ones are refused before "
                   "they are tokenised.")
@click.option("--read-timeout", type=click.FloatRange(min=0), default=10.0, show_default=True,
              callback=a_number,
              help="Seconds a frame may take to arrive once its first byte has (0: no limit); a connection that "
                   "stalls mid-frame gets an error and is closed. A new connection must begin its Hello within this "
                   "time (10 s when 0); connections idle after their Hello are never timed out.")
@click.option("--max-active", type=click.IntRange(min=1), default=8, show_default=True,
              help="Requests advanced together (each holds a cache slot; bounded by --cache-mb).")
@click.option("--decode-width", type=click.IntRange(min=1, max=MAX_DECODE_WIDTH), default=8, show_default=True,
              help="Rows per batched decode step: concurrent streams share it. Outputs never depend on what runs "
                   f"beside them; 1 gives the lowest single-stream latency but no batching (at most "
                   f"{MAX_DECODE_WIDTH}).")
@click.option("--lookahead", type=click.IntRange(min=0), default=3, show_default=True,
              help="Prompt-lookup decoding: draft tokens copied from the prompt, verified per decode step (greedy "
                   "requests only; the output is the same, it comes faster where the completion repeats the "
                   "document; 3 measured best). Drafts run while a stream decodes alone, not beside others. 0 "
                   "turns it off; a request's `lookahead` field overrides it.")
@click.option("--beams", type=click.IntRange(1, 8), default=3, show_default=True,
              help="Beam search width for greedy line completions (a request with a \"\\n\" stop, as editors send "
                   "mid-line) that do not choose: the likeliest line as a whole, at some latency; 1 is plain greedy "
                   "decoding. A request's `beams` field overrides it.")
@click.option("--chunk-size", type=click.IntRange(min=1), default=8, show_default=True,
              help="Prefill chunk; cache reuse happens at multiples of it (smaller: less recomputed per keystroke).")
@click.option("--quant", type=click.Choice(["auto", "int8", "int4", "none"]), default="auto", show_default=True,
              help="Weight quantization, applied to a float bundle at load (a quantized bundle is served as "
                   "stored). auto: on a CPU, int8 where the native int8 kernel for float32 activations passes its "
                   "self-check or activations are bfloat16, else none; none on a GPU.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@click.option("--log-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the JSON log lines to this file instead of stderr, moving it to FILE.1 past 10 MiB (the "
                   "launchd agent uses it: nothing rotates its log otherwise).")
def daemon(bundle_dir: Path | None, socket_path: Path | None, device: str, dtype: str, kv_dtype: str,
           prefill_gemm: str, threads: int | None,
           cache_mb: float, max_queue: int, max_per_connection: int, max_prompt_chars: int, read_timeout: float,
           max_active: int, decode_width: int, lookahead: int, beams: int, chunk_size: int, quant: str | None,
           log_level: str, log_file: Path | None) -> None:
    """Run the m31r daemon in the foreground (JSON log lines on stderr, or --log-file)."""
    from m31r_protocol.paths import default_socket_path
    from m31rd.main import DaemonOptions, default_bundle, run

    ctx = click.get_current_context()
    settings = ctx.meta.get("m31r.settings")
    if settings is not None and ctx.get_parameter_source("device") is click.core.ParameterSource.DEFAULT_MAP:
        from m31r.daemon_config import device_error

        if why := device_error(settings, device):  # as the file's other errors: it, not --device, names the device
            click.echo(f"m31rd: {why}", err=True)
            sys.exit(1)
    else:
        check_device(device)
    opts = DaemonOptions(bundle=bundle_dir or default_bundle(), socket=socket_path or default_socket_path(),
                         device=device, dtype=dtype, kv_dtype=kv_dtype, prefill_gemm=prefill_gemm, threads=threads,
                         cache_mb=cache_mb,
                         max_queue=max_queue,
                         max_per_connection=max_per_connection, max_prompt_chars=max_prompt_chars,
                         read_timeout=read_timeout, max_active=max_active, decode_width=decode_width,
                         lookahead=lookahead, beams=beams, chunk_size=chunk_size, quant=quant,
                         log_level=log_level, log_file=log_file,
                         settings=settings)
    code = run(opts)
    # Everything is flushed and the socket is gone: skip interpreter teardown (seconds of torch cleanup).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ------------------------------------------------------------------------------------------------------------
# generate / fim / status / stop: thin clients of the daemon socket (never import torch)
# ------------------------------------------------------------------------------------------------------------


class WireInt(click.ParamType):
    """An integer the protocol can carry (MessagePack: -2**63 to 2**64 - 1); the daemon judges the value itself
    (it answers bad_request with the allowed range), but one past 64 bits cannot even be sent."""

    name = "integer"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        n = click.INT.convert(value, param, ctx)
        if not -(1 << 63) <= n < 1 << 64:
            self.fail(f"{n} does not fit in 64 bits (the protocol carries -2**63 to 2**64 - 1)", param, ctx)
        return n


def sampling_options(fn: F) -> F:
    for opt in reversed([
        click.option("--max-tokens", type=WireInt(), default=64, show_default=True),
        click.option("--temperature", type=click.FloatRange(min=0), default=0.0, show_default=True, callback=finite,
                     help="0 = greedy."),
        click.option("--top-k", type=WireInt(), default=0, show_default=True),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=1.0, show_default=True,
                     callback=finite),
        click.option("--seed", type=WireInt(), default=None,
                     help="Makes sampling reproducible (a 64-bit integer: -2**63 to 2**64 - 1)."),
        click.option("--stop", multiple=True, help="Stop sequence (repeatable); not included in the output."),
        click.option("--lookahead", type=click.IntRange(min=0), default=None,
                     help="Prompt-lookup draft tokens per decode step (greedy only; same output); 0 turns it off. "
                          "Default: the daemon's --lookahead."),
        click.option("--beams", type=click.IntRange(1, 8), default=None,
                     help="Beam search of this width (greedy only): the likeliest completion as a whole, shown once "
                          "the search ends; 1 is plain greedy. Default: the daemon's --beams for a completion "
                          "stopped by --stop '\\n', else 1."),
        click.option("--logprobs", type=click.IntRange(0, 20), default=None,
                     help="With --json: each token's log-probability and this many of the likeliest tokens at its "
                          "step (\"token_logprobs\": [{text, token, logprob, top: [[token, text, logprob], ...]}])."),
        click.option("--json", "as_json", is_flag=True,
                     help="Print one JSON object {text, tokens, finish_reason, usage, timings, source, alternatives, "
                          "logprob, line_logprob, logprob_by_line, stopped_by, stop_sequence} at the end (source: "
                          "\"model\", or \"typed_through\" for a fim answered from the previous suggestion for the "
                          "same --file; alternatives: a beam search's runners-up; "
                          "logprob, line_logprob, logprob_by_line: how likely the model found the completion, its "
                          "first line and each line, natural logs; stopped_by: end, sequence, repeat or unsure for a "
                          "finish_reason stop, stop_sequence the stop that matched)."),
        socket_option,
        click.option("--no-autostart", is_flag=True, help="Fail instead of starting a daemon when none runs."),
    ]):
        fn = opt(fn)
    return fn


def _run_client(coro_fn: Callable[..., Any], *args: Any, socket_path: Path | None) -> Any:
    """Run a client coroutine; every way of not reaching the daemon on `socket_path` is one line naming it."""
    import asyncio

    from m31r_protocol import DaemonError, DaemonUnavailable

    if why := _not_a_socket(socket_path):
        fail(why)
    try:
        return asyncio.run(coro_fn(*args))
    except DaemonUnavailable as e:
        cause = e.__cause__  # why the shared connection (m31r_protocol.reconnect) could not be made
        if isinstance(cause, DaemonError):
            fail(f"{cause.code}: {cause.message}")
        if isinstance(cause, OSError) and not isinstance(cause, DaemonUnavailable):
            fail(_unreachable(cause, socket_path))
        fail(str(cause or e))
    except DaemonError as e:
        if e.code == "cancelled" and "superseded" in e.message:  # the daemon's newest-wins rule, across processes
            fail(f"{e.code}: {e.message}: another `m31r fim` on the same --file reached the daemon after this one "
                 "(it answers the newest request for a file, as an editor wants while the user types); run "
                 "completions for one file one after another")
        fail(f"{e.code}: {e.message}")
    except KeyboardInterrupt:
        sys.exit(INTERRUPTED_EXIT)


def _not_a_socket(socket_path: Path | None) -> str | None:
    """Why no daemon can ever answer on the socket path, when something other than a socket or a folder is there (a
    regular file): connecting is refused as at a stale socket file, which `status` and `generate --no-autostart`
    called one a daemon had left, and an autostart started a daemon only for it to refuse the path."""
    import stat

    from m31r_protocol.paths import default_socket_path

    path = Path(socket_path or default_socket_path())
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):  # nothing there (a daemon may be started), or unreachable: connecting says why
        return None
    if stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):  # (a folder: m31r_protocol's socket_path_problem words it)
        return None
    return f"{path} is not a socket: no daemon can listen there; choose another socket path (--socket, or M31R_SOCKET)"


def _unreachable(e: OSError, socket_path: Path | None) -> str:
    """What an OSError on the way to the daemon means: one naming a file is the autostart's (its log folder);
    one of the socket's connect is worded as every client words it."""
    from m31r_protocol.client import daemon_log_path, unreachable
    from m31r_protocol.paths import default_socket_path

    if e.filename is not None:
        where = Path(os.fsdecode(e.filename))
        hint = (" (where the daemon's log goes: set XDG_STATE_HOME to a folder you can write to)"
                if where in (daemon_log_path(), *daemon_log_path().parents[:2]) else "")
        return f"cannot start the daemon: {where}: {e.strerror or e}{hint}"
    return unreachable(e, Path(socket_path or default_socket_path()))


def refuse_unusable(opts: dict) -> None:
    """Option combinations `generate` and `fim` cannot serve, refused first: before stdin is read (which may never
    end, a pipe left open), a file read or a daemon started."""
    if opts["logprobs"] is not None and not opts["as_json"]:
        fail("--logprobs gives figures in the --json output: add --json")
    for stop in opts["stop"]:
        refuse_non_utf8("--stop", stop)


async def _stream(kind: str, payload: dict, opts: dict) -> None:
    from m31r_protocol import DaemonError
    from m31r_protocol.reconnect import DaemonLink, link_config

    config = link_config(opts["socket_path"], autostart=not opts["no_autostart"])
    link = DaemonLink(config, client_name="m31r", progress=lambda msg: click.echo(msg, err=True))
    client = await link.get(wait=config.start_timeout + 10)  # an autostart's own limit decides
    if missing := client.missing:
        from m31r_protocol.capabilities import restart_hint

        click.echo(f"note: {restart_hint(missing)}", err=True)
    try:
        await _complete(kind, payload, opts, client)
    except DaemonError as e:
        if e.code == "context_overflow" and e.overflow is not None:
            truncate = payload.get("truncate", False) if kind == "generate" else None
            raise DaemonError(e.code, overflow_advice(e.overflow, truncate) or e.message, overflow=e.overflow) from e
        raise
    finally:
        await link.close()


def overflow_advice(o: Any, truncate: bool | None) -> str | None:
    """A context_overflow in this command's options, from the Error's figures: the daemon's own wording says "ask for
    truncation", which names no option, and said it even to `generate --truncate`, whose --max-tokens alone left no
    room for any prompt. `truncate`: whether --truncate was given (None: the command has no such option). None where
    the figures do not add up to an overflow (the daemon's message is then shown as it is)."""
    n, k, ctx = o.prompt_tokens, o.max_tokens, o.max_context
    what = f"prompt ({n} tokens) + --max-tokens ({k}) = {n + k} exceeds the model's context of {ctx} tokens"
    if k >= ctx:  # no prompt fits beside it, cut or not
        if truncate:
            return f"{what}: --max-tokens alone fills it; lower it below {ctx} (--truncate then keeps the prompt's end)"
        shorten = "shorten the prompt" + (" (or pass --truncate)" if truncate is not None else "")
        return f"{what}: --max-tokens alone fills it; lower it " + (
            f"to at most {ctx - n}" if n < ctx else f"below {ctx} and {shorten}")
    if truncate or n + k <= ctx:
        return None
    cut = ", or ask for truncation with --truncate (it keeps the prompt's end)" if truncate is not None else ""
    if n >= ctx:
        return f"{what}: the prompt alone fills it; shorten the prompt{cut}"
    return f"{what}: lower --max-tokens to at most {ctx - n}, or shorten the prompt{cut}"


async def _complete(kind: str, payload: dict, opts: dict, client: Any) -> None:
    import json

    from m31r_protocol import Sampling

    sampling = Sampling(temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"])
    common = dict(max_tokens=opts["max_tokens"], sampling=sampling, stop=list(opts["stop"]), seed=opts["seed"],
                  lookahead=opts["lookahead"], beams=opts["beams"], logprobs=opts["logprobs"])
    if kind == "fim" and payload.get("document"):
        payload = {**payload, **_fim_window(payload["prefix"], payload["suffix"], client.welcome.max_context)}
    stream = await (client.generate(payload["prompt"], truncate=payload.get("truncate", False), **common)
                    if kind == "generate"
                    else client.fim(payload["prefix"], payload["suffix"], document=payload.get("document", ""),
                                    context=payload.get("context"), **common))
    text, frames = [], []
    try:
        async for tok in stream:
            text.append(tok.text)
            frames.append(tok)
            if not opts["as_json"]:
                sys.stdout.write(tok.text)
                sys.stdout.flush()
    except BaseException as e:  # (Ctrl-C: asyncio.run cancels this task)
        await stream.cancel()
        if not opts["as_json"]:  # an error line follows (an Exception): not on the half-written one
            _end_open_line("".join(text), both=isinstance(e, Exception))
        raise
    done = stream.done
    assert done is not None
    if opts["as_json"]:
        import msgspec

        from m31r_protocol.messages import scored_tokens

        click.echo(json.dumps({"text": "".join(text), "tokens": stream.tokens, "finish_reason": done.finish_reason,
                               "usage": msgspec.to_builtins(done.usage),
                               "timings": msgspec.to_builtins(done.timings), "source": done.source,
                               "alternatives": done.alternatives, "logprob": done.logprob,
                               "line_logprob": done.line_logprob, "logprob_by_line": done.logprob_by_line,
                               "stopped_by": done.stopped_by, "stop_sequence": done.stop_sequence,
                               "truncated": done.truncated,
                               **({"token_logprobs": [
                                   {"text": f.text, "token": f.token, "logprob": f.logprob,
                                    "top": msgspec.to_builtins(f.top_logprobs)} for f in scored_tokens(frames)]}
                                  if opts["logprobs"] is not None else {})}))
    else:
        from m31r_protocol.policy import MIN_PROBABILITY, confident, first_line_logprob

        written = "".join(text)
        if not written:  # an empty stdout says nothing by itself
            click.echo(f"(no completion: the model wrote nothing here; finish_reason {done.finish_reason})", err=True)
            return
        first = first_line_logprob(written, done.line_logprob, done.logprob_by_line)
        unsure = not confident(first, MIN_PROBABILITY)
        _end_open_line(written, both=unsure)
        if unsure:
            assert first is not None  # (confident says yes without a figure)
            _say_unsure(first)


def _fim_window(prefix: str, suffix: str, max_context: int) -> dict[str, str]:
    """A `fim --file`'s prefix and suffix cut to what the daemon keeps of them, as the language server cuts an open
    document's (the same prompt, the same answer): sent whole, a file past the daemon's --max-prompt-chars (2 MiB
    of generated bindings) was refused with bad_request, naming a daemon option the user of `fim` cannot act on."""
    from m31r_lsp.completion import sent_text

    prefix, suffix = sent_text(prefix, suffix, max_context)
    return {"prefix": prefix, "suffix": suffix}


def _end_open_line(written: str, both: bool) -> None:
    """Finish stdout's unfinished last line (`written` is all it got) where it shows: on a terminal, and with `both`
    (a line for stderr follows) also where stderr goes to the same file (`2>&1`), so that line starts on its own.
    A file or pipe of its own keeps the completion exactly as the model wrote it."""
    if not written or written.endswith("\n"):
        return
    with contextlib.suppress(OSError, ValueError):  # closed, or no real file behind it: nothing to finish
        sys.stdout.flush()
        shared = both and os.path.samestat(os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno()))
        if sys.stdout.isatty() or shared:
            sys.stdout.write("\n")
            sys.stdout.flush()


def _say_unsure(line_logprob: float) -> None:
    """On stderr (stdout keeps the completion alone): the editors would have hidden this suggestion."""
    from m31r_protocol.policy import MIN_PROBABILITY

    click.echo(f"(unsure: the model gives its first line a probability of {math.exp(line_logprob):.3f}; the editors "
               f"hide suggestions under {MIN_PROBABILITY})", err=True)


@main.command()
@click.argument("prompt", required=False, default="-")
@click.option("--truncate", is_flag=True, help="A prompt longer than the model's context (less --max-tokens) keeps "
              "its end, instead of failing with context_overflow.")
@sampling_options
def generate(prompt: str, truncate: bool, **opts: Any) -> None:
    """Continue PROMPT (or stdin with `-`), streaming text to stdout."""
    need_stdout()
    refuse_unusable(opts)
    if prompt == "-":
        if sys.stdin is not None and sys.stdin.isatty():  # else it would wait without a word, and look hung
            click.echo("reading the prompt from stdin; end it with Ctrl-D", err=True)
        prompt = read_stdin()
    else:
        refuse_non_utf8("PROMPT", prompt)
    if not prompt:
        fail("empty prompt: pass text or pipe it on stdin")
    _run_client(_stream, "generate", {"prompt": prompt, "truncate": truncate}, opts, socket_path=opts["socket_path"])


_LINE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z")


def editor_lines(text: str) -> list[str]:
    """`text`'s lines, each with its line end, as editors and LSP count them: only \\n, \\r\\n and \\r end a line
    (str.splitlines also breaks at form feeds, \\x1c-\\x1e, U+0085, U+2028 and U+2029, which would put the cursor
    lines away from where the editor shows it)."""
    return _LINE.findall(text)


@main.command()
@click.option("--prefix", default=None, help="Text before the cursor.")
@click.option("--suffix", default=None, help="Text after the cursor (default: none).")
@click.option("--file", "file_path", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="Complete inside this file at --line/--column instead.")
@click.option("--line", type=int, default=None, help="1-based cursor line in --file.")
@click.option("--column", type=int, default=None, help="1-based cursor column (characters) in --file.")
@click.option("--context", "with_context", is_flag=True, help="Lead the prompt with snippets of the --file's crate's "
              "other files, as the language server does with projectContext on.")
@sampling_options
def fim(prefix: str | None, suffix: str | None, file_path: Path | None, line: int | None, column: int | None,
        with_context: bool, **opts: Any) -> None:
    """Fill in the middle: complete at a cursor, given the text before and after it."""
    need_stdout()
    refuse_unusable(opts)
    document = ""
    if file_path is not None:
        if prefix is not None or suffix is not None or line is None or column is None:
            fail("use either --prefix/--suffix or --file with --line and --column")
        try:
            raw = file_path.read_bytes()
        except OSError as e:  # a read that fails names no file: _Main would call it output that cannot be written
            fail(f"cannot read {file_path}: {e.strerror or e}")
        # A byte-order mark is no character of the file's for an editor: its columns start after it. The offset of a
        # bad byte counts from the file's start (as `cmp` and `xxd` do), the mark's 3 bytes included: utf-8-sig
        # counted from after it.
        bom = len(codecs.BOM_UTF8) if raw.startswith(codecs.BOM_UTF8) else 0
        try:
            text = raw[bom:].decode("utf-8")
        except UnicodeDecodeError as e:
            fail(f"{file_path} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset {bom + e.start}); the model "
                 "completes UTF-8 source")
        text = text.replace("\r\n", "\n").replace("\r", "\n")  # as a text-mode read has always given it
        lines = editor_lines(text)
        # A line end opens one more (empty) line for the cursor; without one at the end (or with no text), the last
        # line is the last: past it, the cursor fell silently at that line's end.
        last = len(lines) + 1 if not lines or lines[-1][-1] in "\r\n" else len(lines)
        if not 1 <= line <= last:
            fail(f"--line {line} is outside {file_path} ({len(lines)} line{'s' * (len(lines) != 1)})")
        width = len(lines[line - 1].rstrip("\r\n")) if line <= len(lines) else 0
        if not 1 <= column <= width + 1:
            fail(f"--column {column} is outside line {line} ({width} characters)")
        offset = sum(len(x) for x in lines[: line - 1]) + column - 1
        from m31r_protocol.context import wire_path

        document = wire_path(str(file_path.resolve()))  # the file's identity (newest-wins, typed-through)
        prefix, suffix = text[:offset], text[offset:]
    elif prefix is None:
        fail("give --prefix (and optionally --suffix), or --file with --line and --column")
    elif line is not None or column is not None:  # without --file they would be ignored: the cursor is elsewhere
        fail("--line and --column place the cursor in --file: give --file, or --prefix/--suffix without them")
    elif with_context:
        fail("--context takes the snippets from the files beside --file: give --file with --line and --column")
    else:
        refuse_non_utf8("--prefix", prefix)
        refuse_non_utf8("--suffix", suffix or "")
    context = []
    if file_path is not None and with_context:
        from m31r_lsp.context import ProjectContext

        context = ProjectContext(lambda: []).snippets(file_path.resolve().as_uri(), prefix)
    payload = {"prefix": prefix, "suffix": suffix or "", "document": document, "context": context}
    _run_client(_stream, "fim", payload, opts, socket_path=opts["socket_path"])


WAIT_NOTE_S = 3.0  # after this long without a daemon's greeting, `m31r status` and `m31r stop` say what they wait for
# Their connect's limits: the socket's own connect (local: at once, or refused) ends before the note is due, so that
# the note, when it comes, is about the greeting and its minute (WELCOME_TIMEOUT_S), which it names.
CONNECT_TIMEOUT_S = 2.5
WELCOME_TIMEOUT_S = 60.0


async def _connect(socket_path: Path | None) -> Any:
    """Client.connect, saying on stderr what it waits for once the wait is long enough to notice: a daemon that a
    systemd or launchd socket starts loads its model before it answers (the client allows a minute), and a silent
    minute looked hung."""
    import asyncio

    from m31r_protocol import Client
    from m31r_protocol.paths import default_socket_path

    def note() -> None:
        click.echo(f"waiting for the daemon on {socket_path or default_socket_path()} to answer (one that a systemd or "
                   "launchd socket starts loads its model first); giving up after a minute", err=True)

    waiting = asyncio.get_running_loop().call_later(WAIT_NOTE_S, note)
    try:
        return await Client.connect(socket_path, timeout=CONNECT_TIMEOUT_S, welcome_timeout=WELCOME_TIMEOUT_S)
    finally:
        waiting.cancel()


async def _status(socket_path: Path | None) -> None:
    import msgspec

    from m31r_protocol.blocking import status_json

    async with await _connect(socket_path) as client:
        click.echo(status_json(msgspec.to_builtins(await client.status())))


@main.command()
@socket_option
def status(socket_path: Path | None) -> None:
    """Print the running daemon's state as JSON (model, device, queue, cache, memory)."""
    need_stdout()
    _run_client(_status, socket_path, socket_path=socket_path)


STOP_WAIT_S = 30.0  # how long `m31r stop` waits for the daemon to finish in-flight work and exit
async def _stop(socket_path: Path | None) -> bool:
    """Whether a daemon was running (and has exited). None listening (no socket file, or a stale one nobody
    accepts on) is what stop wants, as `systemctl stop` of a stopped unit: not a failure. Anything else that keeps
    the daemon from being reached (another user's socket, a file on the path, no Welcome) still is one (a file on
    the path is refused by _run_client before this runs).

    The daemon closes its connections before it exits (and it holds the socket's lock until then): this returns
    only once its process has ended, so that a daemon started next (`m31r stop && m31r generate`, after a change
    of settings) is not refused as "another m31rd is already starting or serving"."""
    import asyncio

    from m31r.process_exit import ProcessExit
    from m31r_protocol import DaemonUnavailable

    try:
        client = await _connect(socket_path)
    except DaemonUnavailable as e:
        if isinstance(e.__context__, FileNotFoundError | ConnectionRefusedError):
            return False
        raise
    loop = asyncio.get_running_loop()
    async with client:
        # Its pid from its own Status, not the socket's peer credentials, which under systemd socket activation
        # name systemd (the socket's maker); watched from now, while this open connection shows it is alive.
        daemon = ProcessExit.of((await client.status()).pid)
        try:
            deadline = loop.time() + STOP_WAIT_S
            await client.shutdown()
            try:
                await asyncio.wait_for(client.closed.wait(), STOP_WAIT_S)
                exited = daemon is None or await daemon.wait(deadline - loop.time())
            except TimeoutError:
                exited = False
        finally:
            if daemon is not None:
                daemon.close()
        if not exited:
            fail(f"the daemon accepted the shutdown but was still running {STOP_WAIT_S:g} s later (it finishes "
                 f"in-flight requests first); `m31r status` shows whether it is still there")
    return True


@main.command()
@socket_option
def stop(socket_path: Path | None) -> None:
    """Ask the running daemon to finish in-flight work and exit; with none running, say so and exit 0."""
    from m31r_protocol.paths import default_socket_path
    from m31rd.service import systemd_states

    path = Path(socket_path or default_socket_path())
    # The units' states where the installed m31rd.socket listens on this path ("" for both elsewhere).
    socket_unit, service_unit = systemd_states(path) or ("", "")
    held = socket_unit == "active"
    again = (f"m31rd.socket listens on {path}, so systemd starts a daemon for the next request (`systemctl --user stop "
             "m31rd.socket` stops that too)")
    if held and service_unit in ("inactive", "failed"):  # connecting would start one to stop it
        click.echo(f"no daemon was running; {again}", err=True)
    elif _run_client(_stop, socket_path, socket_path=socket_path):
        click.echo(f"daemon stopped; {again}" if held else "daemon stopped", err=True)
    else:
        click.echo(f"no daemon was running on {path}", err=True)


@main.command()
@click.option("--bundle", "bundle_dir", type=UserPath(path_type=Path), default=None,
              help="Bundle to check (default: $M31R_BUNDLE or the bundled release/).")
@socket_option
@click.option("--json", "as_json", is_flag=True, help="Print {ok, checks: [{name, level, detail}]} as JSON.")
def doctor(bundle_dir: Path | None, socket_path: Path | None, as_json: bool) -> None:
    """Check the CPU, kernels, bundle, socket, daemon, service and editors; exit 1 if any check fails."""
    from m31r import doctor as checks

    need_stdout()  # its report is the point, as status's is: with stdout closed it ran every check and said nothing
    results = checks.run_checks(checks.Context.create(socket_path, bundle_dir))
    click.echo(checks.render_json(results) if as_json else checks.render_text(results))
    sys.exit(1 if checks.failed(results) else 0)


# ------------------------------------------------------------------------------------------------------------
# service: run the daemon as a per-user service (systemd socket activation, launchd agent)
# ------------------------------------------------------------------------------------------------------------


@main.group()
def service() -> None:
    """Install the daemon as a user service: systemd user units (Linux) or a launchd agent (macOS)."""


service_kind_option = click.option("--kind", type=click.Choice(["systemd", "launchd"]), default=None,
                                   help="Service manager (default: launchd on macOS, systemd elsewhere).")


@service.command("install")
@service_kind_option
@click.option("--bundle", "bundle_dir", type=UserPath(file_okay=False, path_type=Path), default=None,
              help="Model bundle the service serves (default: $M31R_BUNDLE or the bundled release/).")
@click.option("--socket", "socket_path", type=UserPath(path_type=Path), default=None,
              help=f"Socket the service listens on (default: the one clients here use: {DEFAULT_SOCKET_HELP}).")
@click.option("--dry-run", is_flag=True, help="Print the files and where they would go; write nothing.")
@click.option("--force", is_flag=True, help="Replace unit files that differ from what install writes (edited by "
              "hand, links, an older install's); each old one is kept as FILE.bak.")
@user_errors
def service_install(kind: str | None, bundle_dir: Path | None, socket_path: Path | None, dry_run: bool,
                    force: bool) -> None:
    """Write the unit files with this environment's paths, and print the command that enables them."""
    from m31rd.service import install

    install(kind, bundle_dir, dry_run, force=force, socket=socket_path, echo=click.echo)


@service.command("uninstall")
@service_kind_option
@click.option("--dry-run", is_flag=True, help="Print what would be removed; change nothing.")
@user_errors
def service_uninstall(kind: str | None, dry_run: bool) -> None:
    """Stop and disable the service (best effort), then remove its unit files."""
    from m31rd.service import uninstall

    uninstall(kind, dry_run, echo=click.echo)


# ------------------------------------------------------------------------------------------------------------
# serve: the localhost HTTP adapter, a thin client of the daemon socket (README "HTTP adapter"; never imports torch)
# ------------------------------------------------------------------------------------------------------------


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to bind; anything but loopback needs --allow-remote.")
@click.option("--port", type=click.IntRange(0, 65535), default=8731, show_default=True)
@socket_option
@click.option("--allow-remote", is_flag=True, help="Allow binding a non-loopback address (prints a warning).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="HOST",
              help="Also accept requests whose Host header names HOST (repeatable; default: loopback names only; "
                   "'*' accepts any Host, which gives up the DNS-rebinding defence).")
@click.option("--cors-origin", "cors_origins", multiple=True, metavar="ORIGIN",
              help="Allow browser requests from ORIGIN, e.g. http://localhost:3000 (repeatable; default: none).")
@click.option("--token-file", type=click.Path(path_type=Path), default=None,
              help="Require `Authorization: Bearer <token>`, the token read from this file (mode 0600).")
@click.option("--no-autostart", is_flag=True, help="Answer 503 instead of starting a daemon when none runs.")
@click.option("--bundle", "bundle_dir", type=UserPath(exists=True, file_okay=False, path_type=Path), default=None,
              help="Bundle for an autostarted daemon (default: $M31R_BUNDLE or the bundled release/); a daemon "
                   "already running on --socket keeps its own.")
@click.option("--max-body", type=click.IntRange(min=1), default=1 << 20, show_default=True,
              help="Largest request body in bytes (413 beyond).")
@click.option("--max-tokens-cap", type=click.IntRange(min=1), default=512, show_default=True,
              help="Most tokens a request gets: the native endpoints refuse more, the OpenAI, Ollama, llama.cpp, "
                   "Tabby and Codestral ones cap it.")
@click.option("--request-timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              callback=a_number,
              help="Seconds a request may take once its body is in, the daemon's work included (504 past it; the "
                   "daemon request is cancelled).")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=30.0, show_default=True,
              callback=a_number,
              help="Seconds a client has to send a request's body after its headers (408 past it, and the connection "
                   "is closed), so that a client trickling its body cannot hold a connection for good.")
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=10.0, show_default=True,
              callback=a_number,
              help="Seconds a client has to send a request's headers, from its connection's start or the previous "
                   "answer's end (408 past it if the client had begun, and the connection is closed), so that a "
                   "client trickling its headers cannot hold a connection for good.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True)
@user_errors
def serve(host: str, port: int, socket_path: Path | None, allow_remote: bool, allowed_hosts: tuple[str, ...],
          cors_origins: tuple[str, ...], token_file: Path | None, no_autostart: bool, bundle_dir: Path | None,
          max_body: int, max_tokens_cap: int, request_timeout: float, body_timeout: float, header_timeout: float,
          log_level: str) -> None:
    """Serve the model over HTTP on localhost: /generate, /completion, /fim, OpenAI's /v1/completions, Ollama's
    /api/generate."""
    from m31r_http.server import run

    if bundle_dir is not None and no_autostart:
        fail("--bundle names the bundle an autostarted daemon loads: it has no effect with --no-autostart")
    bundle = bundle_dir.resolve() if bundle_dir is not None else None  # the daemon may run from another folder
    sys.exit(run(host, port, socket_path, autostart=not no_autostart, bundle=bundle, allow_remote=allow_remote,
                 allowed_hosts=allowed_hosts, cors_origins=cors_origins, token_file=token_file, max_body=max_body,
                 max_tokens_cap=max_tokens_cap, request_timeout=request_timeout, body_timeout=body_timeout,
                 header_timeout=header_timeout, log_level=log_level))


# ------------------------------------------------------------------------------------------------------------
# lsp: the language server for editors (inline completions)
# ------------------------------------------------------------------------------------------------------------


@main.command()
@socket_option
@click.option("--tcp", metavar="HOST:PORT", default=None,
              help="Serve LSP over TCP instead of stdio, one editor at a time (another is told and turned away); HOST "
                   "must be loopback unless --allow-remote.")
@click.option("--allow-remote", is_flag=True, help="Allow --tcp on a non-loopback address (prints a warning).")
@click.option("--no-autostart", is_flag=True, help="Do not start a daemon when none runs.")
@click.option("--bundle", "bundle_dir", type=UserPath(path_type=Path), default=None,
              help="Bundle for an autostarted daemon (default: the daemon's).")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              show_default=True)
@user_errors
def lsp(socket_path: Path | None, tcp: str | None, allow_remote: bool, no_autostart: bool, bundle_dir: Path | None,
        log_level: str) -> None:
    """Run the language server (LSP over stdio; stdout carries the protocol only)."""
    from m31r_lsp.server import run

    run(str(socket_path) if socket_path else None, tcp, not no_autostart,
        bundle=str(bundle_dir) if bundle_dir else None, log_level=log_level, allow_remote=allow_remote)


if __name__ == "__main__":
    main()

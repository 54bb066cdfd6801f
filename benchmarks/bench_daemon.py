"""Daemon benchmark: a scripted typing session and client round-trip/throughput, through a real `m31r daemon`
subprocess on a real Unix socket, measured from the client side (what an editor sees).

  typing      benchmarks/data/typing_session.rs with one function body deleted at the cursor; the body is
              retyped keystroke by keystroke (characters, Enter with auto-indent, typos fixed with backspace)
              while the text after the cursor stays fixed. One Fim per keystroke (same document key, greedy,
              max_tokens 16), each awaited before the next keystroke. Reported: keystroke→first token and
              keystroke→done latency p50/p90, and the share of prompt tokens served from the prefix cache,
              cold (`--cache-mb 0`, a fresh prefill every keystroke) against warm (default cache).
  lookahead   prompt-lookup decoding: the same typing session against two warm daemons, `--lookahead 0` and
              `--lookahead K`, interleaved keystroke by keystroke (which one goes first alternates). Reported: tokens
              and accepted drafts per decode step, keystroke→done/first token p50/p95 both ways, and whether every
              completion was the same text (it must be). Acceptance needs a trained model: pass --bundle release.
  roundtrip   1-token Generate latency p50 on an open connection (and the daemon's own total_ms, so the
              difference is the socket + protocol overhead), and the wall time of `m31r status` as a user
              runs it (a new process: interpreter start, imports, connect, handshake).
  throughput  completion tokens/s summed over 1, 8 and 16 concurrent clients, each on its own connection
              sending Generate requests back to back for a fixed time.

The model is a random-init bundle of the chosen shape (`m31r bundle init` into a temp dir; the medium shape
is ~205M parameters) with the first of data/tokenizer.json (a training run's) and release/tokenizer.json (the
shipped one) that fits the shape's vocabulary, so prompts are as long in tokens as real ones; else the byte-level
tokenizer. Random weights make the completions garbage, but the cost per token is the real one; pass --bundle to
measure a trained bundle instead.

    python benchmarks/bench_daemon.py --out bench-results/daemon.json      # medium shape
    python benchmarks/bench_daemon.py --shape tiny --quick                 # smoke test
    python benchmarks/bench_daemon.py --bundle release --skip cold warm roundtrip throughput   # prompt lookup only
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import signal
import socket as so
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SESSION_FILE = REPO / "benchmarks" / "data" / "typing_session.rs"
DOCUMENT = "bench://typing_session.rs"
# The body retyped in the session: from the start of the first line to the end of the last (the cursor
# starts where the first line starts, after its indentation).
RETYPE_FROM = "let start = self.line_starts[line];"
RETYPE_TO = "let column = match encoding {"
TYPOS = {9: "w", 47: "y"}  # index in the retyped text → a wrong key pressed (then backspace) before it


# ------------------------------------------------------------------------------------------------------------
# The typing script
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Keystroke:
    key: str  # "char", "enter", "backspace"
    text: str = ""  # what it inserts


def session_document() -> tuple[str, str, str]:
    """(text before the cursor, the text to retype, the text after the cursor)."""
    text = SESSION_FILE.read_text()
    start = text.index(RETYPE_FROM)
    end = text.index(RETYPE_TO, start) + len(RETYPE_TO)
    return text[:start], text[start:end], text[end:]


def keystrokes(target: str) -> list[Keystroke]:
    """Retype `target`: one keystroke per character, Enter inserts the newline and the next line's
    indentation (as editors auto-indent), and a typo + backspace before the characters in TYPOS."""
    out: list[Keystroke] = []
    i = 0
    while i < len(target):
        if i in TYPOS:
            out += [Keystroke("char", TYPOS[i]), Keystroke("backspace")]
        ch = target[i]
        if ch == "\n":
            j = i + 1
            while j < len(target) and target[j] in " \t":
                j += 1
            out.append(Keystroke("enter", target[i:j]))
            i = j
            continue
        out.append(Keystroke("char", ch))
        i += 1
    return out


def replay(prefix: str, strokes: list[Keystroke]) -> list[str]:
    """The text before the cursor after each keystroke."""
    states, cur = [], prefix
    for k in strokes:
        cur = cur[:-1] if k.key == "backspace" else cur + k.text
        states.append(cur)
    return states


# ------------------------------------------------------------------------------------------------------------
# Daemon and bundle
# ------------------------------------------------------------------------------------------------------------


def m31r_cmd() -> list[str]:
    script = Path(os.path.abspath(sys.executable)).parent / "m31r"
    return [str(script)] if script.exists() else [sys.executable, "-m", "m31r.cli"]


def make_bundle(shape: str, out: Path, tokenizer: Path | None, storage_dtype: str) -> tuple[Path, str]:
    config = REPO / "configs" / "model" / f"{shape}.yaml"
    if tokenizer is None:
        import yaml

        vocab = yaml.safe_load(config.read_text())["vocab_size"]
        for cand in (REPO / "data" / "tokenizer.json", REPO / "release" / "tokenizer.json"):
            if cand.exists():
                with cand.open() as f:
                    if len(json.load(f)["model"]["vocab"]) == vocab:
                        tokenizer = cand
                        break
    cmd = [*m31r_cmd(), "bundle", "init", str(config), str(out), "--seed", "0", "--dtype", storage_dtype]
    if tokenizer is not None:
        cmd += ["--tokenizer", str(tokenizer)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out, str(tokenizer) if tokenizer else "byte-level"


class Daemon:
    def __init__(self, bundle: Path, sock: Path, log: Path, args: list[str]):
        self.sock, self.log = sock, log
        cmd = [*m31r_cmd(), "daemon", "--bundle", str(bundle), "--socket", str(sock), *args]
        with log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            self._wait_ready()
        except BaseException:  # a failed `m31r status`, a Ctrl-C while it loads: the daemon must not outlive us
            self.stop()
            raise

    def _wait_ready(self) -> None:
        sock, log = self.sock, self.log
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {log.read_text()[-2000:]}")
            if sock.exists():
                s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
                with contextlib.suppress(OSError):
                    s.connect(str(sock))
                    s.close()
                    break
                s.close()
            if time.monotonic() - t0 > 600:
                raise TimeoutError("daemon not ready after 600 s")
            time.sleep(0.05)
        self.listening_s = time.monotonic() - t0  # the socket accepts (before the model has loaded)
        # launch → `m31r status` answers (issue 18's figure), as a user's shell sees it
        subprocess.run([*m31r_cmd(), "status", "--socket", str(sock)], check=True, stdout=subprocess.DEVNULL)
        self.ready_s = time.monotonic() - t0
        # launch → ready to complete (loaded and warmed up): the typing session starts from there, so that its
        # first keystroke measures a full prefill, not the model's load
        while asyncio.run(self._warming()):
            time.sleep(0.05)
        self.warm_s = time.monotonic() - t0

    async def _warming(self) -> bool:
        from m31r_protocol import Client

        async with await Client.connect(self.sock, client="bench", timeout=10) as c:
            return (await c.status()).warming

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def exit_on_sigterm() -> None:
    """SIGTERM (`timeout`, `kill`, a cancelled CI job) ends the benchmark as Ctrl-C does, by an exception, so that
    the finally blocks stop the daemons it started: Python's default just dies and leaves them running, orphaned."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def start_daemons(bundle: Path, log: Path, specs: dict[str, tuple[Path, list[str]]]) -> dict[str, Daemon]:
    """One daemon per name (socket, arguments), all ready; if one fails to start, those already started are stopped
    before the error goes on (a dict comprehension would leave them running, orphaned, after the benchmark)."""
    started: dict[str, Daemon] = {}
    try:
        for name, (sock, args) in specs.items():
            started[name] = Daemon(bundle, sock, log, args)
    except BaseException:
        for d in started.values():
            d.stop()
        raise
    return started


# ------------------------------------------------------------------------------------------------------------
# Measurements
# ------------------------------------------------------------------------------------------------------------


def pct(xs: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no data."""
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


@dataclass
class Sample:
    first_ms: float | None
    done_ms: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    server_first_ms: float | None
    prefill_ms: float
    source: str
    text: str = ""
    decode_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0


@dataclass
class TypingResult:
    mode: str
    keystrokes: int
    samples: list[Sample] = field(default_factory=list)

    def summary(self) -> dict:
        """Latency over the keystrokes after the first: the first pays the whole prompt's prefill in both modes
        (the session's "open file" cost) and is reported on its own."""
        rest = self.samples[1:] or self.samples
        first = [s.first_ms for s in rest if s.first_ms is not None]
        done = [s.done_ms for s in rest]
        model = [s for s in self.samples if s.source == "model"]
        prompt = sum(s.prompt_tokens for s in model)
        return {
            "mode": self.mode, "keystrokes": self.keystrokes,
            "first_keystroke_done_ms": self.samples[0].done_ms if self.samples else None,
            "first_token_ms_p50": pct(first, 50), "first_token_ms_p90": pct(first, 90),
            "first_token_ms_p95": pct(first, 95),
            "done_ms_p50": pct(done, 50), "done_ms_p90": pct(done, 90), "done_ms_p95": pct(done, 95),
            # the keystrokes the model answered (the rest were typed through, in microseconds)
            "model_done_ms_p50": pct(ran := [s.done_ms for s in rest if s.source == "model"], 50),
            "model_done_ms_p95": pct(ran, 95),
            "server_prefill_ms_p50": pct([s.prefill_ms for s in rest if s.source == "model"], 50),
            "prompt_tokens_mean": prompt / len(model) if model else 0,
            "cached_share": sum(s.cached_tokens for s in model) / prompt if prompt else 0.0,
            "cached_share_after_first": (sum(s.cached_tokens for s in model[1:])
                                         / max(1, sum(s.prompt_tokens for s in model[1:]))),
            "typed_through": len(self.samples) - len(model),
            "completion_tokens": sum(s.completion_tokens for s in self.samples),
            **self.steps(),
        }

    def steps(self) -> dict:
        """Prompt-lookup decoding's figures over the session: completion tokens per decode step (1 without it),
        and accepted drafts per step and per draft."""
        steps = sum(s.decode_steps for s in self.samples)
        drafts = sum(s.draft_tokens for s in self.samples)
        accepted = sum(s.accepted_tokens for s in self.samples)
        return {"decode_steps": steps, "draft_tokens": drafts, "accepted_tokens": accepted,
                "tokens_per_step": (steps + accepted) / steps if steps else None,
                "accepted_per_step": accepted / steps if steps else None,
                "draft_acceptance": accepted / drafts if drafts else None}


async def typing_session(sock: Path, mode: str, limit: int | None, max_tokens: int) -> TypingResult:
    from m31r_protocol import Client

    before, target, after = session_document()
    strokes = keystrokes(target)[:limit]
    result = TypingResult(mode, len(strokes))
    async with await Client.connect(sock, client="bench", timeout=60) as c:
        for prefix in replay(before, strokes):
            result.samples.append(await keystroke(c, prefix, after, max_tokens))
    return result


async def keystroke(c, prefix: str, after: str, max_tokens: int) -> Sample:
    """One keystroke's Fim, timed from the client."""
    t0 = time.perf_counter()
    stream = await c.fim(prefix, after, document=DOCUMENT, max_tokens=max_tokens)
    first, text = None, []
    async for tok in stream:
        if first is None:
            first = (time.perf_counter() - t0) * 1000
        text.append(tok.text)
    done_ms = (time.perf_counter() - t0) * 1000
    d = stream.done
    assert d is not None
    u = d.usage
    return Sample(first, done_ms, u.prompt_tokens, u.cached_tokens, u.completion_tokens, d.timings.first_token_ms,
                  d.timings.prefill_ms, d.source, "".join(text), u.decode_steps, u.draft_tokens, u.accepted_tokens)


async def lookahead_session(socks: dict[str, Path], limit: int | None, max_tokens: int) -> dict[str, TypingResult]:
    """The typing session against each daemon in `socks` (name: socket), keystroke by keystroke in turn, the
    order alternating, so that both see the same machine load; each daemon keeps its own warm cache."""
    from m31r_protocol import Client

    before, target, after = session_document()
    strokes = keystrokes(target)[:limit]
    results = {name: TypingResult(name, len(strokes)) for name in socks}
    clients = {name: await Client.connect(sock, client="bench", timeout=60) for name, sock in socks.items()}
    try:
        for i, prefix in enumerate(replay(before, strokes)):
            for name in list(socks)[:: 1 if i % 2 == 0 else -1]:
                results[name].samples.append(await keystroke(clients[name], prefix, after, max_tokens))
    finally:
        for c in clients.values():
            await c.close()
    return results


async def roundtrip(sock: Path, n: int) -> dict:
    from m31r_protocol import Client

    wall, server = [], []
    async with await Client.connect(sock, client="bench") as c:
        for i in range(n + 3):
            t0 = time.perf_counter()
            _, done = await (await c.generate(f"fn f{i % 4}() {{\n", max_tokens=1)).collect()
            if i >= 3:  # the first few fill the cache for these prompts
                wall.append((time.perf_counter() - t0) * 1000)
                server.append(done.timings.total_ms)
        status = await c.status()
    p50, s50 = pct(wall, 50), pct(server, 50)
    return {"requests": n, "generate_1tok_ms_p50": p50, "daemon_total_ms_p50": s50,
            "overhead_ms_p50": None if p50 is None or s50 is None else p50 - s50, "rss_mb": status.rss_mb}


def status_wall(sock: Path, n: int) -> dict:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run([*m31r_cmd(), "status", "--socket", str(sock)], check=True, stdout=subprocess.DEVNULL)
        times.append((time.perf_counter() - t0) * 1000)
    return {"runs": n, "status_wall_ms_p50": pct(times, 50), "status_wall_ms_min": min(times)}


async def throughput(sock: Path, clients: int, seconds: float, max_tokens: int) -> dict:
    from m31r_protocol import Client, DaemonError

    conns = [await Client.connect(sock, client=f"bench-{i}") for i in range(clients)]
    tokens = [0] * clients
    requests = [0] * clients
    busy = [0]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(i: int) -> None:
        c = conns[i]
        n = 0
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            stream = await c.generate(f"// client {i}, request {n}\nfn main() {{\n", max_tokens=max_tokens)
            n += 1
            try:
                async for _ in stream:
                    if time.perf_counter() < deadline:
                        tokens[i] += 1
                    else:
                        await stream.cancel()
                        break
                else:
                    requests[i] += 1
                    latencies.append((time.perf_counter() - t0) * 1000)
            except DaemonError as e:
                if e.code == "busy":
                    busy[0] += 1
                    await asyncio.sleep(0.01)
                elif e.code != "cancelled":
                    raise

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(clients)))
    elapsed = min(time.perf_counter(), deadline) - t0
    for c in conns:
        await c.close()
    return {"clients": clients, "seconds": round(elapsed, 2), "completion_tokens": sum(tokens),
            "tokens_per_s": sum(tokens) / elapsed, "requests_done": sum(requests),
            "request_ms_p50": pct(latencies, 50), "busy_replies": busy[0]}


# ------------------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------------------


def fmt(x: float | None, nd: int = 1) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def print_tables(res: dict) -> None:
    m = res["meta"]
    what = "bundle" if m["shape"] == "bundle" else f"shape {m['shape']}"
    print(f"\nm31rd daemon benchmark: {what} ({m['model']}), dtype {m['dtype']}, "
          f"threads {m['threads'] or 'default'}, tokenizer {Path(m['tokenizer']).name}")
    print(f"CPU: {m.get('cpu') or str(m['cpus']) + ' CPUs'}")
    print_typing(res)
    print_lookahead(res)
    print_others(res)


def print_typing(res: dict) -> None:
    if not res["typing"]:
        return
    m = res["meta"]
    print(f"\ntyping session: one Fim per keystroke (max_tokens {m['fim_max_tokens']}, greedy), "
          "latency seen by the client")
    hdr = (f"{'mode':<6} {'keys':>4} {'1st key':>8} {'first p50':>10} {'first p90':>10} {'done p50':>9} "
           f"{'done p90':>9} {'prefill p50':>11} {'prompt tok':>10} {'cached':>7} {'typed-thr':>9}")
    print(hdr)
    print("-" * len(hdr))
    for s in res["typing"]:
        print(f"{s['mode']:<6} {s['keystrokes']:>4} {fmt(s['first_keystroke_done_ms'], 0):>8} "
              f"{fmt(s['first_token_ms_p50']):>10} {fmt(s['first_token_ms_p90']):>10} {fmt(s['done_ms_p50']):>9} "
              f"{fmt(s['done_ms_p90']):>9} {fmt(s['server_prefill_ms_p50']):>11} {s['prompt_tokens_mean']:>10.0f} "
              f"{100 * s['cached_share']:>6.1f}% {s['typed_through']:>9}")
    print("(ms. 1st key: keystroke → Done for the session's first keystroke, a full prefill in both modes; the "
          "percentiles are over the keystrokes after it. first = keystroke → first token, done = keystroke → "
          "Done, prefill and prompt tokens as the daemon reports them, cached = share of all prompt tokens "
          "served from the prefix cache, typed-thr = answered from the previous completion without the model)")


def print_lookahead(res: dict) -> None:
    if "lookahead" in res:
        la = res["lookahead"]
        print(f"\nprompt-lookup decoding: the typing session against --lookahead 0 and --lookahead {la['k']}, "
              f"interleaved ({la['keystrokes']} keystrokes; same text every time: {la['same_text']})")
        hdr = (f"{'lookahead':>9} {'done p50':>9} {'done p95':>9} {'model p50':>10} {'model p95':>10} "
               f"{'first p50':>10} {'tokens/step':>11} {'accepted/step':>13} {'drafts kept':>11}")
        print(hdr)
        print("-" * len(hdr))
        for name in ("off", "on"):
            s = la[name]
            kept = s["draft_acceptance"]
            print(f"{0 if name == 'off' else la['k']:>9} {fmt(s['done_ms_p50']):>9} {fmt(s['done_ms_p95']):>9} "
                  f"{fmt(s['model_done_ms_p50']):>10} {fmt(s['model_done_ms_p95']):>10} "
                  f"{fmt(s['first_token_ms_p50']):>10} {fmt(s['tokens_per_step'], 2):>11} "
                  f"{fmt(s['accepted_per_step'], 2):>13} {'-' if kept is None else f'{100 * kept:.0f}%':>11}")
        print("(ms, keystroke → Done over the keystrokes after the first; model = only those the model answered, "
              "the rest were typed through; first = keystroke → first token; tokens/step = completion tokens per "
              "decode step; drafts kept = accepted drafts / drafts fed)")


def print_others(res: dict) -> None:
    m = res["meta"]
    if "roundtrip" in res:
        r = res["roundtrip"]
        print(f"\nround trip: 1-token Generate p50 {fmt(r['generate_1tok_ms_p50'], 2)} ms "
              f"(daemon total_ms p50 {fmt(r['daemon_total_ms_p50'], 2)}, socket+protocol overhead "
              f"{fmt(r['overhead_ms_p50'], 2)} ms); `m31r status` wall p50 {fmt(r['status_wall_ms_p50'])} ms "
              f"(min {fmt(r['status_wall_ms_min'])}); daemon RSS {fmt(r['rss_mb'])} MiB")
    if "throughput" in res:
        print(f"\nthroughput: Generate max_tokens {m['gen_max_tokens']} back to back per client")
        hdr = f"{'clients':>7} {'tokens/s':>9} {'tokens':>7} {'requests':>8} {'req p50 ms':>10} {'busy':>5}"
        print(hdr)
        print("-" * len(hdr))
        for t in res["throughput"]:
            print(f"{t['clients']:>7} {t['tokens_per_s']:>9.1f} {t['completion_tokens']:>7} "
                  f"{t['requests_done']:>8} {fmt(t['request_ms_p50']):>10} {t['busy_replies']:>5}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["tiny", "mini", "small", "medium", "large"], default="medium")
    ap.add_argument("--bundle", type=Path, help="Use this bundle instead of a random-init one of --shape.")
    ap.add_argument("--tokenizer", type=Path, help="tokenizer.json for the random bundle (default: "
                    "data/ or release/tokenizer.json if it fits the shape, else byte-level).")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default="auto",
                    help="Daemon compute dtype.")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--quant", choices=["auto", "int8", "int4", "none"], default=None,
                    help="Daemon --quant (default: the daemon's, auto).")
    ap.add_argument("--stored-quant", choices=["int8", "int4"], default=None,
                    help="Quantize the random bundle on disk first (`m31r bundle quantize`), as a user would.")
    ap.add_argument("--chunk-size", type=int, default=None, help="Daemon --chunk-size (default: the daemon's).")
    ap.add_argument("--threads", type=int, default=None, help="Daemon torch threads (default: the daemon's).")
    ap.add_argument("--quick", action="store_true",
                    help="Smoke test: fewer keystrokes (cold: 6, warm: 20), shorter throughput windows.")
    ap.add_argument("--keystrokes", type=int, default=None, help="Limit the typing session to N keystrokes.")
    ap.add_argument("--cold-keystrokes", type=int, default=None,
                    help="Limit the cold run (a full prefill per keystroke) to N keystrokes.")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=["cold", "warm", "lookahead", "roundtrip", "throughput"])
    ap.add_argument("--lookahead", type=int, default=3,
                    help="The --lookahead compared with 0 in the prompt-lookup run.")
    ap.add_argument("--daemon-lookahead", type=int, default=None,
                    help="The cold and warm daemons' --lookahead (default: the daemon's, 3).")
    ap.add_argument("--seconds", type=float, default=None, help="Throughput window per client count.")
    ap.add_argument("--out", type=Path, help="Write the results as JSON.")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    for name in ("keystrokes", "cold_keystrokes", "chunk_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    for name in ("lookahead", "daemon_lookahead"):
        if getattr(args, name) is not None and getattr(args, name) < 0:
            ap.error(f"--{name.replace('_', '-')} must be 0 (off) or more, not {getattr(args, name)}")
    if args.seconds is not None and args.seconds <= 0:
        ap.error(f"--seconds must be more than 0, not {args.seconds:g}")
    if args.bundle and not (args.bundle / "metadata.json").is_file():
        ap.error(f"--bundle {args.bundle}: not a bundle (no metadata.json)")

    keys = args.keystrokes if args.keystrokes is not None else (20 if args.quick else None)
    cold_keys = args.cold_keystrokes if args.cold_keystrokes is not None else (6 if args.quick else keys)
    if keys is not None and cold_keys is not None:
        cold_keys = min(keys, cold_keys)
    seconds = args.seconds or (3.0 if args.quick else 10.0)
    fim_tokens, gen_tokens = 16, 32
    daemon_args = ["--dtype", args.dtype, "--device", args.device]
    if args.threads:
        daemon_args += ["--threads", str(args.threads)]
    if args.quant:
        daemon_args += ["--quant", args.quant]
    if args.chunk_size:
        daemon_args += ["--chunk-size", str(args.chunk_size)]
    lookahead_args = [] if args.daemon_lookahead is None else ["--lookahead", str(args.daemon_lookahead)]

    from m31r.cpu import describe

    _, target, _ = session_document()
    res: dict = {"meta": {
        # A given bundle has its own shape: --shape names only the random-init one's.
        "shape": "bundle" if args.bundle else args.shape, "dtype": args.dtype, "device": args.device,
        "threads": args.threads,
        "quant": args.quant, "stored_quant": args.stored_quant, "chunk_size": args.chunk_size,
        "daemon_lookahead": args.daemon_lookahead,
        "cpus": os.cpu_count(), "cpu": describe(), "platform": platform.platform(),
        "python": platform.python_version(), "fim_max_tokens": fim_tokens, "gen_max_tokens": gen_tokens,
        "session_keystrokes": len(keystrokes(target)),
        "loadavg_start": os.getloadavg(),
    }, "typing": []}
    with tempfile.TemporaryDirectory(prefix="m31r-bench-") as tmp:
        tmpd = Path(tmp)
        if args.bundle:
            bundle, tok = args.bundle.resolve(), str(args.bundle / "tokenizer.json")
        else:
            t0 = time.perf_counter()
            bundle, tok = make_bundle(args.shape, tmpd / "bundle", args.tokenizer,
                                      "float32" if args.shape in ("tiny", "mini") else "bfloat16")
            if args.stored_quant:  # served as stored: loading stays a memory map (no quantizing at startup)
                subprocess.run([*m31r_cmd(), "bundle", "quantize", str(bundle), str(tmpd / "bundle-q"), "--quant",
                                args.stored_quant], check=True, stdout=subprocess.DEVNULL)
                bundle = tmpd / "bundle-q"
            res["meta"]["bundle_init_s"] = round(time.perf_counter() - t0, 1)
        meta = json.loads((bundle / "metadata.json").read_text())
        model = f"{meta.get('model_name', '?')}@{meta.get('model_version', '?')}"
        res["meta"].update(model=model, parameters=meta.get("parameter_count"), tokenizer=tok)
        sock, log = tmpd / "d.sock", tmpd / "daemon.log"
        print(f"bundle {bundle} ({meta.get('parameter_count', 0):,} params, tokenizer {Path(tok).name}); "
              f"daemon log {log}", file=sys.stderr)
        try:
            for mode, cache_args, n in [("cold", ["--cache-mb", "0"], cold_keys), ("warm", [], keys)]:
                if mode in args.skip:
                    continue
                d = Daemon(bundle, sock, log, daemon_args + lookahead_args + cache_args)
                res["meta"][f"{mode}_daemon_ready_s"] = round(d.ready_s, 2)
                res["meta"][f"{mode}_daemon_listening_s"] = round(d.listening_s, 2)
                res["meta"][f"{mode}_daemon_warm_s"] = round(d.warm_s, 2)
                try:
                    print(f"{mode}: daemon launch → socket listening {d.listening_s:.2f} s, → `m31r status` answers "
                          f"{d.ready_s:.2f} s, → ready to complete {d.warm_s:.2f} s; typing {n or 'all'} keystrokes",
                          file=sys.stderr)
                    r = asyncio.run(typing_session(sock, mode, n, fim_tokens))
                    res["typing"].append(r.summary())
                    res.setdefault("typing_samples", {})[mode] = [asdict(s) for s in r.samples]
                    if mode == "warm" and "roundtrip" not in args.skip:
                        print("round trip", file=sys.stderr)
                        res["roundtrip"] = {**asyncio.run(roundtrip(sock, 10 if args.quick else 30)),
                                            **status_wall(sock, 3 if args.quick else 7)}
                    if mode == "warm" and "throughput" not in args.skip:
                        res["throughput"] = []
                        for clients in (1, 8, 16):
                            print(f"throughput: {clients} clients, {seconds:.0f}s", file=sys.stderr)
                            res["throughput"].append(asyncio.run(throughput(sock, clients, seconds, gen_tokens)))
                finally:
                    d.stop()
            if "lookahead" not in args.skip:
                names = {"off": 0, "on": args.lookahead}
                daemons = start_daemons(bundle, log, {name: (tmpd / f"{name}.sock",
                                                             [*daemon_args, "--lookahead", str(k)])
                                                      for name, k in names.items()})
                try:
                    print(f"lookahead: --lookahead 0 against {args.lookahead}, typing {keys or 'all'} keystrokes",
                          file=sys.stderr)
                    runs = asyncio.run(lookahead_session({n: d.sock for n, d in daemons.items()}, keys,
                                                         fim_tokens))
                finally:
                    for d in daemons.values():
                        d.stop()
                res["lookahead"] = {
                    "k": args.lookahead, "keystrokes": runs["on"].keystrokes,
                    "same_text": [s.text for s in runs["on"].samples] == [s.text for s in runs["off"].samples],
                    **{name: r.summary() for name, r in runs.items()}}
                res.setdefault("typing_samples", {}).update({f"lookahead-{n}": [asdict(s) for s in r.samples]
                                                             for n, r in runs.items()})
        except BaseException:
            if log.exists():
                print(log.read_text()[-3000:], file=sys.stderr)
            raise
    res["meta"]["loadavg_end"] = os.getloadavg()
    print_tables(res)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"\nwrote {args.out}")
    if not res.get("lookahead", {}).get("same_text", True):
        sys.exit("prompt-lookup decoding changed a completion: greedy output must not depend on --lookahead")


if __name__ == "__main__":
    main()

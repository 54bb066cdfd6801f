"""`make bench`: the benchmark suite on the medium shape, printed as one table of issue 7's targets.

Runs each benchmark script (speed per precision vs transformers, the daemon's typing session, round trip and
concurrency with int8 and with bf16 weights, the LSP layer), writes their JSON under bench-results/, then prints one
table headed by the CPU, with its flags, that the figures were measured on (the issue's targets were set on AMX
machines): each figure, its peer measured in the same run (transformers on the same weights) where there is one, and
the target. llama.cpp is compared on this machine by `make bench-llamacpp`: a figure from another machine is no peer.
`--quick` runs the smoke versions; `--only` a subset (the table then shows only what ran); `--report` reprints the
table from the JSON already in bench-results/, headed by the CPU each file records.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "bench-results"
SUITE = [
    ("speed", "bench_speed.py", []),  # decode, prefill, load, RSS per precision; transformers alongside
    # typing session cold vs warm, round trip, 1/8/16 concurrent clients; the daemon's defaults on an int8 bundle
    ("daemon", "bench_daemon.py", ["--stored-quant", "int8"]),
    # concurrency again with bf16 weights, whose batched matmuls cost little more than one row's (int8's do)
    ("daemon-bf16", "bench_daemon.py", ["--quant", "none", "--skip", "cold", "roundtrip", "--keystrokes", "3"]),
    ("lsp", "bench_lsp.py", []),  # keystroke → suggestion through the language server
    # prompt-lookup decoding: the typing session on the release model (acceptance needs a trained model) against
    # --lookahead 0 and the default, interleaved; the `daemon` run above measures it on the medium shape too
    ("lookahead", "bench_daemon.py", ["--bundle", str(HERE.parent / "release"), "--skip", "cold", "warm",
                                      "roundtrip", "throughput"]),
]


@dataclass
class Row:
    label: str
    get: Callable[[dict], float | None]  # the figure, from {suite name: its JSON}
    target: str  # "<= 45" style
    peer: Callable[[dict], float | None] | None = None


def speed(name: str, key: str) -> Callable[[dict], float | None]:
    return lambda r: r.get("speed", {}).get("results", {}).get(name, {}).get(key)


def daemon(part: str, key: str) -> Callable[[dict], float | None]:
    return lambda r: r.get("daemon", {}).get(part, {}).get(key)


def typing(key: str) -> Callable[[dict], float | None]:
    return lambda r: next((t.get(key) for t in r.get("daemon", {}).get("typing", []) if t["mode"] == "warm"), None)


def lookahead(key: str, which: str = "on", suite: str = "lookahead") -> Callable[[dict], float | None]:
    return lambda r: r.get(suite, {}).get("lookahead", {}).get(which, {}).get(key)


def clients(n: int, suite: str = "daemon") -> Callable[[dict], float | None]:
    return lambda r: next((t["tokens_per_s"] for t in r.get(suite, {}).get("throughput", [])
                           if t["clients"] == n), None)


def ratio(a: Callable, b: Callable) -> Callable[[dict], float | None]:
    def f(r: dict) -> float | None:
        x, y = a(r), b(r)
        return x / y if x is not None and y else None
    return f


ROWS = [
    Row("decode fp32, short ctx (ms/token)", speed("fp32", "decode_short_ms"), "<= 45",
        speed("hf-fp32", "decode_short_ms")),
    Row("decode bf16, short ctx (ms/token)", speed("bf16", "decode_short_ms"), "-",
        speed("hf-bf16", "decode_short_ms")),
    Row("decode int8, short ctx (ms/token)", speed("int8", "decode_short_ms"), "<= 20"),
    Row("decode int4, short ctx (ms/token)", speed("int4", "decode_short_ms"), "<= 12"),
    Row("decode int8 @1536 ctx (ms/token)", speed("int8", "decode_at_1536_ms"), "<= 30"),
    Row("decode bf16 @1536 ctx (ms/token)", speed("bf16", "decode_at_1536_ms"), "-",
        speed("hf-bf16", "decode_at_1536_ms")),
    Row("prefill bf16 @512 (tok/s)", speed("bf16", "prefill_512_tok_s"), "-", speed("hf-bf16", "prefill_512_tok_s")),
    Row("prefill bf16 @1536 (tok/s)", speed("bf16", "prefill_1536_tok_s"), ">= 1200",
        speed("hf-bf16", "prefill_1536_tok_s")),
    Row("peak RSS, int8 engine (MiB; peer: bf16)", speed("int8", "peak_rss_mb"), "< 700",
        speed("hf-bf16", "peak_rss_mb")),
    Row("keystroke -> first token p50 (ms)", typing("first_token_ms_p50"), "<= 50"),
    Row("keystroke -> 16-token suggestion p50 (ms)", typing("done_ms_p50"), "<= 300"),
    Row("  same, prompt lookup on (--lookahead 3)", lookahead("done_ms_p50", "on", "daemon"), "<= 300"),
    Row("prompt lookup, release model: tokens/step", lookahead("tokens_per_step"), "> 1"),
    Row("  accepted drafts per step", lookahead("accepted_per_step"), "> 0"),
    Row("  suggestion p50, lookup on (ms)", lookahead("done_ms_p50"), "-"),
    Row("  suggestion p50, lookup off (ms)", lookahead("done_ms_p50", "off"), "-"),
    Row("  suggestion p95, lookup on (ms)", lookahead("done_ms_p95"), "-"),
    Row("  suggestion p95, lookup off (ms)", lookahead("done_ms_p95", "off"), "-"),
    Row("daemon ready, int8 bundle (s)", daemon("meta", "warm_daemon_ready_s"), "< 1.5"),
    Row("`m31r status` wall p50 (ms)", daemon("roundtrip", "status_wall_ms_p50"), "< 50"),
    Row("daemon RSS after the session (MiB)", daemon("roundtrip", "rss_mb"), "<= 8192"),
    Row("8 streams / 1 stream throughput (x)", ratio(clients(8), clients(1)), ">= 4"),
    Row("  same, bf16 weights (--quant none) (x)", ratio(clients(8, "daemon-bf16"), clients(1, "daemon-bf16")),
        ">= 4"),
]


def machine() -> tuple[str, str]:
    """This CPU with the flags that choose the kernels, and what its bf16 matmuls run on: the issue's targets were
    set on 2 Sapphire Rapids cores (AMX)."""
    from m31r.cpu import cpu_info, describe

    _, flags, _ = cpu_info()
    bf16 = "AMX" if "amx_bf16" in flags else "AVX512-BF16, no AMX" if "avx512_bf16" in flags else "no native bf16"
    return describe(), bf16


def suite_cpu(result: dict) -> str | None:
    """The CPU a suite's JSON says it ran on (bench_speed at the top, bench_daemon and bench_lsp in "meta")."""
    return result.get("cpu") or result.get("meta", {}).get("cpu")


def meets(value: float, target: str) -> str:
    op, _, num = target.partition(" ")
    if not num:
        return ""
    t = float(num)
    ok = {"<=": value <= t, "<": value < t, ">=": value >= t, ">": value > t}[op]
    return "yes" if ok else "NO"


def report(results: dict) -> str:
    head = f"{'figure':44} {'M31R':>9} {'transformers':>12} {'target':>8} {'met':>4}"
    lines = [head, "-" * len(head)]
    for row in ROWS:
        v = row.get(results)
        p = row.peer(results) if row.peer else None
        if v is None and p is None:
            continue  # a suite that did not run (--only) or failed: no row, rather than one of dashes
        lines.append(f"{row.label:44} {'-' if v is None else f'{v:,.4g}':>9} {'' if p is None else f'{p:,.4g}':>12} "
                     f"{row.target:>8} {'' if v is None else meets(v, row.target):>4}")
    return "\n".join(lines)


def load_results(names: list[str]) -> dict:
    """{suite: its JSON} for these suites, those whose file exists."""
    return {name: json.loads((OUT / f"{name}.json").read_text()) for name in names if (OUT / f"{name}.json").exists()}


def header(results: dict, here: str, bf16: str) -> str:
    """Where the figures were measured: this machine, or (--report on files from elsewhere) each file's own CPU."""
    cpus = {name: suite_cpu(r) for name, r in results.items()}
    if all(cpu == here for cpu in cpus.values()):
        return f"measured on: {here}; bf16 matmuls: {bf16}"
    return "\n".join([*(f"{name}: measured on {cpu or 'an unrecorded CPU'}" for name, cpu in cpus.items()),
                      f"(this machine: {here}; figures from another machine compare with nothing measured here)"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, choices=[name for name, _, _ in SUITE])
    ap.add_argument("--report", action="store_true", help="only print the table from bench-results/*.json")
    args = ap.parse_args(argv)
    OUT.mkdir(exist_ok=True)
    failed, ran = [], []
    for name, script, extra in SUITE:
        if args.report or (args.only and name not in args.only):
            continue
        out = OUT / f"{name}.json"
        # An earlier run's file must not stand in for this run's figures if this one fails before writing its own.
        out.unlink(missing_ok=True)
        cmd = [sys.executable, str(HERE / script), "--out", str(out), *extra, *(["--quick"] if args.quick else [])]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        ran.append(name)
        if subprocess.run(cmd).returncode != 0 or not out.exists():
            failed.append(name)
    results = load_results([name for name, _, _ in SUITE] if args.report else [n for n in ran if n not in failed])
    print(f"\n=== summary, medium shape ({time.strftime('%Y-%m-%d')}); every figure and its transformers peer from "
          "the JSON in bench-results/, the peer measured in the same run")
    print(header(results, *machine()))
    print(report(results))
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

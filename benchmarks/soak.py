"""`make soak`: reliability figures, measured by the project itself, on a real daemon on a real Unix socket, with the
real LSP server and HTTP adapter in front of it (loopback only; nothing is mocked). Four jobs, one module each:

  fuzz      benchmarks/soak_fuzz.py: the protocol fuzzer, a million frames: 0 crashes, every frame answered as the
            protocol says, and after each batch a valid request on a new connection answered correctly.
  vanish    benchmarks/soak_vanish.py: 10,000 requests from clients that vanish mid-stream: the daemon's RSS stays
            within 5% of where it started, and each request's generation stops within one scheduler round.
  load      benchmarks/soak_load.py: 100 concurrent clients x 20 short completions: no error but a clean `busy`,
            latency p50/p99.
  kill      benchmarks/soak_kill.py: `kill -9` of the daemon mid-stream: `m31r lsp` and `m31r serve` report it,
            a new daemon starts over the stale socket, and both serve the next request.

The model is the tiny test shape (configs/model/tiny.yaml, random weights, fp32, one thread): the figures are about
reliability, not speed. `--scale` (or SOAK_SCALE through make) multiplies every count; 0.05 is a quick run.
Prints a table (figure, value, target, pass/fail), writes bench-results/soak.json, exits 1 if a target is missed.

    python benchmarks/soak.py                      # the full run, ~10-15 minutes on 2 cores
    python benchmarks/soak.py --scale 0.05 --only fuzz load
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_daemon import exit_on_sigterm  # noqa: E402
from soak_common import Figure, JobResult, make_tiny_bundle  # noqa: E402

JOBS = {"fuzz": "soak_fuzz", "vanish": "soak_vanish", "load": "soak_load", "kill": "soak_kill"}


def run_job(name: str, bundle: Path, work: Path, scale: float) -> JobResult:
    module = importlib.import_module(JOBS[name])
    print(f"-- {name}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        res = module.run(bundle, work, scale)
    except Exception as e:  # a job that breaks is a failed figure, and the other jobs still run
        import traceback

        traceback.print_exc()
        res = JobResult([Figure(f"{name}: the job ran to the end", repr(e)[:80], "yes", False)])
    res.details["job_seconds"] = round(time.monotonic() - t0, 1)
    print(f"   {name} took {res.details['job_seconds']} s", file=sys.stderr, flush=True)
    return res


def table(results: dict[str, JobResult]) -> str:
    rows = [("figure", "value", "target", "met")]
    for res in results.values():
        rows += [(f.name, f.value, f.target, {True: "pass", False: "FAIL", None: ""}[f.ok]) for f in res.figures]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows[1:])])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scale", type=float, default=None,
                    help="Multiply every count (cases, requests, clients' completions, kill cycles); default 1 "
                         "(or SOAK_SCALE).")
    ap.add_argument("--only", nargs="+", choices=list(JOBS), default=list(JOBS), help="Run these jobs only.")
    ap.add_argument("--bundle", type=Path, help="Serve this bundle instead of a random tiny one.")
    ap.add_argument("--out", type=Path, default=HERE.parent / "bench-results" / "soak.json")
    args = ap.parse_args()
    exit_on_sigterm()
    if args.scale is None:
        try:
            args.scale = float(os.environ.get("SOAK_SCALE") or 1)
        except ValueError:
            ap.error(f"SOAK_SCALE={os.environ['SOAK_SCALE']!r} is not a number")
    if not args.scale > 0:
        ap.error(f"--scale must be more than 0, not {args.scale:g}")

    from m31r.cpu import describe

    machine = describe()
    print(f"soak: scale {args.scale:g}, {machine}", file=sys.stderr, flush=True)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="m31r-soak-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)  # the daemon's socket folder must be ours alone
        bundle = args.bundle or make_tiny_bundle(work / "bundle")
        results = {name: run_job(name, bundle, work, args.scale) for name in args.only}
    minutes = (time.monotonic() - t0) / 60
    print(f"\nsoak (scale {args.scale:g}, {minutes:.1f} min) on {machine}, load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print(table(results))
    failed = [f.name for r in results.values() for f in r.figures if f.ok is False]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "machine": machine, "python": platform.python_version(), "scale": args.scale, "minutes": round(minutes, 1),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "figures": [f.row() for r in results.values() for f in r.figures],
        "details": {name: r.details for name, r in results.items()}, "failed": failed}, indent=1, default=str))
    print(f"\n{len(failed)} target(s) missed" if failed else "\nall targets met", f"(JSON in {args.out})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

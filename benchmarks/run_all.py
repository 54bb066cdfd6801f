"""`make bench`: the benchmark suite on the medium shape, each figure beside its peer from the same run.

Runs each benchmark script (speed per precision vs transformers, the daemon's typing session, round trip and
concurrency, the LSP layer), writes their JSON under bench-results/, then prints one combined table of the
numeric figures. `--quick` runs the smoke versions.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE.parent / "bench-results"
SUITE = [
    ("speed", "bench_speed.py", []),  # decode, prefill, load, RSS per precision; transformers alongside
    ("daemon", "bench_daemon.py", []),  # typing session cold vs warm, round trip, 1/4/16 concurrent clients
    ("lsp", "bench_lsp.py", []),  # keystroke → suggestion through the language server
]


def flatten(obj, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, int | float) and not isinstance(obj, bool):
        out[prefix] = obj
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", nargs="*", default=None, choices=[name for name, _, _ in SUITE])
    args = ap.parse_args()
    OUT.mkdir(exist_ok=True)
    failed = []
    rows: list[tuple[str, str, float]] = []
    for name, script, extra in SUITE:
        if args.only and name not in args.only:
            continue
        out = OUT / f"{name}.json"
        cmd = [sys.executable, str(HERE / script), "--out", str(out), *extra, *(["--quick"] if args.quick else [])]
        print(f"\n=== {name}: {' '.join(cmd[1:])}", flush=True)
        if subprocess.run(cmd).returncode != 0 or not out.exists():
            failed.append(name)
            continue
        rows += [(name, k, v) for k, v in flatten(json.loads(out.read_text())).items()]
    print("\n=== summary (all figures from this run; JSON in bench-results/)")
    width = max((len(k) for _, k, _ in rows), default=10)
    for name, key, value in rows:
        print(f"{name:7} {key:{width}}  {value:,.4g}")
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

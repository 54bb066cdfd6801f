"""Keystroke latency while other processes hold the CPUs (a `cargo build` beside the editor): a real `m31r daemon`
per configuration, one Fim per keystroke of bench_daemon's typing session (max_tokens 16, greedy, no drafts, no
beams, no document, so every keystroke runs the model), first with the machine idle, then with busy-loop processes
(one per CPU this process may run on, by default) started and killed by this script. Reported per configuration:
keystroke→done p50/p90/max and the 1-minute load average, idle and loaded, with the CPU and its flags.

    python benchmarks/bench_contention.py                                  # default, --threads 1
    python benchmarks/bench_contention.py --case default= --case spin2000=env:GOMP_SPINCOUNT=2000 --busy 2
    python benchmarks/bench_contention.py --out bench-results/contention.json

A case is NAME=ARGS: daemon arguments separated by spaces, and env:KEY=VALUE items for the daemon's environment.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import machine, write_report  # noqa: E402
from bench_daemon import REPO, Daemon, exit_on_sigterm, keystrokes, pct, replay, session_document  # noqa: E402

FIM_TOKENS = 16


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def session(sock: Path, n: int) -> tuple[list[float], list[tuple[int | None, ...]]]:
    """Keystroke→done ms for the session's first n keystrokes, and every completion's tokens."""
    from m31r_protocol import Client

    before, target, after = session_document()
    done, outputs = [], []
    async with await Client.connect(sock, client="bench", timeout=120) as c:
        for prefix in replay(before, keystrokes(target))[:n]:
            t0 = time.perf_counter()
            stream = await c.fim(prefix, after, max_tokens=FIM_TOKENS, lookahead=0, beams=1)
            outputs.append(tuple([t.token async for t in stream]))
            done.append((time.perf_counter() - t0) * 1000)
    return done, outputs


def figures(done: list[float], load: tuple[float, float]) -> dict:
    return {"done_ms_p50": pct(done, 50), "done_ms_p90": pct(done, 90), "done_ms_max": max(done),
            "load_avg_1m": list(load)}


def run_case(bundle: Path, args: list[str], env: dict[str, str], n: int, busy: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="m31r-contention-"))
    folder.chmod(0o700)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # Daemon passes this process's environment on
    try:
        daemon = Daemon(bundle, folder / "m31rd.sock", folder / "daemon.log", args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        asyncio.run(session(daemon.sock, 3))  # first-call costs out of the way
        l0 = os.getloadavg()[0]
        idle, idle_out = asyncio.run(session(daemon.sock, n))
        l1 = os.getloadavg()[0]
        loops = busy_loops(busy)
        try:
            time.sleep(0.5)
            l2 = os.getloadavg()[0]
            loaded, loaded_out = asyncio.run(session(daemon.sock, n))
            l3 = os.getloadavg()[0]
        finally:
            for p in loops:
                p.kill()
                p.wait()
    finally:
        daemon.stop()
    return {"args": args, "env": env, "idle": figures(idle, (l0, l1)), "loaded": figures(loaded, (l2, l3)),
            "same_output_idle_and_loaded": idle_out == loaded_out}


def parse_case(spec: str) -> tuple[str, list[str], dict[str, str]]:
    name, sep, rest = spec.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"a case is NAME=ARGS (ARGS may be empty), not {spec!r}")
    args, env = [], {}
    for item in rest.split():
        if item.startswith("env:"):
            key, eq, value = item[4:].partition("=")
            if not eq or not key:
                raise argparse.ArgumentTypeError(f"env:KEY=VALUE, not {item!r}")
            env[key] = value
        else:
            args.append(item)
    return name, args, env


def main(argv: list[str] | None = None) -> None:
    exit_on_sigterm()
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        cpus = os.cpu_count() or 1
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bundle", type=Path, default=REPO / "release")
    ap.add_argument("--case", action="append", type=parse_case, help="NAME=ARGS (repeatable; see above)")
    ap.add_argument("--keystrokes", type=int, default=40)
    ap.add_argument("--busy", type=int, default=cpus, help=f"busy-loop processes while loaded (default {cpus})")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    cases = a.case or [parse_case("default="), parse_case("threads1=--threads 1")]
    where = machine()
    print(f"cpu: {where['cpu']}; {where['cpu_count']} CPUs ({cpus} usable); torch {where['torch']}; "
          f"load {where['load_avg_1m']:.2f}")
    print(f"bundle {a.bundle}; {a.keystrokes} keystrokes, {FIM_TOKENS}-token Fims; loaded = {a.busy} busy loops\n")
    print(f"{'case':<12} {'idle p50':>9} {'p90':>7} {'max':>7}   {'loaded p50':>10} {'p90':>7} {'max':>7}   "
          f"{'load 1m':>11}  same output")
    results = {}
    for name, args, env in cases:
        r = results[name] = run_case(a.bundle, args, env, a.keystrokes, a.busy)
        i, lo = r["idle"], r["loaded"]
        print(f"{name:<12} {i['done_ms_p50']:>9.1f} {i['done_ms_p90']:>7.1f} {i['done_ms_max']:>7.1f}   "
              f"{lo['done_ms_p50']:>10.1f} {lo['done_ms_p90']:>7.1f} {lo['done_ms_max']:>7.1f}   "
              f"{i['load_avg_1m'][0]:>5.2f}/{lo['load_avg_1m'][1]:<5.2f}  {r['same_output_idle_and_loaded']}",
              flush=True)
    if a.out:
        write_report(a.out, {"machine": where, "keystrokes": a.keystrokes, "fim_max_tokens": FIM_TOKENS,
                             "busy": a.busy, "cases": results})


if __name__ == "__main__":
    main()

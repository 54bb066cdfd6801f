"""Soak job: 100 concurrent clients x 20 short completions against a daemon with its default limits.

Each client is the real async client (m31r_protocol.Client) on a connection of its own; all connect first, then
start together, and ask for 20 completions one after another, alternating Generate and Fim (16 tokens, greedy).
With 100 clients and a queue of 32 (`--max-queue`), some requests are answered `busy`: that must come at once, as an
Error for the request's id, on a connection that goes on serving; the client retries it after a jittered
back-off (50 ms, doubling up to 1 s). Anything
else (another error, a lost connection, a hang) counts as an error. Latency is request -> Done of each served
attempt, and first attempt -> Done including the retries.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from soak_common import Daemon, Figure, JobResult, fmt, pct

from m31r_protocol import Client, DaemonError

CLIENTS = 100
PER_CLIENT = 20
MAX_TOKENS = 16
PREFIX = "fn parse_line(line: &str) -> Option<(String, u32)> {\n    let mut parts = line.split(':');\n    "
SUFFIX = "\n}\n"


@dataclass
class Tally:
    served: int = 0
    busy: int = 0
    errors: list[str] = field(default_factory=list)
    attempt_ms: list[float] = field(default_factory=list)  # request -> Done, served attempts
    total_ms: list[float] = field(default_factory=list)  # first attempt -> Done, retries included
    busy_ms: list[float] = field(default_factory=list)  # request -> the busy answer


async def one_client(sock: Path, k: int, per: int, start: asyncio.Event, tally: Tally) -> None:
    rnd = random.Random(k)
    async with await Client.connect(sock, client="soak-load") as c:
        await start.wait()
        for j in range(per):
            t_first = time.perf_counter()
            backoff = 0.05
            while True:
                t0 = time.perf_counter()
                try:
                    if (k + j) % 2:
                        stream = await c.fim(PREFIX + f"// {k}.{j}\n    ", SUFFIX, max_tokens=MAX_TOKENS)
                    else:
                        stream = await c.generate(PREFIX + f"let n{k}_{j} = ", max_tokens=MAX_TOKENS)
                    async with asyncio.timeout(120):
                        _, done = await stream.collect()
                except DaemonError as e:
                    if e.code == "busy":
                        tally.busy += 1
                        tally.busy_ms.append((time.perf_counter() - t0) * 1000)
                        await asyncio.sleep(rnd.uniform(backoff / 2, backoff))
                        backoff = min(1.0, backoff * 2)
                        continue
                    tally.errors.append(f"client {k} request {j}: {e}")
                except Exception as e:  # a lost connection or a hang
                    tally.errors.append(f"client {k} request {j}: {e!r}")
                    return
                else:
                    now = time.perf_counter()
                    tally.served += 1
                    tally.attempt_ms.append((now - t0) * 1000)
                    tally.total_ms.append((now - t_first) * 1000)
                    if done.usage.completion_tokens > MAX_TOKENS:
                        tally.errors.append(f"client {k} request {j}: {done.usage.completion_tokens} tokens")
                break


async def load(sock: Path, clients: int, per: int) -> tuple[Tally, float]:
    tally, start = Tally(), asyncio.Event()
    tasks = [asyncio.create_task(one_client(sock, k, per, start, tally)) for k in range(clients)]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    tally.errors += [f"client {k}: {r!r}" for k, r in enumerate(results) if isinstance(r, BaseException)]
    return tally, time.perf_counter() - t0


def run(bundle: Path, work: Path, scale: float) -> JobResult:
    per = max(1, round(PER_CLIENT * scale))
    daemon = Daemon(bundle, work / "load.sock", work / "load.log")
    try:
        tally, seconds = asyncio.run(load(daemon.sock, CLIENTS, per))
        alive = daemon.alive
    finally:
        daemon.stop()
    want = CLIENTS * per
    res = JobResult()
    res.figures = [
        Figure(f"{CLIENTS} concurrent clients x {per} completions: served", f"{tally.served:,}/{want:,}", "all",
               tally.served == want and alive),
        Figure("concurrent clients: errors other than a clean `busy`", str(len(tally.errors)), "0", not tally.errors),
        Figure("concurrent clients: `busy` answers (retried), p99 time to the answer (ms)",
               f"{tally.busy:,}, {fmt(pct(tally.busy_ms, 99))}"),
        Figure("concurrent clients: latency request -> done, p50 / p99 (ms)",
               f"{fmt(pct(tally.attempt_ms, 50))} / {fmt(pct(tally.attempt_ms, 99))}"),
        Figure("concurrent clients: latency with busy retries, p50 / p99 (ms)",
               f"{fmt(pct(tally.total_ms, 50))} / {fmt(pct(tally.total_ms, 99))}"),
    ]
    res.details = {
        "clients": CLIENTS, "per_client": per, "max_tokens": MAX_TOKENS, "served": tally.served, "busy": tally.busy,
        "errors": tally.errors[:20], "seconds": round(seconds, 1),
        "completions_per_s": round(tally.served / max(seconds, 1e-9), 1),
        "attempt_ms": {q: pct(tally.attempt_ms, q) for q in (50, 90, 99)},
        "total_ms": {q: pct(tally.total_ms, q) for q in (50, 90, 99)},
        "busy_ms": {q: pct(tally.busy_ms, q) for q in (50, 99)}, "daemon_alive": alive,
    }
    return res

"""Soak job: 10,000 requests from clients that vanish mid-stream.

Each client connects, asks for a long greedy Generate (max_tokens 400), and goes away: after its first token (closing
the socket), after its third (aborting it, with unread tokens left behind), or right after sending the request
(before any token: the daemon sees the request, then EOF). PARALLEL clients at a time. The daemon has its default
options (its prefix cache reuses slots, since the prompts come from a set of eight).

- Memory: the daemon's RSS (read by this process from /proc) after a warm-up of WARMUP such requests, then after the
  10,000, once the daemon is idle: the second may be at most 5% above the first.
- Stopping: the daemon's per-request log line reports, for a cancelled request, the model calls it made after the
  cancel (`calls_after_cancel`). The scheduler checks cancellation at every round boundary, so at most one (the round
  already running) may follow. Every vanished request must have been cancelled, not generated to its end. Reported
  too: the time from the client's close to the daemon's log line for the request.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from protocol_fuzz import Frames, open_raw
from soak_common import Daemon, Figure, JobResult, fmt, pct

from m31r_protocol import messages as m
from m31r_protocol.framing import pack

REQUESTS = 10_000
WARMUP = 500
PARALLEL = 8
MAX_TOKENS = 400
PROMPTS = [f"fn f{i}(x: u32) -> u32 {{\n    let y = x * {i + 2};\n    " for i in range(8)]
CLIENT = "soak-vanish"
STYLES = ("first_token_close", "third_token_abort", "before_any_token")


async def vanish(sock: Path, rid: int) -> dict:
    """One client: a Generate, then gone. Returns what the log line is matched against."""
    style = STYLES[0] if rid % 10 < 5 else STYLES[1] if rid % 10 < 8 else STYLES[2]
    enc = m.encoder()
    reader, writer = await open_raw(sock)
    frames = Frames(reader)
    writer.write(pack(enc.encode(m.Hello(protocol=m.PROTOCOL_VERSION, client=CLIENT))))
    assert isinstance(await frames.next(), m.Welcome)
    writer.write(pack(enc.encode(m.Generate(id=rid, prompt=PROMPTS[rid % len(PROMPTS)], max_tokens=MAX_TOKENS))))
    tokens = 0
    if style != "before_any_token":
        want = 1 if style == "first_token_close" else 3
        while tokens < want:
            msg = await frames.next()
            assert isinstance(msg, m.Token), msg
            tokens += 1
        await writer.drain()
    closed = time.time()
    if style == "third_token_abort":
        writer.transport.abort()
    else:
        writer.close()
    return {"id": rid, "style": style, "tokens": tokens, "closed": closed}


async def vanish_many(sock: Path, ids: range) -> list[dict]:
    todo = iter(ids)
    out: list[dict] = []

    async def worker() -> None:
        for rid in todo:
            out.append(await vanish(sock, rid))

    await asyncio.gather(*(worker() for _ in range(PARALLEL)))
    return out


async def wait_idle(sock: Path, timeout: float = 60.0) -> None:
    from m31r_protocol import Client

    t0 = time.monotonic()
    async with await Client.connect(sock, client="soak-status") as c:
        while (st := await c.status()).queue or st.active:
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the daemon is still busy after {timeout:g} s: {st}")
            await asyncio.sleep(0.05)


def run(bundle: Path, work: Path, scale: float) -> JobResult:
    n = max(100, int(REQUESTS * scale))
    daemon = Daemon(bundle, work / "vanish.sock", work / "vanish.log")
    curve: list[tuple[int, float]] = []
    try:
        asyncio.run(vanish_many(daemon.sock, range(1, WARMUP + 1)))
        asyncio.run(wait_idle(daemon.sock))
        time.sleep(0.5)
        before = daemon.rss_mb()
        curve.append((0, round(before, 1)))
        clients: list[dict] = []
        t0 = time.monotonic()
        step = max(1, n // 10)
        for done in range(0, n, step):  # in tenths, sampling the RSS after each
            first = WARMUP + 1 + done
            clients += asyncio.run(vanish_many(daemon.sock, range(first, first + min(step, n - done))))
            curve.append((len(clients), round(daemon.rss_mb(), 1)))
        seconds = time.monotonic() - t0
        asyncio.run(wait_idle(daemon.sock))
        time.sleep(0.5)
        after = daemon.rss_mb()
        alive = daemon.alive
    finally:
        daemon.stop()
    return judge(n, clients, daemon.lines(), before, after, curve, seconds, alive)


def judge(n: int, clients: list[dict], lines: list[dict], before: float, after: float, curve: list, seconds: float,
          alive: bool) -> JobResult:
    by_id = {x["id"]: x for x in lines if x.get("msg") == "request" and x.get("client") == CLIENT}
    missing = [c["id"] for c in clients if c["id"] not in by_id]
    logged = [(c, by_id[c["id"]]) for c in clients if c["id"] in by_id]
    cancelled = [(c, x) for c, x in logged if x.get("code") == "cancelled"]
    ran_out = [x for _, x in logged if x.get("finish_reason") == "length"]  # generated to the end: never stopped
    after_cancel = [x.get("calls_after_cancel") for _, x in cancelled]
    unmeasured = sum(v is None for v in after_cancel)
    worst = max((v for v in after_cancel if v is not None), default=None)
    stop_ms = [x["ts"] * 1000 - c["closed"] * 1000 for c, x in cancelled]
    cancel_ms = [x["cancel_ms"] for _, x in cancelled if "cancel_ms" in x]
    rounds_ok = worst is not None and worst <= 1 and not unmeasured
    growth = (after / before - 1) * 100
    res = JobResult()
    res.figures = [
        Figure("vanishing clients: requests (vanished mid-stream / before any token)",
               f"{len(clients):,} ({sum(c['tokens'] > 0 for c in clients):,} / "
               f"{sum(c['tokens'] == 0 for c in clients):,})", f"{n:,}", len(clients) == n and alive),
        Figure("vanishing clients: daemon RSS before -> after (MiB)", f"{before:.1f} -> {after:.1f} ({growth:+.1f}%)",
               "<= +5%", growth <= 5.0),
        Figure("vanishing clients: cancelled, not run to the end", f"{len(cancelled):,}/{len(clients):,}", "all",
               len(cancelled) == len(clients) and not ran_out),
        Figure("vanishing clients: model calls after the cancel (max)", fmt(worst, 0), "<= 1 (one round)",
               rounds_ok),
        Figure("vanishing clients: client gone -> request ended in the daemon, p50 / p99 (ms)",
               f"{fmt(pct(stop_ms, 50))} / {fmt(pct(stop_ms, 99))}"),
    ]
    res.details = {
        "requests": len(clients), "seconds": round(seconds, 1), "styles": {s: sum(c["style"] == s for c in clients)
                                                                           for s in STYLES},
        "rss_mb_curve": curve, "rss_mb_before": round(before, 1), "rss_mb_after": round(after, 1),
        "not_logged": missing[:20], "ran_to_the_end": len(ran_out), "calls_after_cancel_unmeasured": unmeasured,
        "calls_after_cancel": {str(v): after_cancel.count(v) for v in sorted(set(after_cancel), key=str)},
        "close_to_end_ms": {"p50": pct(stop_ms, 50), "p99": pct(stop_ms, 99), "max": max(stop_ms, default=None)},
        "cancel_to_end_ms": {"p50": pct(cancel_ms, 50), "p99": pct(cancel_ms, 99), "max": max(cancel_ms, default=None)},
        "daemon_alive": alive,
    }
    return res

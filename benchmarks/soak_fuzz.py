"""Soak job: the protocol fuzzer (tests/protocol_fuzz.py) at a million cases against one daemon.

A pool of messages is drawn with hypothesis over the protocol's Structs; each case is one of them sent as is (5%),
mutated (wrong types, missing and unknown fields, unknown kinds, flipped, spliced or cut bytes, bad UTF-8, deep
nesting) or with a broken frame (oversize or cut length prefixes). A case that ends its connection (a broken frame,
an undecodable body) costs a connection, so only one in ten drawn is kept: about 2% of the cases sent. A round is
CONNECTIONS connections carrying BODY cases written back to back (each answer checked as it comes), one more
connection per further connection-ending case and per fuzzed first frame, then a probe: a valid request on a new
connection must get the same answer as before any fuzzing. At the end, STALLS clients stop mid-frame and wait for
the daemon's read timeout. A crash is the daemon exiting, an `internal` answer, or
an error in its log.
"""

from __future__ import annotations

import asyncio
import random
import sys
import time
from pathlib import Path

from protocol_fuzz import Outcome, case, fuzz_connection, handshake_case, messages, probe, stall_case
from soak_common import Daemon, Figure, JobResult, fmt, log_errors

CASES = 1_000_000
BODY = 2000  # cases per round (then the probe), on CONNECTIONS connections that stay open, besides those that end
CONNECTIONS = 4
PARALLEL = 16  # connections open at once
# A connection-ending case costs a connection (~1 ms of both processes' time, against ~0.3 ms for a case that keeps it
# open): a third of the mutations end one, so only one in ten of those is kept, about 2% of the cases sent.
KEEP_ENDING = 0.1
STALLS = 100  # connections that stop mid-frame, at the end (each waits out the daemon's 2 s --read-timeout)
POOL = 3000  # hypothesis messages the cases are made from


def message_pool(n: int) -> list:
    """n messages drawn by hypothesis (derandomized: the same pool every run of one hypothesis version)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st

    pool: list = []

    @settings(max_examples=max(1, n // 10), deadline=None, database=None, derandomize=True, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(messages, min_size=10, max_size=10))
    def draw(msgs: list) -> None:
        pool.extend(msgs)

    draw()
    return pool


def round_cases(pool: list, rnd: random.Random, size: int) -> list[tuple]:
    """One round's connections, (body, end, first) each: CONNECTIONS that carry `size` cases in all (each ended by
    one of the connection-ending cases drawn), one more per further connection-ending case, and one per fuzzed first
    frame."""
    body, ends = [], []
    while len(body) < size:
        c = case(rnd.choice(pool), rnd, plain=0.05, framing=0.02, dict_share=0.8)
        if c is None or (c.expect in ("close", "eof") and rnd.random() > KEEP_ENDING):
            continue  # not sent, not counted
        (body if c.expect in ("reply", "silent") else ends).append(c)
    n = max(1, min(CONNECTIONS, len(body) // 100))
    plan = [(body[i::n], ends[i] if i < len(ends) else None, None) for i in range(n)]
    plan += [([], end, None) for end in ends[n:]]
    plan += [([], None, handshake_case(rnd.choice(pool), rnd)) for _ in range(n)]
    return plan


async def fuzz_round(sock: Path, plan: list[tuple], parallel: int = PARALLEL) -> Outcome:
    """The round's connections, `parallel` at a time."""
    gate = asyncio.Semaphore(parallel)

    async def one(body: list, end, first) -> Outcome:
        async with gate:
            return await fuzz_connection(sock, body, end, first)

    total = Outcome()
    for o in await asyncio.gather(*(one(*p) for p in plan)):
        merge(total, o)
    return total


def arun(coro):
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def merge(total: Outcome, o: Outcome) -> None:
    total.cases += o.cases
    total.answers += o.answers
    total.codes.update(o.codes)
    total.labels.update(o.labels)
    total.violations += o.violations


def run(bundle: Path, work: Path, scale: float) -> JobResult:
    target = max(1000, int(CASES * scale))
    res = JobResult()
    t0 = time.monotonic()
    pool = message_pool(min(POOL, max(100, target // 100)))
    pool_s = time.monotonic() - t0
    # A small prefix cache: every fuzzed prompt is new, and the cache would otherwise grow to its default budget.
    daemon = Daemon(bundle, work / "fuzz.sock", work / "fuzz.log", "--read-timeout", "2", "--cache-mb", "64")
    rss0 = daemon.rss_mb()
    reference = probe(daemon.sock)
    rnd = random.Random(0)
    total = Outcome()
    rounds = connections = probes_ok = 0
    curve = [(0, round(rss0, 1))]
    bad_probes: list[str] = []
    t1 = time.monotonic()
    next_report = 0.1
    try:
        while total.cases < target and daemon.alive:
            size = min(BODY, target - total.cases)
            plan = round_cases(pool, rnd, size)
            merge(total, arun(fuzz_round(daemon.sock, plan)))
            rounds += 1
            connections += len(plan)
            if not daemon.alive:
                break
            try:
                answer = probe(daemon.sock)
                probes_ok += answer == reference
                if answer != reference:
                    bad_probes.append(f"round {rounds}: {answer!r} != {reference!r}")
            except (OSError, AssertionError) as e:
                bad_probes.append(f"round {rounds}: {e!r}")
            if total.cases >= next_report * target:
                curve.append((total.cases, round(daemon.rss_mb(), 1)))
                rate = total.cases / (time.monotonic() - t1)
                print(f"  fuzz: {total.cases:,} cases, {rate:,.0f}/s, {len(total.violations)} violations",
                      file=sys.stderr, flush=True)
                next_report += 0.1
        if daemon.alive:  # clients that stop mid-frame: each waits out the read timeout, so all at once
            stalls = [([], stall_case(rnd.choice(pool), rnd), None) for _ in range(max(10, int(STALLS * scale)))]
            merge(total, arun(fuzz_round(daemon.sock, stalls, parallel=len(stalls))))
            connections += len(stalls)
        seconds = time.monotonic() - t1
        alive = daemon.alive
        rss1 = daemon.rss_mb() if alive else None
    finally:
        code = daemon.stop()
    lines = daemon.lines()
    errors = log_errors(lines)
    internal = total.codes.get("internal", 0)
    crashes = (0 if alive else 1) + internal + len(errors)
    res.figures = [
        Figure("protocol fuzz: cases (frames sent and checked)", f"{total.cases:,}", f">= {target:,}",
               total.cases >= target),
        Figure("protocol fuzz: crashes (daemon exit, `internal`, error log lines)", str(crashes), "0", crashes == 0),
        Figure("protocol fuzz: wrong, missing or late answers", str(len(total.violations)), "0",
               not total.violations),
        Figure("protocol fuzz: valid request on a new connection after each batch answered correctly",
               f"{probes_ok:,}/{rounds:,}", "all", probes_ok == rounds and rounds > 0),
    ]
    res.details = {
        "cases": total.cases, "answers": total.answers, "rounds": rounds, "connections": connections,
        "seconds": round(seconds, 1), "cases_per_s": round(total.cases / max(seconds, 1e-9)),
        "pool": len(pool), "pool_seconds": round(pool_s, 1), "cases_by_kind": dict(total.labels.most_common()),
        "answers_by_code": dict(total.codes.most_common()), "violations": total.violations[:20],
        "bad_probes": bad_probes[:20], "daemon_exit": code, "log_errors": errors[:10],
        "rss_mb": {"start": round(rss0, 1), "end": fmt(rss1), "curve": curve}, "daemon_args": list(daemon.args),
        "reference_answer": reference,
    }
    return res

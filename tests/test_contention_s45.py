"""The daemon's thread count follows the CPUs other processes leave free (m31rd.torch_thread.ThreadGovernor): with a
`cargo build` holding the cores, an OpenMP team as wide as the machine stalled every decode step at its barriers.
No timings here (benchmarks/bench_contention.py measures them): the decision on given load figures, the switch under
real load in a real daemon, and greedy output that does not depend on the thread count."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from m31rd.torch_thread import ThreadGovernor, free_cpu_threads, read_cpu_ticks

LINUX = sys.platform.startswith("linux")
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.parametrize(("others", "cpus", "ceiling", "want"), [
    (0.0, 2, 2, 2),  # idle: all the cores
    (0.4, 2, 2, 2),  # a core used less than half by others still counts as free
    (0.6, 2, 2, 1),
    (1.0, 2, 2, 1),  # one busy process on two cores: a team of two would wait for the descheduled one
    (2.0, 2, 2, 1),  # all cores taken: one thread, never none
    (3.7, 2, 2, 1),
    (0.0, 16, 8, 8),  # never past --threads (the ceiling)
    (12.0, 16, 8, 4),
    (16.0, 16, 8, 1),
])
def test_threads_are_the_cpus_other_processes_leave_free(others: float, cpus: int, ceiling: int, want: int) -> None:
    assert free_cpu_threads(others, cpus, ceiling) == want


STAT = """cpu  900 0 100 1000 50 0 0 0 0 0
cpu0 100 0 50 500 25 0 0 0 0 0
cpu1 800 0 50 500 25 0 0 0 0 0
intr 12345
procs_running 3
"""


def test_cpu_ticks_count_the_cpus_this_process_may_run_on() -> None:
    assert read_cpu_ticks(STAT, None) == (1000, 2050)  # busy: all but idle and iowait
    assert read_cpu_ticks(STAT, {1}) == (850, 1375)
    with pytest.raises(ValueError, match="no per-CPU lines"):
        read_cpu_ticks("intr 1\n", None)
    with pytest.raises(ValueError, match="no per-CPU lines"):
        read_cpu_ticks(STAT, {7})  # an affinity set /proc/stat does not list


def write_stat(path: Path, busy: int, idle: int) -> None:
    path.write_text("cpu  0 0 0 0 0\n" + "".join(f"cpu{c} {busy} 0 0 {idle} 0 0 0 0\n" for c in CPUS))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to choose between one thread and two")
def test_governor_drops_to_one_thread_while_others_hold_the_cpus_and_comes_back(tmp_path: Path) -> None:
    import torch

    before = torch.get_num_threads()
    stat = tmp_path / "stat"
    write_stat(stat, 0, 0)
    gov = ThreadGovernor(2, stat_path=str(stat), window_s=0.0)
    try:
        write_stat(stat, 10_000, 0)  # every CPU busy, and not (only) with this process: 100 s of ticks a CPU
        assert gov.adjust() == 1 and torch.get_num_threads() == 1
        assert gov.others_busy > len(CPUS) - 1
        write_stat(stat, 10_000, 10_000)  # idle since
        assert gov.adjust() == 2 and torch.get_num_threads() == 2
        stat.unlink()  # /proc gone (a sandbox): keeps what runs
        assert gov.adjust() == 2
    finally:
        torch.set_num_threads(before)


def test_no_governor_for_one_thread_or_without_proc_stat(tmp_path: Path) -> None:
    assert ThreadGovernor.where_supported(1) is None
    with pytest.raises(OSError):
        ThreadGovernor(2, stat_path=str(tmp_path / "missing"))


@pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to switch between one thread and two")
def test_greedy_output_is_the_same_whatever_the_thread_count_mid_generation(tiny_engine, tmp_path: Path) -> None:
    """Threads switching between every model pass give the tokens and logprobs of one thread throughout."""
    import torch

    from m31rd.main import _govern_threads

    prompt = "fn main() {\n    let total: u64 = items.iter().map(|x| x.len() as u64).sum();\n" * 3

    def run() -> list[tuple[int | None, float | None, tuple]]:
        return [(p.id, p.logprob, p.top) for p in tiny_engine.generate(prompt, max_tokens=24, top_logprobs=2)]

    before = torch.get_num_threads()
    stat = tmp_path / "stat"
    write_stat(stat, 0, 0)
    gov = ThreadGovernor(2, stat_path=str(stat), window_s=0.0)
    seen: list[int] = []
    ticks = {"busy": 0, "idle": 0}

    def flip() -> None:  # others load the CPUs before every other pass: 1, 2, 1, 2 ... threads
        ticks["busy" if len(seen) % 2 == 0 else "idle"] += 10_000
        write_stat(stat, ticks["busy"], ticks["idle"])
        seen.append(gov.adjust())

    try:
        assert _govern_threads(tiny_engine, 2) == "yes"  # the warm-up's check on this engine passes here
        tiny_engine.before_pass = None
        torch.set_num_threads(1)
        alone = run()
        tiny_engine.before_pass = flip
        switching = run()
    finally:
        tiny_engine.before_pass = None
        torch.set_num_threads(before)
    assert {1, 2} <= set(seen)
    assert len([p for p in alone if p[0] is not None]) == 24
    assert switching == alone


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


async def complete(sock: Path, prompt: str) -> list[tuple[int | None, float | None]]:
    from m31r_protocol import Client

    async with await Client.connect(sock, client="test", timeout=60) as c:
        stream = await c.generate(prompt, max_tokens=12, logprobs=1, lookahead=0, beams=1)
        return [(t.token, t.logprob) async for t in stream]


def switches(proc) -> list[str]:
    return [json.loads(line)["msg"] for line in proc.log_lines if line.startswith("{") and '"threads ' in line]


@pytest.mark.skipif(not LINUX or len(CPUS) < 2, reason="reads /proc/stat; needs two CPUs")
def test_daemon_runs_one_thread_while_other_processes_hold_the_cpus(tiny_bundle, tmp_path: Path) -> None:
    """A real daemon at --threads 2: busy-loop processes on every CPU it may use take it to one thread (coming back
    to two is the governor test's: this machine may be busy with other work), and its greedy answers stay the same."""
    from daemon_util import start_daemon, stop_daemon

    run_dir = tmp_path / "run"
    run_dir.mkdir(mode=0o700)
    sock = run_dir / "m31rd.sock"
    prompt = "fn parse(line: &str) -> Option<u32> {\n    let mut n = 0;\n"
    proc = start_daemon(tiny_bundle.path, sock, "--threads", "2", "--log-level", "debug")
    try:
        warm = next(json.loads(x) for x in proc.log_lines if '"msg": "warm"' in x)
        assert warm["threads_follow_load"] == "yes"
        idle = asyncio.run(complete(sock, prompt))
        loops = busy_loops(len(CPUS))
        try:
            deadline = time.monotonic() + 20
            while not any("2 -> 1" in s for s in switches(proc)) and time.monotonic() < deadline:
                assert asyncio.run(complete(sock, prompt)) == idle
                time.sleep(0.05)
        finally:
            for p in loops:
                p.kill()
                p.wait()
        assert any("2 -> 1" in s for s in switches(proc)), "".join(proc.log_lines)[-2000:]
        assert asyncio.run(complete(sock, prompt)) == idle
    finally:
        stop_daemon(proc)

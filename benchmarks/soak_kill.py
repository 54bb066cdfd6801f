"""Soak job: `kill -9` of the daemon mid-stream, with the real language server and the real HTTP adapter in front.

`m31r lsp --no-autostart` (driven by pytest-lsp's client, as an editor drives it) and `m31r serve --no-autostart`
(driven by httpx over loopback) both talk to one daemon. Each cycle:

1. both serve a request;
2. an HTTP stream (`/generate`, `stream: true`, 400 tokens) has sent its first chunk and a language-server
   completion (400 tokens, multi-line, sampled so that it does not stop early) is running in the daemon;
3. the daemon gets SIGKILL: no shutdown, its socket file stays behind;
4. the HTTP stream must end with an `event: error` and `/health` must answer 503; the completion request must come
   back (empty) instead of hanging, and the language server must tell the user (`window/showMessage`) and the
   editor (`m31r/status` "unavailable");
5. a new daemon starts on the same socket path, over the stale file;
6. both must serve a request again, each through a connection of its own that it remade.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from soak_common import Daemon, Figure, JobResult, fmt, pct

from m31r_protocol import Client

CYCLES = 10
# A cursor at the end of a different line each time: the server reuses a finished suggestion for its own cursor.
RUST = "fn main() {\n" + "".join(f"    let v{i} = v{i - 1} + {i};\n" for i in range(1, 200)) + "}\n"
LINES = [(i, len(line)) for i, line in enumerate(RUST.split("\n")) if line.startswith("    let")]
# minProbability 0: the random tiny model is unsure of everything, and the language server would hide it all (README
# "Confidence"); this job measures that suggestions come back, not whether they are shown.
LSP_SETTINGS = {"multiline": "always", "temperature": 1.0, "seed": 7, "debounceMode": "fixed", "debounceMs": 0,
                "maxTokens": 400, "deadlineMs": 20000, "autostart": False, "minProbability": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Http:
    """`m31r serve` in a subprocess, its log in a file."""

    def __init__(self, sock: Path, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "m31r.cli", "serve", "--port", str(self.port), "--socket", str(sock),
               "--no-autostart", "--max-tokens-cap", "500", "--request-timeout", "60"]
        with log.open("ab") as f:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=f,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                    self.stop()  # not serving after a minute: it must not outlive the job either
                    raise RuntimeError(f"m31r serve did not start: {log.read_text()[-2000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Lsp:
    """`m31r lsp` through pytest-lsp's client, with one open Rust document."""

    async def start(self, sock: Path) -> None:
        from lsprotocol import types as t
        from pytest_lsp import ClientServerConfig, client_capabilities

        cfg = ClientServerConfig(server_command=[sys.executable, "-m", "m31r_lsp", "--no-autostart"])
        self.client = await cfg.start()
        self.status: list[str] = []
        self.client.feature("m31r/status")(lambda ls, params: self.status.append(getattr(params, "state", "")))
        await self.client.initialize_session(t.InitializeParams(
            capabilities=client_capabilities("visual-studio-code"),
            initialization_options={"m31r": {**LSP_SETTINGS, "socket": str(sock)}}))
        self.uri = "file:///soak/src/main.rs"
        self.client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=self.uri, language_id="rust", version=1, text=RUST)))
        self.cursors = itertools.cycle(LINES)

    async def complete(self) -> int:
        """One inline completion at the next cursor: the number of items."""
        from lsprotocol import types as t

        line, column = next(self.cursors)
        res = await self.client.text_document_inline_completion_async(t.InlineCompletionParams(
            context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Invoked),
            text_document=t.TextDocumentIdentifier(self.uri), position=t.Position(line, column)))
        return len(res.items) if res is not None else 0

    def warnings(self) -> int:
        from lsprotocol import types as t

        return sum(m.type == t.MessageType.Warning for m in self.client.messages)

    async def stats(self) -> dict:
        return await self.client.protocol.send_request_async("m31r/stats", {})

    async def stop(self) -> None:
        await self.client.shutdown_session()
        await self.client.stop()


async def until(pred, timeout: float, step: float = 0.1) -> float | None:
    """Seconds until `pred()` (async) is true, or None after `timeout`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        with contextlib.suppress(Exception):
            if await pred():
                return time.monotonic() - t0
        await asyncio.sleep(step)
    return None


async def active_jobs(sock: Path) -> int:
    async with await Client.connect(sock, client="soak-kill") as c:
        return (await c.status()).active


async def cycle(daemon: Daemon, http: Http, lsp: Lsp, hc: httpx.AsyncClient,
                started: list[Daemon]) -> tuple[Daemon, dict]:
    """One kill and restart; the new daemon is also appended to `started`, so that it is stopped even when the
    cycle ends in an error (or Ctrl-C) before it returns."""
    r: dict = {}
    # 1. both serve
    r["http_before"] = (await hc.post("/generate", json={"prompt": "fn", "max_tokens": 2})).status_code == 200
    r["lsp_before"] = await until(lambda: _items(lsp), 20) is not None
    # 2. mid-stream on both
    warnings, statuses = lsp.warnings(), len(lsp.status)
    pending = asyncio.create_task(lsp.complete())
    events: list[str] = []
    first = asyncio.Event()

    async def stream() -> None:
        body = {"prompt": "fn main() {\n    let x = ", "max_tokens": 400, "stream": True,
                "temperature": 1.0, "seed": 3}
        async with hc.stream("POST", "/generate", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("event:"):
                    events.append(line.split(":", 1)[1].strip())
                    first.set()

    streaming = asyncio.create_task(stream())
    await asyncio.wait_for(first.wait(), 30)
    # The language server's request goes through its own process and may reach the daemon after the HTTP stream's
    # first chunk: wait (a few seconds at most) until both run there, so that the kill lands mid-request on both.
    await until(lambda: _both_in_flight(daemon.sock), 5, 0.01)
    r["in_flight_at_kill"] = await active_jobs(daemon.sock)
    r["lsp_pending_at_kill"] = not pending.done()
    # 3. kill -9
    t_kill = time.monotonic()
    daemon.kill9()
    r["stale_socket_left"] = daemon.sock.exists()
    # 4. both report it
    try:
        await asyncio.wait_for(streaming, 10)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        events.append(f"raised {e!r}")
    r["http_stream_error_event"] = bool(events) and events[-1] == "error"
    r["http_stream_end_s"] = round(time.monotonic() - t_kill, 3)
    health = await hc.get("/health")
    r["http_health_503"] = health.status_code == 503
    try:
        r["lsp_pending_items"] = await asyncio.wait_for(pending, 10)
        r["lsp_pending_returned"] = True
    except Exception:  # noqa: BLE001
        r["lsp_pending_returned"] = False
    r["lsp_pending_end_s"] = round(time.monotonic() - t_kill, 3)
    r["lsp_told_user"] = await until(lambda: _true(lsp.warnings() > warnings), 10) is not None
    r["lsp_status_unavailable"] = "unavailable" in lsp.status[statuses:]
    # 5. restart over the stale socket
    t_restart = time.monotonic()
    daemon = Daemon(daemon.bundle, daemon.sock, daemon.log)
    started.append(daemon)
    r["restart_s"] = round(time.monotonic() - t_restart, 2)
    # 6. both serve again
    r["http_next_s"] = await until(lambda: _served(hc), 30, 0.05)
    r["lsp_next_s"] = await until(lambda: _items(lsp), 30, 0.05)
    return daemon, r


async def _items(lsp: Lsp) -> bool:
    return await lsp.complete() > 0


async def _both_in_flight(sock: Path) -> bool:
    return await active_jobs(sock) >= 2


async def _served(hc: httpx.AsyncClient) -> bool:
    return (await hc.post("/generate", json={"prompt": "fn", "max_tokens": 2})).status_code == 200


async def _true(x: bool) -> bool:
    return x


async def kill_cycles(bundle: Path, work: Path, cycles: int) -> tuple[list[dict], dict]:
    sock = work / "kill" / "d.sock"
    sock.parent.mkdir(mode=0o700)
    daemon = Daemon(bundle, sock, work / "kill-daemon.log")
    started = [daemon]  # every daemon this job started: all are stopped at the end, however it ends
    http: Http | None = None
    lsp = Lsp()
    out: list[dict] = []
    try:
        http = Http(sock, work / "kill-http.log")
        await lsp.start(sock)
        async with httpx.AsyncClient(base_url=http.url, timeout=60) as hc:
            for _ in range(cycles):
                daemon, r = await cycle(daemon, http, lsp, hc, started)
                out.append(r)
            metrics = (await hc.get("/metrics")).text
        stats = await lsp.stats()
    finally:
        if hasattr(lsp, "client"):
            with contextlib.suppress(Exception):
                await lsp.stop()
        if http is not None:
            http.stop()
        for d in started:
            d.stop()
    http_connects = next((float(line.split()[-1]) for line in metrics.splitlines()
                          if line.startswith("m31r_daemon_connects_total")), None)
    return out, {"lsp_connects": getattr(stats, "connects", None), "http_connects": http_connects}


def run(bundle: Path, work: Path, scale: float) -> JobResult:
    n = max(1, round(CYCLES * scale))
    cycles, counts = asyncio.run(kill_cycles(bundle, work, n))
    ok = lambda key: sum(bool(c.get(key)) for c in cycles)  # noqa: E731
    served = lambda key: sum(c.get(key) is not None for c in cycles)  # noqa: E731
    http_reported = sum(c["http_stream_error_event"] and c["http_health_503"] for c in cycles)
    lsp_reported = sum(c["lsp_pending_returned"] and c["lsp_told_user"] and c["lsp_status_unavailable"]
                       for c in cycles)
    mid = sum(c["in_flight_at_kill"] >= 2 and c["lsp_pending_at_kill"] for c in cycles)
    http_next = [c["http_next_s"] for c in cycles if c["http_next_s"] is not None]
    lsp_next = [c["lsp_next_s"] for c in cycles if c["lsp_next_s"] is not None]
    res = JobResult()
    res.figures = [
        Figure("kill -9 mid-stream: cycles with both front ends mid-request at the kill", f"{mid}/{n}", "all",
               mid == n),
        Figure("kill -9: HTTP stream ended with an error event, /health 503", f"{http_reported}/{n}", "all",
               http_reported == n),
        Figure("kill -9: LSP request returned, user told, status unavailable", f"{lsp_reported}/{n}", "all",
               lsp_reported == n),
        Figure("kill -9: new daemon started over the stale socket", f"{ok('stale_socket_left')} left, "
               f"{served('restart_s')}/{n} restarted", "all", served("restart_s") == n),
        Figure("kill -9: next request served after the restart, HTTP / LSP", f"{served('http_next_s')}/{n} / "
               f"{served('lsp_next_s')}/{n}", "all", served("http_next_s") == n and served("lsp_next_s") == n),
        Figure("kill -9: connections made to the daemon, LSP / HTTP", f"{counts['lsp_connects']} / "
               f"{fmt(counts['http_connects'], 0)}", f"{n + 1} each (one per daemon)",
               counts["lsp_connects"] == n + 1 and counts["http_connects"] == n + 1),
        Figure("kill -9: restart -> served, p50 HTTP / LSP (s)", f"{fmt(pct(http_next, 50), 2)} / "
               f"{fmt(pct(lsp_next, 50), 2)}"),
    ]
    res.details = {"cycles": cycles, **counts,
                   "restart_s": {"p50": pct([c["restart_s"] for c in cycles], 50),
                                 "max": max(c["restart_s"] for c in cycles)}}
    return res

"""`m31r serve` as users configure it, session 46's audit: an --allowed-host or --cors-origin written in a form no
request can match (a URL for a host, an origin without its scheme or with a path) is refused at start, naming the
form that works, instead of a server that answered every such request 403 "start the server with --allowed-host
(--cors-origin) to accept it" although it had been; an origin in capitals is the one browsers send.

The real `m31r serve` (subprocesses on real TCP ports) in front of the shared real daemon.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from test_http import SERVE, Server, free_port

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(("flag", "value", "fix"), [
    ("--allowed-host", "http://box.test:8731", "--allowed-host box.test"),
    ("--allowed-host", "box.test/", "--allowed-host box.test"),
    ("--cors-origin", "localhost:5173", "--cors-origin http://localhost:5173"),
    ("--cors-origin", "http://localhost:5173/app", "--cors-origin http://localhost:5173"),
])
def test_a_host_or_origin_no_request_can_match_is_refused_at_start(tmp_path, flag, value, fix):
    r = subprocess.run([*SERVE, flag, value, "--no-autostart", "--port", str(free_port()), "--socket",
                        str(tmp_path / "none.sock")], capture_output=True, text=True, timeout=30,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 1, r.stderr
    assert f"error: {flag} {value!r} is not" in r.stderr and r.stderr.rstrip().endswith(fix), r.stderr


def test_the_hosts_and_origins_given_are_the_ones_admitted(shared_daemon, tmp_path):
    """A host with its port, and an origin in capitals with a trailing slash, admit the requests that name them (the
    browser sends the origin in lower case); others are still refused."""
    srv = Server(tmp_path, shared_daemon[1], "--allowed-host", "Box.Test:8731", "--cors-origin",
                 "HTTP://LocalHost:5173/")
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            ok = http.get("/v1/models", headers={"host": "box.test:9999", "origin": "http://localhost:5173"})
            assert ok.status_code == 200, ok.text
            assert ok.headers["access-control-allow-origin"] == "http://localhost:5173", ok.headers
            preflight = http.options("/v1/completions", headers={
                "origin": "http://localhost:5173", "access-control-request-method": "POST"})
            assert preflight.status_code == 200, preflight.text
            assert http.get("/v1/models", headers={"host": "other.test"}).json()["error"]["code"] == "forbidden_host"
            other = http.get("/v1/models", headers={"origin": "http://localhost:3000"})
            assert other.status_code == 403 and other.json()["error"]["code"] == "forbidden_origin", other.text
    finally:
        srv.stop()


def test_a_block_cut_at_the_floor_before_a_closer_leaves_it_on_its_own_line() -> None:
    """`/completion`'s editor policy, as the language server's (lsp.completion.shown_suggestion): a block body cut at
    the confidence floor, asked at the start of the `}` line, kept its last line's break off, so accepting it left
    `        a();    }`. The daemon's answer is given (a model's line probabilities cannot be chosen)."""
    from types import SimpleNamespace

    from m31r_http.app import CompletionRenderer
    from m31r_protocol import policy
    from m31r_protocol.messages import Done, Timings, Usage

    text = "fn f() {\n    if x {\n    }\n}\n"
    cursor = text.index("    }\n}")
    plan = policy.plan(text, cursor, policy.Options())
    raw = "        a();\n        b();\n"
    done = Done(id=1, finish_reason="stop", usage=Usage(), timings=Timings(), logprob=-9.5, line_logprob=-0.5,
                logprob_by_line=[-0.5, -9.0])
    r = CompletionRenderer(plan, cursor, 0.05).response(SimpleNamespace(text=raw, done=done, frames=[]))
    assert not r.unsure and r.lines_cut == 1
    assert text[: r.start] + r.text + text[r.end :] == "fn f() {\n    if x {\n        a();\n    }\n}\n"

"""A failure inside `m31r serve` after its daemon request began: the daemon request is cancelled all the same, and
the client gets an answer in its endpoint family's error shape. The app runs in-process (httpx's ASGI transport) in
front of a real daemon on the tiny bundle; the failure itself is injected, a renderer that raises, as no request
should be able to cause one.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from test_http import sse_events

from m31r_http.app import NativeRenderer, OpenAIRenderer, ServeSettings, create_app
from m31r_http.ollama import OllamaRenderer

pytestmark = pytest.mark.timeout(120)


def _boom(*args: object) -> bytes:
    raise RuntimeError("injected")


@pytest.mark.parametrize(("path", "body", "broken"), [
    ("/api/generate", {"model": "m31r", "prompt": "fn main() {\n", "stream": False,
                       "options": {"num_predict": 400}}, (OllamaRenderer, "connected")),
    ("/v1/completions", {"prompt": "fn main() {\n", "max_tokens": 400}, (OpenAIRenderer, "connected")),
    ("/generate", {"prompt": "fn main() {\n", "max_tokens": 400, "stream": True}, (NativeRenderer, "chunk")),
])
def test_a_failure_after_the_daemon_request_began_cancels_it(shared_daemon, monkeypatch, path, body, broken):
    monkeypatch.setattr(*broken, _boom)
    app = create_app(ServeSettings(socket=shared_daemon[1], autostart=False, max_tokens_cap=500))
    svc = app.state.service

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=30) as c:
            r = await c.post(path, json=body)
            client = await svc.upstream.get(5)
            for _ in range(200):  # the daemon answers the Cancel: its Stream leaves the connection's table
                if not client._streams and not svc.admission.taken:
                    break
                await asyncio.sleep(0.05)
            assert client._streams == {} and svc.admission.taken == 0  # and its daemon slot is free again
            await svc.shutdown()
            return r

    r = asyncio.run(go())
    if path.startswith("/api/"):
        assert r.status_code == 500 and r.json() == {"error": "the server hit an internal error: RuntimeError"}
    elif body.get("stream"):  # the stream had begun: it ends with an error event
        assert r.status_code == 200
        event, data = sse_events(r.text)[-1]
        assert event == "error" and json.loads(data)["error"]["code"] == "internal"
    else:
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal"
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in svc.metrics.registry.collect() for s in fam.samples}
    assert samples[("m31r_http_cancelled_total", (("endpoint", path), ("reason", "error")))] == 1
    assert samples[("m31r_http_cancel_outcomes_total", (("outcome", "cancelled"),))] == 1  # it was still running
    assert samples[("m31r_http_requests_total", (("endpoint", path), ("status", str(r.status_code))))] == 1

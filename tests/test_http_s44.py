"""`m31r serve` as tools meet it, session 44's audit: the remote-bind warning only once the server listens, and a body
in another encoding than UTF-8 (a Latin-1 one, as Windows PowerShell 5.1 sends a string, or UTF-16) told so.

The real `m31r serve` (a subprocess on a real TCP port) in front of the shared real daemon.
"""

from __future__ import annotations

import subprocess

import httpx
import pytest
from test_http import SERVE, Server, free_port, healthy_server

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s44", shared_daemon[1])


def test_the_remote_bind_warning_is_said_only_once_the_server_listens(tmp_path):
    """`--host nosuchhost.invalid --allow-remote` printed "is listening on nosuchhost.invalid:..., reachable from other
    machines" just before "cannot listen on ...": a server that never listened said it did. A bind that works still
    warns."""
    r = subprocess.run([*SERVE, "--host", "nosuchhost.invalid", "--allow-remote", "--no-autostart", "--port",
                        str(free_port()), "--socket", str(tmp_path / "none.sock")],
                       capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert r.returncode == 1 and "cannot listen on nosuchhost.invalid" in r.stderr, r.stderr
    assert "is listening on" not in r.stderr, r.stderr
    srv = Server(tmp_path, tmp_path / "none.sock", "--host", "0.0.0.0", "--allow-remote")
    try:
        assert httpx.get(f"{srv.url}/", timeout=10).status_code == 200
    finally:
        srv.stop()
    assert f"warning: m31r serve is listening on 0.0.0.0:{srv.port}" in srv.log.read_text()


OPENAI = '{"model": "m31r", "prompt": "fn caf\u00e9() {", "max_tokens": 2}'
OLLAMA = '{"model": "m31r", "prompt": "fn caf\u00e9() {", "stream": false, "options": {"num_predict": 2}}'


@pytest.mark.parametrize(("path", "text"), [("/v1/completions", OPENAI), ("/api/generate", OLLAMA)])
def test_a_body_that_is_not_utf8_is_a_400_saying_so(server, path, text):
    """A Latin-1 body was "the body is not valid JSON: 'utf-8' codec can't decode byte 0xe9 in position 12" (counted
    in the string, not the body, and no word that the encoding is at fault); a UTF-16 one "invalid character
    (byte 0)". Now each says the body is not UTF-8, and where; the same text in UTF-8 is served."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        headers = {"content-type": "application/json"}
        assert http.post(path, content=text.encode(), headers=headers).status_code == 200
        body = text.encode("latin-1")
        r = http.post(path, content=body, headers=headers)
        assert r.status_code == 400, r.text
        message = r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]
        assert "not UTF-8" in message and f"byte 0xe9 at byte {body.index(0xE9)}" in message, message
        assert message.startswith("prompt: "), message
        if not path.startswith("/api/"):
            assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "bad_json", r.text
        for encoding in ("utf-16", "utf-16-le", "utf-32-be"):
            r = http.post(path, content=text.encode(encoding), headers=headers)
            message = r.json()["error"] if path.startswith("/api/") else r.json()["error"]["message"]
            assert r.status_code == 400 and "UTF-16 or UTF-32" in message, (encoding, r.text)


INFILL = {"input_prefix": "fn main() {\n    let x = ", "input_suffix": "\n}\n", "n_predict": 8, "temperature": 0}


def test_infill_reads_a_stop_string_as_one_sequence_and_null_as_none(server):
    """llama.cpp's server reads `stop` only as an array, passing over a string or null; /infill refused both with a
    400 ("Expected `array`, got `str`"), leaving such a client with no completion. A string is now the one stop
    sequence it names (as OpenAI's and Ollama's APIs read one), null none: each answered as the array form is."""
    with httpx.Client(base_url=server.url, timeout=60) as http:
        def fill(stop: object) -> dict:
            r = http.post("/infill", json={**INFILL, "stop": stop})
            assert r.status_code == 200, r.text
            return r.json()

        plain = http.post("/infill", json=INFILL).json()
        assert fill(None)["content"] == plain["content"] and fill(None)["generation_settings"]["stop"] == []
        stop = plain["content"][1:3] or "\n"  # (a sequence the greedy answer holds: it ends there)
        listed, named = fill([stop]), fill(stop)
        assert named["content"] == listed["content"] and named["generation_settings"]["stop"] == [stop], named
        if plain["content"][1:3]:
            assert listed["content"] != plain["content"], (plain, listed)  # the stop sequence ended it

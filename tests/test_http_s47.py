"""`m31r serve` as OpenAI's and other servers' clients meet it, session 47's audit.

The real `m31r serve` (a subprocess on a real TCP port) in front of the shared real daemon, driven through the real
clients (the `openai` package, httpx).
"""

from __future__ import annotations

import httpx
import openai
import pytest
from test_http import healthy_server

pytestmark = pytest.mark.timeout(120)

CAP = 300  # --max-tokens-cap: above the tiny model's fill-in-the-middle limit, half its context of 512
HALF_CONTEXT = 256


@pytest.fixture(scope="module")
def server(shared_daemon, tmp_path_factory):
    yield from healthy_server(tmp_path_factory, "s47", shared_daemon[1], "--max-tokens-cap", str(CAP))


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_a_model_not_served_is_openais_404(client, server, stream):
    """A `model` not served was a 400, so the OpenAI client raised BadRequestError where OpenAI's own 404
    `model_not_found` raises NotFoundError (and GET /v1/models/{model} answered 404 already); the schema says so."""
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-3.5-turbo-instruct", prompt="fn", max_tokens=2, stream=stream)
    assert e.value.status_code == 404 and e.value.code == "model_not_found" and e.value.param == "model"
    assert e.value.type == "invalid_request_error" and "'m31r'" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-3.5-turbo-instruct")
    assert client.completions.create(model="m31r", prompt="fn", max_tokens=2).usage.completion_tokens <= 2
    doc = httpx.get(f"{server.url}/openapi.json", timeout=30).json()
    assert "model_not_found" in doc["paths"]["/v1/completions"]["post"]["responses"]["404"]["description"]


@pytest.mark.parametrize("body", [
    {"prompt": "fn main() {", "suffix": "\n}\n"},
    {"prompt": "<fim_prefix>fn main() {<fim_suffix>\n}\n<fim_middle>"},  # Continue's openai provider's layout
])
def test_a_fim_max_tokens_the_server_capped_is_served(client, body):
    """A fill-in-the-middle /v1/completions whose max_tokens (Continue's 4096) the server capped to --max-tokens-cap
    was then refused by the daemon, 400 "max_tokens 300 is more than a fim completion may have": a figure the client
    never sent, for a request the server had undertaken to cap. It is capped to the FIM limit too; a figure the client
    chose within the cap is still refused, as the schema's FIM maximum says."""
    c = client.completions.create(model="m31r", max_tokens=4096, **body)
    assert c.usage.completion_tokens <= HALF_CONTEXT and c.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="m31r", max_tokens=HALF_CONTEXT + 1, **body)
    assert "half its context" in e.value.message

"""Settings problems reach the user: `window/logMessage` alone went where Neovim and Helix users rarely look, so each
problem is also shown (`window/showMessage`, a warning), once per distinct problem in a session. Real server, real
daemon (test_lsp's fixtures), nothing mocked."""

from __future__ import annotations

import asyncio

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp


async def settled(session) -> None:
    """Once the server answered a request sent after the last notification (its messages went out before)."""
    await session.stats()
    await asyncio.sleep(0.05)


def shown(session) -> list[str]:
    return [m.message for m in session.client.messages if m.type == t.MessageType.Warning]


async def test_settings_problems_are_shown_once_each(lsp):
    s = await lsp({**NOISE, "debounceMs": -5, "nonsense": 1})
    await settled(s)
    first = shown(s)
    assert len(first) == 2
    assert first[0].startswith("m31r.debounceMs: expected 0..5000 (got -5)") and "m31r.nonsense" in first[1]
    logs = len(s.client.log_messages)

    # The same bad values again (an editor sends its whole configuration on every change), the value kept meanwhile
    # changed: logged again, not shown again.
    for debounce in (40, -5, 60):
        s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
            settings={"m31r": {"debounceMs": debounce, "nonsense": 1}}))
    await settled(s)
    st = await s.stats()
    assert st["settings"]["debounce_ms"] == 60
    assert shown(s) == first
    logged = [m.message for m in s.client.log_messages[logs:]]
    assert "m31r.debounceMs: expected 0..5000 (got -5); keeping 40" in logged and logged.count(
        "m31r.nonsense: unknown setting, ignored") == 3

    # A new problem (another key, or another bad value of the same key) is shown, once.
    for _ in range(2):
        s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(
            settings={"m31r": {"debounceMs": -7, "multiline": "sometimes"}}))
    await settled(s)
    new = shown(s)[len(first):]
    assert len(new) == 2 and new[0].startswith("m31r.debounceMs: expected 0..5000 (got -7)")
    assert new[1].startswith("m31r.multiline: expected one of auto, always, never (got 'sometimes')")

    # A section that is not an object: shown once too.
    for _ in range(2):
        s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": 75}))
    await settled(s)
    assert [m for m in shown(s)[len(first) + 2:] if m.startswith("m31r: expected an object of settings")] == [
        shown(s)[-1]]
    assert len(shown(s)) == len(first) + 3


async def test_good_settings_show_nothing(lsp):
    s = await lsp({**NOISE, "debounceMs": 10})
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": {"maxTokens": 9}}))
    await settled(s)
    assert shown(s) == [] and (await s.stats())["settings"]["max_tokens"] == 9

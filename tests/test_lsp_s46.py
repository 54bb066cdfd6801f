"""The language server's settings, pulled: a real m31r lsp against a real daemon (test_lsp's fixtures)."""

from __future__ import annotations

import pytest
import test_lsp
from lsprotocol import types as t
from test_lsp import NOISE, _async, _settings_are, until

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp


async def test_a_pulled_configuration_without_our_section_resets_what_was_pushed(lsp):
    """A client that answers workspace/configuration with null for "m31r" holds no such section any more (the user
    removed it): as a whole configuration, every key goes back to its initializationOptions value or default. The
    values an earlier payload set were kept instead, against the module's own rule."""
    s = await lsp({**NOISE, "maxLines": 3})
    # Connected (in the background, from initialize) before the settings change: on a loaded machine the first
    # connection can still be under way at the end, and the check there is that the reset kept this one.
    await until(lambda: _async(any(st["state"] == "ready" for st in s.status)))
    s.client.workspace_did_change_configuration(
        t.DidChangeConfigurationParams(settings={"m31r": {"maxTokens": 9, "maxLines": 5, "beams": 2}}))
    await until(lambda: _settings_are(s, max_tokens=9, max_lines=5, beams=2), timeout=10)
    s.client.set_configuration({})  # no m31r section: the client answers null for it
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=None))
    await until(lambda: _settings_are(s, max_tokens=64, max_lines=3, beams=None), timeout=10)
    st = await s.stats()
    assert st["daemon"]["state"] == "ready"  # still the initializationOptions' socket

"""`m31r lsp`: invoked requests and the confidence floor, answers computed under other settings, settings keys the
client removed, and an audit against LSP 3.18 and real clients. A pytest-lsp client drives the real server process,
which talks to a real m31rd on the tiny random-weight bundle (test_lsp's fixtures). Nothing is mocked."""

from __future__ import annotations

import math

import pytest
import test_lsp
from lsp_stdio import URI, Stdio, inline
from lsprotocol import types as t
from test_lsp import NOISE, RUST, _settings_are, until

from m31r_lsp import settings as settings_mod
from m31r_lsp.settings import EditorSettings

pytestmark = pytest.mark.timeout(120)
daemon, lsp = test_lsp.daemon, test_lsp.lsp  # the fixtures, shared with test_lsp

OFFSET = RUST.index("    counts\n}") + len("    counts")


def configure(s, section: dict) -> None:
    """A pushed didChangeConfiguration with `section` as the client's whole m31r configuration."""
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings={"m31r": section}))


# -- 1. an invoked request and the confidence floor ---------------------------------------------------------------


async def test_an_invoked_unsure_multi_line_suggestion_shows_its_first_line(lsp):
    """The user asked (Invoked), so an unsure suggestion shows, but only its first line: the lines after it are cut at
    the floor as ever (the probability of the lines so far only falls), so the user reads one unsure line, not twelve.
    The daemon, asked again without the floor (it had ended the answer where the floor fell), wrote more than that
    line."""
    s = await lsp({**NOISE, "minProbability": 0.5, "maxTokens": 48, "seed": 13})  # (a seed that writes two lines)
    s.open(RUST)
    res = await s.inline(OFFSET, invoked=True)
    st = await s.stats()
    assert st["lastFim"]["min_probability"] is None and st["unsure_invoked"] == 1 and st["daemon_requests"] == 2
    assert st["lastLogprobByLine"][0] < math.log(0.5)
    assert "\n" in st["lastRaw"].rstrip("\n") and st["lines_cut"] == 1  # several lines written, cut to the first
    assert len(res.items) == 1 and "\n" not in res.items[0].insert_text.strip("\n")


# -- 2. an answer computed under other settings -------------------------------------------------------------------


@pytest.mark.parametrize("change", [{"maxTokens": 9}, {"maxLines": 1}, {"multiline": "never"},
                                    {"minProbability": 0.5}, {"seed": 8}])
async def test_a_settings_change_is_not_answered_with_the_last_settings_suggestion(lsp, change):
    """The same request at the same cursor, after a settings change that changes what a completion is: the finished
    job's suggestion (for the old settings) answered it, without asking the daemon, until the cursor moved. Now the
    job is keyed by the settings' shape and the request computes a new one."""
    s = await lsp(NOISE)
    s.open(RUST)
    first = await s.inline(OFFSET, invoked=False)
    assert len(first.items) == 1
    configure(s, change)
    await until(lambda: _settings_are(s, **{settings_mod.FIELDS[k][0]: v for k, v in change.items()}), timeout=10)
    await s.inline(OFFSET, invoked=False)
    st = await s.stats()
    assert st["daemon_requests"] == 2 and st.get("joined", 0) == 0
    if "maxTokens" in change:
        assert st["lastFim"]["max_tokens"] == 9
    if "multiline" in change:
        assert st["lastFim"]["stop"] == ["\n"]
    if "minProbability" in change:
        assert st["lastFim"]["min_probability"] == 0.5 and st["unsure"] == 1


async def test_a_change_of_when_to_ask_still_shares_the_finished_suggestion(lsp):
    """debounceMs decides when a completion is asked for, not what it is: the finished job still answers."""
    s = await lsp(NOISE)
    s.open(RUST)
    first = await s.inline(OFFSET, invoked=False)
    configure(s, {"debounceMs": 5})
    await until(lambda: _settings_are(s, debounce_ms=5), timeout=10)
    again = await s.inline(OFFSET, invoked=False)
    st = await s.stats()
    assert st["daemon_requests"] == 1 and st["joined"] == 1 and again.items == first.items


async def test_typing_through_a_suggestion_shown_under_other_settings_asks_the_daemon(lsp):
    """A suggestion shown under multiline "always", then "never": typing its first character answered with the rest
    of the old multi-line suggestion (typed-through) without a round trip. Now the shown suggestion is dropped with the
    settings it was made under, and the daemon is asked for a single line."""
    s = await lsp({**NOISE, "maxTokens": 48})
    s.open(RUST)
    cursor = len(RUST) - 1  # the blank line's end at the file's end: multi-line with "always"
    first = await s.inline(cursor, invoked=False)
    assert len(first.items) == 1
    shown = first.items[0].insert_text
    assert len(shown.rstrip()) >= 2
    configure(s, {"multiline": "never"})
    await until(lambda: _settings_are(s, multiline="never"), timeout=10)
    s.edit(cursor, cursor, shown[0])
    res = await s.inline(cursor + 1, invoked=False)
    st = await s.stats()
    assert st.get("typed_through", 0) == 0 and st["daemon_requests"] == 2 and st["lastFim"]["stop"] == ["\n"]
    assert all("\n" not in item.insert_text for item in res.items)


# -- 3. a settings key the client removed -------------------------------------------------------------------------


async def test_a_key_removed_from_the_configuration_goes_back_to_its_default(lsp):
    """didChangeConfiguration carries the client's whole m31r section (VS Code, Neovim, Helix and Sublime send it so):
    a key it no longer holds kept the value an earlier payload set. Now it goes back to its default, or to its
    initializationOptions value, what the session started with; `socket` to the command line's."""
    s = await lsp({**NOISE, "maxLines": 3})  # (the fixture adds socket and minProbability 0 to initializationOptions)
    configure(s, {"maxTokens": 9, "maxLines": 5, "beams": 2})
    await until(lambda: _settings_are(s, max_tokens=9, max_lines=5, beams=2), timeout=10)
    configure(s, {"beams": 2})  # maxTokens and maxLines removed
    await until(lambda: _settings_are(s, max_tokens=64, max_lines=3, beams=2), timeout=10)
    # The pull model: the client's answer to workspace/configuration is its whole section too.
    s.client.set_configuration({"multiline": "never"}, section="m31r")
    s.client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=None))
    await until(lambda: _settings_are(s, multiline="never", beams=None, temperature=1.0), timeout=10)
    st = await s.stats()
    assert st["settings"]["min_probability"] == 0 and st["daemon"]["state"] == "ready"  # still the init's socket


def test_removed_keys_take_the_base_and_bad_values_keep_the_current() -> None:
    """settings.apply with a base: a key left out takes the base's value; a bad one keeps the current value (the
    user's last good one), as it always has; initializationOptions (no base) leave other keys as they are."""
    base = EditorSettings(max_tokens=20, socket="/cmdline.sock")
    current = EditorSettings(max_tokens=30, max_lines=4, debounce_ms=9, socket="/set.sock")
    new, problems = settings_mod.apply(current, {"m31r": {"maxLines": 0}}, EditorSettings(socket="/cmdline.sock"),
                                       base)
    assert (new.max_tokens, new.max_lines, new.debounce_ms, new.socket) == (20, 4, 75, "/cmdline.sock")
    assert problems == ["m31r.maxLines: expected 1..200 (got 0); keeping 4"]
    new, _ = settings_mod.apply(current, {"maxLines": 6})
    assert (new.max_tokens, new.max_lines, new.debounce_ms) == (30, 6, 9)
    assert settings_mod.apply(current, {"editor": {"tabSize": 4}}, None, base)[0] == current  # not our section


# -- the audit: LSP's lifecycle and documents closed under a request ----------------------------------------------

INIT = {"capabilities": {}, "initializationOptions": {"m31r": {"debounceMs": 0, "minProbability": 0}}}
TEXT = "fn main() {\n    let x = \n}\n"


def _open(s: Stdio, text: str = TEXT) -> None:
    s.send("textDocument/didOpen", {"textDocument": {"uri": URI, "languageId": "rust", "version": 1, "text": text}})


async def test_a_second_initialize_is_refused_and_the_documents_are_kept(daemon):
    """LSP: initialize is sent once. A second one was answered as the first, and pygls made a new workspace for it:
    every open document was dropped without a word (requests for them answered empty until each was reopened). Now it
    is answered InvalidRequest and the session goes on."""
    s = await Stdio.spawn(daemon)
    s.send("initialize", INIT, msg_id=1)
    await s.answer(1)
    s.send("initialized", {})
    _open(s)
    s.send("initialize", INIT, msg_id=2)
    again = await s.answer(2)
    assert again["error"]["code"] == -32600 and "already initialized" in again["error"]["message"]
    await s.request("textDocument/inlineCompletion", inline(1, 12))
    stats = (await s.request("m31r/stats", {}))["result"]
    assert stats["daemon_requests"] == 1 and stats["lastFim"]["document"] == URI  # the document is still open
    assert await s.end() == (0, "")


async def test_a_document_closed_and_reopened_under_a_pending_request_is_not_completed_from_its_old_text(daemon):
    """didClose while a request waits (its debounce): the request answers empty and nothing reaches the daemon, even
    when the document is reopened at once with other text and the same version (1), which the version check alone
    would take for the text the request was made in."""
    s = await Stdio.spawn(daemon)
    s.send("initialize", {**INIT, "initializationOptions": {"m31r": {"debounceMs": 1500, "debounceMode": "fixed"}}},
           msg_id=1)
    await s.answer(1)
    s.send("initialized", {})
    _open(s)
    s.send("textDocument/inlineCompletion", {**inline(1, 12), "context": {"triggerKind": 2}}, msg_id=2)
    await s.request("m31r/stats", {})  # the request has arrived and waits
    s.send("textDocument/didClose", {"textDocument": {"uri": URI}})
    _open(s, "// reopened\n" + TEXT)
    assert (await s.answer(2))["result"] == {"items": []}
    stats = (await s.request("m31r/stats", {}))["result"]
    assert stats.get("daemon_requests", 0) == 0 and stats["lastFim"] is None
    assert await s.end() == (0, "")

"""The VS Code extension's settings contract with the real `m31r lsp`.

The extension validates every setting itself (editors/vscode/src/settings.ts: clamped to its ranges, enums
normalised) and sends the result as `initializationOptions` and `settings.m31r`. A value it lets through that the
server refused would be kept at the server's previous value with a warning pop-up; a value the server accepts but the
extension clamped could never be set from VS Code. Here the extension's own code (out/settings.js, run by node) makes
the payloads, from the defaults, both ends of every range and every enum value, and the real server applies them: it
must take each as sent, with no settings problem reported, and refuse one step past each end of the extension's
ranges. `make test` builds out/ (`npm test` compiles) before pytest runs; without node or out/ this is skipped.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from lsp_stdio import Stdio

from m31r_lsp import settings as lsp_settings

EXT = Path(__file__).resolve().parent.parent / "editors" / "vscode"
SETTINGS_JS = EXT / "out" / "settings.js"

pytestmark = [
    pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed"),
    pytest.mark.skipif(not SETTINGS_JS.is_file(),
                       reason="editors/vscode/out/settings.js missing: run `npm test` there (make test-vscode does)"),
    pytest.mark.timeout(120),
]

HOME = "/home/m31r-test"

# The cases, from the extension's own exported ranges and enums, each validated by its toServerSettings.
CASES_JS = r"""
const s = require(process.argv[1]);
const cases = [{}, { enable: false, projectContext: true }, { socket: '~/m31r-test.sock' }, { beams: null }];
for (const [key, r] of Object.entries(s.RANGES)) cases.push({ [key]: r.minimum }, { [key]: r.maximum });
cases.push({ beams: s.BEAMS_RANGE.minimum }, { beams: s.BEAMS_RANGE.maximum });
cases.push({ minProbability: 0 }, { minProbability: 1 });
for (const m of s.DEBOUNCE_MODES) cases.push({ debounceMode: m.toUpperCase() });
for (const m of s.MULTILINE_MODES) cases.push({ multiline: ` ${m} ` });
// What a user may type that the extension repairs: what it sends instead must suit the server too.
cases.push({ maxTokens: 99999, deadlineMs: 0, debounceMs: '12.6', beams: 0, minProbability: 7, multiline: 'often' });
const out = cases.map((c) => ({ input: c, ...s.toServerSettings(c, process.argv[2]) }));
console.log(JSON.stringify({ cases: out, ranges: s.RANGES, beams: s.BEAMS_RANGE, defaults: s.DEFAULTS }));
"""


def extension() -> dict:
    r = subprocess.run(["node", "-e", CASES_JS, str(SETTINGS_JS), HOME], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def expected(sent: dict, sock: Path) -> dict:
    """The server's settings (snake_case fields) that `sent` should give: an empty socket is the command line's."""
    out = {}
    for key, value in sent.items():
        field = lsp_settings.FIELDS[key][0]
        out[field] = str(sock) if key == "socket" and value == "" else value
    return out


def problems(s: Stdio) -> list[str]:
    """The settings problems the server reported (its `m31r.<key>: ...` and `m31r: expected ...` messages)."""
    return [m for m in s.shown() + s.logged() if m.startswith(("m31r.", "m31r: expected"))]


async def test_every_value_the_extension_sends_is_taken_by_the_real_server_as_sent(tmp_path: Path) -> None:
    ext = extension()
    sock = tmp_path / "none" / "m31rd.sock"  # no daemon: applying settings needs none
    s = await Stdio.spawn(sock)
    try:
        defaults = ext["cases"][0]["value"]
        await s.request("initialize", {"processId": None, "rootUri": None, "capabilities": {},
                                       "initializationOptions": defaults})
        s.send("initialized", {})
        st = (await s.request("m31r/stats", None))["result"]["settings"]
        want = expected(defaults, sock)
        assert {k: st[k] for k in want} == want
        for case in ext["cases"]:
            sent = case["value"]
            # Every key, every time: a setting the user removes goes back to its default on the server too.
            assert set(sent) == set(ext["defaults"]), case
            s.send("workspace/didChangeConfiguration", {"settings": {"m31r": sent}})
            st = (await s.request("m31r/stats", None))["result"]["settings"]
            want = expected(sent, sock)
            assert {k: st[k] for k in want} == want, case
        assert problems(s) == []
    finally:
        await s.end()
    # The last case really was repaired by the extension (else it proved nothing about repaired values): all but
    # debounceMs, which is rounded without a word, were warned about.
    assert len(ext["cases"][-1]["warnings"]) == 5 and ext["cases"][-1]["value"]["debounceMs"] == 13, ext["cases"][-1]


def test_the_extension_ranges_are_the_servers() -> None:
    """Both ends of each extension range pass the server's own validator and one step past them does not: the
    extension neither sends what the server refuses nor clamps away what it would take."""
    ext = extension()
    for key, r in {**ext["ranges"], "beams": ext["beams"]}.items():
        check = lsp_settings.FIELDS[key][1]
        assert (check(r["minimum"]), check(r["maximum"])) == (r["minimum"], r["maximum"]), key
        for outside in (r["minimum"] - 1, r["maximum"] + 1):
            with pytest.raises(ValueError):
                check(outside)
    for outside in (-0.001, 1.001):
        with pytest.raises(ValueError):
            lsp_settings.FIELDS["minProbability"][1](outside)


def test_the_extension_defaults_are_the_servers() -> None:
    """The defaults VS Code's settings UI shows are the ones the server (and so every other editor) uses."""
    ext = extension()
    base = lsp_settings.EditorSettings()
    for key, value in ext["defaults"].items():
        server = getattr(base, lsp_settings.FIELDS[key][0])
        assert (server or "" if key == "socket" else server) == value, key

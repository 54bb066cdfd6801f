"""editors/sublime and editors/kate against their clients' config formats, the server's settings and a real server.

Neither editor runs headless here, so the keys each client reads are written down from its source, and a short LSP
session (the configured argv, the configured settings delivered the way the client delivers them) stands in for the
editor. A key a client does not read is silently ignored by it: the key sets catch a misspelling.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lsprotocol import types as t
from pytest_lsp import ClientServerConfig, client_capabilities

from m31r_lsp import settings

pytestmark = pytest.mark.timeout(120)

EDITORS = Path(__file__).resolve().parent.parent / "editors"
SUBLIME = EDITORS / "sublime"
KATE = EDITORS / "kate"

# sublimelsp/LSP 7ffc7211d0c07317f7d6a9b35601e2e0360d85b8 (2.13.0), plugin/core/types.py: the keys
# ClientConfig.from_dict reads from a LanguageServers.sublime-settings entry. Its "initializationOptions" fallback is
# left out: deprecated since 2.9 in favour of "initialization_options".
SUBLIME_KEYS = {"selector", "priority_selector", "schemes", "command", "tcp_port", "auto_complete_selector", "enabled",
                "initialization_options", "settings", "env", "experimental_capabilities", "disabled_capabilities",
                "file_watcher", "semantic_tokens", "diagnostics_mode", "markdown_language_map", "syntax_map",
                "path_maps"}
# KDE/kate 8bb02e9c7aeb05380caf29b20577b5091f515b94, addons/lspclient/lspclientservermanager.cpp (_findServer,
# updateServerConfig) and apps/lib/exec_utils.cpp ("exec"): the keys of a `servers` entry, and the top-level ones.
KATE_SERVER_KEYS = {"use", "root", "rootIndicationFileNames", "rootIndicationFilePatterns", "useWorkspace", "command",
                    "commandDebug", "settings", "url", "path", "completionTriggerCharacters",
                    "signatureTriggerCharacters", "initializationOptions", "allowExperimental", "highlightingModeRegex",
                    "documentLanguageId", "exec"}
KATE_TOP_KEYS = {"servers", "global"}

RUST = "fn add(a: i32, b: i32) -> i32 {\n    a + b\n}\n\nfn main() {\n    let x = add(1, 2);\n    \n}\n"


def _outside_strings(text: str, step) -> str:
    """`text` with `step(text, i)` -> (kept, next i) applied outside JSON strings, which are copied as they are."""
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == '"':
            j = i + 1
            while text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        else:
            kept, i = step(text, i)
            out.append(kept)
    return "".join(out)


def _comment(text: str, i: int) -> tuple[str, int]:
    if text.startswith("//", i):
        end = text.find("\n", i)
        return "", len(text) if end < 0 else end
    if text.startswith("/*", i):
        return " ", text.index("*/", i) + 2
    return text[i], i + 1


def _trailing_comma(text: str, i: int) -> tuple[str, int]:
    if text[i] == "," and text[i + 1:].lstrip()[:1] in ("}", "]"):
        return "", i + 1
    return text[i], i + 1


def strip_jsonc(text: str) -> str:
    """JSON from Sublime's JSON dialect: `//` and `/* */` comments and trailing commas removed, strings untouched."""
    return _outside_strings(_outside_strings(text, _comment), _trailing_comma)


def test_strip_jsonc_keeps_strings_and_drops_comments_and_trailing_commas():
    src = '{"a": "x // y, /* z */",  // note\n "b": [1, 2, /* c */],\n /* d */ "c": {"e": 1,},}'
    assert json.loads(strip_jsonc(src)) == {"a": "x // y, /* z */", "b": [1, 2], "c": {"e": 1}}


def sublime() -> dict:
    return json.loads(strip_jsonc((SUBLIME / "LanguageServers.sublime-settings").read_text()))


def kate() -> dict:
    return json.loads((KATE / "settings.json").read_text())  # Kate reads it with QJsonDocument: strict JSON


def test_sublime_entry_uses_lsp_keys_and_runs_m31r_lsp_on_rust():
    config = sublime()
    assert set(config) == {"m31r"}  # one entry, merged into the user's LanguageServers.sublime-settings
    entry = config["m31r"]
    assert set(entry) <= SUBLIME_KEYS, set(entry) - SUBLIME_KEYS
    assert entry["enabled"] is True  # from_dict defaults "enabled" to False
    assert entry["selector"] == "source.rust"
    assert entry["command"][:2] == ["m31r", "lsp"]


def test_kate_entry_uses_kate_keys_and_runs_m31r_lsp_on_rust():
    config = kate()
    assert set(config) <= KATE_TOP_KEYS, set(config) - KATE_TOP_KEYS
    assert set(config["servers"]) == {"rust"}  # Kate's built-in entry for Rust documents, merged over
    entry = config["servers"]["rust"]
    assert set(entry) <= KATE_SERVER_KEYS, set(entry) - KATE_SERVER_KEYS
    assert entry["command"][:2] == ["m31r", "lsp"]
    assert entry["highlightingModeRegex"] == "^Rust$"


def sublime_settings() -> dict:
    return sublime()["m31r"]["settings"]


def kate_settings() -> dict:
    return kate()["servers"]["rust"]["initializationOptions"]


@pytest.mark.parametrize(("payload", "readme"), [(sublime_settings, SUBLIME / "README.md"),
                                                 (kate_settings, KATE / "README.md")], ids=["sublime", "kate"])
def test_settings_are_the_servers_defaults_and_documented(payload, readme):
    raw = payload()
    table = settings.section(raw)
    assert table is not None and set(table) <= set(settings.FIELDS), set(table or {}) - set(settings.FIELDS)
    new, problems = settings.apply(settings.EditorSettings(), raw)
    assert problems == []
    assert new == settings.EditorSettings()  # "these are the defaults", as the files say
    text = readme.read_text()
    for key in [*table, "socket"]:
        assert f"| `{key}` |" in text, key


def argv(command: list[str], daemon: Path, path: str | None = None) -> list[str]:
    """The configured command, found the way the editor finds it (on `path`; by default PATH with this venv's bin
    first), pointed at the test daemon and kept from starting another."""
    path = path or os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    exe = shutil.which(command[0], path=path)
    assert exe, f"{command[0]} not on PATH"
    return [exe, *command[1:], "--socket", str(daemon), "--no-autostart"]


async def session(command: list[str], daemon: Path, init_options, did_change_settings,
                  path: str | None = None) -> list[str]:
    """initialize (with init_options), initialized, didChangeConfiguration (if the client sends one), didOpen a Rust
    document, one completion request, shutdown and exit. Returns the server's log and showMessage lines."""
    client = await ClientServerConfig(server_command=argv(command, daemon, path)).start()
    try:
        init = await client.initialize_session(t.InitializeParams(
            capabilities=client_capabilities("visual-studio-code"), initialization_options=init_options))
        assert init.server_info.name == "m31r-lsp" and init.capabilities.completion_provider is not None
        if did_change_settings is not None:
            client.workspace_did_change_configuration(t.DidChangeConfigurationParams(settings=did_change_settings))
        uri = "file:///work/src/main.rs"
        client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=uri, language_id="rust", version=1, text=RUST)))
        line = RUST.split("\n").index("    ")
        res = await client.text_document_completion_async(t.CompletionParams(
            text_document=t.TextDocumentIdentifier(uri), position=t.Position(line, 4)))
        assert isinstance(res, t.CompletionList)
        stats = await client.protocol.send_request_async("m31r/stats", {})
        assert stats.daemon_requests == 1  # the request reached the daemon: the configured command is the server
        want, _ = settings.apply(settings.EditorSettings(socket=str(daemon), autostart=False), init_options)  # argv()
        want, _ = settings.apply(want, did_change_settings)
        assert stats.settings._asdict() == dataclasses.asdict(want)  # what the server runs with: the file's settings
    finally:
        await client.shutdown_session()
        await client.stop()
    return [m.message for m in client.log_messages] + [m.message for m in client.messages]


async def test_sublime_command_serves_a_session(shared_daemon):
    """LSP sends `initialization_options` with initialize, then `settings` as didChangeConfiguration right after
    `initialized` (Session._maybe_send_did_change_configuration)."""
    entry = sublime()["m31r"]
    messages = await session(entry["command"], shared_daemon[1], entry.get("initialization_options"),
                             entry.get("settings"))
    assert not [m for m in messages if "m31r." in m], messages  # no setting rejected or unknown


async def test_kate_command_serves_a_session(shared_daemon):
    """Kate sends `initializationOptions` with initialize, then `settings` (when set) as didChangeConfiguration once
    the server runs (LSPClientServerManagerImpl::onStateChanged)."""
    entry = kate()["servers"]["rust"]
    messages = await session(entry["command"], shared_daemon[1], entry.get("initializationOptions"),
                             entry.get("settings"))
    assert not [m for m in messages if "m31r." in m], messages


async def test_readme_puts_m31r_on_path_for_the_editors(shared_daemon, tmp_path):
    """editors/README.md's install step, run as written (less its `make install`, done: the venv this test runs in),
    puts a `m31r` on a PATH that holds no virtual environment, and the editors' configured command serves a session
    from there. Before it, the READMEs said `make install` puts `m31r` on PATH: it leaves it in `.venv/bin`."""
    text = (EDITORS / "README.md").read_text()
    (line,) = [x for x in text.splitlines() if "ln -sf" in x]
    assert line.startswith("make install && "), line
    venv_m31r = EDITORS.parent / ".venv" / "bin" / "m31r"  # Makefile: BIN := .venv/bin
    assert venv_m31r.exists(), "make install builds .venv/bin/m31r"
    home = tmp_path / "home"
    home.mkdir()
    system_path = os.pathsep.join(p for p in ("/usr/local/bin", "/usr/bin", "/bin") if Path(p).is_dir())
    r = subprocess.run(["sh", "-c", line.removeprefix("make install && ")], cwd=EDITORS.parent,
                       env={"HOME": str(home), "PATH": system_path, "PWD": str(EDITORS.parent)},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    path = os.pathsep.join([str(home / ".local" / "bin"), system_path])
    assert shutil.which("m31r", path=path) == str(home / ".local" / "bin" / "m31r")  # the README's link, found first
    entry = kate()["servers"]["rust"]
    messages = await session(entry["command"], shared_daemon[1], entry.get("initializationOptions"), None, path)
    assert not [m for m in messages if "m31r." in m], messages

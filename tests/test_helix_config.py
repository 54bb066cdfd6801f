"""editors/helix/languages.toml against Helix's config schema and the server's settings.

Helix is not installed here, so its schema is written down from its source (helix-core/src/syntax/config.rs:
`LanguageServerConfiguration`, `LanguageServerFeature`, kebab-case): an unknown key in a `[language-server.*]` table
is silently ignored by Helix, and a misspelt feature name makes it reject the whole languages.toml.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from m31r_lsp import settings

HELIX = Path(__file__).resolve().parent.parent / "editors" / "helix"
SERVER_KEYS = {"command", "args", "environment", "config", "timeout", "required-root-patterns"}
FEATURES = {"format", "goto-declaration", "goto-definition", "goto-type-definition", "goto-reference",
            "goto-implementation", "signature-help", "hover", "document-highlight", "completion", "code-action",
            "workspace-command", "document-symbols", "workspace-symbols", "diagnostics", "pull-diagnostics",
            "rename-symbol", "inlay-hints", "document-colors"}


def load() -> dict:
    return tomllib.loads((HELIX / "languages.toml").read_text())


def test_language_server_table_uses_helix_keys_and_runs_m31r_lsp():
    server = load()["language-server"]["m31r"]
    assert set(server) <= SERVER_KEYS, set(server) - SERVER_KEYS
    assert server["command"] == "m31r" and server["args"][0] == "lsp"


def test_rust_keeps_rust_analyzer_first_and_m31r_completes_only():
    (rust,) = [lang for lang in load()["language"] if lang["name"] == "rust"]
    assert set(rust) == {"name", "language-servers"}  # merged into Helix's own rust entry: nothing else overridden
    servers = rust["language-servers"]
    assert servers[0] == "rust-analyzer"  # the list replaces Helix's default one: rust-analyzer must stay in it
    (m31r,) = [s for s in servers if isinstance(s, dict) and s.get("name") == "m31r"]
    assert set(m31r) <= {"name", "only-features", "except-features"}
    assert set(m31r["only-features"]) <= FEATURES and m31r["only-features"] == ["completion"]


def test_config_table_is_the_servers_defaults_and_documented():
    config = load()["language-server"]["m31r"]["config"]
    new, problems = settings.apply(settings.EditorSettings(), config)
    assert problems == []
    assert new == settings.EditorSettings()  # "these are the defaults", as the file says
    readme = (HELIX / "README.md").read_text()
    for key in [*config, "socket"]:
        assert f"| `{key}` |" in readme, key

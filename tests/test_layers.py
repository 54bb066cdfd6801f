"""Imports go one way, downward (README "Layout"):

    core       m31r            model, engine, bundle, tokenizer, fim, sampling, quant, native, training
    protocol   m31r_protocol   messages, framing, the client, the editor policy, the JSON log format
    daemon     m31rd           may import core and protocol
    front ends m31r_lsp, m31r_http   may import protocol (never torch, the core or the daemon), not each other
    CLI        m31r.cli (and its m31r.cli_* modules), its fast path m31r.entry, and m31r.doctor (the `m31r doctor`
               command): anything

One crossing is allowed: training's samples use the protocol's choice of project-context snippets
(m31r_protocol.context), so that the model trains on what front ends send.

Every import statement counts, at the top of a module or inside a function, parsed with ast (nothing is imported).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FOLDERS = {"m31r": "m31r", "m31rd": "m31rd", "protocol": "m31r_protocol", "lsp": "m31r_lsp", "httpd": "m31r_http"}
PROJECT = set(FOLDERS.values())
CLI = {"m31r.cli", "m31r.cli_common", "m31r.cli_bundle", "m31r.cli_train", "m31r.entry", "m31r.doctor"}
CROSSINGS = {("m31r.train.samples", "m31r_protocol.context")}
ALLOWED = {
    "m31r": {"m31r"},
    "m31r_protocol": {"m31r_protocol"},
    "m31rd": {"m31rd", "m31r", "m31r_protocol"},
    "m31r_lsp": {"m31r_lsp", "m31r_protocol"},
    "m31r_http": {"m31r_http", "m31r_protocol"},
}


def imported(source: str) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a module's source."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def violations(root: Path) -> list[str]:
    found = []
    for folder, package in FOLDERS.items():
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root / folder).with_suffix("")
            module = ".".join([package, *rel.parts]).removesuffix(".__init__")
            if module in CLI:
                continue
            for line, name in imported(path.read_text()):
                top = name.split(".")[0]
                if top in PROJECT and top not in ALLOWED[package] and (module, name) not in CROSSINGS:
                    found.append(f"{path.relative_to(root)}:{line}: {module} ({package}) imports {name}")
    return found


def test_lower_layers_never_import_higher_ones() -> None:
    assert violations(REPO) == []


@pytest.mark.parametrize(("folder", "source"), [
    ("m31r", "def f():\n    from m31rd.server import Daemon\n"),  # core → daemon, even inside a function
    ("protocol", "import m31r.engine\n"),  # protocol → core
    ("lsp", "from m31r_http import app\n"),  # one front end → another
    ("httpd", "from m31rd.main import setup_logging\n"),  # front end → daemon
    ("m31rd", "from m31r_lsp import server\n"),  # daemon → front end
])
def test_the_check_catches_an_upward_import(tmp_path: Path, folder: str, source: str) -> None:
    for f in FOLDERS:
        (tmp_path / f).mkdir()
    (tmp_path / folder / "bad.py").write_text(source)
    [problem] = violations(tmp_path)
    assert problem.startswith(f"{folder}/bad.py:")


def test_the_cli_may_import_anything(tmp_path: Path) -> None:
    for f in FOLDERS:
        (tmp_path / f).mkdir()
    (tmp_path / "m31r" / "cli.py").write_text("import m31rd.main, m31r_lsp.server, m31r_http.server\n")
    assert violations(tmp_path) == []


def test_the_front_ends_and_the_protocol_never_import_torch() -> None:
    modules = ["m31r_protocol", "m31r_lsp", "m31r_http", "m31r_protocol.client", "m31r_protocol.policy",
               "m31r_protocol.logs", "m31r_protocol.reconnect", "m31r_lsp.server", "m31r_http.app",
               "m31r_http.ollama", "m31r_http.server"]
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "bad = sorted(n for n in sys.modules if n.split('.')[0] in {'torch', 'numpy', 'm31r', 'm31rd'})\n"
            "sys.exit(f'imported: {bad}' if bad else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr + proc.stdout

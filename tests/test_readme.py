"""The README tells the truth about the CLI: every option of every `m31r` command is named in it, every flag it (or a
document under docs/) writes for `m31r` exists, every environment variable they name is read and every one the code
reads is named, and every repository path and link they name exists. Torch-free: it walks click's command tree, reading
nothing but text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click

from m31r.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
# The README and the documents it links to for the details (design, training, speed): what they write must hold too.
DOCS = {p: p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")

# Programs other than m31r whose command lines the README quotes: flags in a code span (or a line of a code block)
# that starts with one of these are theirs, not ours. Kept explicit, so that a span starting with a misspelt `m31r`
# command is not silently skipped.
OTHER_PROGRAMS = {
    "systemctl": "`systemctl --user ...` enables the service units",
    "journalctl": "`journalctl --user -u m31rd` shows the service's log",
    "python": "`python benchmarks/*.py --bundle ... --n-single ...`: the benchmark scripts' own flags",
    "npm": "`npm ci --no-audit --no-fund` builds the VS Code extension",
    "pip": "`pip install torch==2.13.0 --index-url ...` installs torch's CPU build before m31r",
    "make": "make targets take no flags of ours",
    "llama-bench": "`llama-bench ... --repack 0`: llama.cpp's benchmark, which the llama.cpp comparison runs",
    "rustc": "`rustc --test` builds the execution evaluation's programs (benchmarks/eval_exec.py)",
    "xcode-select": "`xcode-select --install` installs Apple's command line tools (a C compiler) on a Mac",
    "clang": "`clang --target=...` cross-compiles the neon kernels as a Mac's compiler would (test_native_neon.py)",
}
# A `*.py` first word is a script (benchmarks/*.py, run with or without `python`): the flags are its argparse's.
SCRIPT = re.compile(r"\S+\.py$")
# Flags of other tools that the README names on their own, without the tool's command line.
OTHER_FLAGS = {
    "--spm-infill": "llama.cpp's infill mode, quoted beside its figure in the speed table",
}
# Environment variables the README may name that our code reads only through the standard library or a tool.
OTHER_ENV = {
    "TMPDIR": "read by Python's tempfile.gettempdir() for the socket folder without XDG_RUNTIME_DIR",
    "M31R_DATA": "read by the Makefile (training folders)",
    "M31R_RUN": "read by the Makefile",
    "M31R_DEBIAN": "read by the Makefile",
}


def commands(cmd: click.Command = main, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    yield path, cmd
    if isinstance(cmd, click.Group):
        for name, sub in cmd.commands.items():
            yield from commands(sub, (*path, name))


def long_options() -> dict[str, list[str]]:
    """{--flag: the commands that take it}, help excepted (click adds it to every command)."""
    out: dict[str, list[str]] = {}
    for path, cmd in commands():
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in (*p.opts, *p.secondary_opts):
                    if opt.startswith("--") and opt != "--help":
                        out.setdefault(opt, []).append(" ".join(("m31r", *path)))
    return out


def code_spans(text: str) -> tuple[list[str], str]:
    """(each line of a fenced block and each inline code span, the prose left over). Inline spans may wrap lines."""
    spans: list[str] = []

    def fence(m: re.Match[str]) -> str:
        spans.extend(m.group(1).splitlines())
        return ""

    text = re.sub(r"^```[^\n]*\n(.*?)^```", fence, text, flags=re.S | re.M)

    def inline(m: re.Match[str]) -> str:
        spans.append(" ".join(m.group(1).split()))
        return ""

    prose = re.sub(r"`([^`]+)`", inline, text)
    return spans, prose


def commands_section() -> str:
    return README.split("\n## Commands\n", 1)[1].split("\n## ", 1)[0]


def test_every_m31r_option_is_named_in_the_readme() -> None:
    missing = {f: cmds for f, cmds in long_options().items() if not re.search(rf"(?<![\w-]){f}(?![\w-])", README)}
    assert not missing, f"options the README does not name: {missing}"


def test_every_command_is_in_the_commands_table() -> None:
    rows = [line for line in commands_section().splitlines() if line.startswith("| `m31r")]
    for path, _ in commands():
        if not path:
            continue
        head = f"m31r {path[0]}"
        row = [r for r in rows if re.search(rf"`{head}(?![\w-])", r)]
        assert row, f"`{head}` has no row in the README's Commands table"
        if len(path) > 1:
            assert any(re.search(rf"(?<![\w-]){path[-1]}(?![\w-])", r) for r in row), f"`m31r {' '.join(path)}`"


def test_every_flag_the_readme_writes_for_m31r_exists() -> None:
    known = long_options()
    names = {part for path, _ in commands() for part in path}
    spans, prose = code_spans("\n".join(DOCS.values()))
    unknown: set[str] = set()
    strangers: set[str] = set()
    for span in spans:
        for part in re.split(r"&&|\|\||;|\$\(|\|(?!\w)", span):  # one command of a command line at a time
            words = part.split()
            flags = FLAG.findall(part)
            if not words or not flags:
                continue
            first = words[0]
            if first in OTHER_PROGRAMS or SCRIPT.match(first):
                continue
            # `m31r ...`, `.venv/bin/m31r ...`, a bare `--flag`, or a (sub)command named without `m31r` (the table)
            if Path(first).name == "m31r" or first.startswith("--") or first in names:
                unknown |= {f for f in flags if f not in known and f not in OTHER_FLAGS}
            else:
                strangers.add(part.strip())
    unknown |= {f for f in FLAG.findall(prose) if f not in known and f not in OTHER_FLAGS}
    assert not unknown, f"the README names flags no m31r command has: {sorted(unknown)}"
    assert not strangers, f"flags after a program that is neither m31r nor in OTHER_PROGRAMS: {sorted(strangers)}"


def env_read_by_code() -> set[str]:
    names: set[str] = set()
    pattern = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["']([A-Z][A-Z0-9_]*)["']""")
    for package in ("m31r", "m31rd", "protocol", "lsp"):
        for f in (ROOT / package).rglob("*.py"):
            names |= set(pattern.findall(f.read_text()))
    return names


def test_environment_variables_match_the_code() -> None:
    read = env_read_by_code()
    assert {"M31R_SOCKET", "M31R_BUNDLE", "M31R_NATIVE"} <= read, "the scan finds what the code reads"
    env_section = README.split("\n### Environment\n", 1)[1].split("\n## ", 1)[0]
    unnamed = {v for v in read if not re.search(rf"`{v}`", env_section)}
    assert not unnamed, f"read by the code, missing from the README's Environment table: {sorted(unnamed)}"
    every = "\n".join(DOCS.values())
    named = set(re.findall(r"\$([A-Z][A-Z0-9_]+)", every)) | set(re.findall(r"`([A-Z][A-Z0-9_]*_[A-Z0-9_]+|CC)`",
                                                                            env_section))
    named |= set(re.findall(r"\b(M31R_[A-Z0-9_]+)", every))
    stray = named - read - set(OTHER_ENV)
    assert not stray, f"named in the README, read by nothing: {sorted(stray)}"


def test_repository_paths_exist() -> None:
    # Folders the code writes into (benchmark results) are named for where output lands: they need not exist.
    written = {"bench-results"}
    top = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")} - written
    missing = []
    for doc, text in DOCS.items():
        spans, _ = code_spans(text)
        for token in [w for s in spans for w in re.split(r"[\s,()]+", s)]:
            token = token.strip(".:;")
            looks_like_ours = "/" in token and token.split("/")[0] in top and not re.search(r"[<>*{}|$]", token)
            if looks_like_ours and not (ROOT / token).exists():
                missing.append(f"{doc.name}: {token}")
        # Links resolve from the document's own folder, as a Markdown viewer resolves them.
        missing += [f"{doc.name}: link {link}" for link in re.findall(r"\]\(([^)#:]+)\)", text)
                    if not (doc.parent / link).exists()]
    assert not missing, f"paths the README or docs/ name that do not exist: {missing}"

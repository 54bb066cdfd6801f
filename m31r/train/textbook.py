""""Textbook" documents from the train split: its doc-test examples and its small documented functions, each a file.

The model sees ordinary crate files, where a function's doc comment is one line among thousands and the examples
in doc comments are comment text. An editor user asks it for something else: the body of a function whose doc
comment says what it does (`make run`, `make eval-exec`). Cut out as files of their own, these pieces become FIM
samples where the doc comment and signature are the prompt and the body the middle, and the doc examples become
small programs. Nothing comes from outside the train split, so the held-out crates stay unseen.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from m31r.train.corpus import UNFINISHED
from m31r.train.samples import block_bodies
from m31r.train.trainer import read_docs

_FENCE = re.compile(r"^```\s*([\w,\- ]*)\s*$")
_DOC_LINE = re.compile(r"^[ \t]*//[/!] ?(.*)$")
_FN = re.compile(r"^([ \t]*)(?:pub(?:\([^)]*\))? )?(?:const )?(?:async )?(?:unsafe )?(?:extern \"\w+\" )?fn \w+")
# Fenced blocks with these tags are not (compiling) Rust.
NOT_RUST = frozenset({"text", "sh", "bash", "console", "shell", "toml", "json", "yaml", "c", "cpp", "python", "js",
                      "html", "xml", "sql", "ini", "diff", "md", "markdown", "txt", "plain", "compile_fail",
                      "ignore"})
EXAMPLE_LINES = (3, 60)  # lines of code (not blank, not comments) a kept example has
FUNCTION_BODY_LINES = (2, 30)


def doc_examples(text: str) -> list[str]:
    """The fenced Rust examples of a file's `///` and `//!` comments as programs: rustdoc's hidden `# ` lines
    shown, and wrapped in `fn main` as rustdoc wraps them when they have none."""
    blocks: list[list[str]] = []
    code: list[str] | None = None
    inside = False
    for line in text.split("\n"):
        m = _DOC_LINE.match(line)
        if not m:
            code, inside = None, False  # a fence left open at the end of a comment is dropped
            continue
        body = m.group(1)
        fence = _FENCE.match(body.strip())
        if fence:
            if inside:
                if code is not None:
                    blocks.append(code)
                code, inside = None, False
            else:
                tags = {t for t in re.split(r"[\s,]+", fence.group(1)) if t}
                code, inside = (None if tags & NOT_RUST else []), True
            continue
        if code is not None:
            code.append("" if body == "#" else body[2:] if body.startswith("# ") else body)
    out = []
    for lines in blocks:
        lines = [ln.rstrip() for ln in lines]
        while lines and not lines[0]:
            lines.pop(0)
        while lines and not lines[-1]:
            lines.pop()
        n_code = sum(1 for ln in lines if ln.strip() and not ln.lstrip().startswith("//"))
        if not EXAMPLE_LINES[0] <= n_code <= EXAMPLE_LINES[1]:
            continue
        if not any(re.match(r"\s*(?:pub )?(?:async )?fn main\b", ln) for ln in lines):
            lines = ["fn main() {", *[("    " + ln) if ln else "" for ln in lines], "}"]
        out.append("\n".join(lines) + "\n")
    return out


def documented_functions(text: str) -> list[str]:
    """Each function with a `///` doc comment and a body of a few lines, from its doc comment to its closing
    brace (block_bodies finds it by indentation, as for block-FIM middles), moved to the left margin."""
    lines = text.split("\n")
    closing = dict(block_bodies(lines, FUNCTION_BODY_LINES[1]))  # first body line -> closing line
    out = []
    for i, line in enumerate(lines):
        m = _FN.match(line)
        end = closing.get(i + 1)
        if not m or end is None or end - i - 1 < FUNCTION_BODY_LINES[0]:
            continue
        top = i
        while top > 0 and lines[top - 1].strip().startswith("#["):
            top -= 1
        doc = top
        while doc > 0 and lines[doc - 1].strip().startswith("///"):
            doc -= 1
        indent = m.group(1)
        if doc < top and lines[end].rstrip() == indent + "}":  # not `} else {`, `});` or `} // ...`
            piece = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[doc:end + 1]]
            out.append("\n".join(piece) + "\n")
    return out


def _key(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


def build_textbook(data_dir: Path, out_dir: Path, *, plain_share: float = 1.0, seed: int = 0) -> dict:
    """OUT_DIR as a data folder of its own: the textbook pieces of DATA_DIR's train split (each once), and whole
    train files drawn at random up to plain_share times their characters, shuffled; the validation split and
    tokenizer as they are, so validation figures compare with DATA_DIR's. Returns the manifest."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    docs = [d for d in read_docs(data_dir / "corpus" / "train.jsonl") if d["text"]]
    seen: set[str] = set()
    pieces: list[dict] = []
    counts = {"examples": 0, "functions": 0}
    for d in docs:
        for kind, texts in (("examples", doc_examples(d["text"])), ("functions", documented_functions(d["text"]))):
            for t in texts:
                if (k := _key(t)) in seen:
                    continue
                seen.add(k)
                counts[kind] += 1
                pieces.append({"path": f"{d['path']}#{kind[:-1]}{counts[kind]}", "crate": d.get("crate"),
                               "crate_path": d.get("crate_path"), "text": t})  # its file's, as served
    rng = random.Random(seed)
    piece_chars = sum(len(p["text"]) for p in pieces)
    order = list(range(len(docs)))
    rng.shuffle(order)
    plain, plain_chars = [], 0
    for i in order:
        if plain_chars >= plain_share * piece_chars:
            break
        plain.append(docs[i])
        plain_chars += len(docs[i]["text"])
    mixed = pieces + plain
    rng.shuffle(mixed)

    manifest = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    corpus = out_dir / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    # As build_corpus does: every file is written beside its name and renamed over it, under a marker that training
    # refuses (unfinished_build), so a build stopped part-way (a full disk, Ctrl-C) never leaves the pieces of one
    # build beside the manifest, validation split or tokenizer of another.
    (corpus / UNFINISHED).write_text("m31r train textbook is replacing this folder's files\n")
    digest = hashlib.sha256()

    def write_train(tmp: Path) -> None:
        with open(tmp, "w") as f:
            for d in mixed:
                line = json.dumps(d) + "\n"
                digest.update(line.encode())
                f.write(line)

    _replace(corpus / "train.jsonl", write_train)
    _replace(corpus / "val.jsonl", lambda tmp: shutil.copyfile(data_dir / "corpus" / "val.jsonl", tmp))
    _replace(out_dir / "tokenizer.json", lambda tmp: shutil.copyfile(data_dir / "tokenizer.json", tmp))
    manifest["dataset_version"] = f"{manifest['dataset_version']}+textbook-{digest.hexdigest()[:12]}"
    manifest["textbook"] = {**counts, "piece_chars": piece_chars, "plain_files": len(plain),
                            "plain_chars": plain_chars, "seed": seed}
    _replace(corpus / "manifest.json", lambda tmp: tmp.write_text(json.dumps(manifest, indent=1) + "\n"))
    (corpus / UNFINISHED).unlink()
    return manifest


def _replace(path: Path, write: Callable[[Path], object]) -> None:
    """`write` makes the file beside `path`, which is then renamed over it; a failed write leaves no partial file
    taking the disk's space."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise

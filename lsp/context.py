"""Code from the rest of the crate for a completion's prompt (`Fim.context`).

The files: the other open documents of the completed document's language and the crate's files of that language on disk
(the crate is the nearest folder above the document holding a Cargo.toml, else the document's folder, its own files
only), nearest the document first (an open document as it is in the editor, not its file). A language is a file suffix
(`.rs` for Rust; a document without one, an unsaved buffer, has its languageId's): Rust code is never quoted into a
TOML, Markdown or Python prompt, nor theirs into a Rust one. Each file's windows are kept until it changes, so a
request costs a stat per file and the ranking (m31r_protocol.context), a few milliseconds; it runs on a worker thread
all the same (`find`), because disks can be slow. The listing of the crate's files (`walk`, every LISTING_TTL_S) is
bounded by entries and time, as every completion waits on the lock it holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from urllib.parse import unquote_to_bytes, urlparse

from m31r_protocol.context import Window, query_words, rank, windows, wire_path
from m31r_protocol.messages import Snippet

MAX_FILES = 64  # files ranked per request: open documents first, then the nearest files on disk
MAX_FILE_BYTES = 256 * 1024  # larger files are generated tables more often than code worth quoting
MAX_LISTED = 2000  # files a crate's listing takes before it stops walking
MAX_VISITED = 5000  # folder entries (any name) a listing looks at before it stops walking
MAX_WALK_S = 0.3  # seconds a listing walks before it stops: the lock every completion takes is held meanwhile
LISTING_TTL_S = 10.0  # a crate's file list is walked again after this long
SKIP_DIRS = {".git", "node_modules"}  # and hidden folders, and `target` beside a Cargo.toml (_skipped)
LANGUAGE_SUFFIXES = {"rust": ".rs"}  # the suffix of a languageId's files, for a document whose URI has none

log = logging.getLogger("m31r_lsp.context")


def uri_path(uri: str) -> Path | None:
    """A file: URI's path; its escaped bytes as the file system names them (a name that is not UTF-8 included)."""
    u = urlparse(uri)
    return Path(os.fsdecode(unquote_to_bytes(u.path))) if u.scheme == "file" else None


def language_suffix(uri: str, language_id: str | None = None) -> str | None:
    """The suffix of the files in document `uri`'s language: its own (`.rs`), else its languageId's (an unsaved
    `untitled:` buffer in Rust: `.rs`); None when neither tells."""
    return (uri_path(uri) or Path(uri)).suffix or LANGUAGE_SUFFIXES.get((language_id or "").lower())


def crate_root(path: Path) -> Path:
    """The nearest folder above `path` with a Cargo.toml, else `path`'s own folder."""
    for folder in path.parents:
        if (folder / "Cargo.toml").is_file():
            return folder
    return path.parent


class ProjectContext:
    def __init__(self, open_documents: Callable[[], Iterable[tuple[str, ...]]]) -> None:
        """`open_documents()` gives (uri, text) or (uri, text, languageId) of the open documents."""
        self.open_documents = open_documents
        self._lock = threading.Lock()
        self._windows: dict[object, list[Window]] = {}  # (path, mtime_ns, size) or (uri, text hash) -> windows
        self._not_utf8: dict[Path, tuple[int, int]] = {}  # path -> (mtime_ns, size) of a version that is not UTF-8
        # (crate, suffix, None) -> (when, files) of a whole listing; (crate, suffix, document's folder) of a cut one
        self._listings: dict[tuple[Path, str, Path | None], tuple[float, list[Path]]] = {}
        self._cut: set[tuple[Path, str]] = set()  # (crate, suffix) whose listing was cut, as the log said once

    async def find(self, uri: str, prefix: str) -> list[Snippet]:
        """`snippets` on a worker thread, with the open documents as they are now (read here, on the event loop
        that changes them)."""
        return await asyncio.to_thread(self.snippets, uri, prefix, list(self.open_documents()))

    def snippets(self, uri: str, prefix: str, opened: Iterable[tuple[str, ...]] | None = None) -> list[Snippet]:
        """Snippets for a cursor at the end of `prefix` in document `uri`, best first; [] for a document with no
        other file of its language near it, or nothing above the cursor to go by. `opened`: the open documents
        (default: as `open_documents()` gives them), (uri, text) or (uri, text, languageId)."""
        query = query_words(prefix)
        if not query:
            return []
        given = self.open_documents() if opened is None else opened
        docs = [(d[0], d[1], d[2] if len(d) > 2 else None) for d in given]
        suffix = language_suffix(uri, next((lang for other, _, lang in docs if other == uri), None))
        if suffix is None:
            return []
        with self._lock:
            return rank(query, self._files(uri, suffix, docs))

    def _files(self, uri: str, suffix: str,
               opened: Iterable[tuple[str, str, str | None]]) -> list[tuple[str, list[Window]]]:
        """The MAX_FILES files to rank: the open documents and the crate's files on disk, nearest to the document first
        (an open document before a file on disk as near). Open documents all came first: past MAX_FILES of them (an
        editor also opens the sources of dependencies and std that go-to-definition showed) the first opened filled
        the list, from other crates as often as not, and the crate's own files on disk were never read."""
        if len(self._windows) > 4 * MAX_FILES:  # bounded: past that, all are dropped and rebuilt as needed
            self._windows.clear()
        if len(self._not_utf8) > 4 * MAX_LISTED:  # (more than one request looks at: no request reads them again)
            self._not_utf8.clear()
        here = uri_path(uri)
        root = crate_root(here) if here is not None else None
        near = () if here is None else here.parent.parts
        seen: set[Path] = set() if here is None else {here}
        docs: list[tuple[str, str, Path | None]] = []
        for other, text, lang in opened:
            path = uri_path(other)
            if other == uri or path in seen or language_suffix(other, lang) != suffix:
                continue
            if path is not None:
                seen.add(path)
            docs.append((other, text, path))
        on_disk = [] if root is None or here is None else [p for p in self._nearest(root, here, suffix)
                                                             if p not in seen]
        # (sorted is stable: among the open documents as near, the editor's order; the files on disk come nearest first)
        candidates = sorted([(-_common(d[2].parent.parts if d[2] else (), near), 0, d) for d in docs]
                            + [(-_common(p.parent.parts, near), 1, p) for p in on_disk], key=lambda c: c[:2])
        out: list[tuple[str, list[Window]]] = []
        for _, _, item in candidates:
            got = self._open_windows(item, root) if isinstance(item, tuple) else self._disk_windows(item, root)
            if got is not None:
                out.append(got)
                if len(out) == MAX_FILES:
                    break
        return out

    def _open_windows(self, doc: tuple[str, str, Path | None], root: Path | None) -> tuple[str, list[Window]]:
        other, text, path = doc
        key = (other, hash(text))
        if key not in self._windows:
            self._windows[key] = windows(text)
        return (_shown(path, root) if path else other), self._windows[key]

    def _disk_windows(self, path: Path, root: Path | None) -> tuple[str, list[Window]] | None:
        """A file's windows; None for one that is no regular file (a named pipe called `x.rs` blocked the read, and
        every request after it, with the lock held, until something wrote to it; a link to /dev/zero never ended),
        is too large, or is not UTF-8 (training's corpus leaves those out, and rustc refuses them: quoted, they
        put U+FFFD in the prompt). Line ends read as LF, as before. A file found not UTF-8 is not read again until it
        changes: it was read and decoded anew at every keystroke (a crate's fixtures in Latin-1, a binary named .rs)."""
        try:
            st = path.stat()
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_FILE_BYTES:
                return None
            key = (path, st.st_mtime_ns, st.st_size)
            if self._not_utf8.get(path) == key[1:]:
                return None
            if key not in self._windows:
                with path.open(encoding="utf-8-sig") as f:  # no byte order mark, as training's corpus has none
                    text = f.read(MAX_FILE_BYTES + 1)  # grown since the stat: not read on without end
                if len(text) > MAX_FILE_BYTES:
                    return None
                self._windows[key] = windows(text)
        except UnicodeDecodeError:
            self._not_utf8[path] = key[1:]
            return None
        except OSError:  # (not remembered: a file made readable keeps its mtime)
            return None
        return _shown(path, root), self._windows[key]

    def _nearest(self, root: Path, here: Path, suffix: str) -> list[Path]:
        """The crate's files ending in `suffix`, those sharing the most folders with `here` first. A listing that was
        cut holds the files nearest the document it was walked for, so it serves documents of that folder only: shared
        by the crate, a document in another folder got the first one's neighbours, not its own (the file beside it never
        quoted), and other snippets than it would get alone, until the listing expired."""
        now = time.monotonic()
        keys = ((root, suffix, None), (root, suffix, here.parent))
        got = next((g for k in keys if (g := self._listings.get(k)) is not None and now - g[0] <= LISTING_TTL_S), None)
        if got is None:
            found, visited, cut = walk(root, here, suffix)
            if cut and (root, suffix) not in self._cut:  # said once per crate, not at every refresh
                self._cut.add((root, suffix))
                log.info("project context: stopped listing %s's %s files after %d entries (%d files found); the "
                         "files nearest the document were listed first", root, suffix, visited, len(found))
            # Expired listings go (each would be walked again): kept, a long session held one per crate and folder.
            self._listings = {k: v for k, v in self._listings.items() if now - v[0] <= LISTING_TTL_S}
            got = self._listings[keys[1] if cut else keys[0]] = (now, found)
        parts = here.parent.parts
        return sorted(got[1], key=lambda p: -_common(p.parent.parts, parts))


def walk(root: Path, here: Path, suffix: str) -> tuple[list[Path], int, bool]:
    """The files ending in `suffix` under crate `root` for document `here`: (files, entries visited, whether the walk
    was cut). Outward from the document's folder (its subtree breadth first, then its parent's other folders, and so
    on up to `root`), so that a cut at MAX_VISITED entries, MAX_LISTED files or MAX_WALK_S keeps the nearest files:
    walked from `root` in name order, a large crate's limit was reached before the document's folder, and a document
    in no crate (`~/x.rs`: `root` is its folder) walked the whole tree under it, home folder and all, every refresh.
    With no Cargo.toml in `root`, only its own files are listed. Never entered: symlinked folders, `.git`,
    `node_modules`, hidden folders and a crate's `target` (_skipped); never listed: a symlink that leads out of the
    crate."""
    deadline = time.monotonic() + MAX_WALK_S
    descend = (root / "Cargo.toml").is_file()
    real_root = root.resolve()
    rel = here.parent.relative_to(root).parts
    kept = next((i for i, part in enumerate(rel)
                 if _skipped(part, part == "target" and os.path.isfile(root.joinpath(*rel[:i], "Cargo.toml")))),
                len(rel))
    level = root.joinpath(*rel[:kept])  # the walk starts at the document's folder, unless it is one never entered
    found: list[Path] = []
    visited = 0
    done: str | None = None  # the subfolder of `level` walked already
    while True:
        queue = deque([level])
        while queue:
            folder = queue.popleft()
            entries: list[os.DirEntry[str]] = []
            try:
                with os.scandir(folder) as it:
                    for entry in it:
                        visited += 1
                        entries.append(entry)
                        if visited >= MAX_VISITED or time.monotonic() > deadline:
                            break
            except OSError:
                pass
            manifest = any(e.name == "Cargo.toml" for e in entries)
            for entry in sorted(entries, key=lambda e: e.name):
                try:
                    if entry.is_dir(follow_symlinks=False):
                        if (descend and not _skipped(entry.name, manifest)
                                and not (folder == level and entry.name == done)):
                            queue.append(Path(entry.path))
                    elif entry.name.endswith(suffix) and entry.name != suffix and (
                            not entry.is_symlink() or Path(entry.path).resolve().is_relative_to(real_root)):
                        found.append(Path(entry.path))
                except (OSError, RuntimeError):  # (RuntimeError: a symlink loop, before Python 3.13)
                    continue
            if visited >= MAX_VISITED or len(found) >= MAX_LISTED or time.monotonic() > deadline:
                return sorted(found, key=_walk_order), visited, True
        if not descend or level == root:
            return sorted(found, key=_walk_order), visited, False
        done, level = level.name, level.parent


def _walk_order(path: Path) -> tuple[tuple[int, str], ...]:
    """The order a walk from the crate's root in name order lists files (a folder's files before its subfolders'): it
    decides which of the files as near the document are ranked, as it did before the walk went outward."""
    return (*((1, d) for d in path.parent.parts), (0, path.name))


def _skipped(name: str, beside_manifest: bool) -> bool:
    """A folder never entered. `target` only beside a Cargo.toml, where cargo builds: skipped by name anywhere, a
    module's folder (cc-rs's `src/target/`) was never listed, and a document in it got no snippets at all."""
    return name in SKIP_DIRS or name.startswith(".") or (name == "target" and beside_manifest)


def _common(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _shown(path: Path, root: Path | None) -> str:
    """A path as the model sees it: relative to the crate (`src/de.rs`), as training showed it."""
    if root is not None:
        try:
            return wire_path(path.relative_to(root).as_posix())
        except ValueError:
            pass
    return wire_path(path.name)

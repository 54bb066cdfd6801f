"""A bundle's checksums (checksum.txt, `sha256sum` format), without torch: the daemon starts hashing the weights
on another core before it imports torch (~0.8 s), instead of after."""

from __future__ import annotations

import hashlib
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

CONTENT_FILES = ("model.safetensors", "tokenizer.json", "config.yaml", "metadata.json")
CHECKSUM_FILE = "checksum.txt"
# In a folder that `m31r bundle` commands are writing into, removed once the bundle is whole: one that stays marks the
# leftover of a writer killed outright (SIGKILL, the OOM killer), which the same command, run again, replaces.
UNFINISHED_FILE = ".m31r-unfinished"


class BundleError(RuntimeError):
    """A bundle that must not be loaded; the message names the file and what is wrong."""


# What to do about a bundle whose files are missing or damaged: nothing in it can be repaired in place.
RESTORE = ("restore the bundle from where it came from (the bundled release/ comes with m31r: reinstall it), or "
           "serve another (--bundle, or M31R_BUNDLE)")


# checksum.txt holds four lines of about 85 bytes; one far larger is no checksum file, and is not read into memory.
MAX_CHECKSUM_BYTES = 64 << 10
_LINE = re.compile(r"([0-9a-fA-F]{64})[ \t]+\*?(.+)")  # digest, separator (text or *binary), file name


def fingerprint(path: Path) -> str:
    """What identifies a bundle's exact bytes (clients and cache entries key on it): a hash of its checksum file
    (streamed: the daemon takes it before the file is checked)."""
    return sha256_file(Path(path) / CHECKSUM_FILE)[:16]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def read_checksums(path: Path) -> dict[str, str]:
    f = path / CHECKSUM_FILE
    if not f.is_file():
        raise BundleError(f"{f}: missing; a bundle needs {CHECKSUM_FILE} beside {', '.join(CONTENT_FILES)}: "
                          f"{RESTORE}")
    with open(f, "rb") as fh:
        raw = fh.read(MAX_CHECKSUM_BYTES + 1)
    if len(raw) > MAX_CHECKSUM_BYTES:
        raise BundleError(f"{f}: over {MAX_CHECKSUM_BYTES >> 10} KiB, not a checksum file of {len(CONTENT_FILES)} "
                          f"lines: {RESTORE}")
    sums: dict[str, str] = {}
    # As `sha256sum -c` reads it: hex in either case, a text (` `) or binary (`*`) marker, the name to the end of the
    # line; and what an editor or a copy through Windows adds: a byte-order mark, CRLF, blank lines.
    for n, line in enumerate(raw.decode("utf-8-sig", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        if not (m := _LINE.fullmatch(line.strip())):
            raise BundleError(f"{f}: line {n} is not '<sha256>  <file>': {line[:80]!r}")
        digest, name = m[1].lower(), m[2]
        if name in sums:
            raise BundleError(f"{f}: line {n} lists {name} a second time")
        sums[name] = digest
    if set(sums) != set(CONTENT_FILES):
        raise BundleError(f"{f}: must list exactly {', '.join(CONTENT_FILES)}; lists {', '.join(sorted(sums))}")
    return sums


def unfinished(path: Path) -> str | None:
    """Why `path` is no whole bundle or checkpoint yet, where an `m31r bundle` writer left it unfinished."""
    if not (Path(path) / UNFINISHED_FILE).is_file():
        return None
    return (f"{path}: unfinished: the `m31r bundle` command writing it was stopped before the end (killed?), or still "
            "runs; run that command again, which replaces it")


def check_present(path: Path) -> None:
    """That `path` holds the five files. A folder that cannot be searched (no permission, a name too long) is a
    BundleError naming it, like a missing one: pathlib's tests raise those errors instead of answering False."""
    try:
        _check_present(path)
    except OSError as e:
        raise BundleError(f"{e.filename or path}: cannot be read ({e.strerror or e}): check its permissions, or "
                          "pass another bundle with --bundle, or M31R_BUNDLE") from None


def _check_present(path: Path) -> None:
    names = (*CONTENT_FILES, CHECKSUM_FILE)
    if not all((path / n).is_file() for n in names) and (why := unfinished(path)):
        raise BundleError(why)
    not_one = f"{path}: not a bundle directory (one holding {', '.join(CONTENT_FILES)} and {CHECKSUM_FILE})"
    # A folder without any of the files only bundles have is another folder, not a damaged bundle to restore.
    if not path.is_dir() or not any((path / n).exists() for n in ("config.yaml", "metadata.json", CHECKSUM_FILE)):
        if path.is_dir() and (path / "config.json").is_file():
            raise BundleError(f"{not_one}: it looks like a Hugging Face checkpoint, which `m31r bundle import-hf` "
                              "converts into one")
        raise BundleError(f"{not_one}: pass one with --bundle, or M31R_BUNDLE")
    for name in names:
        if not (path / name).is_file():
            raise BundleError(f"{path / name}: missing from the bundle: {RESTORE}")


def verify_checksums(path: Path) -> None:
    """Hash every content file against checksum.txt (sha256; ~1 GB/s with SHA-NI)."""
    for name, expected in read_checksums(path).items():
        got = sha256_file(path / name)
        if got != expected:
            raise BundleError(
                f"{path / name}: checksum mismatch (checksum.txt has {expected[:16]}…, the file hashes to "
                f"{got[:16]}…): the file is corrupt or was modified: {RESTORE}"
            )


def verify_in_background(path: str | Path) -> Future:
    """Start `verify_checksums` on a worker thread (hashlib releases the GIL), so a loader can build the model
    meanwhile; the loader must wait for the result before it serves anything (see Engine). A missing bundle or
    file is reported at once."""
    check_present(Path(path))
    pool = ThreadPoolExecutor(1, thread_name_prefix="m31r-verify")
    future = pool.submit(verify_checksums, Path(path))
    pool.shutdown(wait=False)
    return future

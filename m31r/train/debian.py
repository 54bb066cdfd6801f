"""Fetch the corpus's Rust sources from Debian without installing anything.

Two kinds of package: `rust-src` (the Rust standard library and toolchain sources) and the ~1,500
`librust-*-dev` crate-source packages (names with a `+` are virtual feature packages and carry no
files). `apt-get download` fetches the .deb files into CACHE/debs and `dpkg -x` unpacks them into
CACHE/src, so a user's system is never changed; CACHE/packages.tsv records the name, version and
SHA-256 of every unpacked .deb, which becomes the dataset version in the bundle metadata.

Crates then sit under CACHE/src/usr/share/cargo/registry/<crate>-<version>/ and the standard library
under CACHE/src/usr/lib/rustlib/src/rust/.

Each Debian release is read through a private apt configuration (CACHE/apt, CACHE/<suite>/apt) naming
its suite, so the host's apt sources are neither used nor touched, root is not needed, and a host of any
release (or Ubuntu, with `debian-archive-keyring`) fetches the same packages. Debian 12 (bookworm, where
the corpus was first built) goes into CACHE itself. A later suite (Debian 13, trixie: twice as many crate
packages, and newer versions of the rest) unpacks into CACHE/<suite>/ with the same layout; the corpus
takes its files for training only (`build_corpus`'s `train_only_roots`), so the held-out crates stay as
they were.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

BASE_SUITE = "bookworm"
LATER_SUITES = ("trixie",)
MIRROR = os.environ.get("M31R_DEBIAN_MIRROR", "http://deb.debian.org/debian")
KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
CRATE_PACKAGE = re.compile(r"^librust-[a-z0-9][a-z0-9.-]*-dev$")
STD_PACKAGE = "rust-src"
REGISTRY = Path("usr/share/cargo/registry")
RUST_SRC = Path("usr/lib/rustlib/src/rust")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str


def apt_options(folder: Path, suite: str) -> list[str]:
    """`-o` options for apt-get/apt-cache that read `suite` through a private configuration in `folder`."""
    lists = folder / "lists"
    (lists / "partial").mkdir(parents=True, exist_ok=True)
    (folder / "cache" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
    signed = f" [signed-by={KEYRING}]" if KEYRING.is_file() else ""
    (folder / "sources.list").write_text(f"deb{signed} {MIRROR} {suite} main\n")
    settings = {"Dir::Etc::SourceList": folder / "sources.list", "Dir::Etc::SourceParts": "/dev/null",
                "Dir::Etc::Preferences": "/dev/null", "Dir::Etc::PreferencesParts": "/dev/null",
                "Dir::State::Lists": lists, "Dir::Cache": folder / "cache", "Dir::State::status": "/dev/null"}
    return [arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]


def update(options: list[str]) -> None:
    """`apt-get update` for a private configuration (its lists only)."""
    proc = subprocess.run(["apt-get", *options, "update", "-qq"], capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        hint = "" if KEYRING.is_file() else f" ({KEYRING} is missing: install debian-archive-keyring)"
        raise RuntimeError(f"apt-get update failed{hint}: {proc.stderr.strip()[-500:]}")


def list_packages(options: list[str] = ()) -> list[str]:
    """rust-src and every real librust-*-dev package apt knows, sorted (run `apt-get update` first)."""
    out = subprocess.run(["apt-cache", *options, "--names-only", "search", "^librust-.*-dev$"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    names = sorted({line.split(" - ", 1)[0] for line in out.splitlines() if CRATE_PACKAGE.match(line.split(" ")[0])})
    return [STD_PACKAGE, *names]


def _deb_name(path: Path) -> str:
    return path.name.split("_", 1)[0]


def download(names: list[str], debs: Path, batch: int = 100, options: list[str] = ()) -> list[Path]:
    """`apt-get download` what is not already in `debs`; returns every .deb there for `names`."""
    debs.mkdir(parents=True, exist_ok=True)
    have = {_deb_name(p) for p in debs.glob("*.deb")}
    missing = [n for n in names if n not in have]
    with tqdm(total=len(missing), desc="downloading .deb", unit="pkg", disable=not missing) as bar:
        for i in range(0, len(missing), batch):
            part = missing[i : i + batch]
            subprocess.run(["apt-get", *options, "download", "-q", *part], cwd=debs, check=True, capture_output=True,
                           timeout=1800)
            bar.update(len(part))
    wanted = set(names)
    found = sorted(p for p in debs.glob("*.deb") if _deb_name(p) in wanted)
    lacking = wanted - {_deb_name(p) for p in found}
    if lacking:
        raise RuntimeError(f"apt-get download did not fetch {len(lacking)} packages, e.g. {sorted(lacking)[:5]}")
    return found


def _field(deb: Path, name: str) -> str:
    return subprocess.run(["dpkg-deb", "-f", str(deb), name], capture_output=True, text=True, check=True).stdout.strip()


def unpack(debs: list[Path], src: Path) -> list[Package]:
    """`dpkg -x` each .deb into `src` once (a stamp per .deb), and describe what was unpacked."""
    stamps = src / ".unpacked"
    stamps.mkdir(parents=True, exist_ok=True)
    packages = []
    for deb in tqdm(debs, desc="unpacking", unit="pkg"):
        digest = hashlib.sha256(deb.read_bytes()).hexdigest()
        stamp = stamps / f"{deb.name}.{digest[:16]}"
        if not stamp.exists():
            subprocess.run(["dpkg", "-x", str(deb), str(src)], check=True, capture_output=True)
            stamp.touch()
        packages.append(Package(_field(deb, "Package"), _field(deb, "Version"), digest))
    return packages


def write_packages(path: Path, packages: list[Package]) -> None:
    lines = [f"{p.name}\t{p.version}\t{p.sha256}" for p in sorted(packages, key=lambda p: p.name)]
    path.write_text("".join(line + "\n" for line in lines))


def read_packages(path: Path) -> dict[str, str]:
    """name → version from a packages.tsv written by `fetch`."""
    out = {}
    for line in Path(path).read_text().splitlines():
        name, version, _ = line.split("\t")
        out[name] = version
    return out


def source_roots(folder: Path) -> list[Path]:
    """The standard library's and the crates' folders under a fetched folder's src/, where present."""
    return [folder / "src" / p for p in (RUST_SRC, REGISTRY) if (folder / "src" / p).is_dir()]


def fetch(cache: Path, names: list[str], options: list[str] = ()) -> tuple[list[Path], list[Package]]:
    """Download and unpack into `cache`; returns the source roots for `build_corpus` and the packages."""
    cache = Path(cache)
    packages = unpack(download(names, cache / "debs", options=options), cache / "src")
    write_packages(cache / "packages.tsv", packages)
    return source_roots(cache), packages


def suite_folder(cache: Path, suite: str) -> Path:
    """Where a suite's packages go: CACHE for Debian 12 (as it always has), CACHE/<suite> for a later one."""
    return Path(cache) if suite == BASE_SUITE else Path(cache) / suite


def fetch_suite(cache: Path, suite: str) -> tuple[list[Path], list[Package]]:
    """Fetch a Debian suite's rust-src and crate packages into its folder (apt configured there)."""
    folder = suite_folder(cache, suite)
    options = apt_options(folder / "apt", suite)
    update(options)
    names = list_packages(options)
    if len(names) < 2:
        raise RuntimeError(f"Debian {suite} lists no librust-*-dev packages at {MIRROR}")
    return fetch(folder, names, options=options)

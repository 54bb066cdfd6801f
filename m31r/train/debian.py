"""Fetch the corpus's Rust sources from Debian without installing anything.

Two kinds of package: `rust-src` (the Rust standard library and toolchain sources) and the ~1,500
`librust-*-dev` crate-source packages (names with a `+` are virtual feature packages and carry no
files). `apt-get download` fetches the .deb files into CACHE/debs and `dpkg -x` unpacks them into
CACHE/src, so a user's system is never changed; CACHE/packages.tsv records the name, version and
SHA-256 of every unpacked .deb, which becomes the dataset version in the bundle metadata.

Crates then sit under CACHE/src/usr/share/cargo/registry/<crate>-<version>/ and the standard library
under CACHE/src/usr/lib/rustlib/src/rust/.
"""

from __future__ import annotations

import hashlib
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

CRATE_PACKAGE = re.compile(r"^librust-[a-z0-9][a-z0-9.-]*-dev$")
STD_PACKAGE = "rust-src"
REGISTRY = Path("usr/share/cargo/registry")
RUST_SRC = Path("usr/lib/rustlib/src/rust")


@dataclass(frozen=True)
class Package:
    name: str
    version: str
    sha256: str


def list_packages() -> list[str]:
    """rust-src and every real librust-*-dev package apt knows, sorted (run `apt-get update` first)."""
    out = subprocess.run(["apt-cache", "--names-only", "search", "^librust-.*-dev$"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    names = sorted({line.split(" - ", 1)[0] for line in out.splitlines() if CRATE_PACKAGE.match(line.split(" ")[0])})
    return [STD_PACKAGE, *names]


def _deb_name(path: Path) -> str:
    return path.name.split("_", 1)[0]


def download(names: list[str], debs: Path, batch: int = 100) -> list[Path]:
    """`apt-get download` what is not already in `debs`; returns every .deb there for `names`."""
    debs.mkdir(parents=True, exist_ok=True)
    have = {_deb_name(p) for p in debs.glob("*.deb")}
    missing = [n for n in names if n not in have]
    with tqdm(total=len(missing), desc="downloading .deb", unit="pkg", disable=not missing) as bar:
        for i in range(0, len(missing), batch):
            part = missing[i : i + batch]
            subprocess.run(["apt-get", "download", "-q", *part], cwd=debs, check=True, capture_output=True,
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


def fetch(cache: Path, names: list[str] | None = None) -> tuple[list[Path], list[Package]]:
    """Download and unpack; returns the source roots for `build_corpus` and the packages."""
    cache = Path(cache)
    names = names if names is not None else list_packages()
    packages = unpack(download(names, cache / "debs"), cache / "src")
    write_packages(cache / "packages.tsv", packages)
    roots = [cache / "src" / p for p in (RUST_SRC, REGISTRY) if (cache / "src" / p).is_dir()]
    return roots, packages

"""An installed m31r carries its model: a wheel built from this tree, installed into a folder of its own, finds the
bundled release/ there (the data package `m31r_release`), where before it looked for a release/ beside the package
that no install has. The editable install this suite runs under finds the checkout's release/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from m31rd.main import default_bundle

ROOT = Path(__file__).resolve().parents[1]
RELEASE_FILES = {"model.safetensors", "tokenizer.json", "config.yaml", "metadata.json", "checksum.txt"}


# What a wheel is built from (pyproject.toml's package folders, and the README its metadata names).
SOURCES = ("pyproject.toml", "README.md", "m31r", "m31rd", "protocol", "lsp", "httpd", "release")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A wheel of this tree (torch's setuptools builds it, offline), installed without dependencies into a folder.
    Built from a copy: setuptools writes its build/ folder into the tree it builds."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp / "wheel"), str(src)], check=True, timeout=300)
    (wheel,) = (tmp / "wheel").glob("m31r-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    assert {f"m31r_release/{f}" for f in RELEASE_FILES} <= names, sorted(n for n in names if "release" in n)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                    str(tmp / "site"), str(wheel)], check=True, timeout=300)
    return tmp / "site"


def run_installed(site: Path, code: str) -> str:
    """`code` in a Python that imports m31r from `site` (its dependencies from this environment), run outside the
    checkout so that nothing of the tree is on its path."""
    env = {k: v for k, v in os.environ.items() if k != "M31R_BUNDLE"}
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "-c", code], cwd=site.parent, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_an_installed_m31r_finds_its_bundled_model(installed: Path) -> None:
    found = json.loads(run_installed(installed, (
        "import json, m31rd.main as m\n"
        "from m31r.bundle import open_bundle\n"
        "b = open_bundle(m.default_bundle())\n"  # checksums, config, tokenizer and tensors checked
        "print(json.dumps([m.__file__, str(b.path), b.metadata['model_version']]))")))
    module, bundle, version = found
    assert Path(module).is_relative_to(installed), "the installed copy ran, not the checkout"
    assert Path(bundle) == installed / "m31r_release"
    assert version == json.loads((ROOT / "release" / "metadata.json").read_text())["model_version"]


def test_the_installed_doctor_checks_the_installed_bundle(installed: Path) -> None:
    out = run_installed(installed, (
        "import sys; sys.argv = ['m31r', 'doctor', '--json']\n"
        "from m31r.entry import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass"))  # (1 when another check fails: only the bundle's is ours)
    (bundle,) = [c for c in json.loads(out)["checks"] if c["name"] == "bundle"]
    assert bundle["level"] == "ok", bundle
    assert bundle["detail"].startswith(f"{installed / 'm31r_release'} (default)"), bundle


def test_the_checkout_serves_its_own_release(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("M31R_BUNDLE", raising=False)
    assert default_bundle().resolve() == (ROOT / "release").resolve()
    monkeypatch.setenv("M31R_BUNDLE", "/elsewhere")
    assert default_bundle() == Path("/elsewhere")

"""constraints.txt must stay a set pip can install: every dependency pinned once, inside pyproject's ranges."""

import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent


def pins() -> dict[str, Version]:
    found: dict[str, Version] = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        assert sep and version, f"constraints.txt: {line!r} is not name==version"
        key = canonicalize_name(name)
        assert key not in found, f"constraints.txt pins {name} twice"
        found[key] = Version(version)
    return found


def test_every_dependency_is_pinned_inside_its_range() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    pinned = pins()
    env = {**default_environment(), "extra": "dev"}
    for req in wanted:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        key = canonicalize_name(req.name)
        assert key in pinned, f"constraints.txt has no version for {req.name}: run `make constraints`"
        assert req.specifier.contains(pinned[key], prereleases=True), (
            f"constraints.txt pins {req.name}=={pinned[key]}, outside pyproject's {req}"
        )


def test_the_project_itself_is_not_pinned() -> None:
    # An editable install of m31r written into the file would make pip refuse the checkout's own version.
    assert "m31r" not in pins()

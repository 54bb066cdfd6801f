"""The native kernels' build on a developer's machine: a cached build that no longer loads, a $CC with arguments,
a compiler that hangs, a compile that fails with pages of output.

Every test builds into a temporary cache (XDG_CACHE_HOME or an explicit folder), never the user's. The compilers
here are the system's, behind small shell scripts where a test needs one that counts, truncates or hangs."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

import pytest
import torch

from m31r import native

FP32 = "neon" if native.platform.machine().lower() in ("aarch64", "arm64") else "avx2"  # the fp32 family to test


def _fp32_family() -> str:
    why = native.family_unsupported(FP32)
    if why is not None or native.compiler() is None:
        pytest.skip(f"the {FP32} kernels do not run here: {why or 'no C compiler'}")
    return FP32


def _real_cc() -> str:
    """The system's compiler (what `native` picks with CC unset)."""
    cc = next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)
    if cc is None:
        pytest.skip("no C compiler")
    return cc


@pytest.fixture
def env(tmp_path, monkeypatch, caplog):
    """A fresh `native.load` on the fp32 family with a temporary cache; its log lines at every level."""
    name = _fp32_family()
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("M31R_KERNELS", name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    caplog.set_level(logging.DEBUG, logger="m31r.native")
    native.load.cache_clear()
    yield name
    native.load.cache_clear()


def _script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def _notes(caplog, level: int = logging.INFO) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "m31r.native" and r.levelno >= level]


def _works(kernels: native.Kernels) -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(16, 64, generator=gen)
    torch.testing.assert_close(kernels.f32_mm(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


# -- (1) a cached build that does not load ----------------------------------------------------------------------


@pytest.mark.parametrize("keep", [0, 1000, -1])
def test_a_truncated_cached_build_is_built_again_and_loads(env, caplog, keep: int) -> None:
    """A cached .so cut short (a crash before its data reached the disk, a damaged disk) used to keep the kernels
    off until someone deleted it, or, cut past its headers, to kill the process with SIGBUS: the load now compiles
    it once more, replacing the file in place, and the kernels run. Empty, cut inside its code, and one byte short."""
    path = native.build(native.cache_dir(), env)  # built, not loaded: this process has not mapped the file
    size = path.stat().st_size
    path.write_bytes(path.read_bytes()[:keep])
    kernels = native.load(torch.float32)
    assert kernels is not None, native.why_not(torch.float32)
    assert kernels.path == path and path.stat().st_size == size
    assert not _notes(caplog) and any("did not load" in n for n in _notes(caplog, logging.DEBUG))
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary left beside it
    _works(kernels)


def test_a_build_that_never_loads_is_rebuilt_once_then_off_with_one_line(env, tmp_path, monkeypatch, caplog) -> None:
    """A compiler whose every output is cut short: the cached file is rebuilt once (not in a loop), and then the
    kernels are off with the one usual log line."""
    count = tmp_path / "compiles"
    cc = _script(tmp_path / "short-cc", f"""[ "$1" = --version ] && exec {_real_cc()} "$@"
echo x >> {count}
{_real_cc()} "$@" || exit $?
for a; do out=$a; done
head -c 1000 "$out" > "$out.short" && mv "$out.short" "$out"
""")
    monkeypatch.setenv("CC", str(cc))
    native.build(native.cache_dir(), env)
    assert len(count.read_text().split()) == 1
    assert native.load(torch.float32) is None
    assert len(count.read_text().split()) == 2
    notes = _notes(caplog)
    assert len(notes) == 1 and notes[0].startswith("native kernels off: ") and "\n" not in notes[0], notes
    assert native.load(torch.float32) is None and len(count.read_text().split()) == 2  # asked again: no rebuild


def test_a_build_that_lacks_a_library_is_not_rebuilt_on_every_load(env, tmp_path, monkeypatch, caplog) -> None:
    """A load that fails for what the build needs (a library gone; on macOS, an OpenMP symbol) is no damage: a second
    compile would fail the same way, so it is not paid for on every start."""
    count, lib = tmp_path / "compiles", tmp_path / "libs"
    cc = _script(tmp_path / "needy-cc", f"""[ "$1" = --version ] && exec {_real_cc()} "$@"
echo x >> {count}
mkdir -p {lib} && echo 'int m31r_gone(void) {{ return 1; }}' > {lib}/gone.c
{_real_cc()} -shared -fPIC {lib}/gone.c -o {lib}/libgone.so || exit $?
{_real_cc()} "$@" -L{lib} -Wl,--no-as-needed -lgone -Wl,-rpath,{lib} || exit $?
rm {lib}/libgone.so
""")
    monkeypatch.setenv("CC", str(cc))
    native.build(native.cache_dir(), env)
    assert native.load(torch.float32) is None
    assert len(count.read_text().split()) == 1, "rebuilt for a library the build lacks"
    notes = _notes(caplog)
    assert len(notes) == 1 and "libgone" in notes[0], notes


# -- (2) CC with arguments --------------------------------------------------------------------------------------


def test_cc_with_arguments_is_honoured_and_keys_the_cache(env, tmp_path, monkeypatch, caplog) -> None:
    """CC="ccache gcc" and CC="gcc -m64" (a launcher, or flags, beside the compiler) used to be dropped for `cc`
    without a word: the whole command builds now, and is part of the cache key."""
    real = _real_cc()
    plain = native.build(tmp_path / "cache", env)
    calls = tmp_path / "calls"
    launcher = _script(tmp_path / "launch", f'echo "$@" >> {calls}\nexec "$@"\n')  # what ccache does, less the cache
    monkeypatch.setenv("CC", f"{launcher} {real}")
    assert native.compiler() == f"{launcher} {real}"
    kernels = native.load(torch.float32)
    assert kernels is not None, native.why_not(torch.float32)
    lines = calls.read_text().splitlines()
    assert f"{real} --version" in lines
    assert [line for line in lines if line.startswith(f"{real} ") and f"{native.FAMILIES[env].source} -o " in line]
    _works(kernels)
    monkeypatch.setenv("CC", f"{real} -DM31R_S44_CC_FLAG")
    flagged = native.build(tmp_path / "cache", env)
    assert len({plain, flagged, native.build(tmp_path / "cache", env)}) == 2
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([plain.name, flagged.name])
    assert not _notes(caplog)


def test_a_cc_that_cannot_be_used_is_said_once(env, tmp_path, monkeypatch, caplog) -> None:
    """A $CC whose program is not there, or that does not split into words, falls back to cc, gcc or clang as
    before, and one log line says so; a path with spaces that names a program is still that program."""
    real = _real_cc()
    monkeypatch.setenv("CC", "m31r-no-such-compiler -O2")
    assert native.compiler() == real and native.compiler() == real
    monkeypatch.setenv("CC", "gcc 'unclosed")
    assert native.compiler() == real
    notes = _notes(caplog)
    assert len(notes) == 2, notes
    assert notes[0].startswith("CC=m31r-no-such-compiler -O2 is not used: m31r-no-such-compiler not found; ")
    assert notes[1].startswith("CC=gcc 'unclosed is not used: cannot be split into words")
    spaced = tmp_path / "my tools" / "cc"
    spaced.parent.mkdir()
    spaced.symlink_to(real)
    monkeypatch.setenv("CC", str(spaced))
    assert native.compiler() == str(spaced)
    assert native.build(tmp_path / "cache", env).is_file()


# -- (3) a compiler that hangs ----------------------------------------------------------------------------------


def test_a_hung_compiler_is_killed_and_turns_the_kernels_off(env, tmp_path, monkeypatch, caplog) -> None:
    """A compiler that never finishes used to hang the daemon's start: past the timeout its process group (the
    driver and what it started) is killed, and the kernels are off with the usual one line."""
    pid = tmp_path / "child"
    cc = _script(tmp_path / "hung-cc", f"""[ "$1" = --version ] && {{ echo hung-cc 1.0; exit 0; }}
sleep 60 &
echo $! > {pid}
wait
exit 1
""")
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 5.0, raising=False)
    assert native.load(torch.float32) is None
    why = native.why_not(torch.float32)
    assert why == f"{cc} on {native.FAMILIES[env].source.name} did not finish in 5 s (killed)", why
    notes = _notes(caplog)
    assert len(notes) == 1 and notes[0].startswith(f"native kernels off: {why}"), notes
    stat = Path(f"/proc/{pid.read_text().strip()}/stat")
    for _ in range(100):  # the killed child (the compiler's cc1, here a sleep) is gone, or at most a zombie
        if not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] in "ZX":
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the compiler's child outlived the timeout: {stat.read_text()}")


# -- (4) a compile that fails -----------------------------------------------------------------------------------


def test_a_failed_compile_gives_a_one_line_reason_and_the_full_output_at_debug(env, tmp_path, monkeypatch,
                                                                                 caplog) -> None:
    """A source that does not compile: the reason (and the one INFO line) is the compiler's first error line, not
    up to 2,000 characters of its output; the whole output goes to the DEBUG log."""
    family = native.FAMILIES[env]
    src = tmp_path / "src"
    src.mkdir()
    for p in [family.source, *family.source.parent.glob("kernels*.h")]:
        shutil.copy(p, src / p.name)
    broken = src / family.source.name
    broken.write_text(broken.read_text() + "\nint m31r_s44_a = m31r_s44_undeclared_a;\n"
                      "int m31r_s44_b = m31r_s44_undeclared_b;\n")
    monkeypatch.setitem(native.FAMILIES, env, dataclasses.replace(family, source=broken))
    assert native.load(torch.float32) is None
    why = native.why_not(torch.float32)
    assert "\n" not in why and len(why) < 500 and "error" in why and "m31r_s44_undeclared_a" in why, why
    assert "m31r_s44_undeclared_b" not in why
    notes = _notes(caplog)
    assert len(notes) == 1 and notes[0].startswith(f"native kernels off: {why}"), notes
    debug = "\n".join(_notes(caplog, logging.DEBUG))
    assert "m31r_s44_undeclared_a" in debug and "m31r_s44_undeclared_b" in debug

"""The native kernels' OpenMP runtime on Linux when the compiler is not GCC.

The kernels run their loops on torch's OpenMP threads, so torch.set_num_threads (the daemon's thread count) bounds
them. torch's Linux wheel runs GCC's libgomp; clang's -fopenmp links LLVM's libomp instead, whose ABI libgomp does
not provide: loaded, such a build brought a second thread pool that ignored torch's thread count, and a clang without
libomp installed failed to link and left no kernels at all. Either way the one-thread build now runs, and its reason
says why. Builds go to a temporary cache; the compilers are the system's, behind a small script where one must fail."""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m31r import native

AVX2 = "avx2"


@pytest.fixture
def env(tmp_path, monkeypatch, caplog):
    """A fresh `native.load` of the avx2 family on x86-64 Linux, into a temporary cache."""
    if sys.platform != "linux" or native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the libgomp/libomp question is Linux's; the x86 families are built for x86-64 Linux")
    why = native.family_unsupported(AVX2)
    if why is not None:
        pytest.skip(f"the avx2 kernels do not run here: {why}")
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    monkeypatch.setenv("M31R_KERNELS", AVX2)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    caplog.set_level(logging.INFO, logger="m31r.native")
    native.load.cache_clear()
    yield
    native.load.cache_clear()


def _operands() -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(46)
    x, w = torch.randn(3, 256, generator=gen), torch.randn(64, 256, generator=gen)
    codes = torch.randint(-127, 128, (64, 256), generator=gen, dtype=torch.int8)
    return x, w, codes, (torch.rand(64, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)


@pytest.fixture(scope="module")
def threaded() -> native.Kernels | None:
    """The avx2 family's threaded build as the suite's other tests get it (the usual cache, usually built already),
    where it runs on torch's runtime; None elsewhere."""
    if native.family_unsupported(AVX2) is not None or native.compiler() is None:
        return None
    path = native.build(family=AVX2)
    return None if native._second_runtime(path) else native.Kernels(path, AVX2)


def _same_bits(kernels: native.Kernels, threaded: native.Kernels | None) -> None:
    """One thread or many, a column's bits are the threaded build's (kernels_avx2.c)."""
    if threaded is None:
        return
    x, w, codes, scales = _operands()
    assert torch.equal(kernels.f32_mm(x, w), threaded.f32_mm(x, w))
    assert torch.equal(kernels.int8_mm(x, codes, scales), threaded.int8_mm(x, codes, scales))


def test_clang_builds_run_on_torchs_threads_or_one(env, monkeypatch, threaded) -> None:
    """CC=clang: the kernels never run more threads than torch is set to (they ran libomp's own team, one per CPU,
    whatever torch.set_num_threads said), and the library links no OpenMP runtime torch does not run."""
    clang = shutil.which("clang")
    if clang is None:
        pytest.skip("needs clang")
    monkeypatch.setenv("CC", clang)
    kernels = native.load(torch.float32)
    assert kernels is not None, native.why_not(torch.float32)
    before = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert kernels.threads <= n, kernels.reason
    finally:
        torch.set_num_threads(before)
    torch_cpu = next(p for p in native.loaded_libraries() if p.name.startswith("libtorch_cpu"))
    runtimes = [n for n in native.elf_needed(kernels.path) if "omp" in n]
    assert set(runtimes) <= set(native.elf_needed(torch_cpu)), runtimes
    assert kernels.reason.startswith(f"forced by M31R_KERNELS={AVX2}; one thread: its OpenMP build "), kernels.reason
    assert "CC=gcc" in kernels.reason or "failed" in kernels.reason
    _same_bits(kernels, threaded)


def _wrapper(tmp_path: Path, message: str, when: str) -> tuple[Path, Path]:
    """A compiler that fails with `message` on stderr when an argument equals `when`, else runs the system's; it
    counts its compiles (not its --version runs) in the returned file."""
    real = next((p for p in map(shutil.which, ("gcc", "cc", "clang")) if p), None)
    if real is None:
        pytest.skip("no C compiler")
    count = tmp_path / "compiles"
    count.write_text("")
    script = tmp_path / "cc-wrapper"
    script.write_text(f"""#!/bin/sh
[ "$1" = --version ] || echo x >> '{count}'
for a in "$@"; do
  if [ "$a" = '{when}' ]; then printf '%s\\n' {" ".join(repr(line) for line in message.splitlines())} >&2; exit 1; fi
done
exec '{real}' "$@"
""")
    script.chmod(0o755)
    return script, count


def test_a_compiler_that_cannot_link_openmp_runs_the_one_thread_build(env, tmp_path, monkeypatch, caplog,
                                                                          threaded) -> None:
    """clang without libomp installed ("cannot find -lomp") left the kernels off on Linux; the one-thread build now
    runs, one INFO line says why, and its bits are the threaded build's."""
    cc, count = _wrapper(tmp_path, "/usr/bin/ld: cannot find -lomp: No such file or directory\n"
                                   "clang: error: linker command failed with exit code 1", "-fopenmp")
    monkeypatch.setenv("CC", str(cc))
    kernels = native.load(torch.float32)
    assert kernels is not None, native.why_not(torch.float32)
    assert kernels.threads == 1
    assert kernels.reason == (f"forced by M31R_KERNELS={AVX2}; one thread: its OpenMP build failed ({cc} failed on "
                              "kernels_avx2.c: clang: error: linker command failed with exit code 1)")
    notes = [r.getMessage() for r in caplog.records if r.name == "m31r.native"]
    assert notes == [f"native kernels on one thread: {kernels.reason.split('; one thread: ')[1]}"], notes
    assert len(count.read_text().split()) == 2  # the OpenMP build, then the one-thread one
    _same_bits(kernels, threaded)


def test_a_compile_error_not_about_openmp_is_not_tried_again(env, tmp_path, monkeypatch) -> None:
    """Any other failure would fail the one-thread build the same way: one compile, and its reason."""
    cc, count = _wrapper(tmp_path, "cc1: error: unrecognized command-line option '-mavx2'\ncompilation terminated.",
                         "-mavx2")
    monkeypatch.setenv("CC", str(cc))
    assert native.load(torch.float32) is None
    assert native.why_not(torch.float32) == (f"{cc} failed on kernels_avx2.c: cc1: error: unrecognized command-line "
                                             "option '-mavx2'")
    assert len(count.read_text().split()) == 1


def test_elf_needed_reads_what_readelf_reads(tmp_path, threaded) -> None:
    """The DT_NEEDED list the runtime check compares, against binutils' readelf, for a build and for torch's
    libtorch_cpu (hundreds of MB, mapped); a file that is not a whole ELF is no list, not an error."""
    if sys.platform != "linux" or shutil.which("readelf") is None or threaded is None:
        pytest.skip("needs Linux, readelf and the avx2 kernels on torch's runtime")
    torch_cpu = next(p for p in native.loaded_libraries() if p.name.startswith("libtorch_cpu"))
    for path in (threaded.path, torch_cpu):
        text = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
        want = [line.split("[", 1)[1].rstrip("]") for line in text.splitlines() if "(NEEDED)" in line]
        assert want and native.elf_needed(path) == want
    if torch.backends.openmp.is_available():
        assert any(n.startswith(("libgomp", "libomp", "libiomp")) for n in native.elf_needed(torch_cpu))
    with open(torch_cpu, "rb") as f:
        (tmp_path / "short.so").write_bytes(f.read(100))  # its header, not its section headers
    (tmp_path / "text.so").write_text("not a library")
    (tmp_path / "empty.so").write_bytes(b"")
    for name in ("short.so", "text.so", "empty.so", "missing.so"):
        assert native.elf_needed(tmp_path / name) == []

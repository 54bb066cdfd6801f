"""The native kernels' threads: which OpenMP runtime a build runs its loops on, and the one-thread build.

On Linux a build links libgomp by soname and so shares torch's loaded copy: its team follows torch.set_num_threads.
On macOS (Apple's clang has no OpenMP runtime) a build is compiled with `-Xclang -fopenmp`, links no runtime and binds
to torch's libomp when it loads. That recipe is run here with Debian's clang and LLVM's libomp, GNU ld's `-z now`
standing in for `-bind_at_load` (a shared library's undefined symbols are left to load time on Linux anyway, as
`-undefined dynamic_lookup` leaves them on macOS). Where the runtime is missing, or that build fails, the one-thread
build runs, and the reason says so; both paths are taken here with the system's gcc."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from m31r import native

PACKAGES = "clang libomp-dev"
LLVM_OMP = "libomp.so.5"


def fp32_family() -> native.Family:
    family, why = native.choose(torch.float32)
    if family is None or family.dtype != torch.float32 or native.compiler() is None:
        pytest.skip(f"no fp32 kernel family runs here: {why}")
    return family


def _operands(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 256, generator=gen)
    w = torch.randn(512, 256, generator=gen)
    codes = torch.randint(-128, 128, (512, 256), generator=gen, dtype=torch.int8)
    scales = (torch.rand(512, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return x, w, codes, scales


def test_a_linux_build_runs_on_torchs_openmp_threads() -> None:
    """The kernels' team is torch's: one runtime, so torch.set_num_threads sets both."""
    if sys.platform != "linux":
        pytest.skip(f"the shared-soname runtime is Linux's (this is {sys.platform})")
    family = fp32_family()
    kernels = native.Kernels(native.build(family=family.name), family)
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert kernels.threads == n
        assert kernels.describe().endswith("; 3 threads")
    finally:
        torch.set_num_threads(before)


def test_the_one_thread_build_gives_the_same_bits(tmp_path) -> None:
    """What a Mac without torch's libomp runs: no OpenMP at all, one thread whatever torch's setting, and the
    threaded build's results bit for bit (each column block's sums do not depend on which thread ran it)."""
    family = fp32_family()
    threaded = native.Kernels(native.build(tmp_path, family.name), family)
    alone = native.Kernels(native.build(tmp_path, family.name, openmp=False), family)
    assert alone.path != threaded.path and alone.threads == 1 and alone.describe().endswith("; 1 thread")
    x, w, codes, scales = _operands()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(alone.f32_mm(x, w), threaded.f32_mm(x, w))
        assert torch.equal(alone.int8_mm(x, codes, scales), threaded.int8_mm(x, codes, scales))
    finally:
        torch.set_num_threads(before)


def test_macos_falls_back_to_one_thread_and_says_why(tmp_path, monkeypatch) -> None:
    """`open_family` as on macOS, with this machine's gcc: without torch's libomp among the loaded images it builds
    without OpenMP; with a runtime but a compiler that refuses `-Xclang` (GCC), the OpenMP build fails to compile and
    the one-thread build runs. Either way the engine gets kernels, and their reason says why they run alone."""
    family = fp32_family()
    if "clang" in Path(native.compiler() or "").name:
        pytest.skip("needs a compiler without clang's front-end flags (gcc)")
    monkeypatch.setattr(native, "openmp_runtime", lambda system=sys.platform: None)
    kernels = native.open_family(family, "chosen", "darwin", tmp_path)
    assert kernels.threads == 1
    assert kernels.reason == "chosen; one thread: torch's OpenMP runtime (libomp) is not loaded"
    gomp = next(p for p in native.loaded_libraries() if p.name.startswith("libgomp"))  # torch's, for a runtime
    monkeypatch.setattr(native, "openmp_runtime", lambda system=sys.platform: gomp)
    kernels = native.open_family(family, "chosen", "darwin", tmp_path)
    assert kernels.threads == 1 and kernels.reason.startswith("chosen; one thread: its OpenMP build failed (")
    assert "Xclang" in kernels.reason


def test_openmp_runtime_is_one_loaded_file(monkeypatch) -> None:
    """The runtime a macOS build binds to is the one file torch loaded; none, or two copies (which libomp refuses
    to run beside each other), is no runtime."""
    one, other = Path("/t/torch/lib/libomp.dylib"), Path("/u/.dylibs/libomp.dylib")
    for images, want in (([Path("/t/libtorch_cpu.dylib"), one], one), ([one], one), ([], None), ([one, other], None)):
        monkeypatch.setattr(native, "loaded_libraries", lambda system="darwin", images=images: images)
        assert native.openmp_runtime("darwin") == want
    def unreadable(system: str = "darwin") -> list[Path]:
        raise OSError("no libSystem here")

    monkeypatch.setattr(native, "loaded_libraries", unreadable)  # a list it cannot read is no runtime, not a failure
    assert native.openmp_runtime("darwin") is None
    monkeypatch.setattr(native, "loaded_libraries", lambda system="darwin": [one])
    monkeypatch.setattr(torch.backends.openmp, "is_available", lambda: False)
    assert native.openmp_runtime("darwin") is None


_CLANG_RUN = r"""
import ctypes, json, sys
from pathlib import Path
import torch
from m31r import native
lib, gcc_lib = Path(sys.argv[1]), Path(sys.argv[2])
try:
    ctypes.CDLL(str(lib))
    unbound = None
except OSError as e:
    unbound = str(e)
ctypes.CDLL("libomp.so.5")  # the process's runtime, as torch's libomp is on a Mac (loaded, not global)
runtime = native.openmp_runtime("linux", ("libomp.so.5",))
ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)  # what native.open_family does on macOS
clang, gcc = native.Kernels(lib, "avx2"), native.Kernels(gcc_lib, "avx2")
gen = torch.Generator().manual_seed(1)
x, w = torch.randn(8, 256, generator=gen), torch.randn(512, 256, generator=gen)
codes = torch.randint(-128, 128, (512, 256), generator=gen, dtype=torch.int8)
scales = (torch.rand(512, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
print(json.dumps({"unbound": unbound, "runtime": str(runtime), "threads": clang.threads,
                  "f32": torch.equal(clang.f32_mm(x, w), gcc.f32_mm(x, w)),
                  "int8": torch.equal(clang.int8_mm(x, codes, scales), gcc.int8_mm(x, codes, scales))}))
"""


def test_the_macos_recipe_binds_to_the_loaded_runtime(tmp_path) -> None:
    """The macOS build's flags with clang: OpenMP code generation only, no runtime linked. Loaded before any runtime
    is global, it fails to load (an exception, which `open_family` turns into the one-thread build), not at its first
    call; with the process's libomp made global it runs its loops on that runtime's team, and gives the gcc build's
    bits. Needs Debian's clang and libomp-dev (.ci/run installs them)."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"the recipe is tried with Debian's clang on x86-64 Linux (this is {sys.platform})")
    if native.family_unsupported("avx2") is not None:
        pytest.skip(f"avx2: {native.family_unsupported('avx2')}")
    clang = shutil.which("clang")
    probe = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    if clang is None or LLVM_OMP not in probe:
        pytest.fail(f"clang and LLVM's {LLVM_OMP} are needed: apt-get install --no-install-recommends {PACKAGES} "
                    "(Debian/Ubuntu; .ci/run does)")
    family = native.FAMILIES["avx2"]
    mac = native.flags_for(family, {"avx2", "fma", "f16c"}, "darwin")
    flags = [f for f in mac if not f.startswith("-Wl,")] + ["-Wl,-z,now"]
    assert "-Xclang" in flags and "-fopenmp" in flags
    lib = tmp_path / "kernels-avx2-macos-recipe.so"
    done = subprocess.run([clang, *flags, str(family.source), "-o", str(lib)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    undefined = subprocess.run(["nm", "-D", "--undefined-only", str(lib)], capture_output=True, text=True,
                               check=True).stdout
    assert "__kmpc_fork_call" in undefined and "omp_get_max_threads" in undefined
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "libomp" not in needed and "libgomp" not in needed  # no runtime of its own
    gcc_lib = native.build(tmp_path, "avx2")
    run = subprocess.run([sys.executable, "-c", _CLANG_RUN, str(lib), str(gcc_lib)], capture_output=True, text=True,
                         check=False, env={"OMP_NUM_THREADS": "2", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert got["unbound"] is not None and "__kmpc" in got["unbound"]
    assert got["runtime"].endswith(LLVM_OMP) and got["threads"] == 2
    assert got["f32"] and got["int8"]

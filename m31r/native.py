"""The native CPU kernels: built once with the system C compiler, cached, loaded through ctypes.

Five families, chosen at run time by the CPU's features (never assumed):

  avx512  m31r/kernels.c, for bf16 activations: decode attention over a bf16 KV cache, and the weight-only int8
          matmul of small row counts (AVX512-BF16 dot products; `Kernels.int8_dtype` is None without them).
  avx2    m31r/kernels_avx2.c (AVX2 + FMA + F16C: most laptops), for fp32 activations, which is what the engine
          runs where bf16 is not native: decode attention over an fp32 KV cache, and weight-only matmuls of small
          row counts: int8 on activations quantized to int16 in blocks of 32 (q16, accurate enough for greedy
          decoding to keep fp32's choices), int4 on activations quantized to int8 in blocks of 32 (q8, llama.cpp's
          q8_0 idea), and fp32 weights (`f32_mm`: a summation order that no row count changes, so an fp32 row
          gets the same bits alone or batched). The q8 int8 kernel stays for comparison (`int8_mm(..., mode="q8")`).
  avx512vnni  the same source built with AVX-512 VNNI (Intel since Cascade Lake, AMD since Zen 4): the avx2 family
          with one change, its q16 int8 matmul, which runs two rows per 512-bit register (half the instructions per
          row for batched decode rows) and keeps the avx2 build's bits (kernels_avx2.c's Q16P tiles say how); its
          256-bit integer dot products are vpdpwssd / vpdpbusd, as in avx2vnni. auto prefers it for fp32.
  avx2vnni  the same source built with -mavxvnni, where the CPU has AVX-VNNI (Intel since Alder Lake, AMD since
          Zen 5): each block's integer dot product takes vpdpwssd / vpdpbusd, fewer instructions for the same
          exact int32 sums, so its results are the avx2 build's bit for bit (kernels_avx2.c says why).
  neon    m31r/kernels_neon.c (aarch64: Linux, and macOS without OpenMP), the avx2 family's functions in NEON, down to
          its bits. Built with -march=armv8.2-a+dotprod where the CPU lists the dot-product extension (asimddp:
          sdot for the q8 products; FEAT_DotProd is an Armv8.2 option, and GCC's arm_neon.h offers vdotq_s32 only
          from armv8.2-a), else with plain -march=armv8-a, which every aarch64 CPU runs (`flags_for`). Tested on
          x86-64 by cross-compiling and running under qemu-user (tests/test_native_neon.py).

`Kernels.int8_check` is the start-up self-check `--quant auto` relies on before it picks int8 for fp32 engines: a
small product against a float64 reference, within the error its activation rounding allows.

`M31R_KERNELS` picks one: `auto` (default: the widest family this CPU runs), `avx512`, `avx512vnni`, `avx2vnni`,
`avx2` (plain AVX2 even where the CPU has AVX-VNNI), `neon` (a family the CPU lacks is refused, never run), or
`eager` (none: torch only).
`M31R_NATIVE=0` is the older spelling of `eager`. Under `auto`, a compiler that cannot build avx2vnni (GCC < 11,
clang < 12 lack -mavxvnni) or avx512vnni leaves the plain avx2 build running, with the reason said.

Building takes ~0.3 s and happens the first time an engine loads on a machine (the shared object is cached under
$XDG_CACHE_HOME/m31r/kernels, keyed by the source, the compiler and the flags), so from the first request on a
daemon runs one arithmetic and never switches. Where no family runs, no C compiler exists or the build fails,
`load` returns None and the engine keeps its eager path (the reason is logged once, and `why_not` says it).

The kernels run on torch's OpenMP threads, not on a second pool competing with them for the cores. On Linux the
library is linked with -fopenmp and so needs libgomp.so.1: torch has loaded its own copy by then, and the dynamic
loader reuses a loaded library of the same soname. clang's -fopenmp links LLVM's libomp instead, whose ABI libgomp
lacks: that build, which would run a second thread pool ignoring torch's thread count, is not loaded (`elf_needed`
says what a build links), and the one-thread build runs, as it does where the OpenMP build cannot link at all (clang
without libomp installed). Apple's clang ships no OpenMP runtime or header, but torch's macOS
wheels carry libomp.dylib: there the library is compiled with `-Xclang -fopenmp`, links no runtime, and binds its
OpenMP calls when it loads to the libomp torch has loaded (`openmp_runtime`, made global first). Where that runtime
is not found, or that build does not compile or load, the one-thread build (no OpenMP) runs, and `Kernels.reason`
says why; `Kernels.threads` says how many threads a build's loops run on.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import logging
import mmap
import os
import platform
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from m31r.cpu import cpu_info

log = logging.getLogger("m31r.native")

_COMMON = ["-O3", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC"]
# macOS: OpenMP code generation without a runtime of its own; the runtime's symbols are bound at load time (not
# lazily, so that a missing one fails the load, not a call) to the libomp torch loaded.
_OPENMP_MACOS = ("-Xclang", "-fopenmp", "-Wl,-undefined,dynamic_lookup", "-Wl,-bind_at_load")


@dataclass(frozen=True)
class Family:
    name: str
    source: Path
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]  # /proc/cpuinfo flags it needs
    torch_caps: tuple[str, ...]  # torch.backends.cpu.get_cpu_capability() values that have them (empty: no say)
    dtype: torch.dtype  # the activation (and KV cache) dtype its kernels take
    base: str  # the family whose source and entry points it has (itself, or the one auto falls back to)
    machines: tuple[str, ...] = ("x86_64", "amd64")  # platform.machine() values it is written for
    arch: str = "x86-64"
    platforms: tuple[str, ...] = ("linux",)  # sys.platform values it is built and tested for
    # (CPU flag, compiler flags used instead of `flags` where the CPU has it): the first that applies wins
    variants: tuple[tuple[str, tuple[str, ...]], ...] = ()


_AVX2_CAPS = ("AVX2", "AVX512", "AVX512_BF16", "AMX")
_AVX2_FLAGS = ("-mavx2", "-mfma", "-mf16c")
# Widest first: `auto` takes the first this CPU runs (for the engine's activation dtype).
FAMILIES = {
    "avx512": Family("avx512", Path(__file__).with_name("kernels.c"),
                     ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma", *_COMMON),
                     ("avx512f", "avx512bw", "avx512vl"), ("AVX512", "AVX512_BF16", "AMX"), torch.bfloat16,
                     "avx512"),
    "avx512vnni": Family("avx512vnni", Path(__file__).with_name("kernels_avx2.c"),
                         (*_AVX2_FLAGS, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", *_COMMON),
                         ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
                         ("AVX512", "AVX512_BF16", "AMX"), torch.float32, "avx2"),
    "avx2vnni": Family("avx2vnni", Path(__file__).with_name("kernels_avx2.c"), (*_AVX2_FLAGS, "-mavxvnni", *_COMMON),
                       ("avx2", "fma", "f16c", "avx_vnni"), _AVX2_CAPS, torch.float32, "avx2"),
    "avx2": Family("avx2", Path(__file__).with_name("kernels_avx2.c"), (*_AVX2_FLAGS, *_COMMON),
                   ("avx2", "fma", "f16c"), _AVX2_CAPS, torch.float32, "avx2"),
    # torch has no capability level for NEON (it is aarch64's baseline), so only the CPU's flags decide.
    "neon": Family("neon", Path(__file__).with_name("kernels_neon.c"), ("-march=armv8-a", *_COMMON), ("asimd",), (),
                   torch.float32, "neon", ("aarch64", "arm64"), "aarch64", ("linux", "darwin"),
                   (("asimddp", ("-march=armv8.2-a+dotprod", *_COMMON)),)),
}
CHOICES = ("auto", *FAMILIES, "eager")
# Kept for callers of the single-family API: the AVX-512 family's source and flags.
SOURCE = FAMILIES["avx512"].source
FLAGS = list(FAMILIES["avx512"].flags)
_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class Mat(ctypes.Structure):
    """One weight matrix as m31r_decode_layer_f32 takes it (kernels_avx2.c's m31r_mat): its kind, shape and data."""

    _fields_ = [("kind", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("group", ctypes.c_int32),
                ("w", ctypes.c_int64), ("scale", ctypes.c_int64), ("base", ctypes.c_int64)]


MAT_F32, MAT_INT4 = 0, 4
MAT_INT8 = {"q16": 1, "q8": 2, "f32": 3}  # by the int8 activation mode
INT8_MODES = ("q16", "q8", "f32")  # the avx2 and neon int8 matmuls (Kernels.int8_mm); q16 is the one engines run
# Activation rounding step per block of 32, relative to the block's max |x| (Kernels.int8_check).
ACTIVATION_STEP = {"q16": 1 / 32767, "q8": 1 / 127}
# The longest context every family's decode attention takes (MAX_KEYS in kernels.c, kernels_avx2.c, kernels_neon.c:
# each head's scores sit on its thread's stack); rows_ok refuses longer ones.
MAX_KEYS = 65536


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "m31r" / "kernels"


def requested() -> str:
    """The family asked for by the environment: M31R_KERNELS (auto by default), or eager under M31R_NATIVE=0."""
    if os.environ.get("M31R_NATIVE", "1") == "0":
        return "eager"
    return os.environ.get("M31R_KERNELS", "auto").strip().lower() or "auto"


_OS_NAMES = {"linux": "Linux", "darwin": "macOS"}


def family_unsupported(name: str) -> str | None:
    """Why this CPU cannot run a family, or None. Both the CPU's flags (/proc/cpuinfo, sysctl) and torch's own
    detection (where it has one for the family) must have its instructions, on the family's architecture and OS:
    the x86 families on Linux, neon on Linux and macOS."""
    family = FAMILIES[name]
    if sys.platform not in family.platforms:
        return f"built for {' and '.join(_OS_NAMES[p] for p in family.platforms)} only (this is {sys.platform})"
    if platform.machine().lower() not in family.machines:
        return f"{family.arch} only (this is {platform.machine()})"
    _, flags, _ = cpu_info()
    missing = [f for f in family.cpu_flags if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    cap = torch.backends.cpu.get_cpu_capability()
    if family.torch_caps and cap not in family.torch_caps:
        return f"torch reports CPU capability {cap}"
    return None


def flags_for(family: Family, cpu_flags: set[str], system: str = sys.platform, openmp: bool = True) -> tuple[str, ...]:
    """The compiler flags that build `family` for a CPU with these flags: its first variant whose CPU flag is there
    (neon: dot products where asimddp is), else its plain flags. OpenMP as the system needs it (macOS: bound to
    torch's libomp, see the module's docstring); `openmp=False` is the one-thread build, whose `#pragma omp` lines
    are ignored."""
    flags = next((extra for flag, extra in family.variants if flag in cpu_flags), family.flags)
    if openmp and system != "darwin":
        return flags
    plain = tuple(f for f in flags if f != "-fopenmp")
    return (*plain, *_OPENMP_MACOS) if openmp else plain


def loaded_libraries(system: str = sys.platform) -> list[Path]:
    """The shared libraries this process has loaded (macOS: dyld's images; Linux: /proc/self/maps)."""
    if system == "darwin":
        dyld = ctypes.CDLL("/usr/lib/libSystem.B.dylib")
        dyld._dyld_image_count.restype = ctypes.c_uint32
        dyld._dyld_get_image_name.restype = ctypes.c_char_p
        dyld._dyld_get_image_name.argtypes = [ctypes.c_uint32]
        names = (dyld._dyld_get_image_name(i) for i in range(dyld._dyld_image_count()))
        return [Path(os.fsdecode(n)) for n in names if n]
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return []
    fields = (line.split(None, 5) for line in maps)  # address, perms, offset, device, inode, path
    return list(dict.fromkeys(Path(f[5]) for f in fields if len(f) == 6 and f[5].startswith("/")))


def openmp_runtime(system: str = sys.platform, names: tuple[str, ...] = ("libomp.dylib",)) -> Path | None:
    """The OpenMP runtime torch has loaded, which a macOS build binds to, or None (torch without OpenMP). One file
    only: loading a second copy of libomp aborts the process."""
    if not torch.backends.openmp.is_available():
        return None
    try:
        found = [p for p in loaded_libraries(system) if p.name in names]
    except (OSError, AttributeError, ValueError):  # no dyld list to read: the one-thread build, not no kernels
        return None
    return found[0] if len({p.resolve() for p in found}) == 1 else None


def forced() -> Family | None:
    """The family M31R_KERNELS names, where this CPU runs it; None for auto, eager, or one it cannot run."""
    want = requested()
    if want in FAMILIES and family_unsupported(want) is None:
        return FAMILIES[want]
    return None


def choose(dtype: torch.dtype | None = None) -> tuple[Family | None, str]:
    """(the family to run, why): the one M31R_KERNELS names, or with auto the widest this CPU runs, preferring one
    whose kernels take `dtype` activations (an AVX-512 CPU without bf16 serves fp32 and then runs the avx2 family)."""
    want = requested()
    if want not in CHOICES:
        return None, f"M31R_KERNELS={want} is not one of {', '.join(CHOICES)}"
    if want == "eager":
        how = "M31R_NATIVE=0" if os.environ.get("M31R_NATIVE", "1") == "0" else "M31R_KERNELS=eager"
        return None, f"disabled by {how}"
    if want != "auto":
        why = family_unsupported(want)
        if why:
            return None, f"M31R_KERNELS={want}, but {why}"
        return FAMILIES[want], f"forced by M31R_KERNELS={want}"
    reasons, runs = [], []
    for name in FAMILIES:
        why = family_unsupported(name)
        if why is None:
            runs.append(FAMILIES[name])
        else:
            reasons.append(f"no {name}: {why}")
    if not runs:
        return None, "; ".join(reasons)
    # The first (widest) of the dtype's families: where that is the widest of all (avx2vnni before avx2 on an AVX-VNNI
    # laptop), the search must stop there, not go on to a narrower one of the same dtype.
    family = next((f for f in runs if f.dtype == dtype), runs[0])
    if family is not runs[0]:
        return family, f"the widest family this CPU runs for {str(dtype).removeprefix('torch.')} activations"
    return runs[0], "the widest family this CPU runs"


def unavailable() -> str | None:
    """Why no native kernels can run here, or None."""
    family, why = choose()
    if family is None:
        return why
    if compiler() is None:
        return "no C compiler found (set CC)"
    return None


def compiler_command() -> list[str] | None:
    """The C compiler as a command: $CC where its program is found (its words shlex-split: `ccache gcc`, `gcc -m64`
    are common; a path with spaces that names a program is one word), else cc, gcc or clang. A $CC that cannot be
    used is said once in the log, not silently replaced."""
    cc = os.environ.get("CC", "").strip()
    if cc and (cmd := _cc_command(cc))[0] is not None:
        return cmd[0]
    found = next((p for p in map(shutil.which, ("cc", "gcc", "clang")) if p), None)
    if cc and cc not in _cc_told:
        _cc_told.add(cc)
        log.info("CC=%s is not used: %s; native kernels build with %s", cc, cmd[1], found or "no compiler")
    return [found] if found else None


def _cc_command(cc: str) -> tuple[list[str] | None, str]:
    """$CC as a command (its program's path first), or None and why it cannot be used."""
    if whole := shutil.which(cc):
        return [whole], ""
    try:
        words = shlex.split(cc)
    except ValueError as e:
        return None, f"cannot be split into words ({e})"
    if not words:
        return None, "no program named"
    program = shutil.which(words[0])
    return ([program, *words[1:]], "") if program else (None, f"{words[0]} not found")


def cc_problem() -> str | None:
    """Why $CC cannot be used (compiler_command then builds with cc, gcc or clang), or None where it can or is unset:
    `m31r doctor` says it, as a typo in CC otherwise went unnoticed."""
    cc = os.environ.get("CC", "").strip()
    return None if not cc else _cc_command(cc)[1] or None


_cc_told: set[str] = set()  # the $CC values `compiler_command` has said it cannot use


def compiler() -> str | None:
    """The C compiler command as one string (a program's path, or $CC's words with its program's path first)."""
    cmd = compiler_command()
    return None if cmd is None else " ".join(cmd)


def int8_supported() -> bool:
    """Whether this CPU runs the AVX-512 family's int8 matmul: it uses AVX512-BF16 instructions (the rest of that
    family needs AVX-512 only)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def int8_error_bound(family: str, x: Tensor, w: Tensor, mode: str = "q16") -> Tensor:
    """Per element [M, N], the largest error an int8 matmul of x [M, K] by the dequantized weights w [N, K] may
    make against their exact product (float64), from how the family rounds its input and output.

    avx2, avx2vnni and neon (which compute the same bits): each activation rounded to half a step of its block's
    scale (`ACTIVATION_STEP[mode]` of the block's max |x|), times |w|, plus fp32 rounding. avx512: x is already
    bf16 (exact), the sum is fp32 and the output is rounded once to bf16 (half an ulp: up to 2^-8 relative)."""
    xd, wd = x.double(), w.double().abs()
    m, k = x.shape
    # fp32 rounding: one per block of 32 in each accumulator, the lanes' fold, the scales (2^-24 relative each)
    noise = (k / 32 + 8) * 2.0**-24 * (xd.abs() @ wd.T)
    if family == "avx512":
        return (xd @ w.double().T).abs() * 2.0**-8 + 2 * noise
    step = xd.abs().view(m, k // 32, 32).amax(-1) * ACTIVATION_STEP[mode]
    return (step.repeat_interleave(32, dim=1) / 2) @ wd.T * 1.001 + noise


def takes(head_dim: int, max_context: int = MAX_KEYS) -> bool:
    """Whether decode attention handles this head size (kernels.c: chunks of 16 values, up to 256; kernels_avx2.c
    and kernels_neon.c take any multiple of 8 up to 256) at every position of a model's context: the kernels refuse
    a row past MAX_KEYS, so a longer model (imported Llama configs: 131072) would fail mid-generation there."""
    return head_dim % 16 == 0 and 0 < head_dim <= 256 and max_context <= MAX_KEYS


def takes_int8(out_features: int, in_features: int) -> bool:
    """Whether the int8 matmul handles this weight shape (K in steps of 32, N in blocks of 8; every family)."""
    return in_features % 32 == 0 and out_features % 8 == 0


def takes_f32(out_features: int, in_features: int) -> bool:
    """Whether the fp32 matmul (avx2 and neon families) handles this weight shape: K in steps of 8, N in blocks of
    8."""
    return in_features % 8 == 0 and in_features > 0 and out_features % 8 == 0


def takes_int4(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether the int4 matmul (avx2 and neon families) handles this shape: groups of a multiple of 32, N in blocks
    of 8."""
    return group_size % 32 == 0 and in_features % group_size == 0 and out_features % 8 == 0


def source_text(source: Path) -> str:
    """A family's source with the headers beside it (kernels_layer.h), as a build's cache key must see them."""
    return "\0".join(p.read_text() for p in [source, *sorted(source.parent.glob("kernels*.h"))])


def build(out_dir: Path | None = None, family: str | None = None, openmp: bool = True,
          system: str = sys.platform) -> Path:
    """Compile a family's source (default: the one `choose` picks, else avx512), or return the cached build of the
    same source, compiler and flags (avx2 and avx2vnni: one source, two flag sets, two cached files). `openmp=False`:
    the one-thread build; `system`: whose OpenMP flags (`flags_for`). Where `out_dir` cannot take the build, it is
    returned from a private temporary folder (removed at exit), and a line logged says why."""
    return _build(out_dir, family, openmp, system)[0]


def _build(out_dir: Path | None, family: str | None, openmp: bool, system: str,
           fresh: bool = False) -> tuple[Path, bool]:
    """`build`, and whether the file came from the cache; `fresh` compiles even where the cache has the key (a
    cached file that did not load), replacing that file."""
    fam = FAMILIES[family] if family else (choose()[0] or FAMILIES["avx512"])
    cmd = compiler_command()
    if cmd is None:
        raise RuntimeError("no C compiler found (set CC)")
    cc = " ".join(cmd)
    flags = flags_for(fam, cpu_info()[1], system, openmp)
    version = _run([*cmd, "--version"], f"{cc} --version").stdout
    key = hashlib.sha256("\0".join([source_text(fam.source), *cmd, version, *flags]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"kernels-{fam.name}-{key}.so"
    if target.exists() and not fresh:
        return target, True
    # Compiled in a private folder, then published: a cache the user cannot write (read-only, full, over quota, a
    # file in its path) then costs the cache, not the kernels, and a compiler's error is always about the source.
    private = Path(tempfile.mkdtemp(prefix="m31r-kernels-"))
    built = private / target.name
    try:
        done = _run([*cmd, *flags, str(fam.source), "-o", str(built)], f"{cc} on {fam.source.name}")
        if done.returncode:
            # The reason is one line (it ends up in "native kernels off: ..."); the whole output is for debugging.
            log.debug("%s failed on %s (exit status %d):\n%s", cc, fam.source, done.returncode, done.stderr)
            raise BuildError(f"{cc} failed on {fam.source.name}: {_first_error(done.stderr, done.returncode)}",
                             done.stderr)
        try:
            _publish(built, target)
        except OSError as e:
            log.info("native kernels built in %s, not cached: %s cannot take them (%s)", private, out_dir, e)
            atexit.register(shutil.rmtree, private, True)  # loaded by then; a loaded library outlives its file
            private = None
            return built, False
    finally:
        if private is not None:
            shutil.rmtree(private, ignore_errors=True)
    return target, False


class BuildError(RuntimeError):
    """A compile that exited with an error: its one-line reason, and the compiler's whole output (`output`)."""

    def __init__(self, reason: str, output: str):
        super().__init__(reason)
        self.output = output


BUILD_TIMEOUT_S = 120.0  # a compiler run past this is taken as hung (a build takes ~0.3 s; a loaded machine, more)


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess[str]:
    """Runs a compiler command. Past BUILD_TIMEOUT_S its whole process group is killed (gcc's cc1 and as with the
    driver, not left spinning) and a RuntimeError says so: a hung compiler costs the kernels, not the daemon's start."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise RuntimeError(f"{what} did not finish in {BUILD_TIMEOUT_S:g} s (killed)") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _first_error(output: str, status: int) -> str:
    """A failed compile's reason in one short line: its first line naming an error, else its first line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    first = next((line for line in lines if "error" in line.lower()), lines[0] if lines else "")
    return first[:300] or f"exit status {status}, no output"


def _publish(built: Path, target: Path) -> None:
    """Copy a build into the cache under its final name atomically: a concurrent build of the same key writes the
    same bytes, and a reader never sees a partial file (a full disk fails the copy, not the rename). The copy is
    flushed to disk before the rename, and the folder after it: else a power cut could leave the final name on a
    file whose data never reached the disk (empty, or its size right and its pages zeros, which _whole passes and
    the loader maps), and every later start would load that. One build per key, so the cost is once."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    try:
        with os.fdopen(fd, "wb") as out, open(built, "rb") as src:
            shutil.copyfileobj(src, out)
            shutil.copymode(built, tmp)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _sync_folder(target.parent)


def _sync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the system lets a folder be opened for that."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # (some file systems refuse to sync a folder: the rename stands, as it would have)
        pass
    finally:
        os.close(fd)


def _fn(lib: ctypes.CDLL, name: str, *argtypes) -> ctypes._CFuncPtr:
    f = getattr(lib, name)
    f.restype = _I32
    f.argtypes = list(argtypes)
    return f


def _refused(err: int, op: str, operands: str) -> None:
    """A kernel's return code: 0 ran; 2 ran out of memory (a thread's attention scores, kernels_scratch.h, or a
    matmul's work buffer could not be allocated), a MemoryError; any other nonzero refused the operands' shape, a
    ValueError. `op` and `operands` name the call in either."""
    if err == 2:
        raise MemoryError(f"native {op} ran out of memory ({operands})")
    if err:
        raise ValueError(f"native {op} does not take {operands}")


class Kernels:
    """A loaded family, with argument checks that keep a bad call from touching memory it should not.

    `dtype`: the activation and KV-cache dtype decode attention takes. `int8_dtype` / `int4_dtype` / `linear_dtype`:
    the activation dtype the int8 / int4 / float-weight matmul takes (its output and, for the last, its weights have
    the same dtype: fp32 in the fp32 families, bf16 in avx512), None where this family or CPU has none.
    `float_dtype`: fp32 in the fp32 families, whose per-token kernels (norms, SwiGLU, attention on the projection,
    one call per layer) engines on fp32 activations run; None in avx512."""

    def __init__(self, path: Path, family: Family | str = "avx512", reason: str = ""):
        self.family = FAMILIES[family] if isinstance(family, str) else family
        self.name = self.family.name
        self.reason = reason
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        self.dtype = self.family.dtype
        self._int4 = None
        self._int8_modes: dict[str, ctypes._CFuncPtr] = {}
        self._checked: dict[str, tuple[bool, str]] = {}
        self.int8_mode = "q16"  # the avx2/neon int8 matmul int8_mm runs by default (benchmarks switch; INT8_MODES)
        # The KV-cache dtypes decode attention reads (the fp32 families' attend_qkv: float32 or float16 caches).
        self.kv_dtypes: tuple[torch.dtype, ...] = (self.family.dtype,)
        self._layer = None  # m31r_decode_layer_f32, in the fp32 families
        self._bf16 = None  # m31r_bf16_mm, in avx512
        self.vnni = False  # whether the integer dot products are VNNI's (the avx2vnni and avx512vnni builds)
        self.dotprod = False  # whether the q8 products are the dot-product extension's sdot (a neon build)
        self.q16_pairs = False  # whether q16 runs two rows per 512-bit register (the avx512vnni build)
        self._threads = _fn(self.lib, "m31r_threads")
        if self.family.base == "avx512":
            self._attend = _fn(self.lib, "m31r_attend_decode", *[_I32] * 4, *[_P] * 9, _F32, _P)
            self._int8 = _fn(self.lib, "m31r_int8_mm", _I32, _I32, _I32, _P, _P, _P, _P)
            self.int8_dtype = torch.bfloat16 if int8_supported() else None
            self.int4_dtype = self.float_dtype = None
            self._f32 = None
            # bf16 weights on AVX512-BF16 dot products (the int8 kernel's arithmetic, without the widening)
            self._bf16 = _fn(self.lib, "m31r_bf16_mm", _I32, _I32, _I32, _P, _P, _P)
            self.linear_dtype = self.int8_dtype
        else:
            self._attend = _fn(self.lib, "m31r_attend_decode_f32", *[_I32] * 4, *[_P] * 9, _F32, _P)
            self._int8_modes = {mode: _fn(self.lib, f"m31r_int8_mm_{mode}", _I32, _I32, _I32, _P, _P, _P, _P)
                                for mode in INT8_MODES}
            self._int8 = self._int8_modes["q16"]
            self._int4 = _fn(self.lib, "m31r_int4_mm_q8", _I32, _I32, _I32, _I32, _P, _P, _P, _P, _P)
            self._f32 = _fn(self.lib, "m31r_f32_mm", _I32, _I32, _I32, _P, _P, _P)
            self._attend_qkv = _fn(self.lib, "m31r_attend_qkv_f32", *[_I32] * 4, *[_P] * 9, _F32, _P)
            self._attend_qkv16 = _fn(self.lib, "m31r_attend_qkv_f32_kv16", *[_I32] * 4, *[_P] * 9, _F32, _P)
            self.kv_dtypes = (torch.float32, torch.float16)
            self._norm = _fn(self.lib, "m31r_add_rmsnorm_f32", _I32, _I32, _P, _P, _P, _F32, _P)
            self._swiglu = _fn(self.lib, "m31r_swiglu_f32", _I32, _I32, _P, _P)
            self._layer = _fn(self.lib, "m31r_decode_layer_f32", *[_I32] * 7, _P, _P, _F32, _P, _F32, *[_P] * 10,
                              _F32, _I32, _P)
            self.int8_dtype = self.int4_dtype = self.float_dtype = self.linear_dtype = torch.float32
            if self.family.base == "neon":  # the library says how it was built; sdot on a CPU without it would trap
                self.dotprod = bool(_fn(self.lib, "m31r_neon_dotprod")())
                if self.dotprod and "asimddp" not in cpu_info()[1]:
                    raise RuntimeError(f"{path.name}: built with dot products for a CPU without them (asimddp)")
            else:
                self.vnni = bool(_fn(self.lib, "m31r_avx2_vnni")())
                self.q16_pairs = bool(_fn(self.lib, "m31r_avx2_q16_pairs")())
                vnni = "-mavxvnni" in self.family.flags or "-mavx512vnni" in self.family.flags
                if self.vnni != vnni:  # the build is what its family promises
                    raise RuntimeError(f"{path.name}: built {'with' if self.vnni else 'without'} AVX-VNNI for "
                                       f"{self.name}")
                if self.q16_pairs != ("-mavx512vnni" in self.family.flags):
                    raise RuntimeError(f"{path.name}: built {'with' if self.q16_pairs else 'without'} 512-bit q16 "
                                       f"tiles for {self.name}")

    @property
    def threads(self) -> int:
        """How many threads the kernels' parallel loops run on when called from this thread: torch's OpenMP team size
        (torch.set_num_threads, which OpenMP keeps per calling thread), or 1 for a build without OpenMP."""
        return int(self._threads())

    @property
    def int8(self) -> bool:
        """Whether this family runs the int8 matmul on this CPU."""
        return self.int8_dtype is not None

    @property
    def int8_kernel(self) -> str:
        """The int8 matmul engines run, in words (the warm-up log's `int8_kernel`)."""
        if self.family.base in ("avx2", "neon"):
            dot16, dot8 = ("vpdpwssd", "vpdpbusd") if self.vnni else ("vpmaddwd", "vpmaddubsw")
            if self.family.base == "neon":
                dot16, dot8 = "smull/smlal", "sdot" if self.dotprod else "smull and pairwise adds"
            pairs = ", two rows per 512-bit register" if self.q16_pairs else ""
            how = {"q16": f"int16 activations per block of 32, {dot16} on int8 codes widened to int16{pairs}",
                   "q8": f"int8 activations per block of 32, {dot8} on int8 codes",
                   "f32": "int8 codes widened to fp32, one FMA per weight and row"}[self.int8_mode]
            return f"{self.name} {self.int8_mode}: {how}"
        return "avx512 bf16: vdpbf16ps on int8 codes widened to bf16"

    def describe(self) -> str:
        """What runs, for the warm-up log and `m31r doctor`."""
        caches = " or ".join(str(d).removeprefix("torch.") for d in self.kv_dtypes)
        parts = [f"decode attention ({str(self.dtype).removeprefix('torch.')}, over {caches} caches)"]
        if self.int8_dtype is not None:
            parts.append("int8 matmul" + (f" ({self.int8_mode} activations)" if self._int8_modes else ""))
        if self.int4_dtype is not None:
            parts.append("int4 matmul (q8 activations)")
        if self.linear_dtype is not None:
            parts.append(f"{'fp32' if self.linear_dtype == torch.float32 else 'bf16'} matmul")
        if self.vnni:
            parts.append(f"{'AVX-VNNI' if '-mavxvnni' in self.family.flags else 'AVX512-VNNI'} dot products")
        if self.q16_pairs:
            parts.append("512-bit q16 tiles of row pairs")
        if self.dotprod:
            parts.append("sdot dot products")
        threads = self.threads
        return f"{self.name}: " + ", ".join(parts) + f"; {threads} thread{'s' if threads != 1 else ''}"

    def attend_decode(self, q: Tensor, knew: Tensor, vnew: Tensor, table: DecodeTable, layer: int,
                      out: Tensor) -> None:
        """Writes each row's new key/value into its cache, then its attention output into `out` (see kernels.c).

        q/out [rows, heads, hd], knew/vnew [rows, kv_heads, hd]: contiguous CPU tensors of the family's dtype."""
        rows, heads, hd = q.shape
        kv = knew.shape[1]
        for t in (q, knew, vnew, out):
            assert t.dtype == self.dtype and t.is_contiguous() and t.device.type == "cpu", f"{self.dtype} CPU tensors"
        assert rows == table.rows and knew.shape == vnew.shape == (rows, kv, hd) and out.shape == q.shape
        assert table.dtype == self.dtype, f"caches of {table.dtype}, kernels for {self.dtype}"
        table.check_heads(heads, kv, hd, layer)
        err = self._attend(rows, heads, kv, hd, q.data_ptr(), knew.data_ptr(), vnew.data_ptr(),
                           table.k[layer].data_ptr(), table.v[layer].data_ptr(), table.cap.data_ptr(),
                           table.len.data_ptr(), table.lead_ptr, table.shared_ptr, hd**-0.5, out.data_ptr())
        _refused(err, "decode attention", f"heads={heads}, kv_heads={kv}, head_dim={hd}")

    def int8_mm(self, x: Tensor, codes: Tensor, scales: Tensor, mode: str | None = None) -> Tensor:
        """x [M, K] (int8_dtype) times int8 codes [N, K] (one bf16 scale per output): [M, N] in x's dtype.

        avx512: bf16 dot products (`mode` does not apply). avx2 and neon: `mode` (default `int8_mode`) q16 (int16
        activations per block of 32, integer dot products: what engines run), q8 (int8 activations, ~258x coarser,
        for comparison) or f32 (every code widened to fp32, one FMA per weight and row, for comparison)."""
        mode = mode or self.int8_mode
        m, k = x.shape
        n = codes.shape[0]
        assert x.dtype == self.int8_dtype and x.is_contiguous() and codes.shape[1] == k and scales.shape == (n,)
        assert codes.dtype == torch.int8 and codes.is_contiguous() and scales.dtype == torch.bfloat16
        assert scales.is_contiguous()
        y = torch.empty(m, n, dtype=x.dtype)
        if self._int8_modes and mode not in self._int8_modes:
            raise ValueError(f"int8 mode {mode!r}: the {self.name} kernels have {', '.join(self._int8_modes)}")
        fn = self._int8_modes.get(mode, self._int8)
        _refused(fn(m, n, k, x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr()),
                 "int8 matmul", f"[{m}, {k}] x [{n}, {k}]")
        return y

    def int8_check(self) -> tuple[bool, str]:
        """The start-up self-check of the int8 matmul (`int8_mode`'s; run once per library and mode, ~1 ms):
        (passed, what it found).

        A fixed random product (8 rows of uneven magnitudes, K=512, N=64) against the float64 product of the same
        activations and dequantized weights must stay within the error the family's activation rounding allows per
        element (`int8_error_bound`), and each row must get the same bits alone as in the batch. A miscompiled or
        misdetected kernel, or the coarse q8 activations, fail it; `--quant auto` then keeps float weights."""
        if self.int8_mode not in self._checked:
            self._checked[self.int8_mode] = self._int8_check()
        return self._checked[self.int8_mode]

    def _int8_check(self) -> tuple[bool, str]:
        from m31r.quant import dequantize_int8, quantize_int8

        if self.int8_dtype is None:
            return False, f"the {self.name} kernels run no int8 matmul on this CPU"
        gen = torch.Generator().manual_seed(18)
        x = torch.randn(8, 512, generator=gen) * (torch.rand(8, 512, generator=gen) * 3)
        codes, scales = quantize_int8(torch.randn(64, 512, generator=gen) * 0.05)
        x = x.to(self.int8_dtype)
        try:
            y = self.int8_mm(x, codes, scales)
            alone = torch.cat([self.int8_mm(x[r : r + 1].contiguous(), codes, scales) for r in range(8)])
        except (ValueError, AssertionError) as e:
            return False, f"int8 self-check could not run: {e}"
        w = dequantize_int8(codes, scales).double()
        err = (y.double() - x.double() @ w.T).abs()
        bound = int8_error_bound(self.family.base, x, w)  # q16's step: the q8 kernel fails it
        worst = (err / bound).max().item()
        if not torch.equal(alone, y):
            return False, "int8 self-check failed: a row got other bits alone than batched"
        if not worst <= 1.0:
            return False, f"int8 self-check failed: error {worst:.3g}x its bound"
        return True, f"int8 self-check passed (worst error {worst:.2g}x its bound)"

    def attend_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor, table: DecodeTable, layer: int,
                   out: Tensor) -> None:
        """attend_decode on the wqkv projection itself (avx2, neon): qkv [rows, (heads + 2 kv_heads) * hd] as the
        fused matmul writes it, each row's RoPE tables cos/sin [rows, hd] at its position; the kernel rotates queries
        and keys (torch's bits: apply_rope's fused multiply-add), writes each new key/value into its cache and the
        attention output into out [rows, heads * hd]."""
        rows, kv, hd = qkv.shape[0], table.kv_heads, table.head_dim
        heads = qkv.shape[1] // max(hd, 1) - 2 * kv
        table.check_heads(heads, kv, hd, layer)
        for t in (qkv, cos, sin, out):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu", "float32 CPU tensors"
        assert rows == table.rows and qkv.shape == (rows, (heads + 2 * kv) * hd) and out.shape == (rows, heads * hd)
        assert cos.shape == sin.shape == (rows, hd) and table.dtype in self.kv_dtypes, f"{table.dtype} caches"
        fn = self._attend_qkv16 if table.dtype == torch.float16 else self._attend_qkv
        err = fn(rows, heads, kv, hd, qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), table.k[layer].data_ptr(),
                 table.v[layer].data_ptr(), table.cap.data_ptr(), table.len.data_ptr(), table.lead_ptr,
                 table.shared_ptr, hd**-0.5, out.data_ptr())
        _refused(err, "decode attention", f"heads={heads}, kv_heads={kv}, head_dim={hd}")

    def add_rmsnorm(self, x: Tensor, delta: Tensor | None, weight: Tensor, eps: float, out: Tensor) -> None:
        """x += delta (the residual add; none for None), then out = RMSNorm(x) with `weight` (avx2, neon; rows of
        d fp32 values, d a multiple of 8)."""
        d = x.shape[-1]
        for t in (x, weight, out, *([] if delta is None else [delta])):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu", "float32 CPU tensors"
        assert out.shape == x.shape and weight.shape == (d,) and (delta is None or delta.shape == x.shape)
        if self._norm(x.numel() // d, d, x.data_ptr(), None if delta is None else delta.data_ptr(),
                      weight.data_ptr(), eps, out.data_ptr()):
            raise ValueError(f"native RMSNorm does not take rows of {d}")

    def swiglu(self, gate_up: Tensor) -> Tensor:
        """silu(gate) * up for rows of [gate | up] (avx2, neon; [..., 2h] fp32 → [..., h], h a multiple of 8)."""
        h = gate_up.shape[-1] // 2
        assert gate_up.dtype == torch.float32 and gate_up.is_contiguous() and gate_up.device.type == "cpu"
        if h < 1 or gate_up.shape[-1] != 2 * h:  # an odd width would make numel // 2h count a row more than out has
            raise ValueError(f"native SwiGLU takes rows of [gate | up], an even width; got {gate_up.shape[-1]}")
        out = torch.empty(*gate_up.shape[:-1], h, dtype=torch.float32)
        if self._swiglu(gate_up.numel() // (2 * h), h, gate_up.data_ptr(), out.data_ptr()):
            raise ValueError(f"native SwiGLU does not take rows of {2 * h}")
        return out

    @property
    def decode_layer(self) -> bool:
        """Whether this build runs a whole decoder layer of a decode pass in one call (decode_layer_f32)."""
        return self._layer is not None

    def decode_layer_f32(self, shape: tuple[int, ...], mats: ctypes.Array, norms: tuple[Tensor, float, Tensor, float],
                         x: Tensor, h: Tensor, cos: Tensor, sin: Tensor, table: DecodeTable, layer: int,
                         scratch: Tensor) -> None:
        """One layer of a decode pass (kernels_avx2.c's m31r_decode_layer_f32): x [rows, d] += attention and
        feed-forward, h [rows, d] from this layer's attention norm to the next one's. `shape`: (d, heads, kv_heads,
        head_dim, ffn_hidden); `mats`: wqkv, wo, w13, w2 as Mat; `norms`: (ffn norm weight, eps, next norm weight,
        eps); cos/sin [>= table.rows, hd] fp32; scratch holds decode_scratch(rows, shape) floats. The caller has
        checked the operands once (Transformer.layer_plan); this is the per-token path."""
        d, heads, kv, hd, ffn = shape
        rows, n = x.shape[0], table.rows
        table.check_heads(heads, kv, hd, layer)
        err = self._layer(rows, n, d, heads, kv, hd, ffn, mats, norms[0].data_ptr(), norms[1], norms[2].data_ptr(),
                          norms[3], x.data_ptr(), h.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                          table.k[layer].data_ptr(), table.v[layer].data_ptr(), table.cap.data_ptr(),
                          table.len.data_ptr(), table.lead_ptr, table.shared_ptr, hd**-0.5,
                          int(table.dtype == torch.float16), scratch.data_ptr())
        _refused(err, "decode layer", f"rows={rows}, d={d}, heads={heads}, hd={hd}")

    @staticmethod
    def decode_scratch(rows: int, shape: tuple[int, ...]) -> int:
        d, heads, kv, hd, ffn = shape
        return rows * ((heads + 2 * kv) * hd + heads * hd + 2 * d + 3 * ffn)

    def takes_linear(self, out_features: int, in_features: int) -> bool:
        """Whether the float-weight matmul (`float_mm`) handles this weight shape."""
        if self.linear_dtype == torch.float32:
            return takes_f32(out_features, in_features)
        return self.linear_dtype is not None and takes_int8(out_features, in_features)  # same tiles as int8

    def float_mm(self, x: Tensor, w: Tensor) -> Tensor:
        """x [M, K] times float weights w [N, K] of `linear_dtype` (nn.Linear's layout): [M, N] in that dtype, every
        (row, column) summed in the same order whatever M. fp32 families: `f32_mm`; avx512: bf16 dot products
        (vdpbf16ps, fp32 accumulators), rounded to bf16 once."""
        if self.linear_dtype == torch.float32:
            return self.f32_mm(x, w)
        m, k = x.shape
        n = w.shape[0]
        assert self.linear_dtype is not None, f"the {self.name} kernels have no float matmul on this CPU"
        assert x.dtype == w.dtype == self.linear_dtype and x.is_contiguous() and w.is_contiguous()
        assert w.shape[1] == k and x.device.type == w.device.type == "cpu"
        y = torch.empty(m, n, dtype=x.dtype)
        if self._bf16(m, n, k, x.data_ptr(), w.data_ptr(), y.data_ptr()):
            raise ValueError(f"native bf16 matmul does not take [{m}, {k}] x [{n}, {k}]")
        return y

    def f32_mm(self, x: Tensor, w: Tensor) -> Tensor:
        """x [M, K] times fp32 weights w [N, K] (nn.Linear's layout): [M, N] fp32, every (row, column) summed in
        the same order whatever M (kernels_avx2.c)."""
        m, k = x.shape
        n = w.shape[0]
        assert self._f32 is not None, f"the {self.name} family has no fp32 matmul"
        assert x.dtype == w.dtype == torch.float32 and x.is_contiguous() and w.is_contiguous() and w.shape[1] == k
        assert x.device.type == w.device.type == "cpu"
        y = torch.empty(m, n, dtype=torch.float32)
        if self._f32(m, n, k, x.data_ptr(), w.data_ptr(), y.data_ptr()):
            raise ValueError(f"native fp32 matmul does not take [{m}, {k}] x [{n}, {k}]")
        return y

    def int4_mm(self, x: Tensor, codes: Tensor, scale: Tensor, base: Tensor, group_size: int) -> Tensor:
        """x [M, K] fp32 times int4 codes [N, K/2] (plain nibbles, quant.quantize_int4's layout) with per-group fp32
        scale and base [N, K/group] (w = code * scale + base): [M, N] fp32."""
        m, k = x.shape
        n = codes.shape[0]
        assert self._int4 is not None, f"the {self.name} family has no int4 matmul"
        assert x.dtype == torch.float32 and x.is_contiguous() and codes.shape == (n, k // 2)
        assert codes.dtype == torch.uint8 and codes.is_contiguous()
        for t in (scale, base):
            assert t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n, k // group_size)
        y = torch.empty(m, n, dtype=torch.float32)
        _refused(self._int4(m, n, k, group_size, x.data_ptr(), codes.data_ptr(), scale.data_ptr(), base.data_ptr(),
                            y.data_ptr()),
                 "int4 matmul", f"[{m}, {k}] x [{n}, {k}] in groups of {group_size}")
        return y


class DecodeTable:
    """Per decode step, what the native attention needs to find each row's cache: the address of its k and v
    tensor in every layer, its capacity and its context length (position + 1). Built once per step, after the
    caches are fitted (a resize moves them).

    `shares`: per row, None or (key, n): rows with the same key hold the same keys and values at
    positions [0, n) (a beam search's hypotheses share their prompt, each in a cache of its own), so each reads them
    from the first such row's cache, and the step reads them from memory once instead of once per row."""

    def __init__(self, kernels: Kernels, caches: list, positions: list[int],
                 shares: list[tuple[object, int] | None] | None = None):
        n_layers = caches[0].n_layers
        self.kernels = kernels
        self.rows = len(caches)
        self.kv_heads, self.head_dim = caches[0].kv_heads, caches[0].head_dim
        self.n_layers = n_layers
        self.dtype = caches[0].dtype
        assert all(c.dtype == self.dtype for c in caches), "one dtype for every cache of a step"
        shapes = {(c.n_layers, c.kv_heads, c.head_dim) for c in caches}
        if len(shapes) > 1:  # the kernels index every row's cache with one shape
            raise ValueError(f"a decode step's caches differ in (layers, kv_heads, head_dim): {sorted(shapes)}")
        self.k = torch.tensor([[c.k[i].data_ptr() for c in caches] for i in range(n_layers)], dtype=torch.int64)
        self.v = torch.tensor([[c.v[i].data_ptr() for c in caches] for i in range(n_layers)], dtype=torch.int64)
        self.cap = torch.tensor([c.capacity for c in caches], dtype=torch.int32)
        self.len = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        self.caches = caches  # keeps the tensors the addresses point into alive for the step
        self.lead = self.shared = None
        if shares and any(s is not None for s in shares):
            first: dict[object, int] = {}
            lead, shared = list(range(self.rows)), [0] * self.rows
            for r, share in enumerate(shares):
                if share is not None:
                    key, n = share
                    lead[r] = first.setdefault(key, r)
                    if lead[r] != r:  # never the row's own new position, nor past what the lead holds
                        shared[r] = max(0, min(n, positions[r], positions[lead[r]] + 1))
            self.lead = torch.tensor(lead, dtype=torch.int32)
            self.shared = torch.tensor(shared, dtype=torch.int32)

    def check_heads(self, heads: int, kv_heads: int, head_dim: int, layer: int) -> None:
        """Raises ValueError unless operands of these heads fit the caches: the kernels write each row's new key and
        value at [kv head, position] of a [kv_heads, capacity, head_dim] cache, so another kv_heads or head_dim
        writes past it, and kv_heads 0 would divide by zero in C."""
        if kv_heads < 1 or heads < 1 or heads % kv_heads:
            raise ValueError(f"native decode attention takes heads a multiple of kv_heads >= 1; got heads={heads}, "
                             f"kv_heads={kv_heads}")
        if (kv_heads, head_dim) != (self.kv_heads, self.head_dim):
            raise ValueError(f"operands of kv_heads={kv_heads}, head_dim={head_dim} for caches of "
                             f"kv_heads={self.kv_heads}, head_dim={self.head_dim}")
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} of caches with {self.n_layers} layers")

    @property
    def lead_ptr(self) -> int:
        return 0 if self.lead is None else self.lead.data_ptr()

    @property
    def shared_ptr(self) -> int:
        return 0 if self.shared is None else self.shared.data_ptr()

    def attend(self, q: Tensor, knew: Tensor, vnew: Tensor, layer: int, out: Tensor) -> None:
        self.kernels.attend_decode(q, knew, vnew, self, layer, out)

    def attend_qkv(self, qkv: Tensor, cos: Tensor, sin: Tensor, layer: int, out: Tensor) -> None:
        self.kernels.attend_qkv(qkv, cos, sin, self, layer, out)


# OpenMP runtimes by soname: GCC's libgomp (and auditwheel's renamed copies), LLVM's libomp, Intel's libiomp5.
_OPENMP_LIB = re.compile(r"lib(?:g|i)?omp5?(?:-[0-9a-f]+)?\.so")
# What a compiler says where it cannot link its OpenMP runtime (clang without libomp-dev: "cannot find -lomp").
_OPENMP_ERROR = re.compile(r"openmp|-l(?:g|i)?omp|lib(?:g|i)?omp|omp\.h", re.IGNORECASE)


class SecondRuntime(RuntimeError):
    """A Linux OpenMP build that links an OpenMP runtime other than torch's (`open_family`)."""


def elf_needed(path: Path) -> list[str]:
    """The libraries an ELF shared object names as DT_NEEDED, in order; [] for a file that is not one or cannot be
    read. Mapped, not read: torch's libtorch_cpu.so is hundreds of MB, of which this touches a few pages."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            if data[:4] != b"\x7fELF":
                return []
            order = "<" if data[5] == 1 else ">"
            if data[4] == 2:  # ELF64: section header (type, offset, size, link) and dynamic entry layouts
                shoff, (entsize, count) = struct.unpack_from(f"{order}Q", data, 0x28)[0], \
                    struct.unpack_from(f"{order}HH", data, 0x3A)
                header, entry = f"{order}IIQQQQIIQQ", f"{order}qQ"
            else:
                shoff, (entsize, count) = struct.unpack_from(f"{order}I", data, 0x20)[0], \
                    struct.unpack_from(f"{order}HH", data, 0x2E)
                header, entry = f"{order}IIIIIIIIII", f"{order}iI"
            sections = [struct.unpack_from(header, data, shoff + i * entsize) for i in range(count)]
            dynamic = next((s for s in sections if s[1] == 6), None)  # SHT_DYNAMIC
            if dynamic is None:
                return []
            strings, step, needed = sections[dynamic[6]][4], struct.calcsize(entry), []
            for at in range(dynamic[4], dynamic[4] + dynamic[5] - step + 1, step):
                tag, value = struct.unpack_from(entry, data, at)
                if tag == 0:  # DT_NULL ends the table
                    break
                if tag == 1:  # DT_NEEDED: an offset into the dynamic string table
                    start = strings + value
                    needed.append(data[start : data.find(b"\0", start)].decode(errors="replace"))
            return needed
    except (OSError, ValueError, IndexError, struct.error):
        return []


def _second_runtime(path: Path) -> str | None:
    """Why a Linux OpenMP build would not run on torch's threads, or None: it links an OpenMP runtime that torch's
    libtorch_cpu does not (clang's -fopenmp links LLVM's libomp; torch's wheel runs libgomp, whose ABI clang's code
    does not call). Loaded, it would bring a second thread pool that ignores torch.set_num_threads (the daemon's
    thread count) and whose threads spin after every call on the cores torch's threads need."""
    ours = [n for n in elf_needed(path) if _OPENMP_LIB.match(n)]
    torch_libs = [p for p in loaded_libraries("linux") if p.name.startswith("libtorch_cpu")]
    theirs = [n for p in torch_libs[:1] for n in elf_needed(p) if _OPENMP_LIB.match(n)]
    foreign = [n for n in ours if n not in theirs]
    if not theirs or not foreign:  # one runtime either way (torch without OpenMP: the build's own is the only one)
        return None
    return (f"its OpenMP build links {foreign[0]}, not torch's runtime ({theirs[0]}): a second thread pool beside "
            "torch's (CC=gcc builds kernels on torch's threads)")


def open_family(family: Family, why: str, system: str = sys.platform, out_dir: Path | None = None) -> Kernels:
    """The family's build, loaded. On macOS its OpenMP build rests on torch's libomp (the module's docstring): where
    that runtime is missing, or the build does not compile (a compiler without `-Xclang -fopenmp`) or load (a
    symbol not found), the one-thread build runs instead, and its reason says why. On Linux the OpenMP build must
    run on torch's runtime: where the compiler links another (clang: LLVM's libomp) or cannot link its own (clang
    without libomp installed), the one-thread build runs too."""
    if system != "darwin":
        try:
            return _open(out_dir, family, why, system=system)
        except SecondRuntime as e:
            note = str(e)
        except BuildError as e:
            if not _OPENMP_ERROR.search(e.output):  # not about OpenMP: the one-thread build would fail the same way
                raise
            note = f"its OpenMP build failed ({str(e).strip().splitlines()[0][:300]})"
        log.info("native kernels on one thread: %s", note)
        return _open(out_dir, family, f"{why}; one thread: {note}", False, system)
    runtime = openmp_runtime(system)
    if runtime is None:
        note = "torch's OpenMP runtime (libomp) is not loaded"
    else:
        try:
            ctypes.CDLL(str(runtime), mode=ctypes.RTLD_GLOBAL)  # the loaded image itself, its symbols made global
            return _open(out_dir, family, why, system=system)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            note = f"its OpenMP build failed ({str(e).strip().splitlines()[0][:300]})"
    log.info("native kernels on one thread: %s", note)
    return _open(out_dir, family, f"{why}; one thread: {note}", False, system)


def _open(out_dir: Path | None, family: Family, why: str, openmp: bool = True, system: str = sys.platform) -> Kernels:
    """The family's build, loaded. A cached file that does not load (truncated by a crash or a damaged disk) is
    compiled once more, replacing it atomically, so the kernels do not stay off until someone deletes it; what
    that rebuild's load raises is the reason they are off."""
    path, cached = _build(out_dir, family.name, openmp, system)
    if openmp and system != "darwin" and (second := _second_runtime(path)):
        raise SecondRuntime(second)  # checked before the load: a loaded runtime cannot be unloaded
    try:
        _whole(path)
        return Kernels(path, family, why)
    except OSError as e:
        if not cached or not _damaged(e):  # a missing symbol (macOS's OpenMP) would fail again: no compile per start
            raise
        log.debug("cached native kernels %s did not load (%s): building them again", path, e)
    path = _build(out_dir, family.name, openmp, system, fresh=True)[0]
    if openmp and system != "darwin" and (second := _second_runtime(path)):  # (a cut file's links were unreadable)
        raise SecondRuntime(second)
    _whole(path)
    return Kernels(path, family, why)


# What loaders say of a damaged file (glibc, macOS dyld, _whole), as against a symbol or runtime the build lacks.
_DAMAGE = ("cut short", "too short", "invalid elf", "not a mach-o", "truncated", "malformed", "file is empty")


def _damaged(e: OSError) -> bool:
    return any(word in str(e).lower() for word in _DAMAGE)


def _whole(path: Path) -> None:
    """Raises OSError where an ELF build is shorter than its headers say. dlopen refuses a file too short for its
    headers, but one cut later (a crash before its data reached the disk) maps pages past the end of the file and
    the process dies of SIGBUS when they are touched. The section header table is what a linker writes last; other
    formats (Mach-O) are left to the loader."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    if head[:4] != b"\x7fELF":
        return
    wide, order = head[4:5] == b"\x02", "<" if head[5:6] == b"\x01" else ">"
    # e_shoff, e_shentsize, e_shnum: where the section header table starts, its entries' size and count
    fmt, at, end = (f"{order}Q", 0x28, 0x3E) if wide else (f"{order}I", 0x20, 0x32)
    if len(head) < end:
        raise OSError(f"{path}: cut short ({size} bytes, not a whole ELF header)")
    shoff = struct.unpack_from(fmt, head, at)[0]
    entsize, count = struct.unpack_from(f"{order}HH", head, end - 4)
    need = shoff + entsize * count
    if size < need:
        raise OSError(f"{path}: cut short ({size} of the {need} bytes its ELF header describes)")


@cache
def _load(dtype: torch.dtype | None) -> tuple[Kernels | None, str]:
    family, why = choose(dtype)
    if family is not None:
        if compiler() is None:
            why = "no C compiler found (set CC)"
        else:
            try:
                kernels = open_family(family, why)
                return kernels, kernels.reason
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                why = str(e)
            base = FAMILIES[family.base]
            if base is not family and requested() == "auto" and family_unsupported(base.name) is None:
                # a compiler without the variant's flag: the plain build runs, and says why
                why = f"the widest family that builds here ({family.name} did not: {why.splitlines()[0][:300]})"
                try:
                    kernels = open_family(base, why)
                    return kernels, kernels.reason
                except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                    why = str(e)
    if why not in _told:  # one line per reason: a daemon asks for fp32 then bf16 kernels, for the same reason
        _told.add(why)
        log.info("native kernels off: %s; decode attention runs in eager torch, quantized layers on torch's kernels",
                 why)
    return None, why


_told: set[str] = set()  # the reasons `_load` has logged


def load(dtype: torch.dtype | None = None) -> Kernels | None:
    """The chosen family's kernels (see `choose`), built if needed; None (logged once) where none can run."""
    return _load(dtype)[0]


def why_not(dtype: torch.dtype | None = None) -> str:
    """Why `load` returned None (or why it chose the family it loaded)."""
    return _load(dtype)[1]


def _forget() -> None:
    """Forget every load and every reason logged (tests reload under another environment)."""
    _load.cache_clear()
    _told.clear()
    _cc_told.clear()


load.cache_clear = _forget  # type: ignore[attr-defined]

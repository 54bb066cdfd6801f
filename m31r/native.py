"""The native CPU kernels (m31r/kernels.c): built once with the system C compiler, cached, loaded through ctypes.

Two kernels: decode attention (every decode row of a step in one call per layer) and the weight-only int8 matmul
of small row counts (AVX512-BF16 dot products; `Kernels.int8` says whether this CPU has them).

Building takes ~0.3 s and happens the first time an engine loads on a machine (the shared object is cached under
$XDG_CACHE_HOME/m31r/kernels, keyed by the source, the compiler and the flags), so from the first request on a
daemon runs one arithmetic and never switches. Where the CPU lacks AVX-512, no C compiler exists, the build fails,
or M31R_NATIVE=0, `load` returns None and the engine keeps its eager path (the reason is logged once).

The library is linked with -fopenmp and so needs libgomp.so.1: torch has loaded its own copy by then, and the
dynamic loader reuses a loaded library of the same soname, so these kernels run on torch's OpenMP threads, not on
a second pool competing with it for the cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger("m31r.native")

SOURCE = Path(__file__).with_name("kernels.c")
FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx2", "-mfma", "-ffp-contract=off",
         "-fopenmp", "-shared", "-fPIC"]
_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "m31r" / "kernels"


def unavailable() -> str | None:
    """Why the native kernels cannot run here, or None."""
    if os.environ.get("M31R_NATIVE", "1") == "0":
        return "disabled by M31R_NATIVE=0"
    if sys.platform != "linux":
        return f"built for Linux only (this is {sys.platform})"
    if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
        return f"needs AVX-512 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if compiler() is None:
        return "no C compiler found (set CC)"
    return None


def compiler() -> str | None:
    found = (shutil.which(c) for c in (os.environ.get("CC", ""), "cc", "gcc", "clang") if c)
    return next((path for path in found if path), None)


def int8_supported() -> bool:
    """Whether this CPU runs the int8 matmul: it uses AVX512-BF16 instructions (the rest of the library needs
    AVX-512 only)."""
    probe = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(probe and probe())


def takes(head_dim: int) -> bool:
    """Whether the kernel handles this head size (kernels.c: chunks of 16 values, MAX_CHUNKS of them)."""
    return head_dim % 16 == 0 and head_dim <= 256


def takes_int8(out_features: int, in_features: int) -> bool:
    """Whether the int8 matmul handles this weight shape (kernels.c: K in steps of 32, N in blocks of 8)."""
    return in_features % 32 == 0 and out_features % 8 == 0


def build(out_dir: Path | None = None) -> Path:
    """Compile kernels.c, or return the cached build of the same source, compiler and flags."""
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), cc, version, *FLAGS]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    target = out_dir / f"kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp], capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"{cc} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)  # atomic: a concurrent build of the same key writes the same bytes
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class Kernels:
    """The loaded library, with argument checks that keep a bad call from touching memory it should not."""

    def __init__(self, path: Path):
        self.path = path
        self.lib = ctypes.CDLL(str(path))
        f = self.lib.m31r_attend_decode
        f.restype = _I32
        f.argtypes = [_I32, _I32, _I32, _I32, _P, _P, _P, _P, _P, _P, _P, _F32, _P]
        self._attend = f
        g = self.lib.m31r_int8_mm
        g.restype = _I32
        g.argtypes = [_I32, _I32, _I32, _P, _P, _P, _P]
        self._int8 = g
        self.int8 = int8_supported()

    def attend_decode(self, q: Tensor, knew: Tensor, vnew: Tensor, table: DecodeTable, layer: int,
                      out: Tensor) -> None:
        """Writes each row's new key/value into its cache, then its attention output into `out` (see kernels.c).

        q/out [rows, heads, hd], knew/vnew [rows, kv_heads, hd]: contiguous bf16 on the CPU."""
        rows, heads, hd = q.shape
        kv = knew.shape[1]
        for t in (q, knew, vnew, out):
            assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu", "bf16 CPU tensors"
        assert rows == table.rows and knew.shape == vnew.shape == (rows, kv, hd) and out.shape == q.shape
        err = self._attend(rows, heads, kv, hd, q.data_ptr(), knew.data_ptr(), vnew.data_ptr(),
                           table.k[layer].data_ptr(), table.v[layer].data_ptr(), table.cap.data_ptr(),
                           table.len.data_ptr(), hd**-0.5, out.data_ptr())
        if err:
            raise ValueError(f"native decode attention does not take heads={heads}, kv_heads={kv}, head_dim={hd}")

    def int8_mm(self, x: Tensor, codes: Tensor, scales: Tensor) -> Tensor:
        """x [M, K] bf16 times int8 codes [N, K] (one bf16 scale per output): [M, N] bf16 (see kernels.c)."""
        m, k = x.shape
        n = codes.shape[0]
        assert x.dtype == torch.bfloat16 and x.is_contiguous() and codes.shape[1] == k and scales.shape == (n,)
        y = torch.empty(m, n, dtype=torch.bfloat16)
        if self._int8(m, n, k, x.data_ptr(), codes.data_ptr(), scales.data_ptr(), y.data_ptr()):
            raise ValueError(f"native int8 matmul does not take [{m}, {k}] x [{n}, {k}]")
        return y


class DecodeTable:
    """Per decode step, what the native attention needs to find each row's cache: the address of its k and v
    tensor in every layer, its capacity and its context length (position + 1). Built once per step, after the
    caches are fitted (a resize moves them)."""

    def __init__(self, kernels: Kernels, caches: list, positions: list[int]):
        n_layers = caches[0].n_layers
        self.kernels = kernels
        self.rows = len(caches)
        self.k = torch.tensor([[c.k[i].data_ptr() for c in caches] for i in range(n_layers)], dtype=torch.int64)
        self.v = torch.tensor([[c.v[i].data_ptr() for c in caches] for i in range(n_layers)], dtype=torch.int64)
        self.cap = torch.tensor([c.capacity for c in caches], dtype=torch.int32)
        self.len = torch.tensor([p + 1 for p in positions], dtype=torch.int32)
        self.caches = caches  # keeps the tensors the addresses point into alive for the step

    def attend(self, q: Tensor, knew: Tensor, vnew: Tensor, layer: int, out: Tensor) -> None:
        self.kernels.attend_decode(q, knew, vnew, self, layer, out)


@cache
def load() -> Kernels | None:
    """The kernels, built if needed; None (logged once) where they cannot run."""
    why = unavailable()
    if why is None:
        try:
            return Kernels(build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            why = str(e)
    log.info("native kernels off: %s; decode attention runs in eager torch, int8 layers on torch's kernel", why)
    return None

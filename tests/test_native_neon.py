"""The neon family (m31r/kernels_neon.c), tested where no Arm machine is: cross-compiled with aarch64-linux-gnu-gcc
and run under qemu-user through a small C driver (tests/kernels_driver.c, which calls the kernels on arrays read
from files), once built with the dot-product extension (run on qemu's `max` CPU, which has it) and once without (run
on an emulated Cortex-A53, which lacks it: the plain build must not need it), and with it by clang, as a Mac builds
it (without OpenMP). The same driver built for this machine against kernels_avx2.c checks the driver and gives the
bits the neon builds must reproduce.

Each product against float64: int8 within the bound of its q16 activations (the AVX2 tests' bound) and, given its
quantized activations, exact up to fp32 accumulation; int4 likewise on q8 activations, reading the even column from
the low nibble; decode attention with grouped-query heads within 1e-5. Rows get the same bits alone or batched, and
all builds the same bits. Then how native.py picks and builds the family on Arm machines, simulated.

Linux x86-64 (CI) must have the tools: a missing one is a failure naming the Debian packages, so CI cannot pass by
skipping (.ci/run installs them). Shapes are tiny: qemu is slow."""

from __future__ import annotations

import hashlib
import os
import platform
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from m31r import native

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "tests" / "kernels_driver.c"
CROSS_CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
PACKAGES = "gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
ENV = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "passive"}  # more threads than CI's cores: another split of work


def _x86_linux() -> bool:
    return sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")


def require_cross_tools() -> None:
    """The cross compiler and qemu-user: a failure on x86-64 Linux where they are not installed, skipped where these
    Debian packages do not apply."""
    if not _x86_linux():
        pytest.skip(f"cross-testing the neon kernels runs on x86-64 Linux (this is {sys.platform} "
                    f"{platform.machine()})")
    missing = [tool for tool in (CROSS_CC, QEMU) if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"{' and '.join(missing)} not installed: apt-get install --no-install-recommends {PACKAGES} "
                    "(Debian/Ubuntu; .ci/run does)")


@dataclass(frozen=True)
class Build:
    name: str
    argv: tuple[str, ...]  # how to run the driver


def _compile(cc: str, flags: tuple[str, ...], source: Path, out_dir: Path, name: str) -> Path:
    """The driver linked with one kernel source, cached by sources, compiler and flags (a build takes seconds)."""
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256("\0".join([DRIVER.read_text(), native.source_text(source), cc, version, *flags]).encode())
    target = out_dir / f"driver-{name}-{key.hexdigest()[:16]}"
    if not target.exists():
        tmp = target.with_suffix(".tmp")
        done = subprocess.run([cc, *flags, str(DRIVER), str(source), "-lm", "-o", str(tmp)], capture_output=True,
                              text=True, check=False)
        assert done.returncode == 0, f"{cc} failed: {done.stderr[-3000:]}"
        tmp.replace(target)
    return target


def _driver_flags(family: str, cpu_flags: set[str]) -> tuple[str, ...]:
    """The flags native.py builds the family with for such a CPU, for an executable instead of a shared library."""
    return tuple(f for f in native.flags_for(native.FAMILIES[family], cpu_flags, "linux")
                 if f not in ("-shared", "-fPIC"))


@pytest.fixture(scope="module")
def builds(pytestconfig, tmp_path_factory) -> dict[str, Build]:
    """neon+dotprod and neon (always, under qemu; the first also built by clang), and avx2 for this machine where
    its CPU runs that family."""
    require_cross_tools()
    cache = getattr(pytestconfig, "cache", None)
    out = cache.mkdir("kernels-drivers") if cache is not None else tmp_path_factory.mktemp("drivers")
    neon = native.FAMILIES["neon"].source
    found = {
        "neon+dotprod": Build("neon+dotprod", (QEMU, "-cpu", "max", str(_compile(
            CROSS_CC, (*_driver_flags("neon", {"asimd", "asimddp"}), "-static"), neon, out, "neon-dotprod")))),
        "neon": Build("neon", (QEMU, "-cpu", "cortex-a53", str(_compile(
            CROSS_CC, (*_driver_flags("neon", {"asimd"}), "-static"), neon, out, "neon")))),
    }
    # As a Mac builds it: clang (Apple's on a Mac), the dot-product variant (every Apple CPU has it), here without
    # OpenMP (no aarch64 libomp to link statically; test_native_threads.py runs the OpenMP recipe), which is also the
    # one-thread build a Mac falls back to.
    clang = shutil.which("clang")
    if clang is None:
        pytest.fail("clang not installed: apt-get install --no-install-recommends clang (.ci/run does)")
    mac = native.flags_for(native.FAMILIES["neon"], {"asimd", "asimddp"}, "darwin", openmp=False)
    found["neon+dotprod/clang"] = Build("neon+dotprod/clang", (QEMU, "-cpu", "max", str(_compile(
        clang, ("--target=aarch64-linux-gnu", *(f for f in mac if f not in ("-shared", "-fPIC")), "-static"), neon,
        out, "neon-dotprod-clang"))))
    if native.family_unsupported("avx2") is None and native.compiler() is not None:
        found["avx2"] = Build("avx2", (str(_compile(native.compiler(), _driver_flags("avx2", set()),
                                                    native.FAMILIES["avx2"].source, out, "avx2")),))
    return found


def _no_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def run_driver(build: Build, lines: list[str], check: bool = True,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(build.argv, input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=300,
                          env={**os.environ, **ENV, **(env or {})}, preexec_fn=_no_core, check=False)
    if check:
        assert done.returncode == 0, f"{build.name}: driver exited {done.returncode}: {done.stderr[-2000:]}"
    return done


class Calls:
    """Kernel calls whose inputs are written to files once, then run on each build in one process (qemu starts
    cost more than these tiny products)."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.lines: list[str] = []
        self.outputs: list[list[tuple[str, np.dtype, tuple[int, ...]]]] = []  # per call: (name, dtype, shape)
        self._n = 0

    def file(self, t: torch.Tensor) -> str:
        self._n += 1
        path = self.folder / f"in{self._n}.bin"
        t = t.contiguous()
        (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy().tofile(path)
        return str(path)

    def _add(self, line: str, outputs: list[tuple[str, np.dtype, tuple[int, ...]]]) -> int:
        self.lines.append(line)
        self.outputs.append(outputs)
        return len(self.lines) - 1

    def int8(self, mode: str, x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> int:
        (m, k), n = x.shape, codes.shape[0]
        return self._add(f"int8 {mode} {m} {n} {k} {self.file(x)} {self.file(codes)} {self.file(scales)} @y",
                         [("y", np.float32, (m, n))])

    def int4(self, x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, group: int) -> int:
        (m, k), n = x.shape, codes.shape[0]
        return self._add(f"int4 {m} {n} {k} {group} {self.file(x)} {self.file(codes)} {self.file(scale)} "
                         f"{self.file(base)} @y", [("y", np.float32, (m, n))])

    def attend(self, q, knew, vnew, k: list[torch.Tensor], v: list[torch.Tensor], lengths: list[int]) -> int:
        """q [rows, heads, hd], knew/vnew [rows, kv, hd]; row r's caches k[r]/v[r] [kv, cap_r, hd]."""
        rows, heads, hd = q.shape
        kv = knew.shape[1]
        cap = torch.tensor([c.shape[1] for c in k], dtype=torch.int32)
        size = int(sum(c.numel() for c in k))
        scale = float(np.float32(hd**-0.5)).hex()
        files = [self.file(t) for t in (q, knew, vnew, torch.cat([c.flatten() for c in k]),
                                        torch.cat([c.flatten() for c in v]), cap,
                                        torch.tensor(lengths, dtype=torch.int32))]
        return self._add(f"attend {rows} {heads} {kv} {hd} {scale} {' '.join(files)} @out @k @v",
                         [("out", np.float32, (rows, heads, hd)), ("k", np.float32, (size,)),
                          ("v", np.float32, (size,))])

    def f32mm(self, x: torch.Tensor, w: torch.Tensor) -> int:
        (m, k), n = x.shape, w.shape[0]
        return self._add(f"f32mm {m} {n} {k} {self.file(x)} {self.file(w)} @y", [("y", np.float32, (m, n))])

    def qkv(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, k: list[torch.Tensor],
            v: list[torch.Tensor], lengths: list[int], lead: list[int] | None = None,
            shared: list[int] | None = None) -> int:
        """qkv [rows, (heads + 2 kv) * hd] as the wqkv matmul writes it, cos/sin [rows, hd]; caches as `attend`
        (fp16 caches: m31r_attend_qkv_f32_kv16); row r reads positions [0, shared[r]) from row lead[r]'s cache."""
        half = k[0].dtype == torch.float16
        rows, hd, kv = qkv.shape[0], cos.shape[1], k[0].shape[0]
        cap = torch.tensor([c.shape[1] for c in k], dtype=torch.int32)
        size = int(sum(c.numel() for c in k))
        scale = float(np.float32(hd**-0.5)).hex()
        files = [self.file(t) for t in (qkv, cos, sin, torch.cat([c.flatten() for c in k]),
                                        torch.cat([c.flatten() for c in v]), cap,
                                        torch.tensor(lengths, dtype=torch.int32))]
        cached = np.float16 if half else np.float32
        share = "" if lead is None else (f" {self.file(torch.tensor(lead, dtype=torch.int32))}"
                                         f" {self.file(torch.tensor(shared, dtype=torch.int32))}")
        return self._add(f"qkv{'16' if half else ''} {rows} {heads} {kv} {hd} {scale} {' '.join(files)} @out @k @v"
                         + share,
                         [("out", np.float32, (rows, heads * hd)), ("k", cached, (size,)), ("v", cached, (size,))])

    def layer(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: list[torch.Tensor],
              v: list[torch.Tensor], lengths: list[int], norms: tuple[torch.Tensor, torch.Tensor],
              mats: list[tuple[torch.Tensor, ...]], shape: tuple[int, ...], kind: int, group: int = 0) -> int:
        """m31r_decode_layer_f32: x/h [rows, d], cos/sin [n, hd], caches as `attend` (fp16 ones: kv16), the four
        matrices of `kind` as (weights, scales, bases) with what the kind lacks left out; shape (heads, kv, hd, ffn)."""
        rows, d = x.shape
        heads, kv, hd, ffn = shape
        half = k[0].dtype == torch.float16
        cap = torch.tensor([c.shape[1] for c in k], dtype=torch.int32)
        size = int(sum(c.numel() for c in k))
        files = [self.file(t) for t in (x, h, cos, sin, torch.cat([c.flatten() for c in k]),
                                        torch.cat([c.flatten() for c in v]), cap,
                                        torch.tensor(lengths, dtype=torch.int32), *norms)]
        parts = [" ".join([self.file(t) for t in m] + ["-"] * (3 - len(m))) for m in mats]
        eps = float(np.float32(1e-5)).hex()
        cached = np.float16 if half else np.float32
        return self._add(f"layer {rows} {len(lengths)} {d} {heads} {kv} {hd} {ffn} {kind} {group} {int(half)} {eps} "
                         f"{eps} {' '.join(files)} {' '.join(parts)} @x @h @k @v",
                         [("x", np.float32, (rows, d)), ("h", np.float32, (rows, d)), ("k", cached, (size,)),
                          ("v", cached, (size,))])

    def norm(self, x: torch.Tensor, delta: torch.Tensor | None, w: torch.Tensor, eps: float) -> int:
        rows, d = x.shape
        eps_hex = float(np.float32(eps)).hex()
        return self._add(f"norm {rows} {d} {eps_hex} {self.file(x)} {'-' if delta is None else self.file(delta)} "
                         f"{self.file(w)} @out @x", [("out", np.float32, (rows, d)), ("x", np.float32, (rows, d))])

    def swiglu(self, gate_up: torch.Tensor) -> int:
        rows, h = gate_up.shape[0], gate_up.shape[1] // 2
        return self._add(f"swiglu {rows} {h} {self.file(gate_up)} @out", [("out", np.float32, (rows, h))])

    def run(self, build: Build, env: dict[str, str] | None = None) -> list[tuple[int, dict[str, torch.Tensor]]]:
        """Per call: (the kernel's return value, its outputs); `env` added to the driver's environment."""
        out_dir = self.folder / build.name
        out_dir.mkdir(exist_ok=True)
        lines = [" ".join(str(out_dir / f"{i}-{w[1:]}.bin") if w.startswith("@") else w for w in line.split())
                 for i, line in enumerate(self.lines)]
        printed = run_driver(build, lines, env=env).stdout.splitlines()
        assert len(printed) == len(lines) and all(p.startswith("rc ") for p in printed), (build.name, printed[:5])
        results = []
        for i, (said, outputs) in enumerate(zip(printed, self.outputs, strict=True)):
            arrays = {name: torch.from_numpy(np.fromfile(out_dir / f"{i}-{name}.bin", dtype).reshape(shape))
                      for name, dtype, shape in outputs}
            results.append((int(said.split()[1]), arrays))
        return results


def run_all(calls: Calls, builds: dict[str, Build],
            env: dict[str, str] | None = None) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """Every build's results; they must be the same bits (neon reproduces avx2's arithmetic exactly, with or without
    the dot-product extension). Returns one build's."""
    results = {name: calls.run(build, env) for name, build in builds.items()}
    first = results["neon+dotprod"]
    for name, res in results.items():
        for i, ((rc, arrays), (rc0, arrays0)) in enumerate(zip(res, first, strict=True)):
            assert rc == rc0, (name, calls.lines[i])
            for key in arrays:
                same = np.array_equal(arrays[key].numpy().view(np.uint8), arrays0[key].numpy().view(np.uint8))
                assert same, f"{name} and neon+dotprod differ in {key} of: {calls.lines[i][:60]}"
    return first


# -- the builds ------------------------------------------------------------------------------------------------


def test_the_builds_are_what_they_claim_and_the_plain_one_needs_no_dot_products(builds, tmp_path) -> None:
    """The library reports its variant (native.Kernels.dotprod); the dotprod build really runs sdot (a CPU without
    the extension stops it), while the plain build has just run on such a CPU."""
    said = {name: run_driver(b, ["variant"]).stdout.strip() for name, b in builds.items()}
    assert said["neon+dotprod"] == said["neon+dotprod/clang"] == "dotprod 1" and said["neon"] == "dotprod 0"
    assert said.get("avx2", "dotprod -1") == "dotprod -1"
    calls = Calls(tmp_path)
    x, codes, scales = _x32(2, 64, seed=1), *_int8_weights(8, 64, seed=1)
    calls.int8("q8", x, codes, scales)
    plain = calls.run(builds["neon"])
    assert plain[0][0] == 0 and plain[0][1]["y"].abs().sum() > 0
    argv = builds["neon+dotprod"].argv
    on_a53 = Build("dotprod-on-a53", (argv[0], "-cpu", "cortex-a53", *argv[3:]))
    line = calls.lines[0].replace("@y", str(tmp_path / "y.bin"))
    stopped = run_driver(on_a53, [line], check=False)
    assert stopped.returncode in (-4, 132), (stopped.returncode, stopped.stderr[-500:])  # SIGILL


def test_the_driver_reports_bad_input_instead_of_reading_past_it(builds, tmp_path) -> None:
    short = tmp_path / "short.bin"
    np.zeros(3, np.float32).tofile(short)
    for build in builds.values():
        out = run_driver(build, [f"int8 q16 1 8 32 {short} {short} {short} {tmp_path / 'y.bin'}", "frobnicate",
                                 "int8 q4 1 8 32 a b c d"]).stdout.splitlines()
        assert out[0] == f"error {short} does not hold 128 bytes"
        assert out[1:] == ["error unknown command frobnicate", "error no int8 mode q4"]


# -- int8 ------------------------------------------------------------------------------------------------------


def _x32(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * (torch.rand(m, k, generator=gen) * 3)  # uneven magnitudes


def _int8_weights(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    from m31r.quant import quantize_int8

    return quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed + 100)) * 0.05)


def quantized(x: torch.Tensor, top: int, order: torch.Tensor | None = None) -> torch.Tensor:
    """x as the kernels round it, in float64: per block of 32, scale = max|x| / top and codes round(x / scale) to the
    nearest even, computed in fp32 as the C code does (x * (top / max|x|)); zero codes where top / max|x| is not
    finite (code_step). Only the scale term is rounded."""
    m, k = x.shape
    xb = x.view(m, k // 32, 32)
    mx = xb.abs().amax(-1)
    d = mx / top
    inv = torch.where((mx > 0) & torch.isfinite(top / mx), top / mx, torch.zeros_like(mx))
    codes = torch.round(xb * inv[..., None]).clamp(-top, top)
    return (codes.double() * d.double()[..., None]).view(m, k)


def fp32_noise(k: int, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation error of a product of a [M, K] and b [N, K] summed in blocks of 32 (one rounding per block
    in each lane, the lanes' fold and the scales): a bound, relative to the sum of |terms|."""
    return (k / 32 + 8) * 2.0**-24 * (a.double().abs() @ b.double().abs().T)


@pytest.mark.parametrize(("n", "k"), [(8, 32), (24, 96), (64, 1024), (200, 512)])
def test_int8_is_exact_on_its_quantized_activations_and_within_the_avx2_bound(builds, tmp_path, n: int,
                                                                               k: int) -> None:
    """q16 (what engines run) and q8: the integer block sums are exact, so against the float64 product of the
    activations as rounded, only fp32 accumulation remains; against the exact product the error stays within
    int8_error_bound (the AVX2 tests' bound). f32 widens the codes: fp32 rounding only."""
    from m31r.quant import dequantize_int8

    x = _x32(11, k, seed=n)
    codes, scales = _int8_weights(n, k, seed=k)
    w = dequantize_int8(codes, scales)
    calls = Calls(tmp_path)
    for mode in ("q16", "q8", "f32"):
        calls.int8(mode, x, codes, scales)
    calls.int8("q16", _x32(11, 48, seed=0), torch.ones(n, 48, dtype=torch.int8), scales)  # K not in blocks of 32
    if n > 8:
        calls.int8("q16", x, codes[:12].contiguous(), scales[:12].contiguous())  # N not in blocks of 8
    (rc16, y16), (rc8, y8), (rcf, yf), (rc48, _), *rest = run_all(calls, builds)
    assert rc16 == rc8 == rcf == 0 and rc48 == 1 and all(rc == 1 for rc, _ in rest)
    exact = x.double() @ w.double().T
    for mode, top, y in (("q16", 32767, y16["y"]), ("q8", 127, y8["y"])):
        rounded = quantized(x, top)
        err = (y.double() - rounded @ w.double().T).abs()
        assert (err <= fp32_noise(k, rounded, w)).all(), mode
        assert ((y.double() - exact).abs() <= native.int8_error_bound("neon", x, w, mode)).all(), mode
    assert ((y8["y"].double() - exact).abs() / native.int8_error_bound("neon", x, w)).max() > 10  # q8 is coarser
    assert (yf["y"].double() - exact).abs().max() <= 1e-5 * exact.abs().max()


def test_int8_block_sums_are_exact_at_the_largest_codes(builds, tmp_path) -> None:
    """Activations of equal magnitude throughout (every q16 code ±32767, q8 ±127) against codes ±127 of the same
    sign: every product is the largest it can be and all add up. An int16 accumulator would overflow and an int32
    lane summing more than 4 such products would round on its way to fp32; the result must be the float64 one."""
    gen = torch.Generator().manual_seed(7)
    k, n = 256, 16
    signs = torch.randint(0, 2, (1, k), generator=gen).float() * 2 - 1
    x = torch.cat([signs * 3.0, -signs * 0.5, signs * torch.linspace(0.25, 8, k).view(1, k).floor()])
    codes = (signs * 127).to(torch.int8).expand(n, k).contiguous()
    scales = torch.full((n,), 0.01).to(torch.bfloat16)
    w = codes.double() * scales.double()[:, None]
    calls = Calls(tmp_path)
    calls.int8("q16", x, codes, scales)
    calls.int8("q8", x, codes, scales)
    (_, y16), (_, y8) = run_all(calls, builds)
    for top, y in ((32767, y16["y"]), (127, y8["y"])):
        rounded = quantized(x, top)
        assert (rounded[:2].abs() == rounded[:2].abs()[:, :1]).all()  # the largest codes everywhere
        ref = rounded @ w.T
        assert ((y.double() - ref).abs() <= fp32_noise(k, rounded, w)).all(), top


@pytest.mark.parametrize("mode", ["q16", "q8", "f32", "int4"])
def test_a_row_gets_the_same_bits_alone_and_batched(builds, tmp_path, mode: str) -> None:
    """1 to 8 rows (each its own tile shape) and 17 (two blocks of 8 and one), against the same rows in a batch of
    17, and the batch in another order."""
    x = _x32(17, 256, seed=3)
    calls = Calls(tmp_path)
    order = torch.randperm(17, generator=torch.Generator().manual_seed(0))
    if mode == "int4":
        codes4, scale, base = _int4_weights(48, 256, 64, seed=3)
    else:
        codes8, scales8 = _int8_weights(40, 256, seed=3)

    def call(rows: torch.Tensor) -> None:
        if mode == "int4":
            calls.int4(rows, codes4, scale, base, 64)
        else:
            calls.int8(mode, rows, codes8, scales8)

    call(x)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 17):
        call(x[-m:].contiguous())
    call(x[order].contiguous())
    (_, full), *parts, (_, shuffled) = run_all(calls, builds)
    for m, (rc, part) in zip((1, 2, 3, 4, 5, 6, 7, 8, 17), parts, strict=True):
        assert rc == 0 and torch.equal(part["y"], full["y"][-m:]), m
    assert torch.equal(shuffled["y"], full["y"][order])


def test_a_block_too_small_to_quantize_adds_nothing(builds, tmp_path) -> None:
    """A block whose max |x| is below 3e-37 (32767 / max|x| and 127 / max|x| overflow fp32): once every code of it
    was -32767 on AVX2 and ±32767 by sign on NEON, builds apart. Every build, avx2 too, now rounds it to zero codes:
    int8 (q16, q8) and int4 give the product with that block zero, bit for bit, and the block alone gives zero."""
    x = _x32(4, 128, seed=9)
    tiny = torch.zeros(4, 32)
    tiny[0, 0], tiny[1, :2], tiny[3, 5] = 2e-37, torch.tensor([2e-37, -2e-37]), -3e-38
    tiny[2] = torch.randn(32, generator=torch.Generator().manual_seed(9)) * 2e-38
    x[:, 32:64] = tiny
    zeroed = x.clone()
    zeroed[:, 32:64] = 0
    codes, scales = _int8_weights(16, 128, seed=9)
    codes4, scale, base = _int4_weights(16, 128, 32, seed=9)
    calls = Calls(tmp_path)
    for mode in ("q16", "q8"):
        calls.int8(mode, x, codes, scales)
        calls.int8(mode, zeroed, codes, scales)
        calls.int8(mode, tiny, codes[:, 32:64].contiguous(), scales)
    calls.int4(x, codes4, scale, base, 32)
    calls.int4(zeroed, codes4, scale, base, 32)
    (_, a16), (_, z16), (_, t16), (_, a8), (_, z8), (_, t8), (_, a4), (_, z4) = run_all(calls, builds)
    assert torch.equal(a16["y"], z16["y"]) and torch.equal(a8["y"], z8["y"]) and torch.equal(a4["y"], z4["y"])
    assert not t16["y"].any() and not t8["y"].any()
    assert torch.equal(quantized(x, 32767), quantized(zeroed, 32767))  # the reference rounds it alike


# -- int4 ------------------------------------------------------------------------------------------------------


def _int4_weights(n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K/2] as quant.quantize_int4 packs them, and fp32 scale and base (the value of code 0) [N, K/group]
    as Int4Linear.use_native hands them to the kernel."""
    from m31r.quant import quantize_int4

    codes, sz = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, group)
    sz = sz.float()  # [K/group, N, 2]
    return codes, sz[..., 0].t().contiguous(), (sz[..., 1] - 8 * sz[..., 0]).t().contiguous()


@pytest.mark.parametrize(("n", "k", "group"), [(16, 64, 32), (32, 128, 64), (64, 1024, 64), (48, 512, 128)])
def test_int4_is_the_product_of_its_q8_activations(builds, tmp_path, n: int, k: int, group: int) -> None:
    """Codes and group scales enter exactly and the zero points multiply the plain fp32 sum of x: against the
    float64 product of the rounded activations only fp32 accumulation remains, and against the exact product the
    error stays within the AVX2 tests' bound."""
    from m31r.quant import unpack_int4

    codes, scale, base = _int4_weights(n, k, group, seed=n)
    x = _x32(11, k, seed=k)
    calls = Calls(tmp_path)
    calls.int4(x, codes, scale, base, group)
    calls.int4(x[:, :48].contiguous(), codes[:, :24].contiguous(), scale[:, :1].contiguous(),
               base[:, :1].contiguous(), 48)  # groups of 48: refused
    (rc, y), (rc48, _) = run_all(calls, builds)
    assert rc == 0 and rc48 == 1
    q = unpack_int4(codes).double()
    qs = q * scale.double().repeat_interleave(group, 1)  # the scale term of each weight
    bs = base.double().repeat_interleave(group, 1)
    rounded = quantized(x, 127)
    ref = rounded @ qs.T + x.double() @ bs.T
    noise = (k / 32 + 8 + group) * 2.0**-24 * (rounded.abs() @ qs.abs().T + x.double().abs() @ bs.abs().T)
    assert ((y["y"].double() - ref).abs() <= noise).all()
    exact = x.double() @ (qs + bs).T
    bound = native.int8_error_bound("neon", x, scale.repeat_interleave(group, 1) * 15, "q8") + 1e-5 * exact.abs().max()
    assert ((y["y"].double() - exact).abs() <= bound).all()


def test_int4_reads_the_even_column_from_the_low_nibble(builds, tmp_path) -> None:
    """Rows of x that pick one column each (even, odd, at block and group edges) return that column of the weights:
    each byte's two nibbles differ, so a swapped order would return the neighbour's."""
    gen = torch.Generator().manual_seed(11)
    n, k, group = 16, 128, 64
    lo = torch.randint(0, 16, (n, k // 2), generator=gen)
    hi = (lo + torch.randint(1, 16, (n, k // 2), generator=gen)) % 16
    codes = (lo | (hi << 4)).to(torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.1 + 0.01
    base = torch.randn(n, k // group, generator=gen) * 0.1
    w = torch.stack([lo, hi], -1).view(n, k).double() * scale.double().repeat_interleave(group, 1) \
        + base.double().repeat_interleave(group, 1)
    cols = [0, 1, 2, 31, 32, 33, 63, 64, 65, 127]
    x = torch.zeros(len(cols), k)
    for i, c in enumerate(cols):
        x[i, c] = 1.0
    calls = Calls(tmp_path)
    calls.int4(x, codes, scale, base, group)
    ((rc, y),) = run_all(calls, builds)
    assert rc == 0
    for i, c in enumerate(cols):
        got = y["y"][i].double()
        assert (got - w[:, c]).abs().max() <= 1e-6 * w.abs().max(), c
        assert (got - w[:, c ^ 1]).abs().max() > 1e-3, c  # the other nibble of the byte is another weight


# -- decode attention ------------------------------------------------------------------------------------------


def _caches(lengths: list[int], kv: int, hd: int, ahead: int, seed: int) -> tuple[list[torch.Tensor], ...]:
    """Per row, k and v [kv, len + ahead, hd]: random up to the new token's position, NaN from there on (the kernel
    writes the new token before it reads, and never reads past it)."""
    gen = torch.Generator().manual_seed(seed)
    ks, vs = [], []
    for n in lengths:
        for out in (ks, vs):
            c = torch.randn(kv, n + ahead, hd, generator=gen)
            c[:, n - 1 :] = float("nan")
            out.append(c)
    return ks, vs


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of q [heads, hd] over k/v [kv, n, hd]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    p = torch.softmax((q.double()[:, None, :] * q.shape[-1] ** -0.5 * k).sum(-1), dim=-1)
    return (p[:, :, None] * v).sum(1)


@pytest.mark.parametrize(("heads", "kv", "hd"), [(16, 16, 64), (8, 2, 64), (4, 1, 128), (6, 3, 24), (2, 2, 8)])
def test_decode_attention_with_grouped_heads_matches_float64(builds, tmp_path, heads: int, kv: int, hd: int) -> None:
    """Each row writes its new key and value at its last position (and nothing else), then attends over its own
    cache: within 1e-5 of float64 (the AVX2 tests' bound), reading nothing past its context (NaN there), and with
    the same bits alone as batched."""
    lengths = [1, 7, 8, 9, 17, 64, 65, 300]
    ks, vs = _caches(lengths, kv, hd, ahead=5, seed=hd)
    gen = torch.Generator().manual_seed(heads)
    q, knew, vnew = (torch.randn(len(lengths), h, hd, generator=gen) * 2 for h in (heads, kv, kv))
    calls = Calls(tmp_path)
    calls.attend(q, knew, vnew, ks, vs, lengths)
    for r in range(len(lengths)):
        calls.attend(q[r : r + 1], knew[r : r + 1], vnew[r : r + 1], ks[r : r + 1], vs[r : r + 1], lengths[r : r + 1])
    (rc, batch), *alone = run_all(calls, builds)
    assert rc == 0
    at = 0
    for r, n in enumerate(lengths):
        size = ks[r].numel()
        for name, before, new in (("k", ks[r], knew[r]), ("v", vs[r], vnew[r])):
            after = batch[name][at : at + size].view(ks[r].shape)
            expected = before.clone()
            expected[:, n - 1] = new
            assert np.array_equal(after.numpy().view(np.uint32), expected.numpy().view(np.uint32)), (name, r)
        ref = _reference(q[r], batch["k"][at : at + size].view(ks[r].shape)[:, :n],
                         batch["v"][at : at + size].view(vs[r].shape)[:, :n])
        out = batch["out"][r]
        assert torch.isfinite(out).all() and (out.double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5, n
        assert alone[r][0] == 0 and torch.equal(alone[r][1]["out"][0], out), n
        at += size
    assert not torch.equal(batch["out"][0], batch["out"][1])


def test_decode_attention_refuses_what_it_does_not_take_and_leaves_the_caches(builds, tmp_path) -> None:
    """Head sizes off the multiples of 8 or above 256, heads not a multiple of kv heads, a context longer than its
    cache: nonzero, and nothing written."""
    calls = Calls(tmp_path)
    for heads, kv, hd, lengths, cap in ((4, 4, 20, [10], 12), (4, 4, 264, [3], 4), (6, 4, 16, [5], 8),
                                        (2, 2, 16, [9], 8)):
        gen = torch.Generator().manual_seed(hd)
        ks = [torch.randn(kv, cap, hd, generator=gen)]
        vs = [torch.randn(kv, cap, hd, generator=gen)]
        q, knew, vnew = (torch.randn(1, h, hd, generator=gen) for h in (heads, kv, kv))
        calls.attend(q, knew, vnew, ks, vs, lengths)
    for i, (rc, out) in enumerate(run_all(calls, builds)):
        assert rc == 1, calls.lines[i][:40]
        written = [np.fromfile(p, np.float32) for p in calls.lines[i].split()[9:11]]
        assert np.array_equal(out["k"].numpy(), written[0]) and np.array_equal(out["v"].numpy(), written[1])


def test_a_long_context_runs_on_openmp_workers_with_small_stacks(builds, tmp_path) -> None:
    """m31r_attend_decode_f32 and m31r_attend_qkv_f32(_kv16) at MAX_KEYS positions on 3 threads with
    OMP_STACKSIZE=128K: the scores were variable-length arrays on the thread's stack (256 KB a query), and a worker
    died of SIGSEGV; now they live in per-thread heap scratch (kernels_scratch.h). Within 1e-5 of float64, and
    every build's bits (run_all: the clang build runs on one thread, the main one). 128K: aarch64's smallest thread
    stack (its PTHREAD_STACK_MIN, for 64 KB pages); libgomp ignores a smaller OMP_STACKSIZE there, and the x86 build
    then runs with 128K too."""
    from m31r.model import apply_rope

    n, heads, kv = native.MAX_KEYS, 4, 1  # one row of 4 heads: heads for every thread, and small files
    gen = torch.Generator().manual_seed(31)
    calls = Calls(tmp_path)
    q, knew, vnew = (torch.randn(1, h, 8, generator=gen) for h in (heads, kv, kv))
    ks, vs = [torch.randn(kv, n, 8, generator=gen)], [torch.randn(kv, n, 8, generator=gen)]
    calls.attend(q, knew, vnew, ks, vs, [n])
    hd = 16  # RoPE's halves: whole chunks of 8
    qkv = torch.randn(1, (heads + 2 * kv) * hd, generator=gen)
    cos, sin = torch.randn(1, hd, generator=gen), torch.randn(1, hd, generator=gen)
    k16, v16 = [torch.randn(kv, n, hd, generator=gen).half()], [torch.randn(kv, n, hd, generator=gen).half()]
    calls.qkv(qkv, cos, sin, heads, k16, v16, [n])
    calls.qkv(qkv, cos, sin, heads, [c.float() for c in k16], [c.float() for c in v16], [n])
    (rc, res), (rc16, half), (rc32, full) = run_all(calls, builds, {"OMP_STACKSIZE": "128K"})
    assert rc == rc16 == rc32 == 0
    ref = _reference(q[0], res["k"].view(kv, n, 8), res["v"].view(kv, n, 8))
    assert (res["out"][0].double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5
    rq = apply_rope(qkv.view(1, heads + 2 * kv, 1, hd)[:, :heads], cos.view(1, 1, 1, hd), sin.view(1, 1, 1, hd))
    for got in (half, full):  # the fp16 cache's new key and value rounded to fp16 on their way in: other bits
        ref = _reference(rq[0, :, 0], got["k"].view(kv, n, hd).float(), got["v"].view(kv, n, hd).float())
        assert (got["out"][0].view(heads, hd).double() - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5


# -- fp32 weights and the per-token ops of fp32 engines ---------------------------------------------------------


@pytest.mark.parametrize(("n", "k"), [(8, 8), (24, 96), (64, 1024)])
def test_the_fp32_matmul_is_the_exact_product_within_fp32_rounding(builds, tmp_path, n: int, k: int) -> None:
    """k/8 fused multiply-adds per lane and the lanes' fold: within (k/8 + 3) roundings of the sum of |x * w|; shapes
    off the blocks of 8 are refused."""
    x = _x32(11, k, seed=n)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    calls = Calls(tmp_path)
    calls.f32mm(x, w)
    calls.f32mm(x[:, :4].contiguous(), w[:, :4].contiguous())  # K not in steps of 8
    calls.f32mm(x, w[:4].contiguous())  # N not in blocks of 8
    (rc, y), (rc4, _), (rcn, _) = run_all(calls, builds)
    assert rc == 0 and rc4 == 1 and rcn == 1
    exact = x.double() @ w.double().T
    bound = (k / 8 + 3) * 2.0**-24 * (x.double().abs() @ w.double().abs().T) * 1.01
    assert ((y["y"].double() - exact).abs() <= bound).all()


def test_the_fp32_matmul_gives_a_row_the_same_bits_alone_and_batched(builds, tmp_path) -> None:
    x, w = _x32(17, 256, seed=4), torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    calls = Calls(tmp_path)
    calls.f32mm(x, w)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16):
        calls.f32mm(x[-m:].contiguous(), w)
    (_, full), *parts = run_all(calls, builds)
    for m, (rc, part) in zip((1, 2, 3, 4, 5, 6, 7, 8, 9, 16), parts, strict=True):
        assert rc == 0 and torch.equal(part["y"], full["y"][-m:]), m


def test_attention_on_the_projection_rotates_as_torch_and_attends_as_the_reference(builds, tmp_path) -> None:
    """m31r_attend_qkv_f32 with grouped-query heads: the keys it writes are torch's apply_rope, bit for bit, the
    values are copied, and the outputs are fp32 attention of the rotated queries within 1e-5; hd = 24 (RoPE halves
    not whole chunks of 8) is refused."""
    from m31r.config import ModelConfig
    from m31r.model import apply_rope, rope_tables

    heads, kv, hd, lengths = 8, 2, 32, [1, 9, 70]
    rows = len(lengths)
    gen = torch.Generator().manual_seed(21)
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, generator=gen) * 2
    cos_t, sin_t = rope_tables(ModelConfig(n_layers=1, d_model=heads * hd, n_heads=heads, n_kv_heads=kv,
                                           ffn_hidden=8, vocab_size=8, max_context=128))
    pos = torch.tensor([n - 1 for n in lengths])
    cos, sin = cos_t[pos].contiguous(), sin_t[pos].contiguous()
    caps = [64, 64, 128]
    k = [torch.randn(kv, c, hd, generator=gen) for c in caps]
    v = [torch.randn(kv, c, hd, generator=gen) for c in caps]
    calls = Calls(tmp_path)
    calls.qkv(qkv, cos, sin, heads, k, v, lengths)
    calls.qkv(torch.zeros(1, 12 * 24), torch.zeros(1, 24), torch.zeros(1, 24), 8, [torch.zeros(2, 64, 24)],
              [torch.zeros(2, 64, 24)], [5])
    (rc, res), (rc24, _) = run_all(calls, builds)
    assert rc == 0 and rc24 == 1
    parts = qkv.view(rows, heads + 2 * kv, 1, hd)
    qk = apply_rope(parts[:, : heads + kv], cos.view(rows, 1, 1, hd), sin.view(rows, 1, 1, hd))[:, :, 0]
    at = 0
    for r, n in enumerate(lengths):
        kc = res["k"][at : at + k[r].numel()].view(kv, caps[r], hd)
        vc = res["v"][at : at + k[r].numel()].view(kv, caps[r], hd)
        at += k[r].numel()
        assert torch.equal(kc[:, n - 1], qk[r, heads:]) and torch.equal(vc[:, n - 1], parts[r, heads + kv :, 0])
        keys, values = kc[:, :n].repeat_interleave(heads // kv, 0), vc[:, :n].repeat_interleave(heads // kv, 0)
        p = torch.softmax((qk[r, :heads, None, :].double() * hd**-0.5 * keys).sum(-1), -1)
        ref = (p[:, :, None] * values).sum(1)
        got = res["out"][r].view(heads, hd)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6, r


def test_attention_over_fp16_caches_rounds_what_it_writes_and_attends_in_fp32(builds, tmp_path) -> None:
    """m31r_attend_qkv_f32_kv16: the new key and value go into the fp16 caches as torch's fp16 cast of what the fp32
    kernel writes, the rest of the caches is untouched, and the output is fp32 attention over the caches' values
    within 1e-5; every build gives the x86 build's bits (run_all)."""
    from m31r.model import apply_rope

    heads, kv, hd, lengths = 4, 2, 32, [1, 9, 70]
    rows = len(lengths)
    gen = torch.Generator().manual_seed(23)
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, generator=gen) * 2
    cos, sin = torch.randn(rows, hd, generator=gen), torch.randn(rows, hd, generator=gen)
    caps = [64, 64, 128]
    k = [torch.randn(kv, c, hd, generator=gen).half() for c in caps]
    v = [torch.randn(kv, c, hd, generator=gen).half() for c in caps]
    calls = Calls(tmp_path)
    calls.qkv(qkv, cos, sin, heads, k, v, lengths)
    calls.qkv(qkv, cos, sin, heads, [c.float() for c in k], [c.float() for c in v], lengths)  # the fp32 kernel
    (rc, half), (rc32, full) = run_all(calls, builds)
    assert rc == rc32 == 0
    assert torch.equal(half["k"], full["k"].half()) and torch.equal(half["v"], full["v"].half())
    parts = qkv.view(rows, heads + 2 * kv, 1, hd)
    q = apply_rope(parts[:, :heads], cos.view(rows, 1, 1, hd), sin.view(rows, 1, 1, hd))[:, :, 0]
    at = 0
    for r, n in enumerate(lengths):
        size = kv * caps[r] * hd
        kc = half["k"][at : at + size].view(kv, caps[r], hd).double()
        vc = half["v"][at : at + size].view(kv, caps[r], hd).double()
        at += size
        assert torch.equal(kc[:, : n - 1], k[r][:, : n - 1].double())
        keys, values = kc[:, :n].repeat_interleave(heads // kv, 0), vc[:, :n].repeat_interleave(heads // kv, 0)
        p = torch.softmax((q[r, :, None, :].double() * hd**-0.5 * keys).sum(-1), -1)
        ref = (p[:, :, None] * values).sum(1)
        got = half["out"][r].view(heads, hd)
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-6, r


def test_rows_reading_a_shared_prompt_from_one_cache_get_the_bits_of_their_own(builds, tmp_path) -> None:
    """m31r_attend_qkv_f32(_kv16) with lead/shared (a beam search's rows): rows whose caches hold the same prompt get
    the same bits reading it from the lead row's cache as from their own, in every build; a row whose own copy of the
    prompt is spoiled still gets them (it reads the lead's), while its own tail is read from its own cache. Lengths
    put the shared end and the row ends inside and at the ends of the four-key blocks."""
    heads, kv, hd, prompt = 4, 2, 32, 37
    lengths = [prompt + 1, prompt + 2, prompt + 7]
    rows = len(lengths)
    gen = torch.Generator().manual_seed(29)
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, generator=gen) * 2
    cos, sin = torch.randn(rows, hd, generator=gen), torch.randn(rows, hd, generator=gen)
    calls = Calls(tmp_path)
    for half in (False, True):
        common_k, common_v = torch.randn(kv, prompt, hd, generator=gen), torch.randn(kv, prompt, hd, generator=gen)
        k, v = [], []
        for _ in lengths:  # each its own cache: the same prompt, a tail of its own, room after it
            k.append(torch.cat([common_k, torch.randn(kv, 64 - prompt, hd, generator=gen)], 1))
            v.append(torch.cat([common_v, torch.randn(kv, 64 - prompt, hd, generator=gen)], 1))
        if half:
            k, v = [c.half() for c in k], [c.half() for c in v]
        spoiled_k, spoiled_v = [c.clone() for c in k], [c.clone() for c in v]
        for c in (spoiled_k[2], spoiled_v[2]):
            c[:, :prompt] = 7.0
        calls.qkv(qkv, cos, sin, heads, k, v, lengths)
        calls.qkv(qkv, cos, sin, heads, k, v, lengths, [0, 0, 0], [prompt] * rows)
        calls.qkv(qkv, cos, sin, heads, spoiled_k, spoiled_v, lengths, [0, 0, 0], [prompt] * rows)
        calls.qkv(qkv, cos, sin, heads, spoiled_k, spoiled_v, lengths)  # without sharing the spoiled copy shows
        calls.qkv(qkv, cos, sin, heads, k, v, lengths, [0, 0, 1], [prompt, prompt, lengths[1] + 1])  # refused:
        # row 2 would read past what its lead holds
    results = run_all(calls, builds)
    for at in (0, 5):
        (rc, own), (rc_s, shared), (rc_p, spoiled), (rc_x, unshared), (rc_bad, _) = results[at : at + 5]
        assert rc == rc_s == rc_p == rc_x == 0 and rc_bad == 1
        assert torch.equal(own["out"], shared["out"]) and torch.equal(own["out"], spoiled["out"])
        assert torch.equal(own["k"], shared["k"]) and torch.equal(own["v"], shared["v"])
        assert not torch.equal(own["out"][2], unshared["out"][2]) and torch.equal(own["out"][:2], unshared["out"][:2])


def test_a_decode_layer_in_one_call_gives_every_build_the_same_bits(builds, tmp_path) -> None:
    """m31r_decode_layer_f32 (one decoder layer of a decode pass, kernels_avx2.c's code over each family's kernels)
    with fp32, int8 (q16) and int4 weights, fp16 and fp32 caches, a padding row: every neon build gives the x86
    build's bits (run_all), which tests/test_native.py holds to the per-call path's; it changes x, h and the caches."""
    from m31r.quant import quantize_int4, quantize_int8

    heads, kv, hd, ffn, d, rows, lengths = 4, 2, 16, 64, 64, 3, [5, 40]
    gen = torch.Generator().manual_seed(31)
    x, h = torch.randn(rows, d, generator=gen), torch.randn(rows, d, generator=gen)
    cos, sin = torch.randn(len(lengths), hd, generator=gen), torch.randn(len(lengths), hd, generator=gen)
    norms = (torch.rand(d, generator=gen) + 0.5, torch.rand(d, generator=gen) + 0.5)
    shapes = [((heads + 2 * kv) * hd, d), (d, heads * hd), (2 * ffn, d), (d, ffn)]
    weights = [torch.randn(n, k, generator=gen) * k**-0.5 for n, k in shapes]
    int8 = [quantize_int8(w) for w in weights]
    int4 = []
    for w in weights:
        codes, sz = quantize_int4(w, 32)
        sz = sz.float()  # [K/G, N, 2] -> the kernel's fp32 scale and base [N, K/G]
        int4.append((codes, sz[..., 0].t().contiguous(), (sz[..., 1] - 8 * sz[..., 0]).t().contiguous()))
    calls = Calls(tmp_path)
    for kind, mats, group in ((0, [(w,) for w in weights], 0), (1, [(c, s.to(torch.bfloat16)) for c, s in int8], 0),
                              (4, int4, 32)):
        for dtype in (torch.float16, torch.float32):
            caps = [64, 64]
            k = [torch.randn(kv, c, hd, generator=gen).to(dtype) for c in caps]
            v = [torch.randn(kv, c, hd, generator=gen).to(dtype) for c in caps]
            calls.layer(x, h, cos, sin, k, v, lengths, norms, mats, (heads, kv, hd, ffn), kind, group)
    for rc, out in run_all(calls, builds):
        assert rc == 0 and not torch.equal(out["x"], x) and not torch.equal(out["h"], h)
        assert torch.isfinite(out["h"]).all()


def test_residual_norm_and_swiglu_match_torch(builds, tmp_path) -> None:
    """x += delta as torch adds, RMSNorm and silu(gate) * up within fp32 rounding of torch's, with and without the
    residual; rows of other than a multiple of 8 are refused."""
    from m31r.model import RMSNorm

    gen = torch.Generator().manual_seed(9)
    x, delta = _x32(5, 64, seed=9) * 3, torch.randn(5, 64, generator=gen)
    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.rand(64, generator=gen) + 0.5
    gate_up = torch.randn(5, 2 * 48, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    calls = Calls(tmp_path)
    calls.norm(x, delta, norm.weight.data, 1e-5)
    calls.norm(x, None, norm.weight.data, 1e-5)
    calls.swiglu(gate_up)
    calls.norm(torch.zeros(2, 12), None, torch.ones(12), 1e-5)
    calls.swiglu(torch.zeros(2, 24))
    (rc1, added), (rc2, plain), (rc3, sw), (rcn, _), (rcs, _) = run_all(calls, builds)
    assert rc1 == rc2 == rc3 == 0 and rcn == rcs == 1
    assert torch.equal(added["x"], x + delta) and torch.equal(plain["x"], x)
    with torch.no_grad():
        for got, ref in ((added["out"], norm(x + delta)), (plain["out"], norm(x))):
            assert (got - ref).abs().max() <= 4e-7 * ref.abs().max()
    ref = torch.nn.functional.silu(gate_up[:, :48]) * gate_up[:, 48:]
    assert ((sw["out"] - ref).abs() <= 1e-6 * ref.abs() + 1e-30).all()


# -- native.py on Arm machines (simulated) ---------------------------------------------------------------------


def _arm(monkeypatch, flags: set[str], system: str = "linux", machine: str = "aarch64") -> None:
    """native.py as it sees an Arm machine: its OS, architecture, CPU flags and torch's capability level."""
    monkeypatch.setattr(native, "sys", SimpleNamespace(platform=system))
    monkeypatch.setattr(native, "platform", SimpleNamespace(machine=lambda: machine))
    monkeypatch.setattr(native, "cpu_info", lambda: ("an Arm CPU", flags, machine.lower()))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")  # torch's level on aarch64


def test_an_arm_cpu_runs_the_neon_family_and_no_x86_one(monkeypatch) -> None:
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    monkeypatch.delenv("M31R_KERNELS", raising=False)
    _arm(monkeypatch, {"fp", "asimd", "asimddp"})
    assert native.family_unsupported("neon") is None
    assert native.family_unsupported("avx2") == "x86-64 only (this is aarch64)"
    assert native.choose() == (native.FAMILIES["neon"], "the widest family this CPU runs")
    assert native.choose(torch.float32)[0] is native.FAMILIES["neon"]
    monkeypatch.setenv("M31R_KERNELS", "neon")
    assert native.forced() is native.FAMILIES["neon"]
    assert native.choose() == (native.FAMILIES["neon"], "forced by M31R_KERNELS=neon")
    monkeypatch.setenv("M31R_KERNELS", "avx512")
    assert native.choose() == (None, "M31R_KERNELS=avx512, but x86-64 only (this is aarch64)")
    _arm(monkeypatch, {"fp"})  # features read, never assumed
    assert native.family_unsupported("neon") == "the CPU lacks asimd"
    _arm(monkeypatch, {"asimd"}, system="darwin", machine="arm64")
    assert native.family_unsupported("neon") is None
    assert native.family_unsupported("avx2") == "built for Linux only (this is darwin)"
    _arm(monkeypatch, {"asimd"}, system="win32", machine="ARM64")
    assert native.family_unsupported("neon") == "built for Linux and macOS only (this is win32)"


def test_the_neon_build_uses_dot_products_where_the_cpu_has_them() -> None:
    """armv8.2-a+dotprod where the CPU lists asimddp (FEAT_DotProd is an Armv8.2 option; GCC's arm_neon.h offers
    vdotq_s32 from armv8.2-a only), plain armv8-a elsewhere. OpenMP on macOS through clang's front end, bound at
    load to torch's libomp (Apple's clang has no runtime of its own); none in the one-thread build. The x86 families
    keep their flags."""
    neon = native.FAMILIES["neon"]
    dot = native.flags_for(neon, {"asimd", "asimddp"}, "linux")
    plain = native.flags_for(neon, {"asimd"}, "linux")
    assert dot[0] == "-march=armv8.2-a+dotprod" and plain[0] == "-march=armv8-a"
    assert "-fopenmp" in dot and "-fopenmp" in plain and "-ffp-contract=off" in plain
    mac = native.flags_for(neon, {"asimd", "asimddp"}, "darwin")
    assert mac[0] == "-march=armv8.2-a+dotprod" and mac.count("-fopenmp") == 1
    assert mac[mac.index("-fopenmp") - 1] == "-Xclang"  # the front end's OpenMP; the driver's would link a runtime
    assert {"-Wl,-undefined,dynamic_lookup", "-Wl,-bind_at_load"} <= set(mac)
    alone = native.flags_for(neon, {"asimd"}, "darwin", openmp=False)
    assert alone[0] == "-march=armv8-a" and not {"-fopenmp", "-Xclang"} & set(alone)
    assert "-fopenmp" not in native.flags_for(neon, {"asimd"}, "linux", openmp=False)
    for family in native.FAMILIES.values():
        if family.base != "neon":
            assert native.flags_for(family, {"asimddp", "avx2", "avx_vnni"}, "linux") == family.flags, family.name


def test_native_builds_the_library_an_arm_machine_loads(pytestconfig, tmp_path, monkeypatch) -> None:
    """`native.build` on an aarch64 CPU (simulated, with the cross compiler as CC) compiles kernels_neon.c as a shared
    aarch64 library exporting what `Kernels` binds: with sdot where the CPU lists asimddp, without it elsewhere,
    each cached under its own flags (here in pytest's cache, as the drivers: a build takes seconds)."""
    require_cross_tools()
    cache = getattr(pytestconfig, "cache", None)
    out = cache.mkdir("kernels-neon-libs") if cache is not None else tmp_path
    monkeypatch.setenv("CC", CROSS_CC)
    libs = {}
    for name, flags in (("dotprod", {"asimd", "asimddp"}), ("plain", {"asimd"})):
        _arm(monkeypatch, flags)
        libs[name] = native.build(out, family="neon")
        assert libs[name].name.startswith("kernels-neon-") and native.build(out, family="neon") == libs[name]
    assert libs["dotprod"] != libs["plain"]
    binds = {"m31r_attend_decode_f32", "m31r_int4_mm_q8", "m31r_neon_dotprod",
             *(f"m31r_int8_mm_{mode}" for mode in native.INT8_MODES)}
    for name, lib in libs.items():
        head = lib.read_bytes()[:20]
        assert head[:4] == b"\x7fELF" and int.from_bytes(head[18:20], "little") == 183, name  # EM_AARCH64
        tools = "aarch64-linux-gnu-"  # binutils-aarch64-linux-gnu, which the cross compiler depends on
        symbols = subprocess.run([f"{tools}nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                                 check=True).stdout.split()
        assert binds <= set(symbols), name
        code = subprocess.run([f"{tools}objdump", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
        assert ("\tsdot\t" in code) == (name == "dotprod"), name

"""The avx2vnni family: m31r/kernels_avx2.c built with -mavxvnni (vpdpwssd / vpdpbusd), against the plain build.

Its integer dot products sum the same products in the same int32 lanes as the plain build's vpmaddwd / vpmaddubsw
(whose int16 pair sums never saturate on these operands: kernels_avx2.c says why), so every result must be the
plain build's bit for bit, whatever the inputs, the extremes included. Then a row's bits alone and batched, what
`M31R_KERNELS` and `auto` choose, the refusal where the CPU lacks AVX-VNNI, and the fallback to the plain build
where the compiler lacks -mavxvnni.

Tests that run kernels need a CPU with avx_vnni (Intel since Alder Lake, AMD since Zen 5) and skip, saying so,
elsewhere; the choice and fallback tests run on any x86-64 Linux CPU with AVX2 (they fake the flag)."""

from __future__ import annotations

import shutil
import sys

import pytest
import torch
from test_native import family  # the loaded or built kernels of a family, or skip

from m31r import native
from m31r.precision import resolve
from m31r.quant import FloatLinear, Int4Linear, Int8Linear, quantize_int4


def both() -> tuple[native.Kernels, native.Kernels]:
    """(plain avx2, avx2vnni); the CPU runs both where it runs the second."""
    vnni = family("avx2vnni")
    return family("avx2"), vnni


def bits(t: torch.Tensor) -> torch.Tensor:
    """The fp32 bit patterns (NaN equals NaN of the same bits)."""
    return t.contiguous().view(torch.int32)


def x86_linux() -> None:
    if sys.platform != "linux" or native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 Linux only")


def _activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Uneven magnitudes, plus the rows that drive the quantized codes to their ends: constant blocks (every code
    ±127 / ±32767), one huge value per block, alternating signs, zeros, a tiny row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * (torch.rand(m, k, generator=gen) * 3)
    x[0] = 7.5
    x[1] = -7.5
    x[2, ::32] = 1e6
    x[3] = torch.tensor([1.0, -1.0]).repeat(k // 2) * 3
    x[4] = 0.0
    x[5] *= 1e-30
    return x


def _codes(n: int, k: int, seed: int) -> torch.Tensor:
    """Every int8 code, -128 included (quantize_int8 never writes it; the kernels take any byte), and rows at the
    ends of the range."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    codes[0], codes[1], codes[2] = -128, 127, -127
    return codes


def _scales(n: int, seed: int) -> torch.Tensor:
    return (torch.rand(n, generator=torch.Generator().manual_seed(seed)) * 0.02 + 0.001).to(torch.bfloat16)


def test_each_build_is_what_its_family_says() -> None:
    plain, vnni = both()
    assert vnni.vnni and not plain.vnni
    assert vnni.path != plain.path and vnni.path.name.startswith("kernels-avx2vnni-")
    assert "vpdpwssd" in vnni.int8_kernel and "vpmaddwd" in plain.int8_kernel
    assert "AVX-VNNI dot products" in vnni.describe() and "VNNI" not in plain.describe()
    with pytest.raises(RuntimeError, match="built without AVX-VNNI for avx2vnni"):
        native.Kernels(plain.path, "avx2vnni")  # a plain build is never taken for the VNNI family
    with pytest.raises(RuntimeError, match="built with AVX-VNNI for avx2"):
        native.Kernels(vnni.path, "avx2")
    assert vnni.int8_check()[0]


@pytest.mark.parametrize("mode", native.INT8_MODES)
@pytest.mark.parametrize(("m", "n", "k"), [(6, 8, 32), (9, 24, 96), (17, 64, 1024), (8, 200, 512)])
def test_int8_matmuls_are_the_plain_builds_bit_for_bit(mode: str, m: int, n: int, k: int) -> None:
    plain, vnni = both()
    x, codes, scales = _activations(m, k, seed=k), _codes(n, k, seed=n), _scales(n, seed=m)
    y = vnni.int8_mm(x, codes, scales, mode=mode)
    assert torch.equal(bits(y), bits(plain.int8_mm(x, codes, scales, mode=mode)))
    assert y.isfinite().all() and not torch.equal(y[0], y[1])


@pytest.mark.parametrize(("m", "n", "k"), [(1, 8, 8), (9, 24, 96), (17, 64, 1024)])
def test_the_fp32_matmul_is_the_plain_builds_bit_for_bit(m: int, n: int, k: int) -> None:
    plain, vnni = both()
    x = _activations(m + 6, k, seed=k)  # the rows of extremes, then m random ones
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n))
    y = vnni.f32_mm(x, w)
    assert torch.equal(bits(y), bits(plain.f32_mm(x, w))) and y.isfinite().all()


def test_the_largest_pair_sums_are_exact_in_both_builds() -> None:
    """vpmaddubsw's int16 pair sums at their largest (q8: 127 * -128 twice = -32512; the limit is -32768) and q16's
    int32 lanes at theirs: both builds give the exact product up to fp32 rounding. A positive constant block
    quantizes every activation to exactly 127 (q8) or 32767 (q16), so only the fp32 scaling rounds."""
    plain, vnni = both()
    k = 256
    x = torch.full((1, k), 0.5)
    codes = torch.stack([torch.full((k,), -128), torch.full((k,), 127), torch.full((k,), -127),
                         torch.tensor([-128, 127]).repeat(k // 2)] * 2).to(torch.int8)
    scales = torch.ones(8, dtype=torch.bfloat16)
    exact = x.double() @ codes.double().T
    for mode in ("q8", "q16"):
        y = vnni.int8_mm(x, codes, scales, mode=mode)
        assert torch.equal(bits(y), bits(plain.int8_mm(x, codes, scales, mode=mode)))
        assert ((y.double() - exact).abs() <= 1e-6 * exact.abs()).all(), (mode, y, exact)


@pytest.mark.parametrize(("m", "n", "k", "group"), [(6, 8, 64, 32), (9, 32, 128, 64), (17, 64, 1024, 64),
                                                    (8, 48, 512, 128)])
def test_int4_matmul_is_the_plain_builds_bit_for_bit(m: int, n: int, k: int, group: int) -> None:
    """Any byte of codes (all 16 nibbles, both at 15: the largest pair sum 2 * 15 * 127), any scale and base."""
    plain, vnni = both()
    gen = torch.Generator().manual_seed(k + group)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    codes[0] = 255
    scale = torch.rand(n, k // group, generator=gen) * 0.01
    base = torch.randn(n, k // group, generator=gen) * 0.05
    x = _activations(m, k, seed=group)
    y = vnni.int4_mm(x, codes, scale, base, group)
    assert torch.equal(bits(y), bits(plain.int4_mm(x, codes, scale, base, group)))
    assert y.isfinite().all()


def test_a_row_gets_the_same_bits_alone_and_batched() -> None:
    _, vnni = both()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(23, 256, generator=gen) * (torch.rand(23, 256, generator=gen) * 3)
    codes, scales = _codes(40, 256, seed=7), _scales(40, seed=7)
    layer4 = Int4Linear(*quantize_int4(torch.randn(48, 256, generator=gen) * 0.05, 64), 64)
    layer4.use_native(vnni)
    order = torch.randperm(23, generator=gen)
    for mode in ("q16", "q8"):
        full = vnni.int8_mm(x, codes, scales, mode=mode)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
            assert torch.equal(vnni.int8_mm(x[-m:].contiguous(), codes, scales, mode=mode), full[-m:]), (mode, m)
        assert torch.equal(vnni.int8_mm(x[order].contiguous(), codes, scales, mode=mode), full[order])
    full = layer4(x)
    for m in (1, 2, 3, 4, 5, 8, 9, 13):
        assert torch.equal(layer4(x[-m:].contiguous()), full[-m:]), m
    assert torch.equal(layer4(x[order].contiguous()), full[order])


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_an_fp32_engine_decodes_the_same_bits_on_either_build(tiny_bundle, quant: str | None) -> None:
    """Attention, fp32, int8 and int4 layers: the decode logits and greedy tokens of the VNNI build are the plain
    build's, so its agreement with fp32 is theirs (README "Speed"). The fp32 matmul has no integer dot products:
    the flag must not change its code either."""
    from m31r.engine import Engine

    plain, vnni = both()
    engine = Engine(tiny_bundle, dtype="float32", quant=quant, group_size=32)
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits, tokens = {}, {}
    for k in (plain, vnni):
        engine.use_kernels(k)
        assert engine.kernel_report["kernels"] == k.name and engine.kernel_report["native_attention"]
        assert engine.kernel_report["native_int8"] == (quant is not None)
        assert engine.kernel_report["native_int4"] == (quant == "int4")
        assert engine.kernel_report["native_float"] == (quant is None)
        layers = [mod for mod in engine.model.modules() if isinstance(mod, (FloatLinear, Int8Linear, Int4Linear))]
        assert layers and all(mod.native is k for mod in layers)
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[k.name] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13, 14)])
        tokens[k.name] = [t.id for t in engine.generate(ids, max_tokens=12)]
    assert quant is None or "vpdpwssd" in engine.kernel_report["int8_kernel"]
    assert torch.equal(logits["avx2vnni"], logits["avx2"]) and tokens["avx2vnni"] == tokens["avx2"]
    assert len(tokens["avx2"]) == 12


# -- the choice ---------------------------------------------------------------------------------------------------


def _flags(monkeypatch, vnni: bool) -> None:
    """This CPU's flags with or without avx_vnni, and without avx512_vnni (whose family auto would prefer for fp32:
    tests/test_native_avx512vnni.py), the rest as they are."""
    name, flags, arch = native.cpu_info()
    flags = (flags | {"avx_vnni"} if vnni else flags - {"avx_vnni"}) - {"avx512_vnni"}
    monkeypatch.setattr(native, "cpu_info", lambda: (name, flags, arch))


def _needs_avx2() -> None:
    x86_linux()
    if native.family_unsupported("avx2") is not None:
        pytest.skip(f"the avx2 kernels cannot run here: {native.family_unsupported('avx2')}")


def test_m31r_kernels_forces_either_build(monkeypatch) -> None:
    both()
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    native.load.cache_clear()
    try:
        for name, vnni in (("avx2vnni", True), ("avx2", False)):
            monkeypatch.setenv("M31R_KERNELS", name)
            assert native.choose() == (native.FAMILIES[name], f"forced by M31R_KERNELS={name}")
            loaded = native.load(torch.float32)
            assert loaded is not None and loaded.name == name and loaded.vnni is vnni
            p = resolve(torch.device("cpu"), "auto", "auto", None)  # a forced family sets its activation dtype
            assert p.dtype == "float32" and f"the {name} kernels M31R_KERNELS forces take it" in p.why
            assert p.quant == "int8" and f"the {name} int8 kernel" in p.why
            native.load.cache_clear()
    finally:
        native.load.cache_clear()


def test_auto_prefers_vnni_for_fp32_where_the_cpu_has_it(monkeypatch) -> None:
    _needs_avx2()
    monkeypatch.setenv("M31R_KERNELS", "auto")
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    _flags(monkeypatch, vnni=True)
    assert native.choose(torch.float32)[0] is native.FAMILIES["avx2vnni"]
    _flags(monkeypatch, vnni=False)
    assert native.choose(torch.float32)[0] is native.FAMILIES["avx2"]


def test_a_cpu_without_avx_vnni_is_refused_the_vnni_build(monkeypatch) -> None:
    _needs_avx2()
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    _flags(monkeypatch, vnni=False)
    assert native.family_unsupported("avx2vnni") == "the CPU lacks avx_vnni"
    assert native.family_unsupported("avx2") is None
    monkeypatch.setenv("M31R_KERNELS", "avx2vnni")
    assert native.choose() == (None, "M31R_KERNELS=avx2vnni, but the CPU lacks avx_vnni")
    assert native.forced() is None


def old_compiler(monkeypatch, tmp_path, flag: str) -> None:
    """CC: the real compiler behind a script that rejects `flag` as an older one does; auto kernels, a fresh cache
    (skips where there is no AVX2 or no compiler)."""
    _needs_avx2()
    real = native.compiler()
    if real is None:
        pytest.skip("no C compiler")
    cc = tmp_path / "old-cc"
    cc.write_text(f"#!/bin/sh\nfor a in \"$@\"; do\n  if [ \"$a\" = {flag} ]; then\n"
                  f"    echo \"cc: error: unrecognized command-line option '{flag}'\" >&2; exit 1\n  fi\ndone\n"
                  f"exec {shutil.which(real)} \"$@\"\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("M31R_KERNELS", "auto")
    monkeypatch.delenv("M31R_NATIVE", raising=False)


def plain_build_under_auto(flag: str, family: str) -> native.Kernels:
    """auto's fp32 kernels where the compiler (old_compiler) rejected `flag`: the plain avx2 build, whose reason says
    that `family` did not build, and why."""
    loaded = native.load(torch.float32)
    assert loaded is not None and loaded.name == "avx2" and not loaded.vnni and not loaded.q16_pairs
    assert loaded.reason.startswith(f"the widest family that builds here ({family} did not: ")
    assert f"unrecognized command-line option '{flag}'" in loaded.reason
    return loaded


def test_auto_falls_back_to_the_plain_build_where_the_compiler_lacks_avxvnni(monkeypatch, tmp_path) -> None:
    """GCC before 11 and clang before 12 reject -mavxvnni: under auto the plain avx2 build runs and the reason says
    why; forced, the VNNI family is not replaced."""
    old_compiler(monkeypatch, tmp_path, "-mavxvnni")
    _flags(monkeypatch, vnni=True)
    native.load.cache_clear()
    try:
        loaded = plain_build_under_auto("-mavxvnni", "avx2vnni")
        assert loaded.reason == native.why_not(torch.float32)
        monkeypatch.setenv("M31R_KERNELS", "avx2vnni")
        native.load.cache_clear()
        assert native.load(torch.float32) is None and "failed on kernels_avx2.c" in native.why_not(torch.float32)
    finally:
        native.load.cache_clear()

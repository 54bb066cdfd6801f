"""The avx512vnni family: m31r/kernels_avx2.c built with AVX-512 VNNI, whose q16 int8 matmul runs two rows per
512-bit register (kernels_avx2.c's Q16P tiles), against the plain avx2 build.

Each lane pair of a 512-bit accumulator is lane i of the plain build's 8-lane accumulator for two rows: the same
four products, the same conversion, FMA and fold. So every result must be the plain build's bit for bit, for any
row count (pairs, an odd row left over, several groups of 8), alone or batched; the q8, int4 and fp32 matmuls too.
Then what `auto` chooses, the refusal where the CPU lacks AVX-512 VNNI, and the fallback to the plain build where
the compiler lacks -mavx512vnni.

Tests that run kernels need a CPU with avx512_vnni (Intel since Cascade Lake, AMD since Zen 4) and skip, saying so,
elsewhere; the choice and fallback tests run on any x86-64 Linux CPU with AVX2 (they fake the flags)."""

from __future__ import annotations

import pytest
import torch
from test_native import family  # the loaded or built kernels of a family, or skip
from test_native_vnni import _activations, _codes, _needs_avx2, _scales, bits, old_compiler, plain_build_under_auto

from m31r import native
from m31r.quant import Int8Linear


def both() -> tuple[native.Kernels, native.Kernels]:
    """(plain avx2, avx512vnni); the CPU runs both where it runs the second."""
    wide = family("avx512vnni")
    return family("avx2"), wide


def test_each_build_is_what_its_family_says() -> None:
    plain, wide = both()
    assert wide.q16_pairs and wide.vnni and not plain.q16_pairs
    assert wide.path.name.startswith("kernels-avx512vnni-") and wide.path != plain.path
    assert "two rows per 512-bit register" in wide.int8_kernel and "512-bit" not in plain.int8_kernel
    assert "512-bit q16 tiles" in wide.describe()
    with pytest.raises(RuntimeError, match="built without AVX-VNNI for avx512vnni"):
        native.Kernels(plain.path, "avx512vnni")
    if native.family_unsupported("avx2vnni") is None:
        with pytest.raises(RuntimeError, match="built without 512-bit q16 tiles for avx512vnni"):
            native.Kernels(family("avx2vnni").path, "avx512vnni")
        with pytest.raises(RuntimeError, match="built with 512-bit q16 tiles for avx2vnni"):
            native.Kernels(wide.path, "avx2vnni")
    assert wide.int8_check()[0]


@pytest.mark.parametrize("mode", native.INT8_MODES)
@pytest.mark.parametrize(("m", "n", "k"), [(6, 8, 32), (7, 24, 96), (8, 40, 64), (9, 24, 96), (17, 64, 1024),
                                           (16, 200, 512), (19, 16, 2048)])
def test_int8_matmuls_are_the_plain_builds_bit_for_bit(mode: str, m: int, n: int, k: int) -> None:
    """Even and odd row counts, one group of 8 and several, K of one block to 64."""
    plain, wide = both()
    x, codes, scales = _activations(m, k, seed=k), _codes(n, k, seed=n), _scales(n, seed=m)
    y = wide.int8_mm(x, codes, scales, mode=mode)
    assert torch.equal(bits(y), bits(plain.int8_mm(x, codes, scales, mode=mode)))
    assert y.isfinite().all() and not torch.equal(y[0], y[1])


@pytest.mark.parametrize(("m", "n", "k", "group"), [(6, 8, 64, 32), (17, 64, 1024, 64)])
def test_int4_and_fp32_matmuls_are_the_plain_builds_bit_for_bit(m: int, n: int, k: int, group: int) -> None:
    plain, wide = both()
    gen = torch.Generator().manual_seed(k + group)
    codes = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    scale = torch.rand(n, k // group, generator=gen) * 0.01
    base = torch.randn(n, k // group, generator=gen) * 0.05
    x = _activations(m, k, seed=group)
    assert torch.equal(bits(wide.int4_mm(x, codes, scale, base, group)), bits(plain.int4_mm(x, codes, scale, base,
                                                                                              group)))
    w = torch.randn(n, k, generator=gen)
    assert torch.equal(bits(wide.f32_mm(x, w)), bits(plain.f32_mm(x, w)))


def test_a_row_gets_the_same_bits_alone_paired_and_batched() -> None:
    """A row's partner (or none) never changes its bits: every suffix, and the rows reordered."""
    _, wide = both()
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(21, 512, generator=gen) * (torch.rand(21, 512, generator=gen) * 3)
    codes, scales = _codes(48, 512, seed=11), _scales(48, seed=11)
    full = wide.int8_mm(x, codes, scales)
    for m in range(1, 22):
        assert torch.equal(wide.int8_mm(x[-m:].contiguous(), codes, scales), full[-m:]), m
    for r in range(21):
        assert torch.equal(wide.int8_mm(x[r:r + 1].contiguous(), codes, scales), full[r:r + 1]), r
    order = torch.randperm(21, generator=gen)
    assert torch.equal(wide.int8_mm(x[order].contiguous(), codes, scales), full[order])


def test_an_int8_engine_decodes_the_same_bits_on_either_build(tiny_bundle) -> None:
    """Batched decode rows (the daemon's streams) run the pair tiles: logits and greedy tokens as the plain build's."""
    from m31r.engine import Engine

    plain, wide = both()
    engine = Engine(tiny_bundle, dtype="float32", quant="int8")
    prompts = [engine.tokenizer.encode(t) for t in ("fn add(a: u32, b: u32) -> u32 {\n", "let mut v = Vec::new();\n",
                                                    "impl Display for Point {\n")]
    logits, tokens = {}, {}
    for k in (plain, wide):
        engine.use_kernels(k)
        assert engine.kernel_report["kernels"] == k.name and engine.kernel_report["native_int8"]
        assert all(mod.native is k for mod in engine.model.modules() if isinstance(mod, Int8Linear))
        caches = [engine.new_cache() for _ in prompts]
        for cache, ids in zip(caches, prompts, strict=True):
            for _ in engine.prefill(cache, ids, 0):
                pass
        logits[k.name] = torch.stack([engine.decode_rows(caches, [11 + i, 12, 13]) for i in range(4)])
        tokens[k.name] = [t.id for t in engine.generate(prompts[0], max_tokens=12)]
    assert torch.equal(logits["avx512vnni"], logits["avx2"]) and tokens["avx512vnni"] == tokens["avx2"]
    assert len(tokens["avx2"]) == 12


# -- the choice ---------------------------------------------------------------------------------------------------


def _flags(monkeypatch, wide: bool) -> None:
    """This CPU's flags with or without AVX-512 VNNI (and the AVX-512 parts it needs), the rest as they are."""
    name, flags, arch = native.cpu_info()
    needs = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}
    flags = flags | needs if wide else flags - {"avx512_vnni"}
    monkeypatch.setattr(native, "cpu_info", lambda: (name, flags, arch))
    monkeypatch.setattr(native.torch.backends.cpu, "get_cpu_capability", lambda: "AVX512" if wide else "AVX2")


def test_auto_prefers_avx512vnni_for_fp32_where_the_cpu_has_it(monkeypatch) -> None:
    _needs_avx2()
    monkeypatch.setenv("M31R_KERNELS", "auto")
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    _flags(monkeypatch, wide=True)
    assert native.choose(torch.float32)[0] is native.FAMILIES["avx512vnni"]
    _flags(monkeypatch, wide=False)
    assert native.choose(torch.float32)[0] in (native.FAMILIES["avx2vnni"], native.FAMILIES["avx2"])
    assert native.family_unsupported("avx512vnni") == "the CPU lacks avx512_vnni"
    monkeypatch.setenv("M31R_KERNELS", "avx512vnni")
    assert native.choose() == (None, "M31R_KERNELS=avx512vnni, but the CPU lacks avx512_vnni")


def test_auto_falls_back_to_the_plain_build_where_the_compiler_lacks_avx512vnni(monkeypatch, tmp_path) -> None:
    old_compiler(monkeypatch, tmp_path, "-mavx512vnni")
    _flags(monkeypatch, wide=True)
    native.load.cache_clear()
    try:
        plain_build_under_auto("-mavx512vnni", "avx512vnni")
    finally:
        native.load.cache_clear()

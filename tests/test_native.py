"""The native kernels (m31r/kernels.c and m31r/kernels_avx2.c through m31r.native), family by family.

Decode attention: its arithmetic against an fp32 reference, the bits a row gets alone and batched, the cache writes
it makes. The int8 (and, AVX2, int4) matmuls: against the exact product (AVX2 int8: within the error bound of its
q16 activations, which q8 activations miss), rows alone and batched, the start-up self-check. Then the family
choice and M31R_KERNELS, the build cache, and engines running them.

Each family's tests run where the CPU has its instructions and skip, saying so, where it does not: CI machines have
AVX-512 and a C compiler (.ci/run installs one where missing) and run both families (AVX-512 CPUs have AVX2); a
laptop without AVX-512 runs the AVX2 ones, an Arm machine runs them on the neon family (test_native_neon.py
runs that family on x86-64, under qemu-user). Shapes are tiny: the whole module takes seconds."""

from __future__ import annotations

import functools
import os
import sys

import pytest
import torch

from m31r import native, quant
from m31r.model import KVCache, span_of

LOADED = native.load()


@functools.cache
def _built(name: str) -> native.Kernels:
    return native.Kernels(native.build(family=name), name)


def family(name: str) -> native.Kernels:
    """The loaded kernels of a family (those `native.load` chose when it is the one), or skip the test."""
    why = native.family_unsupported(name)
    if why is not None:
        pytest.skip(f"the {name} kernels cannot run on this CPU: {why}")
    if native.compiler() is None:
        pytest.skip("no C compiler")
    return LOADED if LOADED is not None and LOADED.name == name else _built(name)


def test_the_widest_family_this_cpu_runs_loads() -> None:
    """Where a family runs, `load` (M31R_KERNELS unset) picks the widest; the choice names its reason."""
    if os.environ.get("M31R_KERNELS", "auto") != "auto" or os.environ.get("M31R_NATIVE") == "0":
        pytest.skip("M31R_KERNELS or M31R_NATIVE set for this run")
    runs = [name for name in native.FAMILIES if native.family_unsupported(name) is None]
    if not runs or native.compiler() is None:
        assert LOADED is None
        pytest.skip(f"no family runs here: {native.why_not()}")
    assert LOADED is not None and LOADED.name == runs[0], native.why_not()
    assert LOADED.reason == "the widest family this CPU runs"


def test_m31r_kernels_picks_a_family_and_never_one_the_cpu_lacks(monkeypatch) -> None:
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    for name in native.FAMILIES:
        monkeypatch.setenv("M31R_KERNELS", name)
        chosen, why = native.choose()
        if native.family_unsupported(name) is None:
            assert chosen is native.FAMILIES[name] and why == f"forced by M31R_KERNELS={name}"
        else:
            assert chosen is None and why.startswith(f"M31R_KERNELS={name}, but ")
    monkeypatch.setenv("M31R_KERNELS", "eager")
    assert native.choose() == (None, "disabled by M31R_KERNELS=eager")
    monkeypatch.setenv("M31R_KERNELS", "sse9")
    choices = "not one of auto, avx512, avx512vnni, avx2vnni, avx2, neon, eager"
    assert native.choose()[0] is None and choices in native.choose()[1]
    monkeypatch.setenv("M31R_KERNELS", "avx2")
    monkeypatch.setenv("M31R_NATIVE", "0")  # the older switch still turns them all off
    assert native.choose() == (None, "disabled by M31R_NATIVE=0")
    assert native.unavailable() == "disabled by M31R_NATIVE=0"


def test_a_family_needs_the_cpu_flags_and_torch_to_agree(monkeypatch) -> None:
    """Features are read, never assumed: a CPU whose flags lack AVX2, or a torch that reports a narrower
    capability, runs no AVX2 kernels."""
    if sys.platform != "linux" or native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86-64 Linux only")
    name, flags, arch = native.cpu_info()
    monkeypatch.setattr(native, "cpu_info", lambda: (name, flags - {"avx2"}, arch))
    assert native.family_unsupported("avx2") == "the CPU lacks avx2"
    monkeypatch.setattr(native, "cpu_info", lambda: (name, flags | {"avx2", "fma", "f16c"}, arch))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert native.family_unsupported("avx2") == "torch reports CPU capability DEFAULT"


def K512() -> native.Kernels:  # noqa: N802
    return family("avx512")


def _engine(bundle, name: str, **kw):
    """An Engine running family `name`'s kernels wherever its dtype is theirs, whichever family `load` chose."""
    from m31r.engine import Engine

    kernels = family(name)
    engine = Engine(bundle, **kw)
    engine.use_kernels(kernels)
    return engine


class Cfg:  # what KVCache reads from a model config
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim


def _caches(lengths: list[int], kv: int, hd: int, layers: int = 2, seed: int = 0, ahead: int = 0,
            dtype: torch.dtype = torch.bfloat16) -> list[KVCache]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        c = KVCache(Cfg(layers, kv, hd), span_of(n) + ahead, dtype, "cpu")
        for t in (*c.k, *c.v):
            t.copy_(torch.randn(t.shape, generator=gen))
        out.append(c)
    return out


def _inputs(rows: int, heads: int, kv: int, hd: int, seed: int = 1,
            dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(rows, h, hd, generator=gen) * 2).to(dtype) for h in (heads, kv, kv))


def _attend(caches: list[KVCache], lengths: list[int], q, k, v, layer: int = 1, kernels=None) -> torch.Tensor:
    out = torch.empty_like(q)
    native.DecodeTable(kernels or family("avx512"), caches, [n - 1 for n in lengths]).attend(q, k, v, layer, out)
    return out


def _reference(cache: KVCache, n: int, q: torch.Tensor, layer: int) -> torch.Tensor:
    """fp32 attention of q [heads, hd] over positions [0, n) of one cache."""
    k, v = cache.k[layer][0, :, :n].float(), cache.v[layer][0, :, :n].float()  # [kv, n, hd]
    group = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    p = torch.softmax((q.float()[:, None, :] * q.shape[-1] ** -0.5 * k).sum(-1), dim=-1)
    return (p[:, :, None] * v).sum(1)


@pytest.mark.parametrize("heads,kv,hd", [(16, 16, 64), (8, 2, 64), (4, 4, 16), (4, 1, 128)])
def test_matches_fp32_attention_and_writes_the_new_key_and_value(heads: int, kv: int, hd: int) -> None:
    lengths = [1, 17, 64, 65, 300, 1000]
    caches = _caches(lengths, kv, hd)
    q, k, v = _inputs(len(lengths), heads, kv, hd)
    out = _attend(caches, lengths, q, k, v)
    for r, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        assert torch.equal(cache.k[1][0, :, n - 1], k[r]) and torch.equal(cache.v[1][0, :, n - 1], v[r])
        ref = _reference(cache, n, q[r], 1)
        # One bf16 rounding of the output: within 2^-8 of its magnitude, plus fp32 noise.
        assert (out[r].float() - ref).abs().max() <= ref.abs().max() / 128 + 1e-3, (r, n)
    assert not torch.equal(out[0], out[1])


def test_a_row_gets_the_same_bits_alone_batched_and_in_any_order() -> None:
    """Each call rewrites a row's new key/value with the same values, so the caches can be reused across calls."""
    lengths = [5, 130, 64, 700, 129, 2048, 33, 256]
    heads, kv, hd = 16, 16, 64
    caches = _caches(lengths, kv, hd)
    q, k, v = _inputs(len(lengths), heads, kv, hd)
    together = _attend(caches, lengths, q, k, v)
    order = [3, 0, 7, 5, 1, 6, 2, 4]
    shuffled = _attend([caches[i] for i in order], [lengths[i] for i in order], q[order].contiguous(),
                       k[order].contiguous(), v[order].contiguous())
    assert torch.equal(shuffled, together[order])
    for r, n in enumerate(lengths):
        alone = _attend(caches[r : r + 1], [n], q[r : r + 1], k[r : r + 1], v[r : r + 1])
        assert torch.equal(alone[0], together[r]), r


def test_positions_past_the_context_are_never_read() -> None:
    """Capacity beyond the context (a cache grown ahead, or one reused for a shorter sequence) may hold anything."""
    lengths = [70, 200]
    q, k, v = _inputs(2, 4, 4, 64)
    clean = _attend(_caches(lengths, 4, 64, ahead=192), lengths, q, k, v)
    dirty = _caches(lengths, 4, 64, ahead=192)
    for c, n in zip(dirty, lengths, strict=True):
        for t in (*c.k, *c.v):
            t[0, :, n:] = float("nan")
    assert torch.equal(_attend(dirty, lengths, q, k, v), clean)


def test_shapes_it_does_not_take_are_refused_without_side_effects() -> None:
    caches = _caches([10], 4, 24)
    q, k, v = _inputs(1, 4, 4, 24)
    before = caches[0].k[1].clone()
    with pytest.raises(ValueError, match="head_dim=24"):
        _attend(caches, [10], q, k, v)
    assert torch.equal(caches[0].k[1], before)


@pytest.mark.parametrize("name", list(native.FAMILIES))
def test_the_build_is_cached_and_a_broken_compiler_is_reported(tmp_path, name: str, monkeypatch) -> None:
    """Each family builds from its own source with its own flags, into its own cached file."""
    family(name)
    first = native.build(tmp_path, family=name)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path, family=name) == first and first.stat().st_mtime_ns == stamp
    assert first.name.startswith(f"kernels-{name}-")
    if name != next(n for n in native.FAMILIES if native.family_unsupported(n) is None):
        return  # one family is enough: the first this CPU runs
    # A broken compiler and an empty cache, in this process (load's cache cleared before and after: a
    # subprocess for it cost a torch import).
    monkeypatch.setenv("CC", "false")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty"))
    monkeypatch.setenv("M31R_KERNELS", name)
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    native.load.cache_clear()
    try:
        assert native.load() is None
        assert f"false failed on {native.FAMILIES[name].source.name}" in native.why_not()
    finally:
        native.load.cache_clear()  # the next load sees the restored environment


def test_the_engine_decodes_with_it_close_to_the_eager_path(tiny_bundle) -> None:
    """bf16 engines run the kernel on every decode row; its logits stay within bf16 noise of eager attention's, and
    greedy generation is deterministic with it."""
    engine = _engine(tiny_bundle, "avx512", dtype="bfloat16")
    assert engine.model.native is K512()
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "eager"):
        engine.model.native = K512() if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert not torch.equal(logits["native"], logits["eager"])  # the eager path really ran
    scale = logits["eager"].abs().max()
    assert (logits["native"] - logits["eager"]).abs().max() <= 0.05 * scale
    engine.model.native = K512()
    runs = [[t.id for t in engine.generate(ids, max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


# -- the int8 matmul ------------------------------------------------------------------------------------------


def _int8_operands(m: int, n: int, k: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return x, codes, scales


needs_bf16 = pytest.mark.skipif(not native.int8_supported(), reason="the AVX-512 int8 kernel needs AVX512-BF16")


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(8, 32), (24, 96), (64, 2048), (200, 1024)])
def test_int8_matmul_is_the_exact_product_rounded_once(n: int, k: int) -> None:
    """Products of bf16 activations and int8 codes are exact and summed in fp32: the result is the float64 product
    to within fp32 summation error and the one bf16 rounding of the output."""
    x, codes, scales = _int8_operands(19, n, k)
    y = K512().int8_mm(x, codes, scales)
    exact = x.double() @ codes.double().T * scales.double()
    tolerance = 2**-8 * exact.abs() + 1e-6 * (x.double().abs() @ codes.double().abs().T * scales.double())
    assert y.dtype == torch.bfloat16 and y.shape == (19, n)
    assert ((y.double() - exact).abs() <= tolerance).all()
    aten = torch.ops.aten._weight_int8pack_mm(x, codes, scales)  # torch's kernel: the same numbers up to rounding
    assert (y.double() - aten.double()).abs().max() <= 2 * 2**-8 * exact.abs().max()


@needs_bf16
def test_int8_matmul_gives_a_row_the_same_bits_alone_and_batched() -> None:
    """Every row count takes its own tile shape; the arithmetic of a row must not change with it."""
    x, codes, scales = _int8_operands(63, 136, 1024, seed=3)
    full = K512().int8_mm(x, codes, scales)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 48):
        part = x[-m:].contiguous()
        assert torch.equal(K512().int8_mm(part, codes, scales), full[-m:]), m
    order = torch.randperm(63, generator=torch.Generator().manual_seed(0))
    assert torch.equal(K512().int8_mm(x[order].contiguous(), codes, scales), full[order])


@needs_bf16
def test_int8_matmul_refuses_shapes_it_does_not_take() -> None:
    assert not native.takes_int8(12, 64) and not native.takes_int8(16, 48) and native.takes_int8(16, 64)
    x, codes, scales = _int8_operands(2, 16, 48)
    with pytest.raises(ValueError, match="does not take"):
        K512().int8_mm(x, codes, scales)


@needs_bf16
def test_an_int8_layer_takes_it_below_the_gemm_rows() -> None:
    from m31r.quant import INT8_GEMM_ROWS, Int8Linear

    x, codes, scales = _int8_operands(INT8_GEMM_ROWS, 512, 2048, seed=4)
    layer = Int8Linear(codes, scales)
    aten = layer(x[:48])
    layer.native = K512()
    assert torch.equal(layer(x[:48]), K512().int8_mm(x[:48].contiguous(), codes, scales))
    # The two summations differ in fp32 rounding, which the bf16 output hides for most elements, not all.
    assert not torch.equal(layer(x[:48]), aten)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, codes.to(torch.bfloat16)).mul_(scales))  # GEMM rows


# -- the bf16 matmul (avx512: float layers of bf16 engines) ---------------------------------------------------


def _bf16_operands(m: int, n: int, k: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=gen).to(torch.bfloat16),
            (torch.randn(n, k, generator=gen) * 0.05).to(torch.bfloat16))


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(8, 32), (24, 96), (64, 2048), (200, 1024)])
def test_bf16_matmul_is_the_exact_product_rounded_once(n: int, k: int) -> None:
    """bf16 times bf16 is exact in fp32 and the sums run in fp32: the float64 product to within fp32 summation
    error and the one bf16 rounding of the output; oneDNN's bf16 matmul gives the same numbers up to rounding."""
    x, w = _bf16_operands(19, n, k)
    y = K512().float_mm(x, w)
    exact = x.double() @ w.double().T
    tolerance = 2**-8 * exact.abs() + 1e-6 * (x.double().abs() @ w.double().abs().T)
    assert y.dtype == torch.bfloat16 and y.shape == (19, n)
    assert ((y.double() - exact).abs() <= tolerance).all()
    assert (y.double() - torch.nn.functional.linear(x, w).double()).abs().max() <= 2 * 2**-8 * exact.abs().max()


@needs_bf16
def test_bf16_matmul_gives_a_row_the_same_bits_alone_and_batched() -> None:
    x, w = _bf16_operands(63, 136, 1024, seed=6)
    full = K512().float_mm(x, w)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 48):
        assert torch.equal(K512().float_mm(x[-m:].contiguous(), w), full[-m:]), m
    order = torch.randperm(63, generator=torch.Generator().manual_seed(1))
    assert torch.equal(K512().float_mm(x[order].contiguous(), w), full[order])


@needs_bf16
def test_bf16_matmul_refuses_shapes_it_does_not_take() -> None:
    assert K512().takes_linear(16, 64) and not K512().takes_linear(16, 48) and not K512().takes_linear(12, 64)
    x, w = _bf16_operands(2, 16, 48)
    with pytest.raises(ValueError, match="does not take"):
        K512().float_mm(x, w)
    with pytest.raises(AssertionError):
        K512().float_mm(x.float(), w.float())  # fp32 operands: the avx2 family's matmul, not this one


@needs_bf16
def test_a_bf16_layer_takes_it_below_the_gemm_rows_and_onednn_above() -> None:
    from m31r.quant import BF16_GEMM_ROWS, FloatLinear

    x, w = _bf16_operands(32, 64, 128, seed=7)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    layer = FloatLinear(w.clone(), bias)
    packed = layer(x)
    layer.use_native(K512())
    assert layer.packed is None and torch.equal(layer.weight, w)
    assert torch.equal(layer(x[:5].view(5, 1, 128)).view(5, 64), K512().float_mm(x[:5].contiguous(), w) + bias)
    below = x[: BF16_GEMM_ROWS - 1].contiguous()
    assert torch.equal(layer(below), K512().float_mm(below, w) + bias)
    assert torch.equal(layer(x[:BF16_GEMM_ROWS]), packed[:BF16_GEMM_ROWS])  # GEMM rows: oneDNN, on the plain weight
    assert torch.equal(layer(x), packed)
    layer.use_native(None)
    assert torch.equal(layer(x[:5]), packed[:5])


@needs_bf16
def test_a_bf16_engine_runs_its_float_layers_and_head_on_it_alone_and_batched(tiny_bundle) -> None:
    """Every float layer and the tied head of a bf16 engine on the avx512 family take the kernel; a decode row gets
    the same logits alone or beside others, and greedy generation repeats itself."""
    from m31r.quant import FloatLinear

    engine = _engine(tiny_bundle, "avx512", dtype="bfloat16")
    assert engine.kernel_report["native_float"]
    assert engine.decode_widths[0] == 1  # the probe found a lone row's bits the same as at the full width
    layers = [m for m in engine.model.modules() if isinstance(m, FloatLinear)]
    assert engine.model.head in layers and all(m.native is K512() for m in layers)
    prompts = [engine.tokenizer.encode(t) for t in ("fn main() {", "let x = 1;\n", "impl Foo for Bar {\n    ")]
    caches = []
    for ids in prompts:
        caches.append(engine.new_cache())
        for _ in engine.prefill(caches[-1], ids, 0):
            pass
    alone = [engine.decode_step(c, 7) for c in caches]
    for c in caches:
        del c.tokens[-1:]  # the same position again, now beside the others
    batched = engine.decode_rows(caches, [7, 7, 7])
    for r in range(3):
        assert torch.equal(batched[r], alone[r]), r
    runs = [[t.id for t in engine.generate(prompts[0], max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


@needs_bf16
def test_an_int8_engine_runs_it_on_every_decode_row(tiny_bundle) -> None:
    """Every int8 layer of a bf16 engine takes the kernel; logits stay close to torch's int8 kernel, every decode
    width gives a row its bits (the probe), and greedy generation is deterministic."""
    from m31r.quant import Int8Linear

    engine = _engine(tiny_bundle, "avx512", dtype="bfloat16", quant="int8")
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * engine.config.n_layers + 1 and all(m.native is K512() for m in layers)
    assert engine.decode_widths == list(range(1, engine.decode_width + 1))
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "aten"):
        for m in layers:
            m.native = K512() if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert (logits["native"] - logits["aten"]).abs().max() <= 0.05 * logits["aten"].abs().max()
    for m in layers:
        m.native = K512()
    runs = [[t.id for t in engine.generate(ids, max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


@needs_bf16
def test_an_imported_shape_runs_both_kernels(tiny_config, tmp_path) -> None:
    """An imported checkpoint's shape (q/k/v biases added after the native int8 product, an untied int8 head, GQA, a
    tokenizer smaller than the embedding): decode attention and every int8 layer, the head included, take the
    kernels; logits stay close to torch's kernels, and greedy generation is deterministic and never emits padding."""
    import msgspec

    from m31r.bundle import write_bundle
    from m31r.model import Transformer, init_weights
    from m31r.quant import Int8Linear
    from m31r.tokenizer import build_byte_tokenizer

    config = msgspec.structs.replace(tiny_config, n_kv_heads=2, qkv_bias=True, tie_embeddings=False)
    model = Transformer(config)
    init_weights(model, 5)
    gen = torch.Generator().manual_seed(5)  # not the global generator: its state depends on the tests run before
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.bias.normal_(0, 0.5, generator=gen)
    bundle = write_bundle(tmp_path / "b", config, model.state_dict(), build_byte_tokenizer(300), seed=5,
                          dataset_version="test", dtype=torch.float32)
    engine = _engine(bundle, "avx512", dtype="bfloat16", quant="int8")
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert engine.model.output in layers and engine.model.head is None
    assert len(layers) == 4 * config.n_layers + 1 and all(m.native is K512() for m in layers)
    assert engine.model.native is K512()
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "torch"):
        for m in [*layers, engine.model]:
            m.native = K512() if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert (logits["native"] - logits["torch"]).abs().max() <= 0.05 * logits["torch"].abs().max()
    for m in [*layers, engine.model]:
        m.native = K512()
    runs = [[t.id for t in engine.generate(ids, max_tokens=12) if t.id is not None] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0 and max(runs[0]) < 300


# -- the AVX2 family: fp32 decode attention, q16 int8 and q8 int4 matmuls -------------------------------------------
# On Arm machines the neon family (kernels_neon.c: the same functions, down to the bits) runs these tests; on x86-64
# tests/test_native_neon.py runs it under qemu-user.

FP32 = "neon" if native.platform.machine().lower() in ("aarch64", "arm64") else "avx2"  # the fp32 family to test


def K2() -> native.Kernels:  # noqa: N802
    return family(FP32)


def _f32(lengths: list[int], heads: int, kv: int, hd: int, ahead: int = 0):
    caches = _caches(lengths, kv, hd, dtype=torch.float32, ahead=ahead)
    return caches, _inputs(len(lengths), heads, kv, hd, dtype=torch.float32)


@pytest.mark.parametrize("heads,kv,hd", [(16, 16, 64), (8, 2, 64), (4, 4, 16), (4, 1, 128), (2, 2, 24)])
def test_avx2_attention_matches_fp32_and_writes_the_new_key_and_value(heads: int, kv: int, hd: int) -> None:
    lengths = [1, 7, 17, 64, 65, 300, 1000]
    caches, (q, k, v) = _f32(lengths, heads, kv, hd)
    out = _attend(caches, lengths, q, k, v, kernels=K2())
    for r, (cache, n) in enumerate(zip(caches, lengths, strict=True)):
        assert torch.equal(cache.k[1][0, :, n - 1], k[r]) and torch.equal(cache.v[1][0, :, n - 1], v[r])
        ref = _reference(cache, n, q[r], 1)
        assert (out[r] - ref).abs().max() <= 1e-5 * ref.abs().max() + 1e-5, (r, n)  # fp32 throughout
    assert not torch.equal(out[0], out[1])


def test_avx2_attention_gives_a_row_the_same_bits_alone_batched_and_in_any_order() -> None:
    lengths = [5, 130, 64, 700, 129, 33, 256]
    caches, (q, k, v) = _f32(lengths, 8, 4, 64)
    together = _attend(caches, lengths, q, k, v, kernels=K2())
    order = [3, 0, 6, 5, 1, 2, 4]
    shuffled = _attend([caches[i] for i in order], [lengths[i] for i in order], q[order].contiguous(),
                       k[order].contiguous(), v[order].contiguous(), kernels=K2())
    assert torch.equal(shuffled, together[order])
    for r, n in enumerate(lengths):
        alone = _attend(caches[r : r + 1], [n], q[r : r + 1], k[r : r + 1], v[r : r + 1], kernels=K2())
        assert torch.equal(alone[0], together[r]), r


def test_avx2_attention_never_reads_past_the_context_and_refuses_what_it_does_not_take() -> None:
    lengths = [70, 200]
    caches, (q, k, v) = _f32(lengths, 4, 4, 64, ahead=192)
    clean = _attend(caches, lengths, q, k, v, kernels=K2())
    for c, n in zip(caches, lengths, strict=True):
        for t in (*c.k, *c.v):
            t[0, :, n:] = float("nan")
    assert torch.equal(_attend(caches, lengths, q, k, v, kernels=K2()), clean)
    caches, (q, k, v) = _f32([10], 4, 4, 20)
    before = caches[0].k[1].clone()
    with pytest.raises(ValueError, match="head_dim=20"):
        _attend(caches, [10], q, k, v, kernels=K2())
    assert torch.equal(caches[0].k[1], before)
    with pytest.raises(AssertionError, match="float32"):  # bf16 tensors are the other family's
        bf = _caches([10], 4, 64)
        _attend(bf, [10], *_inputs(1, 4, 4, 64), kernels=K2())


@pytest.mark.parametrize("heads,kv,hd", [(16, 16, 64), (8, 2, 64), (4, 1, 128), (2, 2, 16)])
def test_avx2_attention_on_the_projection_is_rope_then_attention_bit_for_bit(heads: int, kv: int, hd: int) -> None:
    """attend_qkv (decode rows of fp32 engines) reads the wqkv projection as it is and rotates q and k itself: the
    keys it writes, and its outputs, are torch's apply_rope followed by attend_decode, bit for bit."""
    from m31r.config import ModelConfig
    from m31r.model import apply_rope, rope_tables

    lengths = [1, 40, 64, 65, 300, 700]
    rows = len(lengths)
    gen = torch.Generator().manual_seed(hd)
    qkv = torch.randn(rows, (heads + 2 * kv) * hd, generator=gen) * 2
    cos_t, sin_t = rope_tables(ModelConfig(n_layers=1, d_model=heads * hd, n_heads=heads, n_kv_heads=kv,
                                           ffn_hidden=8, vocab_size=8, max_context=1024))
    pos = torch.tensor([n - 1 for n in lengths])
    cos, sin = cos_t[pos].contiguous(), sin_t[pos].contiguous()
    fused, plain = (_caches(lengths, kv, hd, dtype=torch.float32, seed=3) for _ in range(2))
    out = torch.empty(rows, heads * hd)
    native.DecodeTable(K2(), fused, pos.tolist()).attend_qkv(qkv, cos, sin, 1, out)
    heads4 = qkv.view(rows, heads + 2 * kv, 1, hd)
    qk = apply_rope(heads4[:, : heads + kv], cos.view(rows, 1, 1, hd), sin.view(rows, 1, 1, hd))
    q, k, v = (t.reshape(rows, -1, hd).contiguous() for t in (qk[:, :heads], qk[:, heads:], heads4[:, heads + kv :]))
    ref = _attend(plain, lengths, q, k, v, kernels=K2())
    assert torch.equal(out.view(rows, heads, hd), ref)
    for a, b in zip(fused, plain, strict=True):
        assert all(torch.equal(x, y) for x, y in zip((*a.k, *a.v), (*b.k, *b.v), strict=True))
    with pytest.raises(ValueError, match="head_dim=24"):  # RoPE's halves must be whole chunks of 8
        table = native.DecodeTable(K2(), _caches([10], 2, 24, dtype=torch.float32), [9])
        table.attend_qkv(torch.zeros(1, 6 * 24), torch.zeros(1, 24), torch.zeros(1, 24), 1, torch.zeros(1, 48))


def test_avx2_residual_norm_and_swiglu_match_torch_and_keep_rows_apart() -> None:
    """The per-token ops of fp32 engines: x += delta exactly as torch adds, RMSNorm and silu(gate) * up within fp32
    rounding of torch's (model.RMSNorm, F.silu), each row the same bits alone as batched; shapes they do not take
    are refused."""
    from m31r.model import RMSNorm

    gen = torch.Generator().manual_seed(5)
    x, delta = _x32(9, 256, seed=5) * 3, torch.randn(9, 256, generator=gen)
    norm = RMSNorm(256, 1e-5)
    norm.weight.data = torch.rand(256, generator=gen) + 0.5
    h, summed = torch.empty_like(x), x.clone()
    K2().add_rmsnorm(summed, delta, norm.weight.data, 1e-5, h)
    assert torch.equal(summed, x + delta)
    with torch.no_grad():
        ref = norm(x + delta)
    assert (h - ref).abs().max() <= 4e-7 * ref.abs().max()
    alone = torch.empty(1, 256)
    K2().add_rmsnorm((x + delta)[4:5].contiguous(), None, norm.weight.data, 1e-5, alone)
    assert torch.equal(alone[0], h[4])
    gate_up = torch.randn(9, 2 * 96, generator=gen) * 6
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    y = K2().swiglu(gate_up)
    ref = torch.nn.functional.silu(gate_up[:, :96]) * gate_up[:, 96:]
    assert y.shape == (9, 96) and ((y - ref).abs() <= 1e-6 * ref.abs() + 1e-30).all()
    assert torch.equal(K2().swiglu(gate_up[3:4].contiguous())[0], y[3])
    with pytest.raises(ValueError, match="rows of 12"):
        K2().swiglu(torch.zeros(2, 12))
    with pytest.raises(ValueError, match="rows of 20"):
        K2().add_rmsnorm(torch.zeros(2, 20), None, torch.ones(20), 1e-5, torch.zeros(2, 20))


def _x32(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen) * (torch.rand(m, k, generator=gen) * 3)  # uneven magnitudes


@pytest.mark.parametrize(("n", "k"), [(8, 32), (24, 96), (64, 1024), (200, 512)])
def test_avx2_int8_matmul_is_within_the_q16_bound_which_q8_activations_miss(n: int, k: int) -> None:
    """The engine's int8 kernel (q16: activations rounded to int16 per block of 32) stays within half a q16 step
    per activation of the exact product everywhere; the old q8 activations miss that bound by far (but keep their
    own, ~258x wider); the fp32-widened alternative is exact to fp32 rounding."""
    from m31r.quant import dequantize_int8, quantize_int8

    x = _x32(11, k, seed=n)
    codes, scales = quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05)
    w = dequantize_int8(codes, scales)
    exact = x.double() @ w.double().T
    q16_bound = native.int8_error_bound("avx2", x, w)
    y = K2().int8_mm(x, codes, scales)
    assert y.dtype == torch.float32 and y.shape == (11, n)
    assert torch.equal(y, K2().int8_mm(x, codes, scales, mode="q16"))  # q16 is what engines run
    assert ((y.double() - exact).abs() <= q16_bound).all()
    q8 = K2().int8_mm(x, codes, scales, mode="q8")
    assert ((q8.double() - exact).abs() <= native.int8_error_bound("avx2", x, w, "q8")).all()
    assert ((q8.double() - exact).abs() / q16_bound).max() > 10  # q8 misses the q16 bound tenfold
    assert (q8.double() - exact).abs().mean() > 50 * (y.double() - exact).abs().mean()
    widened = K2().int8_mm(x, codes, scales, mode="f32")
    assert (widened.double() - exact).abs().max() <= 1e-5 * exact.abs().max()
    with pytest.raises(ValueError, match="int8 mode 'q4'"):
        K2().int8_mm(x, codes, scales, mode="q4")


@pytest.mark.parametrize("mode", ["q16", "q8"])
def test_avx2_int8_matmul_gives_a_row_the_same_bits_alone_and_batched(mode: str) -> None:
    x, codes, scales = _x32(23, 256, seed=3), *_int8_operands(1, 40, 256, seed=3)[1:]
    full = K2().int8_mm(x, codes, scales, mode=mode)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
        assert torch.equal(K2().int8_mm(x[-m:].contiguous(), codes, scales, mode=mode), full[-m:]), m
    order = torch.randperm(23, generator=torch.Generator().manual_seed(0))
    assert torch.equal(K2().int8_mm(x[order].contiguous(), codes, scales, mode=mode), full[order])
    with pytest.raises(ValueError, match="does not take"):
        K2().int8_mm(x[:, :48].contiguous(), codes[:, :48].contiguous(), scales, mode=mode)


@pytest.mark.parametrize("name", [FP32, "avx512"])
def test_the_int8_self_check_passes_the_kernels_engines_run_and_fails_q8(name: str) -> None:
    """`int8_check` (what --quant auto relies on for fp32 engines) passes each family's engine kernel and fails the
    avx2 (neon) family's q8 kernel, whose activation rounding is the accuracy problem it guards against."""
    family(name)  # skips where the CPU lacks the family
    kernels = native.Kernels(native.build(family=name), name)  # a private instance: int8_mode is switched below
    if name == "avx512" and not kernels.int8:
        pytest.skip("the AVX-512 int8 kernel needs AVX512-BF16")
    ok, detail = kernels.int8_check()
    assert ok and detail.startswith("int8 self-check passed"), detail
    if name == FP32:
        kernels.int8_mode = "q8"
        ok, detail = kernels.int8_check()
        assert not ok and "self-check failed: error" in detail, detail
        assert "q8" in kernels.describe() and "q8" in kernels.int8_kernel
        kernels.int8_mode = "q16"
        assert kernels.int8_check()[0]


def _int4(n: int, k: int, group: int, seed: int):
    from m31r.quant import Int4Linear, dequantize_int4, quantize_int4

    codes, sz = quantize_int4(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05, group)
    layer = Int4Linear(codes, sz, group)
    layer.use_native(K2())
    return layer, dequantize_int4(codes, sz, group)


@pytest.mark.parametrize(("n", "k", "group"), [(16, 64, 32), (32, 128, 64), (64, 1024, 64), (48, 512, 128)])
def test_avx2_int4_matmul_is_the_product_of_q8_activations(n: int, k: int, group: int) -> None:
    """Codes and group scales enter exactly; the zero points multiply the plain fp32 sum of x; only the activations
    are quantized, so the error is within the q8 bound of the scale term."""
    layer, w = _int4(n, k, group, seed=n)
    x = _x32(11, k, seed=k)
    y = K2().int4_mm(x, layer.codes, layer._scale_f32, layer._base_f32, group)
    exact = x.double() @ w.double().T
    scaled = (layer._scale_f32.repeat_interleave(group, 1) * torch.arange(16.0).max())  # |code * scale| <= 15 scale
    bound = native.int8_error_bound("avx2", x, scaled, "q8") + 1e-5 * exact.abs().max()
    assert ((y.double() - exact).abs() <= bound).all()


def test_avx2_int4_matmul_gives_a_row_the_same_bits_alone_and_batched() -> None:
    layer, _ = _int4(48, 256, 64, seed=5)
    x = _x32(19, 256, seed=6)
    full = layer(x)
    for m in (1, 2, 3, 4, 5, 8, 9, 13):
        assert torch.equal(layer(x[-m:].contiguous()), full[-m:]), m
    order = torch.randperm(19, generator=torch.Generator().manual_seed(1))
    assert torch.equal(layer(x[order].contiguous()), full[order])


@pytest.mark.parametrize(("n", "k"), [(8, 8), (24, 96), (64, 1024), (200, 520), (16, 4096)])
def test_avx2_f32_matmul_is_the_exact_product_within_fp32_rounding(n: int, k: int) -> None:
    """Each output is a sum of k products in fp32: per lane k/8 fused multiply-adds (one rounding each), then three
    adds across the 8 lanes, so its error against the float64 product stays below (k/8 + 3) roundings of the sum of
    |x * w| (2^-24 relative each, first order). A product of a few elements checks the indexing exactly."""
    x = _x32(11, k, seed=n)
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(k)) * 0.05
    y = K2().f32_mm(x, w)
    assert y.dtype == torch.float32 and y.shape == (11, n)
    exact = x.double() @ w.double().T
    bound = (k / 8 + 3) * 2.0**-24 * (x.double().abs() @ w.double().abs().T) * 1.01
    assert ((y.double() - exact).abs() <= bound).all()
    assert (y.double() - exact).abs().max() > 0 or k == 8  # the bound is fp32's, not exactness by accident
    ints = torch.randint(-8, 8, (11, k), generator=torch.Generator().manual_seed(1)).float()
    iw = torch.randint(-8, 8, (n, k), generator=torch.Generator().manual_seed(2)).float()
    assert torch.equal(K2().f32_mm(ints, iw), (ints.double() @ iw.double().T).float())  # exact sums below 2^24


def test_avx2_f32_matmul_gives_a_row_the_same_bits_alone_and_batched() -> None:
    """Every row count from 1 to 17 (tiles of 1 to 8 rows, and a second group past 8), any order, any thread count:
    what lets an fp32 engine decode a lone stream at one row."""
    x, w = _x32(17, 256, seed=4), torch.randn(40, 256, generator=torch.Generator().manual_seed(4))
    full = K2().f32_mm(x, w)
    for m in range(1, 18):
        assert torch.equal(K2().f32_mm(x[-m:].contiguous(), w), full[-m:]), m
        assert torch.equal(K2().f32_mm(x[:m].contiguous(), w), full[:m]), m
    order = torch.randperm(17, generator=torch.Generator().manual_seed(0))
    assert torch.equal(K2().f32_mm(x[order].contiguous(), w), full[order])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(K2().f32_mm(x, w), full)
    finally:
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="does not take"):
        K2().f32_mm(x[:, :12].contiguous(), w[:, :12].contiguous())  # K not a multiple of 8
    with pytest.raises(ValueError, match="does not take"):
        K2().f32_mm(x, w[:36].contiguous())  # N not a multiple of 8
    with pytest.raises(AssertionError):
        K2().f32_mm(x.t(), w)  # not contiguous


def test_an_fp32_layer_takes_it_below_the_gemm_rows_and_keeps_one_copy_of_its_weight() -> None:
    """FloatLinear on the fp32 matmul: rows below F32_GEMM_ROWS run the kernel (a bias added after), more rows
    oneDNN's GEMM on the same plain weight; handing it back to torch packs the weight for oneDNN again."""
    from m31r.quant import F32_GEMM_ROWS, FloatLinear

    gen = torch.Generator().manual_seed(11)
    w, bias = torch.randn(64, 128, generator=gen) * 0.05, torch.randn(64, generator=gen)
    layer = FloatLinear(w.clone(), bias)
    x = _x32(F32_GEMM_ROWS, 128, seed=11)
    eager = layer(x)
    layer.use_native(K2())
    assert layer.packed is None and torch.equal(layer.weight, w)
    assert torch.equal(layer(x[:5].view(5, 1, 128)).view(5, 64), K2().f32_mm(x[:5].contiguous(), w) + bias)
    assert torch.equal(layer(x[:F32_GEMM_ROWS - 1]), K2().f32_mm(x[:F32_GEMM_ROWS - 1].contiguous(), w) + bias)
    big = layer(x.view(1, F32_GEMM_ROWS, 128))
    assert big.shape == (1, F32_GEMM_ROWS, 64)
    torch.testing.assert_close(big[0], eager, atol=1e-5, rtol=1e-5)
    layer.use_native(None)
    if layer.packed is not None:  # oneDNN runs here: the plain copy is dropped again
        assert layer.weight is None
    assert torch.equal(layer(x), eager)


def test_avx2_quantized_layers_take_it_below_the_gemm_rows_and_fp32_gemms_above() -> None:
    from m31r.quant import INT4_GEMM_ROWS, INT8_GEMM_ROWS, Int8Linear, dequantize_int8, quantize_int8

    codes, scales = quantize_int8(torch.randn(64, 128, generator=torch.Generator().manual_seed(9)) * 0.05)
    layer = Int8Linear(codes, scales, bias=torch.full((64,), 0.5))
    layer.native = K2()
    x = _x32(INT8_GEMM_ROWS, 128, seed=9)
    assert torch.equal(layer(x[:5]), K2().int8_mm(x[:5].contiguous(), codes, scales) + 0.5)
    big = layer(x.view(1, INT8_GEMM_ROWS, 128))
    assert big.dtype == torch.float32 and big.shape == (1, INT8_GEMM_ROWS, 64)
    torch.testing.assert_close(big[0], x @ dequantize_int8(codes, scales).T + 0.5, atol=1e-4, rtol=1e-4)
    layer4, w4 = _int4(64, 128, 32, seed=10)
    torch.testing.assert_close(layer4(x[:INT4_GEMM_ROWS]), x[:INT4_GEMM_ROWS] @ w4.T, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_an_fp32_engine_runs_the_avx2_kernels_close_to_the_eager_path(tiny_bundle, quant: str | None) -> None:
    """fp32 engines hand every decode row's attention and every weight matrix (fp32, int8 or int4; the tied fp32
    head too) to the AVX2 kernels; logits stay close to eager torch's, the probe lets every width through and
    short chunks share passes (no kernel changes a row's arithmetic with the row count), and greedy generation is
    deterministic."""
    from m31r.quant import FloatLinear, Int4Linear, Int8Linear

    engine = _engine(tiny_bundle, FP32, dtype="float32", quant=quant, group_size=32)
    layers = [m for m in engine.model.modules() if isinstance(m, (FloatLinear, Int8Linear, Int4Linear))]
    assert len(layers) == 4 * engine.config.n_layers + 1  # the head included
    assert engine.model.native is K2() and all(m.native is K2() for m in layers)
    assert engine.kernel_report["kernels"] == FP32 and engine.kernel_report["native_attention"]
    assert engine.kernel_report["native_int8"] == (quant is not None)
    assert engine.kernel_report["native_int4"] == (quant == "int4")
    assert engine.kernel_report["native_float"] == (quant is None)
    assert engine.decode_widths == list(range(1, engine.decode_width + 1)) and engine.fuse
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "eager"):
        engine.use_kernels(K2() if mode == "native" else None)
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert not any(m.native for m in engine.model.modules() if isinstance(m, (FloatLinear, Int8Linear, Int4Linear)))
    tolerance = 1e-4 if quant is None else 0.05  # eager int8/int4 layers run bf16 activations
    assert (logits["native"] - logits["eager"]).abs().max() <= tolerance * logits["eager"].abs().max()
    engine.use_kernels(K2())
    runs = [[t.id for t in engine.generate(ids, max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_an_fp32_engine_on_the_f32_matmul_picks_eager_fp32s_tokens_alone_and_batched(tiny_bundle) -> None:
    """Greedy decoding of several prompts, fed eager fp32's own tokens step by step (teacher forcing): the fp32
    matmul picks eager's token wherever eager's top two logits are not a near-tie. Then its own greedy output is
    the same run after run, and a stream gets the same logits decoded alone (one row) as beside three others."""
    engine = _engine(tiny_bundle, FP32, dtype="float32")
    assert engine.kernel_report["native_float"] and engine.decode_widths[0] == 1
    prompts = ["fn add(a: u32, b: u32) -> u32 {\n", "let mut v = Vec::new();\n", "impl Display for", "// sum\n"]
    ids = [engine.tokenizer.encode(p) for p in prompts]
    engine.use_kernels(None)
    eager = [[t.id for t in engine.generate(p, max_tokens=16) if t.id is not None] for p in ids]

    def forced(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        cache = engine.new_cache()
        out = [x for x in engine.prefill(cache, prompt, 0) if x is not None]
        return torch.stack(out + [engine.decode_step(cache, t) for t in tokens[:-1]])

    reference = [forced(p, toks) for p, toks in zip(ids, eager, strict=True)]
    engine.use_kernels(K2())
    compared = 0
    for p, toks, ref in zip(ids, eager, reference, strict=True):
        logits = forced(p, toks)
        assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3 * ref.abs().max()
        assert torch.equal(logits.argmax(-1)[clear], ref.argmax(-1)[clear])
        compared += int(clear.sum())
    assert compared >= 0.9 * sum(len(t) for t in eager)
    runs = [[[t.id for t in engine.generate(p, max_tokens=16)] for p in ids] for _ in range(2)]
    assert runs[0] == runs[1]
    caches = [engine.new_cache() for _ in ids]
    for cache, p in zip(caches, ids, strict=True):
        for _ in engine.prefill(cache, p, 0):
            pass
    alone_cache = engine.new_cache()
    for _ in engine.prefill(alone_cache, ids[2], 0):
        pass
    for step in range(4):
        together = engine.decode_rows(caches, [40 + step] * len(caches))
        assert torch.equal(engine.decode_step(alone_cache, 40 + step), together[2])


def test_a_tiny_int8_engine_on_q16_stays_close_to_fp32_activations_and_q8_does_not(tiny_bundle) -> None:
    """An fp32 int8 engine on the AVX2 family: its decode logits on q16 activations stay within 1e-4 of the same
    int8 weights on fp32 activations (the f32 kernel), ~100x closer than q8 activations; greedy tokens are fp32's."""
    from m31r.quant import Int8Linear

    engine = _engine(tiny_bundle, FP32, dtype="float32", quant="int8")
    kernels = native.Kernels(native.build(family=FP32), FP32)  # a private instance: int8_mode is switched
    engine.use_kernels(kernels)
    assert engine.kernel_report["native_int8"] and engine.kernel_report["int8_kernel"].startswith(f"{FP32} q16")
    assert engine.kernel_report["int8_check"].startswith("int8 self-check passed")
    assert all(m.native is kernels for m in engine.model.modules() if isinstance(m, Int8Linear))
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits, tokens = {}, {}
    for mode in ("f32", "q16", "q8"):
        kernels.int8_mode = mode
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13, 14, 15, 16)])
        tokens[mode] = [t.id for t in engine.generate(ids, max_tokens=16)]
    kernels.int8_mode = "q16"
    scale = logits["f32"].abs().max()
    q16, q8 = ((logits[m] - logits["f32"]).abs().max() for m in ("q16", "q8"))
    assert q16 <= 1e-4 * scale and q8 > 20 * q16, (q16, q8, scale)
    assert tokens["q16"] == tokens["f32"] and len(tokens["f32"]) == 16


def test_a_bf16_engine_on_the_avx2_family_stays_eager_and_says_why(tiny_bundle) -> None:
    engine = _engine(tiny_bundle, FP32, dtype="bfloat16", quant="int8")
    report = engine.kernel_report
    assert not report["native_attention"] and not report["native_int8"]
    assert report["kernels_why"] == f"{FP32} kernels take float32 activations, this engine runs bfloat16"


# -- fp16 KV caches under the fp32 kernels -------------------------------------------------------------------------


def _half_inputs(lengths: list[int], heads: int, kv: int, hd: int):
    """The same caches twice, fp16 and fp32 (holding the fp16 values widened), and a wqkv projection to attend."""
    half = _caches(lengths, kv, hd, dtype=torch.float16, seed=3)
    wide = _caches(lengths, kv, hd, dtype=torch.float32, seed=3)
    for h, w in zip(half, wide, strict=True):
        for a, b in zip((*h.k, *h.v), (*w.k, *w.v), strict=True):
            b.copy_(a.float())
    gen = torch.Generator().manual_seed(hd)
    qkv = torch.randn(len(lengths), (heads + 2 * kv) * hd, generator=gen) * 2
    return half, wide, qkv


def _rope_at(lengths: list[int], heads: int, kv: int, hd: int):
    from m31r.config import ModelConfig
    from m31r.model import rope_tables

    cos_t, sin_t = rope_tables(ModelConfig(n_layers=1, d_model=heads * hd, n_heads=heads, n_kv_heads=kv,
                                           ffn_hidden=8, vocab_size=8, max_context=1024))
    pos = torch.tensor([n - 1 for n in lengths])
    return cos_t[pos].contiguous(), sin_t[pos].contiguous()


@pytest.mark.parametrize("heads,kv,hd", [(16, 16, 64), (8, 2, 64), (4, 1, 128), (2, 2, 16)])
def test_avx2_attention_over_an_fp16_cache_is_the_fp32_kernel_on_its_values(heads: int, kv: int, hd: int) -> None:
    """attend_qkv over fp16 caches: the new key (rotated) and value go in as torch's fp16 cast of them, and the
    output is the fp32 kernel's, bit for bit, on fp32 caches holding the same values (the new key and value rounded
    alike): an fp16 cache changes what is stored, never how it is summed."""
    from m31r.model import apply_rope

    lengths = [1, 40, 64, 65, 300, 700]
    half, wide, qkv = _half_inputs(lengths, heads, kv, hd)
    cos, sin = _rope_at(lengths, heads, kv, hd)
    rows, pos = len(lengths), [n - 1 for n in lengths]
    out16 = torch.empty(rows, heads * hd)
    native.DecodeTable(K2(), half, pos).attend_qkv(qkv, cos, sin, 1, out16)
    heads4 = qkv.view(rows, heads + 2 * kv, 1, hd)
    qk = apply_rope(heads4[:, : heads + kv], cos.view(rows, 1, 1, hd), sin.view(rows, 1, 1, hd))
    q, k, v = (t.reshape(rows, -1, hd).contiguous() for t in (qk[:, :heads], qk[:, heads:], heads4[:, heads + kv :]))
    for h, n, kr, vr in zip(half, lengths, k, v, strict=True):
        assert torch.equal(h.k[1][0, :, n - 1], kr.half()) and torch.equal(h.v[1][0, :, n - 1], vr.half())
    ref = _attend(wide, lengths, q, k.half().float(), v.half().float(), kernels=K2())
    assert torch.equal(out16.view(rows, heads, hd), ref)
    assert not torch.equal(ref, _attend(wide, lengths, q, k, v, kernels=K2()))  # the rounding shows


def test_avx2_attention_over_fp16_caches_gives_a_row_the_same_bits_alone_and_batched() -> None:
    lengths = [5, 130, 64, 700, 129]
    heads, kv, hd = 8, 4, 64
    half, _, qkv = _half_inputs(lengths, heads, kv, hd)
    cos, sin = _rope_at(lengths, heads, kv, hd)
    together = torch.empty(len(lengths), heads * hd)
    native.DecodeTable(K2(), half, [n - 1 for n in lengths]).attend_qkv(qkv, cos, sin, 1, together)
    for r, n in enumerate(lengths):
        alone = torch.empty(1, heads * hd)
        native.DecodeTable(K2(), half[r : r + 1], [n - 1]).attend_qkv(qkv[r : r + 1], cos[r : r + 1],
                                                                      sin[r : r + 1], 1, alone)
        assert torch.equal(alone[0], together[r]), r


def test_an_fp32_engine_keeps_an_fp16_cache_where_its_kernels_read_one(tiny_bundle) -> None:
    """kv_dtype auto: fp16 caches under the fp32 kernels (half the bytes; the warm-up log says so), the activation
    dtype when asked. Decode logits stay within fp16's rounding of the fp32 cache's, an fp16 cache
    prefilled under the kernels also serves the eager path, and a dtype no kernel reads is refused."""
    from m31r.engine import Engine

    engine = _engine(tiny_bundle, FP32, dtype="float32")
    assert engine.kv_dtype == torch.float16 and engine.kernel_report["kv_cache"] == "float16"
    assert "half the bytes" in engine.kernel_report["kv_why"]
    full = _engine(tiny_bundle, FP32, dtype="float32", kv_dtype="float32")
    assert full.kv_dtype == torch.float32 and full.cache_bytes(128) == 2 * engine.cache_bytes(128)
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits, caches = {}, {}
    for name, e in (("half", engine), ("full", full)):
        cache = caches[name] = e.new_cache()
        assert cache.k[0].dtype == e.kv_dtype
        for _ in e.prefill(cache, ids, 0):
            pass
        logits[name] = torch.stack([e.decode_step(cache, t) for t in (11, 12, 13)])
    scale = logits["full"].abs().max()
    assert 0 < (logits["half"] - logits["full"]).abs().max() <= 2e-3 * scale
    engine.use_kernels(None)  # the eager path reads the fp16 cache made under the kernels, widened
    assert engine.kv_dtype == torch.float32
    eager = engine.decode_step(caches["half"], 14)
    engine.use_kernels(K2())
    assert (eager - full.decode_step(caches["full"], 14)).abs().max() <= 2e-3 * scale
    with pytest.raises(ValueError, match="kv_dtype float16"):
        Engine(tiny_bundle, dtype="bfloat16", kv_dtype="float16")  # bf16 engines keep bf16 caches
    with pytest.raises(ValueError, match="unknown kv_dtype"):
        Engine(tiny_bundle, dtype="float32", kv_dtype="int8")


@pytest.mark.parametrize("quant", [None, "int8", "int4"])
def test_a_decode_layer_in_one_call_gives_the_per_call_paths_bits(tiny_bundle, quant: str | None,
                                                                   monkeypatch) -> None:
    """m31r_decode_layer_f32 runs a layer of a decode pass as one call: the logits of lone and batched decode rows
    (fp16 and fp32 caches) are those of the per-call path, bit for bit; a pass with a prefill chunk, or a layer the
    call does not take (a bias), runs the per-call path."""
    from m31r.model import Transformer

    assert K2().decode_layer
    prompts = ["fn add(a: u32, b: u32) -> u32 {\n", "let mut v = Vec::new();\n", "impl Display for"]

    def run(engine) -> list[torch.Tensor]:
        caches = [engine.new_cache() for _ in prompts]
        for cache, p in zip(caches, prompts, strict=True):
            for _ in engine.prefill(cache, engine.tokenizer.encode(p), 0):
                pass
        out = [engine.decode_step(caches[0], 40), engine.decode_step(caches[0], 41)]
        return out + [engine.decode_rows(caches, [50 + i for i in range(len(caches))]) for _ in range(2)]

    for kv in ("auto", "float32"):
        engine = _engine(tiny_bundle, FP32, dtype="float32", quant=quant, group_size=32, kv_dtype=kv)
        plan = engine.model.layer_plan(1)
        assert plan is not None and len(plan.layers) == engine.config.n_layers
        calls = []
        original = Transformer._layers_fused
        monkeypatch.setattr(Transformer, "_layers_fused",
                            lambda *a, calls=calls, original=original: calls.append(1) or original(*a))
        fused = run(engine)
        assert len(calls) >= 4  # every decode pass (and the engine's probe of its widths)
        monkeypatch.undo()
        engine.model.layer_calls = False
        assert engine.model.layer_plan(1) is None
        per_call = run(engine)
        assert all(torch.equal(a, b) for a, b in zip(fused, per_call, strict=True)), (quant, kv)
    engine.model.layers[0].attention.wo.bias = torch.zeros(engine.config.d_model)
    engine.use_kernels(K2())
    assert engine.model.layer_plan(1) is None


@pytest.mark.parametrize("m", [64, 200])  # prefill chunks: the fp32 GEMM on the dequantized weights, from 64 rows
def test_quantized_layers_on_fp32_activations_run_chunks_at_fp32_precision(m: int) -> None:
    """Int8 and int4 layers under the fp32 family take a chunk of 64 rows and more through an fp32 GEMM (oneDNN's
    where torch has it) on the weights the codes stand for: fp32 products of the exact dequantized weights, unlike
    the bf16 activations of the torch kernels."""
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(96, 128, generator=gen), torch.randn(m, 128, generator=gen)
    q8, q4 = quant.quantize_int8(w), quant.quantize_int4(w, 32)
    int8, int4 = quant.Int8Linear(*q8), quant.Int4Linear(*q4, 32)
    int8.native = K2()  # as the engine sets it
    int4.use_native(K2())
    for layer, weight in ((int8, quant.dequantize_int8(*q8)), (int4, quant.dequantize_int4(*q4, 32))):
        want = x.double() @ weight.double().T
        got = layer(x)
        assert got.dtype == torch.float32 and (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.parametrize("name", ["avx512", FP32])
def test_decode_attention_reads_a_shared_prompt_from_the_first_rows_cache(name: str) -> None:
    """attend_decode (the bf16 family's, and the fp32 families' on separate q/k/v) with DecodeTable `shares`: rows
    whose caches hold the same prompt read it from the first such row's cache. A row whose own copy is spoiled gets
    the bits of a clean copy; without `shares` the spoiled copy shows; a row of another key reads its own."""
    kernels = family(name)
    dtype = kernels.dtype
    heads, kv, hd, prompt = 4, 2, 32, 37
    lengths = [prompt + 1, prompt + 3, prompt + 6, 50]
    caches = _caches(lengths, kv, hd, dtype=dtype)
    for c in caches[1:3]:  # rows 1 and 2 hold row 0's prompt
        for layer in range(c.n_layers):
            c.k[layer][:, :, :prompt] = caches[0].k[layer][:, :, :prompt]
            c.v[layer][:, :, :prompt] = caches[0].v[layer][:, :, :prompt]
    q, k, v = _inputs(len(lengths), heads, kv, hd, dtype=dtype)
    shares = [("a", prompt)] * 3 + [("b", 40)]

    def attend(cs: list[KVCache], share: bool) -> torch.Tensor:
        out = torch.empty_like(q)
        native.DecodeTable(kernels, [c.clone() for c in cs], [n - 1 for n in lengths],
                           shares if share else None).attend(q, k, v, 1, out)
        return out

    clean = attend(caches, share=False)
    spoiled = [c.clone() for c in caches]
    with torch.inference_mode():  # clones are inference tensors
        for c in (spoiled[2], spoiled[3]):
            c.k[1][:, :, :prompt] = 5.0
    assert torch.equal(attend(caches, share=True), clean)
    shared = attend(spoiled, share=True)
    assert torch.equal(shared[:3], clean[:3]) and not torch.equal(shared[3], clean[3])  # row 3 leads key "b" itself
    unshared = attend(spoiled, share=False)
    assert not torch.equal(unshared[2], clean[2]) and torch.equal(unshared[:2], clean[:2])


@pytest.mark.parametrize("kv_dtype", ["float16", "float32"])
def test_fp32_prefill_chunks_attend_in_the_decode_kernel_close_to_eager(tiny_bundle, monkeypatch, kv_dtype) -> None:
    """Under the fp32 kernels a prefill chunk's tokens attend as decode rows of the chunk's cache, long chunks (their
    own forward) and short ones (sharing a pass with another sequence's decode row) alike: torch's chunk attention
    never runs. Logits and the keys/values left in the cache stay within fp32 (fp16) rounding of eager torch's."""
    from m31r.engine import Chunk, Decode
    from m31r.model import Attention

    if FP32 == "neon":
        pytest.skip("NEON keeps torch's chunk attention (Transformer._attends_native: measured on x86 only)")
    engine = _engine(tiny_bundle, FP32, dtype="float32", kv_dtype=kv_dtype)
    ids = engine.tokenizer.encode("pub fn gcd(mut a: u64, mut b: u64) -> u64 {\n    while b != 0 {\n" * 6)
    assert engine.layout(len(ids))[0] == 256 and len(ids) > 288  # a long chunk, then short ones
    engine.use_kernels(None)
    eager = engine.new_cache()
    ref = [x for x in engine.prefill(eager, ids, 0)][-1]
    engine.use_kernels(K2())

    def refused(*args, **kwargs):
        raise AssertionError("torch's chunk attention ran")

    monkeypatch.setattr(Attention, "_attend_chunk", staticmethod(refused))
    cache = engine.new_cache()
    got = [x for x in engine.prefill(cache, ids, 0)][-1]
    scale = ref.abs().max()
    tol = 2e-3 if kv_dtype == "float16" else 1e-4
    assert 0 < (got - ref).abs().max() <= tol * scale
    n = len(ids)
    for mine, theirs in ((cache.k, eager.k), (cache.v, eager.v)):
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a[:, :, :n].float(), b[:, :, :n].float(), atol=2e-3, rtol=2e-3)
    other = engine.new_cache()
    for _ in engine.prefill(other, ids[:40], 0):
        pass
    short = engine.new_cache()
    decoded, (last,) = engine.run([Decode(other, 7)], [Chunk(short, ids[:20], 0, True)])
    alone = engine.new_cache()
    assert torch.equal(last, engine.run([], [Chunk(alone, ids[:20], 0, True)])[1][0])
    monkeypatch.undo()
    engine.use_kernels(None)
    eager_short = engine.new_cache()
    torch.testing.assert_close(last, engine.run([], [Chunk(eager_short, ids[:20], 0, True)])[1][0],
                               atol=tol * scale, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv,hd", [(8, 8, 64), (4, 2, 48), (2, 1, 128), (2, 2, 16)])
def test_avx2_chunk_rows_on_one_cache_get_each_rows_bits_alone(dtype, heads: int, kv: int, hd: int) -> None:
    """A prefill chunk's tokens are rows of one cache at consecutive positions: the kernel runs two at a time, each
    key and value loaded once for both (attend_pair), and every row gets the bits it gets alone, in any row order and
    with an odd row out; beside a row of another cache, and behind a shared prompt, rows run one by one as before."""
    gen = torch.Generator().manual_seed(hd)
    start, t = 61, 7
    positions = list(range(start, start + t))
    qkv = torch.randn(t, (heads + 2 * kv) * hd, generator=gen)
    cos, sin = torch.randn(t, hd, generator=gen), torch.randn(t, hd, generator=gen)
    (cache,) = _caches([start + t], kv, hd, dtype=dtype, seed=5)
    out = torch.empty(t, heads * hd)
    native.DecodeTable(K2(), [cache] * t, positions).attend_qkv(qkv, cos, sin, 1, out)
    for r in range(t):
        alone = torch.empty(1, heads * hd)
        native.DecodeTable(K2(), [cache], [positions[r]]).attend_qkv(qkv[r : r + 1], cos[r : r + 1], sin[r : r + 1],
                                                                     1, alone)
        assert torch.equal(alone[0], out[r]), r
    back = torch.empty(t, heads * hd)  # the longer row first in every pair
    order = list(reversed(range(t)))
    native.DecodeTable(K2(), [cache] * t, [positions[r] for r in order]).attend_qkv(
        qkv[order].contiguous(), cos[order].contiguous(), sin[order].contiguous(), 1, back)
    assert torch.equal(back, out[order])
    (other,) = _caches([start + t], kv, hd, dtype=dtype, seed=6)
    mixed = torch.empty(2, heads * hd)
    native.DecodeTable(K2(), [cache, other], [positions[2], positions[3]]).attend_qkv(
        qkv[2:4].contiguous(), cos[2:4].contiguous(), sin[2:4].contiguous(), 1, mixed)
    assert torch.equal(mixed[0], out[2]) and not torch.equal(mixed[1], out[3])
    key = object()
    native.DecodeTable(K2(), [cache, cache], [positions[2], positions[3]], [(key, 30), (key, 30)]).attend_qkv(
        qkv[2:4].contiguous(), cos[2:4].contiguous(), sin[2:4].contiguous(), 1, mixed)
    assert torch.equal(mixed, out[2:4])


def test_int8_prefill_chunks_take_bf16_gemms_only_where_bf16_is_native(tiny_bundle, monkeypatch) -> None:
    """An int8 engine on fp32 activations runs chunks of INT8_GEMM_ROWS rows and more as a bf16 GEMM (bf16 inputs, a
    bf16 product, then the scales) where bf16 matmuls are native, says so, and keeps fp32 GEMMs elsewhere or when
    asked (prefill_gemm="float32"); decode rows never take it."""
    import m31r.engine as engine_mod
    from m31r.engine import Engine
    from m31r.quant import INT8_GEMM_ROWS, Int8Linear

    x = torch.randn(INT8_GEMM_ROWS + 9, 64, generator=torch.Generator().manual_seed(3))
    for native_bf16, ask, expect in ((True, "auto", True), (False, "auto", False), (True, "float32", False)):
        monkeypatch.setattr(engine_mod, "fast_bf16", lambda device, v=native_bf16: v)
        engine = _engine(tiny_bundle, FP32, dtype="float32", quant="int8", prefill_gemm=ask)
        assert engine.kernel_report["prefill_gemm"] == ("bfloat16" if expect else "float32")
        layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear) and m.native is not None]
        assert layers and all(m.gemm_bf16 == expect for m in layers)
        layer = next(m for m in layers if m.in_features == 64)
        y = layer(x)
        bf16 = torch.nn.functional.linear(x.bfloat16(), layer.codes.bfloat16()).float() * layer.scales.float()
        exact = x @ (layer.codes.float() * layer.scales.float()[:, None]).T
        if expect:
            assert torch.equal(y, bf16) and not torch.equal(y, exact)
        tol = 2e-2 if expect else 1e-5  # a bf16 product against fp32 rounding
        torch.testing.assert_close(y, exact, atol=tol * exact.abs().max().item(), rtol=0)
        assert torch.equal(layer(x[:5]), layer.native.int8_mm(x[:5].contiguous(), layer.codes, layer.scales))
    monkeypatch.setattr(engine_mod, "fast_bf16", lambda device: True)
    monkeypatch.setenv("M31R_KERNELS", FP32)  # a forced family serves as its CPUs would: they emulate bf16
    assert _engine(tiny_bundle, FP32, dtype="float32", quant="int8").kernel_report["prefill_gemm"] == "float32"
    with pytest.raises(ValueError, match="prefill_gemm"):
        Engine(tiny_bundle, dtype="float32", prefill_gemm="bfloat16")

"""The native kernels (m31r/kernels.c through m31r.native). Decode attention: its arithmetic against an fp32
reference, the bits a row gets alone and batched, the cache writes it makes. The int8 matmul: against the exact
product, rows alone and batched. Then the build cache, and engines running both.

CI machines have AVX-512 and a C compiler (.ci/run installs one where missing), so these tests expect the kernels
to load; on a CPU without AVX-512 the module is not collected (the engine runs eager attention there)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from m31r import native
from m31r.model import KVCache, span_of

if torch.backends.cpu.get_cpu_capability() not in ("AVX512", "AVX512_BF16", "AMX"):
    pytest.skip("the native kernels need AVX-512", allow_module_level=True)

KERNELS = native.load()
assert KERNELS is not None, f"native kernels did not load: {native.unavailable()}"


class Cfg:  # what KVCache reads from a model config
    def __init__(self, n_layers: int, kv_heads: int, head_dim: int):
        self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim


def _caches(lengths: list[int], kv: int, hd: int, layers: int = 2, seed: int = 0, ahead: int = 0) -> list[KVCache]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        c = KVCache(Cfg(layers, kv, hd), span_of(n) + ahead, torch.bfloat16, "cpu")
        for t in (*c.k, *c.v):
            t.copy_(torch.randn(t.shape, generator=gen))
        out.append(c)
    return out


def _inputs(rows: int, heads: int, kv: int, hd: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(rows, h, hd, generator=gen) * 2).to(torch.bfloat16) for h in (heads, kv, kv))


def _attend(caches: list[KVCache], lengths: list[int], q, k, v, layer: int = 1) -> torch.Tensor:
    out = torch.empty_like(q)
    native.DecodeTable(KERNELS, caches, [n - 1 for n in lengths]).attend(q, k, v, layer, out)
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


def test_the_build_is_cached_and_a_broken_compiler_is_reported(tmp_path) -> None:
    first = native.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    env = {**os.environ, "CC": "false", "XDG_CACHE_HOME": str(tmp_path / "empty")}
    code = "from m31r import native; print(native.load()); native.build()"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "None" and "false failed on kernels.c" in done.stderr
    off = subprocess.run([sys.executable, "-c", "from m31r import native; print(native.unavailable())"],
                         env={**os.environ, "M31R_NATIVE": "0"}, capture_output=True, text=True, check=True)
    assert off.stdout.strip() == "disabled by M31R_NATIVE=0"


def test_the_engine_decodes_with_it_close_to_the_eager_path(tiny_bundle) -> None:
    """bf16 engines run the kernel on every decode row; its logits stay within bf16 noise of eager attention's, and
    greedy generation is deterministic with it."""
    from m31r.engine import Engine

    engine = Engine(tiny_bundle, dtype="bfloat16")
    assert engine.model.native is KERNELS
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "eager"):
        engine.model.native = KERNELS if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert not torch.equal(logits["native"], logits["eager"])  # the eager path really ran
    scale = logits["eager"].abs().max()
    assert (logits["native"] - logits["eager"]).abs().max() <= 0.05 * scale
    engine.model.native = KERNELS
    runs = [[t.id for t in engine.generate(ids, max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


# -- the int8 matmul ------------------------------------------------------------------------------------------


def _int8_operands(m: int, n: int, k: int, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    codes = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scales = (torch.rand(n, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    return x, codes, scales


needs_bf16 = pytest.mark.skipif(not KERNELS.int8, reason="the int8 kernel needs AVX512-BF16")


@needs_bf16
@pytest.mark.parametrize(("n", "k"), [(8, 32), (24, 96), (64, 2048), (200, 1024)])
def test_int8_matmul_is_the_exact_product_rounded_once(n: int, k: int) -> None:
    """Products of bf16 activations and int8 codes are exact and summed in fp32: the result is the float64 product
    to within fp32 summation error and the one bf16 rounding of the output."""
    x, codes, scales = _int8_operands(19, n, k)
    y = KERNELS.int8_mm(x, codes, scales)
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
    full = KERNELS.int8_mm(x, codes, scales)
    for m in (1, 2, 3, 4, 5, 7, 8, 9, 17, 48):
        part = x[-m:].contiguous()
        assert torch.equal(KERNELS.int8_mm(part, codes, scales), full[-m:]), m
    order = torch.randperm(63, generator=torch.Generator().manual_seed(0))
    assert torch.equal(KERNELS.int8_mm(x[order].contiguous(), codes, scales), full[order])


@needs_bf16
def test_int8_matmul_refuses_shapes_it_does_not_take() -> None:
    assert not native.takes_int8(12, 64) and not native.takes_int8(16, 48) and native.takes_int8(16, 64)
    x, codes, scales = _int8_operands(2, 16, 48)
    with pytest.raises(ValueError, match="does not take"):
        KERNELS.int8_mm(x, codes, scales)


@needs_bf16
def test_an_int8_layer_takes_it_below_the_gemm_rows() -> None:
    from m31r.quant import INT8_GEMM_ROWS, Int8Linear

    x, codes, scales = _int8_operands(INT8_GEMM_ROWS, 512, 2048, seed=4)
    layer = Int8Linear(codes, scales)
    aten = layer(x[:48])
    layer.native = KERNELS
    assert torch.equal(layer(x[:48]), KERNELS.int8_mm(x[:48].contiguous(), codes, scales))
    # The two summations differ in fp32 rounding, which the bf16 output hides for most elements, not all.
    assert not torch.equal(layer(x[:48]), aten)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, codes.to(torch.bfloat16)).mul_(scales))  # GEMM rows


@needs_bf16
def test_an_int8_engine_runs_it_on_every_decode_row(tiny_bundle) -> None:
    """Every int8 layer of a bf16 engine takes the kernel; logits stay close to torch's int8 kernel, every decode
    width gives a row its bits (the probe), and greedy generation is deterministic."""
    from m31r.engine import Engine
    from m31r.quant import Int8Linear

    engine = Engine(tiny_bundle, dtype="bfloat16", quant="int8")
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert len(layers) == 4 * engine.config.n_layers + 1 and all(m.native is KERNELS for m in layers)
    assert engine.decode_widths == list(range(1, engine.decode_width + 1))
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "aten"):
        for m in layers:
            m.native = KERNELS if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert (logits["native"] - logits["aten"]).abs().max() <= 0.05 * logits["aten"].abs().max()
    for m in layers:
        m.native = KERNELS
    runs = [[t.id for t in engine.generate(ids, max_tokens=12)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


@needs_bf16
def test_an_imported_shape_runs_both_kernels(tiny_config, tmp_path) -> None:
    """An imported checkpoint's shape (q/k/v biases added after the native int8 product, an untied int8 head, GQA, a
    tokenizer smaller than the embedding): decode attention and every int8 layer, the head included, take the
    kernels; logits stay close to torch's kernels, and greedy generation is deterministic and never emits padding."""
    import msgspec

    from m31r.bundle import write_bundle
    from m31r.engine import Engine
    from m31r.model import Transformer, init_weights
    from m31r.quant import Int8Linear
    from m31r.tokenizer import build_byte_tokenizer

    config = msgspec.structs.replace(tiny_config, n_kv_heads=2, qkv_bias=True, tie_embeddings=False)
    model = Transformer(config)
    init_weights(model, 5)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.bias.normal_(0, 0.5)
    bundle = write_bundle(tmp_path / "b", config, model.state_dict(), build_byte_tokenizer(300), seed=5,
                          dataset_version="test", dtype=torch.float32)
    engine = Engine(bundle, dtype="bfloat16", quant="int8")
    layers = [m for m in engine.model.modules() if isinstance(m, Int8Linear)]
    assert engine.model.output in layers and engine.model.head is None
    assert len(layers) == 4 * config.n_layers + 1 and all(m.native is KERNELS for m in layers)
    assert engine.model.native is KERNELS
    ids = engine.tokenizer.encode("fn add(a: u32, b: u32) -> u32 {\n    a + b\n}\n")
    logits = {}
    for mode in ("native", "torch"):
        for m in [*layers, engine.model]:
            m.native = KERNELS if mode == "native" else None
        cache = engine.new_cache()
        for _ in engine.prefill(cache, ids, 0):
            pass
        logits[mode] = torch.stack([engine.decode_step(cache, t) for t in (11, 12, 13)])
    assert (logits["native"] - logits["torch"]).abs().max() <= 0.05 * logits["torch"].abs().max()
    for m in [*layers, engine.model]:
        m.native = KERNELS
    runs = [[t.id for t in engine.generate(ids, max_tokens=12) if t.id is not None] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0 and max(runs[0]) < 300

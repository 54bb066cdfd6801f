"""Quantized weights and the fast inference paths: kernels match their references, quantized bundles round-trip,
and determinism holds within each precision (a cache hit gives the bits of a cold run)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from devices import DEVICES

from m31r import quant
from m31r.bundle import CHECKSUM_FILE, CONTENT_FILES, Bundle, BundleError, open_bundle, quantize_bundle, sha256_file
from m31r.cli import main
from m31r.engine import Engine, chunk_layout
from m31r.model import STACK_SPAN, row_groups
from m31rd.scheduler import run_together

GEN = torch.Generator().manual_seed(0)


def _w(n: int, k: int) -> torch.Tensor:
    return torch.randn(n, k, generator=GEN) * 0.05


def _x(m: int, k: int) -> torch.Tensor:
    return torch.randn(m, k, generator=GEN)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(5, 384, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _last(gen) -> torch.Tensor:
    return [x for x in gen if x is not None][-1]


# -- quantizers and modules ---------------------------------------------------------------------------------


def test_int8_quantizer_error_is_bounded() -> None:
    w = _w(96, 64)
    codes, scales = quant.quantize_int8(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.bfloat16 and scales.shape == (96,)
    err = (quant.dequantize_int8(codes, scales) - w).abs()
    assert (err <= scales.float()[:, None] * 0.5 + 1e-6).all()  # half a step per row, at most


@pytest.mark.parametrize("group", [32, 64])
def test_int4_quantizer_error_and_layout(group: int) -> None:
    w = _w(64, 128)
    codes, sz = quant.quantize_int4(w, group)
    assert codes.shape == (64, 64) and codes.dtype == torch.uint8 and sz.shape == (128 // group, 64, 2)
    q = quant.unpack_int4(codes)
    assert q.shape == (64, 128) and int(q.max()) <= 15
    assert torch.equal(codes, q[:, 0::2] | (q[:, 1::2] << 4))  # even column in the low nibble
    step = sz[..., 0].float().t().repeat_interleave(group, dim=1)  # [N, K]
    err = (quant.dequantize_int4(codes, sz, group) - w).abs()
    assert (err <= step * 0.5 + 1e-3 * step + 1e-6).all()
    with pytest.raises(ValueError, match="group size"):
        quant.quantize_int4(_w(16, 96), 64)


@pytest.mark.parametrize("m", [1, 3, 17, 64, 200])  # kernel path below INT8_GEMM_ROWS, GEMM path from it
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_int8_linear_matches_dequantized_reference(m: int, act: torch.dtype) -> None:
    w = _w(192, 128)
    codes, scales = quant.quantize_int8(w)
    layer = quant.Int8Linear(codes, scales)
    x = _x(m, 128).to(act)
    ref = F.linear(x.to(torch.bfloat16).float(), quant.dequantize_int8(codes, scales))
    y = layer(x.view(1, m, 128))
    assert y.dtype == act and y.shape == (1, m, 192)
    torch.testing.assert_close(y[0].float(), ref, atol=0.05, rtol=0.02)  # bf16 activations and outputs


@pytest.mark.parametrize("m", [1, 5, 64, 130])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_linear_matches_dequantized_reference(m: int, group: int) -> None:
    w = _w(128, 256)
    codes, sz = quant.quantize_int4(w, group)
    layer = quant.Int4Linear(codes, sz, group)
    x = _x(m, 256)
    ref = F.linear(x.to(torch.bfloat16).float(), quant.dequantize_int4(codes, sz, group))
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (m, 128)
    torch.testing.assert_close(y, ref, atol=0.05, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_linear_matches_f_linear(dtype: torch.dtype) -> None:
    w, x = _w(192, 64).to(dtype), _x(33, 64).to(dtype)
    y = quant.FloatLinear(w)(x)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y.float(), F.linear(x, w).float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("m", [1, 3, 64, 130])  # weight-only kernels below the GEMM rows, the GEMM from them
def test_a_bias_is_added_after_every_kernel(m: int) -> None:
    """Qwen2's q/k/v biases: the float, int8 and int4 layers add them to their product on every path."""
    w, bias = _w(128, 256), torch.randn(128, generator=GEN)
    x = _x(m, 256)
    q8, q4 = quant.quantize_int8(w), quant.quantize_int4(w, 32)
    cases = [(quant.FloatLinear(w, bias), w, 1e-5),
             (quant.Int8Linear(*q8, bias), quant.dequantize_int8(*q8), 0.05),
             (quant.Int4Linear(*q4, 32, bias), quant.dequantize_int4(*q4, 32), 0.05)]
    for layer, weight, tol in cases:
        xs = x if tol < 1e-3 else x.to(torch.bfloat16).float()  # the quantized kernels take bf16 activations
        torch.testing.assert_close(layer(x), F.linear(xs, weight, bias), atol=tol, rtol=tol)


def test_int8_embedding_dequantizes_rows() -> None:
    codes, scales = quant.quantize_int8(_w(384, 64))
    emb = quant.Int8Embedding(codes, scales, torch.float32)
    tokens = torch.tensor([[5, 7, 383]])
    torch.testing.assert_close(emb(tokens)[0], quant.dequantize_int8(codes, scales)[[5, 7, 383]])


@pytest.mark.parametrize("n", [1, 37, 64, 65, 100])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_attention_matches_sdpa_and_ignores_the_padding(n: int, kv_heads: int) -> None:
    """A decode row attends over span_of(n) positions (attend_rows with span_mask); whatever finite values lie past
    n (stale entries of an earlier sequence) change nothing: the result is SDPA over the first n, bit for bit the
    same as with zeros there."""
    from m31r.model import attend_rows, span_mask, span_of

    span = span_of(n)
    k, v = (torch.randn(1, kv_heads, span, 16, generator=GEN) for _ in range(2))
    k[:, :, n:] *= 1e4  # stale entries: large, finite
    v[:, :, n:] *= 1e4
    q = torch.randn(1, 4, 1, 16, generator=GEN)
    expected = F.scaled_dot_product_attention(q, k[:, :, :n], v[:, :, :n], enable_gqa=kv_heads != 4)

    def attend(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        qg = (q * 16**-0.5).view(1, kv_heads, 4 // kv_heads, 16)  # query heads grouped by their k/v head, scaled
        return attend_rows(qg, [k], [v], span_mask([n], span, q.device)).view(1, 4, 1, 16)

    got = attend(k, v)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    zeroed_k, zeroed_v = k.clone(), v.clone()
    zeroed_k[:, :, n:], zeroed_v[:, :, n:] = 0, 0
    assert torch.equal(attend(zeroed_k, zeroed_v), got)


def test_kv_cache_capacity_follows_the_context(tiny_engine, monkeypatch) -> None:
    """Prefill reserves whole SPAN blocks; decoding keeps the capacity at exactly span_of(context) (dense per-layer
    blocks), shrinking a reused cache that held a longer sequence; the kept positions survive every resize. That is
    eager attention's rule: native decode attention (where the fp32 engine runs AVX2 kernels) grows a cache ahead."""
    from m31r.model import SPAN, span_of

    monkeypatch.setattr(tiny_engine.model, "native", None)

    cache = tiny_engine.new_cache()
    assert cache.capacity == 0 and cache.nbytes == 0
    ids = [(7 * i + 3) % 200 + 10 for i in range(150)]
    _last(tiny_engine.prefill(cache, ids, 0))
    assert cache.capacity == span_of(150) == 3 * SPAN
    def keys(n: int) -> torch.Tensor:
        return torch.stack([k[:, :, :n] for k in cache.k])

    kept = keys(150).clone()
    tiny_engine.decode_step(cache, 11)
    assert cache.capacity == span_of(151)
    for t in range(42):  # writes position 192: grows by one block
        tiny_engine.decode_step(cache, 12 + t)
    assert len(cache.tokens) == 193 and cache.capacity == 4 * SPAN
    assert torch.equal(keys(150), kept)
    # Reuse for a shorter sequence: the first decode step shrinks the buffer to that sequence's span.
    start = tiny_engine.reusable(cache, ids[:70])
    _last(tiny_engine.prefill(cache, ids[:70], start))
    assert cache.capacity == 4 * SPAN  # prefill only grows
    tiny_engine.decode_step(cache, 5)
    assert cache.capacity == span_of(71) and torch.equal(keys(64), kept[..., :64, :])


def test_a_growing_cache_copies_only_the_positions_it_keeps(tiny_engine) -> None:
    """A prompt that outgrows a reused cache copies only the positions it reuses into the larger buffers (none for a
    cold one: it rewrites them all), and its prefill gets the bits of a fresh cache."""
    from m31r.model import span_of

    cache = tiny_engine.new_cache(60)
    for t in (*cache.k, *cache.v):
        t.fill_(1.0)
    cache.reserve(200, keep=10)
    assert cache.capacity == span_of(200)
    assert all(bool((t[:, :, :10] == 1).all()) and not t[:, :, 10:].any() for t in (*cache.k, *cache.v))
    cache.reserve(400)  # by default every position is kept
    assert all(bool((t[:, :, :10] == 1).all()) and not t[:, :, 10:].any() for t in (*cache.k, *cache.v))
    ids = [(5 * i + 1) % 200 + 10 for i in range(300)]
    small = tiny_engine.new_cache()
    _last(tiny_engine.prefill(small, ids[:40], 0))
    fresh = tiny_engine.new_cache()
    assert torch.equal(_last(tiny_engine.prefill(small, ids, 0)), _last(tiny_engine.prefill(fresh, ids, 0)))


@pytest.mark.parametrize("start", [0, 24, 64])
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_chunk_attention_matches_causal_sdpa(start: int, kv_heads: int) -> None:
    """attend_chunk (the bf16 prefill path) is causal attention of a chunk at `start` over the cache before it."""
    from m31r.model import attend_chunk

    t, end = 16, start + 16
    q = torch.randn(1, 8, t, 32, generator=GEN)
    k, v = (torch.randn(1, kv_heads, end, 32, generator=GEN) for _ in range(2))
    mask = torch.ones(t, end, dtype=torch.bool).tril(diagonal=start)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv_heads != 8)
    torch.testing.assert_close(attend_chunk(q, k, v, start), expected, atol=1e-5, rtol=1e-5)  # exact maths in fp32
    got = attend_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), start).float()
    torch.testing.assert_close(got, expected, atol=3e-2, rtol=3e-2)  # bf16 scores: close, not equal


# -- the chunk layout ---------------------------------------------------------------------------------------


def test_chunk_layout_rule() -> None:
    assert chunk_layout(1536, 32, 256) == [256 * i for i in range(1, 7)]
    assert chunk_layout(1500, 32, 256) == [256, 512, 768, 1024, 1280, 1408, 1472, 1500]
    assert chunk_layout(20, 32, 256) == [20]
    for n in range(1, 700, 7):
        ends = chunk_layout(n, 32, 256)
        starts = [0, *ends[:-1]]
        assert ends[-1] == n and all(b > a for a, b in zip(starts, ends, strict=True))
        for a, b in zip(starts, ends, strict=True):
            size = b - a
            assert size < 32 and b == n or (size in (32, 64, 128, 256) and a % size == 0)


# -- engines on the tiny bundle, per precision ---------------------------------------------------------------


@pytest.fixture(scope="module", params=["int8", "int4"])
def qbundle(request: pytest.FixtureRequest, tiny_bundle: Bundle, tmp_path_factory: pytest.TempPathFactory) -> Bundle:
    return quantize_bundle(tiny_bundle.path, tmp_path_factory.mktemp(request.param) / "b", request.param, 32)


def test_quantized_bundle_round_trip(qbundle: Bundle, tiny_bundle: Bundle) -> None:
    method = qbundle.quantization["method"]
    assert open_bundle(qbundle.path).quantization == qbundle.quantization
    assert qbundle.metadata["quantized_from"] == tiny_bundle.fingerprint
    size = (qbundle.path / "model.safetensors").stat().st_size
    assert size < (tiny_bundle.path / "model.safetensors").stat().st_size / (3 if method == "int8" else 5)
    # Loading the stored codes computes exactly what quantizing the float bundle at load computes.
    stored = Engine(qbundle.path, dtype="float32")
    at_load = Engine(tiny_bundle.path, dtype="float32", quant=method, group_size=32)
    assert stored.quant == at_load.quant == method
    ids = _ids(50, seed=1)
    a, b = _last(stored.prefill(stored.new_cache(), ids, 0)), _last(at_load.prefill(at_load.new_cache(), ids, 0))
    assert torch.equal(a, b)
    # ... and stays close to the float model.
    ref = Engine(tiny_bundle.path, dtype="float32")
    f = _last(ref.prefill(ref.new_cache(), ids, 0))
    assert (a - f).abs().max().item() < 0.1 * f.abs().max().item()


def test_quantized_bundle_cannot_be_served_as_another_method(qbundle: Bundle) -> None:
    other = "int4" if qbundle.quantization["method"] == "int8" else "int8"
    with pytest.raises(ValueError, match=f"cannot be served as {other}"):
        Engine(qbundle.path, quant=other)
    with pytest.raises(BundleError, match="already quantized"):
        quantize_bundle(qbundle.path, qbundle.path.parent / "again", "int8")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_is_deterministic_and_cache_hits_are_exact(qbundle: Bundle, dtype: str) -> None:
    """Within a precision: the same prompt gives the same tokens, and a warm cache gives the bits of a cold one."""
    engine = Engine(qbundle.path, dtype=dtype, chunk_size=8, max_chunk=64)
    ids = _ids(150, seed=2)

    def greedy(prompt: list[int], cache=None) -> list[int]:
        return [t.id for t in engine.generate(prompt, max_tokens=12, cache=cache) if t is not None and t.id]

    cold = greedy(ids)
    assert greedy(ids) == cold
    cache = engine.new_cache()
    greedy(ids[:131], cache)  # an earlier, shorter prompt leaves reusable chunks behind
    assert engine.reusable(cache, ids) == 128
    assert greedy(ids, cache) == cold
    for n in (97, 150, 151, 200):  # typing at the end, across chunk boundaries of several sizes
        more = ids + _ids(60, seed=3)
        warm_cache = cache
        start = engine.reusable(warm_cache, more[:n])
        warm = _last(engine.prefill(warm_cache, more[:n], start))
        fresh = _last(engine.prefill(engine.new_cache(), more[:n], 0))
        assert torch.equal(warm, fresh), f"n={n}, reused {start}"


FLOAT_PRECISIONS = [(d, t) for d in DEVICES for t in ("float32", "bfloat16")] + [
    (d, "float16") for d in DEVICES if d == "cuda"]


@pytest.mark.parametrize(("device", "dtype", "method"), [(d, t, None) for d, t in FLOAT_PRECISIONS] + [
    ("cpu", "bfloat16", "int8"), ("cpu", "bfloat16", "int4"), ("cpu", "float32", "int8"), ("cpu", "float32", "int4")])
def test_batched_decode_gives_each_row_its_bits_alone(tiny_bundle: Bundle, device: str, dtype: str,
                                                      method: str | None) -> None:
    """Whatever widths the load-time probe allows, a stream's logits are the same bits alone and beside others:
    rows at the same short span share an attention call (contiguous or not), a long one attends alone."""
    engine = Engine(tiny_bundle.path, device=device, dtype=dtype, quant=method, group_size=32, decode_width=8)
    assert engine.decode_widths and engine.decode_widths[-1] == 8
    lengths = [20, 70, 27, STACK_SPAN + 40, 75, 131]  # spans 64, 128, 64, 320, 128, 192
    groups = [g.rows for g in row_groups(lengths, torch.device("cpu"))]
    assert groups == [[0, 2], [1, 4], [3], [5]]
    prompts = [_ids(n, seed=10 + i) for i, n in enumerate(lengths)]

    def primed() -> list:
        caches = [engine.new_cache() for _ in prompts]
        for c, ids in zip(caches, prompts, strict=True):
            _last(engine.prefill(c, ids, 0))
        return caches

    batch, alone = primed(), primed()
    for step in range(3):
        tokens = [(17 * step + 5 * i) % 256 for i in range(len(prompts))]
        together = engine.decode_rows(batch, tokens)
        for i, (c, t) in enumerate(zip(alone, tokens, strict=True)):
            assert torch.equal(engine.decode_rows([c], [t])[0], together[i]), f"row {i}, step {step}"
        for n in (2, 3):  # and in smaller groups, which may run at other widths: rerun the step's first rows
            for c in batch[:n]:
                c.tokens.pop()  # the rerun rewrites the same positions with the same values
            assert torch.equal(engine.decode_rows(batch[:n], tokens[:n]), together[:n])


@pytest.mark.parametrize(("device", "dtype"), FLOAT_PRECISIONS)
def test_float_cache_hits_are_exact_across_layouts(tiny_bundle: Bundle, device: str, dtype: str) -> None:
    """Every pair (earlier prompt, later prompt sharing a prefix): the warm logits are the cold logits, bit for bit,
    in each float precision on each device; and greedy decoding repeats itself."""
    engine = Engine(tiny_bundle.path, device=device, dtype=dtype, chunk_size=4, max_chunk=32)
    base = _ids(120, seed=4)
    cold = {n: _last(engine.prefill(engine.new_cache(), base[:n], 0)) for n in (23, 40, 64, 65, 97, 120)}
    for first in (10, 31, 33, 64, 90):
        for n in cold:
            cache = engine.new_cache()
            _last(engine.prefill(cache, base[:first], 0))
            start = engine.reusable(cache, base[:n])
            assert start <= min(first, n - 1)
            assert torch.equal(_last(engine.prefill(cache, base[:n], start)), cold[n]), (first, n, start)
    runs = [[t.id for t in engine.generate(base[:97], max_tokens=16)] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_prefill_refuses_a_start_inside_a_chunk(tiny_engine: Engine) -> None:
    cache = tiny_engine.new_cache()
    ids = _ids(100, seed=5)
    _last(tiny_engine.prefill(cache, ids, 0))
    with pytest.raises(ValueError, match="chunk boundary"):
        next(tiny_engine.prefill(cache, ids, 33))


# -- bundle validation and the CLI ----------------------------------------------------------------------------


def _rewrite_checksums(d: Path) -> None:
    (d / CHECKSUM_FILE).write_text("".join(f"{sha256_file(d / n)}  {n}\n" for n in CONTENT_FILES))


def test_quantized_bundle_validation(qbundle: Bundle, tmp_path: Path) -> None:
    d = Path(shutil.copytree(qbundle.path, tmp_path / "b"))
    meta = json.loads((d / "metadata.json").read_text())
    method = meta["quantization"]["method"]
    meta["quantization"] = {"method": "int3"}
    (d / "metadata.json").write_text(json.dumps(meta))
    _rewrite_checksums(d)
    with pytest.raises(BundleError, match=r"metadata\.json: quantization must be"):
        open_bundle(d)
    # Metadata claiming the other method: the tensors it implies are missing.
    meta["quantization"] = {"method": "int8"} if method == "int4" else {"method": "int4", "group_size": 32}
    (d / "metadata.json").write_text(json.dumps(meta))
    _rewrite_checksums(d)
    with pytest.raises(BundleError, match=r"model\.safetensors: \d+ tensors missing for config\.yaml, e\.g\. int"):
        open_bundle(d)


def test_engine_reports_a_corrupt_quantized_bundle(qbundle: Bundle, tmp_path: Path) -> None:
    """Checksums are verified beside the model build; a mismatch still aborts the load with its own message."""
    d = Path(shutil.copytree(qbundle.path, tmp_path / "b"))
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x10
    f.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"model\.safetensors: checksum mismatch"):
        Engine(d)


def test_cli_bundle_quantize(tiny_bundle: Bundle, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "q"
    result = runner.invoke(main, ["bundle", "quantize", str(tiny_bundle.path), str(out), "--quant", "int4",
                                  "--group-size", "32"])
    assert result.exit_code == 0, result.output
    assert "int4 (group 32) weights" in result.stdout and open_bundle(out).quantization == {
        "method": "int4", "group_size": 32}
    again = runner.invoke(main, ["bundle", "quantize", str(tiny_bundle.path), str(out), "--quant", "int8"])
    assert again.exit_code == 1 and "already exists" in again.stderr
    bad = runner.invoke(main, ["bundle", "quantize", str(out), str(tmp_path / "q2"), "--quant", "int8"])
    assert bad.exit_code == 1 and "already quantized" in bad.stderr and not (tmp_path / "q2").exists()
    assert "--quant [auto|int8|int4|none]" in runner.invoke(main, ["daemon", "--help"]).stdout


def test_daemon_serves_int8_quantized_at_load(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """`m31r daemon --quant int8` on a float bundle streams what an int8 Engine computes in-process."""
    import asyncio

    from daemon_util import start_daemon, stop_daemon

    from m31r_protocol.client import Client

    sock = tmp_path / "d.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--quant", "int8", "--dtype", "bfloat16")
    try:
        async def ask() -> list[int]:
            async with await Client.connect(sock) as c:
                stream = await c.generate("fn main() {", max_tokens=8)
                return [t.token async for t in stream if t.token is not None]

        got = asyncio.run(asyncio.wait_for(ask(), 60))
    finally:
        assert stop_daemon(proc) == 0
    engine = Engine(tiny_bundle.path, dtype="bfloat16", quant="int8")
    expected = [t.id for t in engine.generate("fn main() {", max_tokens=8) if t is not None and t.id is not None]
    assert got == expected and len(got) == 8


@pytest.fixture
def kernel_env(monkeypatch):
    """Set M31R_KERNELS for a test: native.load's cached choice is cleared before and after."""
    from m31r import native

    def use(value: str | None) -> None:
        monkeypatch.delenv("M31R_NATIVE", raising=False)
        if value is None:
            monkeypatch.delenv("M31R_KERNELS", raising=False)
        else:
            monkeypatch.setenv("M31R_KERNELS", value)
        native.load.cache_clear()

    yield use
    monkeypatch.undo()
    native.load.cache_clear()


def _fp32_int8() -> str | None:
    """The fp32 family (avx2, or neon on Arm) whose int8 kernel can run here (it then passes its self-check:
    test_native), or None."""
    from m31r import native

    runs = [name for name in ("avx2", "neon") if native.family_unsupported(name) is None]
    return runs[0] if runs and native.compiler() is not None else None


def test_auto_precision_rules(kernel_env) -> None:
    from m31r.engine import auto_precision, fast_bf16
    from m31r.precision import resolve

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    native_bf16, fp32 = fast_bf16(cpu), _fp32_int8()
    fp32_quant = "int8" if fp32 else None  # fp32 activations: int8 only on a q16 kernel (AVX2, NEON) that checks out
    kernel_env(None)
    # fp32 wherever the fp32 kernels run (bf16 activations fail the 98% agreement bar), bf16 only without them
    default = ("float32", fp32_quant) if fp32 or not native_bf16 else ("bfloat16", "int8")
    assert auto_precision(cpu, "auto", "auto", None) == default
    if fp32:
        assert resolve(cpu, "auto", "auto", None).why.startswith("dtype float32: the ")
    assert auto_precision(cpu, "bfloat16", "auto", None) == ("bfloat16", "int8")
    assert auto_precision(cpu, "float32", "auto", None) == ("float32", fp32_quant)
    assert auto_precision(cpu, "bfloat16", "auto", "int4") == ("bfloat16", "int4")  # a quantized bundle as stored
    assert auto_precision(cpu, "bfloat16", "none", None) == ("bfloat16", None)
    assert auto_precision(cpu, "float32", "int4", None) == ("float32", "int4")  # explicit choices stand
    assert auto_precision(cpu, "float16", "auto", None) == ("float16", None)
    assert auto_precision(cuda, "auto", "auto", None) == ("bfloat16", None)  # the int8/int4 kernels are CPU-only
    assert resolve(cpu, "float32", "int8", None).why == ""  # nothing was auto
    if fp32:
        from m31r import native

        why = resolve(cpu, "float32", "auto", None).why
        name = native.load(torch.float32).name  # avx2vnni where the CPU has AVX-VNNI (test_native_vnni), else fp32
        assert why == f"int8 weights: the {name} int8 kernel (q16 activations) passed its self-check"
    # eager: fp32 engines have no int8 kernel worth running, bf16 ones keep torch's int8 kernel
    kernel_env("eager")
    assert auto_precision(cpu, "float32", "auto", None) == ("float32", None)
    assert auto_precision(cpu, "auto", "auto", None) == (("bfloat16", "int8") if native_bf16 else ("float32", None))
    assert "disabled by M31R_KERNELS=eager" in resolve(cpu, "float32", "auto", None).why
    if not fp32:
        return
    # a forced AVX2 (NEON) family serves as an AVX2 machine would, whatever else the CPU has
    kernel_env(fp32)
    p = resolve(cpu, "auto", "auto", None)
    assert (p.dtype, p.quant) == ("float32", "int8")
    assert p.why.startswith(f"dtype float32: the {fp32} kernels M31R_KERNELS forces take it; int8 weights: ")
    assert auto_precision(cpu, "bfloat16", "auto", None) == ("bfloat16", "int8")
    assert auto_precision(cpu, "auto", "auto", "int4") == ("float32", "int4")
    # and where the kernel fails its check (here: switched to q8 activations), float weights
    from m31r import native

    kernels = native.load(torch.float32)
    kernels.int8_mode = "q8"
    try:
        p = resolve(cpu, "auto", "auto", None)
    finally:
        kernels.int8_mode = "q16"
    assert (p.dtype, p.quant) == ("float32", None) and "failed its check (int8 self-check failed: error" in p.why


def test_a_forced_avx2_engine_resolves_auto_to_int8_on_q16_and_says_why(tiny_bundle: Bundle, kernel_env) -> None:
    fp32 = _fp32_int8()
    if not fp32:
        pytest.skip("neither the AVX2 nor the NEON kernels can run here")
    kernel_env(fp32)
    engine = Engine(tiny_bundle.path, dtype="auto", quant="auto")
    assert engine.dtype == torch.float32 and engine.quant == "int8"
    report = engine.kernel_report
    assert report["kernels"] == fp32 and report["native_int8"] and report["native_attention"]
    assert report["int8_kernel"].startswith(f"{fp32} q16") and report["int8_check"].startswith("int8 self-check passed")
    assert "M31R_KERNELS forces" in report["precision_why"] and "passed its self-check" in report["precision_why"]
    assert [t.id for t in engine.generate("fn main() {", max_tokens=4)]


def test_engine_auto_precision_serves(tiny_bundle: Bundle) -> None:
    from m31r.engine import auto_precision

    engine = Engine(tiny_bundle.path, dtype="auto", quant="auto")
    dtype, quant = auto_precision(torch.device("cpu"), "auto", "auto", None)
    assert str(engine.dtype) == f"torch.{dtype}" and engine.quant == quant
    assert [t.id for t in engine.generate("fn main() {", max_tokens=4)]


@pytest.mark.parametrize(("dtype", "method"), [("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4"),
                                               ("float32", None), ("float32", "int8"), ("float32", "int4")])
def test_chunks_beside_decode_rows_change_nothing(tiny_bundle: Bundle, dtype: str, method: str | None) -> None:
    """Streams whose prompts differ in length, so that their prefill chunks (of 8, partial ones, and one longer than
    FUSE_CHUNK) run while other streams decode, produce exactly what each produces alone, in each precision."""
    engine = Engine(tiny_bundle.path, dtype=dtype, quant=method, group_size=32, chunk_size=8, max_chunk=64)
    prompts = [_ids(n, seed=30 + n) for n in (3, 11, 17, 70, 9, 24)]  # 70 tokens: a 64-token chunk, run alone
    alone = [[t.id for t in engine.generate(p, max_tokens=10)] for p in prompts]
    together, sched = run_together(engine, prompts, 10)
    shared = sched.mixed_rounds
    assert together == alone
    assert engine.fuse and shared > 0

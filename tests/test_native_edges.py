"""Edge shapes around the native kernels that once crashed the process or wrote past a buffer: int8 layers whose K
torch's int8 kernel reads past, contexts longer than the kernels' MAX_KEYS, attention operands whose heads do not
match their caches (kv_heads 0 included), long contexts on threads with small stacks (and out of memory for their
scores), SwiGLU of an odd width, and activation blocks too small to quantize.

A call that crashed runs in a fresh interpreter (`_run`): a regression then fails its test instead of killing
pytest, and memory written past a buffer cannot corrupt the tests after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest
import torch

from m31r import native, quant

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, *args: object, env: dict[str, str] | None = None) -> dict:
    """Run `code` in a fresh interpreter with `args` as sys.argv[1:]; the JSON object it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], capture_output=True,
                          text=True, timeout=280, cwd=ROOT, env={**os.environ, **(env or {})}, check=False)
    assert done.returncode == 0, f"exited {done.returncode}: {done.stderr[-3000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def _families() -> list[str]:
    """The families this machine builds and runs (the ones whose C code the tests can call)."""
    if native.compiler() is None:
        return []
    return [name for name in native.FAMILIES if native.family_unsupported(name) is None]


def _family(name: str) -> str:
    if name not in _families():
        pytest.skip(f"the {name} kernels do not run here: {native.family_unsupported(name) or 'no C compiler'}")
    return name


# -- int8 layers on a K that aten._weight_int8pack_mm reads past ------------------------------------------------


def test_only_k_in_steps_of_32_go_to_aten_int8_kernel() -> None:
    assert [k for k in range(8, 257, 8) if quant.int8pack_ok(k)] == list(range(32, 257, 32))


@pytest.mark.parametrize("k", [40, 56, 136, 200])
def test_an_int8_layer_of_such_a_k_computes_its_dequantized_product(k: int) -> None:
    """Without native kernels, at the row counts that ran aten's int8 kernel (its garbage reached 1e26 relative
    error, or a segfault, where K % 16 == 8) and at the GEMM's: within bf16 rounding of the product on bf16
    activations, relative to the sum of |terms|."""
    out = _run("""
        import json, sys, torch
        from m31r import quant
        k = int(sys.argv[1])
        gen = torch.Generator().manual_seed(k)
        codes, scales = quant.quantize_int8(torch.randn(72, k, generator=gen) * 0.05)
        layer = quant.Int8Linear(codes, scales)
        w = quant.dequantize_int8(codes, scales).double()
        worst = 0.0
        for m in (1, 2, 3, 17, 63, 64):
            for _ in range(3):  # what lies past the rows changes from call to call
                x = torch.randn(m, k, generator=gen)
                xb = x.to(torch.bfloat16).double()
                err = (layer(x).double() - xb @ w.T).abs() / (xb.abs() @ w.abs().T)
                worst = max(worst, err.max().item())
        print(json.dumps({"worst": worst}))
    """, k)
    assert out["worst"] <= 2**-7, out  # the product rounded to bf16, then its scaling


def test_an_int8_layer_copies_codes_torch_int8_kernel_cannot_read() -> None:
    """Codes off a 16-byte boundary (a slice of a larger buffer): aten._weight_int8pack_mm segfaults on them from 4
    rows on, so Int8Linear keeps an aligned copy (quant._aligned) and computes the product."""
    out = _run("""
        import json, torch
        from m31r import quant
        gen = torch.Generator().manual_seed(2)
        codes, scales = quant.quantize_int8(torch.randn(64, 64, generator=gen) * 0.05)
        buf = torch.empty(64 * 64 + 64, dtype=torch.int8)
        shifted = buf[4 : 4 + 64 * 64].view(64, 64)
        shifted.copy_(codes)
        layer = quant.Int8Linear(shifted, scales)
        x = torch.randn(8, 64, generator=gen).to(torch.bfloat16)
        w = quant.dequantize_int8(codes, scales).double()
        err = (layer(x).double() - x.double() @ w.T).abs() / (x.double().abs() @ w.abs().T)
        print(json.dumps({"shifted": shifted.data_ptr() % 16, "copied": layer.codes.data_ptr() % 64,
                          "worst": err.max().item()}))
    """)
    assert out["shifted"] and out["copied"] == 0 and out["worst"] <= 2**-8, out


def _dequantized_reference(float_bundle, out: Path):
    """The float bundle with every weight an int8 bundle quantizes replaced by its dequantized codes: the model the
    int8 engine computes, up to its activations' rounding."""
    from m31r.bundle import load_weights, write_bundle
    from m31r.tokenizer import build_byte_tokenizer

    sd = {}
    for name, w in load_weights(float_bundle).items():
        if name in quant.INT8_ALWAYS or name.removesuffix(".weight").endswith(quant.LINEARS):
            w = quant.dequantize_int8(*quant.quantize_int8(w))
        sd[name] = w
    config = float_bundle.config
    return write_bundle(out, config, sd, build_byte_tokenizer(config.vocab_size), seed=0, dataset_version="test",
                        dtype=torch.float32)


@pytest.mark.parametrize(("d_model", "ffn_hidden"), [(64, 200), (136, 128)])
def test_an_int8_model_of_such_a_shape_picks_its_dequantized_reference_tokens(tiny_config, tmp_path, d_model: int,
                                                                               ffn_hidden: int) -> None:
    """tiny.yaml with ffn_hidden 200 (w2's K) or d_model 136 (wqkv's, w13's and the head's K), quantized to int8:
    under M31R_KERNELS=eager and the default family, an fp32 and a bf16 engine greedily pick the tokens of the
    fp32 model on the dequantized weights, and fp32 engines' logits stay within 2% of its."""
    from m31r.bundle import init_bundle, quantize_bundle

    config = msgspec.structs.replace(tiny_config, d_model=d_model, ffn_hidden=ffn_hidden)
    base = init_bundle(config, tmp_path / "float", seed=3, dtype=torch.float32)
    int8 = quantize_bundle(base.path, tmp_path / "int8", "int8")
    ref = _dequantized_reference(base, tmp_path / "ref")
    code = """
        import json, sys, torch
        from m31r.engine import Engine
        ids = torch.randint(5, 300, (40,), generator=torch.Generator().manual_seed(1)).tolist()

        def run(path, dtype):
            engine = Engine(path, dtype=dtype)
            tokens = [t.id for t in engine.generate(ids, max_tokens=16) if t is not None and t.id]
            cache = engine.new_cache()
            logits = [x for x in engine.prefill(cache, ids, 0) if x is not None]
            logits += [engine.decode_step(cache, t) for t in (7, 8, 9)]
            return engine, tokens, torch.stack(logits).float()

        _, want, ref = run(sys.argv[2], "float32")
        out = {}
        for dtype in ("float32", "bfloat16"):
            engine, tokens, logits = run(sys.argv[1], dtype)
            out[dtype] = {"kernels": engine.kernel_report["kernels"], "tokens": tokens, "want": want,
                          "err": ((logits - ref).abs().max() / ref.abs().max()).item()}
        print(json.dumps(out))
    """
    for kernels in ("eager", "auto"):
        out = _run(code, int8.path, ref.path, env={"M31R_KERNELS": kernels, "M31R_NATIVE": "1"})
        for dtype, got in out.items():
            assert got["tokens"] == got["want"] and len(got["want"]) >= 8, (kernels, dtype, got)
            if dtype == "float32":
                assert got["err"] <= 0.02, (kernels, got)
        if kernels == "eager":
            assert out["float32"]["kernels"] == "eager"


# -- contexts past the kernels' MAX_KEYS -----------------------------------------------------------------------


def test_decode_attention_is_native_only_for_contexts_it_takes() -> None:
    assert native.takes(64, native.MAX_KEYS) and native.takes(128)
    assert not native.takes(64, native.MAX_KEYS + 1) and not native.takes(64, 131072)
    assert not native.takes(8) and not native.takes(0) and not native.takes(272)


def test_a_model_longer_than_max_keys_decodes_past_it_on_eager_attention(tiny_config, tmp_path) -> None:
    """max_context 70000 (an imported Llama config has 131072): the engine keeps torch's decode attention, and a
    decode step at position 65536, which every family refuses, runs; one of 65536 positions keeps the kernels."""
    from m31r.bundle import init_bundle
    from m31r.engine import Engine

    config = msgspec.structs.replace(tiny_config, n_layers=1, max_context=70000)
    engine = Engine(init_bundle(config, tmp_path / "long", seed=0, dtype=torch.float32), dtype="float32")
    assert engine.model.native is None and not engine.kernel_report["native_attention"]
    for pos in (native.MAX_KEYS - 1, native.MAX_KEYS):
        cache = engine.new_cache()
        cache.reserve(pos + 1)
        cache.tokens = [0] * pos  # zero keys and values before it: enough to reach the boundary
        logits = engine.decode_step(cache, 5)
        assert logits.shape == (config.vocab_size,) and torch.isfinite(logits).all()
    if native.load(torch.float32) is not None and native.load(torch.float32).dtype == torch.float32:
        short = msgspec.structs.replace(tiny_config, max_context=native.MAX_KEYS)
        fits = Engine(init_bundle(short, tmp_path / "fits", seed=0, dtype=torch.float32), dtype="float32")
        assert fits.model.native is not None and fits.kernel_report["native_attention"]


# -- attention operands against their caches -------------------------------------------------------------------

_ATTEND = """
    import json, sys, torch
    from m31r import native
    from m31r.model import KVCache

    class Cfg:
        def __init__(self, n_layers, kv_heads, head_dim):
            self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim

    kernels = native.Kernels(native.build(family=sys.argv[1]), sys.argv[1])
    dt = kernels.dtype

    def table(kv=1, hd=16, others=()):
        caches = [KVCache(Cfg(1, kv, hd), 64, dt, "cpu")] + [KVCache(Cfg(*o), 64, dt, "cpu") for o in others]
        return native.DecodeTable(kernels, caches, [3] * len(caches))

    def refused(fn):
        try:
            fn()
        except ValueError as e:
            return str(e)
        return None

    def decode(t, heads, kv, hd, layer=0):
        q = torch.randn(t.rows, heads, hd).to(dt)
        kn, vn = torch.randn(t.rows, kv, hd).to(dt), torch.randn(t.rows, kv, hd).to(dt)
        return lambda: kernels.attend_decode(q, kn, vn, t, layer, torch.empty_like(q))

    def qkv(t, heads, hd=16):
        x = torch.randn(t.rows, (heads + 2 * t.kv_heads) * hd)
        cos, sin = torch.randn(t.rows, hd), torch.randn(t.rows, hd)
        return lambda: kernels.attend_qkv(x, cos, sin, t, 0, torch.empty(t.rows, heads * hd))

    out = {
        "more kv heads": refused(decode(table(kv=1), 2, 2, 16)),
        "fewer kv heads": refused(decode(table(kv=2), 2, 1, 16)),
        "another head_dim": refused(decode(table(hd=16), 2, 1, 32)),
        "kv heads 0": refused(decode(table(), 2, 0, 16)),
        "a layer past the caches": refused(decode(table(), 2, 1, 16, layer=1)),
        "caches of two shapes": refused(lambda: table(kv=1, others=[(1, 2, 16)])),
        "fits": refused(decode(table(kv=2), 4, 2, 16)),
    }
    if kernels.float_dtype is not None:
        out["qkv heads not a multiple"] = refused(qkv(table(kv=2), 3))
        out["qkv fits"] = refused(qkv(table(kv=2), 4))
    print(json.dumps(out))
"""


@pytest.mark.parametrize("name", list(native.FAMILIES))
def test_attention_refuses_operands_that_do_not_fit_their_caches(name: str) -> None:
    """knew with 2 kv heads against caches of 1 (and the like) once wrote past every cache tensor (ASAN:
    heap-buffer-overflow), and kv_heads 0 divided by zero in C (SIGFPE): each is a ValueError now."""
    out = _run(_ATTEND, _family(name))
    fits = [key for key in out if key.endswith("fits")]
    assert all(out[key] is None for key in fits), out
    assert all(out[key] for key in out if key not in fits), out


_KV0 = """
    import ctypes, json, sys, torch
    from m31r import native
    kernels = native.Kernels(native.build(family=sys.argv[1]), sys.argv[1])
    dt = kernels.dtype
    rows, hd = 1, 16
    cache_k, cache_v = torch.zeros(1, 64, hd, dtype=dt), torch.zeros(1, 64, hd, dtype=dt)
    kp, vp = torch.tensor([cache_k.data_ptr()]), torch.tensor([cache_v.data_ptr()])
    cap, length = torch.tensor([64], dtype=torch.int32), torch.tensor([4], dtype=torch.int32)
    q, out = torch.randn(rows, 2, hd).to(dt), torch.empty(rows, 2, hd, dtype=dt)
    new = torch.randn(rows, 1, hd).to(dt)
    said = {}
    for heads, kv in ((2, 0), (0, 1), (2, -1)):
        said[f"attend {heads} {kv}"] = kernels._attend(rows, heads, kv, hd, q.data_ptr(), new.data_ptr(),
                                                       new.data_ptr(), kp.data_ptr(), vp.data_ptr(), cap.data_ptr(),
                                                       length.data_ptr(), 0, 0, hd**-0.5, out.data_ptr())
        if kernels.float_dtype is not None:
            flat = torch.randn(rows, 4 * hd)
            cos, sin = torch.randn(rows, hd), torch.randn(rows, hd)
            for fn in (kernels._attend_qkv, kernels._attend_qkv16):
                said[f"{fn.__name__} {heads} {kv}"] = fn(rows, heads, kv, hd, flat.data_ptr(), cos.data_ptr(),
                                                         sin.data_ptr(), kp.data_ptr(), vp.data_ptr(), cap.data_ptr(),
                                                         length.data_ptr(), 0, 0, hd**-0.5, out.data_ptr())
    print(json.dumps(said))
"""


@pytest.mark.parametrize("name", list(native.FAMILIES))
def test_the_c_attention_returns_an_error_for_no_kv_heads(name: str) -> None:
    """The C entry points themselves, past Python's checks: kv_heads 0 (or negative) and heads 0 return nonzero."""
    out = _run(_KV0, _family(name))
    assert out and all(rc == 1 for rc in out.values()), out


# -- long contexts on threads with small stacks ----------------------------------------------------------------

_SMALL_STACKS = """
    import json, sys, threading, torch
    from m31r import native
    from m31r.model import KVCache

    class Cfg:
        def __init__(self, n_layers, kv_heads, head_dim):
            self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim

    kernels = native.Kernels(native.build(family=sys.argv[1]), sys.argv[1])
    n, heads, kv, hd = native.MAX_KEYS, 2, 1, 16  # the longest context the kernels take; tiny heads, so it is fast
    gen = torch.Generator().manual_seed(11)

    def cache(dt):
        c = KVCache(Cfg(1, kv, hd), n, dt, "cpu")
        for t in (*c.k, *c.v):
            t.copy_(torch.randn(t.shape, generator=gen))
        return c

    def reference(c, length, q):  # fp32 attention of q [heads, hd] over positions [0, length) of one cache
        k, v = c.k[0][0, :, :length].float(), c.v[0][0, :, :length].float()
        p = torch.softmax((q.float()[:, None, :] * hd**-0.5 * k.repeat_interleave(heads // kv, 0)).sum(-1), -1)
        return (p[:, :, None] * v.repeat_interleave(heads // kv, 0)).sum(1)

    calls = {}  # name: (call, output, check against reference or None)
    dt = kernels.dtype
    caches = [cache(dt), cache(dt)]  # two rows, so that each thread gets heads of a row
    q, kn, vn = ((torch.randn(2, h, hd, generator=gen) * 2).to(dt) for h in (heads, kv, kv))
    out = torch.empty_like(q)
    table = native.DecodeTable(kernels, caches, [n - 1, n - 2])
    calls["attend_decode"] = (lambda: kernels.attend_decode(q, kn, vn, table, 0, out), out,
                              lambda: [reference(c, m, q[r]) for r, (c, m) in enumerate(zip(caches, [n, n - 1]))])
    if kernels.float_dtype is not None:  # the projection's path: rows on caches of their own, and a chunk's pair
        for kv_dt in kernels.kv_dtypes:
            qkv = torch.randn(2, (heads + 2 * kv) * hd, generator=gen)
            cos, sin = torch.randn(2, hd, generator=gen), torch.randn(2, hd, generator=gen)
            one = cache(kv_dt)
            for how, rows in (("rows", [cache(kv_dt), cache(kv_dt)]), ("pair", [one, one])):
                o = torch.empty(2, heads * hd)
                t = native.DecodeTable(kernels, rows, [n - 2, n - 1])
                calls[f"attend_qkv {kv_dt} {how}"] = (
                    lambda t=t, qkv=qkv, cos=cos, sin=sin, o=o: kernels.attend_qkv(qkv, cos, sin, t, 0, o), o, None)

    said = {}
    for name, (call, o, ref) in calls.items():
        torch.set_num_threads(1)
        call()  # on the main thread alone (8 MB of stack): the bits every run must give
        alone = o.clone()
        torch.set_num_threads(2)
        o.zero_()
        call()  # half the heads on an OpenMP worker, whose stack is OMP_STACKSIZE
        workers = torch.equal(o, alone)
        o.zero_()
        threading.stack_size(256 * 1024)  # a thread another runtime made, with a small stack of its own
        th = threading.Thread(target=call)
        th.start()
        th.join()
        threading.stack_size(0)
        worst = None
        if ref is not None:
            worst = max(((o[r].float() - x).abs().max() / x.abs().max()).item() for r, x in enumerate(ref()))
        said[name] = {"workers": workers, "small thread": torch.equal(o, alone), "worst": worst}
    print(json.dumps(said))
"""


@pytest.mark.parametrize("name", list(native.FAMILIES))
def test_a_long_context_runs_on_threads_with_small_stacks(name: str) -> None:
    """Decode attention at MAX_KEYS positions on 2 threads with OMP_STACKSIZE=128K (aarch64's smallest: libgomp
    ignores less there), and on a thread of 256 KB: the per-position score arrays were variable-length arrays on the
    thread's stack (256 KB, 512 KB for a chunk's pair of rows), and such a thread died of SIGSEGV. They live in
    per-thread heap scratch now (kernels_scratch.h): every path gives the main thread's bits, close to fp32
    attention."""
    out = _run(_SMALL_STACKS, _family(name), env={"OMP_STACKSIZE": "128K", "OMP_NUM_THREADS": "2",
                                                  "OMP_WAIT_POLICY": "passive"})
    assert "attend_decode" in out and (native.FAMILIES[name].dtype != torch.float32 or len(out) == 5), out
    for call, got in out.items():
        assert got["workers"] and got["small thread"], (call, got)
    assert out["attend_decode"]["worst"] <= 1e-2, out  # bf16: one rounding of the output; fp32: ~1e-6


# posix_memalign (what kernels_scratch.h grows a thread's scores with) that fails while no_memory(1) is in force.
_FAILING_MEMALIGN = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stddef.h>
static int failing;
void no_memory(int on) { failing = on; }
int posix_memalign(void** p, size_t align, size_t n) {
  static int (*real)(void**, size_t, size_t);
  if (failing) return ENOMEM;
  if (!real) real = (int (*)(void**, size_t, size_t))dlsym(RTLD_NEXT, "posix_memalign");
  return real(p, align, n);
}
"""

_NO_MEMORY = """
    import ctypes, json, sys, threading, torch
    from m31r import native
    from m31r.model import KVCache

    class Cfg:
        def __init__(self, n_layers, kv_heads, head_dim):
            self.n_layers, self.kv_heads, self.head_dim = n_layers, kv_heads, head_dim

    shim = ctypes.CDLL(sys.argv[2])  # the preloaded copy, which the kernels' posix_memalign resolves to
    kernels = native.Kernels(native.build(family=sys.argv[1]), sys.argv[1])
    n, heads, kv, hd = native.MAX_KEYS, 2, 1, 16
    cache = KVCache(Cfg(1, kv, hd), n, kernels.dtype, "cpu")
    q, kn, vn = (torch.ones(1, h, hd, dtype=kernels.dtype) for h in (heads, kv, kv))
    qkv, cs = torch.ones(1, (heads + 2 * kv) * hd), torch.ones(1, hd)
    tables = {length: native.DecodeTable(kernels, [cache], [length - 1]) for length in (64, n)}
    out, o = torch.zeros_like(q), torch.zeros(1, heads * hd)
    calls = {"attend_decode": lambda t: kernels.attend_decode(q, kn, vn, t, 0, out)}
    if kernels.float_dtype is not None:
        calls["attend_qkv"] = lambda t: kernels.attend_qkv(qkv, cs, cs, t, 0, o)

    def attempt(call, length, failing):
        shim.no_memory(failing)
        try:
            call(tables[length])
            return "ran"
        except MemoryError as e:
            return str(e)
        finally:
            shim.no_memory(0)

    said = {}

    def steps(name, call):  # on a thread of its own (OMP_NUM_THREADS=1), whose scratch starts empty
        said[name] = [attempt(call, 64, 0),  # the thread's scratch, at its smallest
                      attempt(call, n, 1),  # too small for n positions, and it cannot grow
                      attempt(call, 64, 1),  # large enough: nothing to allocate
                      attempt(call, n, 0)]  # with memory back, it runs
        said[name].append(bool(torch.isfinite(out).all() and torch.isfinite(o).all()))

    for name, call in calls.items():
        th = threading.Thread(target=steps, args=(name, call))
        th.start()
        th.join()
    print(json.dumps(said))
"""


@pytest.mark.parametrize("name", list(native.FAMILIES))
def test_attention_out_of_memory_for_its_scores_is_a_memory_error(name: str, tmp_path) -> None:
    """A thread whose score scratch cannot grow (posix_memalign failing, through a preloaded shim) makes the call
    return 2, which Python raises as MemoryError instead of crashing; a thread whose scratch is large enough
    allocates nothing, and with memory back the long call runs."""
    if sys.platform != "linux":
        pytest.skip("the shim is an LD_PRELOAD of Linux's dynamic loader")
    name = _family(name)
    shim = tmp_path / "failing_memalign.so"
    (tmp_path / "shim.c").write_text(_FAILING_MEMALIGN)
    subprocess.run([native.compiler(), "-shared", "-fPIC", "-O1", str(tmp_path / "shim.c"), "-o", str(shim), "-ldl"],
                   check=True)
    out = _run(_NO_MEMORY, name, shim, env={"LD_PRELOAD": str(shim), "OMP_NUM_THREADS": "1"})
    assert len(out) == (1 if native.FAMILIES[name].dtype != torch.float32 else 2), out
    oom = "native decode attention ran out of memory (heads=2, kv_heads=1, head_dim=16)"
    assert all(said == ["ran", oom, "ran", "ran", True] for said in out.values()), out


# -- SwiGLU's width ---------------------------------------------------------------------------------------------


def test_swiglu_refuses_an_odd_width() -> None:
    """[16, 17]: h = 8 passed the C check and numel // 16 counted 17 rows of 8 into an output of 16."""
    name = next((f for f in _families() if native.FAMILIES[f].dtype == torch.float32), None)
    if name is None:
        pytest.skip("no fp32 family runs here")
    out = _run("""
        import json, sys, torch
        from m31r import native
        kernels = native.Kernels(native.build(family=sys.argv[1]), sys.argv[1])
        said = {}
        for width in (17, 1, 0, 16):
            try:
                said[width] = list(kernels.swiglu(torch.randn(16, width)).shape)
            except ValueError as e:
                said[width] = str(e)
        print(json.dumps(said))
    """, name)
    assert out["16"] == [16, 8], out
    assert all("even width" in out[w] for w in ("17", "1", "0")), out


# -- activation blocks too small to quantize -------------------------------------------------------------------


def _tiny_blocks(k: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose second block holds values below 3e-37, where both quotients 32767 / max|x| (q16: below ~1e-34)
    and 127 / max|x| (q8: below ~4e-37) overflow, one sign or both, beside ordinary blocks; and the same rows with
    those blocks zero."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(4, k, generator=gen)
    tiny = torch.zeros(4, 32)
    tiny[0, 0] = 2e-37
    tiny[1, :2] = torch.tensor([2e-37, -2e-37])
    tiny[2] = torch.randn(32, generator=gen) * 2e-38
    tiny[3, 5] = -3e-38
    x[:, 32:64] = tiny
    zeroed = x.clone()
    zeroed[:, 32:64] = 0
    return x, zeroed


@pytest.mark.parametrize("name", ["avx2", "avx2vnni", "avx512vnni", "neon"])
def test_a_block_too_small_to_quantize_adds_nothing(name: str) -> None:
    """Such a block once became codes of -32767 (-127) whatever its signs: it now rounds to zero codes, so the
    product is the one with that block zero, bit for bit (int8 q16 and q8, int4 on q8), and a row of such values
    alone gives zero, not a value of the wrong sign."""
    kernels = native.Kernels(native.build(family=_family(name)), name)
    x, zeroed = _tiny_blocks()
    gen = torch.Generator().manual_seed(5)
    codes, scales = quant.quantize_int8(torch.randn(16, x.shape[1], generator=gen) * 0.05)
    c4, sz = quant.quantize_int4(torch.randn(16, x.shape[1], generator=gen) * 0.05, 32)
    layer = quant.Int4Linear(c4, sz, 32)
    layer.use_native(kernels)
    for mode in ("q16", "q8"):
        full, without = kernels.int8_mm(x, codes, scales, mode), kernels.int8_mm(zeroed, codes, scales, mode)
        assert torch.equal(full, without), mode
        alone = kernels.int8_mm(x[:, 32:64].contiguous(), codes[:, 32:64].contiguous(), scales, mode)
        assert torch.equal(alone, torch.zeros_like(alone)), (mode, alone)
    assert torch.equal(layer(x), layer(zeroed))

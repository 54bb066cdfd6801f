"""Decode speed with and without the native CPU kernels, per weight precision, interleaved in one run (issue 18).

One random-init master of the chosen shape (default: the medium shape) is written as an fp32 bundle and quantized
to int8 and int4 bundles; an engine per precision runs at the activation dtype given (default: auto, fp32 where
bf16 is not native). Each repetition then runs every (precision, kernels) pair in turn: a prefill of
`--context` tokens into a fresh cache, then `--tokens` greedy decode steps. Kernels are switched in place
(`Engine.use_kernels`: the eager torch path, or the family `native.load` chose), so both variants run the same
weights in the same process, moments apart: on a shared machine interleaving is what makes them comparable.
Reported: the median over repetitions of each run's median ms/token, with the spread of the run medians.

`--profile` then times one decode step of each pair by part (Parts): the matmuls of the layers, the LM head, decode
attention, the norms, RoPE, SwiGLU, the ops between them, and the engine around the step, from forward hooks and
wrappers. The wrappers find their targets by name and skip those a tree lacks, so the same script profiles an older
checkout (copy it there) part for part.

`--kv-cache` compares the engines' default KV cache (float16 where the fp32 kernels read one) against one in the
activation dtype instead of eager against native, both on the native kernels.

`--layer-calls` compares decode passes through the per-call path (about 25 torch and ctypes calls per layer) against
one native call per layer (m31r_decode_layer_f32), both on the native kernels, the same engine switched in place.

`--one-thread` compares the family's one-thread build (no OpenMP: what a Mac runs where torch's libomp is not found)
against its OpenMP build, both on the native kernels, the same engine switched in place.

`--fp32-matmuls` times the float weights of a whole decode step instead (every layer's four matrices, so the weights
stream from memory as in a real step): the AVX2 family's fp32 matmul against oneDNN on the packed weights (what
fp32 layers ran before it) and torch's F.linear (MKL), at the row counts of `--rows`, alternating in a rotating
order; ms per step (minimum and median over `--reps`) and the weight bytes per second the minimum implies.

`--matmuls` times only the AVX2 family's int8 and int4 matmuls instead, kernel against kernel: the four weight
matrices of one layer of the shape (wqkv, wo, w13, w2; random int8 codes, int4 codes in the default group size) at
1, 2, 4 and 8 rows, for each of `--modes` (the int8 activation modes q8, q16, f32 of `native.INT8_MODES`, and
int4), alternating call by call in a rotating order; ms per layer, the median of all calls and (in parentheses)
their 10th percentile, which a shared machine's stalls disturb less. `--families avx2,avx2vnni` runs each mode on
both builds in that rotation (plain AVX2 against AVX-VNNI dot products) and adds their ratio per mode.

    python benchmarks/bench_kernels.py --threads 2 --reps 5 --profile
    M31R_KERNELS=avx2 python benchmarks/bench_kernels.py --config configs/model/mini.yaml --threads 1 --matmuls
    python benchmarks/bench_kernels.py --matmuls --modes q8,q16,int4 --families avx2,avx2vnni
    M31R_KERNELS=avx2 python benchmarks/bench_kernels.py --fp32-matmuls --threads 1 --rows 1,2,4,8,16,32,48
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def decode_run(engine, prompt: list[int], tokens: int) -> list[float]:
    """ms per decode step after a cold prefill of `prompt`, greedy."""
    import torch

    cache = engine.new_cache()
    logits = [x for x in engine.prefill(cache, prompt, 0) if x is not None][-1]
    times = []
    for _ in range(tokens):
        tok = int(torch.argmax(logits))
        t0 = time.perf_counter()
        logits = engine.decode_step(cache, tok)
        times.append((time.perf_counter() - t0) * 1000)
    return times


PRECISIONS = ("fp32", "int8", "int4")  # the bundles --precisions can name: fp32 and the two it is quantized to
PARTS = ["matmuls", "LM head", "attention", "norms", "RoPE", "SwiGLU", "attention glue", "step rest", "engine"]


class Parts:
    """Wall time by part of a decode step, from forward hooks on the linear layers and wrappers on everything else:
    the layer matmuls, the LM head, decode attention (the kernel call, or the eager attention), the RMSNorms (with
    the fp32 kernels: each residual add and the norm after it), RoPE, SwiGLU's product (silu * up), the attention
    module's own ops between those (layouts, copies, cache writes of the eager path), the rest of
    Transformer.step (embedding, residual adds, the decode table, cache fitting) and the engine around it (Engine.run
    and its pass set-up). Each wrapper counts its own time less the parts inside it, so the parts add up to the step
    (the hooks' own overhead, a few microseconds each, lands in the part that calls them)."""

    def __init__(self, engine):
        from m31r import model as model_mod
        from m31r import native
        from m31r.quant import FloatLinear, Int4Linear, Int8Linear

        self.t = dict.fromkeys(PARTS, 0.0)
        self.handles, self.undo = [], []
        head = engine.model.head if engine.model.head is not None else engine.model.output
        for m in engine.model.modules():
            if isinstance(m, (FloatLinear, Int8Linear, Int4Linear)):
                self._hook(m, "LM head" if m is head else "matmuls")

        def wrap(obj, name: str, part: str, inside: tuple[str, ...] = ()) -> None:
            fn = getattr(obj, name, None)
            if fn is None:  # a path this tree does not have
                return

            def timed(*a, **k):
                t0, before = time.perf_counter(), sum(self.t[p] for p in inside)
                try:
                    return fn(*a, **k)
                finally:
                    self.t[part] += time.perf_counter() - t0 - (sum(self.t[p] for p in inside) - before)

            setattr(obj, name, timed)
            # a class gets its function back; an instance loses the attribute that shadowed its method
            self.undo.append(lambda: setattr(obj, name, fn) if isinstance(obj, type) or obj is model_mod
                             else delattr(obj, name))

        wrap(native.DecodeTable, "attend", "attention")
        wrap(native.DecodeTable, "attend_qkv", "attention")
        wrap(model_mod, "attend_rows", "attention")
        wrap(model_mod.RMSNorm, "forward", "norms")
        wrap(native.Kernels, "add_rmsnorm", "norms")
        wrap(model_mod, "apply_rope", "RoPE")
        wrap(native.Kernels, "swiglu", "SwiGLU")
        wrap(model_mod.FeedForward, "forward", "SwiGLU", ("matmuls",))
        wrap(model_mod.Attention, "step", "attention glue", ("matmuls", "attention", "RoPE"))
        if head is None:  # an fp32 tied head without the fp32 kernels is F.linear on the embedding
            wrap(engine.model, "_head", "LM head")
        wrap(model_mod.Transformer, "step", "step rest", tuple(PARTS[:7]))
        wrap(engine, "run", "engine", tuple(PARTS[:8]))

    def _hook(self, m, part: str) -> None:
        start = {}
        self.handles.append(m.register_forward_pre_hook(lambda mod, a: start.__setitem__(0, time.perf_counter())))
        self.handles.append(m.register_forward_hook(
            lambda mod, a, out: self.t.__setitem__(part, self.t[part] + time.perf_counter() - start[0])))

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for u in reversed(self.undo):
            u()


def profile(engine, prompt: list[int], steps: int) -> dict[str, float]:
    """Median ms per part over `steps` decode steps."""
    import torch

    cache = engine.new_cache()
    logits = [x for x in engine.prefill(cache, prompt, 0) if x is not None][-1]
    rows: list[dict[str, float]] = []
    for _ in range(steps):
        parts = Parts(engine)
        tok = int(torch.argmax(logits))
        t0 = time.perf_counter()
        logits = engine.decode_step(cache, tok)
        total = time.perf_counter() - t0
        parts.close()
        row = {k: v * 1000 for k, v in parts.t.items()}
        row["other"] = total * 1000 - sum(row.values())  # decode_step around Engine.run; ~0 but for the hooks
        row["total"] = total * 1000
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def matmuls(config, threads: int, reps: int, modes: list[str], families: list[str]) -> None:
    """ms per layer of the AVX2 int8 matmul in each activation mode, and of the int4 matmul, per family (see the
    module docstring)."""
    import torch

    from m31r import native
    from m31r.cpu import describe
    from m31r.quant import DEFAULT_INT4_GROUP, Int4Linear, quantize_int4, quantize_int8

    if families:
        bad = {f: native.family_unsupported(f) for f in families if f not in native.FAMILIES
               or native.FAMILIES[f].base not in ("avx2", "neon") or native.family_unsupported(f)}
        if bad:
            raise SystemExit("not an avx2 (or neon) family this CPU runs: "
                             + "; ".join(f"{f} ({why or 'not avx2- or neon-based'})" for f, why in bad.items()))
        kernels = {f: native.Kernels(native.build(family=f), f, "--families") for f in families}
    else:
        loaded = native.load(torch.float32)
        if loaded is None or loaded.family.base not in ("avx2", "neon"):
            raise SystemExit(f"the avx2 (or neon) kernels do not run here ({native.why_not(torch.float32)}); "
                             "try M31R_KERNELS=avx2")
        kernels = {loaded.name: loaded}
    torch.set_num_threads(threads)
    d, hd = config.d_model, config.head_dim
    shapes = [((config.n_heads + 2 * config.kv_heads) * hd, d), (d, config.n_heads * hd), (2 * config.ffn_hidden, d),
              (d, config.ffn_hidden)]
    gen = torch.Generator().manual_seed(0)
    masters = [torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes]
    weights = [quantize_int8(w) for w in masters]
    int4 = [Int4Linear(*quantize_int4(w, DEFAULT_INT4_GROUP), DEFAULT_INT4_GROUP) for w in masters]
    for layer in int4:
        layer.use_native(next(iter(kernels.values())))  # builds its fp32 scale and base: the same for every family
    rows = (1, 2, 4, 8)
    xs = {m: [torch.randn(m, k, generator=gen) for _, k in shapes] for m in rows}

    def layer_call(kern, mode: str, m: int) -> None:
        if mode == "int4":
            for lin, x in zip(int4, xs[m], strict=True):
                kern.int4_mm(x, lin.codes, lin._scale_f32, lin._base_f32, DEFAULT_INT4_GROUP)
        else:
            for (codes, scales), x in zip(weights, xs[m], strict=True):
                kern.int8_mm(x, codes, scales, mode=mode)

    variants = [(f, mode) for mode in modes for f in kernels]
    times: dict[tuple[int, str, str], list[float]] = {(m, f, mode): [] for m in rows for f, mode in variants}
    for rep in range(reps + 1):  # variants alternate call by call: a busy moment hits them alike
        for i in range(50):
            for m in rows:
                for f, mode in variants[i % len(variants):] + variants[: i % len(variants)]:  # each first as often
                    t0 = time.perf_counter()
                    layer_call(kernels[f], mode, m)
                    if rep:  # the first repetition warms up and is dropped
                        times[(m, f, mode)].append((time.perf_counter() - t0) * 1000)
    print(f"{config.name}: int8/int4 matmuls of one layer ({' + '.join(f'{n}x{k}' for n, k in shapes)}; int4 in "
          f"groups of {DEFAULT_INT4_GROUP}), {threads} threads, ms per layer (median of {reps} reps x 50 layer "
          f"calls), load avg {os.getloadavg()[0]:.1f}")
    print(f"CPU: {describe()}")
    for kern in kernels.values():
        print(f"kernels: {kern.describe()} ({kern.reason or native.why_not(torch.float32)})")
    med = {key: statistics.median(t) for key, t in times.items()}
    p10 = {key: statistics.quantiles(t, n=10)[0] for key, t in times.items()}
    for f in kernels:
        print(f"\n{f}\n{'rows':>4}" + "".join(f"{mode + ' ms (p10)':>18}" for mode in modes)
              + ("   q16 / q8 (p10)" if {"q8", "q16"} <= set(modes) else ""))
        for m in rows:
            ratio = (f"   {med[(m, f, 'q16')] / med[(m, f, 'q8')]:.2f} ({p10[(m, f, 'q16')] / p10[(m, f, 'q8')]:.2f})"
                     if {"q8", "q16"} <= set(modes) else "")
            print(f"{m:>4}" + "".join(f"{med[(m, f, mode)]:>10.3f} ({p10[(m, f, mode)]:.3f})" for mode in modes)
                  + ratio)
    if len(kernels) > 1:
        first, *others = kernels
        for f in others:
            print(f"\n{f} / {first}: time ratio, median (p10); below 1 is faster")
            print(f"{'rows':>4}" + "".join(f"{mode:>16}" for mode in modes))
            for m in rows:
                print(f"{m:>4}" + "".join(f"{med[(m, f, mode)] / med[(m, first, mode)]:>9.3f} "
                                          f"({p10[(m, f, mode)] / p10[(m, first, mode)]:.3f})" for mode in modes))


def fp32_matmuls(config, threads: int, reps: int, rows: list[int]) -> None:
    """ms per decode step of the fp32 layer matmuls: native fp32 matmul, oneDNN packed, F.linear (module docstring)."""
    import torch
    import torch.nn.functional as F

    from m31r import native
    from m31r.cpu import describe
    from m31r.quant import FloatLinear

    kernels = native.load(torch.float32)
    if kernels is None or kernels.float_dtype != torch.float32:
        raise SystemExit(f"the avx2 kernels do not run here ({native.why_not(torch.float32)}); try M31R_KERNELS=avx2")
    torch.set_num_threads(threads)
    d, hd = config.d_model, config.head_dim
    shapes = [((config.n_heads + 2 * config.kv_heads) * hd, d), (d, config.n_heads * hd), (2 * config.ffn_hidden, d),
              (d, config.ffn_hidden)]
    gen = torch.Generator().manual_seed(0)
    plain = [[torch.randn(n, k, generator=gen) * 0.05 for n, k in shapes] for _ in range(config.n_layers)]
    packed = [[FloatLinear(w.clone()) for w in layer] for layer in plain]
    xs = {m: [torch.randn(m, k, generator=gen) for _, k in shapes] for m in rows}
    variants = {
        "native fp32": lambda m: [kernels.f32_mm(x, w) for layer in plain for w, x in zip(layer, xs[m], strict=True)],
        "oneDNN packed": lambda m: [lin(x) for layer in packed for lin, x in zip(layer, xs[m], strict=True)],
        "F.linear": lambda m: [F.linear(x, w) for layer in plain for w, x in zip(layer, xs[m], strict=True)],
    }
    names = list(variants)
    times: dict[tuple[int, str], list[float]] = {(m, v): [] for m in rows for v in names}
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first repetition warms up and is dropped
            for m in rows:
                for v in names[rep % len(names):] + names[: rep % len(names)]:
                    t0 = time.perf_counter()
                    variants[v](m)
                    if rep:
                        times[(m, v)].append((time.perf_counter() - t0) * 1000)
    gb = sum(n * k for n, k in shapes) * 4 * config.n_layers / 1e9
    print(f"{config.name}: fp32 layer matmuls of a decode step ({config.n_layers} x "
          f"{' + '.join(f'{n}x{k}' for n, k in shapes)}, {gb * 1000:.0f} MB), {threads} threads, ms per step "
          f"(min / median of {reps}; GB/s of weights at the min), load avg {os.getloadavg()[0]:.1f}")
    print(f"CPU: {describe()}; kernels: {kernels.name}")
    print(f"{'rows':>4}" + "".join(f"{v:>26}" for v in names) + "   native / oneDNN (min)")
    for m in rows:
        cells = "".join(f"{min(times[(m, v)]):>9.1f} / {statistics.median(times[(m, v)]):>6.1f} "
                        f"({gb / min(times[(m, v)]) * 1000:4.1f})" for v in names)
        print(f"{m:>4}{cells}   {min(times[(m, names[0])]) / min(times[(m, names[1])]):.2f}")


def first_dtype(engines: dict) -> str:
    """The activation dtype of the first engine, in words."""
    return str(next(iter(engines.values())).dtype).removeprefix("torch.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "model" / "medium.yaml")
    ap.add_argument("--dtype", default="auto", help="activation dtype of every engine (default auto)")
    ap.add_argument("--precisions", default="fp32,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before decoding (default 300)")
    ap.add_argument("--tokens", type=int, default=64, help="decode steps per run (default 64)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--profile", action="store_true", help="time one decode step by part, per pair")
    ap.add_argument("--matmuls", action="store_true",
                    help="time the AVX2 int8 and int4 matmuls of one layer per mode instead (q8, q16, f32, int4)")
    ap.add_argument("--fp32-matmuls", action="store_true",
                    help="time the fp32 layer matmuls of a decode step instead: native fp32 matmul, oneDNN, F.linear")
    ap.add_argument("--rows", default="1,2,4,8,16,32,48", help="--fp32-matmuls: the row counts (default 1..48)")
    ap.add_argument("--modes", default="",
                    help="--matmuls: the int8 activation modes and/or int4 to time (default all: q8,q16,f32,int4)")
    ap.add_argument("--families", default="",
                    help="--matmuls: avx2 families to time side by side, e.g. avx2,avx2vnni (default: the one "
                         "M31R_KERNELS / auto picks for fp32)")
    ap.add_argument("--kv-cache", action="store_true",
                    help="compare the native kernels on a KV cache of the activation dtype against the engine's "
                         "default (float16 under the fp32 kernels), instead of eager against native")
    ap.add_argument("--layer-calls", action="store_true",
                    help="compare decode passes on the native kernels through the per-call path against one native "
                         "call per layer (Transformer.layer_calls), instead of eager against native")
    ap.add_argument("--one-thread", action="store_true",
                    help="compare the family's one-thread build (no OpenMP) against its OpenMP build, instead of "
                         "eager against native")
    ap.add_argument("--workdir", type=Path, default=None, help="keep the bundles here (default: a temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    for name in ("threads", "context", "tokens", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if not (precisions := [n for n in args.precisions.split(",") if n]) or set(precisions) - set(PRECISIONS):
        ap.error(f"--precisions takes a comma-separated subset of {', '.join(PRECISIONS)}, not {args.precisions!r}")

    import torch

    from m31r import native
    from m31r.bundle import init_bundle, quantize_bundle
    from m31r.config import load_config
    from m31r.cpu import describe
    from m31r.engine import Engine
    from m31r.tokenizer import build_byte_tokenizer

    torch.set_num_threads(args.threads)
    config = load_config(args.config)
    if args.fp32_matmuls:
        return fp32_matmuls(config, args.threads, args.reps, [int(r) for r in args.rows.split(",") if r])
    if args.matmuls:
        modes = [m for m in args.modes.split(",") if m] or [*native.INT8_MODES, "int4"]
        if not set(modes) <= {*native.INT8_MODES, "int4"}:
            raise SystemExit(f"--modes takes {', '.join((*native.INT8_MODES, 'int4'))}")
        return matmuls(config, args.threads, args.reps, modes, [f for f in args.families.split(",") if f])
    names = [n for n in args.precisions.split(",") if n]
    with tempfile.TemporaryDirectory(prefix="m31r-kernels-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        base = work / "bundle-fp32"
        if not base.exists():
            init_bundle(config, base, seed=args.seed, tokenizer=build_byte_tokenizer(config.vocab_size),
                        dtype=torch.float32)
        engines = {}
        for name in names:
            path = base if name == "fp32" else work / f"bundle-{name}"
            if name != "fp32" and not path.exists():
                quantize_bundle(base, path, name)
            engines[name] = Engine(path, dtype=args.dtype, threads=args.threads, decode_width=1)
            if args.kv_cache:  # the same weights, caches in the activation dtype
                act = str(engines[name].dtype).removeprefix("torch.")
                engines[name + "/kv"] = Engine(path, dtype=act, threads=args.threads, decode_width=1, kv_dtype=act)
        kernels = {name: e.kernels for name, e in engines.items()}
        # Every comparison has the native kernels on at least one side: without them ("eager" forced, a CPU none of
        # the families runs on) both columns would time the eager path, and the ratio would pass for a measurement.
        if without := [name for name in names if kernels[name] is None]:
            why = native.why_not(engines[without[0]].dtype)
            if len(without) == len(names):
                raise SystemExit(f"no native kernels run here ({why}): nothing to compare them with eager; "
                                 "M31R_KERNELS=auto picks the widest family this CPU runs")
            print(f"# skipped {', '.join(without)}: no native kernels for them here ({why})", file=sys.stderr)
            names = [n for n in names if n not in without]
        alone = {}  # --one-thread: the same family built without OpenMP
        if args.one_thread:
            alone = {name: native.Kernels(native.build(family=kernels[name].name, openmp=False),
                                          kernels[name].family, "one-thread build") for name in names}
        kinds = (("kv " + str(first_dtype(engines)), "kv auto") if args.kv_cache
                 else ("per call", "layer call") if args.layer_calls
                 else ("one thread", "OpenMP") if args.one_thread else ("eager", "native"))
        pairs = [(n, k) for n in names for k in kinds]

        def engine(name: str, kind: str):
            """The pair's engine, its kernels set."""
            e = engines[name + "/kv" if kind == kinds[0] and args.kv_cache else name]
            e.use_kernels(None if kind == "eager" else alone[name] if kind == "one thread" else kernels[name])
            e.model.layer_calls = kind != "per call"
            return e

        gen = torch.Generator().manual_seed(1234)
        prompt = torch.randint(5, config.vocab_size, (args.context,), generator=gen).tolist()
        runs: dict[tuple[str, str], list[float]] = {p: [] for p in pairs}
        first = engines[names[0]]
        print(f"# {describe()}; torch {torch.__version__}, {args.threads} threads; kernels: "
              f"{first.kernels.describe() if first.kernels else 'none'} ({native.why_not(first.dtype)})",
              file=sys.stderr)
        with torch.inference_mode():
            for name, kind in pairs:  # warm-up: kernels, allocator, probes
                decode_run(engine(name, kind), prompt[:64], 4)
            for rep in range(args.reps):
                for name, kind in pairs:
                    runs[(name, kind)].append(statistics.median(decode_run(engine(name, kind), prompt, args.tokens)))
                print(f"# rep {rep + 1}/{args.reps}: " + ", ".join(f"{n}/{k} {runs[(n, k)][-1]:.1f}"
                                                                  for n, k in pairs), file=sys.stderr)
            parts = {}
            if args.profile:
                for name, kind in pairs:
                    parts[(name, kind)] = profile(engine(name, kind), prompt, 16)
    dtype = str(first.dtype).removeprefix("torch.")
    print(f"{config.name} ({config.param_count() / 1e6:.1f}M params), {dtype} activations, {args.threads} threads, "
          f"{args.context}-token context, {args.tokens} decode steps x {args.reps} interleaved reps, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"CPU: {describe()}")
    print(f"kernels: {first.kernels.describe() if first.kernels else 'none: ' + native.why_not(first.dtype)}")
    if args.kv_cache:
        print("kv auto: " + "; ".join(f"{n} {engines[n].kernel_report['kv_cache']}" for n in names))
    print(f"{'weights':8} {kinds[0] + ' ms/tok':>17} {kinds[1] + ' ms/tok':>17} {'speed-up':>9}"
          "   (run medians: min-max)")
    for name in names:
        e, n = (statistics.median(runs[(name, k)]) for k in kinds)
        spread = " ".join(f"{min(runs[(name, k)]):.1f}-{max(runs[(name, k)]):.1f}" for k in kinds)
        print(f"{name:8} {e:>17.1f} {n:>17.1f} {e / n:>8.2f}x   ({spread})")
    if parts:
        keys = [*PARTS, "other", "total"]
        print(f"\none decode step by part (median of 16 steps at {args.context} context, ms; % of the step)")
        print(f"{'weights/kernels':16}" + "".join(f"{k:>15}" for k in keys))
        for (name, kind), p in parts.items():
            print(f"{name + '/' + kind:16}" + "".join(f"{p[k]:>7.2f} ({100 * p[k] / p['total']:4.1f})" for k in keys))


if __name__ == "__main__":
    main()

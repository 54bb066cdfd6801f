"""Accuracy of each serving precision against fp32, on a trained bundle and the held-out validation split.

For fp32, bf16, int8 and int4 weights on the same bundle (the quantized ones at the activation dtype the daemon
serves them with, `--dtype auto`: fp32 where the fp32 kernels (avx2vnni, avx2, neon) run, whose int8 matmul takes
q16 activations, else bf16 where it is native. For comparison, when asked for: `int8-q8` runs the same int8 weights
on the kernel's older q8 activations, `int8-f32` on exact fp32 activations, which isolates what the weights change).
The fp32 reference keeps its KV cache in fp32; `fp32-kv16` is fp32 weights with the float16 cache the fp32 kernels
read by default (Engine's kv_dtype), and the quantized rows run their engines' default cache too:

  perplexity    eval_fim's validation perplexity (windows of --ppl-context tokens), and its delta to fp32
  same output   the share of FIM tasks (eval_fim's single- and multi-line tasks, greedy) whose completion is
                exactly fp32's completion; also per kind (long multi-line completions diverge first)
  exact match   eval_fim's exact match of the completion against the held-out middle

    python benchmarks/eval_precision.py --bundle release --data data --out bench-results/precision.json
    python benchmarks/eval_precision.py --bundle release --data data --precisions fp32,int8,int4  # no emulated bf16
    M31R_KERNELS=avx2 python benchmarks/eval_precision.py --bundle release --data data --precisions fp32,int8,int8-q8

The run fails (exit 1) when a quantized precision's greedy agreement with fp32 is below --min-agreement (98%).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fim  # noqa: E402

PRECISIONS = [("fp32", "float32", None, "float32"), ("fp32-kv16", "float32", None, "auto"),
              ("bf16", "bfloat16", None, "auto"), ("int8", "auto", "int8", "auto"), ("int4", "auto", "int4", "auto"),
              ("int8-q8", "float32", "int8", "auto"), ("int8-f32", "float32", "int8", "auto"),
              ("int8-f32gemm", "auto", "int8", "auto")]
# The last three only when asked for: the AVX2 (NEON) int8 kernel on its coarser q8 activations, and on exact fp32 ones
# (the codes widened to fp32: what the int8 weights alone change); int8 with fp32 prefill GEMMs everywhere (int8's
# default takes bf16 ones where they are native: Engine's prefill_gemm).
# The reference, fp32, keeps its KV cache in fp32; fp32-kv16 is fp32 weights as engines serve them where the fp32
# kernels read a float16 cache (Engine's kv_dtype auto; skipped elsewhere). The rest run their engines' defaults.
DEFAULT = "fp32,fp32-kv16,bf16,int8,int4"


COMPARISONS = ("int8-q8", "int8-f32", "int8-f32gemm")  # reported, never a failure


def below(rows: list[dict], min_agreement: float) -> list[str]:
    """The served precisions (quantized, and fp32 on a float16 cache) whose greedy agreement with fp32 is under
    `min_agreement`, counted in tasks: `same_as_fp32` is rounded to four places, and 440 of 449 tasks (97.996%) would
    read as 98% and pass."""
    return [r["precision"] for r in rows
            if (r["quant"] or r["precision"] == "fp32-kv16") and r["precision"] not in COMPARISONS
            and r["same_tasks"] / r["tasks"] < min_agreement]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--n-single", type=int, default=60)
    p.add_argument("--n-multi", type=int, default=20)
    p.add_argument("--ppl-windows", type=int, default=32)
    p.add_argument("--ppl-context", type=int, default=1024, help="tokens per perplexity window (as eval_fim)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--precisions", default=DEFAULT,
                   help="comma-separated subset (fp32 always runs first: the reference)")
    p.add_argument("--min-agreement", type=float, default=0.98)
    args = p.parse_args(argv)
    wanted = {"fp32", *args.precisions.split(",")}

    from m31r.cpu import describe
    from m31r.engine import Engine
    from m31r.fim import FimBudget

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    texts = eval_fim.val_texts(args.data)
    if not texts:  # before any model loads
        raise SystemExit(f"error: no validation files in {args.data / 'corpus' / 'val.jsonl'}: nothing to draw tasks "
                         "from")
    rows, reference, outputs = [], None, {}
    for name, dtype, quant, kv in [p for p in PRECISIONS if p[0] in wanted]:
        t0 = time.perf_counter()
        engine = Engine(args.bundle, dtype=dtype, quant=quant, decode_width=1, kv_dtype=kv,
                        prefill_gemm="float32" if name == "int8-f32gemm" else "auto")
        if name == "fp32-kv16" and engine.kernel_report["kv_cache"] != "float16":
            log(f"{name}: skipped, this machine's fp32 engine keeps its KV cache in "
                f"{engine.kernel_report['kv_cache']} ({engine.kernel_report['kv_why']})")
            continue
        if name in ("int8-q8", "int8-f32"):
            if not engine.native_int8 or engine.kernels.family.base not in ("avx2", "neon"):
                log(f"{name}: skipped, the AVX2 (or NEON) int8 kernel does not run here (try M31R_KERNELS=avx2)")
                continue
            engine.kernels.int8_mode = name[5:]  # shared with later engines of this process: set back below
        dtype = str(engine.dtype).removeprefix("torch.")
        kernels = engine.kernel_report["kernels"] if engine.kernel_report["native_attention"] else "eager"
        reserve = FimBudget.for_context(engine.config.max_context).reserve
        single_max = min(48, reserve)
        tasks = eval_fim.make_tasks(texts, args.n_single, args.n_multi, args.seed, engine.tokenizer, single_max,
                                    reserve)
        if not tasks:  # every agreement below would be 0 of 0
            raise SystemExit(f"error: no FIM task fits the completion budget ({single_max} tokens a line, {reserve} a "
                             f"block) in {args.data / 'corpus' / 'val.jsonl'}: nothing to measure agreement on")
        results = eval_fim.run_tasks(engine, tasks, single_max, reserve, lambda _: None)
        ppl = eval_fim.perplexity(engine, [t for _, t, _ in texts], args.ppl_windows, args.ppl_context)
        preds = [r.prediction for r in results]
        if reference is None:
            reference = {"preds": preds, "ppl": ppl.get("perplexity"), "loss": ppl.get("loss")}
        # No window fits (--ppl-windows 0, or a validation split shorter than one window): no perplexity, and the
        # agreement, measured already, is still reported and judged.
        measured = ppl.get("windows") and reference["ppl"] is not None
        same = sum(a == b for a, b in zip(preds, reference["preds"], strict=True)) / len(preds)
        by_kind = {kind: [a == b for a, b, r in zip(preds, reference["preds"], results, strict=True) if r.kind == kind]
                   for kind in ("single", "multi")}  # long multi-line completions diverge first
        rows.append({"precision": name, "dtype": dtype, "quant": quant, "kernels": kernels,
                     "kv_cache": engine.kernel_report["kv_cache"],
                     "prefill_gemm": engine.kernel_report.get("prefill_gemm"),
                     "perplexity": ppl.get("perplexity"),
                     "perplexity_delta": round(ppl["perplexity"] - reference["ppl"], 3) if measured else None,
                     "loss_delta": round(ppl["loss"] - reference["loss"], 4) if measured else None,
                     "same_as_fp32": round(same, 4),
                     "same_tasks": sum(a == b for a, b in zip(preds, reference["preds"], strict=True)),
                     **{f"same_{k}": round(sum(v) / len(v), 4) for k, v in by_kind.items() if v},
                     "exact_match": round(sum(r.exact for r in results) / len(results), 4), "tasks": len(results),
                     "seconds": round(time.perf_counter() - t0, 1)})
        outputs[name] = preds
        if name == "int8-f32gemm" and "int8" in outputs:  # what int8's bf16 prefill GEMMs alone change
            rows[-1]["same_as_int8"] = round(sum(a == b for a, b in zip(preds, outputs["int8"], strict=True))
                                             / len(preds), 4)
        if engine.kernels is not None:
            engine.kernels.int8_mode = "q16"
        log(f"{name}: {rows[-1]}")
    print(f"\nprecision accuracy: {Path(args.bundle).resolve().name} bundle, {rows[0]['tasks']} greedy FIM tasks, "
          f"perplexity over {args.ppl_windows} validation windows")
    print(f"CPU: {describe()}")
    print(f"{'precision':<9} {'activations':<11} {'kv cache':<9} {'kernels':<8} {'perplexity':>10} {'Δ vs fp32':>9} "
          f"{'same output as fp32':>19} {'single / multi-line':>19} {'exact match':>11}")
    for r in rows:
        kinds = f"{100 * r.get('same_single', 0):.1f}% / {100 * r.get('same_multi', 0):.1f}%"
        ppl = (f"{r['perplexity']:>10.3f} {r['perplexity_delta']:>+9.3f}" if r["perplexity_delta"] is not None
               else f"{'-':>10} {'-':>9}")
        print(f"{r['precision']:<9} {r['dtype']:<11} {r['kv_cache']:<9} {r['kernels']:<8} {ppl} "
              f"{100 * r['same_as_fp32']:>18.1f}% {kinds:>19} "
              f"{100 * r['exact_match']:>10.1f}%")
    failed = below(rows, args.min_agreement)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"bundle": str(args.bundle), "cpu": describe(), "rows": rows}, indent=2) + "\n")
    if failed:
        counts = {r["precision"]: f"{r['same_tasks']} of {r['tasks']} tasks" for r in rows}
        print(f"below {100 * args.min_agreement:g}% greedy agreement with fp32: "
              + ", ".join(f"{name} ({counts[name]})" for name in failed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

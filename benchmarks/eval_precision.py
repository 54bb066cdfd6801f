"""Accuracy of each serving precision against fp32, on a trained bundle and the held-out validation split.

For fp32, bf16, int8 and int4 weights (bf16 activations for the quantized ones, as served) on the same bundle:

  perplexity    eval_fim's validation perplexity (windows of max_context + 1 tokens), and its delta to fp32
  same output   the share of FIM tasks (eval_fim's single- and multi-line tasks, greedy) whose completion is
                exactly fp32's completion
  exact match   eval_fim's exact match of the completion against the held-out middle

    python benchmarks/eval_precision.py --bundle release --data data --out bench-results/precision.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import eval_fim  # noqa: E402

PRECISIONS = [("fp32", "float32", None), ("bf16", "bfloat16", None), ("int8", "bfloat16", "int8"),
              ("int4", "bfloat16", "int4")]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--n-single", type=int, default=60)
    p.add_argument("--n-multi", type=int, default=20)
    p.add_argument("--ppl-windows", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from m31r.engine import Engine
    from m31r.fim import FimBudget

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    with open(args.data / "corpus" / "val.jsonl") as f:
        texts = [(d["path"], d["text"]) for d in map(json.loads, filter(str.strip, f)) if d["text"].strip()]
    rows, reference = [], None
    for name, dtype, quant in PRECISIONS:
        t0 = time.perf_counter()
        engine = Engine(args.bundle, dtype=dtype, quant=quant, decode_width=1)
        reserve = FimBudget.for_context(engine.config.max_context).reserve
        single_max = min(48, reserve)
        tasks = eval_fim.make_tasks(texts, args.n_single, args.n_multi, args.seed, engine.tokenizer, single_max,
                                    reserve)
        results = eval_fim.run_tasks(engine, tasks, single_max, reserve, lambda _: None)
        ppl = eval_fim.perplexity(engine, [t for _, t in texts], args.ppl_windows)
        preds = [r.prediction for r in results]
        if reference is None:
            reference = {"preds": preds, "ppl": ppl["perplexity"], "loss": ppl["loss"]}
        same = sum(a == b for a, b in zip(preds, reference["preds"], strict=True)) / len(preds)
        rows.append({"precision": name, "dtype": dtype, "quant": quant, "perplexity": ppl["perplexity"],
                     "perplexity_delta": round(ppl["perplexity"] - reference["ppl"], 3),
                     "loss_delta": round(ppl["loss"] - reference["loss"], 4), "same_as_fp32": round(same, 4),
                     "exact_match": round(sum(r.exact for r in results) / len(results), 4), "tasks": len(results),
                     "seconds": round(time.perf_counter() - t0, 1)})
        log(f"{name}: {rows[-1]}")
    print(f"\nprecision accuracy: {Path(args.bundle).resolve().name} bundle, {rows[0]['tasks']} greedy FIM tasks, "
          f"perplexity over {args.ppl_windows} validation windows")
    print(f"{'precision':<9} {'perplexity':>10} {'Δ vs fp32':>9} {'same output as fp32':>19} {'exact match':>11}")
    for r in rows:
        print(f"{r['precision']:<9} {r['perplexity']:>10.3f} {r['perplexity_delta']:>+9.3f} "
              f"{100 * r['same_as_fp32']:>18.1f}% {100 * r['exact_match']:>10.1f}%")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"bundle": str(args.bundle), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Training throughput: tokens/s and model FLOP utilisation of the trainer's step, old settings against new, one run.

Each variant builds the same model (same seed), then runs `--steps` timed optimizer steps (after one untimed) on
the same data, through the trainer's own functions (`Data.batch`, `loss_terms`, `make_optimizer`). Variants run
interleaved, round by round, so drift on a shared machine hits them alike. Reported per variant:

  tok/s        training tokens per second (median step)
  TFLOP/s      at `trainer.flops_per_token` (6 per matmul weight + causal attention)
  MFU          TFLOP/s over the fp32 (or bf16) matmul rate measured in this run on the same threads: the best a
               step built of matmuls could do here
  data %       share of the step spent building rows (tokenising FIM samples, slicing the stream)

Variants:
  old          what the trainer did before: bf16 autocast whatever the CPU, unfused AdamW (its step here is one
               row of --old-seq tokens, which flatters it: short rows are cheaper per token)
  fp32-unfused the old step without the bf16 cast: full-context rows, unfused AdamW
  new-<len>    the trainer now: autocast only where bf16 is native, fused AdamW, rows of <len> tokens (the context
               schedule's stages), the same tokens per step
  compiled-<len>  the same with torch.compile (`compile: true`; `--compile`)

    python benchmarks/bench_train.py --config configs/train/mini.yaml --data ~/.cache/m31r/data --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def matmul_peak(dtype, threads: int, n: int = 1536, reps: int = 5) -> float:
    """Best TFLOP/s of an n×n×n matmul: the rate a step made only of large matmuls could reach here."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(REPO / "configs/train/mini.yaml"))
    ap.add_argument("--data", required=True, help="a data folder made by `make train-data`")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--lengths", default="256,512,1024", help="row lengths of the new trainer to measure")
    ap.add_argument("--skip-old", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="also the new trainer with torch.compile (compile: true), at each --lengths")
    ap.add_argument("--old-seq", type=int, default=256,
                    help="the old variant's step is one row of this many tokens: where bf16 is emulated it runs ~30x "
                         "slower than fp32, and a full step would take many minutes")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    try:
        lengths = [int(n) for n in args.lengths.split(",")]
    except ValueError:
        ap.error(f"--lengths: comma-separated row lengths, not {args.lengths!r}")
    if min([*lengths, args.steps, args.threads, args.old_seq]) < 1:
        ap.error("--lengths, --steps, --threads and --old-seq must be at least 1")

    import torch

    from m31r.cpu import describe
    from m31r.engine import fast_bf16
    from m31r.model import Transformer, init_weights
    from m31r.tokenizer import Tokenizer
    from m31r.train.trainer import (
        Data,
        autocast_dtype,
        flops_per_token,
        load_train_config,
        loss_terms,
        make_optimizer,
        require_data,
        rows_per_micro_batch,
        total_loss,
    )

    torch.set_num_threads(args.threads)
    tc, mc = load_train_config(args.config)
    data_dir = Path(args.data).expanduser()
    try:
        require_data(data_dir)
    except FileNotFoundError as e:
        raise SystemExit(f"error: {e}") from None
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", mc.special_tokens)
    data = Data(tok, data_dir, mc.max_context, tc.fim_rate, tc.block_fim)
    new_cast = autocast_dtype("auto", torch.device("cpu"))
    full = rows_per_micro_batch(tc, mc.max_context, mc.max_context)
    # (name, autocast dtype, fused AdamW, row length, rows per micro-batch, micro-batches per step, compiled)
    variants = [] if args.skip_old else [("old", torch.bfloat16, False, args.old_seq, 1, 1, False)]
    variants += [("fp32-unfused", None, False, mc.max_context, full, tc.grad_accum, False)]
    for compiled in (False, True) if args.compile else (False,):
        variants += [(f"{'compiled' if compiled else 'new'}-{n}", new_cast, True, n,
                      rows_per_micro_batch(tc, n, mc.max_context), tc.grad_accum, compiled) for n in lengths]

    states = {}
    for name, cast, fused, seq, rows, accum, compiled in variants:
        model = Transformer(mc)
        init_weights(model, tc.seed)
        model.train()
        fwd = torch.compile(model) if compiled else model
        states[name] = (model, fwd, make_optimizer(model, tc, fused=fused), cast, seq, rows, accum, [], [])

    def step(name: str, i: int) -> None:
        model, fwd, opt, cast, seq, n_rows, accum, times, data_times = states[name]
        rng = random.Random(1000 + i)
        t0 = time.perf_counter()
        data_s = 0.0
        for _ in range(accum):
            d0 = time.perf_counter()
            rows, cats = data.batch("train", rng, n_rows, seq)
            data_s += time.perf_counter() - d0
            (total_loss(loss_terms(fwd, rows, cats, cast), tc) / accum).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), tc.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 0:
            times.append(time.perf_counter() - t0)
            data_times.append(data_s)

    for name in states:
        step(name, -1)  # warm-up: allocator, oneDNN primitives, torch.compile's compilation
        step(name, -1)
    for i in range(args.steps):
        for name in states:
            step(name, i)

    peak32 = matmul_peak(torch.float32, args.threads)
    peak16 = matmul_peak(torch.bfloat16, args.threads) if fast_bf16(torch.device("cpu")) else None
    rows = []
    for name, (_, _, _, cast, seq, n_rows, accum, times, data_times) in states.items():
        tokens = accum * n_rows * seq
        t = statistics.median(times)
        tflops = tokens * flops_per_token(mc, seq) / t / 1e12
        peak = peak16 if cast is not None and peak16 else peak32
        rows.append({"variant": name, "dtype": "bf16" if cast is not None else "fp32", "seq": seq,
                     "tokens_per_step": tokens, "step_s": round(t, 3), "tok_s": round(tokens / t, 1),
                     "tflops": round(tflops, 4), "mfu": round(tflops / peak, 3),
                     "data_share": round(statistics.median(data_times) / t, 3)})
    base = rows[0]["tok_s"] if not args.skip_old else None
    print(f"machine: {describe()}, torch {torch.__version__}, {args.threads} threads")
    print(f"model: {mc.name}, {mc.param_count() / 1e6:.1f}M params; matmul peak here: fp32 {peak32:.3f} TFLOP/s"
          + (f", bf16 {peak16:.3f}" if peak16 else " (bf16 is emulated on this CPU)"))
    print(f"{'variant':<10} {'dtype':<5} {'seq':>5} {'tok/step':>8} {'step s':>7} {'tok/s':>8} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'data %':>6} {'vs old':>7}")
    for r in rows:
        rel = f"{r['tok_s'] / base:.2f}x" if base else ""
        print(f"{r['variant']:<10} {r['dtype']:<5} {r['seq']:>5} {r['tokens_per_step']:>8} {r['step_s']:>7.2f} "
              f"{r['tok_s']:>8.0f} {r['tflops']:>8.3f} {r['mfu']:>6.1%} {r['data_share']:>6.1%} {rel:>7}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": describe(), "threads": args.threads, "model": mc.name,
                                        "peak_tflops_fp32": peak32, "peak_tflops_bf16": peak16, "rows": rows},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

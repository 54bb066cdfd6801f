"""Which model size to train: each candidate trained on the same short budget, then held-out loss against compute.

A candidate is a model config, optionally started from a bundle's weights. Each one runs the trainer itself for
`--steps` steps, or for `--minutes` of training (equal compute), of the same training config (same rows, same
tokens per step, same learning-rate shape over `--steps`), then its
loss on the held-out crates is measured at the full context. Printed per candidate: parameters, tokens, training
seconds, tokens/s, held-out next-token loss and perplexity, and held-out FIM loss, under the CPU they ran on (each JSON
row carries it). More tokens through a smaller model often beat a larger, undertrained one; this measures it on the
machine at hand.

    python benchmarks/size_curve.py --data ~/.cache/m31r/data --steps 8 \\
        --candidate mini=configs/model/mini.yaml@release --candidate mini-scratch=configs/model/mini.yaml \\
        --candidate nano=configs/model/nano.yaml
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--train-config", default=str(REPO / "configs/train/mini.yaml"),
                    help="rows, tokens per step and learning rates shared by every candidate")
    ap.add_argument("--candidate", action="append", required=True,
                    help="NAME=MODEL_YAML[@BUNDLE]: a model config, and a bundle to start from")
    ap.add_argument("--steps", type=int, default=8, help="steps per candidate (with --minutes: at most)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="train each candidate this long instead: equal compute, so a smaller model sees more tokens")
    ap.add_argument("--seq", type=int, default=256, help="row length for the whole short run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    candidates = []
    for spec in args.candidate:
        name, eq, rest = spec.partition("=")
        model, _, bundle = rest.partition("@")
        if not eq or not name or not model:
            ap.error(f"--candidate {spec!r}: expected NAME=MODEL_YAML[@BUNDLE]")
        if not Path(model).is_file():
            ap.error(f"--candidate {spec!r}: no model config {model}")
        if bundle and not Path(bundle).is_dir():
            ap.error(f"--candidate {spec!r}: no bundle {bundle}")
        candidates.append((name, model, bundle))
    if len({name for name, _, _ in candidates}) < len(candidates):
        ap.error("--candidate: every NAME must differ (each names its run's folder)")
    if args.steps < 1 or args.seq < 1 or (args.minutes is not None and args.minutes <= 0):
        ap.error("--steps and --seq must be at least 1, and --minutes more than 0")

    from m31r.cpu import describe
    from m31r.train.trainer import train

    base = yaml.safe_load(Path(args.train_config).read_text())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, bundle in candidates:
            cfg = dict(base, model=str(Path(model).resolve()), max_steps=args.steps,
                       warmup_steps=2 if args.minutes else max(1, args.steps // 10), eval_interval=args.steps,
                       ckpt_interval=args.steps,
                       context_schedule=[[0.0, args.seq]], init_from=str(Path(bundle).resolve()) if bundle else None)
            if not bundle:  # from scratch: the learning rate a new run would use, not a continuation's
                cfg["lr"], cfg["min_lr"] = 1.5e-3, 1.5e-4
            path = Path(tmp) / f"{name}.yaml"
            path.write_text(yaml.safe_dump(cfg))
            t0 = time.perf_counter()
            state = train(path, args.data, Path(tmp) / name, device=args.device, max_minutes=args.minutes,
                          log=lambda s: None)
            wall = time.perf_counter() - t0
            from m31r.config import load_config

            mc = load_config(cfg["model"])
            last = state["history"][-1]
            rows.append({"candidate": name, "params_m": round(mc.param_count() / 1e6, 1), "from": bundle or "scratch",
                         "tokens": state["tokens"], "train_s": round(state["seconds"], 1), "wall_s": round(wall, 1),
                         "tok_s": round(state["tokens"] / state["seconds"], 1), "val_next": round(last["val_next"], 4),
                         "val_fim": round(last["val_fim"], 4)})
    machine = describe()  # tokens/s (and so tokens in --minutes) hold on this CPU only
    print(f"machine: {machine}, device {args.device}")
    print(f"{'candidate':<14} {'params':>7} {'from':<10} {'tokens':>8} {'train s':>8} {'tok/s':>7} "
          f"{'val loss':>9} {'val ppl':>8} {'fim loss':>9}")
    for r in rows:
        print(f"{r['candidate']:<14} {r['params_m']:>6.1f}M {r['from']:<10} {r['tokens']:>8} {r['train_s']:>8.0f} "
              f"{r['tok_s']:>7.0f} {r['val_next']:>9.3f} {math.exp(r['val_next']):>8.1f} {r['val_fim']:>9.3f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps([{**r, "machine": machine, "device": args.device} for r in rows], indent=2)
                            + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

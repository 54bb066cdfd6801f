"""Speed benchmark per precision (issue 7): M31R fp32 / bf16 / int8 / int4 beside transformers fp32 / bf16, same run.

One random-init master (the medium shape by default) is written as an fp32 and a bf16 bundle, as int8 and int4
bundles quantized from the fp32 weights (`m31r bundle quantize`), and as HF Llama checkpoints. Each configuration
is measured in its own subprocess, so peak RSS is its own (the weights, the wrappers, the worker process and the
common options are bench_common's, shared with bench_runtime.py):

  load        Engine(path) as the daemon builds it: checksum verification (overlapped) + model build;
              HF: from_pretrained
  prefill     tok/s for one prompt of each length through Engine.prefill (the serving path: chunked so a
              cache hit stays bit-identical); HF one forward pass (logits_to_keep=1)
  decode      ms/token (median over N greedy steps; best of --reps runs) after a short prompt, and a long one
  keystroke   typing at the end of a cached long prompt (last token changed, sometimes one appended):
              the warm prefill that precedes the first new token, median ms, and tokens recomputed
  peak RSS    VmHWM of the worker
  accuracy    against M31R fp32 on the same weights, over 3 prompts each followed by 32 fixed tokens fed one by
              one (teacher forcing): max |logit diff| and top-1 agreement per step; and how many free-running
              greedy steps stay identical

    python benchmarks/bench_speed.py --threads 1 --out bench-results/speed.json
    python benchmarks/bench_speed.py --quick          # short prompts, few steps: a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_common as bc  # noqa: E402

# name → (implementation, bundle/checkpoint, activation dtype). Quantized rows run bf16 activations: the int8/int4
# CPU kernels take bf16 inputs (their fp32-input paths are >10x slower).
CONFIGS = {
    "fp32": ("m31r", "float32", "float32"),
    "bf16": ("m31r", "bfloat16", "bfloat16"),
    "int8": ("m31r", "int8", "bfloat16"),
    "int4": ("m31r", "int4", "bfloat16"),
    "hf-fp32": ("hf", "float32", "float32"),
    "hf-bf16": ("hf", "bfloat16", "bfloat16"),
    "fp16": ("m31r", "float32", "float16"),  # fp32 weights cast at load; for GPUs (--device cuda)
}
DEFAULT_PRECISIONS = {"cpu": ["fp32", "bf16", "int8", "int4", "hf-fp32", "hf-bf16"],
                      "cuda": ["fp32", "bf16", "fp16", "hf-fp32", "hf-bf16"]}  # int8/int4 kernels are CPU-only
N_ACC_PROMPTS, ACC_PROMPT_LEN, ACC_STEPS = 3, 256, 32


def keystrokes(impl: bc.M31R, prompt: list[int], n: int, vocab: int) -> tuple[float, float]:
    """Median ms of the warm prefill per simulated keystroke, and mean tokens recomputed."""
    import torch

    gen = torch.Generator().manual_seed(99)
    ids = list(prompt)
    impl.prefill(ids)
    times, redone = [], []
    for i in range(n):
        new = torch.randint(5, vocab, (2,), generator=gen).tolist()
        ids = ids[:-1] + new[:1] + (new[1:] if i % 3 == 0 else [])  # retokenised word, sometimes one more token
        t0 = time.perf_counter()
        redone.append(impl.warm_prefill(ids))
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times), statistics.mean(redone)


def accuracy_data(impl, prompts: list[list[int]], continuations: list[list[int]]) -> dict:
    """Per prompt: the logits at each step of a fixed continuation fed token by token (teacher forcing: every
    precision sees the same inputs), and the free-running greedy tokens."""
    import torch

    out: dict = {"forced": [], "greedy": []}
    for p, cont in zip(prompts, continuations, strict=True):
        logits, steps = impl.prefill(p), []
        for t in cont:
            steps.append(logits)
            logits = impl.decode(t)
        out["forced"].append(torch.stack(steps).cpu())
        logits, toks = impl.prefill(p), []
        for _ in range(ACC_STEPS):
            toks.append(int(logits.argmax()))
            logits = impl.decode(toks[-1])
        out["greedy"].append(toks)
    return out


def worker(args: argparse.Namespace, spec: dict) -> None:
    import torch

    name, path, work, vocab = spec["name"], spec["path"], Path(spec["work"]), spec["vocab_size"]
    impl_kind, _, dtype = CONFIGS[name]
    impl = (bc.M31R(path, dtype, args.device, chunk_size=args.chunk_size, max_chunk=args.max_chunk,
                    decode_width=args.decode_width)
            if impl_kind == "m31r" else bc.HF(path, dtype, args.device))
    with torch.inference_mode():
        res, prompt, gen = bc.start(impl, args, vocab)
        res["name"] = name
        for n in args.prefill_lengths:
            best = min(bc.timed(impl.prefill, prompt[:n])[1] for _ in range(args.reps))  # least disturbed run
            res[f"prefill_{n}_tok_s"] = n / best
        for key, n in (("short", 32), (f"at_{args.long_context}", args.long_context)):
            if n:  # the best of `reps` medians, as for prefill
                res[f"decode_{key}_ms"] = 1000 * min(statistics.median(bc.decode_run(impl, prompt[:n],
                                                                                      args.decode_tokens)[0])
                                                     for _ in range(args.reps))
        if impl_kind == "m31r" and args.long_context:
            # Start off a chunk boundary, as a real prompt would (one landing on one pays a one-off regrouping).
            res["keystroke_ms"], res["keystroke_tokens"] = keystrokes(impl, prompt[: args.long_context - 20],
                                                                      args.keystrokes, vocab)
        prompts = [torch.randint(5, vocab, (ACC_PROMPT_LEN,), generator=gen).tolist() for _ in range(N_ACC_PROMPTS)]
        conts = [torch.randint(5, vocab, (ACC_STEPS,), generator=gen).tolist() for _ in range(N_ACC_PROMPTS)]
        torch.save(accuracy_data(impl, prompts, conts), work / f"acc-{name}.pt")
    bc.finish(res)


# ------------------------------------------------------------------------------------------------------------
# Driver and report
# ------------------------------------------------------------------------------------------------------------


def accuracy(work: Path, names: list[str]) -> dict[str, dict]:
    import torch

    ref = torch.load(work / "acc-fp32.pt")
    ref_logits = torch.cat(ref["forced"])
    out = {}
    for name in names:
        if name == "fp32":
            continue
        acc = torch.load(work / f"acc-{name}.pt")
        logits = torch.cat(acc["forced"])
        same = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                for a, b in zip(acc["greedy"], ref["greedy"], strict=True)]
        out[name] = {"max_logit_diff": (logits - ref_logits).abs().max().item(),
                     "logit_std": ref_logits.std().item(),
                     "top1_agreement": (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item(),
                     "greedy_identical_steps": same}
    return out


ROWS = [  # (key, label, format)
    ("load_s", "load, daemon path (s)", "{:.2f}"),
    ("verify_s", "  checksum hashing alone (s)", "{:.2f}"),
    ("prefill_{n}_tok_s", "prefill {n} tok (tok/s)", "{:.0f}"),
    ("decode_short_ms", "decode, 32-token ctx (ms/tok)", "{:.1f}"),
    ("decode_at_{long}_ms", "decode at {long} ctx (ms/tok)", "{:.1f}"),
    ("keystroke_ms", "keystroke at {long} ctx (ms)", "{:.0f}"),
    ("keystroke_tokens", "  tokens recomputed (mean)", "{:.1f}"),
    ("peak_rss_mb", "peak RSS (MiB)", "{:.0f}"),
    ("peak_gpu_mb", "peak GPU memory (MiB)", "{:.0f}"),
]


def table(results: dict, args: argparse.Namespace) -> str:
    names = list(results)
    head = f"{'metric':34}" + "".join(f"{n:>10}" for n in names)
    lines = [head, "-" * len(head)]
    for key, label, fmt in ROWS:
        variants = [(key, label)]
        if "{n}" in key:
            variants = [(key.format(n=n), label.format(n=n)) for n in args.prefill_lengths]
        elif "{long}" in key or "{long}" in label:
            if not args.long_context:
                continue
            variants = [(key.format(long=args.long_context), label.format(long=args.long_context))]
        for k, lab in variants:
            cells = [results[n].get(k) for n in names]
            if all(c is None for c in cells):  # e.g. GPU memory on a CPU run
                continue
            lines.append(f"{lab:34}" + "".join(f"{fmt.format(c) if c is not None else '-':>10}" for c in cells))
    return "\n".join(lines)


def main() -> None:
    ap = bc.options(__doc__.split("\n\n")[0], decode_tokens=(8, 64), long_context=(256, 1536), keystrokes=(4, 12))
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precisions", default=None,
                    help=f"comma-separated subset of {', '.join(CONFIGS)} (default: those that run on --device)")
    ap.add_argument("--keystrokes", type=int, default=None, help="simulated keystrokes (default 12; with --quick 4)")
    ap.add_argument("--chunk-size", type=int, default=8, help="M31R cache-reuse granularity (default 8, as the daemon)")
    ap.add_argument("--max-chunk", type=int, default=256, help="M31R largest prefill chunk (default 256)")
    ap.add_argument("--decode-width", type=int, default=1,
                    help="most rows per M31R decode step (default 1: one stream alone, its fastest kernels; the "
                         "daemon allows 8 and runs a lone stream at the narrowest probed width, Engine.decode_widths)")
    args = bc.parse(ap)
    if args.worker:
        return worker(*bc.worker_spec(args.worker))
    if args.keystrokes < 1:
        ap.error(f"--keystrokes must be at least 1, not {args.keystrokes}")

    from m31r.bundle import quantize_bundle
    from m31r.config import load_config

    config = load_config(args.config)
    names = [n for n in args.precisions.split(",") if n] if args.precisions else DEFAULT_PRECISIONS[args.device]
    if unknown := set(names) - set(CONFIGS):
        sys.exit(f"unknown precisions: {', '.join(sorted(unknown))}")
    if args.device == "cuda" and (cpu_only := {"int8", "int4"} & set(names)):
        sys.exit(f"{', '.join(sorted(cpu_only))}: the weight-only kernels run on the CPU only")
    names = ["fp32", *[n for n in names if n != "fp32"]]  # the accuracy reference runs first
    with tempfile.TemporaryDirectory(prefix="m31r-speed-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        for f in work.glob("acc-*.pt"):
            f.unlink()
        t0 = time.perf_counter()
        paths = bc.prepare(args.config, ["float32", "bfloat16"], args.seed, work)
        for q in ("int8", "int4"):
            if q in names and not (work / f"bundle-{q}").exists():
                quantize_bundle(paths["float32"]["m31r"], work / f"bundle-{q}", q)
        print(f"# weights written in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        results: dict[str, dict] = {}
        for name in names:
            impl, weights, _ = CONFIGS[name]
            path = paths[weights][impl] if weights in paths else str(work / f"bundle-{weights}")
            t0 = time.perf_counter()
            results[name] = bc.run_worker(__file__, args, {"name": name, "path": path, "work": str(work),
                                                           "vocab_size": config.vocab_size}, name)
            print(f"# {name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        acc = accuracy(work, names)
    report_machine = bc.machine()
    print(f"{config.name} ({config.param_count() / 1e6:.1f}M params), {args.device}, threads={args.threads}, "
          f"chunk {args.chunk_size}..{args.max_chunk}, decode width {args.decode_width}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(f"CPU: {report_machine['cpu']}")
    print(table(results, args))
    for name, a in acc.items():
        print(f"{name:8} vs m31r fp32: max |logit diff| {a['max_logit_diff']:.3g} (logit std {a['logit_std']:.3g}); "
              f"top-1 agreement {100 * a['top1_agreement']:.1f}% of {N_ACC_PROMPTS * ACC_STEPS} teacher-forced "
              f"steps; greedy identical for {'/'.join(map(str, a['greedy_identical_steps']))} of {ACC_STEPS} steps")
    if args.out:
        bc.write_report(args.out, {
            "config": str(args.config), "model": config.name, "params": config.param_count(), "threads": args.threads,
            "quick": args.quick, "prefill_lengths": args.prefill_lengths, "decode_tokens": args.decode_tokens,
            "long_context": args.long_context, "chunk_size": args.chunk_size, "max_chunk": args.max_chunk,
            "decode_width": args.decode_width, "device": args.device, **report_machine,
            "results": results, "accuracy": acc,
        })


if __name__ == "__main__":
    main()

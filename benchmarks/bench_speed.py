"""Speed benchmark per precision (issue 7): M31R fp32 / bf16 / int8 / int4 beside transformers fp32 / bf16, same run.

One random-init master (the medium shape by default) is written as an fp32 and a bf16 bundle, as int8 and int4
bundles quantized from the fp32 weights (`m31r bundle quantize`), and as HF Llama checkpoints (reusing
bench_runtime's writer). Each configuration is measured in its own subprocess, so peak RSS is its own:

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
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_runtime as rt  # noqa: E402  (the HF wrapper, the weight writer, RSS helpers)

REPO = rt.REPO
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


class Ours:
    def __init__(self, path: str, dtype: str, chunk_size: int, max_chunk: int, decode_width: int, device: str):
        from m31r.bundle import verify_checksums
        from m31r.engine import Engine

        t0 = time.perf_counter()
        self.engine = Engine(path, dtype=dtype, chunk_size=chunk_size, max_chunk=max_chunk, decode_width=decode_width,
                             device=device)
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        verify_checksums(Path(path))
        self.verify_s = time.perf_counter() - t0
        self.cache = None

    def prefill(self, ids: list[int]):
        """A cold prefill into one reused cache slot, as the daemon reuses its slots."""
        if self.cache is None:
            self.cache = self.engine.new_cache()
        self.cache.reset()
        return [x for x in self.engine.prefill(self.cache, ids, 0) if x is not None][-1]

    def warm_prefill(self, ids: list[int]) -> int:
        start = self.engine.reusable(self.cache, ids)
        for _ in self.engine.prefill(self.cache, ids, start):
            pass
        return len(ids) - start

    def decode(self, token: int):
        return self.engine.decode_step(self.cache, token)


def keystrokes(impl: Ours, prompt: list[int], n: int, vocab: int) -> tuple[float, float]:
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


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    spec = json.loads(args.worker)
    name, path, work, vocab = spec["name"], spec["path"], Path(spec["work"]), spec["vocab_size"]
    impl_kind, _, dtype = CONFIGS[name]
    impl = (Ours(path, dtype, args.chunk_size, args.max_chunk, args.decode_width, args.device)
            if impl_kind == "m31r" else rt.HF(path, dtype, args.device))
    res: dict = {"name": name, "threads": torch.get_num_threads(), "load_s": impl.load_s,
                 "verify_s": impl.verify_s, "rss_after_load_mb": rt.rss_mb()}
    gen = torch.Generator().manual_seed(1234)
    longest = max(args.prefill_lengths + [args.long_context])
    prompt = torch.randint(5, vocab, (longest,), generator=gen).tolist()
    with torch.inference_mode():
        impl.prefill(prompt[:64])  # warm-up: allocator, kernels, thread pool
        for t in prompt[64:68]:
            impl.decode(t)
        for n in args.prefill_lengths:
            best = min(rt.timed(impl.prefill, prompt[:n])[1] for _ in range(args.reps))  # least disturbed run
            res[f"prefill_{n}_tok_s"] = n / best
        for key, n in (("short", 32), (f"at_{args.long_context}", args.long_context)):
            if n:  # the best of `reps` medians, as for prefill
                res[f"decode_{key}_ms"] = 1000 * min(statistics.median(rt.decode_run(impl, prompt[:n],
                                                                                      args.decode_tokens)[0])
                                                     for _ in range(args.reps))
        if impl_kind == "m31r" and args.long_context:
            # Start off a chunk boundary, as a real prompt would (one landing on one pays a one-off regrouping).
            res["keystroke_ms"], res["keystroke_tokens"] = keystrokes(impl, prompt[: args.long_context - 20],
                                                                      args.keystrokes, vocab)
        prompts = [torch.randint(5, vocab, (ACC_PROMPT_LEN,), generator=gen).tolist() for _ in range(N_ACC_PROMPTS)]
        conts = [torch.randint(5, vocab, (ACC_STEPS,), generator=gen).tolist() for _ in range(N_ACC_PROMPTS)]
        torch.save(accuracy_data(impl, prompts, conts), work / f"acc-{name}.pt")
    res["peak_rss_mb"] = rt._status_mb("VmHWM")
    if args.device == "cuda":
        res["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(res))


# ------------------------------------------------------------------------------------------------------------
# Driver and report
# ------------------------------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace, spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--threads", str(args.threads),
           "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps), "--keystrokes", str(args.keystrokes),
           "--long-context", str(args.long_context), "--prefill-lengths", ",".join(map(str, args.prefill_lengths)),
           "--chunk-size", str(args.chunk_size), "--max-chunk", str(args.max_chunk),
           "--decode-width", str(args.decode_width), "--device", args.device]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"worker {spec['name']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "model" / "medium.yaml")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--precisions", default=None,
                    help=f"comma-separated subset of {', '.join(CONFIGS)} (default: those that run on --device)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all)")
    ap.add_argument("--quick", action="store_true", help="short prompts and few decode steps: a smoke test")
    ap.add_argument("--prefill-lengths", default=None, help="comma-separated prompt lengths (default 512,1536)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy steps per decode run (default 64)")
    ap.add_argument("--long-context", type=int, default=None, help="long-context decode/keystroke prompt (1536)")
    ap.add_argument("--keystrokes", type=int, default=None, help="simulated keystrokes (default 12)")
    ap.add_argument("--reps", type=int, default=2, help="prefill repetitions; the best is reported (default 2)")
    ap.add_argument("--chunk-size", type=int, default=8, help="M31R cache-reuse granularity (default 8, as the daemon)")
    ap.add_argument("--max-chunk", type=int, default=256, help="M31R largest prefill chunk (default 256)")
    ap.add_argument("--decode-width", type=int, default=1,
                    help="most rows per M31R decode step (default 1: one stream alone, its fastest kernels; the "
                         "daemon allows 8 and runs a lone stream at the narrowest probed width, Engine.decode_widths)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="keep bundles here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prefill_lengths is None:
        args.prefill_lengths = "128,256" if args.quick else "512,1536"
    args.prefill_lengths = [int(n) for n in str(args.prefill_lengths).split(",")]
    if args.decode_tokens is None:
        args.decode_tokens = 8 if args.quick else 64
    if args.long_context is None:
        args.long_context = 256 if args.quick else 1536
    if args.keystrokes is None:
        args.keystrokes = 4 if args.quick else 12
    if args.worker:
        return worker(args)

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
        paths = rt.prepare(args.config, ["float32", "bfloat16"], args.seed, work)
        for q in ("int8", "int4"):
            if q in names and not (work / f"bundle-{q}").exists():
                quantize_bundle(paths["float32"]["m31r"], work / f"bundle-{q}", q)
        print(f"# weights written in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        results: dict[str, dict] = {}
        for name in names:
            impl, weights, _ = CONFIGS[name]
            path = paths[weights][impl] if weights in paths else str(work / f"bundle-{weights}")
            t0 = time.perf_counter()
            results[name] = run_worker(args, {"name": name, "path": path, "work": str(work),
                                              "vocab_size": config.vocab_size})
            print(f"# {name}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        acc = accuracy(work, names)
    print(f"{config.name} ({config.param_count() / 1e6:.1f}M params), {args.device}, threads={args.threads}, "
          f"chunk {args.chunk_size}..{args.max_chunk}, decode width {args.decode_width}, "
          f"load avg {os.getloadavg()[0]:.1f}")
    print(table(results, args))
    for name, a in acc.items():
        print(f"{name:8} vs m31r fp32: max |logit diff| {a['max_logit_diff']:.3g} (logit std {a['logit_std']:.3g}); "
              f"top-1 agreement {100 * a['top1_agreement']:.1f}% of {N_ACC_PROMPTS * ACC_STEPS} teacher-forced "
              f"steps; greedy identical for {'/'.join(map(str, a['greedy_identical_steps']))} of {ACC_STEPS} steps")
    if args.out:
        import torch

        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": str(args.config), "model": config.name, "params": config.param_count(), "threads": args.threads,
            "quick": args.quick, "prefill_lengths": args.prefill_lengths, "decode_tokens": args.decode_tokens,
            "long_context": args.long_context, "chunk_size": args.chunk_size, "max_chunk": args.max_chunk,
            "decode_width": args.decode_width, "device": args.device,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0],
            "date": time.strftime("%Y-%m-%d"), "results": results, "accuracy": acc,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

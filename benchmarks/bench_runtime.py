"""Runtime benchmark: M31R's engine against transformers' LlamaForCausalLM on the same weights, same run.

For each dtype a random-init bundle of the chosen shape (default: the medium production shape) is written,
the same weights are written as a Hugging Face Llama checkpoint (`m31r bundle export-hf`), and each
implementation is measured in its own subprocess so peak RSS is its own:

  load       bundle verification (ours: sha256 of every file) + building the model; HF: from_pretrained
  prefill    tokens/s for one prompt of each length; ours both through Engine.prefill (aligned 32-token
             chunks, the serving path) and as one forward pass; HF as one forward pass (logits_to_keep=1)
  decode     ms/token over N greedy steps after a short prompt, and after a long one
  peak RSS   ru_maxrss of the worker process

Both implementations also report the last-position logits of the first prompt and their greedy tokens, so the
run checks that they computed the same thing (fp32: max |diff| ~1e-4, identical tokens).

    python benchmarks/bench_runtime.py --out bench-results/runtime.json
    python benchmarks/bench_runtime.py --quick        # reduced lengths, for a smoke test
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

REPO = Path(__file__).resolve().parent.parent
IMPLS = ("m31r", "hf")


# ------------------------------------------------------------------------------------------------------------
# Preparing the weights (parent process)
# ------------------------------------------------------------------------------------------------------------


def prepare(config_path: Path, dtypes: list[str], seed: int, work: Path) -> dict[str, dict[str, str]]:
    """Write, per dtype, an M31R bundle and an HF checkpoint holding identical weights."""
    import torch

    from m31r.bundle import init_bundle, load_weights, write_bundle
    from m31r.config import load_config
    from m31r.hf_export import export_hf
    from m31r.tokenizer import build_byte_tokenizer

    config = load_config(config_path)
    tok = build_byte_tokenizer(config.vocab_size)
    t0 = time.perf_counter()
    base = init_bundle(config, work / "bundle-float32", seed=seed, tokenizer=tok, dtype=torch.float32)
    print(f"# random init + write of {config.name} ({config.param_count() / 1e6:.1f}M params): "
          f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    sd = load_weights(base)
    paths = {}
    for name in dtypes:
        dtype = getattr(torch, name)
        bundle_dir = work / f"bundle-{name}"
        if name != "float32":
            write_bundle(bundle_dir, config, sd, tok, dtype=dtype, seed=seed, dataset_version="none (benchmark)")
        hf_dir = export_hf(bundle_dir, work / f"hf-{name}", dtype=name)  # the same weights as a Llama checkpoint
        paths[name] = {"m31r": str(bundle_dir), "hf": str(hf_dir)}
    return paths


# ------------------------------------------------------------------------------------------------------------
# Measuring (worker process: one implementation, one dtype)
# ------------------------------------------------------------------------------------------------------------


class M31R:
    def __init__(self, path: str, dtype: str):
        from m31r.bundle import open_bundle
        from m31r.engine import Engine

        t0 = time.perf_counter()
        bundle = open_bundle(path)
        self.verify_s = time.perf_counter() - t0
        self.engine = Engine(bundle, dtype=dtype)
        self.load_s = time.perf_counter() - t0
        self.cache = None

    def prefill(self, ids: list[int]):
        self.cache = self.engine.new_cache()
        return [x for x in self.engine.prefill(self.cache, ids, 0) if x is not None][-1]

    def prefill_one_shot(self, ids: list[int]):
        import torch

        self.cache = self.engine.new_cache()
        logits = self.engine.model(torch.tensor([ids]), start=0, cache=self.cache, last_only=True)
        self.cache.tokens = list(ids)
        return logits[0, -1].float()

    def decode(self, token: int):
        return self.engine.decode_step(self.cache, token)


class HF:
    def __init__(self, path: str, dtype: str, device: str = "cpu"):
        import torch
        from transformers import LlamaForCausalLM

        t0 = time.perf_counter()
        self.model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.device = device
        self.verify_s = 0.0
        self.load_s = time.perf_counter() - t0
        self.past = None

    def prefill(self, ids: list[int]):
        import torch

        out = self.model(input_ids=torch.tensor([ids], device=self.device), use_cache=True, logits_to_keep=1)
        self.past = out.past_key_values
        return out.logits[0, -1].float()

    prefill_one_shot = prefill

    def decode(self, token: int):
        import torch

        out = self.model(input_ids=torch.tensor([[token]], device=self.device), past_key_values=self.past,
                         use_cache=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float()


def _status_mb(field: str) -> float:
    """A /proc/self/status memory field in MiB. VmHWM, unlike ru_maxrss, is not inherited across fork+exec, so
    the worker reports its own peak and not the parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def rss_mb() -> float:
    return _status_mb("VmRSS")


def timed(fn, *args):
    import torch

    t0 = time.perf_counter()
    out = fn(*args)
    if torch.cuda.is_initialized():  # GPU work is asynchronous: wait for it before reading the clock
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def decode_run(impl, prompt: list[int], steps: int) -> tuple[list[float], list[int]]:
    """Greedy decode `steps` tokens after `prompt`; per-step seconds and the tokens."""
    logits = impl.prefill(prompt)
    times, tokens = [], []
    for _ in range(steps):
        tok = int(logits.argmax())
        tokens.append(tok)
        logits, dt = timed(impl.decode, tok)
        times.append(dt)
    return times, tokens


def worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    spec = json.loads(args.worker)
    impl_name, dtype, path, work = spec["impl"], spec["dtype"], spec["path"], Path(spec["work"])
    impl = (M31R if impl_name == "m31r" else HF)(path, dtype)
    res: dict = {"impl": impl_name, "dtype": dtype, "threads": torch.get_num_threads(),
                 "load_s": impl.load_s, "verify_s": impl.verify_s, "rss_after_load_mb": rss_mb()}
    gen = torch.Generator().manual_seed(1234)
    vocab = spec["vocab_size"]
    longest = max(args.prefill_lengths + [args.long_context])
    prompt = torch.randint(5, vocab, (longest,), generator=gen).tolist()
    with torch.inference_mode():
        # Warm-up: allocator, kernels, thread pool.
        impl.prefill(prompt[:64])
        for t in prompt[64:68]:
            impl.decode(t)
        impl.prefill_one_shot(prompt[:64])
        first_logits = None
        for n in args.prefill_lengths:
            # Best of `reps`: on a shared machine the fastest run is the least disturbed one.
            runs = [timed(impl.prefill, prompt[:n]) for _ in range(args.reps)]
            res[f"prefill_{n}_tok_s"] = n / min(dt for _, dt in runs)
            if first_logits is None:
                first_logits = runs[0][0]
            if impl_name == "m31r":
                best = min(timed(impl.prefill_one_shot, prompt[:n])[1] for _ in range(args.reps))
                res[f"prefill_{n}_one_shot_tok_s"] = n / best
        torch.save(first_logits, work / f"logits-{impl_name}-{dtype}.pt")
        times, tokens = decode_run(impl, prompt[:32], args.decode_tokens)
        res["decode_short_ms"] = 1000 * statistics.mean(times)
        res["decode_short_p50_ms"] = 1000 * statistics.median(times)
        res["decode_tokens"] = tokens
        if args.long_context:
            times, _ = decode_run(impl, prompt[: args.long_context], args.decode_tokens)
            res[f"decode_at_{args.long_context}_ms"] = 1000 * statistics.mean(times)
    res["peak_rss_mb"] = _status_mb("VmHWM")
    print("RESULT " + json.dumps(res))


# ------------------------------------------------------------------------------------------------------------
# Driver and report
# ------------------------------------------------------------------------------------------------------------


def run_worker(args: argparse.Namespace, spec: dict) -> dict:
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--threads", str(args.threads),
           "--decode-tokens", str(args.decode_tokens), "--reps", str(args.reps),
           "--long-context", str(args.long_context), "--prefill-lengths", ",".join(map(str, args.prefill_lengths))]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"worker {spec['impl']}/{spec['dtype']} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


ROWS = [  # (key, label, format, higher is better)
    ("load_s", "load (s, incl. verify)", "{:.2f}", False),
    ("verify_s", "  of which checksum verify (s)", "{:.2f}", None),
    ("prefill_{n}_tok_s", "prefill {n} tok (tok/s)", "{:.0f}", True),
    ("prefill_{n}_one_shot_tok_s", "  m31r {n} as one forward (tok/s)", "{:.0f}", None),
    ("decode_short_ms", "decode, short ctx (ms/tok)", "{:.1f}", False),
    ("decode_short_p50_ms", "  median (ms/tok)", "{:.1f}", False),
    ("decode_at_{long}_ms", "decode at {long} ctx (ms/tok)", "{:.1f}", False),
    ("peak_rss_mb", "peak RSS (MiB)", "{:.0f}", False),
]


def _cell(fmt: str, v: float | None) -> str:
    return fmt.format(v) if v is not None else "-"


def table(results: dict, args: argparse.Namespace) -> str:
    dtypes = list(results)
    head = f"{'metric':36}" + "".join(f"{'m31r ' + d:>16}{'hf ' + d:>16}{'ratio':>8}" for d in dtypes)
    lines = [head, "-" * len(head)]
    keys = []
    for key, label, fmt, better in ROWS:
        if "{n}" in key:
            keys += [(key.format(n=n), label.format(n=n), fmt, better) for n in args.prefill_lengths]
        elif "{long}" in key:
            if args.long_context:
                keys.append((key.format(long=args.long_context), label.format(long=args.long_context), fmt, better))
        else:
            keys.append((key, label, fmt, better))
    for key, label, fmt, better in keys:
        row = f"{label:36}"
        for d in dtypes:
            ours, hf = results[d]["m31r"].get(key), results[d]["hf"].get(key)
            ratio = "-"
            if better is not None and ours and hf:
                ratio = f"{(ours / hf if better else hf / ours):.2f}x"
            row += f"{_cell(fmt, ours):>16}{_cell(fmt, hf):>16}{ratio:>8}"
        lines.append(row)
    lines.append("ratio = how many times better m31r is (>1: m31r faster / smaller).")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "model" / "medium.yaml")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated: float32, bfloat16, float16")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all)")
    ap.add_argument("--quick", action="store_true", help="short prompts and few decode steps: a smoke test")
    ap.add_argument("--prefill-lengths", default=None, help="comma-separated prompt lengths (default 512,1536)")
    ap.add_argument("--decode-tokens", type=int, default=None, help="greedy steps per decode run (default 128)")
    ap.add_argument("--long-context", type=int, default=None,
                    help="also time decode after a prompt this long; 0 = skip (default 1536)")
    ap.add_argument("--reps", type=int, default=2, help="prefill repetitions; the best is reported (default 2)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workdir", type=Path, default=None, help="keep bundles here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.prefill_lengths is None:
        args.prefill_lengths = "128,256" if args.quick else "512,1536"
    args.prefill_lengths = [int(n) for n in str(args.prefill_lengths).split(",")]
    if args.decode_tokens is None:
        args.decode_tokens = 16 if args.quick else 128
    if args.long_context is None:
        args.long_context = 0 if args.quick else 1536
    if args.worker:
        return worker(args)

    from m31r.config import load_config

    config = load_config(args.config)
    dtypes = args.dtypes.split(",")
    with tempfile.TemporaryDirectory(prefix="m31r-bench-") as tmp:
        work = args.workdir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        paths = prepare(args.config, dtypes, args.seed, work)
        results: dict[str, dict[str, dict]] = {}
        for d in dtypes:
            results[d] = {}
            for impl in IMPLS:
                t0 = time.perf_counter()
                results[d][impl] = run_worker(args, {"impl": impl, "dtype": d, "path": paths[d][impl],
                                                     "work": str(work), "vocab_size": config.vocab_size})
                print(f"# {impl} {d}: {time.perf_counter() - t0:.0f}s", file=sys.stderr)
        checks = agreement(work, results)
    print(table(results, args))
    for line in checks:
        print(line)
    if args.out:
        import torch

        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": str(args.config), "model": config.name, "params": config.param_count(),
            "threads": args.threads, "quick": args.quick, "prefill_lengths": args.prefill_lengths,
            "decode_tokens": args.decode_tokens, "long_context": args.long_context,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "results": results,
            "agreement": checks,
        }
        args.out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")


def agreement(work: Path, results: dict) -> list[str]:
    """Did both implementations compute the same model? Logits of the first prompt and greedy tokens."""
    import torch

    out = []
    for d, by_impl in results.items():
        a, b = (torch.load(work / f"logits-{i}-{d}.pt") for i in IMPLS)
        ta, tb = by_impl["m31r"].pop("decode_tokens"), by_impl["hf"].pop("decode_tokens")
        same = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=True)) if x != y), len(ta))
        out.append(f"{d}: max |logit diff| m31r vs hf = {(a - b).abs().max().item():.2e}; "
                   f"greedy tokens identical for {same}/{len(ta)} steps")
    return out


if __name__ == "__main__":
    main()

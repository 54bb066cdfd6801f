"""What the two runtime benchmarks share: bench_runtime.py (M31R beside transformers, per dtype) and bench_speed.py
(per precision, quantized bundles included).

The same weights written as M31R bundles and as Hugging Face Llama checkpoints; one wrapper per implementation, so
both are timed through the same calls; the worker subprocess each configuration is measured in (its peak RSS is
then its own), with the start and end every worker shares; and the options both scripts take.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT_SEED = 1234  # the workers' random prompts: every configuration measures the same tokens
WARM_UP_TOKENS = 64

# ------------------------------------------------------------------------------------------------------------
# Preparing the weights (parent process)
# ------------------------------------------------------------------------------------------------------------


def prepare(config_path: Path, dtypes: list[str], seed: int, work: Path) -> dict[str, dict[str, str]]:
    """Write, per dtype, an M31R bundle and an HF checkpoint holding identical weights: {dtype: {impl: path}}."""
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
# The implementations, behind the same calls (worker process)
# ------------------------------------------------------------------------------------------------------------


class M31R:
    """M31R's engine loaded as the daemon loads it: Engine(path) verifies the checksums while it builds the model
    (load_s); the hashing alone is timed once more after (verify_s). Prefills reuse one cache slot, as the daemon
    reuses its slots. `engine_kw` goes to Engine (chunk sizes, decode width)."""

    def __init__(self, path: str, dtype: str, device: str = "cpu", **engine_kw: Any):
        from m31r.bundle import verify_checksums
        from m31r.engine import Engine

        t0 = time.perf_counter()
        self.engine = Engine(path, dtype=dtype, device=device, **engine_kw)
        self.load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        verify_checksums(Path(path))
        self.verify_s = time.perf_counter() - t0
        self.cache = None

    def prefill(self, ids: list[int]):
        """A cold prefill through Engine.prefill (the serving path); the last position's logits."""
        if self.cache is None:
            self.cache = self.engine.new_cache()
        self.cache.reset()
        return [x for x in self.engine.prefill(self.cache, ids, 0) if x is not None][-1]

    def prefill_one_shot(self, ids: list[int]):
        """The prompt as one forward pass, outside the serving path's chunks."""
        import torch

        self.cache = self.engine.new_cache()
        logits = self.engine.model(torch.tensor([ids], device=self.engine.device), start=0, cache=self.cache,
                                   last_only=True)
        self.cache.tokens = list(ids)
        return logits[0, -1].float()

    def warm_prefill(self, ids: list[int]) -> int:
        """Prefill what the cache cannot reuse of `ids`; how many tokens that was."""
        start = self.engine.reusable(self.cache, ids)
        for _ in self.engine.prefill(self.cache, ids, start):
            pass
        return len(ids) - start

    def decode(self, token: int):
        return self.engine.decode_step(self.cache, token)


class HF:
    """transformers' LlamaForCausalLM on the same weights."""

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


def status_mb(field: str) -> float:
    """A /proc/self/status memory field in MiB. VmHWM, unlike ru_maxrss, is not inherited across fork+exec, so
    the worker reports its own peak and not the parent's."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


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


# ------------------------------------------------------------------------------------------------------------
# Workers: one configuration each, in its own process
# ------------------------------------------------------------------------------------------------------------


def run_worker(script: str, args: argparse.Namespace, spec: dict, label: str) -> dict:
    """Run `script --worker` on one configuration (`spec`, with the parent's settings); its RESULT."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    cmd = [sys.executable, script, "--worker", json.dumps({**spec, "args": settings})]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"worker {label} failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def worker_spec(arg: str) -> tuple[argparse.Namespace, dict]:
    """A worker's settings (the parent's) and its configuration, from its --worker argument; sets torch's threads."""
    import torch

    spec = json.loads(arg)
    args = argparse.Namespace(**spec.pop("args"))
    torch.set_num_threads(args.threads)
    return args, spec


def start(impl, args: argparse.Namespace, vocab: int):
    """What every worker reports first (load times, RSS after load), the random prompt its measurements take
    prefixes of (as long as the longest they need) and the generator that drew it, after a warm-up (allocator,
    kernels, thread pool). Call under torch.inference_mode()."""
    import torch

    res = {"threads": torch.get_num_threads(), "load_s": impl.load_s, "verify_s": impl.verify_s,
           "rss_after_load_mb": status_mb("VmRSS")}
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    longest = max([*args.prefill_lengths, args.long_context, WARM_UP_TOKENS + 4])
    prompt = torch.randint(5, vocab, (longest,), generator=gen).tolist()
    impl.prefill(prompt[:WARM_UP_TOKENS])
    for t in prompt[WARM_UP_TOKENS : WARM_UP_TOKENS + 4]:
        impl.decode(t)
    return res, prompt, gen


def finish(res: dict) -> None:
    """Add the worker's peaks (RSS; GPU memory where it used a GPU) and hand `res` to the parent."""
    import torch

    res["peak_rss_mb"] = status_mb("VmHWM")
    if torch.cuda.is_initialized():
        res["peak_gpu_mb"] = torch.cuda.max_memory_allocated() / 2**20
    print("RESULT " + json.dumps(res))


# ------------------------------------------------------------------------------------------------------------
# Options and the report
# ------------------------------------------------------------------------------------------------------------


def options(description: str, **unset: tuple[Any, Any]) -> argparse.ArgumentParser:
    """A parser with the options both benchmarks take. `unset` maps option names (dest) to their defaults
    (with --quick, without): decode_tokens and long_context, and any the script adds itself; `parse` fills them."""
    unset = {"prefill_lengths": ("128,256", "512,1536"), **unset}

    def default(name: str) -> str:
        quick, full = unset[name]
        return f"(default {full}; with --quick {quick})"

    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "model" / "medium.yaml")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads (default: all)")
    ap.add_argument("--quick", action="store_true", help="short prompts and few decode steps: a smoke test")
    ap.add_argument("--prefill-lengths", default=None,
                    help=f"comma-separated prompt lengths {default('prefill_lengths')}")
    ap.add_argument("--decode-tokens", type=int, default=None,
                    help=f"greedy steps per decode run {default('decode_tokens')}")
    ap.add_argument("--long-context", type=int, default=None,
                    help=f"the long prompt for decode (and keystrokes); 0 = skip {default('long_context')}")
    ap.add_argument("--reps", type=int, default=2, help="repetitions; the best is reported (default 2)")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    ap.add_argument("--workdir", type=Path, default=None, help="keep bundles here (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.set_defaults(unset=unset)
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """The options, with those left unset at their (--quick or full) defaults and the prefill lengths as ints; a
    value no measurement can take is refused here, by name, not as a traceback from a worker."""
    args = ap.parse_args(argv)
    for name, (quick, full) in vars(args).pop("unset").items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:
        args.prefill_lengths = [int(n) for n in str(args.prefill_lengths).split(",")]
    except ValueError:
        ap.error(f"--prefill-lengths: comma-separated token counts, not {args.prefill_lengths!r}")
    if not args.prefill_lengths or min(args.prefill_lengths) < 1:
        ap.error(f"--prefill-lengths: every length must be at least 1, not {args.prefill_lengths}")
    for name in ("threads", "reps", "decode_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.long_context < 0:
        ap.error(f"--long-context must be 0 (skip) or a token count, not {args.long_context}")
    if not args.worker and not args.config.is_file():
        ap.error(f"--config {args.config}: no such file")
    return args


def machine() -> dict:
    """Where the figures were measured, for the JSON report: the CPU with the flags that choose the kernels (figures
    compare only on one machine), not platform.processor(), which on Linux is just "x86_64"."""
    import torch

    from m31r.cpu import describe

    return {"torch": torch.__version__, "cpu": describe(), "arch": platform.machine(),
            "cpu_count": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "date": time.strftime("%Y-%m-%d")}


def write_report(path: Path, report: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")

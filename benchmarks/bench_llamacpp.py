"""`make bench-llamacpp` (issue 18): M31R's decode beside llama.cpp's, same weights, same machine, one run.

1. **Build** llama.cpp's `llama-bench`, `llama-quantize` and `llama-completion` from PyPI's llama-cpp-python source
   distribution (pinned: LLAMA_CPP_PYTHON; it vendors llama.cpp and its convert_hf_to_gguf.py) with cmake and ninja
   for this CPU (GGML_NATIVE), into $XDG_CACHE_HOME/m31r/llamacpp/<version>/ (default ~/.cache/...). A second run
   finds the build there and only asks ninja whether anything is out of date.
2. **Weights**: one random init of the medium shape (`--config`, `--seed`), as M31R bundles (float32, bfloat16, and
   int8/int4 quantized from float32) and, through `m31r bundle export-hf`, as a Llama checkpoint that
   convert_hf_to_gguf.py turns into GGUF f32 and bf16, and llama-quantize into q8_0 and q4_0. Kept beside the
   build, keyed by shape and seed.
3. **Check** that both engines compute the same model: the greedy tokens of f32 llama.cpp (f32 KV cache) and fp32
   M31R (its default KV cache: fp16 under the fp32 kernels) after the same prompt.
4. **Measure** tg64 @ d300 with 2 threads: `llama-bench -t 2 -p 0 -n 64 -d 300` (flash attention off and on, the
   better median kept) against M31R decoding 64 tokens after a 300-token prefill (Engine.decode_step, the
   daemon's path for one stream), per format. Engines and formats alternate, round after round (`--rounds`), on a
   machine other work may share; medians are reported as ms/token, and the JSON keeps every sample.

    python benchmarks/bench_llamacpp.py --out bench-results/llamacpp.json
    python benchmarks/bench_llamacpp.py --quick       # tiny shape, one round: a smoke test of the whole pipeline
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LLAMA_CPP_PYTHON = "0.3.36"  # the PyPI release whose vendored llama.cpp is built
TOOLS = ("llama-bench", "llama-quantize", "llama-completion")
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF")
# --avx2: llama.cpp built as for an AVX2 laptop (no AVX-512, no AVX-VNNI) beside M31R's avx2 family forced
# (M31R_KERNELS=avx2), so an AVX-512 machine measures what most laptops run; a build directory of its own.
AVX2_FLAGS = tuple(f for f in CMAKE_FLAGS if f != "-DGGML_NATIVE=ON") + (
    "-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF", "-DGGML_AVX_VNNI=OFF", "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF")
AVX2_CPU_FLAGS = ("avx2", "fma", "f16c", "bmi2")  # what AVX2_FLAGS compile for, in /proc/cpuinfo spelling


def avx2_refusal(flags: set[str], arch: str) -> str | None:
    """Why --avx2 cannot run on this CPU (its llama.cpp build would die of SIGILL mid-run), or None."""
    if arch not in ("x86_64", "amd64", "i386", "i686"):
        return f"--avx2 builds both engines for x86-64 AVX2 CPUs; this CPU is {arch}: run without --avx2"
    if missing := [f for f in AVX2_CPU_FLAGS if f not in flags]:
        return f"--avx2 needs a CPU with {', '.join(AVX2_CPU_FLAGS)}; this one lacks {', '.join(missing)}"
    return None


# format -> (M31R bundle, M31R activation dtypes, GGUF type). The int8/int4 layers take bf16 inputs whatever the
# activations are; "auto" is the daemon's default for the rest (bf16 where the CPU runs it natively, AVX512-BF16 or
# AMX, else fp32: torch emulates bf16 there). --m31r-dtypes tries others and keeps the fastest.
FORMATS = {
    "float32": ("float32", ("float32",), "f32"),
    "bf16": ("bfloat16", ("bfloat16",), "bf16"),
    "int8": ("int8", ("auto",), "q8_0"),
    "int4": ("int4", ("auto",), "q4_0"),
}
CHECK_PROMPT = "fn main() {\n    let mut total = 0;\n    for i in 0..10 {"  # llama-completion -f drops a final newline
CHECK_TOKENS = 24


def log(msg: str) -> None:
    print(f"# {msg}", file=sys.stderr, flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    """A command that must succeed; its output is shown only when it fails."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if proc.returncode:
        sys.exit(f"failed ({proc.returncode}): {' '.join(map(str, cmd))}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    return proc


# ------------------------------------------------------------------------------------------------------------
# 1. Building llama.cpp
# ------------------------------------------------------------------------------------------------------------


def cache_root(version: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "m31r" / "llamacpp" / version


def fetch_source(root: Path, version: str) -> Path:
    """The sdist's tree under root/src (downloaded and unpacked once)."""
    src = root / "src"
    if (src / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    sdist = root / f"llama_cpp_python-{version}.tar.gz"
    if not sdist.is_file():
        log(f"downloading the llama-cpp-python {version} source distribution")
        run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "-d", root,
             f"llama-cpp-python=={version}"])
    with tempfile.TemporaryDirectory(dir=root) as tmp, tarfile.open(sdist) as tar:
        tar.extractall(tmp, filter="data")
        (Path(tmp) / f"llama_cpp_python-{version}").rename(src)
    return src


def build_tool(name: str) -> str:
    """cmake or ninja: the system's, else installed into this venv from PyPI."""
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found:
        return found
    log(f"{name} not found: pip install {name}")
    run([sys.executable, "-m", "pip", "install", "-q", name])
    return str(Path(sys.executable).parent / name)


def converter_requirements() -> None:
    """What convert_hf_to_gguf.py imports beyond our own dependencies (it tries a SentencePiece vocab first)."""
    import importlib.util

    missing = [m for m in ("sentencepiece",) if importlib.util.find_spec(m) is None]
    if missing:
        log(f"pip install {' '.join(missing)} (for convert_hf_to_gguf.py)")
        run([sys.executable, "-m", "pip", "install", "-q", *missing])


def build(root: Path, src: Path, jobs: int, avx2: bool = False) -> dict[str, Path]:
    """Configure once, then let ninja bring the tools up to date (a no-op once built)."""
    out = root / ("build-avx2" if avx2 else "build")
    if not (out / "CMakeCache.txt").is_file():
        log("configuring llama.cpp (" + ("AVX2, FMA, F16C only" if avx2 else "GGML_NATIVE: this CPU's instruction set")
            + ")")
        run([build_tool("cmake"), "-S", src / "vendor" / "llama.cpp", "-B", out, "-G", "Ninja",
             f"-DCMAKE_MAKE_PROGRAM={build_tool('ninja')}", *(AVX2_FLAGS if avx2 else CMAKE_FLAGS)])
    bins = {t: out / "bin" / t for t in TOOLS}
    if not all(p.is_file() for p in bins.values()):
        log(f"building {', '.join(TOOLS)} with {jobs} jobs (several minutes on 2 cores; cached for the next run)")
    t0 = time.perf_counter()
    run([build_tool("cmake"), "--build", out, "-j", jobs, "--target", *TOOLS])
    log(f"llama.cpp tools ready ({time.perf_counter() - t0:.0f}s)")
    return bins


def llama_version(bins: dict[str, Path]) -> str:
    """`version: N (commit)` as llama-bench reports it."""
    proc = subprocess.run([bins["llama-bench"], "--version"], capture_output=True, text=True)
    text = (proc.stdout + proc.stderr).strip().splitlines()
    return text[0] if text else "unknown"


# ------------------------------------------------------------------------------------------------------------
# 2. The weights, for both engines
# ------------------------------------------------------------------------------------------------------------


def m31r_bundles(config_path: Path, seed: int, work: Path) -> dict[str, Path]:
    """float32 (the master), bfloat16, int8 and int4 bundles of one random init."""
    import torch

    from m31r.bundle import init_bundle, load_weights, open_bundle, quantize_bundle, write_bundle
    from m31r.config import load_config
    from m31r.tokenizer import build_byte_tokenizer

    paths = {name: work / f"bundle-{name}" for name in ("float32", "bfloat16", "int8", "int4")}
    if not (paths["float32"] / "checksum.txt").is_file():
        config = load_config(config_path)
        init_bundle(config, paths["float32"], seed=seed, tokenizer=build_byte_tokenizer(config.vocab_size),
                    dtype=torch.float32)
    if not (paths["bfloat16"] / "checksum.txt").is_file():
        base = open_bundle(paths["float32"])
        write_bundle(paths["bfloat16"], base.config, load_weights(base), build_byte_tokenizer(base.config.vocab_size),
                     dtype=torch.bfloat16, seed=seed, dataset_version="none (random init)")
    for q in ("int8", "int4"):
        if not (paths[q] / "checksum.txt").is_file():
            quantize_bundle(paths["float32"], paths[q], q)
    return paths


# convert_hf_to_gguf.py recognises a tokenizer's pre-tokenizer by hashing how it splits a test text, and stops on one
# it does not know. Ours is byte-level BPE: for the byte tokenizer of random-weight bundles, which has no merges,
# every split gives the same tokens (single bytes), so llama.cpp's "default" pre-tokenizer tokenises exactly as we do.
CONVERT_SHIM = """
import os, runpy, sys
script = sys.argv[1]
sys.path[:0] = [os.path.dirname(script), os.path.join(os.path.dirname(script), "gguf-py")]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("m31r: pre-tokenizer unknown to llama.cpp; writing 'default'", file=sys.stderr)
        return "default"
base.TextModel.get_vocab_base_pre = pre
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
"""


def export_for_llamacpp(bundle: Path, out: Path) -> Path:
    """The float32 bundle as an HF Llama checkpoint, plus what llama.cpp's BPE loader insists on: a merges list.
    A tokenizer without merges gets one that can never apply (both sides are a special token, which is split off
    before BPE runs), in merges.txt, where the converter looks when tokenizer.json has none."""
    from m31r.config import load_config
    from m31r.hf_export import export_hf

    if not (out / "model.safetensors").is_file():
        shutil.rmtree(out, ignore_errors=True)
        export_hf(bundle, out, dtype="float32")
    if not json.loads((out / "tokenizer.json").read_text())["model"].get("merges"):
        eos = load_config(bundle / "config.yaml").eos_token
        (out / "merges.txt").write_text(f"#version: 0.2\n{eos} {eos}\n")
    return out


def gguf_files(src: Path, bins: dict[str, Path], hf_dir: Path, work: Path, types: list[str]) -> dict[str, Path]:
    """f32 and bf16 converted from the checkpoint; q8_0 and q4_0 quantized from f32 by llama-quantize."""
    script = src / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
    converter_requirements()
    paths = {t: work / f"model-{t}.gguf" for t in types}
    for t in ("f32", *[t for t in types if t != "f32"]):
        if paths.get(t, work / f"model-{t}.gguf").is_file():
            continue
        tmp = work / f"model-{t}.gguf.part"
        t0 = time.perf_counter()
        if t in ("f32", "bf16"):
            run([sys.executable, "-c", CONVERT_SHIM, script, hf_dir, "--outtype", t, "--outfile", tmp],
                env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"})
        else:
            run([bins["llama-quantize"], work / "model-f32.gguf", tmp, t, str(os.cpu_count() or 1)])
        tmp.rename(work / f"model-{t}.gguf")
        log(f"model-{t}.gguf written ({time.perf_counter() - t0:.0f}s)")
    return paths


# ------------------------------------------------------------------------------------------------------------
# 3 and 4. Running each engine
# ------------------------------------------------------------------------------------------------------------


class M31RWorker:
    """One engine (bundle, activation dtype) in its own process, loaded once and kept for every round: a line of JSON
    in, a line of JSON out. Its own process so each engine's memory and threads are its own."""

    def __init__(self, bundle: Path, dtype: str, threads: int):
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps({"bundle": str(bundle), "dtype": dtype,
                                                               "threads": threads})],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.dtype = self.ask({"op": "ping"})["dtype"]  # "auto" resolved

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            sys.exit(f"M31R worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def worker(spec: dict) -> None:
    """Serve `ask` requests: ping, decode (ms/token per repetition of tg-N @ d-depth), greedy (token ids)."""
    import torch
    from tokenizers import Tokenizer as HFTokenizer

    from m31r.engine import Engine

    engine = Engine(spec["bundle"], dtype=spec["dtype"], threads=spec["threads"], decode_width=1)
    cache = engine.new_cache()
    hf = HFTokenizer.from_file(str(Path(spec["bundle"]) / "tokenizer.json"))

    def prefill(ids: list[int]) -> torch.Tensor:
        cache.reset()
        return [x for x in engine.prefill(cache, ids, 0) if x is not None][-1]

    def decode(req: dict) -> list[float]:
        """llama-bench's tg test: a context of `depth` random tokens (untimed), then `n` single-token decode steps
        of random tokens, timed together."""
        gen = torch.Generator().manual_seed(req["seed"])
        out = []
        for _ in range(req["reps"]):
            prefill(torch.randint(300, engine.config.vocab_size, (req["depth"],), generator=gen).tolist())
            tokens = torch.randint(300, engine.config.vocab_size, (req["n"],), generator=gen).tolist()
            t0 = time.perf_counter()
            for t in tokens:
                engine.decode_step(cache, t)
            out.append(1000 * (time.perf_counter() - t0) / req["n"])
        return out

    def greedy(req: dict) -> list[int]:
        """Argmax over every id (as llama.cpp's greedy sampler does; the engine's own generate() masks unused ids)."""
        logits, toks = prefill(req["ids"]), []
        for _ in range(req["n"]):
            toks.append(int(logits.argmax()))
            logits = engine.decode_step(cache, toks[-1])
        return toks

    with torch.inference_mode():
        for line in sys.stdin:
            req = json.loads(line)
            if req["op"] == "decode":
                res = {"ms": decode(req)}
            elif req["op"] == "greedy":
                ids = greedy(req)
                res = {"ids": ids, "pieces": [rendered(hf, i).hex() for i in ids],
                       "prompt": engine.tokenizer.encode(req["text"]),
                       "kv_cache": engine.kernel_report.get("kv_cache", "?")}
            else:
                res = {"ok": True, "dtype": str(engine.dtype).removeprefix("torch."), "quant": engine.quant}
            print(json.dumps(res), flush=True)


def byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes (GPT-2's bytes_to_unicode, inverted)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


BYTES = byte_decoder()


def rendered(tok, token: int) -> bytes:
    """A token as llama.cpp prints it: a special (control) token as nothing, any other as its bytes."""
    added = tok.get_added_tokens_decoder().get(token)
    if added is not None and added.special:
        return b""
    return bytes(BYTES[c] for c in tok.id_to_token(token))


def llama_bench(bins: dict[str, Path], gguf: Path, threads: int, n: int, depth: int, reps: int) -> dict[str, list]:
    """ms/token per repetition of tg-n @ d-depth, flash attention off and on (one llama-bench run, two tests).

    llama.cpp repacks quantized weights for this CPU's fastest kernels by default. Where that path crashes (0.3.36's
    q8_0 and q4_0 segfault on a 2-core Sapphire Rapids with AMX, 2026-11-26), the run is repeated with
    `--repack 0`, and its variants are named so ("fa-off, repack off")."""
    cmd = [bins["llama-bench"], "-m", gguf, "-t", threads, "-p", 0, "-n", n, "-d", depth, "-fa", "off,on", "-r", reps,
           "-o", "json"]
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    suffix = ""
    if proc.returncode < 0:  # killed by a signal: the repacked kernels crashed on this CPU
        log(f"llama-bench crashed (signal {-proc.returncode}) on {gguf.name} with repacked weights; again with "
            f"--repack 0")
        proc, suffix = run([*cmd, "--repack", 0]), ", repack off"
    elif proc.returncode:
        run(cmd)  # fails again, and says why
    out: dict[str, list] = {}
    for test in json.loads(proc.stdout):
        fa = "fa-on" if test["flash_attn"] in (1, True, "on", "enabled") else "fa-off"
        out[fa + suffix] = [ns / 1e6 / n for ns in test["samples_ns"]]
    return out


PROMPT_LOG = re.compile(r"^\S+ D tokens: \[ (.*?) \]$", re.M | re.S)  # llama-completion -v: the prompt's ids


def llama_greedy(bins: dict[str, Path], gguf: Path, text: str, n: int, threads: int) -> tuple[list[int], bytes]:
    """(prompt ids, the text of n greedy tokens) from llama-completion: f32 KV cache, temperature 0 (argmax)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        cmd = [bins["llama-completion"], "-m", gguf, "-f", f.name, "-n", n, "--temp", 0, "-t", threads, "-ctk", "f32",
               "-ctv", "f32", "-c", 512, "-no-cnv", "--no-warmup", "-v", "--no-display-prompt"]
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, stdin=subprocess.DEVNULL)
    log_text = proc.stderr.decode(errors="replace")
    found = PROMPT_LOG.search(log_text)
    if proc.returncode or not found:
        sys.exit(f"llama-completion failed or logged no prompt tokens:\n{log_text[-3000:]}")
    return [int(i) for i in re.findall(r":(\d+)(?=, '|$)", found.group(1))], proc.stdout


def check_same_model(bins, gguf: Path, m31r: M31RWorker, threads: int) -> dict:
    """Greedy tokens of both engines after the same prompt ids. llama-completion prints its tokens' text, so ours are
    rendered as llama.cpp renders them (bytes; control tokens as nothing) and compared as a prefix of its output."""
    prompt, text = llama_greedy(bins, gguf, CHECK_PROMPT, CHECK_TOKENS, threads)
    ours = m31r.ask({"op": "greedy", "text": CHECK_PROMPT, "ids": prompt, "n": CHECK_TOKENS})
    same, done = 0, b""
    for piece in ours["pieces"]:
        done += bytes.fromhex(piece)
        if not text.startswith(done):
            break
        same += 1
    return {"prompt_tokens_equal": prompt == ours["prompt"], "prompt_tokens": len(prompt),
            "greedy_identical": same, "compared": len(ours["ids"]), "m31r": ours["ids"], "m31r_kv": ours["kv_cache"],
            "llama.cpp_text": text.decode(errors="replace")}


# ------------------------------------------------------------------------------------------------------------
# Driver and report
# ------------------------------------------------------------------------------------------------------------


def median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarise(samples: dict) -> dict:
    """Per format: each variant's median, and the best variant of each engine."""
    rows = {}
    for fmt, engines in samples.items():
        row: dict = {}
        for engine, variants in engines.items():
            meds = {v: median(xs) for v, xs in variants.items() if xs}
            best = min(meds, key=meds.get) if meds else None
            row[engine] = {"medians_ms": meds, "best": best, "ms": meds.get(best)}
        m, ll = row.get("m31r", {}).get("ms"), row.get("llama.cpp", {}).get("ms")
        row["ratio"] = ll / m if m and ll else None  # > 1: M31R is faster
        rows[fmt] = row
    return rows


def table(rows: dict, formats: dict[str, str]) -> str:
    head = f"{'format':18} {'M31R ms/token':>14} {'llama.cpp ms/token':>19} {'ratio':>7}  kept variants"
    lines = [head, "-" * len(head)]
    for fmt, row in rows.items():
        m, ll = row["m31r"], row["llama.cpp"]
        ratio = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
        label = f"{fmt} / {formats[fmt]}"
        lines.append(f"{label:18} {fmt_ms(m['ms']):>14} {fmt_ms(ll['ms']):>19} {ratio:>7}  "
                     f"M31R {m['best']} activations, llama.cpp {ll['best']}")
    return "\n".join(lines)


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "model" / "medium.yaml")
    ap.add_argument("--seed", type=int, default=0, help="init seed of the random weights (both engines)")
    ap.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {', '.join(FORMATS)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", type=int, default=64, help="tokens generated per repetition (tg N)")
    ap.add_argument("--depth", type=int, default=300, help="context before them (@ d DEPTH)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over the formats, engines alternating")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per engine, format and round")
    ap.add_argument("--m31r-dtypes", default=None,
                    help="M31R activation dtypes to try for int8/int4, comma-separated (default auto, the daemon's "
                         "choice; with several the fastest median is kept)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs of the build")
    ap.add_argument("--version", default=LLAMA_CPP_PYTHON, help="llama-cpp-python release to build")
    ap.add_argument("--quick", action="store_true", help="tiny shape, one round, one repetition: a smoke test")
    ap.add_argument("--avx2", action="store_true",
                    help="both engines as on an AVX2-only CPU: llama.cpp built without AVX-512/AVX-VNNI, M31R's avx2 "
                         "family forced (M31R_KERNELS=avx2); formats float32, int8, int4 by default")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(json.loads(args.worker))
    if args.quick:
        args.config, args.rounds, args.reps, args.n, args.depth = REPO / "configs/model/tiny.yaml", 1, 1, 16, 64

    from m31r.config import load_config
    from m31r.cpu import cpu_info, describe

    for name in ("threads", "n", "depth", "rounds", "reps", "jobs"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.avx2:
        _, flags, arch = cpu_info()
        if why := avx2_refusal(flags, arch):
            sys.exit(why)
        os.environ["M31R_KERNELS"] = "avx2"  # the workers inherit it
        if args.formats == ",".join(FORMATS):
            args.formats = "float32,int8,int4"  # bf16 is emulated on such a CPU
    formats = [f for f in args.formats.split(",") if f]
    if unknown := set(formats) - set(FORMATS):
        sys.exit(f"unknown formats: {', '.join(sorted(unknown))}")
    root = cache_root(args.version)
    src = fetch_source(root, args.version)
    bins = build(root, src, args.jobs, args.avx2)
    config = load_config(args.config)
    work = root / "models" / f"{config.name}-{config.config_hash()[:12]}-seed{args.seed}"
    work.mkdir(parents=True, exist_ok=True)
    bundles = m31r_bundles(args.config, args.seed, work)
    hf_dir = export_for_llamacpp(bundles["float32"], work / "hf-float32")
    ggufs = gguf_files(src, bins, hf_dir, work, [FORMATS[f][2] for f in formats])

    quant_dtypes = tuple(args.m31r_dtypes.split(",")) if args.m31r_dtypes else None
    dtypes = {f: (quant_dtypes or FORMATS[f][1]) if FORMATS[f][0] in ("int8", "int4") else FORMATS[f][1]
              for f in formats}
    workers = {(f, d): M31RWorker(bundles[FORMATS[f][0]], d, args.threads) for f in formats for d in dtypes[f]}
    check = check_same_model(bins, ggufs["f32"], workers[("float32", "float32")], args.threads) \
        if "float32" in formats else None
    if check:
        log(f"same model? prompt tokens equal: {check['prompt_tokens_equal']}; greedy tokens identical for "
            f"{check['greedy_identical']} of {check['compared']}")

    samples: dict = {f: {"m31r": {workers[(f, d)].dtype: [] for d in dtypes[f]},
                         "llama.cpp": {}} for f in formats}
    t0 = time.perf_counter()
    for r in range(args.rounds):
        for i, f in enumerate(formats):
            def ours(f=f, r=r) -> None:
                for d in dtypes[f]:
                    samples[f]["m31r"][workers[(f, d)].dtype] += workers[(f, d)].ask(
                        {"op": "decode", "n": args.n, "depth": args.depth, "reps": args.reps, "seed": r})["ms"]

            def theirs(f=f) -> None:
                for fa, ms in llama_bench(bins, ggufs[FORMATS[f][2]], args.threads, args.n, args.depth,
                                          args.reps).items():
                    samples[f]["llama.cpp"].setdefault(fa, []).extend(ms)

            for step in ((ours, theirs) if (r + i) % 2 == 0 else (theirs, ours)):
                step()
            log(f"round {r + 1}/{args.rounds} {f}: " + ", ".join(
                f"{e} {v} {fmt_ms(median(xs))}" for e, vs in samples[f].items() for v, xs in vs.items()))
        if args.out:
            write_json(args, bins, config, formats, samples, check, r + 1)
    for w in workers.values():
        w.close()

    rows = summarise(samples)
    print(f"\ntg{args.n} @ d{args.depth}, {args.threads} threads, {config.name} ({config.param_count() / 1e6:.1f}M "
          f"params, random weights, seed {args.seed}); medians of {args.rounds} rounds x {args.reps} reps, engines "
          f"alternating; {time.perf_counter() - t0:.0f}s; load avg {os.getloadavg()[0]:.1f}")
    print(f"CPU: {describe()}" + ("; AVX2 only: llama.cpp built without AVX-512/AVX-VNNI, M31R_KERNELS=avx2"
                                  if args.avx2 else ""))
    print(f"llama.cpp: llama-cpp-python {args.version} sdist, {llama_version(bins)}; torch {torch_version()}")
    print(table(rows, {f: FORMATS[f][2] for f in formats}))
    if check:
        print(f"same model: prompt tokens {'equal' if check['prompt_tokens_equal'] else 'DIFFER'}, greedy tokens "
              f"identical for {check['greedy_identical']} of {check['compared']} (fp32 / f32; KV cache "
              f"{check['m31r_kv']} / f32)")
    if args.out:
        print(f"wrote {args.out}")


def write_json(args: argparse.Namespace, bins: dict[str, Path], config, formats: list[str], samples: dict,
               check: dict | None, rounds_done: int) -> None:
    """The results so far (rewritten after every round, so an interrupted run still leaves its figures)."""
    from m31r.cpu import describe

    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"date": time.strftime("%Y-%m-%d"), "cpu": describe(), "llama_cpp_python": args.version,
              "llama_cpp": llama_version(bins), "torch": torch_version(), "config": str(args.config),
              "model": config.name, "params": config.param_count(), "seed": args.seed, "threads": args.threads,
              "n": args.n, "depth": args.depth, "rounds": args.rounds, "rounds_done": rounds_done, "reps": args.reps,
              "load_avg_1m": os.getloadavg()[0],
              "cmake_flags": list(AVX2_FLAGS if args.avx2 else CMAKE_FLAGS), "avx2_only": args.avx2,
              "formats": {f: {"m31r_bundle": FORMATS[f][0], "gguf": FORMATS[f][2]} for f in formats},
              "results": summarise(samples), "samples_ms": samples, "same_model": check}
    args.out.write_text(json.dumps(report, indent=2) + "\n")


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    main()

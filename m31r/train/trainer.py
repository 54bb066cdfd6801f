"""Training loop: L = L_next + α·L_fim + β·L_cot (README "The default model"), resumable, deterministic, exported
as a bundle.

Rows are drawn from a RNG seeded by (seed, step), so a resumed run sees exactly the batches an
uninterrupted one would have. What makes a CPU hour count:
  - rows are packed full (windows of the token stream, FIM samples back to back): no padding;
  - activations run in bf16 only where the hardware multiplies bf16 natively (CUDA, AVX512-BF16/AMX);
    elsewhere torch emulates bf16 and fp32 is faster;
  - AdamW runs fused (one kernel over all parameters instead of a loop of small ops per tensor);
  - a context schedule: early steps train on short rows (attention is cheaper and a fixed token budget
    gives more, smaller updates), the last stage on the full context; tokens per step stay constant.
A new run may start from a bundle's weights (`init_from`, e.g. release/) with a fresh optimizer.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import multiprocessing
import multiprocessing.context
import multiprocessing.pool
import os
import random
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

import msgspec
import numpy as np
import torch
import torch.nn.functional as F
import yaml
from tqdm import tqdm

from m31r.bundle import Bundle, open_bundle, sha256_file, write_bundle
from m31r.config import ModelConfig, _one_line, load_config
from m31r.cpu import cpu_info
from m31r.engine import fast_bf16
from m31r.fim import FimBudget
from m31r.model import Transformer, init_weights
from m31r.quant import dequantize_int8
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer
from m31r.train.corpus import unfinished_build
from m31r.train.profile import StepProfile
from m31r.train.samples import COT, FIM, NEXT, Neighbours, lm_row, pack_fim_row, tokenize_documents


class TrainConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str  # path of the model config, relative to the train config's folder
    micro_batch: int = 4
    grad_accum: int = 4
    max_steps: int = 1000
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    fim_rate: float = 0.5  # share of rows made of FIM samples
    block_fim: float = 0.0  # share of FIM samples whose middle is a block body or its tail (samples.block_middle)
    # share of FIM samples led by snippets of other files of their crate (m31r_protocol.context), as the language
    # server sends them
    context_fim: float = 0.0
    alpha: float = 0.3  # weight of L_fim
    beta: float = 0.2  # weight of L_cot
    seed: int = 1234
    eval_interval: int = 100
    ckpt_interval: int = 100
    threads: int = 0  # 0 = torch default
    dtype: str = "auto"  # autocast dtype: auto (bf16 where native, else fp32) | bfloat16 | float32
    # (start as a share of max_steps, row length): from each start on, rows have that many tokens; micro_batch
    # counts rows of the model's max_context, so shorter rows come more per micro-batch (same tokens per step).
    context_schedule: list[tuple[float, int]] = msgspec.field(default_factory=list)
    # A bundle whose weights start a new run, relative to the config's folder. Kept as written (the run's state and a
    # bundle's metadata record it): a path of this machine must not reach a released bundle.
    init_from: str | None = None
    compile: bool = False  # torch.compile the model for training
    data_workers: int = 0  # processes building rows ahead of the model (a GPU outruns one Python process)
    # > 0: the schedule runs on training time instead of steps. The lr decays over this many minutes of training
    # and the run ends when they are spent (max_steps still caps it): for a lent machine whose speed is not known
    # beforehand, so that a run cut by the clock has still finished its decay. Needs no context_schedule.
    minutes: float = 0.0


# Values that load but failed only later: eval_interval 0 after the first step (ZeroDivisionError), micro_batch 0 at the
# first eval, a context_schedule row longer than the model's context at the step its stage begins; grad_accum 0 or
# grad_clip 0 trained nothing, silently.
_AT_LEAST_ONE = ("micro_batch", "grad_accum", "max_steps", "eval_interval", "ckpt_interval")
_NOT_NEGATIVE = ("warmup_steps", "threads", "data_workers", "weight_decay", "alpha", "beta", "min_lr", "minutes")
_POSITIVE = ("lr", "grad_clip")
_SHARES = ("fim_rate", "block_fim", "context_fim")
DTYPES = ("auto", "bfloat16", "bf16", "float32", "fp32")


def config_problems(tc: TrainConfig, max_context: int) -> list[str]:
    """What is wrong with a training config's values, one phrase each (none for a good config)."""
    out = [f"{k} must be >= 1, not {getattr(tc, k)}" for k in _AT_LEAST_ONE if not getattr(tc, k) >= 1]
    out += [f"{k} must be >= 0, not {getattr(tc, k)}" for k in _NOT_NEGATIVE
            if not 0 <= getattr(tc, k) < math.inf]  # (false for nan too)
    out += [f"{k} must be > 0, not {getattr(tc, k)}" for k in _POSITIVE if not 0 < getattr(tc, k) < math.inf]
    out += [f"{k} must be a share in [0, 1], not {getattr(tc, k)}" for k in _SHARES if not 0 <= getattr(tc, k) <= 1]
    if tc.min_lr > tc.lr:
        out.append(f"min_lr {tc.min_lr} is above lr {tc.lr}")
    if tc.dtype not in DTYPES:
        out.append(f"dtype must be auto, bfloat16 or float32, not {tc.dtype!r}")
    for start, length in tc.context_schedule:
        if not 0 <= start <= 1:
            out.append(f"context_schedule stage [{start}, {length}]: start {start} outside [0, 1] (a share of "
                       "max_steps)")
        if not 8 <= length <= max_context:
            out.append(f"context_schedule stage [{start}, {length}]: row length {length} outside [8, {max_context}] "
                       "(the model's max_context)")
    if tc.minutes > 0 and tc.context_schedule:
        out.append("a run scheduled by minutes has no context_schedule (its steps are not known beforehand)")
    return out


def load_train_config(path: str | Path) -> tuple[TrainConfig, ModelConfig]:
    """A training config and its model's, or a ValueError naming the file and every value that is wrong."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: not valid YAML: {_one_line(e)}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of training config fields, got {type(raw).__name__}")
    try:
        # strict=False: YAML 1.1 reads `lr: 3e-4` (no dot) as a string, which strict conversion refused as one.
        tc = msgspec.convert(raw, TrainConfig, strict=False)
    except msgspec.ValidationError as e:
        raise ValueError(f"{path}: {e}") from None
    mc = load_config((path.parent / tc.model).resolve())
    if problems := config_problems(tc, mc.max_context):
        raise ValueError(f"{path}: {'; '.join(problems)}")
    return tc, mc


def config_init_from(tc: TrainConfig, config_path: str | Path) -> Path | None:
    """Where the config's `init_from` is on this machine (it is written relative to the config's folder)."""
    return None if tc.init_from is None else (Path(config_path).parent / tc.init_from).resolve()


def seq_len_at(step: int, tc: TrainConfig, max_context: int) -> int:
    """Row length at `step` under the context schedule (the full context without one)."""
    seq = max_context
    for start, length in sorted(tc.context_schedule):
        if step >= start * tc.max_steps:
            seq = length
    if not 8 <= seq <= max_context:
        raise ValueError(f"context_schedule row length {seq} outside [8, {max_context}]")
    return seq


def rows_per_micro_batch(tc: TrainConfig, seq: int, max_context: int) -> int:
    return max(1, tc.micro_batch * max_context // seq)


def autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype, or None for plain fp32. auto: bf16 only where the hardware runs it natively."""
    if name == "auto":
        return torch.bfloat16 if fast_bf16(device) else None
    if name in ("bfloat16", "bf16"):
        return torch.bfloat16
    if name in ("float32", "fp32"):
        return None
    raise ValueError(f"dtype must be auto, bfloat16 or float32, got {name!r}")


def device_name(dev: torch.device) -> str:
    """What trained the model, for the bundle's metadata: the GPU's name, or the CPU's and its threads."""
    if dev.type == "cuda":
        return f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}"
    return f"{cpu_info()[0]}, {torch.get_num_threads()} CPU threads, torch {torch.__version__}"


def flops_per_token(mc: ModelConfig, seq: int) -> float:
    """Training FLOPs per token (forward + backward): 6 per weight multiply (the tied head counted as a matmul,
    the embedding lookup not) plus causal attention's score and value products (PaLM's accounting)."""
    matmul_params = mc.param_count() - mc.n_layers * 2 * mc.d_model - mc.d_model  # norm gains do no matmul
    return 6 * matmul_params + 6 * mc.n_layers * mc.d_model * seq


def read_jsonl(path: Path) -> list[str]:
    return [d["text"] for d in read_docs(path)]


def read_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


_TOKENISE_ARGS: tuple[Tokenizer, list[str]] | None = None  # inherited by forked tokenising processes
TOKENISE_CHUNK = 256  # files per task of a tokenising process


def _tokenise_range(bounds: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """The stream of texts[a:b] (each file followed by <|endoftext|>)."""
    tok, texts = _TOKENISE_ARGS
    ids, cats = [], []
    eos, nxt = np.asarray([tok.eos_id], dtype=np.uint16), np.asarray([NEXT], dtype=np.int8)
    for i, c in tokenize_documents(tok, texts[bounds[0] : bounds[1]]):
        ids += (i, eos)
        cats += (c, nxt)
    return np.concatenate(ids), np.concatenate(cats)  # a range is never empty


def _single_threaded_tokeniser() -> None:
    # The processes fill the cores; a tokeniser thread pool in each would only crowd them.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def _leave_signals_to_the_trainer(setup: Callable[[], None] | None) -> None:
    """Ctrl-C (and a SIGTERM or SIGHUP sent to the group) reaches every process of the group: a forked worker it ended
    would never answer, and the trainer would wait for its rows forever instead of saving a checkpoint. The trainer
    ends its workers itself (TrainerPool)."""
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # (`timeout`, systemd: the whole group too)
        signal.signal(signum, signal.SIG_IGN)
    if setup is not None:
        setup()


class _Worker(multiprocessing.context.ForkProcess):
    def terminate(self) -> None:
        # Pool.terminate, and the process's exit, end workers with SIGTERM and then wait for them: these ignore it.
        # (A handler that left on it once the trainer asked could still miss it: one arriving just before the
        # worker blocks on the task queue's lock is handled only when the lock is free, and terminate holds it.)
        self.kill()


class TrainerPool(multiprocessing.pool.Pool):
    """Forked workers that leave Ctrl-C, SIGTERM and SIGHUP sent to the whole group to the trainer, and still end
    when the trainer ends them (terminate, leaving a `with` block, or the process's exit)."""

    def __init__(self, workers: int, setup: Callable[[], None] | None = None):
        super().__init__(workers, _leave_signals_to_the_trainer, (setup,), context=multiprocessing.get_context("fork"))

    @staticmethod
    def Process(ctx: Any, *args: Any, **kwds: Any) -> _Worker:  # noqa: N802 (Pool's own name for it)
        return _Worker(*args, **kwds)


def token_stream(tok: Tokenizer, texts: list[str], cache: Path, workers: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """All files tokenised and concatenated with <|endoftext|>, cached beside the corpus. Forked processes, one per
    core by default, tokenise ranges of files: the tokeniser's own threads speed up only its part (a GPU machine's
    16 cores took 73 s for the grown corpus that way), not the conversion of ids, offsets and categories to arrays."""
    global _TOKENISE_ARGS
    if cache.exists():
        z = np.load(cache)
        return z["ids"], z["cats"]
    if tok.vocab_size > 2**16:
        raise ValueError(f"a vocabulary of {tok.vocab_size} does not fit the uint16 token stream")
    ranges = [(a, min(a + TOKENISE_CHUNK, len(texts))) for a in range(0, len(texts), TOKENISE_CHUNK)]
    # Forked processes where fork is the norm (Linux); elsewhere (macOS) one process, as before.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    workers = min(workers or cores, len(ranges))
    bar = tqdm(total=len(texts), desc=f"tokenising {cache.stem}", unit="file", mininterval=2)
    _TOKENISE_ARGS = (tok, texts)
    pool = None
    try:
        if workers > 1:
            pool = TrainerPool(workers, _single_threaded_tokeniser)
            parts = pool.imap(_tokenise_range, ranges)  # in order: the stream is the same for any number of them
        else:
            parts = map(_tokenise_range, ranges)
        ids, cats = [], []
        for (i, c), (a, b) in zip(parts, ranges, strict=True):
            ids.append(i)
            cats.append(c)
            bar.update(b - a)
    finally:
        _TOKENISE_ARGS = None
        bar.close()
        if pool is not None:
            pool.terminate()
    arr = np.concatenate(ids) if ids else np.zeros(0, np.uint16)
    carr = np.concatenate(cats) if cats else np.zeros(0, np.int8)
    tmp = cache.with_name(cache.stem + ".tmp.npz")
    np.savez(tmp, ids=arr, cats=carr)
    os.replace(tmp, cache)
    split = cache.stem.split("-", 1)[0]
    for old in cache.parent.glob(f"{split}-*.npz"):  # streams of the corpus as it was
        if old != cache and not old.name.endswith(".tmp.npz"):
            old.unlink(missing_ok=True)
    return arr, carr


def stream_cache(data_dir: Path, split: str) -> Path:
    """Where a split's token stream is cached: named for the tokenizer and for the split's file as it is now
    (size, time), so a corpus built again in the same folder is tokenised again, never read stale."""
    tag = sha256_file(data_dir / "tokenizer.json")[:12]
    st = (data_dir / "corpus" / f"{split}.jsonl").stat()
    return data_dir / f"{split}-{tag}-{hashlib.sha256(f'{st.st_size}:{st.st_mtime_ns}'.encode()).hexdigest()[:8]}.npz"


def data_identity(data_dir: Path) -> tuple[str, str]:
    """(sha256 of the tokenizer, the corpus manifest's dataset_version or "unknown") of a data folder."""
    manifest = data_dir / "corpus" / "manifest.json"
    version = json.loads(manifest.read_text()).get("dataset_version") if manifest.exists() else None
    return sha256_file(data_dir / "tokenizer.json"), version or "unknown"


def run_data(state: dict, data_dir: Path, run_dir: Path, log: Callable[[str], None]) -> tuple[str, str]:
    """(tokenizer sha256, dataset_version) a run trained with, from its state. The tokenizer of `data_dir` must be
    that one: weights read through another tokenizer's ids are garbage, so a resume or export with it is refused.
    A run that recorded neither (a checkpoint, or shards, from before they were recorded) takes `data_dir`'s, and
    says so."""
    sha, version = data_identity(data_dir)
    recorded = state.get("tokenizer_sha256")
    if recorded is None:
        log(f"{run_dir} records no tokenizer or dataset version (a run from before they were recorded): taking "
            f"{data_dir}'s (tokenizer sha256 {sha}, dataset {version}) as the run's")
    elif recorded != sha:
        raise ValueError(f"{data_dir / 'tokenizer.json'} (sha256 {sha}) is not the tokenizer {run_dir} trained "
                         f"with (sha256 {recorded}): give the data folder the run trained on")
    return recorded or sha, state.get("dataset_version") or version


def require_data(data_dir: Path) -> None:
    """FileNotFoundError, saying how to make it, unless `data_dir` holds what training reads."""
    missing = [p for p in ("tokenizer.json", "corpus/train.jsonl", "corpus/val.jsonl") if not (data_dir / p).is_file()]
    if missing:
        raise FileNotFoundError(f"{data_dir} is not a training data folder ({', '.join(missing)} missing): build it "
                                f"with `make train-data` (`make train-data DATA={data_dir}` for this folder)")
    if (unfinished := unfinished_build(data_dir / "corpus")) is not None:
        raise ValueError(unfinished)


def corpus_tokens(data_dir: Path) -> dict[str, int]:
    """Tokenise both splits with DATA_DIR/tokenizer.json (cached beside the corpus, as training reads them);
    tokens per split."""
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", DEFAULT_SPECIAL)
    return {s: len(token_stream(tok, [t for t in read_jsonl(data_dir / "corpus" / f"{s}.jsonl") if t],
                                stream_cache(data_dir, s))[0]) for s in ("train", "val")}


# The held-out rows every run is measured on while it trains: drawn with a seed and shares of their own, not the
# run's (until the twenty-ninth session they followed the config's seed, FIM shares and batch, so two runs' logged
# losses did not compare), at the model's full context.
VAL_ROWS, VAL_SEED, VAL_BLOCK_FIM = 16, 0x5EED, 0.25  # half plain rows, half FIM rows (a quarter of them block bodies)


class Data:
    def __init__(self, tok: Tokenizer, data_dir: Path, seq_len: int, fim_rate: float, block_fim: float,
                 context_fim: float = 0.0):
        self.tok, self.seq_len, self.fim_rate, self.block_fim = tok, seq_len, fim_rate, block_fim
        self.context_fim = context_fim
        docs = {s: [d for d in read_docs(data_dir / "corpus" / f"{s}.jsonl") if d["text"]] for s in ("train", "val")}
        self.texts = {s: [d["text"] for d in ds] for s, ds in docs.items()}
        # Files outside any crate (an older corpus) have no neighbours.
        # Snippet headers show a file's path in its crate as the language server does (the corpus's crate_path; a
        # textbook piece's is its file's); an older corpus's are guessed from the corpus path.
        self.neighbours = {s: Neighbours([d["path"].partition("#")[0] for d in ds],
                                         [d.get("crate") or d["path"] for d in ds],
                                         shown=[d.get("crate_path") for d in ds]) for s, ds in docs.items()}
        self.streams = {s: token_stream(tok, self.texts[s], stream_cache(data_dir, s)) for s in self.texts}
        # A split shorter than one row failed in lm_row's randrange ("empty range for randrange()"): the train split at
        # the first step, the validation split only at the first eval, eval_interval steps in and before that step's
        # checkpoint (a corpus built with --val-fraction 0, or one small held-out crate).
        for s, (ids, _) in self.streams.items():
            if len(ids) < seq_len + 2:
                more = "more sources" + (", or with a larger --val-fraction" if s == "val" else "")
                raise ValueError(f"{data_dir / 'corpus' / f'{s}.jsonl'} holds {len(ids)} tokens, fewer than the "
                                 f"{seq_len + 2} one row of the model's max_context needs: build it from {more}")
        self._validation: tuple[torch.Tensor, torch.Tensor] | None = None

    def validation_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """VAL_ROWS rows of the validation split, the same for every run on this corpus and context."""
        if self._validation is None:
            rng, half = random.Random(VAL_SEED), VAL_ROWS // 2
            budget = FimBudget.for_context(self.seq_len)
            rows = [lm_row(*self.streams["val"], rng, self.seq_len) for _ in range(half)]
            rows += [pack_fim_row(self.tok, self.texts["val"], rng, self.seq_len, budget, VAL_BLOCK_FIM)
                     for _ in range(VAL_ROWS - half)]
            self._validation = (torch.from_numpy(np.stack([r for r, _ in rows])),
                                torch.from_numpy(np.stack([c for _, c in rows])))
        return self._validation

    def batch(self, split: str, rng: random.Random, n: int, seq_len: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """n packed rows of seq_len + 1 tokens (the model's context by default); FIM samples are laid out for
        a context of seq_len, as the daemon lays them out for its model's."""
        seq_len = seq_len or self.seq_len
        budget = FimBudget.for_context(seq_len)
        rows, cats = [], []
        for _ in range(n):
            if rng.random() < self.fim_rate:
                r, c = pack_fim_row(self.tok, self.texts[split], rng, seq_len, budget, self.block_fim,
                                    self.neighbours[split], self.context_fim)
            else:
                r, c = lm_row(*self.streams[split], rng, seq_len)
            rows.append(r)
            cats.append(c)
        return torch.from_numpy(np.stack(rows)), torch.from_numpy(np.stack(cats))


def step_batches(data: Data, tc: TrainConfig, max_context: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The micro-batches of one optimizer step: a function of (seed, step) alone, so a resumed run, or one whose
    rows are built in other processes, sees exactly the batches of an uninterrupted one."""
    seq = seq_len_at(step, tc, max_context)
    rng = random.Random(tc.seed * 1_000_003 + step)
    return [data.batch("train", rng, rows_per_micro_batch(tc, seq, max_context), seq) for _ in range(tc.grad_accum)]


_WORKER_ARGS: tuple | None = None  # (data, tc, max_context), inherited by forked workers


def _worker_batches(step: int) -> tuple[list[tuple[np.ndarray, np.ndarray]], float]:
    """A step's rows and the seconds this process took to build them."""
    data, tc, max_context = _WORKER_ARGS
    t0 = time.perf_counter()
    # Narrow dtypes across the process boundary: a step of 262k tokens is 0.8 MB instead of 4 MB.
    rows = [(r.numpy().astype(np.uint16), c.numpy().astype(np.int8))
            for r, c in step_batches(data, tc, max_context, step)]
    return rows, time.perf_counter() - t0


class StepBatches:
    """Each step's micro-batches, built here or, with `tc.data_workers`, by forked processes a few steps ahead.
    `build_s`: the seconds the last step's rows took to build, in whichever process built them (with the step's
    tokens, what one row builder makes a second)."""

    def __init__(self, data: Data, tc: TrainConfig, max_context: int, first: int, stop: int):
        global _WORKER_ARGS
        self.args, self.pool, self.ahead = (data, tc, max_context), None, {}
        self.build_s = 0.0
        self.next, self.stop = first, stop
        if tc.data_workers > 0:
            _WORKER_ARGS = self.args  # the corpus is shared with the workers by fork, not copied through pipes
            self.pool = TrainerPool(tc.data_workers)
            self._fill()

    def _fill(self) -> None:
        while self.next < self.stop and len(self.ahead) < 2 * self.args[1].data_workers:
            self.ahead[self.next] = self.pool.apply_async(_worker_batches, (self.next,))
            self.next += 1

    def get(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.pool is None:
            t0 = time.perf_counter()
            out = step_batches(*self.args, step)
            self.build_s = time.perf_counter() - t0
            return out
        out, self.build_s = self.ahead.pop(step).get()
        self._fill()
        return [(torch.from_numpy(r.astype(np.int64)), torch.from_numpy(c.astype(np.int64))) for r, c in out]

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None


CATEGORIES = (("next", NEXT), ("fim", FIM), ("cot", COT))


def category_counts(batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, int]:
    """Target tokens of each category in a step's micro-batches (the targets' categories are cats[:, 1:])."""
    return {name: sum(int((c[:, 1:] == cat).sum()) for _, c in batches) for name, cat in CATEGORIES}


def loss_terms(model: torch.nn.Module, rows: torch.Tensor, cats: torch.Tensor,
               dtype: torch.dtype | None = torch.bfloat16, counts: dict[str, int] | None = None
               ) -> dict[str, torch.Tensor]:
    """Mean cross-entropy per category; a category absent from the batch contributes zero. With `counts` (the
    step's, category_counts), each is this micro-batch's sum over the step's count instead: the micro-batches' terms
    then add up to the step's own means, whatever rows each micro-batch holds."""
    device = next(model.parameters()).device
    rows, cats = rows.to(device, non_blocking=True), cats.to(device, non_blocking=True)
    x, y, c = rows[:, :-1], rows[:, 1:], cats[:, 1:]
    cast = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
    with cast:
        logits = model(x)
    ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    c = c.reshape(-1)
    out = {}
    for name, cat in CATEGORIES:
        m = c == cat
        out[name] = (ce * m).sum() / (m.sum().clamp(min=1) if counts is None else max(1, counts[name]))
    return out


def accumulate_step(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], tc: TrainConfig,
                    dtype: torch.dtype | None) -> dict[str, float]:
    """Backpropagate one optimizer step's loss, its micro-batches one at a time, and return its terms. Each category's
    mean runs over the whole step's tokens, not each micro-batch's: with a mean per micro-batch a CPU step of 8
    micro-batches of one row weighted each FIM token by 1 / (its own row's middle tokens), so a row of short middles
    (mostly end tokens) counted many times more than a row of long ones, unlike a GPU's 32 rows per micro-batch. The
    gradient of a step is now the same however its rows are split into micro-batches."""
    counts = category_counts(batches)
    parts = {name: 0.0 for name, _ in CATEGORIES}
    for rows, cats in batches:
        terms = loss_terms(model, rows, cats, dtype, counts)
        total_loss(terms, tc).backward()
        for k, v in terms.items():
            parts[k] += float(v.detach())
    return parts


def total_loss(terms: dict[str, torch.Tensor], tc: TrainConfig) -> torch.Tensor:
    return terms["next"] + tc.alpha * terms["fim"] + tc.beta * terms["cot"]


SKIP_LIMIT = 8  # steps in a row with a gradient that is not finite: the run has diverged, and stops


class TrainingDiverged(ValueError):
    """SKIP_LIMIT steps in a row had a gradient that is not finite; the last checkpoint is kept as it was."""


def optimizer_step(model: torch.nn.Module, opt: torch.optim.Optimizer, grad_clip: float) -> float:
    """Clip the step's gradient and apply it; returns its norm. A gradient that is not finite (an overflow, a run
    diverging) is dropped instead: applied, it makes every weight NaN, and the next checkpoint would write those over
    the last good one, losing the run."""
    gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip))
    if math.isfinite(gnorm):
        opt.step()
    opt.zero_grad(set_to_none=True)
    return gnorm


def lr_at(step: int, tc: TrainConfig, seconds: float = 0.0) -> float:
    """Linear warm-up over warmup_steps, then cosine to min_lr over the steps (or, with tc.minutes, the training
    seconds) of the run."""
    if step < tc.warmup_steps:
        return tc.lr * (step + 1) / tc.warmup_steps
    if tc.minutes > 0:
        progress = min(1.0, seconds / (60 * tc.minutes))
    else:
        progress = min(1.0, (step - tc.warmup_steps) / max(1, tc.max_steps - tc.warmup_steps))
    return tc.min_lr + 0.5 * (tc.lr - tc.min_lr) * (1 + math.cos(math.pi * progress))


def rewarm_factor(step: int, state: dict) -> float:
    """The share of the scheduled lr that `step` takes under the run's last re-warm (state["rewarms"]), 1.0 outside
    it. A fresh AdamW's first steps move every weight by about the lr: at a schedule's peak, weights resumed without
    their optimizer state (shards from a GPU call) would take a jolt that undoes part of what they learnt, so the lr
    climbs linearly back to the schedule over the re-warm's steps. Kept in the state, so a resume mid-way goes on
    with the same one."""
    rewarms = state.get("rewarms")
    if not rewarms:
        return 1.0
    start, steps = rewarms[-1]["step"], rewarms[-1]["steps"]
    return (step - start + 1) / steps if start <= step < start + steps else 1.0


def make_optimizer(model: Transformer, tc: TrainConfig, fused: bool = True) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tc.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(0.9, 0.95), eps=1e-8, fused=fused)


def bundle_identity(bundle_dir: str | Path) -> dict:
    """Who a run's first weights came from, never where: a path of this machine must not reach a released bundle."""
    f = Path(bundle_dir) / "metadata.json"
    meta = json.loads(f.read_text()) if f.exists() else {}
    return {"model": f"{meta.get('model_name', '?')}@{meta.get('model_version', '?')}",
            "tokens_seen": meta.get("tokens_seen"), "dataset_version": meta.get("dataset_version")}


def load_weights(model: Transformer, bundle_dir: str | Path) -> None:
    """Start from a bundle's weights (the model config must match the bundle's shape). An int8 bundle starts from
    its dequantized weights: half the bytes of a bf16 one, for a transfer too narrow for the float bundle."""
    from safetensors.torch import load_file

    weights = load_file(str(Path(bundle_dir) / "model.safetensors"))
    for name in [n for n in weights if n.endswith(".weight_int8")]:
        base = name.removesuffix(".weight_int8")
        weights[base + ".weight"] = dequantize_int8(weights.pop(name), weights.pop(base + ".scales"))
    own = model.state_dict()
    if set(weights) != set(own) or any(weights[k].shape != own[k].shape for k in own):
        raise ValueError(f"{bundle_dir}: its weights do not fit this model config (an int4 bundle, or another "
                         f"shape); start from a float or int8 bundle of the same shape")
    model.load_state_dict({k: v.float() for k, v in weights.items()})


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: Data, tc: TrainConfig, dtype: torch.dtype | None = torch.bfloat16
             ) -> dict[str, float]:
    """Each category's mean loss over data.validation_rows, taken in micro-batches of the run's size."""
    model.eval()
    rows, cats = data.validation_rows()
    counts = category_counts([(rows, cats)])
    sums = {name: 0.0 for name, _ in CATEGORIES}
    for i in range(0, len(rows), tc.micro_batch):
        part = slice(i, i + tc.micro_batch)
        for k, v in loss_terms(model, rows[part], cats[part], dtype, counts).items():
            sums[k] += float(v)
    model.train()
    return sums


class _RecordingFile:
    """A file for torch.save that keeps the OSError a write failed with: torch reports a full disk only as its zip
    writer's "unexpected pos" RuntimeError, which says neither what failed nor why."""

    def __init__(self, f: BinaryIO):
        self.f, self.error = f, None

    def write(self, b: bytes) -> int:
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def save_checkpoint(path: Path, model: Transformer, opt: torch.optim.Optimizer, state: dict) -> None:
    write_checkpoint(path, {"model": model.state_dict(), "optimizer": opt.state_dict(), "state": state})


def write_checkpoint(path: Path, saved: dict) -> None:
    """Write the checkpoint beside `path`, fsync it and rename it over `path`: a kill, a full disk or a power cut at
    any moment leaves the previous checkpoint whole. A failed write leaves no partial file taking the disk's space."""
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            sink = _RecordingFile(f)
            try:
                torch.save(saved, sink)
            except RuntimeError as e:
                raise (sink.error or e) from None
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    with contextlib.suppress(OSError):  # the rename itself reaches the disk once the folder is synced
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load_checkpoint(path: Path) -> dict:
    """A run's checkpoint, or a ValueError naming the file and what to do: torch's own errors for a file cut short
    ("failed finding central directory", or an EOFError that the CLI reports only as "Aborted!") name neither."""
    try:
        saved = torch.load(path, weights_only=False, map_location="cpu")
        why = "not a training checkpoint"
    except OSError:
        raise
    except Exception as e:  # a zip archive cut short, an empty file (EOFError), a pickle of something else
        saved, why = None, str(e).split(". ")[0].strip() or type(e).__name__
    if not (isinstance(saved, dict) and {"model", "state"} <= saved.keys() and "step" in saved["state"]):
        raise ValueError(f"{path} cannot be read as a checkpoint ({why}): it was cut short or replaced (training "
                         "writes checkpoints whole); put back a copy of it, or move it away to start the run again")
    return saved


PAUSE_FILE = "PAUSE"


class TrainingStopped(BaseException):
    """A run stopped by a signal, its checkpoint saved. Not an Exception, as KeyboardInterrupt is not: code that
    retries a failed run on any Exception (scripts/device-train.sh) must not train again after a stop."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopRequests:
    """Ctrl-C, SIGTERM (`kill`, `timeout`, a service manager) and SIGHUP (its terminal closed) while a run trains:
    the step in progress finishes and a checkpoint is saved before the run stops, where the default actions lose
    every step since the last checkpoint. A second signal stops at once (the last checkpoint stays). A signal
    ignored when the run started (nohup's SIGHUP) stays ignored."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) is not signal.SIG_IGN:
                self.previous[sig] = signal.signal(sig, self._requested)

    def _requested(self, signum: int, frame: object) -> None:
        if self.signum is not None:
            raise KeyboardInterrupt
        self.signum = signum

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self.previous = {}


class RunWriteError(OSError):
    """The run folder cannot take a checkpoint or a log record (a full disk, a read-only folder)."""


@contextlib.contextmanager
def hold_run(run_dir: Path) -> Iterator[None]:
    """Only one process trains a run folder: two would write the same ckpt.tmp, and one could rename the other's
    half-written file over the checkpoint (a run started again in a second terminal while the first still runs)."""
    import fcntl

    with open(run_dir / "lock", "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            raise BlockingIOError(f"{run_dir} is being trained by another process (pid {pid}): let it finish, or "
                                  f"stop it first (Ctrl-C, or kill -TERM {pid}: it saves a checkpoint and exits)"
                                  ) from None
        f.truncate(0)
        f.write(f"{os.getpid()}\n")
        f.flush()
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def wait_while_paused(run_dir: Path, log: Callable[[str], None], poll: float = 0.5,
                      stop: StopRequests | None = None) -> float:
    """Hold the run between steps while RUN/PAUSE exists; returns the seconds waited.

    For taking benchmark figures beside a long run: unlike SIGSTOP, the wait falls outside any step, so neither
    the step's tokens/s nor a schedule by minutes counts it. A stop request (SIGTERM, Ctrl-C) ends the wait.
    """
    flag = Path(run_dir) / PAUSE_FILE
    if not flag.exists():
        return 0.0
    log(f"paused: {flag} exists; training goes on once it is removed")
    t0 = time.perf_counter()
    while flag.exists() and (stop is None or stop.signum is None):
        time.sleep(poll)
    waited = time.perf_counter() - t0
    log(f"resumed after {waited:.0f} s")
    return waited


def train(config_path: str | Path, data_dir: str | Path, run_dir: str | Path, *, max_minutes: float | None = None,
          max_steps: int | None = None, device: str = "cpu", init_from: str | Path | None = None, log=print,
          profile: tuple[int, int] | None = None) -> dict:
    """Train (or resume) a run; returns its state. Checkpoints land in run_dir/ckpt.pt.

    `max_steps` stops early at that step (the schedule still follows the config's max_steps); `init_from`
    (or the config's) starts a new run from a bundle's weights and is ignored when resuming. `profile` (first, last
    step, as logged) writes a profile of those steps to run_dir/profile.txt (m31r.train.profile).
    """
    tc, mc = load_train_config(config_path)
    data_dir, run_dir = Path(data_dir), Path(run_dir)
    require_data(data_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with hold_run(run_dir):
        return _train(tc, mc, config_path, data_dir, run_dir, max_minutes=max_minutes, max_steps=max_steps,
                      dev=torch.device(device), init_from=init_from, log=log, profile=profile)


def _train(tc: TrainConfig, mc: ModelConfig, config_path: str | Path, data_dir: Path, run_dir: Path, *,
           max_minutes: float | None, max_steps: int | None, dev: torch.device, init_from: str | Path | None,
           log: Callable[[str], None], profile: tuple[int, int] | None = None) -> dict:
    if tc.threads:
        torch.set_num_threads(tc.threads)
    torch.manual_seed(tc.seed)
    cast = autocast_dtype(tc.dtype, dev)
    # The checkpoint first: a resume with another tokenizer is refused before the corpus is tokenised with it.
    ckpt = run_dir / "ckpt.pt"
    tok_sha, version = data_identity(data_dir)
    state = {"step": 0, "tokens": 0, "seconds": 0.0, "history": [], "train_config": msgspec.to_builtins(tc),
             "model_config": mc.to_dict(), "tokenizer_sha256": tok_sha, "dataset_version": version}
    saved = load_checkpoint(ckpt) if ckpt.exists() else None
    if saved is not None:
        state = saved["state"]
        require_same_model(state, mc, ckpt, config_path)
        state["tokenizer_sha256"], state["dataset_version"] = run_data(state, data_dir, run_dir, log)
        if version != (state.get("dataset_changes") or [state])[-1]["dataset_version"]:  # same tokenizer, new corpus
            log(f"{run_dir} trained on {state['dataset_version']}; from step {state['step']} on, on {version}")
            state.setdefault("dataset_changes", []).append({"step": state["step"], "dataset_version": version})
        if (done := nothing_to_train(state, tc, max_steps, run_dir)) is not None:
            log(done)
            return state
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", mc.special_tokens)
    if tok.vocab_size != mc.vocab_size:
        raise ValueError(f"tokenizer has {tok.vocab_size} tokens, model config wants {mc.vocab_size}")
    data = Data(tok, data_dir, mc.max_context, tc.fim_rate, tc.block_fim, tc.context_fim)
    model = Transformer(mc)
    init_weights(model, tc.seed)
    if saved is not None:
        model.load_state_dict(saved["model"])
        log(f"resumed {ckpt} at step {state['step']}")
        old = state["train_config"].get("init_from")
        if old and tc.init_from and Path(old).is_absolute() and Path(old) == config_init_from(tc, config_path):
            state["train_config"]["init_from"] = tc.init_from  # a run from before init_from was kept as written
        record_config_change(state, msgspec.to_builtins(tc))
    elif init_from or tc.init_from:
        source = init_from or config_init_from(tc, config_path)
        load_weights(model, source)
        state["init_from"] = bundle_identity(source)
        log(f"new run from the weights of {source} (fresh optimizer)")
    # Records past the checkpoint (all of them, for a run started again: one killed before its first checkpoint, or
    # device-train's retry without torch.compile) are of steps trained again now, and would be logged twice.
    trim_log(run_dir / "log.jsonl", state["step"])
    model.to(dev)
    opt = make_optimizer(model, tc)
    if saved is not None and saved["optimizer"] is not None:
        # load_state_dict takes the saved groups' settings too: a weight_decay changed in the config (which the state
        # records as followed from this step, record_config_change) was silently left at the run's first value.
        decays = [g["weight_decay"] for g in opt.param_groups]
        opt.load_state_dict(saved["optimizer"])
        for g, wd in zip(opt.param_groups, decays, strict=True):
            g["weight_decay"] = wd
    elif saved is not None:  # weights that came back from a GPU machine without their optimizer state
        at = state["step"]
        if at > 0 and tc.warmup_steps > 0:  # (at step 0 the schedule's own warm-up does it)
            state.setdefault("rewarms", []).append({"step": at, "steps": tc.warmup_steps})
            log(f"the checkpoint has no optimizer state: continuing with a fresh one, its lr warmed up again over "
                f"steps {at + 1} to {at + tc.warmup_steps}")
        else:
            log("the checkpoint has no optimizer state: continuing with a fresh one")
    (run_dir / "train.yaml").write_text(yaml.safe_dump(msgspec.to_builtins(tc)))
    (run_dir / "model.yaml").write_text(mc.to_yaml())
    model.train()
    fwd = torch.compile(model) if tc.compile else model
    where = device_name(dev)
    if where not in state.setdefault("hardware", []):
        state["hardware"].append(where)
    log(f"training on {where} with {'fp32' if cast is None else str(cast).removeprefix('torch.')} activations")
    stop_at = min(tc.max_steps, max_steps or tc.max_steps)
    batches = StepBatches(data, tc, mc.max_context, state["step"], stop_at)
    saved_at = state["step"] if saved is not None else None  # the step of the checkpoint on disk

    def checkpoint() -> None:
        nonlocal saved_at
        try:
            save_checkpoint(ckpt, model, opt, state)
        except OSError as e:
            raise cannot_write(ckpt.with_suffix(".tmp"), e, state["step"], ckpt, saved_at) from None
        saved_at = state["step"]

    t_start = time.time()
    bar = tqdm(total=stop_at, initial=state["step"], desc="train", unit="step", dynamic_ncols=True)
    stop = StopRequests()  # after the row builders' fork: they keep the default actions
    last = out_of_time = False
    # Steps in a row whose gradient was not finite, kept in the state: a run resumed mid-way through such steps (a
    # checkpoint, a stop) stops where an uninterrupted one would, with the same message, not SKIP_LIMIT steps later.
    skipped = state.get("skipped_in_a_row", 0)
    profiler = StepProfile(profile, run_dir / "profile.txt", dev) if profile is not None else None
    try:
        while state["step"] < stop_at:
            step = state["step"]
            t_start += wait_while_paused(run_dir, log, stop=stop)  # a pause counts against no budget
            if stop.signum is not None:
                break
            if profiler is not None:
                profiler.before(step + 1)
            seq = seq_len_at(step, tc, mc.max_context)
            n_rows = rows_per_micro_batch(tc, seq, mc.max_context)
            t0 = time.perf_counter()
            lr = lr_at(step, tc, state["seconds"]) * rewarm_factor(step, state)
            for g in opt.param_groups:
                g["lr"] = lr
            step_rows = batches.get(step)
            waited = time.perf_counter() - t0  # blocked on the row builders: what tells which side limits a GPU run
            parts = accumulate_step(fwd, step_rows, tc, cast)
            gnorm = optimizer_step(model, opt, tc.grad_clip)
            skipped = state["skipped_in_a_row"] = 0 if math.isfinite(gnorm) else skipped + 1
            if skipped >= SKIP_LIMIT:
                kept = f"{ckpt} of step {saved_at} is kept" if saved_at is not None else "it has no checkpoint yet"
                raise TrainingDiverged(f"steps {step + 2 - skipped} to {step + 1} all had a gradient that is not "
                                       f"finite: the run diverged (a lower lr or a longer warm-up may hold it); {kept}")
            if skipped:
                log(f"step {step + 1}: the gradient is not finite ({gnorm}): skipped, the weights are as they were")
            dt = time.perf_counter() - t0
            tokens = tc.grad_accum * n_rows * seq
            state["step"] = step + 1
            state["tokens"] += tokens
            state["seconds"] += dt
            bar.update(1)
            bar.set_postfix(loss=f"{parts['next']:.3f}", fim=f"{parts['fim']:.3f}", lr=f"{lr:.1e}", seq=seq,
                            tok_s=f"{tokens / dt:.0f}")
            record = {"step": step + 1, "lr": lr, "gnorm": gnorm, "seq": seq, "tokens": state["tokens"],
                      "tok_s": round(tokens / dt, 1), "rows_wait_s": round(waited, 4),
                      "rows_build_s": round(batches.build_s, 4),
                      "tflops": round(tokens * flops_per_token(mc, seq) / dt / 1e12, 4),
                      **{f"train_{k}": v for k, v in parts.items()}}
            last = state["step"] == stop_at or (tc.minutes > 0 and state["seconds"] >= 60 * tc.minutes)
            out_of_time = max_minutes is not None and (time.time() - t_start) / 60 > max_minutes
            if state["step"] % tc.eval_interval == 0 or last or out_of_time:
                val = evaluate(model, data, tc, cast)  # eager: a compiled model would recompile for eval mode
                record.update({f"val_{k}": v for k, v in val.items()})
                log(f"step {state['step']}: val next {val['next']:.3f} (ppl {math.exp(val['next']):.1f}) "
                    f"fim {val['fim']:.3f} cot {val['cot']:.3f}")
            state["history"].append(record)
            if profiler is not None:
                profiler.after(state["step"])
            try:
                with open(run_dir / "log.jsonl", "a") as f:
                    f.write(json.dumps(record) + "\n")
            except OSError as e:
                raise cannot_write(run_dir / "log.jsonl", e, state["step"], ckpt, saved_at) from None
            if state["step"] % tc.ckpt_interval == 0 or last or out_of_time:
                checkpoint()
            if out_of_time:
                log(f"stopping at step {state['step']}: time budget of {max_minutes} min spent")
            if last or out_of_time or stop.signum is not None:
                break
        if stop.signum is not None and not (last or out_of_time):
            if saved_at != state["step"]:
                checkpoint()
            raise TrainingStopped(f"stopped by {signal.Signals(stop.signum).name} at step {state['step']}: {ckpt} "
                                  "is saved, and the same command resumes the run from it", stop.signum)
    finally:
        stop.restore()
        batches.close()
        bar.close()
    return state


def nothing_to_train(state: dict, tc: TrainConfig, max_steps: int | None, run_dir: Path) -> str | None:
    """One line saying why a resumed run has nothing left to train, or None. The step loop checks its ends only after
    a step, so a finished run trained one step more each time the same command ran again."""
    at = f"at step {state['step']}"
    if tc.minutes > 0 and state["seconds"] >= 60 * tc.minutes:
        return (f"{run_dir} is finished: its {tc.minutes:g} minutes of training are spent, {at} (raise `minutes` in "
                "the config to train on); nothing to train")
    if state["step"] >= tc.max_steps:
        return f"{run_dir} is finished {at}, the config's max_steps (raise it to train on); nothing to train"
    if max_steps and state["step"] >= max_steps:  # (0: none, as for stop_at)
        return f"{run_dir} is {at}, where --max-steps {max_steps} stops it; nothing to train"
    return None


def cannot_write(path: Path, e: OSError, step: int, ckpt: Path, saved_at: int | None) -> RunWriteError:
    """One line for a run folder that stopped taking writes: what failed, and what is kept to resume from."""
    kept = f"{ckpt} of step {saved_at} is kept" if saved_at is not None else "it has no checkpoint yet"
    return RunWriteError(f"cannot write {path} ({e.strerror or e}): training stopped at step {step}; {kept}. Free "
                         f"some space (or make {path.parent} writable) and run the same command again to resume")


def require_same_model(state: dict, mc: ModelConfig, ckpt: Path, config_path: str | Path) -> None:
    """A resume must build the model the run trained: weights of another shape fail in torch with a long list of
    mismatched tensors, and one of the same shape (another max_context or rope_theta) would train on silently while
    its bundle recorded the run's first config."""
    trained = msgspec.convert(state["model_config"], ModelConfig).to_dict()
    changed = [f"{k} {trained.get(k)!r} -> {v!r}" for k, v in mc.to_dict().items() if trained.get(k) != v]
    if changed:
        raise ValueError(f"{ckpt} is a run of another model than {config_path}'s ({', '.join(changed)}): resume it "
                         "with the config it started with, or give this config a new --run folder")


def trim_log(path: Path, step: int) -> None:
    """Drop the log's records of steps past `step`: a run that stopped after its last checkpoint (a crash, a kill)
    logged steps it trains again when resumed, and would log them twice."""
    if not path.exists():
        return

    def logged(line: str) -> int | None:
        try:
            return json.loads(line).get("step", 0)
        except ValueError:  # blank, or cut short by the crash: it would run into the next record
            return None

    lines = path.read_text().splitlines(keepends=True)
    keep = [line for line in lines if (n := logged(line)) is not None and n <= step and line.endswith("\n")]
    if len(keep) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(keep))
        os.replace(tmp, path)


def record_config_change(state: dict, config: dict) -> None:
    """A resumed run follows its config file as it is now (max_steps raised or lowered to fit a session): the state
    then records that config, and from which step each changed value held, so a bundle's metadata says what ran."""
    before = state["train_config"]
    changed = {k: [before.get(k), v] for k, v in config.items() if before.get(k) != v}
    if changed:
        state.setdefault("config_changes", []).append({"step": state["step"], "changed": changed})
        state["train_config"] = config


def export(run_dir: str | Path, data_dir: str | Path, out: str | Path, *, model_version: str = "0.1.0",
           log: Callable[[str], None] = print) -> Bundle:
    """Write the run's latest checkpoint as a release bundle (16-bit weights), with the tokenizer the run trained with
    (`data_dir`'s must be that one) and its dataset version. `out` is replaced only once the new bundle is whole:
    `make export` writes into release/, and a wrong run or data folder must leave it as it was."""
    run_dir, data_dir, out = Path(run_dir), Path(data_dir), Path(out)
    if not (run_dir / "ckpt.pt").is_file():
        raise FileNotFoundError(f"{run_dir} holds no checkpoint (ckpt.pt): a run writes one as it trains (`m31r train "
                                "model`), and `m31r train import-shards` makes one of a GPU call's shards")
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"{out} is not a folder: a bundle is a folder")
    if out.is_dir() and any(out.iterdir()) and not (out / "metadata.json").is_file():
        raise FileExistsError(f"{out} holds files and is not a bundle (no metadata.json): export into a new folder, "
                              "or into a bundle to replace it (its other files are kept)")
    saved = load_checkpoint(run_dir / "ckpt.pt")
    state = saved["state"]
    # Weights that are not finite (a diverged run, its shards imported) would replace `out` with a bundle that the
    # daemon refuses to load (bundle.load_weights); open_bundle reads no weights, so it would not say.
    bad = [k for k, v in saved["model"].items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"{run_dir / 'ckpt.pt'} holds weights that are not finite ({', '.join(bad[:3])}): the run "
                         f"diverged at step {state['step']} or before; {out} is left as it was")
    _, dataset = run_data(state, data_dir, run_dir, log)
    mc = msgspec.convert(state["model_config"], ModelConfig)
    evals = [h for h in state["history"] if "val_next" in h]
    manifest_path = data_dir / "corpus" / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    if manifest.get("dataset_version", "unknown") != dataset:
        log(f"{data_dir} holds {manifest.get('dataset_version', 'unknown')}, not the run's {dataset}: the bundle's "
            f"metadata gets no package list or held-out crates")
        manifest = {}
    extra = {
        "steps": state["step"],
        "tokens_seen": state["tokens"],
        "train_seconds": round(state["seconds"]),
        "train_config": state["train_config"],
        "train_config_changes": state.get("config_changes", []),
        "dataset_changes": state.get("dataset_changes", []),
        "lr_rewarms": state.get("rewarms", []),
        "init_from": bundle_identity(init) if isinstance(init := state.get("init_from"), str) else init,
        "hardware": "; ".join(state.get("hardware", [])) or f"{os.cpu_count()} CPU threads, torch {torch.__version__}",
        # What the dataset version's hash was made from: every source package with its version, and the crates
        # held out (what an eval on "unseen crates" may draw from).
        "dataset_packages": manifest.get("source_packages", {}),
        "dataset_val_crates": manifest.get("val_crates", []),
    }
    if evals:
        v = evals[-1]
        extra.update({"val_loss_next": round(v["val_next"], 4), "val_perplexity": round(math.exp(v["val_next"]), 3),
                      "val_loss_fim": round(v["val_fim"], 4), "val_loss_cot": round(v["val_cot"], 4)})
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_file(str(data_dir / "tokenizer.json"))
    out = out.resolve() if out.is_symlink() else out  # a link to the bundle: replace the folder it names
    out.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(out, log)
    new = out.with_name(f".{out.name}.new-{os.getpid()}")
    shutil.rmtree(new, ignore_errors=True)
    try:
        write_bundle(new, mc, saved["model"], tok, dtype=torch.bfloat16, seed=state["train_config"]["seed"],
                     dataset_version=dataset, model_version=model_version, extra=extra)
        swap_in(new, out)
    finally:
        shutil.rmtree(new, ignore_errors=True)
    return open_bundle(out)


def _running(pid: int) -> bool:
    if pid == os.getpid():
        return False  # (this process is not writing one already)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def clear_leftovers(out: Path, log: Callable[[str], None] = print) -> None:
    """The folders an export killed outright (SIGKILL, the OOM killer) left beside `out` (`.NAME.new-PID`, a bundle
    half written; `.NAME.old-PID`, the bundle `swap_in` had moved aside): each a full-size bundle, hidden, that nothing
    else removes. An old one goes back to `out` where `out` is missing (killed between swap_in's two renames); the rest
    are removed. Those of a process still running (another export) are left alone."""
    names = {f".{out.name}.{kind}-": kind for kind in ("new", "old")}
    found = []
    for p in out.parent.iterdir():
        for prefix, kind in names.items():
            if p.name.startswith(prefix) and p.name[len(prefix):].isdigit() and p.is_dir() and not p.is_symlink():
                found.append((kind, int(p.name[len(prefix):]), p))
    for kind, pid, p in sorted(found, key=lambda f: f[0] == "new"):  # the old ones first
        if _running(pid):
            continue
        if kind == "old" and not out.exists():
            os.rename(p, out)
            log(f"{out}: put back from {p.name}, where an export that was killed had moved it aside")
        else:
            shutil.rmtree(p)
            log(f"removed {p}, left by an export that was killed")


def swap_in(new: Path, out: Path) -> None:
    """Put the finished folder `new` at `out` by renames. Files of `out` that are not the new folder's (a note kept
    beside a bundle) are copied over first; the old folder stays whole until the new one is in place."""
    if not out.exists():
        os.rename(new, out)
        return
    for entry in out.iterdir():
        if not (new / entry.name).exists():
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, new / entry.name, symlinks=True)
            else:
                shutil.copy2(entry, new / entry.name, follow_symlinks=False)
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.rename(out, old)
    try:
        os.rename(new, out)
    except BaseException:
        os.rename(old, out)
        raise
    shutil.rmtree(old)

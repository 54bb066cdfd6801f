"""Which training files are look-alikes of held-out (validation) files: the one file test of the corpus builder
(which drops them from training) and of benchmarks/eval_leakage.py (which reports what is left).

The split by crate name, with exact and MinHash near-duplicate removal across it, still leaves renamed forks,
partial copies and -sys/wrapper copies of held-out crates in training; a model can answer the eval's tasks on those
files from memory. The test compares every train file with every val file by their token 5-shingles (the corpus's
own tokens, hashed to 64 bits): a train file is a look-alike of a val file when the Jaccard of their shingle sets is
>= JACCARD, or when it holds >= CONTAINMENT of the val file's shingles (a copy inside a larger file). Shingles held
by more than COMMON_FILES train files (licence headers, `fn main() {`) count in neither measure, and val files of
fewer than MIN_SHINGLES other shingles are not judged (too little code to tell a copy from an idiom).

Val is small (a few hundred files), so its shingles go into one sorted index and the train files stream past it
once, each keeping only the val shingles it holds.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from multiprocessing import Pool

import numpy as np
from tqdm import tqdm

from m31r.train.corpus import _SHINGLE_TOKEN_RE, SHINGLE

JACCARD = 0.5
CONTAINMENT = 0.8
COMMON_FILES = 20
MIN_SHINGLES = 50
_P = np.uint64(0x100000001B3)  # odd multiplier of the rolling hash (which wraps mod 2**64)


def _h64(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


class _TokenHashes(dict):
    """A token's 64-bit hash, computed once per distinct token (blake2b per token would dominate the scan)."""

    def __missing__(self, key: str) -> int:
        v = self[key] = _h64(key)
        return v


_TOKENS = _TokenHashes()


def windows(h: np.ndarray, n: int) -> np.ndarray:
    """Rolling hash of every run of `n` consecutive entries of `h` (empty when there are fewer)."""
    if len(h) < n or n < 1:
        return np.empty(0, dtype=np.uint64)
    acc = h[: len(h) - n + 1].copy()
    for k in range(1, n):
        acc = acc * _P + h[k : len(h) - n + 1 + k]
    return acc


def shingle_set(text: str) -> tuple[np.ndarray, str]:
    """(sorted distinct token 5-shingle hashes, digest of the token sequence) of a file."""
    ids = np.fromiter(map(_TOKENS.__getitem__, _SHINGLE_TOKEN_RE.findall(text)), dtype=np.uint64)
    return np.unique(windows(ids, SHINGLE)), hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def forget_tokens() -> None:
    """Free the token hash cache (millions of entries after a whole corpus)."""
    _TOKENS.clear()


class ValIndex:
    """The val files' distinct shingles, sorted, and for each the run of val files (indices) holding it."""

    def __init__(self, shingles: list[np.ndarray]) -> None:
        keys = np.concatenate([*shingles, np.empty(0, dtype=np.uint64)])
        owner = np.concatenate([np.full(len(s), i, dtype=np.int64) for i, s in enumerate(shingles)]
                               + [np.empty(0, dtype=np.int64)])
        order = np.argsort(keys, kind="stable")
        self.owner = owner[order]
        self.keys, starts = np.unique(keys[order], return_index=True)
        self.starts = np.append(starts, len(keys)).astype(np.int64)
        self.key_of_owner = np.repeat(np.arange(len(self.keys)), np.diff(self.starts))
        self.n = len(shingles)

    def hits(self, sh: np.ndarray) -> np.ndarray:
        """Indices (into `keys`) of the shingles of `sh` that some val file holds."""
        if not len(self.keys) or not len(sh):
            return np.empty(0, dtype=np.int32)
        pos = np.minimum(np.searchsorted(self.keys, sh), len(self.keys) - 1)
        return pos[self.keys[pos] == sh].astype(np.int32)

    def overlap(self, hits: np.ndarray) -> np.ndarray:
        """Per val file, how many of these (distinct) keys it holds."""
        lo, size = self.starts[hits], self.starts[hits + 1] - self.starts[hits]
        idx = np.repeat(lo - (np.cumsum(size) - size), size) + np.arange(size.sum())
        return np.bincount(self.owner[idx], minlength=self.n)


@dataclass
class TrainHits:
    """What the file test keeps of each train file: its distinct shingle count and the val shingles it holds."""

    sizes: list[int] = field(default_factory=list)
    hits: list[np.ndarray] = field(default_factory=list)

    def add(self, index: ValIndex, shingles: np.ndarray) -> None:
        self.sizes.append(len(shingles))
        self.hits.append(index.hits(shingles))


class FileTest:
    """The file test over one pass's TrainHits; `alive` (default all) are the train files that count, common
    shingles included, so the test can be taken again on what is left once look-alikes are gone."""

    def __init__(self, index: ValIndex, train: TrainHits, *, jaccard: float = JACCARD,
                 containment: float = CONTAINMENT, common_files: int = COMMON_FILES,
                 min_shingles: int = MIN_SHINGLES, alive: np.ndarray | None = None) -> None:
        self.index, self.train, self.jaccard, self.containment = index, train, jaccard, containment
        live = [h for t, h in enumerate(train.hits) if alive is None or alive[t]]
        df = np.bincount(np.concatenate([*live, np.empty(0, dtype=np.int32)]), minlength=len(index.keys))
        self.rare = df <= common_files
        self.vsize = np.bincount(index.owner[self.rare[index.key_of_owner]], minlength=index.n)
        self.judged = self.vsize >= min_shingles

    def scores(self, t: int) -> tuple[np.ndarray, np.ndarray]:
        """(Jaccard, containment) of train file `t` with each val file, common shingles left out."""
        h = self.train.hits[t]
        r = h[self.rare[h]]
        inter = self.index.overlap(r)
        union = self.vsize + (self.train.sizes[t] - (len(h) - len(r))) - inter
        with np.errstate(divide="ignore", invalid="ignore"):
            return inter / union, inter / self.vsize

    def lookalikes(self, t: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(indices of the judged val files train file `t` is a look-alike of, Jaccard, containment)."""
        jac, con = self.scores(t)
        return np.nonzero(self.judged & ((jac >= self.jaccard) | (con >= self.containment)))[0], jac, con


_INDEX: ValIndex | None = None  # a worker's copy of the val index (_init_worker)


def _init_worker(index: ValIndex | None) -> None:
    global _INDEX
    _INDEX = index


def _train_hits(text: str) -> tuple[int, np.ndarray]:
    """(distinct shingle count, val shingles held) of one train file: the per-file work, run in worker processes."""
    sh = shingle_set(text)[0]
    return len(sh), _INDEX.hits(sh)


def lookalikes_of(val_texts: Iterable[str], train_texts: Sequence[str], workers: int | None = None) -> list[int]:
    """Indices of the train texts that are look-alikes of some val text, sorted.

    Dropping files changes which shingles are common, so the test is taken again on what is left until it finds
    nothing new: the result passes it (benchmarks/eval_leakage.py finds no look-alike in the corpus left).
    """
    index = ValIndex([shingle_set(t)[0] for t in val_texts])
    forget_tokens()
    train = TrainHits()
    workers = workers or os.cpu_count() or 1
    parallel = workers > 1 and len(train_texts) > 256
    with Pool(workers, _init_worker, (index,)) if parallel else nullcontext() as pool:
        if pool is None:
            _init_worker(index)
        results = pool.imap(_train_hits, train_texts, chunksize=64) if pool else map(_train_hits, train_texts)
        for size, hits in tqdm(results, total=len(train_texts), desc="look-alikes", unit="file", mininterval=2,
                               disable=len(train_texts) < 1000):
            train.sizes.append(size)
            train.hits.append(hits)
    _init_worker(None)
    forget_tokens()
    alive = np.ones(len(train.hits), dtype=bool)
    while True:
        test = FileTest(index, train, alive=alive)
        found = [t for t in np.nonzero(alive)[0].tolist() if len(train.hits[t]) and len(test.lookalikes(t)[0])]
        if not found:
            return np.nonzero(~alive)[0].tolist()
        alive[found] = False

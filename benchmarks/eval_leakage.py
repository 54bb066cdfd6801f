"""Is the held-out code of the FIM eval really absent from training? Measured on the corpus, no model run.

`make eval` and `make eval-large` draw their tasks from DATA/corpus/val.jsonl: crates held out of training by name
(m31r.train.corpus). The corpus drops exact duplicates and MinHash near duplicates (estimated Jaccard >= 0.85) in one
pass over both sides before it splits, so a file and its copy never sit on both sides; but crates copy each other's
code with changes, or inside larger files, and those copies stay. This reports what is left:

  files    every val file against every train file, by the corpus's own token 5-shingles (hashed to 64 bits):
           exact duplicates (the same token sequence: whitespace and line ends ignored), near duplicates (Jaccard
           of the shingle sets >= --jaccard) and containers (a train file holding >= --containment of the val
           file's shingles). Shingles in more than --common-files train files (licence headers, `fn main() {`) are
           left out of both measures, and val files of fewer than --min-shingles other shingles are not judged.
           This is the corpus builder's own file test (m31r.train.lookalike, the same defaults): corpora built
           since it drop such train files, so on them this part should find nothing.
  tasks    the exact task lists of `make eval` and `make eval-large` (eval_fim.make_tasks with their counts, seed 0,
           the data's tokenizer (the bundle's where it has none) and eval_fim.py's default budgets): are a task's
           target line(s), with the N lines above them (--context-lines, one probe per N), in a train file, line by
           line with indentation ignored? Such a task can be answered from memory. A probe found in more than
           --common-crates train crates is common text (licence headers, runs of `}`, idioms); in fewer, most likely
           a copy.
  figures  given those evals' results (--results: eval_fim.py --out files of the same tasks), exact match and edit
           similarity on the leaked and the clean tasks apart.

    python benchmarks/eval_leakage.py --data ~/.cache/m31r/data --out bench-results/leakage.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
for _p in (REPO, REPO / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import eval_fim  # noqa: E402 - after the path setup

from m31r.train import lookalike  # noqa: E402
from m31r.train.corpus import SHINGLE  # noqa: E402
from m31r.train.lookalike import FileTest, TrainHits, ValIndex, shingle_set  # noqa: E402

# The Makefile's draws: (single-line, multi-line) tasks, with seed 0 and eval_fim.py's default token budgets.
DRAWS = {"eval": (100, 50), "eval-large": (300, 150)}
SEED = 0
SINGLE_TOKENS, MULTI_TOKENS = 48, 128  # eval_fim.py's --single-tokens and --multi-tokens defaults
_P, _Q = np.uint64(0x100000001B3), 0x9E3779B97F4A7C15  # odd multipliers of the hashes (which wrap mod 2**64)


def stripped_lines(text: str) -> list[str]:
    """Lines as eval_fim.make_tasks counts them (str.splitlines), indentation and trailing space dropped."""
    return [line.strip() for line in text.splitlines()]


def line_hashes(lines: list[str] | tuple[str, ...]) -> np.ndarray:
    """Python's own str hash, ten times blake2b's speed: it differs between processes, but it is compared only
    within this one (and matches are checked line by line)."""
    return np.fromiter(map(hash, lines), dtype=np.int64, count=len(lines)).view(np.uint64)


def line_runs(h: np.ndarray, lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, start, length) of every run of consecutive line hashes `h` of each of `lengths`. A key is the run's
    sum, plus its first hash times one constant and its length times another: cheap to take for many lengths at
    once, and blind to the order of the lines after the first, so a match is checked line by line."""
    c = np.concatenate((np.zeros(1, dtype=np.uint64), np.cumsum(h, dtype=np.uint64)))
    keys, starts, sizes = [], [], []
    for n in lengths:
        if 0 < n <= len(h):
            keys.append(c[n:] - c[:-n] + h[: len(h) - n + 1] * _P + np.uint64(n * _Q % 2**64))
            starts.append(np.arange(len(h) - n + 1))
            sizes.append(np.full(len(h) - n + 1, n))
    if not keys:
        return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64)
    return np.concatenate(keys), np.concatenate(starts), np.concatenate(sizes)


def run_key(lines: tuple[str, ...]) -> int:
    """The key line_runs gives a run of these (stripped) lines."""
    return int(line_runs(line_hashes(lines), [len(lines)])[0][0])


def read_jsonl(path: Path) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


@dataclass
class FileMatch:
    path: str
    crate: str | None
    jaccard: float  # of the two files' shingle sets, common shingles left out
    containment: float  # share of the val file's (uncommon) shingles this train file holds
    exact: bool


@dataclass
class ValFile:
    path: str
    crate: str
    shingles: np.ndarray
    digest: str
    matches: list[FileMatch] = field(default_factory=list)


@dataclass
class Probe:
    """A task's target line(s) and the lines above them, stripped, and the train files holding them."""

    lines: tuple[str, ...]
    hits: dict[str, str | None] = field(default_factory=dict)  # train path -> its crate

    def crates(self) -> set[str]:
        return {c or p for p, c in self.hits.items()}


def task_probe(task: eval_fim.Task, text: str, context_lines: int) -> Probe:
    lines = stripped_lines(text)
    end = task.line + (task.target.count("\n") if task.kind == "multi" else 1)
    return Probe(tuple(lines[max(0, task.line - context_lines) : end]))


@dataclass
class TrainScan:
    """What one pass over train.jsonl keeps: per train file its path, crate and what the file test needs
    (lookalike.TrainHits), and the (val file, train file) pairs of the same token sequence."""

    paths: list[str] = field(default_factory=list)
    crates: list[str | None] = field(default_factory=list)
    train: TrainHits = field(default_factory=TrainHits)
    exact: list[tuple[int, int]] = field(default_factory=list)


def scan_train(train: Path, val: list[ValFile], index: ValIndex, probes: list[Probe],
               log: Callable[[str], None] | None = None) -> TrainScan:
    """Stream train.jsonl once, filling each probe's hits."""
    by_digest: dict[str, list[int]] = {}
    for i, f in enumerate(val):
        by_digest.setdefault(f.digest, []).append(i)
    by_key: dict[int, list[Probe]] = {}
    for p in probes:
        by_key.setdefault(run_key(p.lines), []).append(p)
    table = np.array(sorted(by_key), dtype=np.uint64)
    lengths = sorted({len(p.lines) for p in probes})
    scan, t0 = TrainScan(), time.perf_counter()
    for t, row in enumerate(read_jsonl(train)):
        text, path, crate = row["text"], row["path"], row.get("crate")
        sh, digest = shingle_set(text)
        scan.paths.append(path)
        scan.crates.append(crate)
        scan.train.add(index, sh)
        scan.exact += [(i, t) for i in by_digest.get(digest, ())]
        if probes:
            lines = stripped_lines(text)
            keys, starts, sizes = line_runs(line_hashes(lines), lengths)
            pos = np.minimum(np.searchsorted(table, keys), len(table) - 1)
            for at in np.nonzero(table[pos] == keys)[0].tolist():
                run = tuple(lines[starts[at] : starts[at] + sizes[at]])
                for p in by_key[int(keys[at])]:
                    if run == p.lines:
                        p.hits[path] = crate
        if log and (t + 1) % 10000 == 0:
            log(f"  {t + 1:,} train files, {time.perf_counter() - t0:.0f} s")
    return scan


def match_files(val: list[ValFile], index: ValIndex, scan: TrainScan, *, jaccard: float, containment: float,
                common_files: int, min_shingles: int) -> np.ndarray:
    """Fill each judged val file's matches (the corpus's own file test, lookalike.FileTest); returns the judged
    files' mask. Shingles held by more than `common_files` train files count in neither file."""
    test = FileTest(index, scan.train, jaccard=jaccard, containment=containment, common_files=common_files,
                    min_shingles=min_shingles)
    judged = test.judged
    exact = {pair for pair in scan.exact if judged[pair[0]]}
    for t in range(len(scan.paths)):
        found, jac, con = test.lookalikes(t)
        for i in sorted(set(found.tolist()) | {i for i, tt in exact if tt == t}):
            val[i].matches.append(FileMatch(scan.paths[t], scan.crates[t], round(float(jac[i]), 4),
                                            round(float(con[i]), 4), (i, t) in exact))
    return judged


def draw_tasks(texts: list[tuple[str, str, str]], bundle: Path, data: Path) -> dict[str, list[eval_fim.Task]]:
    """The task lists of `make eval` and `make eval-large`, as eval_fim.py draws them for this bundle on `data`
    (sized by the data's tokenizer where it has one: eval_fim.task_tokenizer)."""
    from m31r.bundle import sha256_file
    from m31r.config import load_config
    from m31r.fim import FimBudget
    from m31r.tokenizer import Tokenizer

    config = load_config(bundle / "config.yaml")
    tok = Tokenizer.from_file(bundle / "tokenizer.json", config.special_tokens, config.vocab_size)
    tok = eval_fim.task_tokenizer(data, tok, sha256_file(bundle / "tokenizer.json"))
    reserve = FimBudget.for_context(config.max_context).reserve
    budgets = min(SINGLE_TOKENS, reserve), min(MULTI_TOKENS, reserve)
    return {name: eval_fim.make_tasks(texts, ns, nm, SEED, tok, *budgets) for name, (ns, nm) in DRAWS.items()}


def same_tasks(results: dict, tasks: list[eval_fim.Task]) -> bool:
    ident = [(r["kind"], r["path"], r["line"], r["target"]) for r in results.get("tasks", [])]
    return ident == [(t.kind, t.path, t.line, t.target) for t in tasks]


def split_figures(results: dict, leaked: list[bool]) -> dict:
    """Exact match and edit similarity per kind on the all, leaked and clean tasks of an eval_fim.py result."""
    out: dict[str, dict] = {}
    for kind in ("single", "multi"):
        rows = [(r, lk) for r, lk in zip(results["tasks"], leaked, strict=True) if r["kind"] == kind]
        for part, keep in (("all", None), ("leaked", True), ("clean", False)):
            rs = [r for r, lk in rows if keep is None or lk == keep]
            out.setdefault(kind, {})[part] = {
                "n": len(rs),
                "exact_match": round(sum(r["exact"] for r in rs) / len(rs), 4) if rs else None,
                "edit_similarity": round(sum(r["edit_similarity"] for r in rs) / len(rs), 4) if rs else None,
            }
    return out


def measure(data: Path, draws: dict[str, list[eval_fim.Task]], *, context_lines: list[int],
            jaccard: float = lookalike.JACCARD, containment: float = lookalike.CONTAINMENT,
            common_files: int = lookalike.COMMON_FILES, min_shingles: int = lookalike.MIN_SHINGLES,
            common_crates: int = 3,
            results: Sequence[Path] = (), log: Callable[[str], None] | None = None) -> dict:
    """The report: leaky val files, the draws' leaked tasks (draw_tasks) and the results of each split by them."""
    texts = eval_fim.val_texts(data)
    val = [ValFile(p, c, *shingle_set(t)) for p, t, c in texts]
    index = ValIndex([f.shingles for f in val])
    text_of = {path: text for path, text, _ in texts}
    probes = {(name, n): [task_probe(t, text_of[t.path], n) for t in tasks]
              for name, tasks in draws.items() for n in context_lines}
    if log:
        log(f"{len(val)} val files, {sum(map(len, draws.values()))} tasks; scanning {data / 'corpus/train.jsonl'}")
    scan = scan_train(data / "corpus" / "train.jsonl", val, index, [q for qs in probes.values() for q in qs], log)
    judged = match_files(val, index, scan, jaccard=jaccard, containment=containment, common_files=common_files,
                         min_shingles=min_shingles)
    leaky = [f for f in val if f.matches]
    kinds = {"exact": [f for f in leaky if any(m.exact for m in f.matches)],
             "near": [f for f in leaky if any(m.jaccard >= jaccard for m in f.matches)],
             "contained": [f for f in leaky if any(m.containment >= containment for m in f.matches)],
             "any": leaky}
    report: dict = {
        "data": str(data),
        "params": {"jaccard": jaccard, "containment": containment, "common_files": common_files,
                   "min_shingles": min_shingles, "context_lines": context_lines, "common_crates": common_crates,
                   "shingle_tokens": SHINGLE, "seed": SEED, "draws": DRAWS},
        "train_files": len(scan.paths),
        "val_files": len(val),
        "val_files_judged": int(judged.sum()),
        "val_crates": len({f.crate for f in val}),
        "files": {k: len(v) for k, v in kinds.items()},
        "crates": {k: sorted({f.crate for f in v}) for k, v in kinds.items()},
        "leaky_files": [{"path": f.path, "crate": f.crate, "shingles": len(f.shingles),
                         "matches": [asdict(m) for m in sorted(f.matches, key=lambda m: -m.jaccard)[:10]]}
                        for f in leaky],
        "draws": {},
    }
    leaky_paths = {f.path for f in leaky}
    crate_of = {p: c for p, _, c in texts}
    loaded = [(f, json.loads(Path(f).read_text())) for f in results]
    for name, tasks in draws.items():
        rows = []
        for k, t in enumerate(tasks):
            row = {"kind": t.kind, "path": t.path, "line": t.line, "crate": crate_of[t.path],
                   "file": t.path in leaky_paths}
            for n in context_lines:
                q = probes[name, n][k]
                row[f"verbatim@{n}"] = bool(q.hits)
                row[f"copied@{n}"] = 0 < len(q.crates()) <= common_crates
                row[f"train_crates@{n}"] = sorted(q.crates())[:5] if len(q.crates()) <= common_crates else len(
                    q.crates())
            rows.append(row)
        criteria = [f"{w}@{n}" for n in context_lines for w in ("verbatim", "copied")] + ["file"]
        draw: dict = {"tasks": len(rows), "leaked": {
            c: {kind: sum(r[c] for r in rows if r["kind"] == kind) for kind in ("single", "multi")}
            for c in criteria}}
        for f, res in loaded:
            if same_tasks(res, tasks):
                draw["results"] = {"file": str(f), "model": res.get("model"),
                                   "split": {c: split_figures(res, [r[c] for r in rows]) for c in criteria}}
        draw["per_task"] = rows
        report["draws"][name] = draw
    return report


def print_report(report: dict) -> None:
    pr = report["params"]
    print(f"\nLeakage of {report['val_files']} val files ({report['val_crates']} crates) into "
          f"{report['train_files']:,} train files ({report['val_files_judged']} val files judged: >= "
          f"{pr['min_shingles']} shingles in at most {pr['common_files']} train files)")
    print(f"{'val files with':<46} {'files':>6} {'crates':>7}")
    for k, label in (("exact", "an exact duplicate (same tokens)"),
                     ("near", f"a near duplicate (Jaccard >= {pr['jaccard']:g})"),
                     ("contained", f"a container (>= {pr['containment']:.0%} of its shingles)"),
                     ("any", "any of these")):
        print(f"{label:<46} {report['files'][k]:>6} {len(report['crates'][k]):>7}")
    for f in report["leaky_files"]:
        m = f["matches"][0]
        more = f" (+{len(f['matches']) - 1} more)" if len(f["matches"]) > 1 else ""
        print(f"  {f['path']} ~ {m['path']} [{m['crate']}] J={m['jaccard']:.2f} C={m['containment']:.2f}{more}")
    for name, d in report["draws"].items():
        print(f"\n{name}: {d['tasks']} tasks; leaked = target and N lines above it in train (copied: in at most "
              f"{pr['common_crates']} train crates), or its file leaky (above)")
        res = d.get("results")
        if res:
            print(f"figures of {res['model']} ({res['file']}): exact match / edit similarity; clean = not leaked")
        print(f"{'criterion':<12} {'single':>6}" + (f" {'all':>14} {'leaked':>14} {'clean':>14}" if res else "")
              + f" {'multi':>6}" + (f" {'all':>14} {'leaked':>14} {'clean':>14}" if res else ""))
        for c, n in d["leaked"].items():
            line = f"{c:<12}"
            for kind in ("single", "multi"):
                line += f" {n[kind]:>6}"
                if res:
                    s = res["split"][c][kind]
                    line += "".join(f" {s[x]['exact_match']:>7.1%} {s[x]['edit_similarity']:.3f}" if s[x]["n"]
                                    else f" {'-':>14}" for x in ("all", "leaked", "clean"))
            print(line)
        if not res:
            print(f"(no saved {name} results of these tasks: no figures)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/train.jsonl and corpus/val.jsonl")
    p.add_argument("--bundle", type=Path, default=REPO / "release", help="the tokenizer and budgets of the task draw")
    p.add_argument("--no-tasks", action="store_true", help="files only: no task draw (needs no bundle)")
    p.add_argument("--results", type=Path, nargs="*", default=None,
                   help="eval_fim.py results to split into leaked and clean tasks (default: bench-results/eval.json "
                        "and bench-results/eval-large.json where they exist)")
    p.add_argument("--jaccard", type=float, default=lookalike.JACCARD,
                   help="near duplicate: shingle-set Jaccard at least this")
    p.add_argument("--containment", type=float, default=lookalike.CONTAINMENT,
                   help="container: a train file holding at least this share of a val file's shingles")
    p.add_argument("--common-files", type=int, default=lookalike.COMMON_FILES,
                   help="shingles in more train files than this are boilerplate, left out of the file measures")
    p.add_argument("--min-shingles", type=int, default=lookalike.MIN_SHINGLES,
                   help="val files with fewer shingles are not judged")
    p.add_argument("--context-lines", type=int, nargs="+", default=[3, 10],
                   help="lines above a task's target in its probes")
    p.add_argument("--common-crates", type=int, default=3,
                   help="a probe found in more train crates than this is common text, not a copy")
    p.add_argument("--out", type=Path, default=None, help="write the full report as JSON here")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = args.results
    if results is None:
        results = [f for f in (REPO / "bench-results" / "eval.json", REPO / "bench-results" / "eval-large.json")
                   if f.is_file()]
    texts = eval_fim.val_texts(args.data)  # says so where val.jsonl is missing
    train = args.data / "corpus" / "train.jsonl"
    if not texts:
        raise SystemExit(f"error: no validation files in {args.data / 'corpus' / 'val.jsonl'}: nothing to measure")
    if not train.is_file():  # said now, not after the task draw as a traceback
        raise SystemExit(f"error: {train} does not exist: build the corpus first, `make train-data` (`make "
                         f"train-data DATA={args.data}` for this folder)")
    t0 = time.perf_counter()
    draws = {} if args.no_tasks else draw_tasks(texts, args.bundle, args.data)
    report = measure(args.data, draws, context_lines=args.context_lines,
                     jaccard=args.jaccard, containment=args.containment, common_files=args.common_files,
                     min_shingles=args.min_shingles, common_crates=args.common_crates, results=results, log=log)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    print_report(report)
    print(f"\n{report['seconds']:.0f} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

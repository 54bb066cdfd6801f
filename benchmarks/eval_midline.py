"""What the editor shows at cursors in the middle of a line with code after them, on the held-out crates.

eval_fim.py's single-line tasks complete a line to its end, so nothing follows their cursor. Here a span of a line
(1-40 characters, neither end inside a word, code that is not only closers and punctuation after it) is taken out,
and the language server's request at its start is answered as the daemon answers it, then gated and post-processed as
the server shows it (eval_fim.editor_request, m31r_lsp.completion.shown_suggestion). A shown suggestion is right when
accepting it gives the original line back; a wrong one is what a user has to undo. Greedy, so the figures of one
bundle, data and seed repeat.

    python benchmarks/eval_midline.py --bundle release --data ~/.cache/m31r/data [--n 400] [--seed 1] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from eval_fim import Task, editor_request, editor_settings, engine_summary, val_texts

MAX_SPAN = 40  # characters taken out of the line
MAX_LINE = 160


def _word(c: str) -> bool:
    return c.isalnum() or c == "_"


def make_tasks(texts: list[tuple[str, str, str]], n: int, seed: int) -> list[Task]:
    """Mid-line spans, a crate drawn first and then one of its files (as eval_fim.make_tasks)."""
    from m31r_protocol.policy import TRAILING_OK

    rng = random.Random(seed)
    by_crate: dict[str, list[tuple[str, str]]] = {}
    for path, text, crate in texts:
        by_crate.setdefault(crate, []).append((path, text))
    crates = sorted(by_crate)
    tasks: list[Task] = []
    tries = 0
    while crates and len(tasks) < n and tries < n * 200:
        tries += 1
        path, text = rng.choice(by_crate[rng.choice(crates)])
        lines = text.splitlines(keepends=True)
        i = rng.randrange(len(lines))
        body = lines[i].rstrip("\r\n")
        if not body.strip() or len(body) > MAX_LINE or body.lstrip().startswith("//"):
            continue
        lo = len(body) - len(body.lstrip())
        a = rng.randrange(lo, len(body))
        b = rng.randrange(a + 1, min(len(body), a + MAX_SPAN) + 1)
        if all(c in TRAILING_OK for c in body[b:]):
            continue  # nothing or only closers after it: the end-of-line case eval_fim.py measures
        if a and _word(body[a - 1]) and _word(body[a]) or _word(body[b - 1]) and _word(body[b]):
            continue  # a cursor or an end inside a word
        off = sum(map(len, lines[:i]))
        tasks.append(Task("midline", path, i, text[: off + a], text[off + b :], body[a:b]))
    return tasks


def run(engine, tasks: list[Task], log) -> list[dict]:
    from m31r.engine import Outcome, line_logprobs
    from m31r.fim import FimBudget
    from m31r_lsp.completion import shown_suggestion

    budget = FimBudget.for_context(engine.config.max_context)
    settings = editor_settings()
    cache = engine.new_cache()
    rows = []
    for k, t in enumerate(tasks):
        req = editor_request(engine, budget, t, settings)  # greedy: the daemon's own width for a line request
        got = Outcome(prompt_tokens=len(req.ids))
        kw = dict(max_tokens=req.max_tokens, cache=cache, result=got, heal=req.heal, stop=req.stop,
                  start_stops=req.start_stops, repeat_context=req.repeat_context)
        for _ in engine.generate(req.ids, min_probability=req.min_probability, **kw):
            pass
        lines = line_logprobs(engine.tokenizer.token_bytes, got.tokens, got.logprobs, got.text.count("\n") + 1,
                              req.heal.count("\n"))
        s, why = shown_suggestion(req.plan, got.text, lines[0] if lines else None, lines, req.min_probability or 0.0,
                                  stop_sequence=got.stop_sequence, finish_reason=got.finish_reason)
        doc = t.prefix + t.suffix
        accepted = None if s is None else doc[: s.start] + s.text + doc[s.end :]
        verdict = why or ("right" if accepted == t.prefix + t.target + t.suffix else "wrong")
        rows.append({"path": t.path, "line": t.line, "target": t.target, "raw": got.text,
                     "shown": None if s is None else s.text, "verdict": verdict})
        if (k + 1) % 50 == 0:
            log(f"  {k + 1}/{len(tasks)} tasks")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None, help="write the summary and every task's row as JSON")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be at least 1")
    from m31r.engine import Engine

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    texts = val_texts(args.data)
    tasks = make_tasks(texts, args.n, args.seed)
    if not tasks:
        raise SystemExit(f"no mid-line spans with code after them in {args.data / 'corpus' / 'val.jsonl'}")
    engine = Engine(args.bundle, dtype=args.dtype)
    log(engine_summary(engine))
    t0 = time.perf_counter()
    rows = run(engine, tasks, log)
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("right", "wrong", "unsure", "empty")}
    shown = counts["right"] + counts["wrong"]
    summary = {"model": engine.bundle.model_id, "tasks": len(rows), "seed": args.seed, **counts,
               "right_of_shown": round(counts["right"] / shown, 3) if shown else None,
               "seconds": round(time.perf_counter() - t0, 1)}
    print(f"{summary['model']}: {len(rows)} mid-line cursors with code after them: shown {shown} "
          f"(right {counts['right']}, wrong {counts['wrong']}), hidden {counts['unsure']} unsure and "
          f"{counts['empty']} empty by the policy")
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

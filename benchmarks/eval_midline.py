"""What the editor shows at cursors in the middle of a line with code after them, on the held-out crates.

eval_fim.py's single-line tasks complete a line to its end, so nothing follows their cursor. Here a span of a line
(1-40 characters, neither end inside a word, code that is not only closers and punctuation after it) is taken out,
and the language server's request at its start is answered as the daemon answers it, then gated and post-processed as
the server shows it (eval_fim.editor_request, m31r_lsp.completion.shown_suggestion). A shown suggestion is right when
accepting it gives the original line back; a wrong one is what a user has to undo. Greedy, so the figures of one
bundle, data and seed repeat.

    python benchmarks/eval_midline.py --bundle release --data ~/.cache/m31r/data [--n 400] [--seed 1] [--out F.json]
    python benchmarks/eval_midline.py --data ~/.cache/m31r/data --rescore F.json   # this tree's policy, same answers
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from eval_fim import MIN_PROBABILITY, Task, editor_request, editor_settings, engine_summary, val_texts

MAX_SPAN = 40  # characters taken out of the line
MAX_LINE = 160


def make_tasks(texts: list[tuple[str, str, str]], n: int, seed: int, after: str = "code") -> list[Task]:
    """Mid-line spans, a crate drawn first and then one of its files (as eval_fim.make_tasks). `after`: "code", spans
    with code after them; "closers", spans followed by closers and punctuation only (`f(a, █);`, as an editor that
    auto-closes brackets leaves a line being typed)."""
    from m31r_protocol.policy import TRAILING_OK
    from m31r_protocol.policy import is_word_char as word

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
        if after == "closers":  # the span ends where the line's closers and punctuation begin
            b = next((j for j in range(a + 1, len(body)) if all(c in TRAILING_OK for c in body[j:])), len(body))
            if b - a > MAX_SPAN:
                continue
        if not body[b:].strip() or all(c in TRAILING_OK for c in body[b:]) != (after == "closers"):
            continue  # nothing after it (eval_fim.py's case), or not the kind asked for
        if a and word(body[a - 1]) and word(body[a]) or word(body[b - 1]) and word(body[b]):
            continue  # a cursor or an end inside a word
        off = sum(map(len, lines[:i]))
        tasks.append(Task("midline", path, i, text[: off + a], text[off + b :], body[a:b]))
    return tasks


def judge(t: Task, answer: dict, settings) -> dict:
    """The task's row: the daemon's `answer` (raw text, stop_sequence, finish_reason, logprob_by_line) as the language
    server shows it at the task's cursor, and whether accepting that gives the original line back."""
    from m31r_lsp.completion import shown_suggestion
    from m31r_protocol import policy

    plan = policy.plan(t.prefix + t.suffix, len(t.prefix), settings.options())
    lines = answer["logprob_by_line"]
    s, why = shown_suggestion(plan, answer["raw"], lines[0] if lines else None, lines, settings.min_probability,
                              stop_sequence=answer["stop_sequence"], finish_reason=answer["finish_reason"])
    doc = t.prefix + t.suffix
    accepted = None if s is None else doc[: s.start] + s.text + doc[s.end :]
    verdict = why or ("right" if accepted == t.prefix + t.target + t.suffix else "wrong")
    return {"path": t.path, "line": t.line, "target": t.target, **answer, "shown": None if s is None else s.text,
            "verdict": verdict}


def answer(engine, budget, cache, t: Task, settings) -> dict:
    """The daemon's answer to the language server's request at the task's cursor (greedy: the daemon's own width for
    a line request), with what the server reads of its Done."""
    from m31r.engine import Outcome, line_logprobs

    req = editor_request(engine, budget, t, settings)
    got = Outcome(prompt_tokens=len(req.ids))
    for _ in engine.generate(req.ids, max_tokens=req.max_tokens, cache=cache, result=got, heal=req.heal,
                             stop=req.stop, start_stops=req.start_stops, repeat_context=req.repeat_context,
                             min_probability=req.min_probability):
        pass
    lines = line_logprobs(engine.tokenizer.token_bytes, got.tokens, got.logprobs, got.text.count("\n") + 1,
                          req.heal.count("\n"))
    return {"raw": got.text, "stop_sequence": got.stop_sequence, "finish_reason": got.finish_reason,
            "logprob_by_line": lines}


def summarize(rows: list[dict], model: str, seed: int, after: str) -> dict:
    counts = {v: sum(r["verdict"] == v for r in rows) for v in ("right", "wrong", "unsure", "empty")}
    shown = counts["right"] + counts["wrong"]
    print(f"{model}: {len(rows)} mid-line cursors with {after} after them: shown {shown} (right {counts['right']}, "
          f"wrong {counts['wrong']}), hidden {counts['unsure']} unsure and {counts['empty']} empty by the policy")
    return {"model": model, "tasks": len(rows), "seed": seed, "after": after, **counts,
            "right_of_shown": round(counts["right"] / shown, 3) if shown else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, help="the model (not with --rescore)")
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--after", choices=("code", "closers"), default="code",
                   help="what follows the span: code, or closers and punctuation only (the line's last ones)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None, help="write the summary and every task's row as JSON")
    p.add_argument("--min-probability", type=float, default=MIN_PROBABILITY, metavar="P",
                   help="the editors' confidence floor (default: theirs); with --rescore, answers decoded under a "
                        "lower floor are shown as this one would (a higher one only stops them sooner)")
    p.add_argument("--rescore", type=Path, default=None, metavar="OUT_JSON",
                   help="no model: show the answers an earlier --out holds (same data, --n, --seed and --after) by "
                        "this tree's policy, beside that run's figures (for policy changes)")
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be at least 1")
    if (args.bundle is None) == (args.rescore is None):
        p.error("give --bundle (decode) or --rescore (an earlier --out), not both")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    tasks = make_tasks(val_texts(args.data), args.n, args.seed, args.after)
    if not tasks:
        raise SystemExit(f"no mid-line spans with {args.after} after them in {args.data / 'corpus' / 'val.jsonl'}")
    settings = editor_settings(args.min_probability)
    t0 = time.perf_counter()
    if args.rescore is not None:
        before = json.loads(args.rescore.read_text())
        old = before["tasks"]
        if [r["target"] for r in old] != [t.target for t in tasks]:
            raise SystemExit(f"{args.rescore} holds other tasks: give the --n, --seed and --after it was run with")
        model = before["summary"]["model"]
        print("before: ", end="")
        summarize(old, model, args.seed, args.after)
        print("now:    ", end="")
        rows = [judge(t, {k: r[k] for k in ("raw", "stop_sequence", "finish_reason", "logprob_by_line")}, settings)
                for t, r in zip(tasks, old, strict=True)]
    else:
        from m31r.engine import Engine
        from m31r.fim import FimBudget

        engine = Engine(args.bundle, dtype=args.dtype)
        log(engine_summary(engine))
        model = engine.bundle.model_id
        budget, cache = FimBudget.for_context(engine.config.max_context), engine.new_cache()
        rows = []
        for k, t in enumerate(tasks):
            rows.append(judge(t, answer(engine, budget, cache, t, settings), settings))
            if (k + 1) % 50 == 0:
                log(f"  {k + 1}/{len(tasks)} tasks")
    summary = {**summarize(rows, model, args.seed, args.after), "seconds": round(time.perf_counter() - t0, 1)}
    print(json.dumps(summary))
    if args.out is not None:
        args.out.write_text(json.dumps({"summary": summary, "tasks": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

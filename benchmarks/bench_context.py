"""What project context costs while the user types (README "Project context").

`make eval`'s multi-line tasks (held-out crates, same seed) from crates of more than one file, each block body typed
character by character, line ends included: one line completion per keystroke (greedy, up to --max-tokens), with and
without the snippets of the crate's other files that the language server would send (m31r_protocol.context). Each way
has its own prompt cache, as a daemon would, and the two take turns on every keystroke, so they share the machine's
load. A snippet choice that changes (the cursor entered another block of lines) moves the prompt's head, and the whole
prompt is prefilled again: that is the cost measured. Timed: the engine's whole answer (prefill of what changed, then
decoding), not the task's first request, which prefills the whole prompt either way.

    python benchmarks/bench_context.py --bundle release --data ~/.cache/m31r/data --tasks 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_common import write_report  # noqa: E402
from bench_daemon import pct  # noqa: E402
from eval_fim import engine_summary, make_tasks, typing_engine, typing_options, val_texts  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    typing_options(p)
    p.add_argument("--tasks", type=int, default=20, help="multi-line tasks typed (of crates with other files)")
    p.add_argument("--max-chars", type=int, default=120, help="characters typed per task at most")
    p.add_argument("--max-tokens", type=int, default=16)
    args = p.parse_args(argv)
    if min(args.tasks, args.max_chars, args.max_tokens) < 1:
        p.error("--tasks, --max-chars and --max-tokens must be at least 1")

    from m31r.context import context_ids, context_room
    from m31r.cpu import describe
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, line_context
    from m31r.train.samples import crate_path
    from m31r_protocol.context import query_words, rank, windows

    engine = typing_engine(args)
    tok = engine.tokenizer
    texts = val_texts(args.data)
    files = {path: (crate, windows(text)) for path, text, crate in texts}
    sizes: dict[str, int] = {}
    for _, _, crate in texts:
        sizes[crate] = sizes.get(crate, 0) + 1
    tasks = [t for t in make_tasks(texts, 0, 4 * args.tasks, args.seed, tok, 48, 128)
             if sizes[files[t.path][0]] > 1][: args.tasks]
    if not tasks:
        raise SystemExit(f"error: no multi-line task from a crate of several files in {args.data / 'corpus'}")
    budget = FimBudget.for_context(engine.config.max_context)
    ways = ("plain", "context")
    caches = {w: engine.new_cache() for w in ways}
    ms: dict[str, list[float]] = {w: [] for w in ways}
    prompt_tokens: dict[str, list[int]] = {w: [] for w in ways}
    prefilled: dict[str, list[int]] = {w: [] for w in ways}
    head_moved = keystrokes = offered = 0
    turn = 0
    for t in tasks:
        crate = files[t.path][0]
        near = [(crate_path(q), w) for q, (c, w) in files.items() if c == crate and q != t.path]
        last_head: list[int] | None = None
        for k in range(min(len(t.target), args.max_chars) + 1):
            prefix = t.prefix + t.target[:k]
            prompt = build_fim_prompt(tok, prefix, t.suffix, budget)
            snippets = rank(query_words(prefix), near)
            head = context_ids(tok, snippets, context_room(budget, prompt))
            if k:
                keystrokes += 1
                offered += len(snippets)
                head_moved += head != last_head
            last_head = head
            turn += 1
            for w in ways[:: 1 if turn % 2 else -1]:
                ids = head + prompt.ids if w == "context" else prompt.ids
                res = Outcome(prompt_tokens=0)
                t0 = time.perf_counter()
                for _ in engine.generate(ids, result=res, max_tokens=args.max_tokens, stop=["\n"], cache=caches[w],
                                         heal=prompt.heal, repeat_context=line_context(prefix)):
                    pass
                if k:
                    ms[w].append((time.perf_counter() - t0) * 1000)
                    prompt_tokens[w].append(len(ids))
                    prefilled[w].append(len(ids) - res.cached_tokens)

    rows = [{"way": w, "keystrokes": len(ms[w]), "ms_p50": round(pct(ms[w], 50), 1),
             "ms_p90": round(pct(ms[w], 90), 1), "ms_p99": round(pct(ms[w], 99), 1),
             "ms_mean": round(statistics.mean(ms[w]), 1), "prompt_tokens": round(statistics.mean(prompt_tokens[w]), 1),
             "prefilled_tokens": round(statistics.mean(prefilled[w]), 1)} for w in ways]
    print(engine_summary(engine))
    print(f"{len(tasks)} block bodies typed, {keystrokes} keystrokes; the snippets changed on "
          f"{head_moved} of them ({head_moved / max(keystrokes, 1):.1%}); {offered / max(keystrokes, 1):.1f} snippets "
          f"offered per keystroke")
    print(f"{'way':>8} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'prompt':>7} {'prefilled':>9}")
    for r in rows:
        print(f"{r['way']:>8} {r['ms_p50']:>8.1f} {r['ms_p90']:>8.1f} {r['ms_p99']:>8.1f} {r['ms_mean']:>8.1f} "
              f"{r['prompt_tokens']:>7.0f} {r['prefilled_tokens']:>9.1f}")
    if args.out:
        write_report(args.out, {"cpu": describe(), "bundle": str(args.bundle), "tasks": len(tasks),
                                "keystrokes": keystrokes, "head_moved": head_moved,
                                "snippets_offered": round(offered / max(keystrokes, 1), 2), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

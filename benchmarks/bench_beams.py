"""What beam search costs a line completion while the user types (README "Beam search").

`make eval`'s single-line tasks (held-out crates, same seed), each typed: the cursor's first request, then one
request per character of the reference line typed, up to --keystrokes. Every width has its own prompt cache and spare
caches, as a daemon serving that width would, and the widths take turns on every keystroke, so they share the
machine's load. Timed: the engine's whole answer (prefill of what changed, then the search or greedy decoding), not
the cursor's first request, which prefills the whole prompt.

`--unshared` adds, for every width above 1, the same search with each hypothesis reading the prompt's keys and values
from its own cache (as before the native attention read a shared prompt once per step: engine.Decode.share), taking
turns with the others.

    python benchmarks/bench_beams.py --bundle release --data ~/.cache/m31r/data --widths 1,3,4
    python benchmarks/bench_beams.py --bundle release --data ~/.cache/m31r/data --widths 1,3 --unshared
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
    p.add_argument("--tasks", type=int, default=40, help="single-line tasks (eval_fim's first ones)")
    p.add_argument("--keystrokes", type=int, default=3, help="characters typed per task")
    p.add_argument("--widths", default="1,3,4", help="beam widths; 1 (greedy decoding) is the reference")
    p.add_argument("--unshared", action="store_true",
                   help="also run each width above 1 with every hypothesis reading the prompt from its own cache")
    args = p.parse_args(argv)
    try:
        widths = [int(w) for w in args.widths.split(",")]
    except ValueError:
        p.error(f"--widths: comma-separated beam widths, not {args.widths!r}")
    if min(widths) < 1 or args.tasks < 1 or args.keystrokes < 1:
        p.error("--widths, --tasks and --keystrokes must be at least 1")
    if 1 not in widths:
        widths.insert(0, 1)
    # (label, width, whether the hypotheses read the prompt once)
    variants = [(str(w), w, True) for w in widths] + [(f"{w}u", w, False) for w in widths if w > 1 and args.unshared]
    labels = [v[0] for v in variants]

    from m31r.beams import beam_generate
    from m31r.cpu import describe
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt, line_context

    engine = typing_engine(args)
    tok = engine.tokenizer
    texts = val_texts(args.data)
    tasks = [t for t in make_tasks(texts, args.tasks, 0, args.seed, tok, 48, 128) if t.kind == "single"]
    if not tasks:
        raise SystemExit(f"error: no single-line task could be drawn from {args.data / 'corpus' / 'val.jsonl'}")
    budget = FimBudget.for_context(engine.config.max_context).with_reserve(48)  # room for max_tokens=48, as served
    state = {label: (engine.new_cache(), []) for label in labels}
    ms: dict[str, list[float]] = {label: [] for label in labels}
    tokens: dict[str, list[int]] = {label: [] for label in labels}
    steps: dict[str, list[int]] = {label: [] for label in labels}
    run = engine.run

    def unshared_run(decodes, chunks):  # every row on its own cache's copy of the prompt
        for d in decodes:
            d.share = None
        return run(decodes, chunks)

    turn = 0
    for t in tasks:
        for k in range(min(args.keystrokes, len(t.target)) + 1):
            prefix = t.prefix + t.target[:k]
            prompt = build_fim_prompt(tok, prefix, t.suffix, budget)
            turn += 1
            for label, w, shared in variants[:: 1 if turn % 2 else -1]:
                cache, spares = state[label]
                engine.run = run if shared else unshared_run
                kw = dict(max_tokens=48, stop=["\n"], cache=cache, heal=prompt.heal,
                          repeat_context=line_context(prefix))
                res = Outcome(prompt_tokens=0)
                t0 = time.perf_counter()
                for _ in (beam_generate(engine, prompt.ids, width=w, result=res, spares=spares, **kw) if w > 1
                          else engine.generate(prompt.ids, result=res, **kw)):
                    pass
                if k:
                    ms[label].append((time.perf_counter() - t0) * 1000)
                    tokens[label].append(res.completion_tokens)
                    steps[label].append(res.decode_steps)
    engine.run = run

    rows = [{"label": label, "width": w, "shared_prompt": shared or w == 1, "keystrokes": len(ms[label]),
             "ms_p50": round(pct(ms[label], 50), 1),
             "ms_p90": round(pct(ms[label], 90), 1), "ms_mean": round(statistics.mean(ms[label]), 1),
             "completion_tokens": round(statistics.mean(tokens[label]), 2),
             "decode_steps": round(statistics.mean(steps[label]), 2)} for label, w, shared in variants]
    base = rows[labels.index("1")]
    print(engine_summary(engine))
    print(f"{len(tasks)} single-line tasks, {args.keystrokes} keystrokes each")
    print(f"{'width':>5} {'keystrokes':>10} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'p50 vs greedy':>13} "
          f"{'tokens':>7} {'steps':>6}")
    for r in rows:
        print(f"{r['label']:>5} {r['keystrokes']:>10} {r['ms_p50']:>8.1f} {r['ms_p90']:>8.1f} {r['ms_mean']:>8.1f} "
              f"{r['ms_p50'] / base['ms_p50']:>12.2f}x {r['completion_tokens']:>7.2f} {r['decode_steps']:>6.2f}")
    if args.out:
        write_report(args.out, {"cpu": describe(), "bundle": str(args.bundle), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

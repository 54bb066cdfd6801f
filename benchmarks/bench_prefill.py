"""What a cursor jump costs: the whole FIM prompt prefilled with nothing cached (docs/serving.md "How much of the
file above the cursor").

Typing only appends to a prompt (suffix first), so the daemon prefills a keystroke's few new tokens; a cursor that
moves to another line changes the suffix, the prompt's first part, and the next request prefills everything again.
This times exactly that: `make eval`'s tasks (single- and multi-line, held-out crates, same seed), each task's FIM
prompt as the daemon lays it out, prefilled into a fresh cache (Engine.prefill: the chunks a cold request runs), the
engine as the daemon serves it by default. One prompt runs first untimed (allocations).

    python benchmarks/bench_prefill.py --bundle release --data ~/.cache/m31r/data --tasks 40
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
    p.add_argument("--tasks", type=int, default=40, help="tasks (eval_fim's first ones: single-line, then multi-line)")
    args = p.parse_args(argv)
    if args.tasks < 1:
        p.error(f"--tasks must be at least 1, not {args.tasks}")

    from m31r.cpu import describe
    from m31r.fim import FimBudget, build_fim_prompt

    engine = typing_engine(args)
    tok = engine.tokenizer
    texts = val_texts(args.data)
    tasks = make_tasks(texts, args.tasks - args.tasks // 3, args.tasks // 3, args.seed, tok, 48, 128)
    budget = FimBudget.for_context(engine.config.max_context)
    prompts = [build_fim_prompt(tok, t.prefix, t.suffix, budget).ids for t in tasks]
    if not prompts:
        raise SystemExit(f"error: no task could be drawn from {args.data / 'corpus' / 'val.jsonl'}")

    def prefill(ids: list[int]) -> float:
        cache = engine.new_cache()
        t0 = time.perf_counter()
        for _ in engine.prefill(cache, ids, 0):
            pass
        return (time.perf_counter() - t0) * 1000

    prefill(prompts[0])
    ms = [prefill(ids) for ids in prompts]
    tokens = [len(ids) for ids in prompts]
    report = {"tasks": len(prompts), "prompt_tokens_mean": round(statistics.mean(tokens), 1),
              "p50_ms": round(pct(ms, 50), 1), "p90_ms": round(pct(ms, 90), 1),
              "mean_ms": round(statistics.mean(ms), 1), "tok_per_s": round(sum(tokens) / sum(ms) * 1000)}
    print(engine_summary(engine))
    print(f"{report['tasks']} cold FIM prompts of {report['prompt_tokens_mean']:.0f} tokens on average: "
          f"p50 {report['p50_ms']:.1f} ms, p90 {report['p90_ms']:.1f} ms, mean {report['mean_ms']:.1f} ms, "
          f"{report['tok_per_s']} tokens/s")
    if args.out:
        write_report(args.out, {"cpu": describe(), "bundle": str(args.bundle), "cold_prefill": report})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

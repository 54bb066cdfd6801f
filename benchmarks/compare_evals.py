"""Compare two `eval_fim.py --out` results task by task: is the candidate's difference more than chance?

The release rule (README "The default model") asks a candidate to beat `release/` on the same tasks. A few points
on 150 or 450 tasks can be noise, so this pairs the two runs' tasks and prints, per kind:

  exact match   both figures, the tasks gained and lost, and the exact two-sided sign (McNemar) test's p-value
                on those discordant tasks: the chance of a split at least this uneven if either model were as
                likely to win each of them.
  edit sim.     both means, the mean paired difference and its 95% interval from a seeded paired bootstrap.
  as shown      where both results score each task as the editor shows it (eval_fim's as-shown figures; results
                from before them have none), the same two comparisons on those scores, in rows of their own. They
                inform; the release rule below stays on the raw figures, comparable across sessions.
  perplexity    both validation perplexities, with the window length each is over; where those differ (eval_fim
                cuts its windows to a model's shorter context) it says they are not comparable. Not in the rule.

Both files must hold the same tasks (same --seed, counts and validation split); the script refuses otherwise.
Last comes the release rule's verdict (docs/training.md "Which tasks decide a release"): on the larger draw
(`make eval-large`: its task counts, seed and token budgets), with the same settings and without --floor-stop, does the
candidate beat the base on both single-line exact match and multi-line edit similarity? A tie is not a win.

The same comparison then runs again on the clean tasks alone, those whose file has no look-alike in training
(--leaky: by default benchmarks/data/eval-leaky-files.json, the files eval_leakage.py found for the corpus 0.8.0 was
trained on; `--leaky none` skips it), and the verdict needs the win there too: a model that saw copies of some held-out
files can gain on their tasks by memory, and more training on the same copies gains there most.

    python benchmarks/compare_evals.py BASE.json CANDIDATE.json [--leaky LEAKAGE.json] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

KINDS = ("single", "multi")
LEAKY = Path(__file__).resolve().parent / "data" / "eval-leaky-files.json"
_IDENTITY = ("kind", "path", "line", "target")


def sign_test_p(gained: int, lost: int) -> float:
    """Exact two-sided binomial test of gained vs lost at p = 1/2 (McNemar's exact test)."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)


def bootstrap_interval(diffs: list[float], *, rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile interval of the mean of `diffs`, resampling tasks with replacement."""
    rng = random.Random(seed)
    n = len(diffs)
    means = sorted(sum(diffs[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds))
    return means[int(0.025 * rounds)], means[int(0.975 * rounds) - 1]


# What a result says about how it was run, with the value meant where a result from before the option has none:
# --beams and --context came later (greedy and without them before), --floor-stop too (off before). eval_fim
# reports the confidence floor under gate.min_probability; the seed and token budgets pick and cut the tasks.
SETTINGS = {"healing": None, "serving_stops": None, "dtype": None, "quant": None, "max_new_tokens": None,
            "beams": 1, "context": False, "floor_stop": False, "min_probability": None, "seed": None}


def settings_of(result: dict) -> dict:
    got = {k: result.get(k, d) for k, d in SETTINGS.items()}
    got["min_probability"] = (result.get("gate") or {}).get("min_probability")
    return got


def tokenizers_differ(base: dict, cand: dict) -> bool:
    """Whether both results name their model's tokenizer (metadata's tokenizer_hash) and the two differ."""
    ta, tb = ((r.get("metadata") or {}).get("tokenizer_hash") for r in (base, cand))
    return bool(ta and tb and ta != tb)


def compare(base: dict, cand: dict) -> dict:
    a, b = base["tasks"], cand["tasks"]
    ident = lambda t: tuple(t[k] for k in _IDENTITY)  # noqa: E731
    if len(a) != len(b) or any(ident(x) != ident(y) for x, y in zip(a, b, strict=True)):
        at = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if ident(x) != ident(y)), min(len(a), len(b)))
        where = (f"{len(a)} and {len(b)} tasks" if len(a) != len(b) else f"{len(a)} tasks each")
        if at < min(len(a), len(b)):
            where += (f", the first different at task {at}: {a[at]['kind']} {a[at]['path']}:{a[at]['line'] + 1} / "
                      f"{b[at]['kind']} {b[at]['path']}:{b[at]['line'] + 1}")
        hint = ""
        if tokenizers_differ(base, cand):
            hint = ("; the models' tokenizers differ, and a data folder without tokenizer.json has each model's "
                    "tokenizer size its tasks (eval_fim.task_tokenizer): run both on one that has it")
        raise ValueError(f"the two results hold different tasks ({where}): run both with the same --seed, --n-single, "
                         f"--n-multi, token budgets and data{hint}")
    out: dict = {"base": base["model"], "candidate": cand["model"]}
    sb, sc = settings_of(base), settings_of(cand)
    out["settings"] = {"base": sb, "candidate": sc}
    if differ := [k for k in sb if sb[k] != sc[k]]:  # a serving change
        out["settings_differ"] = {k: [sb[k], sc[k]] for k in differ}
    for kind in KINDS:
        pairs = [(x, y) for x, y in zip(a, b, strict=True) if x["kind"] == kind]
        if not pairs:
            continue
        out[kind] = paired(pairs, "exact", "edit_similarity")
        # What the editor shows (eval_fim's as-shown scores, since the forty-fifth session): compared where both
        # results have them for every task; it does not enter the release rule.
        if all(x.get(SHOWN[0]) is not None and y.get(SHOWN[0]) is not None for x, y in pairs):
            out[kind]["as_shown"] = paired(pairs, *SHOWN)
    if any("as_shown" in out.get(kind, {}) for kind in KINDS) and base.get("editor") != cand.get("editor"):
        out["editor_differ"] = [base.get("editor"), cand.get("editor")]
    if (ppl := perplexities(base, cand)) is not None:
        out["perplexity"] = ppl
    out["release"] = release_verdict(out)
    return out


def ppl_window(result: dict) -> int | None:
    """The tokens each perplexity window of an eval_fim result predicts: its `perplexity.context`, or for a result from
    before it was recorded, its tokens per window (the same number); None where it has no perplexity."""
    ppl = result.get("perplexity") or {}
    if not ppl.get("windows") or "perplexity" not in ppl:
        return None
    return ppl.get("context") or ppl["tokens"] // ppl["windows"]


def perplexities(base: dict, cand: dict) -> dict | None:
    """Both results' perplexity and bits per byte, with the windows they are over; `not_comparable` says why where
    those differ (eval_fim cuts its windows to a shorter model's context, and a shorter window has less to condition
    on, so its perplexity is higher whatever the model), or where the models' tokenizers differ (a perplexity is per
    token, of each model's own tokens: bits per byte are what compare then). Not part of the release rule."""
    wa, wb = ppl_window(base), ppl_window(cand)
    if wa is None or wb is None:
        return None
    pa, pb = base["perplexity"], cand["perplexity"]
    out = {"base": pa["perplexity"], "candidate": pb["perplexity"], "bits_per_byte": [pa.get("bits_per_byte"),
                                                                                       pb.get("bits_per_byte")],
           "windows": [wa, wb]}
    why = []
    if wa != wb:
        why.append(f"the perplexities are over windows of {wa} and {wb} tokens (a model's context shorter than "
                   "--ppl-context cuts them)")
    if tokenizers_differ(base, cand):
        why.append("the models' tokenizers differ, so each perplexity is per token of its own tokenizer (compare bits "
                   "per byte)")
    if why:
        out["not_comparable"] = "; ".join(why) + ": they are not comparable"
    return out


SHOWN = ("shown_exact", "shown_edit_similarity")  # a task's as-shown scores (eval_fim's Result)


def paired(pairs: list[tuple[dict, dict]], exact: str, edit: str) -> dict:
    """Both runs' figures on these paired tasks, by their `exact` and `edit` fields: exact match with the tasks gained
    and lost and the sign test's p, edit similarity with the mean paired difference and its bootstrap interval."""
    n = len(pairs)
    gained = sum(1 for x, y in pairs if y[exact] and not x[exact])
    lost = sum(1 for x, y in pairs if x[exact] and not y[exact])
    diffs = [y[edit] - x[edit] for x, y in pairs]
    low, high = bootstrap_interval(diffs)
    return {
        "n": n,
        "exact_base": sum(bool(x[exact]) for x, _ in pairs) / n,
        "exact_candidate": sum(bool(y[exact]) for _, y in pairs) / n,
        "gained": gained, "lost": lost, "sign_test_p": round(sign_test_p(gained, lost), 4),
        "edit_base": sum(x[edit] for x, _ in pairs) / n,
        "edit_candidate": sum(y[edit] for _, y in pairs) / n,
        "edit_diff": sum(diffs) / n, "edit_diff_95": [low, high],
    }


DECIDING_DRAW = {"single": 300, "multi": 150}  # `make eval-large`: the tasks that decide a release
# eval-large passes no --seed, --single-tokens or --multi-tokens: eval_fim's defaults draw and cut its tasks.
DECIDING_SEED = 0
DECIDING_TOKENS = {"single": 48, "multi": 128}


def moves(r: dict) -> tuple[int, float]:
    """How far the candidate moved the two deciding figures, as reported: exact matches in tasks, edit similarity to
    three decimals, so a tie is a tie however the digits past the third fall."""
    s, m = r["single"], r["multi"]
    return s["gained"] - s["lost"], round(m["edit_candidate"], 3) - round(m["edit_base"], 3)


def release_verdict(r: dict) -> dict:
    """Whether `compare`'s result lets the candidate replace the base. The figures are compared as they are
    reported: exact matches in tasks, edit similarity to three decimals, so a tie is a tie however the digits past
    the third fall."""
    counts = {kind: r[kind]["n"] if kind in r else 0 for kind in KINDS}
    if counts != DECIDING_DRAW:
        return {"wins": False, "why": f"not the deciding draw: {counts['single']} single-line and {counts['multi']} "
                f"multi-line tasks against {DECIDING_DRAW['single']} and {DECIDING_DRAW['multi']} (make eval-large)"}
    sides = [(name, r.get("settings", {}).get(name, {})) for name in ("base", "candidate")]
    if floor := [name for name, s in sides if s.get("floor_stop")]:
        return {"wins": False, "why": f"the {' and the '.join(floor)} ran with --floor-stop, whose answers are cut "
                "where the editors' floor would hide the rest: for comparison, not for releases"}
    if "settings_differ" in r:
        return {"wins": False, "why": "the runs differ in their settings, not only in the model"}
    for name, s in sides:
        if s.get("seed") != DECIDING_SEED or s.get("max_new_tokens") != DECIDING_TOKENS:
            return {"wins": False, "why": f"not the deciding draw: the {name} ran with seed {s.get('seed')} and token "
                    f"budgets {s.get('max_new_tokens')}, make eval-large with {DECIDING_SEED} and {DECIDING_TOKENS}"}
    single, multi = moves(r)
    wins = single > 0 and multi > 0
    word = lambda d: "wins" if d > 0 else "ties" if d == 0 else "loses"  # noqa: E731
    return {"wins": wins, "why": f"single-line exact match {word(single)} ({single:+d} tasks), multi-line edit "
            f"similarity {word(multi)} ({multi:+.3f})"}


def without(result: dict, leaky: set[str]) -> dict:
    """The result less the tasks drawn from files with a look-alike in training (eval_leakage.py's leaky_files)."""
    return {**result, "tasks": [t for t in result["tasks"] if t["path"] not in leaky]}


def with_clean(r: dict, clean: dict, leaky_files: int) -> dict:
    """`compare`'s result with the clean tasks' comparison beside it. The clean tasks are fewer than the deciding
    draw's counts, so their verdict is the all-task rule applied to them; the release needs both."""
    v = release_verdict(r)
    # A kind whose every task comes from a leaky file has no clean tasks: nothing to compare, so no win shown there.
    empty = [k for k in KINDS if k in r and k not in clean]
    if v["wins"] and empty:
        v = {"wins": False, "why": f"{v['why']}; but there are no clean {' or '.join(map(LABEL.get, empty))} tasks "
             "(every one's file has a look-alike in training): nothing to compare, so the win is not shown to be the "
             "model's alone"}
    elif v["wins"]:
        single, multi = moves(clean)
        if not (single > 0 and multi > 0):
            v = {"wins": False, "why": f"{v['why']}; but on the clean tasks (no file look-alike in training) "
                 f"single-line exact match moves {single:+d} tasks, multi-line edit similarity {multi:+.3f}: the win "
                 "is not the model's alone"}
    return {**r, "clean": {k: clean[k] for k in KINDS if k in clean} | {"leaky_files": leaky_files}
            | ({"nothing_to_compare": empty} if empty else {}), "release": v}


LABEL = {"single": "single-line", "multi": "multi-line"}


def table(r: dict) -> str:
    lines = [f"base {r['base']}  candidate {r['candidate']}"]
    if "settings_differ" in r:
        lines.append("the runs differ in " + ", ".join(f"{k} ({a} / {b})" for k, (a, b) in r["settings_differ"].items())
                     + ": the difference is not the model's alone")
    lines += ["",
              "| tasks | exact base | exact cand. | gained / lost | sign-test p | edit base | edit cand. "
              "| edit diff [95%] |", "|---|---|---|---|---|---|---|---|"]
    def row(name: str, k: dict) -> str:
        lo, hi = k["edit_diff_95"]
        return (f"| {name} ({k['n']}) | {k['exact_base']:.1%} | {k['exact_candidate']:.1%} "
                f"| {k['gained']} / {k['lost']} | {k['sign_test_p']:.3f} | {k['edit_base']:.3f} "
                f"| {k['edit_candidate']:.3f} | {k['edit_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}] |")

    for part, label in ((r, ""), (r.get("clean", {}), ", clean")):
        for kind in KINDS:
            if kind in part:
                lines.append(row(f"{kind}{label}", part[kind]))
                if "as_shown" in part[kind]:
                    lines.append(row(f"{kind}{label}, as shown", part[kind]["as_shown"]))
            elif kind in part.get("nothing_to_compare", ()):
                lines.append(f"| {kind}{label} (0) | nothing to compare: every {LABEL[kind]} task's file has a "
                             "look-alike in training | | | | | | |")
    if any("as_shown" in r.get(kind, {}) for kind in KINDS):
        lines.append("(as shown: scored on what the editor shows at each task's cursor, eval_fim's as-shown figures; "
                     "not part of the release rule)")
    if "editor_differ" in r:
        a, b = r["editor_differ"]
        lines.append(f"the as-shown figures are under different editor settings ({a} / {b})")
    if ppl := r.get("perplexity"):
        wa, wb = ppl["windows"]
        ba, bb = ppl.get("bits_per_byte") or [None, None]
        lines.append(f"validation perplexity: base {ppl['base']:.3f} ({wa}-token windows), candidate "
                     f"{ppl['candidate']:.3f} ({wb}-token windows)"
                     + (f"; bits per byte: base {ba:.4f}, candidate {bb:.4f}" if None not in (ba, bb) else "")
                     + (f"; {ppl['not_comparable']}" if "not_comparable" in ppl else ""))
    if "clean" in r:
        lines.append(f"(clean: the tasks of files without a look-alike in training; {r['clean']['leaky_files']} "
                     "files have one)")
    v = r["release"]
    lines += ["", f"release rule: {'the candidate wins both' if v['wins'] else 'not a release'}: {v['why']}"]
    return "\n".join(lines)


def load_result(path: Path) -> dict:
    """An eval_fim.py --out result, or ValueError naming the file and what it is not: a summary line, another
    benchmark's report or a truncated file otherwise fails later as a bare key ('tasks') or a traceback."""
    try:
        r = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    what = f"{path}: not an eval_fim.py --out result"
    if not isinstance(r, dict) or not isinstance(r.get("tasks"), list) or "model" not in r:
        raise ValueError(f"{what} (it needs 'model' and the per-task list 'tasks', which eval_fim.py writes with "
                         "--out; its printed summary line has no tasks)")
    need = (*_IDENTITY, "exact", "edit_similarity")
    bad = next((i for i, t in enumerate(r["tasks"]) if not isinstance(t, dict) or any(k not in t for k in need)), None)
    if bad is not None:
        raise ValueError(f"{what}: task {bad} lacks one of {', '.join(need)}")
    return r


def load_leaky(path: Path) -> set[str]:
    """The paths of an eval_leakage.py report's leaky_files, or ValueError naming the file."""
    try:
        report = json.loads(path.read_text())
        return {f["path"] for f in report["leaky_files"]}
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not an eval_leakage.py report with leaky_files ({type(e).__name__}: {e})") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("candidate", type=Path)
    ap.add_argument("--json", action="store_true", help="Print the comparison as JSON instead of a table.")
    ap.add_argument("--leaky", type=Path, default=LEAKY,
                    help="eval_leakage.py's report (its leaky_files): compare the clean tasks too, and decide on both; "
                         "'none' compares all tasks only")
    args = ap.parse_args(argv)
    try:
        base, cand = load_result(args.base), load_result(args.candidate)
        r = compare(base, cand)
    except (OSError, ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.leaky is not None and str(args.leaky) != "none":
        try:
            leaky = load_leaky(args.leaky)
            clean = compare(without(base, leaky), without(cand, leaky))
        except (OSError, ValueError, KeyError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        r = with_clean(r, clean, len(leaky))
    print(json.dumps(r, indent=2) if args.json else table(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

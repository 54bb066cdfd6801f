"""Does the completion run? Textbook Rust functions completed by the model, then compiled and tested with rustc.

`make eval` measures how close completions come to the held-out crates' code, character by character; a reader
asks something else: would this body do what the function says? Each file of benchmarks/data/exec/ is one small,
self-contained Rust program written for this project (so no corpus holds it): a function or method with its doc
comment and signature, where the lines between a `// @middle` and an `// @end` line are the task's middle, and
after a `// @tests` line the `#[test]`s its completion must pass. The model sees the file above the middle as the
prefix and the rest up to `// @tests` as the suffix (never the tests), with the cursor at the start of the
middle's first line: a block body, as `make eval`'s multi-line tasks and `make run`'s gcd example lay it out.

Line tasks ask less: each line of a middle with a letter or digit in it, the cursor after its indentation, the
other lines of the middle given around it (what a user who has typed the other lines of the body gets for this one).

Decoding is what the daemon serves for such a request (`benchmarks/eval_fim.py`'s `run_tasks`): a body greedily
with its serving stops, a line by a beam search of 3 stopped at the line end. Then the program with the completion
in its place, and the tests, is compiled with `rustc --test` and run, each test binary limited to a few seconds of
CPU time (a wrong loop body can loop for ever; CPU time, so that a busy machine fails no program an idle one passes).

  passes    the tests pass
  compiles  rustc accepts the program (whatever the tests then say)
  exact     the completion is the reference middle (normalised as in eval_fim); edit similarity likewise
  shown     the editors would show it: its first line at least their confidence floor (0.05) likely
  as shown  the program with what the editor shows at that cursor in its place (eval_fim's `as shown`: the language
            server's request, answered as the daemon answers it, cut and post-processed as the server does) passes;
            where it shows nothing the task counts as failed (nothing is compiled for it)

Needs `rustc` on PATH (Debian: `apt-get install rustc`); nothing else of Rust.

    python benchmarks/eval_exec.py --bundle release --out bench-results/exec.json
    python benchmarks/eval_exec.py --references   # the reference middles: every one must pass
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from eval_fim import Result, Task, edit_similarity, editor_settings, normalize, run_tasks  # noqa: E402

from m31r_protocol.policy import MIN_PROBABILITY, confident  # noqa: E402

PROBLEMS = REPO / "benchmarks" / "data" / "exec"
MIDDLE, END, TESTS = "// @middle", "// @end", "// @tests"


@dataclass(frozen=True)
class Problem:
    """A program with a hole: `prefix` + middle + `suffix` + `tests` is the whole test crate."""

    name: str
    prefix: str
    middle: str
    suffix: str
    tests: str
    kind: str = "body"  # body: whole lines, the cursor at the first's start | line: one line's text after its indent

    def program(self, middle: str) -> str:
        if self.kind == "body" and middle and not middle.endswith("\n"):
            middle += "\n"
        return self.prefix + middle + self.suffix + "\n" + self.tests

    def shown_program(self, shown: str, at: list[int]) -> str:
        """The program once the editor's suggestion `shown` is accepted over the characters `at` (from, to: counted
        from the cursor, Result.shown_range) of the document prefix + suffix."""
        cursor = len(self.prefix)
        doc = self.prefix + self.suffix
        return doc[: cursor + at[0]] + shown + doc[cursor + at[1] :] + "\n" + self.tests

    def lines(self) -> list[Problem]:
        """A line task for each line of the middle with a letter or digit in it."""
        rows = self.middle.splitlines(keepends=True)
        out = []
        for i, row in enumerate(rows):
            text = row.rstrip("\n")
            if not any(c.isalnum() for c in text):
                continue
            indent = text[: len(text) - len(text.lstrip(" \t"))]
            out.append(Problem(f"{self.name}:{i + 1}", self.prefix + "".join(rows[:i]) + indent, text[len(indent):],
                               "\n" + "".join(rows[i + 1 :]) + self.suffix, self.tests, "line"))
        return out


@dataclass
class Outcome:
    name: str
    kind: str  # body | line
    target: str
    prediction: str
    exact: bool
    edit_similarity: float
    compiles: bool
    passes: bool
    error: str  # the first rustc error, or why the tests failed ("" when they passed)
    shown: bool = True  # the editors would show it (policy.confident at MIN_PROBABILITY)
    # What the editor shows, accepted (eval_fim's Result.shown; None: not scored so): "" where it shows nothing
    as_shown: str | None = None
    shown_exact: bool | None = None
    shown_passes: bool | None = None  # False where nothing is shown
    shown_error: str = ""


def parse_problem(path: Path) -> Problem:
    """Split a problem file at its marker lines; a file without exactly one of each is refused by name."""
    lines = path.read_text().splitlines(keepends=True)
    marks = {m: [i for i, ln in enumerate(lines) if ln.strip() == m] for m in (MIDDLE, END, TESTS)}
    if any(len(v) != 1 for v in marks.values()):
        counts = ", ".join(f"{m!r} x{len(v)}" for m, v in marks.items())
        raise ValueError(f"{path.name}: needs exactly one of each marker line, found {counts}")
    a, b, c = marks[MIDDLE][0], marks[END][0], marks[TESTS][0]
    if not a < b < c:
        raise ValueError(f"{path.name}: markers must come in the order {MIDDLE}, {END}, {TESTS}")
    join = "".join
    return Problem(path.stem, join(lines[:a]), join(lines[a + 1 : b]), join(lines[b + 1 : c]), join(lines[c + 1 :]))


def load_problems(folder: Path = PROBLEMS) -> list[Problem]:
    return [parse_problem(p) for p in sorted(folder.glob("*.rs"))]


OUTPUT_BLOCKS = 32768  # `ulimit -f` of a test binary (16-32 MiB, by the shell's block size): a print loop fills no disk
# The limits are CPU time, so that a machine busy with other work (CI, training) fails no program that would pass on an
# idle one: a test binary gets TEST_CPU_S seconds of CPU, rustc RUSTC_CPU_S. The wall-clock limits only back them up,
# for a program that blocks or sleeps without using CPU; they are far above what a passing program takes even at a
# load of 10 on every core.
TEST_CPU_S, RUSTC_CPU_S = 5.0, 60.0
TEST_WALL_S, RUSTC_WALL_S = 120.0, 600.0


def _limited(argv: list[str], cpu: float, blocks: int | None = None) -> list[str]:
    """`argv` run by sh under a CPU-time limit of `cpu` seconds (whole seconds, rounded up: RLIMIT_CPU counts so): past
    it the kernel sends SIGXCPU, and SIGKILL a second later; no core file is written. With `blocks`, files it writes
    are limited to that many blocks. A shell sets the limits, not a preexec_fn, as score() starts programs from
    threads, where a preexec_fn can deadlock."""
    soft = max(1, math.ceil(cpu))
    limits = f"ulimit -c 0 && ulimit -S -t {soft} && ulimit -H -t {soft + 1}"
    if blocks is not None:
        limits += f" && ulimit -f {blocks}"
    return ["sh", "-c", f'{limits} && exec "$0" "$@"', *argv]


def _run_alone(argv: list[str], work: Path, timeout: float) -> tuple[int | None, str]:
    """(exit status, None past `timeout` seconds of wall-clock time; what it wrote) of one command run in an empty
    folder of `work`, its current and temporary folder, with no input, in a process group of its own, all of which is
    killed when it ends: a program that writes files writes them in its own folder (not the evaluator's, where the next
    program would read them), and one that leaves a child behind (holding the output pipe open, or looping) neither
    hangs the evaluation nor outlives it."""
    log, cwd = work / f"{Path(argv[0]).name}.out", work / "run"
    cwd.mkdir(exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, cwd=cwd, env={**os.environ, "TMPDIR": str(cwd)}, stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            with contextlib.suppress(ProcessLookupError):  # none of the group is left
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(log, "rb") as f:
        return code, f.read(1 << 20).decode("utf-8", "replace")


def _out_of_cpu(code: int | None) -> bool:
    """Whether an exit status is RLIMIT_CPU's soft limit (SIGXCPU, whose default action ends the program; one that
    ignores it is killed a second later, and reads as any SIGKILL: -9)."""
    return code == -signal.SIGXCPU


def run_program(source: str, work: Path, rustc: str, timeout: float = TEST_CPU_S,
                wall: float = TEST_WALL_S) -> tuple[bool, bool, str]:
    """(compiles, passes, first error) for one program, built as a test binary in `work` and run there (_run_alone);
    `timeout` is the seconds of CPU time its tests may use, `wall` the seconds they may take however little CPU."""
    work = work.resolve()
    src, exe = work / "main.rs", work / "main"
    src.write_text(source)
    exe.unlink(missing_ok=True)
    code, errors = _run_alone(_limited([rustc, "--edition", "2021", "--test", "-A", "warnings", "-C", "opt-level=1",
                                        "-o", str(exe), str(src)], RUSTC_CPU_S), work, RUSTC_WALL_S)
    if code != 0:
        first = next((ln for ln in errors.splitlines() if ln.startswith("error")), errors.strip())
        if code is None:
            first = f"rustc still running after {RUSTC_WALL_S:g} s of wall-clock time"
        elif _out_of_cpu(code) and not first.startswith("error"):
            first = f"rustc used its {RUSTC_CPU_S:g} s of CPU time without finishing"
        return False, False, first[:300]
    code, output = _run_alone(_limited([str(exe), "--test-threads", "1"], timeout, OUTPUT_BLOCKS), work, wall)
    if code is None:
        return True, False, (f"tests still running after {wall:g} s of wall-clock time, using less than "
                             f"{timeout:g} s of CPU: blocked or sleeping")
    if _out_of_cpu(code):
        return True, False, f"tests used {max(1, math.ceil(timeout))} s of CPU time without finishing (endless loop?)"
    if code != 0:
        failed = [ln for ln in output.splitlines() if "panicked" in ln or ln.startswith("test ") and "FAILED" in ln]
        return True, False, (failed[0] if failed else f"tests exited with {code}")[:300]
    return True, True, ""


def score(problems: list[Problem], predictions: list[str], rustc: str, log,
          shown: list[bool] | None = None, as_shown: list[Result] | None = None) -> list[Outcome]:
    """Each prediction compiled and tested, one program per CPU at a time (rustc compiles a small one on one core),
    each in a folder of its own; with `as_shown` (run_tasks' results with `editor`), each shown suggestion's program
    too, where it is not the prediction's."""
    shown = shown if shown is not None else [True] * len(problems)
    pairs = list(zip(problems, predictions, strict=True))
    sources = [pr.program(pred) for pr, pred in pairs]
    accepted = [None if r is None or not r.shown else pr.shown_program(r.shown, r.shown_range)
                for pr, r in zip(problems, as_shown or [None] * len(problems), strict=True)]
    todo = list(dict.fromkeys([*sources, *filter(None, accepted)]))  # each distinct program once, in order
    with tempfile.TemporaryDirectory(prefix="m31r-exec-") as tmp:
        def one(k: int) -> tuple[bool, bool, str]:
            work = Path(tmp) / str(k)
            work.mkdir()
            return run_program(todo[k], work, rustc)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            built = {}
            for k, result in enumerate(pool.map(one, range(len(todo)))):
                built[todo[k]] = result
                if (k + 1) % 20 == 0:
                    log(f"  {k + 1}/{len(todo)} compiled and tested")
    out = []
    for k, (pr, pred) in enumerate(pairs):
        compiles, passes, error = built[sources[k]]
        p, g = normalize(pred), normalize(pr.middle)
        o = Outcome(pr.name, pr.kind, pr.middle, pred, p == g, round(edit_similarity(p, g), 4), compiles, passes,
                    error, shown[k])
        if as_shown is not None:
            r, program = as_shown[k], accepted[k]
            o.as_shown, o.shown_exact = r.shown, r.shown_exact
            o.shown_passes, o.shown_error = ((built[program][1], built[program][2]) if program is not None
                                             else (False, f"nothing shown ({r.shown_why})"))
        out.append(o)
    return out


def complete(engine, problems: list[Problem], max_tokens: int, beams: int, log,
             as_shown: bool = True) -> tuple[list[str], list[bool], list[Result] | None]:
    """Each problem's completion as the daemon serves it (eval_fim.run_tasks), whether the editors would show it,
    and (`as_shown`) the results that say what they would show at that cursor."""
    tasks = [Task("multi" if pr.kind == "body" else "single", pr.name, pr.prefix.count("\n"), pr.prefix, pr.suffix,
                  pr.middle) for pr in problems]
    results = run_tasks(engine, tasks, max_tokens, max_tokens, log, beams=beams,
                        editor=editor_settings(MIN_PROBABILITY) if as_shown else None)
    return ([r.prediction for r in results], [confident(r.line_logprob, MIN_PROBABILITY) for r in results],
            results if as_shown else None)


def summary(outcomes: list[Outcome]) -> dict:
    n = len(outcomes)

    def share(flag: str) -> float:
        return round(sum(getattr(o, flag) for o in outcomes) / max(n, 1), 4)

    out = {"n": n, "passes": share("passes"), "compiles": share("compiles"), "exact": share("exact"),
           "edit_similarity": round(sum(o.edit_similarity for o in outcomes) / max(n, 1), 4),
           "shown": sum(o.shown for o in outcomes), "shown_passing": sum(o.shown and o.passes for o in outcomes)}
    if outcomes and all(o.shown_passes is not None for o in outcomes):
        # what the editor shows at each cursor (Outcome.as_shown): passing once accepted, the reference, and shown
        out["as_shown"] = {"passes": share("shown_passes"), "exact": share("shown_exact"),
                           "shown": sum(bool(o.as_shown) for o in outcomes)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, help="the model to complete with (omit with --references)")
    p.add_argument("--references", action="store_true", help="test the reference middles instead of a model's")
    p.add_argument("--problems", type=Path, default=PROBLEMS, help="folder of problem files")
    p.add_argument("--max-tokens", type=int, default=128, help="max new tokens of a body (make eval's)")
    p.add_argument("--beams", type=int, default=3, help="beam width for line tasks (the daemon's --beams)")
    p.add_argument("--no-lines", action="store_true", help="body tasks only")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", default="none", help="weights as the daemon's --quant (none: as stored)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rustc", default="rustc", help="the Rust compiler to test with")
    p.add_argument("--no-as-shown", action="store_true",
                   help="skip the 'as shown' scores (what the editor shows at each cursor, compiled and tested)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.references and args.bundle is None:
        p.error("give --bundle (a model to complete with) or --references")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rustc = shutil.which(args.rustc)
    if rustc is None:
        raise SystemExit(f"{args.rustc!r} not found: this evaluation compiles completions (Debian: apt-get install "
                         "rustc, or --rustc PATH)")
    version = subprocess.run([rustc, "--version"], capture_output=True, text=True).stdout.strip()
    bodies = load_problems(args.problems)
    if not bodies:
        raise SystemExit(f"no problem files (*.rs) in {args.problems}")
    problems = bodies + ([] if args.no_lines else [line for pr in bodies for line in pr.lines()])
    t0 = time.perf_counter()
    if args.references:
        predictions, shown, model, results = [pr.middle for pr in problems], None, {"model": "references"}, None
    else:
        from m31r.engine import Engine

        engine = Engine(args.bundle, dtype=args.dtype, threads=args.threads,
                        quant=None if args.quant == "none" else args.quant)
        model = {"model": engine.bundle.model_id, "fingerprint": engine.bundle.fingerprint, "dtype": args.dtype,
                 "quant": engine.quant, "beams": args.beams}
        log(f"{engine.bundle.model_id}: {len(bodies)} bodies and {len(problems) - len(bodies)} lines")
        predictions, shown, results = complete(engine, problems, args.max_tokens, args.beams, log,
                                               not args.no_as_shown)
    outcomes = score(problems, predictions, rustc, log, shown, results)
    kinds = [k for k in ("body", "line") if any(o.kind == k for o in outcomes)]
    report = {**model, "rustc": version, "problems": str(args.problems),
              **{k: summary([o for o in outcomes if o.kind == k]) for k in kinds},
              "seconds": round(time.perf_counter() - t0, 1), "outcomes": [asdict(o) for o in outcomes]}
    with_shown = shown is not None  # references are no model's: nothing is shown or hidden
    print(f"\nexecution evaluation of {model['model']} ({version})")
    for o in outcomes:
        if o.kind == "body":
            mark = "pass" if o.passes else "runs, fails" if o.compiles else "no build"
            print(f"  {o.name:<22} {mark:<12} {'' if o.shown else 'hidden':<7} edit {o.edit_similarity:.2f}  "
                  f"{o.error}")
    with_as_shown = results is not None
    print(f"{'tasks':<7} {'n':>4} {'passes':>7} {'compiles':>9} {'exact':>7} {'edit-sim':>9}"
          + (f" {'shown':>6} {'shown+pass':>11}" if with_shown else "")
          + (f" {'as shown: passes':>16} {'exact':>7}" if with_as_shown else ""))
    for k in kinds:
        s = report[k]
        name = {"body": "bodies", "line": "lines"}[k]
        a = s.get("as_shown")
        print(f"{name:<7} {s['n']:>4} {s['passes']:>7.1%} {s['compiles']:>9.1%} {s['exact']:>7.1%} "
              f"{s['edit_similarity']:>9.3f}" + (f" {s['shown']:>6} {s['shown_passing']:>11}" if with_shown else "")
              + (f" {a['passes']:>16.1%} {a['exact']:>7.1%}" if a else ""))
    print(f"({report['seconds']} s" + (f"; shown: what the editors would show, the first line at least "
                                         f"{MIN_PROBABILITY:g} likely)" if with_shown else ")"))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not args.references or all(o.passes for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

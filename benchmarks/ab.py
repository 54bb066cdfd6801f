"""`make bench-ab`: is this tree slower than another revision? An interleaved A/B run of one benchmark command.

Benchmark figures on a shared 2-core machine drift by more than most regressions (load from other jobs, thermal
state), so one run of each side proves nothing. This checks out BASE (A) into a temporary `git worktree`
(removed afterwards) and runs the same command alternately in A and in the current working tree (B, uncommitted
changes included) for N rounds, swapping which side goes first each round (ABBA...) so that a drift in the
machine's speed lands on both sides alike. It then prints, per figure, the median of A and of B, the ratio B/A
and a noise band (the larger relative spread, (max - min) / median, of the two sides' rounds, and never less than
--tolerance), and flags a regression only when B is worse than A by more than that band.

Both sides run the current interpreter (the .venv's), each with its own tree's source first on PYTHONPATH. The
editable install maps `m31r_protocol`, `m31r_lsp` and `m31r_http` to this checkout's folders through a finder
that a plain PYTHONPATH does not override for renamed packages, so each side also gets a folder of links named as
its own pyproject.toml's package-dir says; the modules each side imports are printed and checked to lie in its
own tree before any round runs.

The command is run with cwd = the tree; `{python}` is replaced by the interpreter and `{out}` by a JSON file it
must write. Figures are dotted paths into that JSON; one ending in `tok_s` or `per_s`, or given with a leading
`+`, is better higher, any other better lower. Without --figure, every numeric leaf ending in `_ms`, `_s` or
`per_s` is compared.

    python benchmarks/ab.py --base f4fca49 --rounds 3
    python benchmarks/ab.py --base main --figure results.x.step_ms -- {python} bench.py --out {out}

Writes bench-results/ab.json; exits 1 when a figure regressed beyond the noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Cheap and meaningful: the mini shape's decode and prefill, fp32 (the accuracy reference bench_speed always runs)
# and int8 (the daemon's default weights) on one thread; ~20 s a run on a 2-core CPU.
DEFAULT_COMMAND = ["{python}", "benchmarks/bench_speed.py", "--config", "configs/model/mini.yaml", "--quick",
                   "--precisions", "int8", "--threads", "1", "--long-context", "0", "--prefill-lengths", "128",
                   "--decode-tokens", "16", "--out", "{out}"]
DEFAULT_FIGURES = ["results.fp32.decode_short_ms", "results.int8.decode_short_ms",
                   "results.fp32.prefill_128_tok_s", "results.int8.prefill_128_tok_s"]


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()


def package_links(tree: Path, into: Path) -> list[str]:
    """Links named after the import packages that the tree's pyproject.toml maps to other folders (package-dir),
    so that PYTHONPATH finds the tree's own copy before the editable install's finder; the top-level packages."""
    into.mkdir(parents=True, exist_ok=True)
    pyproject = tree / "pyproject.toml"
    tool = tomllib.loads(pyproject.read_text()).get("tool", {}).get("setuptools", {}) if pyproject.exists() else {}
    dirs = tool.get("package-dir", {}) if isinstance(tool.get("package-dir"), dict) else {}
    for name, folder in dirs.items():
        if name and name != folder and (tree / folder).is_dir():
            (into / name).symlink_to(tree / folder, target_is_directory=True)
    packages = tool.get("packages", [])
    return sorted({p.split(".")[0] for p in packages if isinstance(p, str)} | {n for n in dirs if n})


def side_env(tree: Path, links: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PYTHONPATH": os.pathsep.join([str(links), str(tree)])}


def imported_files(python: str, tree: Path, env: dict[str, str], modules: list[str]) -> dict[str, str]:
    """Where each module resolves for this side (real paths); exits if one resolves outside the tree."""
    code = ("import importlib.util, json, os, sys\n"
            "out = {}\n"
            "for m in sys.argv[1:]:\n"
            "    s = importlib.util.find_spec(m)\n"
            "    out[m] = os.path.realpath(s.origin) if s and s.origin else None\n"
            "print(json.dumps(out))\n")
    proc = subprocess.run([python, "-c", code, *modules], cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"could not resolve {modules} in {tree}:\n{proc.stderr[-2000:]}")
    files = json.loads(proc.stdout)
    root = os.path.realpath(tree) + os.sep
    if stray := {m: f for m, f in files.items() if f and not f.startswith(root)}:
        sys.exit(f"modules resolve outside {tree}: {stray}")
    return files


def run_once(command: list[str], python: str, tree: Path, env: dict[str, str], out: Path) -> dict:
    """One run of the command in `tree`; the JSON it wrote."""
    out.unlink(missing_ok=True)
    cmd = [a.replace("{python}", python).replace("{out}", str(out)) for a in command]
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if proc.returncode or not out.exists():
        sys.exit(f"{' '.join(cmd)} failed in {tree} (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    return json.loads(out.read_text())


def leaves(data: object, prefix: str = "") -> dict[str, float]:
    """Every numeric leaf of a JSON value, by dotted path."""
    if isinstance(data, dict | list):
        items = data.items() if isinstance(data, dict) else enumerate(data)  # a list's items by index: typing.1.x
        return {k: v for key, val in items for k, v in leaves(val, f"{prefix}{key}.").items()}
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return {prefix.rstrip("."): float(data)}
    return {}


def higher_is_better(path: str) -> bool:
    return path.startswith("+") or path.endswith(("tok_s", "per_s"))


def default_figures(sample: dict) -> list[str]:
    return [p for p in leaves(sample) if p.rsplit(".", 1)[-1].endswith(("_ms", "_s", "per_s"))]


def compare(a: list[float], b: list[float], higher: bool, tolerance: float) -> dict:
    """Medians, B/A and the verdict: B is worse (or better) than A only beyond the rounds' own spread."""
    ma, mb = statistics.median(a), statistics.median(b)
    spread = max((max(x) - min(x)) / abs(statistics.median(x)) if statistics.median(x) else 0.0 for x in (a, b))
    noise = max(spread, tolerance)
    ratio = mb / ma if ma else float("inf")
    worse = (1 / ratio - 1 if ratio else float("inf")) if higher else ratio - 1  # > 0: B is worse by this fraction
    verdict = "regression" if worse > noise else "improvement" if -worse > noise else "within noise"
    return {"a": a, "b": b, "median_a": ma, "median_b": mb, "ratio_b_over_a": ratio, "higher_is_better": higher,
            "worse_by": worse, "noise": noise, "verdict": verdict}


def table(figures: dict[str, dict]) -> str:
    head = f"{'figure':42} {'median A':>10} {'median B':>10} {'B/A':>7} {'noise':>7}  verdict"
    lines = [head, "-" * len(head)]
    for name, f in figures.items():
        better = "higher" if f["higher_is_better"] else "lower"
        lines.append(f"{name:42} {f['median_a']:>10.4g} {f['median_b']:>10.4g} {f['ratio_b_over_a']:>7.3f} "
                     f"{100 * f['noise']:>6.1f}%  {f['verdict']} ({better} is better)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the git revision to compare against (A)")
    ap.add_argument("--rounds", type=int, default=5, help="runs of each side, interleaved (default 5)")
    ap.add_argument("--figure", action="append", default=None,
                    help="a dotted path into the command's JSON; repeat for several (default: the decode and "
                         "prefill figures of the default command, or every *_ms/*_s/*per_s leaf)")
    ap.add_argument("--tolerance", type=float, default=0.03,
                    help="the least noise band, as a fraction (default 0.03)")
    ap.add_argument("--python", default=sys.executable, help="the interpreter both sides run (default: this one)")
    ap.add_argument("--repo", type=Path, default=None, help="the working tree to compare (B; default: this one)")
    ap.add_argument("--out", type=Path, default=REPO / "bench-results" / "ab.json", help="where the JSON goes")
    ap.add_argument("command", nargs="*", help="the benchmark command, after --, with {python} and {out}")
    args = ap.parse_args(argv)
    if args.rounds < 2:  # one round has no spread: the band would be --tolerance alone, and noise a verdict
        ap.error(f"--rounds must be at least 2 (the noise band is the rounds' own spread), not {args.rounds}")
    if args.tolerance < 0:
        ap.error(f"--tolerance is a fraction, 0 or more, not {args.tolerance:g}")
    command = args.command or DEFAULT_COMMAND
    figures = args.figure or (DEFAULT_FIGURES if not args.command else None)
    tree_b = Path(git(args.repo or Path.cwd(), "rev-parse", "--show-toplevel"))
    base_commit = git(tree_b, "rev-parse", "--verify", f"{args.base}^{{commit}}")
    with tempfile.TemporaryDirectory(prefix="m31r-ab-") as tmp_name:
        tmp = Path(tmp_name)
        tree_a = tmp / "base"
        git(tree_b, "worktree", "add", "--detach", str(tree_a), base_commit)
        try:
            return compare_trees(args, command, figures, tmp, {"A": tree_a, "B": tree_b}, base_commit)
        finally:
            git(tree_b, "worktree", "remove", "--force", str(tree_a))
            git(tree_b, "worktree", "prune")


def compare_trees(args: argparse.Namespace, command: list[str], figures: list[str] | None, tmp: Path,
                  trees: dict[str, Path], base_commit: str) -> int:
    envs, modules = {}, {}
    for side, tree in trees.items():
        names = package_links(tree, tmp / f"links-{side}")
        envs[side] = side_env(tree, tmp / f"links-{side}")
        modules[side] = imported_files(args.python, tree, envs[side], names)
        print(f"# {side} = {tree}: " + ", ".join(f"{m} -> {f}" for m, f in modules[side].items()), flush=True)
    runs: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.rounds):
        for side in ("A", "B") if i % 2 == 0 else ("B", "A"):
            t0 = time.perf_counter()
            runs[side].append(run_once(command, args.python, trees[side], envs[side], tmp / f"out-{side}.json"))
            print(f"# round {i + 1}/{args.rounds} {side}: {time.perf_counter() - t0:.1f}s", flush=True)
    flat = {side: [leaves(r) for r in rs] for side, rs in runs.items()}
    paths = figures or default_figures(runs["B"][0])
    results = {}
    for path in paths:
        key = path.lstrip("+-")
        if missing := [s for s in flat if any(key not in r for r in flat[s])]:
            print(f"# {key}: missing on side {', '.join(missing)}", file=sys.stderr)
            continue
        results[key] = compare([r[key] for r in flat["A"]], [r[key] for r in flat["B"]],
                               higher_is_better(path) and not path.startswith("-"), args.tolerance)
    head_desc = git(trees["B"], "rev-parse", "--short", "HEAD")
    dirty = bool(git(trees["B"], "status", "--porcelain", "--untracked-files=no"))
    from m31r.cpu import describe  # standard library only: ab.py stays torch-free

    cpu = describe()  # both sides ran here, on this CPU: the figures compare only with each other
    print(f"\nA = {args.base} ({base_commit[:9]}), B = working tree at {head_desc}{' + changes' if dirty else ''}; "
          f"{args.rounds} interleaved rounds; load avg {os.getloadavg()[0]:.1f}\nCPU: {cpu}")
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "base": args.base, "base_commit": base_commit, "head": head_desc, "dirty": dirty, "rounds": args.rounds,
        "command": command, "tolerance": args.tolerance, "python": args.python,
        "modules": modules, "figures": results, "cpu": cpu, "cpu_count": os.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
    }, indent=2) + "\n")
    print(f"wrote {args.out}")
    regressed = [k for k, f in results.items() if f["verdict"] == "regression"]
    if regressed:
        print(f"regressed beyond the noise: {', '.join(regressed)}", file=sys.stderr)
    return 1 if regressed or not results else 0


if __name__ == "__main__":
    raise SystemExit(main())

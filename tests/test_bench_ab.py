"""benchmarks/ab.py on a throwaway git repository: both revisions run, each imports its own tree's package (through
a renamed package-dir, as m31r_protocol is), the ratio is reported, and a deliberate slowdown in the working tree
is flagged while an unchanged figure is not. Torch-free; a few seconds."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

AB = Path(__file__).resolve().parents[1] / "benchmarks" / "ab.py"
_spec = importlib.util.spec_from_file_location("bench_ab", AB)
ab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ab)
BENCH = """\
import json, sys, time
import m31r_demo
t0 = time.perf_counter()
for _ in range(3):
    time.sleep(m31r_demo.DELAY)
step = (time.perf_counter() - t0) / 3
json.dump({"run": {"step_ms": 1000 * step, "rate_tok_s": 1 / step, "fixed_s": 1.0}, "label": "x"},
          open(sys.argv[sys.argv.index("--out") + 1], "w"))
"""


def git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_ab_flags_a_slowdown_in_the_working_tree(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "demo").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "m31r_demo" = "demo" }\n'
                                         'packages = ["m31r_demo"]\n')
    (repo / "demo" / "__init__.py").write_text("DELAY = 0.01\n")
    (repo / "bench.py").write_text(BENCH)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "fast")
    (repo / "demo" / "__init__.py").write_text("DELAY = 0.04\n")  # B: uncommitted, 4x slower
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(AB), "--base", "HEAD", "--rounds", "3", "--repo", str(repo),
                           "--out", str(out), "--", "{python}", "bench.py", "--out", "{out}"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # a regression fails the run
    report = json.loads(out.read_text())
    figs = report["figures"]
    assert set(figs) == {"run.step_ms", "run.rate_tok_s", "run.fixed_s"}  # numeric timing leaves, not "label"
    step = figs["run.step_ms"]
    assert len(step["a"]) == len(step["b"]) == 3
    assert 2.0 < step["ratio_b_over_a"] < 6.0 and step["verdict"] == "regression"
    assert figs["run.rate_tok_s"]["higher_is_better"] and figs["run.rate_tok_s"]["verdict"] == "regression"
    assert figs["run.fixed_s"]["ratio_b_over_a"] == 1.0 and figs["run.fixed_s"]["verdict"] == "within noise"
    # Each side resolved the renamed package to its own tree: A the temporary worktree, B the repository.
    a_file, b_file = report["modules"]["A"]["m31r_demo"], report["modules"]["B"]["m31r_demo"]
    assert b_file == os.path.realpath(repo / "demo" / "__init__.py")
    assert a_file != b_file and a_file.endswith(os.path.join("demo", "__init__.py"))
    for name in ("median A", "median B", "B/A", "run.step_ms"):
        assert name in proc.stdout
    # The temporary worktree is gone.
    listed = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(listed.strip().splitlines()) == 1


def test_ab_sees_no_regression_between_equal_trees(tmp_path: Path):
    repo = tmp_path / "repo"
    (repo / "demo").mkdir(parents=True)
    (repo / "pyproject.toml").write_text('[tool.setuptools]\npackage-dir = { "m31r_demo" = "demo" }\n')
    (repo / "demo" / "__init__.py").write_text("DELAY = 0.0\n")
    (repo / "bench.py").write_text(BENCH)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", ".")
    git(repo, "commit", "-q", "-m", "one")
    out = tmp_path / "ab.json"
    proc = subprocess.run([sys.executable, str(AB), "--base", "HEAD", "--rounds", "2", "--repo", str(repo),
                           "--out", str(out), "--figure", "run.fixed_s", "--", "{python}", "bench.py", "--out",
                           "{out}"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(json.loads(out.read_text())["figures"]) == ["run.fixed_s"]


def test_figures_lists_and_the_noise_band():
    assert ab.leaves({"typing": [{"mode": "warm", "done_ms": 3}], "ok": True, "n": 2.5}) == {"typing.0.done_ms": 3.0,
                                                                                             "n": 2.5}
    # B 10% slower; A's rounds spread 20%: within noise. The same slowdown with tight rounds is a regression.
    assert ab.compare([9.0, 10.0, 11.0], [11.0, 11.0, 11.0], False, 0.03)["verdict"] == "within noise"
    assert ab.compare([10.0, 10.1, 10.0], [11.0, 11.0, 11.1], False, 0.03)["verdict"] == "regression"
    # Higher is better: B's lower throughput is the regression, B's higher one an improvement.
    assert ab.compare([100.0, 101.0], [80.0, 80.5], True, 0.03)["verdict"] == "regression"
    assert ab.compare([100.0, 101.0], [120.0, 121.0], True, 0.03)["verdict"] == "improvement"

"""The evaluation's figures do not depend on how busy the machine is, and say what they are over: eval_exec limits a
test program's CPU time, not its wall-clock time (a machine also training fails no program that passes on an idle one),
with a wall-clock backstop for one that sleeps or blocks; eval_fim's perplexity records the window it used, warns when
a short model's context cuts it, and compare_evals says that two perplexities over different windows are not
comparable."""

from __future__ import annotations

from pathlib import Path

from benchmark_util import RUSTC, load, needs_rustc


def one_test(body: str) -> str:
    return f"#[cfg(test)]\nmod tests {{\n    #[test]\n    fn t() {{\n{body}\n    }}\n}}\n"


@needs_rustc
def test_a_passing_program_slower_by_the_clock_than_its_cpu_limit_passes(tmp_path: Path, monkeypatch):
    """A test that waits 2 s (as a passing test does on a loaded machine, its CPU time unchanged) under a 1 s limit:
    the limit is CPU time, so it passes; a wall-clock limit failed it, and the figure depended on the load."""
    eval_exec = load(monkeypatch, "eval_exec")
    source = one_test("        std::thread::sleep(std::time::Duration::from_millis(2000));\n"
                      "        assert_eq!(1 + 1, 2);")
    assert eval_exec.run_program(source, tmp_path, RUSTC, timeout=1.0) == (True, True, "")


@needs_rustc
def test_an_endless_loop_ends_on_its_cpu_time_and_a_sleeper_on_the_backstop(tmp_path: Path, monkeypatch):
    """A test that spins is stopped by its CPU limit, a test that sleeps for ever (using none) by the wall-clock
    backstop; both count as failing, each with its own reason. Neither gets input to wait on: stdin is empty."""
    eval_exec = load(monkeypatch, "eval_exec")
    (tmp_path / "spin").mkdir()
    spin = one_test("        let mut x = 0u64;\n        loop { x = std::hint::black_box(x.wrapping_add(1)); }")
    assert eval_exec.run_program(spin, tmp_path / "spin", RUSTC, timeout=1.0) == (
        True, False, "tests used 1 s of CPU time without finishing (endless loop?)")
    (tmp_path / "sleep").mkdir()
    sleeper = one_test("        std::thread::sleep(std::time::Duration::from_secs(3600));")
    assert eval_exec.run_program(sleeper, tmp_path / "sleep", RUSTC, timeout=1.0, wall=2.0) == (
        True, False,
        "tests still running after 2 s of wall-clock time, using less than 1 s of CPU: blocked or sleeping")
    (tmp_path / "stdin").mkdir()
    reader = one_test("        let mut s = String::new();\n        std::io::stdin().read_line(&mut s).unwrap();\n"
                      "        assert!(s.is_empty());")
    assert eval_exec.run_program(reader, tmp_path / "stdin", RUSTC, timeout=1.0, wall=60.0) == (True, True, "")


def test_perplexity_over_a_short_models_windows_warns_and_records_them(tiny_engine, monkeypatch, capsys):
    """The tiny model's context is 512 tokens: asked for 1000-token windows it gets 512-token ones, says so on one
    stderr line naming both numbers, and records the window used beside the one asked for."""
    eval_fim = load(monkeypatch, "eval_fim")
    assert tiny_engine.config.max_context == 512
    ppl = eval_fim.perplexity(tiny_engine, ["fn main() {}\n" * 200], 2, 1000)
    assert (ppl["windows"], ppl["tokens"], ppl["context"], ppl["requested_context"]) == (2, 1024, 512, 1000)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: ") and "512" in err[0] and "1000" in err[0]
    assert "not comparable" in err[0]
    ppl = eval_fim.perplexity(tiny_engine, ["fn main() {}\n" * 200], 2, 100)
    assert (ppl["context"], ppl["requested_context"]) == (100, 100) and capsys.readouterr().err == ""


def test_compare_evals_says_perplexities_over_different_windows_are_not_comparable(monkeypatch):
    """Two results whose perplexity windows differ are flagged, in the JSON and the table; equal windows compare
    plainly; an older result without `context` has its window read from its tokens per window."""
    ce = load(monkeypatch, "compare_evals")
    tasks = [{"kind": "single", "path": "c/src/a.rs", "line": 1, "target": "x", "exact": True, "edit_similarity": 1.0}]

    def result(model: str, ppl: dict) -> dict:
        return {"model": model, "tasks": tasks, "perplexity": ppl}

    long = result("a@1", {"windows": 4, "context": 1024, "tokens": 4096, "perplexity": 3.5, "bits_per_byte": 1.1})
    short = result("b@1", {"windows": 4, "context": 512, "tokens": 2048, "perplexity": 4.0, "bits_per_byte": 1.3})
    older = result("c@1", {"windows": 4, "tokens": 4096, "perplexity": 3.4, "bits_per_byte": 1.0})
    r = ce.compare(long, short)
    assert r["perplexity"]["windows"] == [1024, 512] and "not comparable" in r["perplexity"]["not_comparable"]
    text = ce.table(r)
    assert "base 3.500 (1024-token windows), candidate 4.000 (512-token windows)" in text
    assert "windows of 1024 and 512 tokens" in text and "not comparable" in text
    same = ce.compare(older, long)
    assert same["perplexity"]["windows"] == [1024, 1024] and "not_comparable" not in same["perplexity"]
    assert "not comparable" not in ce.table(same)
    assert "perplexity" not in ce.compare(long, result("d@1", {"windows": 0}))  # no perplexity: nothing to compare

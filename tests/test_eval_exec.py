"""benchmarks/eval_exec.py: its problems are sound (each reference passes its tests, a body that does nothing
fails them), its marker parsing refuses malformed files by name, and a model's completions go through rustc."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUSTC = shutil.which("rustc")
needs_rustc = pytest.mark.skipif(RUSTC is None, reason="rustc is not installed (apt-get install rustc)")


@pytest.fixture(scope="module")
def eval_exec():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("eval_exec", REPO / "benchmarks" / "eval_exec.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["eval_exec"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_every_problem_parses_with_a_middle_and_tests(eval_exec):
    problems = eval_exec.load_problems()
    assert len(problems) >= 40
    assert len({p.name for p in problems}) == len(problems)
    for p in problems:
        assert p.middle.strip(), p.name
        assert p.middle.endswith("\n") and p.prefix.endswith("\n"), p.name  # whole lines: the cursor at a line start
        assert "#[test]" in p.tests, p.name
        assert "@" not in p.prefix + p.middle + p.suffix, p.name  # no marker left in what the model sees
        assert p.program(p.middle).count("#[test]") == p.tests.count("#[test]")


def test_line_tasks_rebuild_the_same_program(eval_exec):
    """Each line task with its reference line in place is the body task's program, character for character; lines
    without a letter or digit (`}`) are no tasks."""
    problems = {p.name: p for p in eval_exec.load_problems()}
    gcd = problems["gcd"]
    lines = gcd.lines()
    assert [(t.name, t.kind, t.middle) for t in lines] == [("gcd:1", "line", "b = a % b;"), ("gcd:2", "line", "a = t;")]
    assert lines[0].prefix.endswith("let t = b;\n        ") and lines[0].suffix.startswith("\n        a = t;\n    }")
    for p in problems.values():
        for t in p.lines():
            assert t.program(t.middle) == p.program(p.middle), t.name
    assert [t.name for t in problems["clamp"].lines()] == [f"clamp:{i}" for i in range(1, 7)]  # not line 7, `}`


def test_a_file_without_its_markers_is_refused_by_name(eval_exec, tmp_path: Path):
    bad = tmp_path / "no_end.rs"
    bad.write_text("fn f() -> u8 {\n// @middle\n    1\n}\n// @tests\n#[test]\nfn t() {}\n")
    with pytest.raises(ValueError, match=r"no_end\.rs: needs exactly one of each marker line.*'// @end' x0"):
        eval_exec.parse_problem(bad)
    swapped = tmp_path / "swapped.rs"
    swapped.write_text("// @end\nfn f() {\n// @middle\n}\n// @tests\n")
    with pytest.raises(ValueError, match=r"swapped\.rs: markers must come in the order"):
        eval_exec.parse_problem(swapped)


@needs_rustc
def test_every_reference_passes_and_a_body_that_does_nothing_fails(eval_exec):
    """The references pass (the command's exit status says so; a line task's program is its body's, above), and
    `unimplemented!()` in place of each middle passes none: every problem's tests can fail."""
    assert eval_exec.main(["--references", "--no-lines"]) == 0
    problems = eval_exec.load_problems()
    out = eval_exec.score(problems, ["        unimplemented!()\n"] * len(problems), RUSTC, lambda m: None)
    assert [o.name for o in out if o.passes] == []
    assert all(o.error for o in out)


@needs_rustc
def test_a_wrong_loop_body_is_stopped_and_reported(eval_exec, tmp_path: Path):
    gcd = next(p for p in eval_exec.load_problems() if p.name == "gcd")
    compiles, passes, error = eval_exec.run_program(gcd.program("        a = t;\n"), tmp_path, RUSTC, timeout=2.0)
    assert (compiles, passes) == (True, False)
    assert error == "tests used 2 s of CPU time without finishing (endless loop?)"  # CPU time: whatever the load
    compiles, passes, error = eval_exec.run_program(gcd.program("        b = a % ;\n"), tmp_path, RUSTC)
    assert (compiles, passes) == (False, False) and error.startswith("error")


@needs_rustc
def test_a_model_completes_compiles_and_reports(eval_exec, tiny_bundle, tmp_path: Path):
    """End to end on the tiny random model: its completions are noise, so only the pipeline is checked."""
    folder = tmp_path / "problems"
    folder.mkdir()
    for name in ("stack", "fahrenheit"):
        shutil.copy(eval_exec.PROBLEMS / f"{name}.rs", folder)
    out = tmp_path / "exec.json"
    assert eval_exec.main(["--bundle", str(tiny_bundle.path), "--problems", str(folder), "--max-tokens", "8",
                           "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["body"]["n"] == report["line"]["n"] == 2
    assert 0 <= report["body"]["shown_passing"] <= report["body"]["shown"] <= 2
    assert [(o["name"], o["kind"]) for o in report["outcomes"]] == [
        ("fahrenheit", "body"), ("stack", "body"), ("fahrenheit:1", "line"), ("stack:1", "line")]
    assert "\n" not in report["outcomes"][2]["prediction"]  # a line task's answer is one line
    assert report["rustc"].startswith("rustc ")
    for o in report["outcomes"]:
        assert o["passes"] <= o["compiles"]
        assert o["passes"] or o["error"]

"""benchmarks/eval_leakage.py: a val file copied into training (reindented, one line changed) is reported, at file
and task level, and splits a saved result into leaked and clean tasks; an unrelated val file is not. Torch-free."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "eval_leakage.py"
_spec = importlib.util.spec_from_file_location("eval_leakage", SCRIPT)
el = importlib.util.module_from_spec(_spec)
sys.modules["eval_leakage"] = el  # dataclasses look their module up there
_spec.loader.exec_module(el)


def _rust(stem: str, n: int) -> str:
    """A file of n distinct small functions (a few hundred distinct 5-shingles)."""
    return "".join(f"pub fn {stem}_{i}(x: u32) -> u32 {{\n    let y = x * {i + 3};\n    y + {stem}_{i}_k\n}}\n\n"
                   for i in range(n))


def _write(path: Path, rows: list[tuple[str, str, str]]) -> None:
    path.write_text("".join(json.dumps({"path": p, "crate": c, "crate_path": p, "text": t}) + "\n"
                            for p, c, t in rows))


def test_a_copied_val_file_is_reported_and_an_unrelated_one_is_not(tmp_path: Path) -> None:
    corpus = tmp_path / "data" / "corpus"
    corpus.mkdir(parents=True)
    leaky, clean = _rust("alpha", 12), _rust("omega", 12)
    _write(corpus / "val.jsonl", [("reg/leaky-1.0/src/lib.rs", "leaky", leaky),
                                  ("reg/clean-1.0/src/lib.rs", "clean", clean)])
    # The copy inside a fork: indented one level deeper, one line changed, other code after it.
    copy = "".join("    " + line if line else line for line in leaky.replace("x * 3", "x * 4").splitlines(True))
    _write(corpus / "train.jsonl", [("reg/fork-2.0/src/vendored.rs", "fork", "mod v {\n" + copy + "}\n"),
                                    *[(f"reg/other{i}/src/lib.rs", f"other{i}", _rust(f"beta{i}", 12))
                                      for i in range(3)]])
    line = 6 * 7 + 1  # the `let` line of the seventh function
    lines = leaky.splitlines(True)
    cut = sum(map(len, lines[:line])) + 8
    tasks = [el.eval_fim.Task("single", path, line, text[:cut], text[cut + len(lines[line]) - 9:],
                              lines[line][8:].rstrip("\n"))
             for path, text in (("reg/leaky-1.0/src/lib.rs", leaky), ("reg/clean-1.0/src/lib.rs", clean))]
    results = tmp_path / "eval.json"
    results.write_text(json.dumps({"model": "m@1", "tasks": [
        {"kind": t.kind, "path": t.path, "line": t.line, "target": t.target, "exact": e, "edit_similarity": s}
        for t, e, s in zip(tasks, (True, False), (1.0, 0.5), strict=True)]}))

    report = el.measure(tmp_path / "data", {"eval": tasks}, context_lines=[3, 10], results=[results])

    assert report["files"] == {"exact": 0, "near": 1, "contained": 1, "any": 1}
    assert report["crates"]["any"] == ["leaky"]
    [match] = report["leaky_files"][0]["matches"]
    assert match["path"] == "reg/fork-2.0/src/vendored.rs" and match["jaccard"] > 0.8
    draw = report["draws"]["eval"]
    assert [r["verbatim@3"] for r in draw["per_task"]] == [True, False]
    assert draw["per_task"][0]["train_crates@3"] == ["fork"]
    assert draw["leaked"]["copied@10"] == {"single": 1, "multi": 0}
    split = draw["results"]["split"]["verbatim@3"]["single"]
    assert (split["leaked"]["exact_match"], split["clean"]["exact_match"], split["clean"]["n"]) == (1.0, 0.0, 1)


def test_the_command_line_writes_its_report(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    text = _rust("gamma", 10)
    _write(corpus / "val.jsonl", [("reg/g-1.0/src/lib.rs", "g", text)])
    _write(corpus / "train.jsonl", [("reg/h-1.0/src/lib.rs", "h", text)])  # an exact copy
    out = tmp_path / "leak.json"
    assert el.main(["--data", str(tmp_path), "--no-tasks", "--results", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["files"]["exact"] == 1 and report["crates"]["exact"] == ["g"]
    assert "an exact duplicate" in capsys.readouterr().out

"""benchmarks/compare_evals.py: the paired comparison behind a release decision. Its sign test matches hand-computed
binomial tails, its interval brackets the paired mean, and results of different tasks are refused. Torch-free."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "compare_evals.py"
_spec = importlib.util.spec_from_file_location("compare_evals", SCRIPT)
ce = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ce)


def _result(model: str, exact: list[bool], edit: list[float], kinds: list[str]) -> dict:
    tasks = [{"kind": k, "path": f"c/src/f{i}.rs", "line": i, "target": f"t{i}", "exact": e, "edit_similarity": s}
             for i, (k, e, s) in enumerate(zip(kinds, exact, edit, strict=True))]
    return {"model": model, "tasks": tasks}


def test_sign_test_p_is_the_exact_two_sided_binomial_tail() -> None:
    assert ce.sign_test_p(0, 0) == 1.0
    assert ce.sign_test_p(5, 5) == 1.0
    assert ce.sign_test_p(6, 0) == pytest.approx(2 / 64)  # all six discordant tasks one way
    assert ce.sign_test_p(5, 10) == pytest.approx(2 * sum(math.comb(15, i) for i in range(6)) / 2**15)
    assert ce.sign_test_p(1, 9) == ce.sign_test_p(9, 1) < 0.05


def test_compare_counts_gains_losses_and_brackets_the_edit_difference() -> None:
    kinds = ["single"] * 6 + ["multi"] * 4
    base = _result("a@1", [True, True, False, False, True, False, False, False, True, False],
                   [1.0, 1.0, 0.5, 0.2, 1.0, 0.3, 0.4, 0.1, 1.0, 0.6], kinds)
    cand = _result("b@2", [True, False, True, True, True, True, False, True, True, False],
                   [1.0, 0.9, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.4], kinds)
    r = ce.compare(base, cand)
    s, m = r["single"], r["multi"]
    assert (s["n"], s["gained"], s["lost"]) == (6, 3, 1)
    assert s["exact_base"] == pytest.approx(3 / 6) and s["exact_candidate"] == pytest.approx(5 / 6)
    assert (m["n"], m["gained"], m["lost"]) == (4, 1, 0)
    assert s["edit_diff"] == pytest.approx((0 - 0.1 + 0.5 + 0.8 + 0 + 0.7) / 6)
    low, high = s["edit_diff_95"]
    assert low <= s["edit_diff"] <= high and low < high
    assert "| single (6) | 50.0% | 83.3% | 3 / 1 |" in ce.table(r)


def test_different_tasks_are_refused_in_one_line(tmp_path: Path) -> None:
    a = _result("a@1", [True, False], [1.0, 0.5], ["single", "multi"])
    b = _result("b@1", [True, False], [1.0, 0.5], ["single", "multi"])
    b["tasks"][1]["line"] = 99
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "a.json"), str(tmp_path / "b.json")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.startswith("error: the two results hold different tasks") and proc.stderr.count("\n") == 1


def test_runs_with_different_serving_settings_are_flagged() -> None:
    a = _result("a@1", [True], [1.0], ["single"]) | {"healing": "none", "serving_stops": True}
    b = _result("a@1", [True], [1.0], ["single"]) | {"healing": "whole word", "serving_stops": True}
    r = ce.compare(a, b)
    assert r["settings_differ"] == {"healing": ["none", "whole word"]}
    assert "the runs differ in healing (none / whole word)" in ce.table(r)
    assert "settings_differ" not in ce.compare(a, a)
    assert "settings_differ" not in ce.compare(a, a | {"beams": 1})  # results from before --beams were greedy
    assert ce.compare(a, a | {"beams": 3})["settings_differ"] == {"beams": [1, 3]}


def _draw(exact_single: int, edit_multi: list[float]) -> dict:
    """A result on the deciding draw: 300 single-line tasks, the first `exact_single` right, and 150 multi-line, with
    the seed, token budgets and floor that `make eval-large` runs with."""
    n_s, n_m = ce.DECIDING_DRAW["single"], ce.DECIDING_DRAW["multi"]
    assert len(edit_multi) == n_m
    return _result("m@1", [i < exact_single for i in range(n_s)] + [False] * n_m,
                   [1.0 if i < exact_single else 0.5 for i in range(n_s)] + edit_multi,
                   ["single"] * n_s + ["multi"] * n_m) | {
        "seed": 0, "max_new_tokens": {"single": 48, "multi": 128}, "floor_stop": False,
        "gate": {"min_probability": 0.05}}


def test_the_release_verdict_needs_both_figures_won_on_the_deciding_draw() -> None:
    base = _draw(143, [0.4] * 150)
    win = ce.compare(base, _draw(144, [0.4] * 149 + [0.6]))  # one more line; multi-line +0.0013
    assert win["release"] == {"wins": True, "why": "single-line exact match wins (+1 tasks), multi-line edit "
                              "similarity wins (+0.001)"}
    assert "release rule: the candidate wins both" in ce.table(win)
    # Past the third decimal the multi-line figure is a tie, and a tie is not a win.
    tie = ce.compare(base, _draw(150, [0.4] * 149 + [0.45]))
    assert not tie["release"]["wins"] and "multi-line edit similarity ties (+0.000)" in tie["release"]["why"]
    lost = ce.compare(base, _draw(140, [0.5] * 150))
    assert not lost["release"]["wins"] and "single-line exact match loses (-3 tasks)" in lost["release"]["why"]
    assert "release rule: not a release" in ce.table(lost)
    # make eval's smaller draw does not decide, however the candidate does on it.
    small = ce.compare(_result("a@1", [False, False], [0.0, 0.2], ["single", "multi"]),
                       _result("b@1", [True, False], [1.0, 0.9], ["single", "multi"]))
    assert not small["release"]["wins"] and small["release"]["why"].startswith("not the deciding draw: 1 single")
    other = ce.compare(base | {"beams": 1}, _draw(150, [0.9] * 150) | {"beams": 3})
    assert not other["release"]["wins"] and "settings" in other["release"]["why"]


def test_floor_stop_never_decides_a_release() -> None:
    """eval_fim --floor-stop cuts answers where the editors' floor hides the rest ("for comparison, not for
    releases"): a candidate run with it, or both, does not win however its figures go; the floor itself is a
    setting both runs must share."""
    base, better = _draw(143, [0.4] * 150), _draw(150, [0.6] * 150)
    assert ce.compare(base, better)["release"]["wins"]
    one = ce.compare(base, better | {"floor_stop": True})
    assert one["settings_differ"] == {"floor_stop": [False, True]}
    assert not one["release"]["wins"] and one["release"]["why"].startswith("the candidate ran with --floor-stop")
    both = ce.compare(base | {"floor_stop": True}, better | {"floor_stop": True})
    assert "settings_differ" not in both and not both["release"]["wins"]
    assert both["release"]["why"].startswith("the base and the candidate ran with --floor-stop")
    floor = ce.compare(base, better | {"gate": {"min_probability": 0.2}})
    assert floor["settings_differ"] == {"min_probability": [0.05, 0.2]} and not floor["release"]["wins"]


def test_the_deciding_draw_has_eval_larges_seed_and_token_budgets() -> None:
    """The same tasks counts under another seed or other token budgets are another draw: not the one that decides."""
    base, better = _draw(143, [0.4] * 150), _draw(150, [0.6] * 150)
    seeded = ce.compare(base | {"seed": 1}, better | {"seed": 1})
    assert not seeded["release"]["wins"] and seeded["release"]["why"].startswith(
        "not the deciding draw: the base ran with seed 1")
    cut = {"max_new_tokens": {"single": 48, "multi": 64}}
    short = ce.compare(base | cut, better | cut)
    assert not short["release"]["wins"] and "token budgets {'single': 48, 'multi': 64}" in short["release"]["why"]
    unknown = ce.compare(_draw(143, [0.4] * 150) | {"seed": None}, better | {"seed": None})
    assert not unknown["release"]["wins"]  # a result that does not say its seed does not decide either


def test_the_deciding_settings_are_eval_larges() -> None:
    """DECIDING_SEED and DECIDING_TOKENS follow the Makefile's eval-large and eval_fim.py's defaults."""
    import re

    root = SCRIPT.parents[1]
    recipe = (root / "Makefile").read_text().split("\neval-large:", 1)[1].split("\n\n", 1)[0]
    assert "--n-single 300" in recipe and "--n-multi 150" in recipe
    assert not re.search(r"--seed|--single-tokens|--multi-tokens|--floor-stop", recipe)
    main = (root / "benchmarks" / "eval_fim.py").read_text().split("\ndef main(", 1)[1]

    def default(flag: str) -> int:
        return int(re.search(rf'"{flag}", type=int, default=(\d+)', main).group(1))

    assert default("--seed") == ce.DECIDING_SEED
    assert {"single": default("--single-tokens"), "multi": default("--multi-tokens")} == ce.DECIDING_TOKENS
    assert (ce.DECIDING_DRAW["single"], ce.DECIDING_DRAW["multi"]) == (300, 150)


def test_a_win_must_hold_on_the_tasks_of_files_without_a_look_alike_in_training(tmp_path: Path) -> None:
    """The candidate's one gained single-line task comes from a file with a copy in training: on all tasks it wins,
    on the clean ones it ties, so it is not a release. Without that file's tasks counted as leaked, it is."""
    base = _draw(143, [0.4] * 150)
    cand = _draw(144, [0.4] * 149 + [0.6])
    leaked = base["tasks"][143]["path"]
    files = {}
    for name, r in (("base", base), ("cand", cand)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(r))
    report = tmp_path / "leakage.json"
    report.write_text(json.dumps({"leaky_files": [{"path": leaked, "crate": "c", "matches": []}]}))

    def run(*extra: str) -> dict:
        out = subprocess.run([sys.executable, str(SCRIPT), str(files["base"]), str(files["cand"]), "--json", *extra],
                             capture_output=True, text=True, check=True).stdout
        return json.loads(out)

    r = run("--leaky", str(report))
    assert r["single"]["gained"] == 1 and r["clean"]["single"]["n"] == 299 and r["clean"]["single"]["gained"] == 0
    assert r["clean"]["leaky_files"] == 1
    assert not r["release"]["wins"] and "on the clean tasks" in r["release"]["why"]
    assert run("--leaky", "none")["release"]["wins"]
    assert run()["release"]["wins"]  # the default list names real validation files, none of these


def test_the_default_leaky_list_names_validation_files() -> None:
    leaky = json.loads(ce.LEAKY.read_text())
    assert leaky["dataset_version"] and len(leaky["leaky_files"]) >= 1
    for f in leaky["leaky_files"]:
        assert f["path"].endswith(".rs") and f["crate"] and f["matches"]

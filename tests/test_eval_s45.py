"""The evaluations' "as shown" scores (session 45): each task scored on what the editor shows at its cursor, the
language server's request answered as the daemon answers it and post-processed as the server does. A real `m31r lsp`
talking to a real daemon on the tiny bundle must show exactly what eval_fim says it shows; compare_evals.py compares
the new scores where both results have them and still reads results without them; a kind without clean tasks is said
to have nothing to compare, not a traceback."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_util import REPO, RUSTC, load
from lsp_stdio import Stdio

SCRIPT = REPO / "benchmarks" / "compare_evals.py"


FILE = ("fn add(x: u32, y: u32) -> u32 {\n    let total = x + y;\n    total\n}\n\n"
        "fn main() {\n    let v = add(1, 2);\n    println!(\"{}\", v);\n}\n")


def task(eval_fim, kind: str, line: int, column: int, end_line: int | None = None):
    """The task whose middle runs from (line, column) of FILE to the end of that line (single) or to the start of
    `end_line` (multi), as make_tasks cuts them."""
    lines = FILE.splitlines(keepends=True)
    start = sum(map(len, lines[:line])) + column
    end = sum(map(len, lines[:end_line])) if kind == "multi" else sum(map(len, lines[: line + 1])) - 1
    return eval_fim.Task(kind, "c/src/main.rs", line, FILE[:start], FILE[end:], FILE[start:end])


def tasks(eval_fim) -> list:
    return [task(eval_fim, "single", 1, 16),  # mid-line: `    let total = |x + y;`
            task(eval_fim, "single", 6, 4),  # right after the indentation: the editor's line is blank
            task(eval_fim, "multi", 1, 0, 3),  # add's body, the cursor at the start of the `}` line
            task(eval_fim, "multi", 6, 0, 8)]


def accepted(text: str, cursor: int, shown: str, at: list[int]) -> str:
    return text[: cursor + at[0]] + shown + text[cursor + at[1] :]


async def lsp_shows(sock: Path, docs: list[tuple[str, int]]) -> list[str]:
    """The document each inline suggestion of a real `m31r lsp` (its default settings, no deadline to meet on a busy
    machine) gives once accepted (the text itself where it shows none), one document per cursor (no answer typed
    through from another)."""
    s = await Stdio.spawn(sock)
    s.send("initialize", {"capabilities": {}, "initializationOptions": {"m31r": {
        "debounceMode": "fixed", "debounceMs": 0, "deadlineMs": 60000}}}, msg_id="init")
    await s.answer("init")
    s.send("initialized", {})
    out = []
    for i, (text, cursor) in enumerate(docs):
        uri = f"file:///work/src/t{i}.rs"
        s.send("textDocument/didOpen", {"textDocument": {"uri": uri, "languageId": "rust", "version": 1,
                                                         "text": text}})
        before = text[:cursor]
        position = {"line": before.count("\n"), "character": len(before) - before.rfind("\n") - 1}
        got = await s.request("textDocument/inlineCompletion", {"textDocument": {"uri": uri}, "position": position,
                                                                 "context": {"triggerKind": 2}}, timeout=60)
        items = got["result"]["items"]
        if not items:
            out.append(text)
            continue
        starts = [0] + [k + 1 for k, c in enumerate(text) if c == "\n"]  # (ASCII text: UTF-16 columns are characters)
        r = items[0]["range"]
        a = starts[r["start"]["line"]] + r["start"]["character"]
        b = starts[r["end"]["line"]] + r["end"]["character"]
        out.append(text[:a] + items[0]["insertText"] + text[b:])
    await s.end()
    return out


@pytest.mark.timeout(300)
def test_as_shown_is_what_a_real_language_server_shows(tmp_path: Path, monkeypatch):
    """eval_fim's `shown` for each task, accepted, is the document the real server's suggestion gives at that cursor,
    served by a real daemon: the request (a line's end asks for several lines; a blank line leaves its indentation
    out), the daemon's stops and floor, and the server's gate, cut and policy are theirs, not copies. The bundled model
    (the tiny random one's answers are all dropped as self-repeating or empty) shows some and hides others."""
    from daemon_util import start_daemon, stop_daemon

    from m31r.engine import Engine

    eval_fim = load(monkeypatch, "eval_fim")
    ts = tasks(eval_fim)
    engine = Engine(REPO / "release", dtype="float32", threads=1)  # the daemon's under test (start_daemon's options)
    results = eval_fim.run_tasks(engine, ts, 16, 64, lambda m: None, editor=eval_fim.editor_settings())
    want = [accepted(t.prefix + t.suffix, len(t.prefix), r.shown, r.shown_range) for t, r in zip(ts, results,
                                                                                                 strict=True)]
    sock = tmp_path / "run" / "d.sock"
    daemon = start_daemon(REPO / "release", sock)
    try:
        got = asyncio.run(lsp_shows(sock, [(t.prefix + t.suffix, len(t.prefix)) for t in ts]))
    finally:
        stop_daemon(daemon)
    assert got == want
    assert [r.shown_why for r in results] == ["", "unsure", "", "unsure"]  # both kinds shown, both hidden
    # At a line's end the editor asks for several lines where the task asked for one: decoded again; a block body's
    # request is the task's but for its budget, and these ended before it.
    assert [r.shown_decoded for r in results] == [True, True, False, False]
    # (at the start of the `}` line: the kept line keeps its break, so the `}` keeps its own line once accepted)
    assert results[2].shown == "    x + y\n" and results[2].prediction == "    x + y\n"


def test_as_shown_scores_what_the_policy_keeps(tiny_engine, monkeypatch):
    """Known answers, post-processed as the editor does: the right line with a wrong one after it is right as the task
    scores it and wrong as shown; a block body the model ended on a line break shows whole, its closer left on its
    line; under the floor nothing shows and nothing scores."""
    eval_fim = load(monkeypatch, "eval_fim")
    from m31r.fim import FimBudget

    budget = FimBudget.for_context(tiny_engine.config.max_context)
    single, blank, body, _ = tasks(eval_fim)

    def shown(t, raw: str, floor: float = 0.0, line_logprob: float | None = None):
        r = eval_fim.Result(t.kind, t.path, t.line, t.target, raw, False, 0.0, 0, 0, "", 0.0)
        req = eval_fim.editor_request(tiny_engine, budget, t, eval_fim.editor_settings(floor))
        eval_fim.score_shown(r, t, req, raw, line_logprob, [], False)
        return r

    r = shown(single, "x + y;\n    let z = 2;")
    assert (r.shown, r.shown_exact) == ("x + y;\n    let z = 2;", False)
    assert shown(single, "x + y;").shown_exact and shown(single, "x + y;").shown_edit_similarity == 1.0
    r = shown(blank, "let v = add(1, 2);")  # written from column 0, indented as the line is
    assert (r.shown, r.shown_range, r.shown_exact) == ("    let v = add(1, 2);", [-4, 0], True)
    r = shown(body, "    let total = x + y;\n    total\n")
    assert r.shown_exact and r.shown.startswith("    let total = x + y;\n    total\n")
    r = shown(single, "x + y;", floor=0.05, line_logprob=math.log(0.01))
    assert (r.shown, r.shown_why, r.shown_exact, r.shown_edit_similarity) == ("", "unsure", False, 0.0)


def test_eval_fim_reports_as_shown_beside_the_raw_figures(tiny_bundle, tmp_path: Path, monkeypatch, capsys):
    """The summaries carry `as_shown` and the table its columns; the raw figures are the same with or without it, and
    --no-as-shown writes what an older run wrote."""
    eval_fim = load(monkeypatch, "eval_fim")
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    docs = [{"path": f"c{i}/src/lib.rs", "text": FILE.replace("add", f"add{i}"), "crate": f"c{i}"} for i in range(3)]
    (data / "corpus" / "val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    opts = ["--bundle", str(tiny_bundle.path), "--data", str(data), "--n-single", "4", "--n-multi", "2",
            "--single-tokens", "8", "--multi-tokens", "32", "--ppl-windows", "1", "--ppl-context", "16",
            "--threads", "1"]
    out = {}
    for name, extra in (("with", []), ("without", ["--no-as-shown"])):
        out[name] = tmp_path / f"{name}.json"
        assert eval_fim.main([*opts, *extra, "--out", str(out[name])]) == 0
    printed = capsys.readouterr().out
    assert "shown    exact  edit-sim" in printed and "as the editor shows it at minProbability 0.05" in printed
    a, b = (json.loads(out[k].read_text()) for k in ("with", "without"))
    assert set(a["single_line"]["as_shown"]) == {"exact_match", "edit_similarity", "shown", "unsure", "decoded_again"}
    assert a["editor"]["max_tokens"] == 64 and "editor" not in b and "as_shown" not in b["multi_line"]
    raw = ("exact", "edit_similarity", "prediction", "completion_tokens", "line_logprob")
    assert [[t[k] for k in raw] for t in a["tasks"]] == [[t[k] for k in raw] for t in b["tasks"]]
    assert all(t["shown_exact"] is None for t in b["tasks"])
    assert all(isinstance(t["shown_exact"], bool) for t in a["tasks"])


# -- compare_evals ----------------------------------------------------------------------------------------------


def ce():
    spec = importlib.util.spec_from_file_location("compare_evals", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def result(exact: list[bool], kinds: list[str], shown: list[bool] | None = None) -> dict:
    tasks = [{"kind": k, "path": f"c/src/f{i}.rs", "line": i, "target": f"t{i}", "exact": e,
              "edit_similarity": 1.0 if e else 0.5} for i, (k, e) in enumerate(zip(kinds, exact, strict=True))]
    if shown is not None:
        for t, s in zip(tasks, shown, strict=True):
            t |= {"shown_exact": s, "shown_edit_similarity": 1.0 if s else 0.0}
    return {"model": "m@1", "tasks": tasks}


def test_compare_evals_compares_as_shown_where_both_have_it_and_reads_older_results():
    mod = ce()
    kinds = ["single"] * 4 + ["multi"] * 2
    old = result([True, False, False, True, False, False], kinds)
    new = result([True, True, False, True, False, True], kinds, [True, False, False, False, False, True])
    newer = result([True, True, True, True, False, True], kinds, [True, True, True, False, False, True])
    r = mod.compare(new, newer)
    s = r["single"]["as_shown"]
    assert (s["gained"], s["lost"], s["exact_base"], s["exact_candidate"]) == (2, 0, 0.25, 0.75)
    assert s["edit_diff"] == pytest.approx(0.5)
    assert "| single, as shown (4) | 25.0% | 75.0% | 2 / 0 |" in mod.table(r)
    assert r["single"]["gained"] == 1  # the raw figures as before
    # An older result has no as-shown scores, one run with --no-as-shown has them None: the raw ones compare alone.
    skipped = result([True] * 6, kinds, [None] * 6)
    for pair in ((old, new), (new, old), (skipped, new), (new, skipped)):
        r = mod.compare(*pair)
        assert "as_shown" not in r["single"] and "as shown" not in mod.table(r)
    differ = mod.compare(new | {"editor": {"max_tokens": 64}}, newer | {"editor": {"max_tokens": 32}})
    assert "different editor settings" in mod.table(differ) and "settings_differ" not in differ


def deciding(exact_single: int, edit_multi: float) -> dict:
    """A result on make eval-large's draw (compare_evals' DECIDING_*), each multi-line task from a file of its own."""
    n_s, n_m = 300, 150
    r = result([i < exact_single for i in range(n_s)] + [False] * n_m, ["single"] * n_s + ["multi"] * n_m)
    for t in r["tasks"][n_s:]:
        t["edit_similarity"] = edit_multi
    return r | {"seed": 0, "max_new_tokens": {"single": 48, "multi": 128}, "floor_stop": False,
                "gate": {"min_probability": 0.05}}


def test_a_kind_without_clean_tasks_has_nothing_to_compare(tmp_path: Path):
    """Every multi-line task's file has a look-alike in training: the clean comparison has no multi-line part. The
    candidate wins on all tasks, so the verdict went on to the clean tasks' figures and crashed (KeyError: 'multi');
    now it says there is nothing to compare and does not call it a release."""
    base, cand = deciding(143, 0.4), deciding(150, 0.6)
    files = {}
    for name, r in (("base", base), ("cand", cand)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(r))
    leaky = tmp_path / "leakage.json"
    leaky.write_text(json.dumps({"leaky_files": [{"path": t["path"], "crate": "c", "matches": []}
                                                 for t in base["tasks"] if t["kind"] == "multi"]}))

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(SCRIPT), str(files["base"]), str(files["cand"]), "--leaky",
                               str(leaky), *extra], capture_output=True, text=True, timeout=60)

    proc = run("--json")
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout)
    assert r["clean"]["nothing_to_compare"] == ["multi"] and r["clean"]["single"]["n"] == 300
    assert not r["release"]["wins"]
    assert "no clean multi-line tasks" in r["release"]["why"] and "nothing to compare" in r["release"]["why"]
    table = run().stdout
    assert "| multi, clean (0) | nothing to compare: every multi-line task's file has a look-alike" in table


# -- eval_exec --------------------------------------------------------------------------------------------------


def test_eval_exec_tests_the_program_the_editor_leaves(monkeypatch):
    """A line task's suggestion on its blank line (the indentation replaced) accepted gives the reference program
    when it is the reference line; a suggestion the editor hides fails without a compile, and the shown one is
    compiled only where it is not the prediction's program."""
    eval_exec = load(monkeypatch, "eval_exec")
    eval_fim = sys.modules["eval_fim"]
    gcd = next(p for p in eval_exec.load_problems() if p.name == "gcd")
    line = gcd.lines()[0]
    indent = line.prefix[len(line.prefix.rstrip(" ")) :]
    assert line.shown_program(indent + line.middle, [-len(indent), 0]) == gcd.program(gcd.middle)
    assert gcd.shown_program(gcd.middle.rstrip() + "\n", [0, 0]) == gcd.program(gcd.middle)
    if RUSTC is None:
        pytest.skip("rustc is not installed (apt-get install rustc)")

    def res(pr, shown: str, at: list[int], why: str = ""):
        r = eval_fim.Result(pr.kind, pr.name, 0, pr.middle, "", False, 0.0, 0, 0, "", 0.0)
        r.shown, r.shown_range, r.shown_why, r.shown_exact = shown, at, why, bool(shown)
        return r

    compiled: list[str] = []
    run_program = eval_exec.run_program
    monkeypatch.setattr(eval_exec, "run_program", lambda src, *a, **k: compiled.append(src) or run_program(src, *a,
                                                                                                           **k))
    out = eval_exec.score([gcd, line], [gcd.middle, "b = b;"], RUSTC, lambda m: None,
                          as_shown=[res(gcd, "", [0, 0], "unsure"), res(line, indent + line.middle,
                                                                        [-len(indent), 0])])
    assert [(o.passes, o.shown_passes) for o in out] == [(True, False), (False, True)]
    assert out[0].shown_error == "nothing shown (unsure)"
    assert len(compiled) == 2  # the reference program once (the shown line's is the same), the wrong line's
    summary = eval_exec.summary(out)
    assert summary["as_shown"] == {"passes": 0.5, "exact": 0.5, "shown": 1}

"""What the editor shows of a daemon answer is one function, lsp/completion.py's shown_suggestion (with fim_request for
the request): the language server calls it, and eval_fim's "as shown" score (score_shown, editor_request) must give
exactly its text, range and reason, or the evaluation scores something no editor shows. Cheap: known answers, no
decoding; test_eval_s45 checks a real server against the evaluation end to end."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

FILE = ("fn add(x: u32, y: u32) -> u32 {\n    let total = x + y;\n    total\n}\n\n"
        "fn main() {\n    let v = add(1, 2);\n    println!(\"{}\", v);\n}\n")


def load_eval_fim(monkeypatch):
    """benchmarks/eval_fim.py, loaded as the scripts import each other (by bare name)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("eval_fim", REPO / "benchmarks" / "eval_fim.py")
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "eval_fim", mod)  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_eval_as_shown_is_shown_suggestion(tiny_engine, monkeypatch):
    """For answers that show whole, show cut to their confident lines, show nothing (under the floor) and leave the
    policy nothing, eval_fim's shown text, range and reason are shown_suggestion's for the server's plan of that
    cursor; and the module the evaluation imports it from does not pull in pygls."""
    from m31r.fim import FimBudget
    from m31r_lsp.completion import fim_request, shown_suggestion
    from m31r_protocol import policy

    imported = subprocess.run([sys.executable, "-c", "import sys, m31r_lsp.completion; print(sorted(m for m in "
                               "sys.modules if m.split('.')[0] in ('pygls', 'lsprotocol')))"],
                              capture_output=True, text=True, check=True)
    assert imported.stdout.strip() == "[]"  # only the server needs pygls
    eval_fim = load_eval_fim(monkeypatch)
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    lines = FILE.splitlines(keepends=True)

    def at(line: int, column: int, end: int) -> object:  # the middle: (line, column) up to character `end`
        start = sum(map(len, lines[:line])) + column
        return eval_fim.Task("multi" if "\n" in FILE[start:end] else "single", "c/src/main.rs", line, FILE[:start],
                             FILE[end:], FILE[start:end])

    single = at(1, 16, FILE.index(";\n    total"))  # `    let total = |x + y`
    body = at(1, 0, FILE.index("}\n\nfn main"))
    sure, unsure = math.log(0.9), math.log(0.01)
    cases = [  # (task, raw, floor, line_logprob, logprob_by_line)
        (single, "x + y;\n    let z = 2;", 0.05, sure, [sure, unsure]),  # the second line cut
        (single, "x + y;", 0.05, None, [sure]),
        (body, "    let total = x + y;\n    total\n", 0.0, None, []),
        (single, "x + y;", 0.05, unsure, [unsure]),  # hidden
        (body, "", 0.05, sure, [sure]),  # nothing for the policy to show
    ]
    whys, stats = [], Counter()
    for t, raw, floor, line_logprob, by_line in cases:
        settings = eval_fim.editor_settings(floor)
        req = eval_fim.editor_request(tiny_engine, budget, t, settings)
        r = eval_fim.Result(t.kind, t.path, t.line, t.target, raw, False, 0.0, 0, 0, "", 0.0)
        eval_fim.score_shown(r, t, req, raw, line_logprob, by_line, False)

        cursor = len(t.prefix)
        plan = policy.plan(t.prefix + t.suffix, cursor, settings.options())
        fields, _, _ = fim_request(plan, settings, tiny_engine.config.max_context)
        assert req.plan == plan and req.min_probability == fields["min_probability"]
        suggestion, why = shown_suggestion(plan, raw, line_logprob, by_line, settings.min_probability, stats=stats)
        want = ((suggestion.text, [suggestion.start - cursor, suggestion.end - cursor]) if suggestion is not None
                else ("", [0, 0]))
        assert (r.shown, r.shown_range, r.shown_why) == (*want, why), raw
        whys.append(why)
    assert whys == ["", "", "", "unsure", "empty"] and stats["lines_cut"] == 1
    assert r.shown_exact is False and r.shown_edit_similarity == 0.0  # nothing shown scores as an empty suggestion

"""eval_fim's "as shown" scores the document a suggestion leaves once accepted, line breaks included."""

from __future__ import annotations

from benchmark_util import load
from test_eval_s45 import tasks


def test_a_shown_block_that_joins_the_line_after_it_is_wrong(tiny_engine, monkeypatch):
    """The as-shown comparison dropped trailing blank lines, so a block body shown without its last line break, which
    accepted leaves `    total}`, scored exact: 21 of the 22 multi-line suggestions the bundled model's eval showed
    were of that kind (protocol/policy.py then glued them), and the figure could not see it."""
    eval_fim = load(monkeypatch, "eval_fim")
    from m31r.fim import FimBudget

    budget = FimBudget.for_context(tiny_engine.config.max_context)
    body = tasks(eval_fim)[2]  # add's body, the cursor at the start of the `}` line
    assert body.suffix.startswith("}")

    def shown(raw: str):
        r = eval_fim.Result(body.kind, body.path, body.line, body.target, raw, False, 0.0, 0, 0, "", 0.0)
        req = eval_fim.editor_request(tiny_engine, budget, body, eval_fim.editor_settings(0.0))
        eval_fim.score_shown(r, body, req, raw, None, [], False)
        return r

    whole = shown("    let total = x + y;\n    total\n")  # the model ended its last line: the `}` keeps its own
    cut = shown("    let total = x + y;\n    total")  # ended by the token budget: accepted, `    total}`
    assert whole.shown_exact and not cut.shown_exact
    assert cut.shown == "    let total = x + y;\n    total" and cut.shown_range == [0, 0]
    assert 0.9 < cut.shown_edit_similarity < 1.0
    # The raw figures still compare the model's text with the middle as before (trailing blank lines dropped).
    assert eval_fim.normalize("    total\n") == eval_fim.normalize("    total")

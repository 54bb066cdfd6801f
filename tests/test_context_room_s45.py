"""Project-context snippets stay put while the user types on a line: their room (m31r.context.context_room) counts
the cursor line at its full budget. Counted at its length, each keystroke took a token of the room; where it fell
below what the chosen snippets took, one was dropped, the head of the prompt changed, and the daemon's prefix cache
prefilled the whole prompt again on that keystroke."""

from __future__ import annotations

import random
from pathlib import Path

from m31r.config import load_config
from m31r.context import context_ids, context_room
from m31r.fim import FimBudget, build_fim_prompt
from m31r.tokenizer import Tokenizer
from m31r_protocol import messages as m
from m31r_protocol.client import Client
from m31r_protocol.context import query_words, rank, windows

REPO = Path(__file__).resolve().parent.parent
SUFFIX = "\n}\n"


def file_above(n: int) -> str:
    """A function of `n` lines, the cursor below them: long enough (n) that the prompt nears its budget."""
    return "fn main() {\n" + "".join(f"    let v{i} = p.x * {i};\n" for i in range(n))


def typed(above: str, line: str) -> list[str]:
    """Each request's prefix while `line` is typed a character at a time after `above`."""
    return [above + line[:k] for k in range(len(line) + 1)]


def before_line(tok: Tokenizer, budget: FimBudget, prefix: str, snippets: list[m.Snippet]) -> tuple[int, ...]:
    """The served ids before the cursor line's text: the snippets, then S and P_above up to <|fim_middle|>."""
    p = build_fim_prompt(tok, prefix, SUFFIX, budget)
    head = context_ids(tok, snippets, context_room(budget, p))
    assert len(head) + len(p.ids) + budget.reserve <= budget.suffix + budget.line + budget.above + budget.reserve + 3
    return (*head, *p.ids[: len(p.ids) - p.line_tokens])


def test_release_tokenizer_keeps_the_snippets_along_a_line() -> None:
    """The 2048-token layout with the bundled tokenizer: files whose prompt passes 1,280 tokens, where the room is
    what the prompt leaves, not a quarter of the context. Every keystroke's prompt starts with the same ids."""
    cfg = load_config(REPO / "release" / "config.yaml")
    tok = Tokenizer.from_file(REPO / "release" / "tokenizer.json", cfg.special_tokens, cfg.vocab_size)
    budget = FimBudget.for_context(cfg.max_context)
    line = "    let total = points.iter().map(|p| p.x * p.y).sum::<i64>();"
    snippets = [m.Snippet("".join(f"pub fn area{i}_{k}(p: &Point) -> i64 {{ p.x * {k} }}\n" for k in range(i + 1)),
                          f"src/s{i}.rs") for i in range(1, 9)]
    everything = len(context_ids(tok, snippets, 10**6))
    held_back = 0
    for n in range(77, 82):
        above = "fn main() {\n" + "".join(f"    let v{i} = points[{i % 7}].x * {i} + offset;\n" for i in range(n))
        seen = {before_line(tok, budget, prefix, snippets) for prefix in typed(above, line)}
        assert len(seen) == 1, f"{n} lines above: the prompt's head changed while typing one line"
        head = context_ids(tok, snippets, context_room(budget, build_fim_prompt(tok, above, SUFFIX, budget)))
        assert head and tok.decode(head).startswith("// src/")
        held_back += len(head) < everything
    assert held_back  # the room, not the snippets, set what was laid before the prompt


def test_daemon_and_training_lay_out_the_same_stable_head(tiny_engine) -> None:
    """The daemon's prompt (m31rd.server.build_prompt) keeps its ids up to the cursor line while a line is typed,
    and a training sample with the same cursor and snippets starts with exactly those ids."""
    from m31r.train.samples import choose_middle, fim_sample
    from m31rd.server import build_prompt

    tok = tiny_engine.tokenizer
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    snippets = [m.Snippet("".join(f"fn a{k}() {{ {k} }}\n" for k in range(i)), f"s{i}.rs") for i in range(1, 7)]
    line = "    let total = p.x * p.y + q;"
    for n in (13, 14, 17, 20):
        seen = set()
        for prefix in typed(file_above(n), line):
            ids = build_prompt(tiny_engine, budget, m.Fim(id=1, prefix=prefix, suffix=SUFFIX, max_tokens=8,
                                                          context=snippets)).ids
            assert ids.count(tok.fim_middle_id) == 1 and len(ids) + budget.reserve <= tiny_engine.config.max_context
            seen.add(tuple(ids[: ids.index(tok.fim_middle_id) + 1]))
        assert len(seen) == 1, f"{n} lines above: the daemon's prompt head changed while typing one line"

    # Training lays a sample's snippets out in the room serving gives them: the same ids before the middle.
    text = file_above(20) + line + SUFFIX
    near = [(f"src/s{i}.rs", windows("".join(f"let v{k} = p.x;\n" for k in range(i)))) for i in range(1, 7)]
    heads = set()
    for seed in range(12):
        sample = fim_sample(tok, text, random.Random(seed), budget, neighbours=near)
        a, b = choose_middle(text, random.Random(seed))
        served = build_prompt(tiny_engine, budget, m.Fim(id=1, prefix=text[:a], suffix=text[b:],
                                                         context=rank(query_words(text[:a]), near))).ids
        assert sample.ids[: len(served)] == served, f"seed {seed}"
        heads.add(served.index(tok.fim_suffix_id))
    assert len(heads) > 2  # snippets laid out in rooms of several sizes


async def test_typing_with_project_context_keeps_the_prefix_cache(shared_daemon, tiny_engine) -> None:
    """A real daemon, a line typed a character at a time with the same snippets: every keystroke the model answers
    reuses at least the snippets and S from the cache (before, the keystroke that dropped a snippet reused nothing)."""
    _, sock = shared_daemon
    tok = tiny_engine.tokenizer
    budget = FimBudget.for_context(tiny_engine.config.max_context)
    snippets = [m.Snippet("".join(f"fn a{k}() {{ {k} }}\n" for k in range(i)), f"s{i}.rs") for i in range(1, 7)]
    prefixes = typed(file_above(13), "    let total = p.x * p.y + q;")
    first = build_fim_prompt(tok, prefixes[0], SUFFIX, budget)
    head = context_ids(tok, snippets, context_room(budget, first))
    assert head
    reused = len(head) + first.suffix_tokens + 2  # the snippets, <|fim_suffix|> S <|fim_prefix|>
    usages = []
    async with await Client.connect(sock) as c:
        for prefix in prefixes:
            stream = await c.fim(prefix, SUFFIX, document="context-room-s45.rs", max_tokens=2, beams=1,
                                 context=snippets)
            async for _ in stream:
                pass
            assert stream.done is not None
            if stream.done.source == "model":
                usages.append(stream.done.usage)
    assert len(usages) >= len(prefixes) // 2
    # Reuse comes in whole 32-token chunks (m31rd.prefix_cache).
    missed = [(i, u) for i, u in enumerate(usages[1:], 1) if u.cached_tokens < reused // 32 * 32]
    assert not missed

"""The serving stops of a Fim (m31r.fim.suffix_stop, m31r.stops.RepeatedLine) and of a Generate (the repeated line),
end to end.

A model that loops is built by hand: the tiny config with weights that make greedy decoding write `ab;` and a line
end over and over, whatever came before (each token's embedding is mapped by the first feed-forward layer to the
next token of the cycle; attention and the second layer are zero). It is a real bundle, served by a real engine and
a real daemon.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from daemon_util import start_daemon, stop_daemon

from m31r.fim import line_context, start_stop, suffix_stop
from m31r.stops import StopMatcher

CYCLE = "ab;\n"


def test_suffix_stop_is_the_next_whole_line_after_the_cursor() -> None:
    assert suffix_stop("fn f() {\n", "    }\n}\n") == "\n    }\n"  # cursor at a line start: that line
    assert suffix_stop("fn f() {\n    ", "\n}\n") == "\n}\n"  # mid-line: the cursor line's rest is skipped
    assert suffix_stop("let x = f(", ");\n\n  g();\n") == "\n  g();\n"  # blank lines are skipped
    assert suffix_stop("", "a\r\nb\r\n") == "\na\r\n"  # CRLF files keep their line ends
    assert suffix_stop("x\n", "}") is None  # a last line without its line end is not a whole line
    assert suffix_stop("x\n", "") is None and suffix_stop("x", "\n\n") is None


def test_start_stop_is_the_suffix_line_where_the_cursor_starts_a_line() -> None:
    assert start_stop("fn f() {\n", "    }\n}\n") == "    }\n"
    assert start_stop("", "\n  a\r\n") == "  a\r\n"  # the start of a file starts a line; blank lines skipped
    assert start_stop("fn f() {\n    ", "\n}\n") is None  # mid-line: the suffix's line follows a line end of its own
    assert start_stop("x\n", "}") is None


def feed(m: StopMatcher, pieces: list[str]) -> tuple[str, bool]:
    out = []
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_a_start_stop_ends_only_a_text_that_begins_with_it() -> None:
    assert feed(StopMatcher([], None, ["    }\n"]), ["  ", "  }", "\n", "x"]) == ("", True)
    # Held while it could still be one, then let through whole, still under the other stops.
    m = StopMatcher(["\n    }\n"], None, ["    }\n"])
    assert m.feed("    ") == ("", False) and m.feed("x") == ("    x", False)
    assert feed(m, ["\n    }", "\n"]) == ("", True)  # later, the suffix line ends it through its own sequence
    assert feed(StopMatcher([], None, ["    }\n"]), ["  }\n    }\n"]) == ("  }\n    }\n", False)  # not at the start
    assert feed(StopMatcher(["\n"], None, ["}\n"]), ["}", "x\n"]) == ("}x", True)  # the line stop still applies
    assert feed(StopMatcher([], None, ["    }\n"]), ["    }"]) == ("    }", False)  # ended before its line end
    assert feed(StopMatcher([], "a\n", ["b\n"]), ["c\n", "c\n"]) == ("c\n", True)  # the repeated line still runs
    m = StopMatcher([], None, ["}\n"])
    twin = m.clone()
    assert m.feed("}\n") == ("", True) and twin.feed("x") == ("x", False)  # a beam's forks match apart


def test_line_context_is_the_last_whole_lines_and_the_cursor_line() -> None:
    assert line_context("a\nb\nc", 1) == "b\nc"
    assert line_context("a\nb\n", 1) == "b\n"
    assert line_context("abc") == "abc" and line_context("") == "" and line_context("\nx") == "\nx"
    assert line_context("1\n2\n3\n4\n5\n6") == "2\n3\n4\n5\n6"  # RepeatedLine.MAX_PERIOD whole lines
    assert line_context("1\n2\n") == "1\n2\n"


@pytest.fixture(scope="module")
def looping_bundle(tiny_config, tmp_path_factory: pytest.TempPathFactory):
    import torch
    from tokenizers import Tokenizer as HFTokenizer

    from m31r.bundle import init_bundle, load_weights, write_bundle
    from m31r.tokenizer import Tokenizer

    base = init_bundle(tiny_config, tmp_path_factory.mktemp("loop") / "random", seed=0, dtype=torch.float32)
    tok = Tokenizer.from_file(base.tokenizer_path, tiny_config.special_tokens)
    w = {k: v.clone() for k, v in load_weights(base).items()}
    d, hidden = tiny_config.d_model, tiny_config.ffn_hidden
    cycle = [tok.encode(c)[0] for c in CYCLE]
    nxt = {a: b for a, b in zip(cycle, cycle[1:] + cycle[:1], strict=True)}
    nxt[tok.fim_middle_id] = cycle[0]  # a prompt ends in <|fim_middle|> when the cursor is at a line start
    emb = torch.randn(tiny_config.vocab_size, d, generator=torch.Generator().manual_seed(1)) * 1e-3
    basis = torch.linalg.qr(torch.randn(d, d, generator=torch.Generator().manual_seed(2)))[0]
    for i, t in enumerate(sorted(nxt)):
        emb[t] = basis[i]  # orthonormal: the cycle's tokens (and <|fim_middle|>) are told apart exactly
    w["tok_embeddings.weight"] = emb
    for k in w:
        if k.endswith(("wo.weight", "w2.weight", "w13.weight")):
            w[k].zero_()
    # Layer 0's feed-forward: one hidden unit per token t (its gate and up rows are t's embedding), writing
    # 2·e(next) − e(t) into the residual stream, so that the last position holds 2·e(next) alone.
    gate, up, w2 = torch.zeros(hidden, d), torch.zeros(hidden, d), torch.zeros(d, hidden)
    for j, (t, n) in enumerate(nxt.items()):
        gate[j], up[j] = emb[t] * 4, emb[t]
        w2[:, j] = 2 * emb[n] - emb[t]
    rms = 1 / d**0.5  # ffn_norm scales a unit vector by sqrt(d): gate and up see 4·sqrt(d) and sqrt(d)
    w2 /= torch.nn.functional.silu(torch.tensor(4 / rms)) / rms
    w["layers.0.feed_forward.w13.weight"] = torch.cat([gate, up])
    w["layers.0.feed_forward.w2.weight"] = w2
    return write_bundle(tmp_path_factory.mktemp("loop") / "bundle", tiny_config, w,
                        HFTokenizer.from_file(str(base.tokenizer_path)), dtype=torch.float32, seed=0,
                        dataset_version="none (a looping model built by hand)")


def complete(engine, prefix: str, suffix: str, serving: bool, max_tokens: int = 24, beams: int = 1):
    from m31r.beams import beam_generate
    from m31r.engine import Outcome
    from m31r.fim import FimBudget, build_fim_prompt

    prompt = build_fim_prompt(engine.tokenizer, prefix, suffix, FimBudget.for_context(engine.config.max_context))
    stop = [s] if serving and (s := suffix_stop(prefix, suffix)) else []
    start_stops = [s] if serving and (s := start_stop(prefix, suffix)) else []
    res = Outcome(prompt_tokens=len(prompt.ids))
    kw = dict(max_tokens=max_tokens, stop=stop, result=res, heal=prompt.heal, start_stops=start_stops,
              repeat_context=line_context(prefix) if serving else None)
    for _ in beam_generate(engine, prompt.ids, width=beams, **kw) if beams > 1 else engine.generate(prompt.ids, **kw):
        pass
    return res


CASES = [  # (prefix, suffix, served text, what stopped it)
    ("fn f() {\n", "    g();\n}\n", CYCLE, "repeat"),  # the second `ab;` line repeats the first
    ("fn f() {\n", "ab;\n}\n", "", "sequence"),  # its first line is the suffix's next line: nothing to insert
    ("fn f() {\na", ";\nab;\n}\n", "b;", "sequence"),  # the completion runs into the suffix's next line
    ("fn f() {\nab;\n", "}\n", "", "repeat"),  # its first line repeats the line above the cursor
    ("fn f() {\n", "    ab;\n}\n", CYCLE, "repeat"),  # the suffix's line at another indentation is another line
]


def test_the_engine_cuts_a_loop_where_it_repeats(looping_bundle) -> None:
    from m31r.engine import Engine

    engine = Engine(looping_bundle.path, dtype="float32", chunk_size=8)
    raw = complete(engine, "fn f() {\n", "}\n", serving=False)
    assert raw.text == (CYCLE * 6)[: len(raw.text)] and raw.finish_reason == "length"  # the model loops
    for prefix, suffix, text, by in CASES:
        res = complete(engine, prefix, suffix, serving=True)
        assert (res.text, res.finish_reason, res.stopped_by) == (text, "stop", by), (prefix, suffix)
        res = complete(engine, prefix, suffix, serving=True, beams=2)
        assert (res.text, res.finish_reason, res.stopped_by) == (text, "stop", by), (prefix, suffix)
        if not text and by == "sequence":  # the search ended there too, not at max_tokens
            assert res.completion_tokens == len(CYCLE) and res.decode_steps < len(CYCLE)


def test_the_daemon_cuts_a_loop_where_it_repeats(looping_bundle, tmp_path: Path) -> None:
    from m31r_protocol.client import Client

    sock = tmp_path / "d.sock"
    proc = start_daemon(looping_bundle.path, sock)
    try:
        async def answers() -> list[tuple[str, str]]:
            async with await Client.connect(sock) as client:
                out = []
                for prefix, suffix, _, _ in CASES:
                    text, done = await (await client.fim(prefix, suffix, max_tokens=24)).collect()
                    out.append((text, done.finish_reason))
                # A stop sequence of the client's own still ends the text first.
                text, done = await (await client.fim("fn f() {\n", "}\n", max_tokens=24, stop=["b"])).collect()
                out.append((text, done.finish_reason))
                # A Generate has no suffix, but a repeated line ends it too: the prompt's last line counts.
                for prompt in ("fn f() {\n", "fn f() {\nab;\n"):
                    text, done = await (await client.generate(prompt, max_tokens=24)).collect()
                    out.append((text, done.finish_reason))
                return out

        served = [(text, "stop") for _, _, text, _ in CASES]
        assert asyncio.run(answers()) == [*served, ("a", "stop"), (CYCLE, "stop"), ("", "stop")]
    finally:
        stop_daemon(proc)


def test_m31r_fim_says_when_the_model_wrote_nothing(looping_bundle, tmp_path: Path) -> None:
    """At the start of the suffix's next line the looping model writes that line: the answer is empty, and an empty
    stdout alone would look like a failure, so stderr says what happened."""
    import subprocess
    import sys

    sock = tmp_path / "d.sock"
    (tmp_path / "f.rs").write_text("fn f() {\nab;\n}\n")
    proc = start_daemon(looping_bundle.path, sock)
    try:
        r = subprocess.run([sys.executable, "-m", "m31r.cli", "fim", "--socket", str(sock), "--no-autostart", "--file",
                            str(tmp_path / "f.rs"), "--line", "2", "--column", "1"],
                           capture_output=True, text=True, timeout=60)
        assert (r.returncode, r.stdout) == (0, "")
        assert r.stderr == "(no completion: the model wrote nothing here; finish_reason stop)\n"
    finally:
        stop_daemon(proc)

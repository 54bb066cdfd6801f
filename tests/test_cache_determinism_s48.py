"""A keystroke's answer must not depend on what the daemon served before it (session 48's audit of the prefix cache
after the token-healing change): healing tokens and generated tokens are written into a slot by decode steps, and a
later prompt that holds the same ids must prefill those positions again rather than reuse them (Engine.reusable keeps
only prefill chunks), and beam searches' spare caches, another document's slot, a concurrent stream or a typed-through
answer must change nothing.

A session types into two documents in turns (every keystroke inside a word, so every request heals), backspaces,
jumps, types into the last suggestion, and sends some requests together, with beams 1 and 3 and lookahead on and
off, against the shared warm daemon. Each answer (text, finish_reason, alternatives, healed and completion tokens,
what stopped it) must be the one a daemon without reuse (`--cache-mb 0`, every prompt cold, no spares kept) gives
the same request. The compared requests ask for logprobs, which the daemon always answers from the model (a typed-
through answer may rightly differ: m31rd.server.clip); the others still change the daemon's state.
"""

from __future__ import annotations

import asyncio
import random

import pytest
from daemon_util import start_daemon, stop_daemon

from m31r_protocol.client import Client

pytestmark = pytest.mark.timeout(120)

A = ("use std::collections::HashMap;\n\nfn count_words(words: &[&str]) -> HashMap<&str, usize> {\n"
     "    let mut counts = HashMap::new();\n    for word in words {\n        *counts.entry(word).or_insert(0) += 1;\n"
     "    }\n    counts\n}\n\nstruct Point { x: f64, y: f64 }\n\nimpl Point {\n    fn norm(&self) -> f64 {\n"
     "        (self.x * self.x + self.y * self.y).sqrt()\n    }\n}\n")
B = ("fn parse_config(path: &Path) -> Result<Config, Error> {\n    let text = std::fs::read_to_string(path)?;\n"
     "    let mut config = Config::default();\n    for line in text.lines() {\n        let trimmed = line.trim();\n"
     "        if trimmed.is_empty() { continue; }\n    }\n    Ok(config)\n}\n")
Ask = tuple[str, str, str, int, int, int, list[str], bool]  # prefix, suffix, document, max_tokens, beams, ...


def in_word(text: str, pos: int) -> bool:
    return pos > 0 and (text[pos - 1].isalnum() or text[pos - 1] == "_")


def session(rng: random.Random) -> list[list[Ask]]:
    """Rounds of requests (one or two sent together, never two of one document): keystrokes that type a new word
    into the text before the cursor (the suffix stays), backspaces and jumps into other words."""
    docs = {"a.rs": [A[: A.index("counts.entry") + 3], A[A.index("counts.entry") + 3 :]],
            "b.rs": [B[: B.index("read_to_string") + 4], B[B.index("read_to_string") + 4 :]]}
    rounds: list[list[Ask]] = []
    for n in range(22):
        names = ["a.rs", "b.rs"] if n % 5 == 4 else ["a.rs" if n % 4 < 2 else "b.rs"]
        batch: list[Ask] = []
        for name in names:
            prefix, suffix = docs[name]
            move = rng.random()
            if move < 0.15 and in_word(prefix, len(prefix) - 1):  # a backspace
                prefix = prefix[:-1]
            elif move < 0.25:  # a jump into another word
                text = prefix + suffix
                pos = rng.choice([i for i in range(20, len(text) - 20) if in_word(text, i) and in_word(text, i - 1)])
                prefix, suffix = text[:pos], text[pos:]
            else:  # a keystroke
                prefix += rng.choice("aeinrst_")
            docs[name] = [prefix, suffix]
            # Now and then a.rs's text under another name (a copy of the file): its slot starts from a.rs's.
            doc = f"a{n}.rs" if name == "a.rs" and n % 6 == 5 else name
            batch.append((prefix, suffix, doc, rng.choice([4, 8, 12]), rng.choice([1, 1, 3]), rng.choice([0, 3]),
                          rng.choice([[], ["\n"]]), rng.random() < 0.8))
        rounds.append(batch)
    return rounds


async def answer(client: Client, ask: Ask, document: str | None = None) -> tuple[tuple, str, int]:
    """The answer's figures, its source and how many of its prompt's tokens came from the cache."""
    prefix, suffix, doc, max_tokens, beams, lookahead, stop, compared = ask
    stream = await client.fim(prefix, suffix, document=doc if document is None else document, max_tokens=max_tokens,
                              beams=beams, lookahead=lookahead, stop=stop, logprobs=0 if compared else None)
    text, done = await stream.collect()
    u = done.usage
    return ((text, done.finish_reason, tuple(done.alternatives), u.healed_tokens, u.completion_tokens,
             done.stopped_by, done.stop_sequence), done.source, u.cached_tokens)


@pytest.fixture(scope="module")
def cold_daemon(tiny_bundle, tmp_path_factory: pytest.TempPathFactory):
    """A daemon that reuses nothing between requests: every prompt prefilled cold, every beam search on new caches."""
    sock = tmp_path_factory.mktemp("cold") / "run" / "m31rd.sock"
    proc = start_daemon(tiny_bundle.path, sock, "--cache-mb", "0")
    yield sock
    stop_daemon(proc)


async def test_keystroke_answers_do_not_depend_on_what_the_daemon_served_before(shared_daemon, cold_daemon) -> None:
    warm, cold = await Client.connect(shared_daemon[1]), await Client.connect(cold_daemon)
    try:
        compared = healed = cached = typed = 0
        rng = random.Random(48)
        for i, batch in enumerate(session(rng)):
            got = await asyncio.gather(*(answer(warm, ask) for ask in batch))
            if i % 3 == 2 and got[0][0][0]:  # type into the suggestion: its tokens were decode steps in the slot
                prefix, suffix, *limits = batch[0]
                text = got[0][0][0]
                tail = prefix + text[: rng.randrange(1, len(text) + 1)]
                plain = (tail, suffix, *limits[:-1], False)
                typed += (await answer(warm, plain))[1] == "typed_through"  # answered from the suggestion, or not
                batch, got = [*batch, plain[:-1] + (True,)], [*got, await answer(warm, plain[:-1] + (True,))]
            for j, (ask, (figures, source, reused)) in enumerate(zip(batch, got, strict=True)):
                if not ask[-1]:
                    continue
                assert source == "model"
                want, _, none = await answer(cold, ask, document=f"cold-{i}-{j}")
                assert none == 0
                assert figures == want, (i, ask[0][-12:], ask[2:])
                compared += 1
                healed += figures[3] > 0
                cached += reused > 0
        # The session did what it is for: most requests healed a word, the warm daemon reused cached prompts, and some
        # keystrokes into a suggestion were answered from it.
        assert compared >= 15 and healed >= compared - 3 and cached >= compared // 2, (compared, healed, cached)
        assert typed
    finally:
        await warm.close()
        await cold.close()

"""Drive several generations the way the daemon's scheduler does, without the daemon: each round, every stream's
next model call (a prefill chunk or a decode step) goes to one Engine.run."""

from __future__ import annotations

import torch

from m31r.engine import Chunk, Decode, Engine


def in_rounds(engine: Engine, prompts: list, max_tokens: int) -> tuple[list[list[int | None]], int, int]:
    """The token ids each prompt produced, the number of rounds, and how many rounds ran prefill chunks beside
    decode rows."""
    gens = [engine.generate(p, max_tokens=max_tokens, cache=engine.new_cache(), batched=True) for p in prompts]
    outs: list[list[int | None]] = [[] for _ in prompts]
    sent: list[torch.Tensor | None] = [None] * len(prompts)
    live, rounds, shared = set(range(len(prompts))), 0, 0
    while live:
        calls: dict[int, Chunk | Decode] = {}
        for i in sorted(live):
            try:
                while not isinstance(ev := gens[i].send(sent[i]), Chunk | Decode):
                    sent[i] = None
                    outs[i].append(ev.id)
                sent[i], calls[i] = None, ev
            except StopIteration:
                live.discard(i)
        if not calls:
            continue
        rounds += 1
        decodes = [i for i, c in calls.items() if isinstance(c, Decode)]
        chunks = [i for i, c in calls.items() if isinstance(c, Chunk)]
        shared += bool(decodes and chunks)
        decoded, chunked = engine.run([calls[i] for i in decodes], [calls[i] for i in chunks])
        for i, logits in zip(decodes + chunks, decoded + chunked, strict=True):
            sent[i] = logits
    return outs, rounds, shared

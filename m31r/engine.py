"""The one core runtime ("Mode C"): load a bundle, prefill against a static KV cache, decode, stream.

Determinism across cache reuse: a token's keys/values depend on how its prefill chunk was shaped (matmul
blocking changes float reduction order). Prefill therefore always runs in chunks aligned to absolute
positions, multiples of `chunk_size`, and only positions covered by full aligned chunks are ever reused.
A warm request then recomputes exactly the chunks a cold one would, bit for bit, so greedy output with a
cache hit equals output without one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from m31r.bundle import Bundle, load_weights, open_bundle
from m31r.model import KVCache, Transformer, rope_tables
from m31r.sampling import Sampler, SamplingParams
from m31r.stops import StopMatcher
from m31r.tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


class ContextOverflowError(ValueError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_context: int):
        self.prompt_tokens, self.max_tokens, self.max_context = prompt_tokens, max_tokens, max_context
        super().__init__(
            f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) = {prompt_tokens + max_tokens} "
            f"exceeds the model's context of {max_context} tokens; shorten the prompt, lower max_tokens, "
            f"or ask for truncation"
        )


@dataclass
class Token:
    """Text that became safe to show, and the token that produced it.

    `text` may be empty while a UTF-8 character or a possible stop sequence is pending; `id` is None for
    held-back text released at the end of generation.
    """

    id: int | None
    text: str


@dataclass
class Generation:
    """The outcome of one request, filled in as it runs; read it once the token iterator is exhausted."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | deadline
    prefill_ms: float = 0.0
    first_token_ms: float | None = None
    total_ms: float = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    def __init__(
        self,
        bundle: Bundle | str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        chunk_size: int = 32,
    ):
        if threads:
            torch.set_num_threads(threads)
        self.bundle = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
        self.config = self.bundle.config
        self.device = torch.device(device)
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
        self.dtype = DTYPES[dtype]
        self.chunk_size = chunk_size
        self.tokenizer = Tokenizer.from_file(self.bundle.tokenizer_path, self.config.special_tokens)
        with torch.device("meta"):
            model = Transformer(self.config)
        weights = load_weights(self.bundle)
        if self.device.type != "cpu" or any(t.dtype != self.dtype for t in weights.values()):
            weights = {k: t.to(self.device, self.dtype) for k, t in weights.items()}
        model.load_state_dict(weights, strict=True, assign=True)
        # The non-persistent RoPE tables were created on meta: build them for real.
        cos, sin = rope_tables(self.config)
        model.rope_cos, model.rope_sin = cos.to(self.device), sin.to(self.device)
        self.model = model.eval()
        self.stop_ids = self.tokenizer.special_ids

    # -- caches ---------------------------------------------------------------------------------------

    def new_cache(self, capacity: int | None = None) -> KVCache:
        return KVCache(self.config, capacity or self.config.max_context, self.dtype, self.device)

    def cache_bytes(self, capacity: int | None = None) -> int:
        c = self.config
        return 2 * c.n_layers * c.kv_heads * (capacity or c.max_context) * c.head_dim * self.dtype.itemsize

    def reusable(self, cache: KVCache, ids: list[int]) -> int:
        """Positions of `ids` whose cached keys/values can be kept: full aligned chunks only, and never
        the whole prompt (the last prompt token must run to give the logits for the first new token)."""
        n = min(common_prefix(cache.tokens, ids), cache.aligned, len(ids) - 1)
        return n - n % self.chunk_size

    # -- the forward passes ---------------------------------------------------------------------------

    def prefill(self, cache: KVCache, ids: list[int], start: int) -> Iterator[torch.Tensor | None]:
        """Run ids[start:] in aligned chunks; yields None between chunks (a cancellation point), then the
        fp32 logits of the last position."""
        c = self.chunk_size
        pos = start
        logits = None
        cache.tokens = cache.tokens[:start]
        cache.aligned = min(cache.aligned, start)
        while pos < len(ids):
            end = min(len(ids), (pos // c + 1) * c)
            chunk = torch.tensor([ids[pos:end]], dtype=torch.long, device=self.device)
            with torch.inference_mode():
                logits = self.model(chunk, start=pos, cache=cache, last_only=True)
            cache.tokens.extend(ids[pos:end])
            if end % c == 0:
                cache.aligned = end
            pos = end
            if pos < len(ids):
                yield None
        assert logits is not None
        yield logits[0, -1].float()

    def decode_step(self, cache: KVCache, token: int) -> torch.Tensor:
        pos = len(cache.tokens)
        x = torch.tensor([[token]], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(x, start=pos, cache=cache)
        cache.tokens.append(token)
        return logits[0, -1].float()

    # -- generation -----------------------------------------------------------------------------------

    def fit_prompt(self, ids: list[int], max_tokens: int, truncate: bool = False) -> list[int]:
        limit = self.config.max_context
        if len(ids) + max_tokens <= limit:
            return ids
        if not truncate or max_tokens >= limit:
            raise ContextOverflowError(len(ids), max_tokens, limit)
        return ids[len(ids) - (limit - max_tokens) :]

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: list[str] | tuple[str, ...] = (),
        cache: KVCache | None = None,
        truncate: bool = False,
        result: Generation | None = None,
        ticks: bool = False,
    ) -> Iterator[Token | None]:
        """Stream tokens for a prompt. Breaking out of the loop is how a caller cancels.

        `result` (if given) is filled in as generation runs. With `ticks`, None is yielded between
        prefill chunks so a scheduler can check for cancellation and interleave other work.
        """
        t0 = time.perf_counter()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt: nothing to continue from")
        if not isinstance(prompt, str) and not all(0 <= i < self.config.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size}), the model's vocabulary")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        ids = self.fit_prompt(ids, max_tokens, truncate)
        res = result if result is not None else Generation(prompt_tokens=len(ids))
        res.prompt_tokens = len(ids)
        if cache is None:
            cache = self.new_cache()
        sampler = Sampler(sampling or SamplingParams(), self.device)
        need_history = sampler.params.repetition_penalty != 1.0
        start = self.reusable(cache, ids)
        res.cached_tokens = start
        logits = None
        for out in self.prefill(cache, ids, start):
            if out is None:
                if ticks:
                    yield None
            else:
                logits = out
        res.prefill_ms = (time.perf_counter() - t0) * 1000
        if max_tokens == 0:
            res.finish_reason = "length"
            res.total_ms = res.prefill_ms
            return
        stops = StopMatcher(stop)
        stream = self.tokenizer.stream(ids)
        history = list(ids) if need_history else []
        res.finish_reason = "length"
        hit = False
        for i in range(max_tokens):
            hist = torch.tensor(history, device=self.device) if need_history else None
            tok = sampler(logits, hist)
            if tok in self.stop_ids:
                res.finish_reason = "stop"
                break
            res.tokens.append(tok)
            res.completion_tokens += 1
            if need_history:
                history.append(tok)
            piece, hit = stops.feed(stream.step(tok))
            res.text += piece
            if res.first_token_ms is None:
                res.first_token_ms = (time.perf_counter() - t0) * 1000
            yield Token(tok, piece)
            if hit:
                res.finish_reason = "stop"
                break
            if i + 1 < max_tokens:
                logits = self.decode_step(cache, tok)
        if not hit and (tail := stops.flush()):
            res.text += tail
            yield Token(None, tail)
        res.total_ms = (time.perf_counter() - t0) * 1000

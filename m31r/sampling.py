"""Next-token selection: greedy unless sampling is asked for, and then reproducible from a seed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy: deterministic by default (README "The socket protocol")
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    repetition_penalty: float = 1.0  # 1 = off
    seed: int | None = None

    def __post_init__(self) -> None:
        # Written as `not x >= 0` so that NaN is refused too: a NaN temperature reached multinomial as NaN
        # probabilities (a RuntimeError), a NaN penalty made every seen logit NaN (greedy then picked one of them).
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def generator_seed(seed: int) -> int:
    """The 32 bits torch's CPU generator keeps of `seed` (its Mersenne Twister takes the low half: seeds 0, 2**32 and
    2**63 drew the same numbers), made of all 64: the high half, mixed by a multiplicative hash so that simple seeds
    like 2**32 + 1 do not land on 1, is folded into the low. Seeds below 2**32 are unchanged, and so are their draws."""
    s = seed % 2**64
    return (s ^ ((s >> 32) * 0x9E3779B1)) & 0xFFFFFFFF


class Sampler:
    """Per-request state: its own generator, so concurrent requests never share randomness."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu"):
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self.generator = torch.Generator(device=device).manual_seed(generator_seed(seed))

    def __call__(self, logits: Tensor, history: Tensor | None = None) -> int:
        """Pick a token from fp32 `logits` [vocab]; `history` holds the ids seen so far for the penalty."""
        p = self.params
        if p.repetition_penalty != 1.0 and history is not None and history.numel():
            seen = logits.index_select(0, history)
            # A penalty far from 1 over- or underflows in float32 (to inf, or to 0 and then x/0): clamp the penalty to
            # float32's range and the penalised logits to finite values, so no inf or nan reaches the softmax. A logit
            # a mask set to -inf (token healing, unused ids) stays -inf: clamped to -max it became a token that a
            # huge temperature (-max / 1e38 is -3.4) samples like any other, breaking the healed text.
            f = torch.finfo(logits.dtype)
            rp = min(max(p.repetition_penalty, f.tiny), f.max)
            penalised = torch.where(seen > 0, seen / rp, seen * rp).clamp(-f.max, f.max)
            seen = torch.where(seen == float("-inf"), seen, penalised)
            logits = logits.index_copy(0, history, seen)
        if p.greedy:
            return int(logits.argmax())
        return int(torch.multinomial(filtered_probs(logits, p), 1, generator=self.generator))


def filtered_probs(logits: Tensor, p: SamplingParams) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus); the most likely token always survives."""
    # Shift so the best logit is 0 before dividing: a tiny temperature then gives -inf for the rest, not inf/nan. The
    # temperature is clamped to float32's range: one that rounds to 0 (1e-50) would make 0/0, and one that rounds to
    # inf (1e300) -inf/inf, for a masked logit; both are nan, which multinomial refuses.
    f = torch.finfo(logits.dtype)
    logits = (logits - logits.max()) / min(max(p.temperature, f.tiny), f.max)
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Drop a token when the mass before it already reaches top_p; the first is never dropped.
        drop = (sorted_probs.cumsum(0) - sorted_probs) >= p.top_p
        drop[0] = False  # a top_p that underflows to 0 in float32 must still keep the argmax
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        probs = probs / probs.sum()
    return probs

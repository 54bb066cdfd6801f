"""The M31R transformer (06_MODEL_ARCHITECTURE): decoder-only, RoPE, pre-norm RMSNorm, SwiGLU, tied head.

One module does both training (full causal sequences) and inference (chunks against a static KV cache).
QKV and gate/up projections are fused so a decode step runs two matmuls per sub-layer, not five.
RoPE uses the rotate-half layout of Llama checkpoints so their weights load without permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m31r.config import ModelConfig


class KVCache:
    """A static per-sequence key/value buffer for every layer: allocated once, written in place.

    `tokens` lists the ids whose keys/values are valid at positions [0, len(tokens)); `aligned` counts
    the leading positions that were computed by full, position-aligned prefill chunks, the only ones
    whose values are bit-identical to a cold prefill and therefore safe to reuse (see engine.prefill).
    """

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        shape = (config.n_layers, 1, config.kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.tokens: list[int] = []
        self.aligned = 0

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        self.tokens = []
        self.aligned = 0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32: bf16 squares lose too much precision over d_model terms.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.type_as(x)


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    # Always on the CPU, even inside a `torch.device("meta")` block: meta arithmetic imports torch._dynamo.
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    freqs = torch.outer(torch.arange(config.max_context, dtype=torch.int64, device="cpu").float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = config.n_heads, config.kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.d_model, (self.n_heads + 2 * self.n_kv) * self.hd, bias=False)
        self.wo = nn.Linear(self.n_heads * self.hd, config.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None, layer: int, start: int
    ) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).split([self.n_heads * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], -1)
        q = apply_rope(q.view(b, t, self.n_heads, self.hd).transpose(1, 2), cos, sin)
        k = apply_rope(k.view(b, t, self.n_kv, self.hd).transpose(1, 2), cos, sin)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)
        gqa = self.n_kv != self.n_heads
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            end = start + t
            cache.k[layer, :, :, start:end] = k
            cache.v[layer, :, :, start:end] = v
            k, v = cache.k[layer, :, :, :end], cache.v[layer, :, :, :end]
            if t == 1:  # one new token sees every cached position: no mask needed
                y = F.scaled_dot_product_attention(q, k, v, enable_gqa=gqa)
            elif start == 0:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                # SDPA's is_causal aligns top-left; a chunk at `start` needs the bottom-right diagonal.
                mask = torch.ones(t, end, dtype=torch.bool, device=x.device).tril(diagonal=start)
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class FeedForward(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.hidden = config.ffn_hidden
        self.w13 = nn.Linear(config.d_model, 2 * config.ffn_hidden, bias=False)  # gate ++ up
        self.w2 = nn.Linear(config.ffn_hidden, config.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).split(self.hidden, dim=-1)
        return self.w2(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(config.d_model, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.d_model, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None, layer: int, start: int):
        x = x + self.attention(self.attention_norm(x), cos, sin, cache, layer, start)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        # nn.Embedding's default N(0, 1) init, skipped on the meta device (Engine builds there): a meta normal_()
        # imports torch._dynamo, which costs ~2 s of daemon startup for nothing.
        emb = torch.empty(config.vocab_size, config.d_model)
        if not emb.is_meta:
            nn.init.normal_(emb)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.d_model, _weight=emb)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.d_model, config.norm_eps)
        cos, sin = rope_tables(config)  # computed on the CPU, then moved where the parameters live
        self.register_buffer("rope_cos", cos.to(emb.device), persistent=False)
        self.register_buffer("rope_sin", sin.to(emb.device), persistent=False)

    def forward(
        self, tokens: Tensor, start: int = 0, cache: KVCache | None = None, last_only: bool = False
    ) -> Tensor:
        """Logits for `tokens` at absolute positions [start, start + T).

        With a cache, keys/values are written at those positions and attention reads [0, start + T).
        `last_only` applies the LM head to the final position only: prefill needs nothing else.
        """
        t = tokens.shape[1]
        if start + t > self.config.max_context:
            raise ValueError(f"positions up to {start + t} exceed max_context {self.config.max_context}")
        x = self.tok_embeddings(tokens)
        cos = self.rope_cos[start : start + t].to(x.dtype)
        sin = self.rope_sin[start : start + t].to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start)
        if last_only:
            x = x[:, -1:]
        return F.linear(self.norm(x), self.tok_embeddings.weight)


def init_weights(model: Transformer, seed: int) -> None:
    """Deterministic random init (06 §21): the same seed gives the same bytes on any machine.

    Drawn on the CPU from a private generator, GPT-2 style: N(0, 0.02), residual outputs scaled down by
    sqrt(2 * n_layers) so the residual stream does not grow with depth.
    """
    gen = torch.Generator().manual_seed(seed)
    std = 0.02
    out_std = std / math.sqrt(2 * model.config.n_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            s = out_std if name.endswith(("wo.weight", "w2.weight")) else std
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * s)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes of a bundle's model.safetensors."""
    d, hd = config.d_model, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"tok_embeddings.weight": (config.vocab_size, d), "norm.weight": (d,)}
    for i in range(config.n_layers):
        p = f"layers.{i}."
        shapes[p + "attention_norm.weight"] = (d,)
        shapes[p + "attention.wqkv.weight"] = ((config.n_heads + 2 * config.kv_heads) * hd, d)
        shapes[p + "attention.wo.weight"] = (d, config.n_heads * hd)
        shapes[p + "ffn_norm.weight"] = (d,)
        shapes[p + "feed_forward.w13.weight"] = (2 * config.ffn_hidden, d)
        shapes[p + "feed_forward.w2.weight"] = (d, config.ffn_hidden)
    return shapes

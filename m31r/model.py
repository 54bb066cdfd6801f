"""The M31R transformer (README "The default model"): decoder-only, RoPE, pre-norm RMSNorm, SwiGLU, tied head.

Imported Llama/Qwen2 checkpoints may also set q/k/v biases, a separate LM head and RoPE scaling (ModelConfig's
optional fields); with the defaults the model is exactly the one trained here.

One module does both training (full causal sequences) and inference (chunks against a KV cache that is
written in place and sized to its context in 64-position blocks).
QKV and gate/up projections are fused so a decode step runs two matmuls per sub-layer, not five.
RoPE uses the rotate-half layout of Llama checkpoints so their weights load without permutation.
"""

from __future__ import annotations

import copy
import math
import mmap
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m31r import native
from m31r.config import ModelConfig
from m31r.native import DecodeTable, Kernels
from m31r.quant import F32_GEMM_ROWS, INT4_GEMM_ROWS, INT8_GEMM_ROWS, native_mat

SPAN = 64  # decode attends over a multiple of this many positions; cache capacities are multiples of it
NATIVE_AHEAD = 3 * SPAN  # with native decode attention a cache grows by this much beyond span_of(context) at once


def span_of(n: int) -> int:
    """The positions a query at context length n attends over: n rounded up to SPAN (the rest masked out)."""
    return -(-n // SPAN) * SPAN


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """A zero tensor; on the CPU one with an anonymous memory map of its own. The kernel hands out zero pages that
    become resident only once written, and unmaps them as soon as the tensor is freed: glibc keeps freed blocks of a
    few MB in its heap, and a cache that grows and shrinks block by block then held ~60 MB more than it used."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


class KVCache:
    """A per-sequence key/value buffer for every layer, written in place, whose capacity follows its context.

    `tokens` lists the ids whose keys/values are valid at positions [0, len(tokens)); `chunks` lists the ends
    of the leading full prefill chunks that computed them, in order. Only positions inside such chunks are ever
    reused, and only while the chunks are the ones a cold prefill of the new prompt would run (see engine).

    A decode step attends over span_of(n) positions. The capacity is kept at exactly that span while decoding
    (`fit`), so each layer's keys/values are one dense block: a bf16 matmul copies any operand whose batch is not
    dense, and that copy of the whole context per layer and token cost more than the attention itself. Resizing
    copies once per SPAN tokens instead, one layer at a time, so it holds at most one layer twice. Positions past
    the context hold finite values (zeros, or stale entries of an earlier use): masked positions then contribute
    exactly 0 * v.
    """

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        self.n_layers, self.kv_heads, self.head_dim = config.n_layers, config.kv_heads, config.head_dim
        self.dtype, self.device = dtype, torch.device(device)
        empty = torch.empty(1, self.kv_heads, 0, self.head_dim, dtype=dtype, device=self.device)
        self.k: list[Tensor] = [empty] * self.n_layers  # per layer: [1, kv_heads, capacity, head_dim]
        self.v: list[Tensor] = [empty] * self.n_layers
        self.capacity = 0
        self.tokens: list[int] = []
        self.chunks: list[int] = []
        self._resize(span_of(capacity))

    def _resize(self, capacity: int, keep: int | None = None) -> None:
        """`keep`: the positions worth copying into the new buffers (default: all that fit).

        An allocation that fails midway leaves some layers at the new size and the rest at the old, which no one
        capacity describes, while the kernels index every layer with one (a stale one read and wrote past a shrunk
        layer's end). Capacity 0 then makes the next reserve or fit resize all of them before any pass reads them,
        copying positions [0, keep), which every layer still holds; the tokens claimed past those go. Holding the old
        layers to put back instead would hold two whole caches at once, the peak this layer-by-layer copy avoids."""
        shape = (1, self.kv_heads, capacity, self.head_dim)
        held = min(t.shape[2] for t in (*self.k, *self.v))  # self.capacity, unless a resize failed midway
        keep = min(capacity, held, held if keep is None else keep)
        replaced = 0
        try:
            for store in (self.k, self.v):
                for layer, old in enumerate(store):
                    new = zeros(shape, self.dtype, self.device)
                    new[:, :, :keep] = old[:, :, :keep]
                    store[layer] = new
                    replaced += 1
        except BaseException:
            if replaced:
                self.capacity = 0
                del self.tokens[keep:]
                self.chunks = [e for e in self.chunks if e <= keep]
            raise
        self.capacity = capacity

    def reserve(self, n: int, keep: int | None = None) -> None:
        """Room for positions [0, n); a resize copies the first `keep` positions (default: all)."""
        if n > self.capacity:
            self._resize(span_of(n), keep)

    def fit(self, n: int, ahead: int = 0) -> None:
        """Capacity from span_of(n) to span_of(n) + ahead, resized to the latter when outside. The eager decode
        attention wants exactly span_of(n) (dense blocks); the native kernel reads any capacity, so it grows a
        cache `ahead` positions at a time and copies it four times less often."""
        if not span_of(n) <= self.capacity <= span_of(n) + ahead:
            self._resize(span_of(n) + ahead)

    def clone(self) -> KVCache:
        """A copy with buffers of its own (beam search's caches start as copies of the prompt's)."""
        new = copy.copy(self)
        with torch.inference_mode():
            new.k, new.v = [t.clone() for t in self.k], [t.clone() for t in self.v]
        new.tokens, new.chunks = list(self.tokens), list(self.chunks)
        return new

    def take(self, other: KVCache, start: int) -> None:
        """Become `other` from position `start` on: the positions before it must already hold the same keys and
        values (beam search moves a hypothesis between caches that share the prompt by copying only its tail, and
        fills a spare cache from the prompt's first position that it does not hold already)."""
        end = len(other.tokens)
        capacity = max(other.capacity, span_of(end))  # other's (0 after its failed resize: _resize)
        if self.capacity != capacity:  # as other's, so that decoding resizes both alike (fit)
            self._resize(capacity, keep=start)
        try:
            with torch.inference_mode():
                for mine, theirs in ((self.k, other.k), (self.v, other.v)):
                    for layer, t in enumerate(theirs):
                        mine[layer][:, :, start:end] = t[:, :, start:end]
        except BaseException:  # positions from `start` on may hold other's in some layers: they are no one's now
            del self.tokens[start:]
            self.chunks = [e for e in self.chunks if e <= start]
            raise
        self.tokens, self.chunks = list(other.tokens), list(other.chunks)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.k, *self.v))

    def reset(self) -> None:
        self.tokens = []
        self.chunks = []


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


def rope_frequencies(config: ModelConfig) -> Tensor:
    """The rotation frequency of each dimension pair, with the config's scaling applied as transformers does."""
    # Always on the CPU, even inside a `torch.device("meta")` block: meta arithmetic imports torch._dynamo.
    hd = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64, device="cpu").float() / hd))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.type == "linear":
        return inv_freq / scaling.factor
    # llama3: wavelengths below original_max_context / high_freq_factor keep their frequency, those above
    # original_max_context / low_freq_factor are slowed by `factor`, and the band between blends the two.
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context = scaling.original_max_context
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_context / low, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
    return torch.where(medium, blended, scaled)


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sin per position and dimension; sin carries rotate-half's sign (-sin on the first half)."""
    inv_freq = rope_frequencies(config)
    freqs = torch.outer(torch.arange(config.max_context, dtype=torch.int64, device="cpu").float(), inv_freq)
    return torch.cat((freqs, freqs), dim=-1).cos(), torch.cat((-freqs.sin(), freqs.sin()), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half RoPE, x * cos + cat(-x2, x1) * sin, as three ops: roll gives (x2, x1), the table the sign."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = config.n_heads, config.kv_heads, config.head_dim
        self.wqkv = nn.Linear(config.d_model, (self.n_heads + 2 * self.n_kv) * self.hd, bias=config.qkv_bias)
        self.wo = nn.Linear(self.n_heads * self.hd, config.d_model, bias=False)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cache: KVCache | None, layer: int, start: int
    ) -> Tensor:
        b, t, _ = x.shape
        h, kv = self.n_heads, self.n_kv
        qkv = self.wqkv(x).view(b, t, h + 2 * kv, self.hd).transpose(1, 2)  # [b, heads, t, hd]
        qk = apply_rope(qkv[:, : h + kv], cos, sin)  # q and k rotated in one go
        q, k, v = qk[:, :h], qk[:, h:], qkv[:, h + kv :]
        gqa = kv != h
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            end = start + t
            ck, cv = cache.k[layer], cache.v[layer]
            ck[:, :, start:end] = k
            cv[:, :, start:end] = v
            y = self._attend_chunk(q, ck[:, :, :end], cv[:, :, :end], start)  # decode steps run in `step`
        return self.wo(y.transpose(1, 2).reshape(b, t, h * self.hd))

    @staticmethod
    def _attend_chunk(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
        """Causal attention of a prefill chunk of t queries at `start` over cached k/v [0, start + t)."""
        t, gqa = q.shape[2], k.shape[1] != q.shape[1]
        if k.dtype != q.dtype:  # a half-size cache (float16 under fp32 activations): read back widened
            k, v = k.to(q.dtype), v.to(q.dtype)
        if t >= CHUNK_MIN_ROWS and q.dtype == torch.bfloat16 and q.device.type == "cpu":
            y = attend_chunk(q, k, v, start)
        elif start == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            # SDPA's is_causal aligns top-left; a chunk at `start` needs the bottom-right diagonal.
            mask = torch.ones(t, start + t, dtype=torch.bool, device=q.device).tril(diagonal=start)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return y

    def step(self, x: Tensor, cos: Tensor, sin: Tensor, caches: list[KVCache], positions: list[int], layer: int,
             groups: list[RowGroup] | DecodeTable, width: int, chunks: list[tuple[KVCache, int, int]],
             chunk_tables: list[DecodeTable] | None = None) -> Tensor:
        """Attention for the rows of Transformer.step (x [rows, 1, d]): `width` decode rows, one new token each for
        its own cache (rows past len(caches) are padding), then the tokens of each prefill chunk (cache, start,
        length), then padding. Projections run on all rows at once; attention runs per group of decode rows (see
        row_groups; or all at once in the native kernel, given a DecodeTable) and per chunk, each over its own cache
        (in the native kernel, given a table per chunk: Transformer._prefill_native). Padding rows attend to nothing."""
        m = x.shape[0]
        h, kv = self.n_heads, self.n_kv
        flat = self.wqkv(x)  # [rows, 1, (heads + 2 kv_heads) * hd]
        y = flat.new_zeros(m, h, 1, self.hd)
        # The fp32 kernels (avx2, neon) take the projection as it is and rotate q/k themselves: decode rows need no
        # RoPE or layout ops here, only the chunks' rows (from `width` on), and those none either with chunk tables.
        fused = isinstance(groups, DecodeTable) and groups.kernels.float_dtype == flat.dtype
        if fused:
            n = len(caches)
            groups.attend_qkv(flat.view(m, -1)[:n], cos.view(m, -1)[:n], sin.view(m, -1)[:n], layer,
                              y[:n].view(n, h * self.hd))
        if chunk_tables is not None:
            o = width
            for table, (_, _, t) in zip(chunk_tables, chunks, strict=True):
                rows = slice(o, o + t)
                table.attend_qkv(flat.view(m, -1)[rows], cos.view(m, -1)[rows], sin.view(m, -1)[rows], layer,
                                 y[rows].view(t, h * self.hd))
                o += t
            chunks = []
        if fused and not chunks:
            return self.wo(y.view(m, 1, h * self.hd))
        r0 = width if fused else 0  # the rows from here need rotated q/k in torch
        qkv = flat[r0:].view(m - r0, 1, h + 2 * kv, self.hd).transpose(1, 2)  # [rows, heads, 1, hd]
        qk = apply_rope(qkv[:, : h + kv], cos[r0:], sin[r0:])  # cos/sin: [rows, 1, 1, hd], each row at its position
        if isinstance(groups, DecodeTable):
            if not fused:  # the bf16 kernels (avx512 family) take rotated q and k, and v, as dense tensors
                n = len(caches)
                parts = (qk[:n, :h], qk[:n, h:], qkv[:n, h + kv :])
                q, k, v = (part.reshape(n, -1, self.hd).contiguous() for part in parts)
                groups.attend(q, k, v, layer, y[:n].view(n, h, self.hd))
        elif width:
            q = (qk[:width, :h] * self.hd**-0.5).view(width, kv, h // kv, self.hd)  # [w, kv, group, hd]
            k, v = qk[:width, h:], qkv[:width, h + kv :]
            for r, (cache, pos) in enumerate(zip(caches, positions, strict=True)):  # each fitted: k/v dense
                cache.k[layer][0, :, pos] = k[r, :, 0]
                cache.v[layer][0, :, pos] = v[r, :, 0]
            yd = y[:width].view(width, kv, h // kv, self.hd)
            for g in groups:
                ks, vs = [caches[r].k[layer] for r in g.rows], [caches[r].v[layer] for r in g.rows]
                if g.first is not None:  # rows first .. first + len: write in place
                    rows = slice(g.first, g.first + len(g.rows))
                    attend_rows(q[rows], ks, vs, g.mask, out=yd[rows])
                else:
                    yd.index_copy_(0, g.index, attend_rows(q[g.index], ks, vs, g.mask))
        o = width
        for cache, start, t in chunks:
            end = start + t
            q, k, v = (part[o - r0 : o - r0 + t].transpose(0, 2) for part in (qk[:, :h], qk[:, h:], qkv[:, h + kv :]))
            ck, cv = cache.k[layer], cache.v[layer]  # q/k/v: [1, heads, t, hd]
            ck[:, :, start:end] = k
            cv[:, :, start:end] = v
            y[o : o + t] = self._attend_chunk(q, ck[:, :, :end], cv[:, :, :end], start).transpose(0, 2)
            o += t
        return self.wo(y.transpose(1, 2).reshape(m, 1, h * self.hd))


STACK_SPAN = 256  # rows attending over at most this many positions share one attention call (row_groups)


class RowGroup:
    """Decode rows whose attention runs as one call: the same span, and a mask for those with padding positions."""

    def __init__(self, rows: list[int], span: int, ns: list[int], device: torch.device):
        self.rows = rows
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        self.first = rows[0] if contiguous else None
        self.index = None if contiguous else torch.tensor(rows, device=device)  # for rows scattered in the batch
        self.mask = span_mask(ns, span, device)


def row_groups(positions: list[int], device: torch.device) -> list[RowGroup]:
    """How a decode step's attention runs: rows at the same short span stacked into one call, longer ones alone.

    Every attention call has a fixed cost (~70 us per row and layer on the medium shape, more than the arithmetic
    of a short context), so eight streams paid it eight times per layer. Stacking copies each row's keys/values,
    which pays while the span is short (8 rows at span 64: 141 vs 457 us) and no longer at 512 (1051 vs 896 us).
    A row gets the same bits alone or stacked (attend_rows computes every row and head by itself); the engine's
    decode-width probe checks it on the running machine.
    """
    spans = [span_of(p + 1) for p in positions]
    groups: list[RowGroup] = []
    for span in dict.fromkeys(spans):
        rows = [r for r, s in enumerate(spans) if s == span]
        for part in [rows] if span <= STACK_SPAN else [[r] for r in rows]:
            groups.append(RowGroup(part, span, [positions[r] + 1 for r in part], device))
    return groups


def span_mask(ns: list[int], span: int, device: torch.device) -> Tensor | None:
    """[rows, 1, 1, span], True past each row's context length n; None where no row has such positions."""
    if all(n == span for n in ns):
        return None
    return (torch.arange(span, device=device) >= torch.tensor(ns, device=device)[:, None]).view(len(ns), 1, 1, span)


def attend_rows(q: Tensor, ks: list[Tensor], vs: list[Tensor], mask: Tensor | None,
                out: Tensor | None = None) -> Tensor:
    """Attention of one query per head (decode) for rows that attend over the same span.

    q is [rows, n_kv, group, hd], already scaled; ks/vs hold each row's keys/values, [1, n_kv, span, hd], and
    `mask` marks the positions past each row's context (see span_mask). SDPA's CPU kernel is built for blocks of
    queries; two batched matmuls are ~3x faster for one. Scores come out as [.., group, span] (queries times
    transposed keys), so the softmax runs along contiguous memory, and grouped k/v heads serve their group of
    query heads without being repeated. Spans are whole SPAN blocks: oneDNN caches a kernel per shape (a context
    growing by one position per token grew the process by ~7 MB per token), and a fitted cache passes each
    layer's k/v without a copy. Masked scores are -inf, so the (finite) values there are multiplied by exactly 0.
    """
    k = ks[0] if len(ks) == 1 else torch.cat(ks)
    v = vs[0] if len(vs) == 1 else torch.cat(vs)
    if k.dtype != q.dtype:  # a float16 cache made for the native kernels, read by the eager path
        k, v = k.to(q.dtype), v.to(q.dtype)
    scores = torch.matmul(q, k.transpose(-1, -2))  # [rows, n_kv, group, span]
    if mask is not None:
        scores.masked_fill_(mask, float("-inf"))
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(p, v, out=out)


CHUNK_HEADS = 4  # query heads per block in attend_chunk: their scores for a 256-token chunk at 2k fit in L2
CHUNK_MIN_ROWS = 32  # below this SDPA is faster (t=8 at 1.2k: 0.6 vs 1.1 ms per layer; t=64: 2.9 vs 1.9)


def attend_chunk(q: Tensor, k: Tensor, v: Tensor, start: int) -> Tensor:
    """Causal attention of a prefill chunk (queries at positions [start, start + t)) over cached k/v [0, end).

    For bf16 on the CPU: SDPA's flash kernel runs bf16 at fp32 speed (~0.12 TFLOP/s here), while bf16 matmuls
    use AMX (~0.6). Plain matmul + softmax, a few heads at a time so the scores stay in cache, halves the
    attention time of a 1536-token prefill (~930 to ~420 ms, medium). Scores are kept in bf16, as in decode.
    Only the chunk's own square needs a mask: every earlier position is visible to every query.
    """
    b, h, t, hd = q.shape
    n_kv = k.shape[1]
    group = h // n_kv
    q = (q * hd**-0.5).reshape(b, n_kv, group * t, hd)  # the query heads of one k/v head, stacked
    future = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1).repeat(group, 1)
    out = torch.empty_like(q)
    kt = k.transpose(-1, -2)
    step = max(1, CHUNK_HEADS // group)
    for i in range(0, n_kv, step):
        s = torch.matmul(q[:, i : i + step], kt[:, i : i + step])  # [b, step, group * t, end]
        s[..., start:].masked_fill_(future, float("-inf"))
        torch.matmul(torch.softmax(s, dim=-1), v[:, i : i + step], out=out[:, i : i + step])
    return out.view(b, h, t, hd)


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
        # The LM head: tied to the embedding, or (imported checkpoints) a separate `output` matrix.
        self.output = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size, bias=False)
        # Inference code may set a faster module computing the tied head's product (an int8 copy of the embedding).
        # Training leaves it None.
        self.head: nn.Module | None = None
        # Native CPU kernels (m31r.native) for decode attention; the engine sets them on the CPU where a family
        # loads whose dtype is the activations' (avx512: bf16, avx2 and neon: fp32). Every decode row, alone or
        # batched, then runs them.
        self.native: Kernels | None = None
        self._plan: tuple | None = None  # (kernels and int8 mode, LayerPlan or None): layer_plan's cache
        self.layer_calls = True  # decode passes may run one native call per layer (layer_plan); benchmarks switch

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
        if cache is not None:
            cache.reserve(start + t)
        x = self.tok_embeddings(tokens)
        if cache is not None and x.shape[0] == 1 and self._attends_native(x.dtype, cache):
            return self._prefill_native(x[0], start, cache, last_only)
        cos = self.rope_cos[start : start + t].to(x.dtype)  # a no-op where the tables are kept in x's dtype
        sin = self.rope_sin[start : start + t].to(x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start)
        if last_only:
            x = x[:, -1:]
        return self._head(self.norm(x))

    def step(self, tokens: Tensor, caches: list[KVCache], positions: list[int], width: int,
             chunks: list[tuple[KVCache, int, int]], shares: list[tuple[object, int] | None] | None = None,
             ) -> tuple[Tensor, list[Tensor]]:
        """One forward pass over independent sequences: decode rows and short prefill chunks together.

        `tokens` [rows] holds `width` decode rows (row r < len(caches) feeds the next token of caches[r] at
        positions[r]; the rest are padding), then the tokens of each chunk (cache, start, length) in order, then
        padding. Every matmul runs on all rows at once, so the sequences share one read of the weights; the
        kernels give a row the same bits at any row count the engine uses (it probes them), so no sequence's
        result depends on the others. Returns the decode rows' logits [len(caches), vocab] and each chunk's
        logits at its last position [vocab], that one through the head by itself."""
        top = max([p + 1 for p in positions] + [s + t for _, s, t in chunks])
        if top > self.config.max_context:
            raise ValueError(f"positions up to {top} exceed max_context {self.config.max_context}")
        native = self.native is not None  # set (by the engine) only on the CPU, for the family's dtype
        for cache, p in zip(caches, positions, strict=True):
            cache.fit(p + 1, min(NATIVE_AHEAD, span_of(self.config.max_context) - span_of(p + 1)) if native else 0)
        for cache, s, t in chunks:
            cache.reserve(s + t)
        m = tokens.shape[0]
        where = positions + [0] * (width - len(positions)) + [p for _, s, t in chunks for p in range(s, s + t)]
        pos = torch.tensor(where + [0] * (m - len(where)), device=tokens.device)
        x = self.tok_embeddings(tokens.view(m, 1))
        cos = self.rope_cos[pos].view(m, 1, 1, -1).to(x.dtype)
        sin = self.rope_sin[pos].view(m, 1, 1, -1).to(x.dtype)
        # shares (per decode row, see engine.Decode) only let the native attention read a shared prompt once
        groups = (DecodeTable(self.native, caches, positions, shares) if native and caches
                  else row_groups(positions, tokens.device))
        tables = ([DecodeTable(self.native, [c] * t, list(range(s, s + t))) for c, s, t in chunks]
                  if chunks and all(self._attends_native(x.dtype, c) for c, _, _ in chunks) else None)
        def attend(h: Tensor, i: int) -> Tensor:
            return self.layers[i].attention.step(h, cos, sin, caches, positions, i, groups, width, chunks, tables)

        if native and self.native.float_dtype == x.dtype and self._fits_step_ops():
            plan = self.layer_plan(m) if not chunks and isinstance(groups, DecodeTable) else None
            normed = self._layers_fused(x, plan, cos, sin, groups) if plan else self._layers_native(x, attend)
        else:
            for i, layer in enumerate(self.layers):
                x = x + attend(layer.attention_norm(x), i)
                x = x + layer.feed_forward(layer.ffn_norm(x))
            normed = None

        def head(rows: slice) -> Tensor:
            return self._head(self.norm(x[rows]) if normed is None else normed[rows])

        decoded = head(slice(0, width))[: len(caches), -1] if width else x.new_empty(0)
        ends = list(accumulate((t for _, _, t in chunks), initial=width))[1:]  # the row after each chunk's last
        return decoded, [head(slice(e - 1, e))[0, -1] for e in ends]

    def _attends_native(self, dtype: torch.dtype, cache: KVCache) -> bool:
        """Whether a prefill chunk into `cache` runs the fp32 kernels' attention: the AVX2 families', measured
        faster than torch's on x86. NEON's attend_head scores one key at a time, and Arm was not measured: it keeps
        torch's chunk attention."""
        kern = self.native
        return (kern is not None and kern.float_dtype == dtype == torch.float32 and kern.family.base == "avx2"
                and cache.dtype in kern.kv_dtypes and self.config.head_dim % 16 == 0 and self._fits_step_ops())

    def _prefill_native(self, x: Tensor, start: int, cache: KVCache, last_only: bool) -> Tensor:
        """forward for one prefill chunk x [t, d] with the AVX2 kernels: each of its tokens attends as a decode row
        of the chunk's cache would (the decode kernel reads the fp16 cache as it is, each row over positions [0, its
        own]), and the per-token ops are _layers_native's. Torch's chunk attention widened the whole cached context
        to fp32 for every chunk and layer and ran SDPA with a mask: a keystroke's answer took 1.1-1.2x as long
        (docs/serving.md "Prefill chunks in the decode kernel")."""
        t = x.shape[0]
        table = DecodeTable(self.native, [cache] * t, list(range(start, start + t)))
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]

        def attend(h: Tensor, i: int) -> Tensor:
            a = self.layers[i].attention
            out = h.new_empty(t, a.n_heads * a.hd)
            table.attend_qkv(a.wqkv(h), cos, sin, i, out)
            return a.wo(out)

        normed = self._layers_native(x, attend)
        return self._head(normed[-1:] if last_only else normed).unsqueeze(0)

    def _fits_step_ops(self) -> bool:
        """Whether the fp32 kernels' per-token ops take this shape (rows of a multiple of 8 values)."""
        return self.config.d_model % 8 == 0 and self.config.ffn_hidden % 8 == 0

    def _layers_native(self, x: Tensor, attend) -> Tensor:
        """Transformer.step's layers with the fp32 kernels' per-token ops (avx2, neon): each residual add and the
        RMSNorm after it are one call, SwiGLU's product another, and decode attention takes the projection as it is
        (Attention.step), so a layer runs its four matmuls, its attention and three small calls. Adds into x in
        place; returns the final norm of every row (the head's input)."""
        kern, h = self.native, torch.empty_like(x)
        kern.add_rmsnorm(x, None, self.layers[0].attention_norm.weight, self.layers[0].attention_norm.eps, h)
        for i, layer in enumerate(self.layers):
            a = attend(h, i)
            kern.add_rmsnorm(x, a, layer.ffn_norm.weight, layer.ffn_norm.eps, h)
            f = layer.feed_forward.w2(kern.swiglu(layer.feed_forward.w13(h)))
            after = self.layers[i + 1].attention_norm if i + 1 < len(self.layers) else self.norm
            kern.add_rmsnorm(x, f, after.weight, after.eps, h)
        return h

    def layer_plan(self, rows: int) -> LayerPlan | None:
        """The layers as one call each (m31r_decode_layer_f32) can run them for a decode pass of `rows` rows: every
        matrix on the fp32 family's kernels, no biases; None where any is not (the per-call path runs). Built once
        per kernels and int8 mode (the engine drops it when it switches kernels)."""
        kern = self.native
        if (kern is None or not kern.decode_layer or not self.layer_calls
                or rows >= min(F32_GEMM_ROWS, INT8_GEMM_ROWS, INT4_GEMM_ROWS)):
            return None
        key = (id(kern), kern.int8_mode)
        if self._plan is None or self._plan[0] != key:
            self._plan = (key, LayerPlan.build(self))
        return self._plan[1]

    def _layers_fused(self, x: Tensor, plan: LayerPlan, cos: Tensor, sin: Tensor, table: DecodeTable) -> Tensor:
        """_layers_native in one native call per layer, the same kernels on the same operands (the same bits)."""
        kern, m = self.native, x.shape[0]
        x2, h = x.view(m, -1), torch.empty(m, x.shape[-1], dtype=x.dtype)
        first = self.layers[0].attention_norm
        kern.add_rmsnorm(x2, None, first.weight, first.eps, h)
        scratch = torch.empty(kern.decode_scratch(m, plan.shape), dtype=torch.float32)
        c, s = cos.view(m, -1), sin.view(m, -1)
        for i, (mats, norms) in enumerate(plan.layers):
            kern.decode_layer_f32(plan.shape, mats, norms, x2, h, c, s, table, i, scratch)
        return h.view_as(x)

    def _head(self, x: Tensor) -> Tensor:
        if self.head is not None:
            return self.head(x)
        return self.output(x) if self.output is not None else F.linear(x, self.tok_embeddings.weight)


class LayerPlan:
    """Per layer, its four matrices (native.Mat: wqkv, wo, w13, w2) and its norms (the ffn norm's weight and eps,
    then the next attention norm's, or the final norm's), as m31r_decode_layer_f32 takes them."""

    def __init__(self, shape: tuple[int, ...], layers: list):
        self.shape, self.layers = shape, layers

    @staticmethod
    def build(model: Transformer) -> LayerPlan | None:
        c = model.config
        layers = []
        for i, layer in enumerate(model.layers):
            mods = (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2)
            mats = [native_mat(mod) for mod in mods]
            after = model.layers[i + 1].attention_norm if i + 1 < len(model.layers) else model.norm
            norms = (layer.ffn_norm.weight, after.weight)
            if any(m is None for m in mats) or any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
                return None
            layers.append(((native.Mat * 4)(*mats), (norms[0], layer.ffn_norm.eps, norms[1], after.eps)))
        return LayerPlan((c.d_model, c.n_heads, c.kv_heads, c.head_dim, c.ffn_hidden), layers)


def init_weights(model: Transformer, seed: int) -> None:
    """Deterministic random init: the same seed gives the same bytes on any machine.

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
            if name.endswith(".bias"):
                p.zero_()
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
        if config.qkv_bias:
            shapes[p + "attention.wqkv.bias"] = ((config.n_heads + 2 * config.kv_heads) * hd,)
    if not config.tie_embeddings:
        shapes["output.weight"] = (config.vocab_size, d)
    return shapes

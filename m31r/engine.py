"""The core runtime (README "How a completion flows", step 4): load a bundle, prefill into a KV cache, decode, stream.

Determinism across cache reuse: a token's keys/values depend on how its prefill chunk was shaped (matmul
blocking changes float reduction order, and kernels are chosen by row count). Prefill therefore splits a
prompt into chunks by a fixed rule of absolute positions and prompt length (`chunk_layout`), and a cached
position is reused only inside leading chunks that the rule also gives for the new prompt. A warm request
then recomputes exactly the chunks a cold one would, bit for bit, so greedy output with a cache hit equals
output without one.

The rule takes, from each position, the largest chunk of `chunk_size * 2**i` tokens (up to `max_chunk`) that
starts at a multiple of its own size and ends inside the prompt; fewer than `chunk_size` leftover tokens form
a last, partial chunk that is never reused. A cold 1536-token prompt runs as six 256-token chunks (near the
speed of one forward pass), while typing at the end of a prompt keeps everything up to the last `chunk_size`
boundary before the edit: the chunks before it are the same for both lengths, except when the prompt grows
across a boundary of a larger chunk, which then runs once as one chunk.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch

from m31r import native
from m31r.bundle import Bundle, load_weights, open_bundle
from m31r.checksums import verify_in_background
from m31r.lookup import Lookup
from m31r.model import KVCache, Transformer, rope_tables, span_of
from m31r.precision import auto_precision, fast_bf16, resolve  # noqa: F401  (the first two: re-exported)
from m31r.quant import DEFAULT_INT4_GROUP, FloatLinear, Int4Linear, Int8Linear, prepare
from m31r.sampling import Sampler, SamplingParams
from m31r.stops import StopMatcher
from m31r.tokenizer import Tokenizer

FUSE_CHUNK = 32  # prefill chunks of up to this many tokens share forward passes with decode rows (Engine.run)
FUSE_ROWS = 48  # the rows of such a shared pass; below 64, where the int8/int4 layers switch kernels (quant)
HEAL_MASK_BYTES = 4 << 20  # token healing's cached masks (Engine.heal_logits): 256 of a 16k vocabulary
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
class Piece:
    """Text that became safe to show, and the token that produced it.

    `text` may be empty while a UTF-8 character or a possible stop sequence is pending; `id` is None for
    held-back text released at the end of generation.
    """

    id: int | None
    text: str
    logprob: float | None = None  # the token's (Outcome.logprobs)
    top: tuple[tuple[int, float], ...] = ()  # the likeliest tokens at its step and theirs (generate's top_logprobs)


@dataclass
class Decode:
    """What a batched generator asks its driver for: run `token` at the end of `cache`, send back the logits.

    `drafts` (prompt-lookup decoding, m31r.lookup) are guesses of the tokens after `token`: they run in the same
    forward pass as further rows on the same cache, at the positions after it, and the logits come back as one
    row per token fed ([1 + len(drafts), vocab]; without drafts a single [vocab] row). The scheduler collects
    these from all its streams and answers them with one `Engine.run` call."""

    cache: KVCache
    token: int
    drafts: list[int] = field(default_factory=list)
    # (key, n): the Decodes of a pass with the same key hold the same keys/values at positions [0, n) (a beam search's
    # hypotheses share their prompt), which the native attention then reads once for all of them (DecodeTable).
    share: tuple[object, int] | None = None

    @property
    def rows(self) -> list[int]:
        return [self.token, *self.drafts]


@dataclass
class Chunk:
    """A prefill chunk a batched generator asks its driver to run: `ids` at positions [start, start + len(ids)) of
    `cache`. The driver sends back the logits of its last position if it is the prompt's `last` chunk, else None."""

    cache: KVCache
    ids: list[int]
    start: int
    last: bool


@dataclass
class Outcome:
    """The outcome of one generation, filled in as it runs; read it once the token iterator is exhausted."""

    prompt_tokens: int
    cached_tokens: int = 0
    completion_tokens: int = 0  # the tokens written after healing_tokens: what max_tokens bounds
    # The first tokens written, where they wrote only healed text again (m31r.fim's token healing): they finish the
    # prompt, so max_tokens does not count them (the context's room after the prompt bounds them) and no Piece
    # streams them. `tokens` and `logprobs` hold both kinds.
    healing_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None  # stop | length | cancelled | deadline
    # what a "stop" was: end (the model's end token) | sequence | repeat (m31r.stops) | unsure (min_probability)
    stopped_by: str | None = None
    stop_sequence: str | None = None  # a "sequence" stop's: the stop (or start stop) that matched, as given
    prefill_ms: float = 0.0  # a healed prompt's: until the first token after the healing tokens (they read it)
    first_token_ms: float | None = None
    total_ms: float = 0.0
    decode_steps: int = 0  # decode model calls (each one forward pass row group: a token and its drafts)
    drafted: int = 0  # draft tokens fed to those calls (prompt-lookup decoding)
    accepted: int = 0  # of which greedy decoding confirmed: tokens produced without a call of their own
    alternatives: list[str] = field(default_factory=list)  # a beam search's runners-up, likeliest first (m31r.beams)
    # The log-probability of each token of the completion under the model (after the healing and unused-id masks,
    # before temperature and penalties), and last that of the end token where the model ended it: how sure the
    # model was of what it wrote (line_logprob below; README "Confidence").
    logprobs: list[float] = field(default_factory=list)


def line_logprobs(token_bytes: list[bytes | None], tokens: list[int], logprobs: list[float],
                  lines: int | None = None, healed_breaks: int = 0) -> list[float]:
    """Each line's log-probability: its tokens' up to and including the one that holds its line break (a token
    holding several breaks ends as many lines, the later ones certain), the last line's with the end token's where
    the model ended it (Outcome.logprobs). The first k summed are how likely the model finds the completion's first
    k lines: what an editor cuts a multi-line suggestion to (m31r_protocol.policy.confident_lines); the first alone
    is Done.line_logprob, which predicts whether the line an editor shows first is right (README "Confidence").
    `lines`: the number of lines the completion's text kept (a stop sequence may end it before its last tokens).
    `healed_breaks`: the line breaks in the healed text (m31r.fim.heal_prompt), which the first tokens write again:
    the prompt's, not the completion's, so they end no line (their tokens count towards the first)."""
    out: list[float] = []
    total = 0.0
    for tok, lp in zip(tokens, logprobs, strict=False):
        total += lp
        breaks = (token_bytes[tok] or b"").count(b"\n")
        skip, healed_breaks = min(breaks, healed_breaks), healed_breaks - min(breaks, healed_breaks)
        for _ in range(breaks - skip):
            out.append(total)
            total = 0.0
    if logprobs:
        out.append(total + sum(logprobs[len(tokens):]))
    return out[:lines] if lines is not None else out


@dataclass
class Pass:
    """The model calls of one forward pass (Engine.run): decode steps, and the indices of the chunks beside them."""

    decodes: list[Decode]
    chunks: list[int] = field(default_factory=list)
    rows: int = 0  # decode rows (padded to a probed width) and chunk tokens


def heal_step(owed: bytes, written: bytes) -> tuple[bytes, bool]:
    """Token healing after a token that wrote `written`: the bytes still owed, and whether healed whitespace just
    ended exactly (the next token must then not add to it)."""
    if not owed.startswith(written):
        return b"", False
    return owed[len(written):], written == owed and owed[-1:] in (b" ", b"\t")


class TextPath:
    """The text a stream shows for its tokens: incremental detokenisation, the healed text left out, stop sequences
    cut and held back (m31r.stops). Engine.generate's, and beam search's for its answers (m31r.beams)."""

    def __init__(self, tokenizer: Tokenizer, ids: list[int], heal: str, stop: list[str] | tuple[str, ...],
                 repeat_context: str | None, start_stops: list[str] | tuple[str, ...]):
        self.stream = tokenizer.stream(ids)
        self.stops = StopMatcher(stop, repeat_context, start_stops)
        self.skip = len(heal)  # healed characters still to hold back

    def step(self, tok: int) -> tuple[str, bool]:
        """The text `tok` adds, and whether a stop ended the text there."""
        piece = self.stream.step(tok)
        if self.skip:
            n = min(self.skip, len(piece))
            piece, self.skip = piece[n:], self.skip - n
        return self.stops.feed(piece)

    def flush(self) -> str:
        """The text held back at the end: the stream's (a decoder that is not byte-level waits after a U+FFFD) through
        the stops, then the stops' own."""
        tail = self.stream.flush()
        n = min(self.skip, len(tail))
        tail, self.skip = tail[n:], self.skip - n
        text, hit = self.stops.feed(tail) if tail else ("", False)
        return text if hit else text + self.stops.flush()

    @property
    def stopped_by(self) -> str:
        return "repeat" if self.stops.repeated else "sequence"

    @property
    def stop_sequence(self) -> str | None:
        return self.stops.matched


def chunk_layout(n: int, chunk_size: int, max_chunk: int) -> list[int]:
    """The ends of the prefill chunks of an n-token prompt (see the module docstring)."""
    sizes = [chunk_size << i for i in range(16) if chunk_size << i <= max(max_chunk, chunk_size)][::-1]
    ends, pos = [], 0
    while pos < n:
        size = next((s for s in sizes if pos % s == 0 and pos + s <= n), n - pos)
        pos += size
        ends.append(pos)
    return ends


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    # Called before every model pass on the calling thread (the daemon's: m31rd.torch_thread.ThreadGovernor.adjust,
    # which sets torch's thread count to the cores other processes leave free); None keeps the thread count as set.
    before_pass: Callable[[], object] | None = None

    def __init__(
        self,
        bundle: Bundle | str | Path,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        threads: int | None = None,
        chunk_size: int = 32,
        max_chunk: int = 256,
        decode_width: int = 8,
        quant: str | None = None,
        group_size: int | None = None,
        verified: Future | None = None,
        kv_dtype: str = "auto",
        prefill_gemm: str = "auto",
    ):
        """`quant` (int8 | int4) quantizes a float bundle's weights at load; a quantized bundle is loaded as it
        was stored (`quant`, if given, must name its method). `dtype` is the precision of everything else:
        activations, norms, attention and the KV cache. Either may be "auto" (see m31r.precision). `verified`
        is a checksum verification of `bundle` the caller started already (checksums.verify_in_background).
        `kv_dtype`: the KV cache's dtype; auto is float16 where the fp32 kernels' decode attention reads it (half
        the bytes a step reads from its context), else the activation dtype, which may also be named.
        `prefill_gemm`: auto runs int8 layers' prefill chunks (fp32 activations, the fp32 kernels) as bf16 GEMMs where
        bf16 matmuls are native (AVX512-BF16, AMX); float32 keeps fp32 GEMMs everywhere."""
        if threads:
            torch.set_num_threads(threads)
        if dtype not in DTYPES and dtype != "auto":
            raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)} or auto")
        if kv_dtype not in DTYPES and kv_dtype != "auto":
            raise ValueError(f"unknown kv_dtype {kv_dtype!r}; choose one of {', '.join(DTYPES)} or auto")
        self.kv_request = kv_dtype
        if prefill_gemm not in ("auto", "float32"):
            raise ValueError(f"unknown prefill_gemm {prefill_gemm!r}; choose auto or float32")
        self.prefill_gemm = prefill_gemm
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.device = torch.device(device)
        self.chunk_size, self.max_chunk = chunk_size, max_chunk
        if decode_width < 1:
            raise ValueError(f"decode_width must be >= 1, got {decode_width}")
        self.decode_width = decode_width
        if isinstance(bundle, Bundle):  # opened (and verified, or not) by the caller
            self._load(bundle, dtype, quant, group_size)
            return
        # The checksums are verified on another thread while the model is built (hashing a medium bundle takes
        # about as long as building it); the engine is returned only once they pass. A checksum failure is
        # reported in preference to whatever it made go wrong in the meantime.
        verified = verified or verify_in_background(bundle)
        try:
            self._load(open_bundle(bundle, verify=False), dtype, quant, group_size)
        except BaseException:
            verified.result()
            raise
        verified.result()

    def _load(self, bundle: Bundle, dtype: str, quant: str | None, group_size: int | None) -> None:
        self.bundle = bundle
        self.config = bundle.config
        stored = bundle.quantization or {}
        precision = resolve(self.device, dtype, quant, stored.get("method"))
        dtype, quant, self.precision_why = precision.dtype, precision.quant, precision.why
        self.dtype = DTYPES[dtype]
        if stored and quant not in (None, stored["method"]):
            raise ValueError(f"{bundle.path} holds {stored['method']} weights; it cannot be served as {quant} "
                             f"(quantize the float bundle instead)")
        self.quant = stored.get("method") or quant
        self.group_size = stored.get("group_size") or group_size or DEFAULT_INT4_GROUP
        # The tokenizer open_bundle read (capped) and checked: the file is not parsed a second time.
        self.tokenizer = Tokenizer(bundle.tokenizer, self.config.special_tokens, self.config.vocab_size)
        with torch.device("meta"):
            model = Transformer(self.config)
        kernels = native.load(self.dtype) if self.device.type == "cpu" else None
        # Float weights that a native float matmul will read stay plain: packing them for oneDNN would be undone.
        plain = kernels is not None and kernels.linear_dtype == self.dtype
        model = prepare(model, load_weights(bundle), dtype=self.dtype, device=self.device, method=self.quant,
                        group_size=self.group_size, pack=not plain)
        # The non-persistent RoPE tables were created on meta: build them for real, in the activation dtype.
        cos, sin = rope_tables(self.config)
        model.rope_cos, model.rope_sin = cos.to(self.device, self.dtype), sin.to(self.device, self.dtype)
        self.model = model
        self.use_kernels(kernels)
        if self.kv_request != "auto" and self.kv_dtype != DTYPES[self.kv_request]:
            raise ValueError(f"kv_dtype {self.kv_request}: this engine's decode attention reads "
                             f"{str(self.kv_dtype).removeprefix('torch.')} caches ({self.kernel_report['kv_why']})")
        self.model.eval()
        self.stop_ids = self.tokenizer.end_ids  # the model's end token, and any other control token it writes
        self._heal_masks: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # heal_logits' masks, least recent first
        self._probed: tuple[list[int], bool] | None = None
        unused = self.tokenizer.unused_ids
        self.unused_ids = torch.tensor(unused, device=self.device) if unused else None

    def use_kernels(self, kernels: native.Kernels | None) -> None:
        """Hand a kernel family's kernels (None: eager torch) to the modules whose dtype they take, and record what
        runs and why (`kernel_report`, the warm-up log). The engine loads with `native.load`'s choice; benchmarks and
        tests switch here (the decode widths are probed again)."""
        model, dt = self.model, self.dtype
        self.kernels, self._probed = kernels, None
        model.native, model._plan = None, None
        if isinstance(model.head, FloatLinear):  # the tied float head on the float matmul: set again below
            model.head = None
        for module in model.modules():
            if isinstance(module, Int8Linear):
                module.native, module.gemm_bf16 = None, False
            elif isinstance(module, Int4Linear):
                module.use_native(None)
        self.native_int8 = self.native_int4 = False  # whether int8 / int4 layers run a native kernel
        # Decode attention on the kernels where they take every position of the context (native.takes): a model
        # longer than their MAX_KEYS keeps torch's, rather than failing at that position mid-generation.
        if kernels is not None and kernels.dtype == dt and native.takes(self.config.head_dim, self.config.max_context):
            model.native = kernels
        # Prefill chunks of int8 layers on the family's fp32 activations: bf16 GEMMs where native, which a cold
        # prompt (a cursor jump) pays for in full. Not under a family M31R_KERNELS forces: that serves as a CPU of
        # that family would, and AVX2 and NEON CPUs emulate bf16.
        gemm_bf16 = (self.prefill_gemm == "auto" and dt == torch.float32 and fast_bf16(self.device)
                     and native.forced() is None)
        if kernels is not None and kernels.int8_dtype == dt:
            for module in model.modules():
                if isinstance(module, Int8Linear) and native.takes_int8(module.out_features, module.in_features):
                    module.native, module.gemm_bf16 = kernels, gemm_bf16
                    self.native_int8 = True
        if kernels is not None and kernels.int4_dtype == dt:
            for module in model.modules():
                if isinstance(module, Int4Linear) and native.takes_int4(module.out_features, module.in_features,
                                                                        module.group_size):
                    module.use_native(kernels)
                    self.native_int4 = True
        # Float weights (fp32, or bf16 on avx512): every float layer the kernel takes, and the tied head (which
        # shares the embedding's weight)
        fl = kernels is not None and kernels.linear_dtype == dt
        self.native_float = False
        for module in list(model.modules()):
            if isinstance(module, FloatLinear):
                runs = fl and kernels.takes_linear(module.out_features, module.in_features)
                module.use_native(kernels if runs else None)
                self.native_float = self.native_float or runs
        emb = model.tok_embeddings
        if fl and model.head is None and model.output is None and kernels.takes_linear(*emb.weight.shape):
            model.head = FloatLinear(emb.weight.detach(), pack=False)  # the same storage
            model.head.use_native(kernels)
        # The KV cache: float16 where the fp32 family's fused decode attention reads it (and auto or float16 asks).
        half = (model.native is not None and kernels.float_dtype == dt and torch.float16 in kernels.kv_dtypes
                and DTYPES.get(self.kv_request, torch.float16) == torch.float16)  # auto, or float16 asked for
        self.kv_dtype = torch.float16 if half else dt
        kv_why = (f"{kernels.name} decode attention reads float16 caches: half the bytes of "
                  f"{str(dt).removeprefix('torch.')}" if half else "the activation dtype")
        name = "" if kernels is None else str(kernels.dtype).removeprefix("torch.")
        if kernels is None:
            why = native.why_not(self.dtype) if self.device.type == "cpu" else f"device {self.device.type}"
        elif kernels.dtype != dt:
            why = f"{kernels.name} kernels take {name} activations, this engine runs {str(dt).removeprefix('torch.')}"
        else:
            why = kernels.reason
        self.kernel_report = {"kernels": kernels.name if kernels is not None else "eager", "kernels_why": why,
                              "native_attention": model.native is not None, "native_int8": self.native_int8,
                              "native_int4": self.native_int4, "native_float": self.native_float,
                              "precision_why": self.precision_why,
                              "kv_cache": str(self.kv_dtype).removeprefix("torch."), "kv_why": kv_why}
        if self.native_int8:  # which int8 matmul runs, and its start-up self-check (cached per library)
            self.kernel_report["int8_kernel"] = kernels.int8_kernel
            self.kernel_report["int8_check"] = kernels.int8_check()[1]
            self.kernel_report["prefill_gemm"] = "bfloat16" if gemm_bf16 else "float32"

    @property
    def decode_widths(self) -> list[int]:
        """Probed on first use, so the daemon can answer before it spends the probe's ~0.6 s (medium)."""
        if self._probed is None:
            self._probed = self._probe()
        return self._probed[0]

    @property
    def fuse(self) -> bool:
        """Whether short prefill chunks may share a forward pass with decode rows and with each other (probed)."""
        if self._probed is None:
            self._probed = self._probe()
        return self._probed[1]

    def _probe(self) -> tuple[list[int], bool]:
        """The row counts a decode step may run at (those that give a row exactly the bits the full `decode_width`
        gives it), and whether a prefill chunk gets the same bits beside decode rows as alone.

        Kernels are picked by row count, and some change their reduction order with it (here: bf16 and fp32
        matrix-vector products at one row; fp32 again from four rows) while the int8/int4 kernels never do. So one
        decode step of this model, on this machine, runs once at each width, every row in its own
        scratch cache at a different context length, so that rows share attention calls in several groups (see
        model.row_groups); then a chunk runs alone and beside the full width. A changed order shows in few of a
        single matmul's rounded outputs, but always after a whole forward pass. A lone stream then runs at the
        narrowest width that matches, often 1 (int8: ~8 vs ~13 ms/token at width 8 on the medium shape), never at
        one that would change its output when others join it.
        """
        n, c = self.decode_width, self.config
        tokens = [(7919 * (r + 1)) % c.vocab_size for r in range(n + FUSE_CHUNK)]
        positions = [min(37 * r % 250, c.max_context - 1) for r in range(n)]  # spans 64 to 256, mixed
        start = min(100, c.max_context - FUSE_CHUNK)
        gen = torch.Generator().manual_seed(0)
        kv = torch.randn(2, c.kv_heads, max(positions + [start]), c.head_dim, generator=gen)  # any values
        caches = [self.new_cache(p + 1) for p in positions + [start + FUSE_CHUNK]]
        for cache, p in zip(caches, positions + [start], strict=True):  # a step rewrites only what it reads
            for layer in range(c.n_layers):
                cache.k[layer][0, :, :p] = kv[0, :, :p]
                cache.v[layer][0, :, :p] = kv[1, :, :p]

        def step(w: int, t: int = 0, rows: int = 1) -> tuple[torch.Tensor, list[torch.Tensor]]:
            ids = tokens[:w] + tokens[n : n + t]
            ids += [0] * (rows - len(ids))
            chunks = [(caches[n], start, t)] if t else []
            with torch.inference_mode():
                return self.model.step(torch.tensor(ids, device=self.device), caches[:w], positions[:w], w, chunks)

        full, _ = step(n)
        widths = [w for w in range(1, n + 1) if torch.equal(step(w)[0], full[:w])]
        # Chunks alone (padded to the narrowest width), then beside decode rows: a one-token chunk, a chunk of
        # chunk_size and one of FUSE_CHUNK beside the full width (the last near FUSE_ROWS), one beside the narrowest.
        size = min(self.chunk_size, FUSE_CHUNK)
        alone = {t: step(0, t, widths[0])[1][0] for t in dict.fromkeys((1, size, FUSE_CHUNK))}
        fuse = True
        for w, t in [(n, t) for t in alone] + [(widths[0], size)]:
            decoded, beside = step(w, t)
            fuse = fuse and torch.equal(decoded, full[:w]) and torch.equal(beside[0], alone[t])
        return widths, fuse

    # -- caches ---------------------------------------------------------------------------------------

    def new_cache(self, capacity: int = 0) -> KVCache:
        """An empty cache; it grows with the context it holds (KVCache)."""
        return KVCache(self.config, capacity, self.kv_dtype, self.device)

    def cache_bytes(self, capacity: int | None = None) -> int:
        """The size of a cache holding `capacity` positions (default: a whole context, a slot's upper bound)."""
        c = self.config
        return 2 * c.n_layers * c.kv_heads * (capacity or c.max_context) * c.head_dim * self.kv_dtype.itemsize

    def layout(self, n: int) -> list[int]:
        return chunk_layout(n, self.chunk_size, self.max_chunk)

    def reusable(self, cache: KVCache, ids: list[int]) -> int:
        """Positions of `ids` whose cached keys/values can be kept: the leading cached chunks that a cold prefill
        of `ids` would also run, and never the whole prompt (the last prompt token must run to give the logits
        for the first new token)."""
        limit = min(common_prefix(cache.tokens, ids), len(ids) - 1)
        keep = 0
        for cached, wanted in zip(cache.chunks, self.layout(len(ids)), strict=False):
            if cached != wanted or cached > limit:
                break
            keep = cached
        return keep

    # -- the forward passes ---------------------------------------------------------------------------

    def chunks(self, cache: KVCache, ids: list[int], start: int) -> Iterator[Chunk]:
        """The chunks of `chunk_layout` that prefill ids[start:] into `cache`, each to run (`run`) before the next
        is taken. `start` must be 0 or a value from `reusable`."""
        ends = self.layout(len(ids))
        if start and start not in ends:
            raise ValueError(f"prefill must start at a chunk boundary of this prompt, not at {start}")
        cache.tokens = cache.tokens[:start]
        cache.chunks = [e for e in cache.chunks if e <= start]
        cache.reserve(len(ids), keep=start)  # one resize for the whole prompt, copying only what it reuses
        pos = start
        for end in ends:
            if end > start:
                yield Chunk(cache, ids[pos:end], pos, end == len(ids))
                pos = end

    def prefill(self, cache: KVCache, ids: list[int], start: int) -> Iterator[torch.Tensor | None]:
        """Run ids[start:] in the chunks of `chunk_layout`; yields None between chunks (a cancellation point),
        then the fp32 logits of the last position. `start` must be 0 or a value from `reusable`."""
        for chunk in self.chunks(cache, ids, start):
            yield self.run([], [chunk])[1][0]

    def run(self, decodes: list[Decode], chunks: list[Chunk]) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """One round of model calls: a decode step for every `decodes` entry and every chunk, with as few forward
        passes as give each sequence the bits it gets alone. Returns fp32 logits per decode, and per chunk (None
        for a chunk that is not its prompt's last).

        Weight reads dominate a decode step, so rows share them almost for free. Decode rows run at the smallest of
        `decode_widths` that holds them (the rest are padding), chunks of up to FUSE_CHUNK tokens join them while
        a pass stays within FUSE_ROWS rows (where the probe found that a chunk's bits do not depend on its
        neighbours), longer chunks run by themselves.

        Drafts run for a lone decode only: where several streams share the round, their drafts are dropped (each
        Decode's `drafts` emptied, its logits then a single row). A lone stream's drafts cost little, since its
        rows share the weight reads, and pay where accepted (docs/speed.md "Prompt-lookup decoding": a typing session's
        answers 13-26% sooner); beside other streams they widen every pass, which cost 8 concurrent streams 10-12%
        of their throughput. The output is the same either way."""
        if self.before_pass is not None:
            self.before_pass()
        if len(decodes) > 1:
            for d in decodes:
                d.drafts = []
        out_d: list[torch.Tensor] = []
        out_c: list[torch.Tensor | None] = [None] * len(chunks)
        passes: list[Pass] = []
        used = 0
        for d in decodes:  # in order, up to decode_width rows a pass (a decode's drafts stay in its pass)
            n = len(d.rows)
            if n > self.decode_width:
                raise ValueError(f"a decode of {n} rows (token and drafts) exceeds decode_width {self.decode_width}")
            if not passes or used + n > self.decode_width:
                passes.append(Pass([]))
                used = 0
            passes[-1].decodes.append(d)
            used += n
        for p in passes:
            p.rows = self._width(sum(len(d.rows) for d in p.decodes))
        for i, c in enumerate(chunks):
            t = len(c.ids)
            if t > FUSE_CHUNK:
                out_c[i] = self._run_long(c)
                continue
            p = next((p for p in passes if self.fuse and p.rows + t <= FUSE_ROWS), None)
            if p is None:
                p = Pass([])
                passes.append(p)
            p.chunks.append(i)
            p.rows += t
        for p in passes:
            decoded, ends = self._run_pass(p.decodes, [chunks[i] for i in p.chunks])
            out_d.extend(decoded)
            for i, logits in zip(p.chunks, ends, strict=True):
                out_c[i] = logits if chunks[i].last else None
        return out_d, out_c

    def _width(self, n: int) -> int:
        return next(w for w in self.decode_widths if w >= n)

    def _run_pass(self, decodes: list[Decode], chunks: list[Chunk]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        # A decode's token and drafts are rows on one cache at consecutive positions: each row writes its key/value
        # before any row attends, and attends over positions up to its own, so row j sees exactly the context that
        # j plain decode steps would have built, and (the probed property) gets the bits a plain step gets.
        rows = [(d.cache, len(d.cache.tokens) + j, t) for d in decodes for j, t in enumerate(d.rows)]
        shares = [d.share for d in decodes for _ in d.rows]
        width = self._width(len(rows)) if rows else 0
        ids = [t for _, _, t in rows] + [0] * (width - len(rows)) + [i for c in chunks for i in c.ids]
        # Never fewer rows than the narrowest probed width: torch's bf16 and fp32 matmuls round differently at one row.
        ids += [0] * (self.decode_widths[0] - len(ids))
        with torch.inference_mode():
            decoded, ends = self.model.step(torch.tensor(ids, device=self.device), [c for c, _, _ in rows],
                                            [p for _, p, _ in rows], width,
                                            [(c.cache, c.start, len(c.ids)) for c in chunks], shares)
        out, o = [], 0
        for d in decodes:
            n = len(d.rows)
            d.cache.tokens.extend(d.rows)
            out.append(decoded[o].float() if n == 1 else decoded[o : o + n].float())
            o += n
        for c in chunks:
            self._ran(c)
        return out, [e.float() for e in ends]

    def _run_long(self, c: Chunk) -> torch.Tensor | None:
        x = torch.tensor([c.ids], dtype=torch.long, device=self.device)
        with torch.inference_mode():
            logits = self.model(x, start=c.start, cache=c.cache, last_only=True)
        self._ran(c)
        return logits[0, -1].float() if c.last else None

    def _ran(self, c: Chunk) -> None:
        c.cache.tokens.extend(c.ids)
        if len(c.ids) >= self.chunk_size:
            c.cache.chunks.append(c.start + len(c.ids))

    def decode_rows(self, caches: list[KVCache], tokens: list[int]) -> torch.Tensor:
        """One decode step for several sequences at once: row r feeds tokens[r] at the end of caches[r] (see run)."""
        return torch.stack(self.run([Decode(c, t) for c, t in zip(caches, tokens, strict=True)], [])[0])

    def decode_step(self, cache: KVCache, token: int) -> torch.Tensor:
        return self.decode_rows([cache], [token])[0]

    # -- generation -----------------------------------------------------------------------------------

    def heal_logits(self, logits: torch.Tensor, owed: bytes) -> torch.Tensor:
        """Logits with every token that cannot continue the owed text at -inf (the masks are cached). `owed`
        empty: the step after healed whitespace, where stopping stays allowed."""
        allowed = self._heal_masks.get(owed)
        if allowed is None:
            allowed = torch.zeros(logits.shape[-1], dtype=torch.bool)
            allowed[self.tokenizer.heal_ids(owed)] = True
            if not owed:
                allowed[list(self.stop_ids)] = True
            allowed = allowed.to(logits.device)
            # The least recently used go past HEAL_MASK_BYTES: a word being typed reuses the same few masks.
            while self._heal_masks and (len(self._heal_masks) + 1) * allowed.nbytes > HEAL_MASK_BYTES:
                self._heal_masks.popitem(last=False)
            self._heal_masks[owed] = allowed
        else:
            self._heal_masks.move_to_end(owed)
        return logits.masked_fill(~allowed, float("-inf"))

    def _drafts(self, lookup: Lookup, k: int, position: int, room: int) -> list[int]:
        """Up to k drafts to feed after the token at `position`: at most `room` (the tokens still to pick after the
        next one) and, where decode attention runs in eager torch, none past the SPAN block of `position`: a row attends
        over its cache's whole capacity there, which a plain step keeps at exactly that block (KVCache.fit)."""
        k = min(k, room)
        if self.model.native is None:
            k = min(k, span_of(position + 1) - position - 1)
        return lookup.drafts(k) if k > 0 else []

    def fit_prompt(self, ids: list[int], max_tokens: int, truncate: bool = False) -> list[int]:
        """The prompt ids that leave room for `max_tokens` in the context: `ids` themselves, or with `truncate` their
        end. The caller fits a prompt once, before `generate`, which refuses one that does not fit rather than
        cutting it where the caller cannot see. Raises ContextOverflowError."""
        limit = self.config.max_context
        if len(ids) + max_tokens <= limit:
            return ids
        if not truncate or max_tokens >= limit:
            raise ContextOverflowError(len(ids), max_tokens, limit)
        return ids[len(ids) - (limit - max_tokens) :]

    def check(self, ids: list[int], max_tokens: int) -> None:
        """Refuse a request the engine cannot run (ValueError; ContextOverflowError where it does not fit). `start`
        checks before it touches a cache; a scheduler checks before it takes a slot (m31rd.scheduler)."""
        if not ids:
            raise ValueError("empty prompt: nothing to continue from")
        if not all(0 <= i < self.config.vocab_size for i in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.config.vocab_size}), the model's vocabulary")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        if len(ids) + max_tokens > self.config.max_context:
            raise ContextOverflowError(len(ids), max_tokens, self.config.max_context)

    def start(self, ids: list[int], max_tokens: int, cache: KVCache, res: Outcome, batched: bool,
              deadline: float | None, t0: float) -> Generator[Chunk, torch.Tensor | None, torch.Tensor | None]:
        """A generation's start, shared by `generate` and beam search (m31r.beams): check the request, prefill the
        prompt into `cache` past what it holds already (each chunk yielded when `batched`) and return the logits
        after it. None where generation ends there, `res` saying why: the deadline passed, or max_tokens is 0."""
        self.check(ids, max_tokens)
        res.prompt_tokens = len(ids)
        res.cached_tokens = start = self.reusable(cache, ids)
        logits = None
        for chunk in self.chunks(cache, ids, start):
            if deadline is not None and time.perf_counter() >= deadline:
                res.finish_reason = "deadline"
                res.prefill_ms = res.total_ms = (time.perf_counter() - t0) * 1000
                return None
            out = (yield chunk) if batched else self.run([], [chunk])[1][0]
            if chunk.last:
                logits = out
        res.prefill_ms = (time.perf_counter() - t0) * 1000
        if max_tokens == 0:
            res.finish_reason = "length"
            res.total_ms = res.prefill_ms
            return None
        return logits

    def generate(
        self,
        prompt: str | list[int],
        *,
        max_tokens: int = 64,
        sampling: SamplingParams | None = None,
        stop: list[str] | tuple[str, ...] = (),
        cache: KVCache | None = None,
        result: Outcome | None = None,
        batched: bool = False,
        heal: str = "",
        deadline: float | None = None,
        lookahead: int = 0,
        repeat_context: str | None = None,
        start_stops: list[str] | tuple[str, ...] = (),
        top_logprobs: int = 0,
        min_probability: float | None = None,
    ) -> Iterator[Piece | Chunk | Decode]:
        """Stream tokens for a prompt. Breaking out of the loop is how a caller cancels.

        The prompt and `max_tokens` must fit the context together: a prompt that does not is refused
        (ContextOverflowError, a ValueError), never cut here; `fit_prompt` is how a caller keeps a long prompt's end.

        `heal` is text the prompt left out of its end (m31r.fim's token healing): the first tokens are held to
        writing it again, and it is not part of the text streamed back. A token that writes only healed text finishes
        the prompt (Outcome.healing_tokens): no Piece streams it, and `max_tokens` counts the tokens after it, so
        `--max-tokens 2` after `fn ma` is two tokens of text, not one spent on `main` again. The context's room
        after the prompt bounds both.

        `deadline` (a time.perf_counter() value) is a hard limit: past it no further model call is made, so
        generation ends (finish_reason "deadline") with what was produced so far, before any token if it passes
        during prefill. A token holding a line end that arrives past it ends the text at that line end.

        `repeat_context` (the document before the completion) turns on the repeated-line stop (m31r.stops): the
        completion ends, finish_reason "stop", before a line that repeats the line before it. `start_stops` end it
        only where it begins with them (m31r.fim.start_stop), with nothing written.

        `min_probability` (an editor's confidence floor, m31r_protocol.policy) ends the completion, finish_reason
        "stop", at the token that takes its probability so far under the floor. Log-probabilities only add up
        downwards, so the line that token is in is one the editor would cut, with those after it (`line_logprobs`
        summed line by line: policy.confident_lines), or, the first line, hide the suggestion for
        (policy.confident). The editor shows what it would have shown of the whole completion, without the tokens.

        `result` (if given) is filled in as generation runs. With `batched`, each prefill chunk and decode step is
        yielded (a `Chunk`, a `Decode`) for the driver to run with other streams' (Engine.run) and send back the
        logits: a scheduler's round boundaries, where it checks for cancellation.

        `top_logprobs`: each Piece of a token also carries the likeliest tokens at its step, this many, with their
        log-probabilities (under the same distribution as its own: Outcome.logprobs).

        `lookahead` (greedy decoding without a repetition penalty only; elsewhere ignored) is prompt-lookup decoding:
        each decode step also feeds up to this many draft tokens copied from the context (m31r.lookup), and every
        draft that equals what greedy decoding picks yields its successor without a call of its own. The output is
        the one lookahead 0 gives, bit for bit (see _run_pass); tokens are still emitted, and stop sequences,
        max_tokens and the deadline still checked, one at a time.
        """
        t0 = time.perf_counter()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        res = result if result is not None else Outcome(prompt_tokens=len(ids))
        cache = cache if cache is not None else self.new_cache()
        sampler = Sampler(sampling or SamplingParams(), self.device)
        need_history = sampler.params.repetition_penalty != 1.0
        logits = yield from self.start(ids, max_tokens, cache, res, batched, deadline, t0)
        if logits is None:
            return

        def late() -> bool:
            return deadline is not None and time.perf_counter() >= deadline

        text = TextPath(self.tokenizer, ids, heal, stop, repeat_context, start_stops)
        history = list(ids) if need_history else []
        res.finish_reason = "length"
        hit = False
        owed = heal.encode()  # healed bytes still to write
        # Healed text ending in whitespace, written exactly: the next token must not add to that whitespace.
        after_space = False
        lookahead = min(lookahead, self.decode_width - 1) if sampler.params.greedy and not need_history else 0
        lookup = Lookup(ids) if lookahead > 0 else None
        floor = math.log(min_probability) if min_probability and min_probability > 0 else None
        spent = 0.0  # the completion's log-probability so far: it only falls
        ahead: list[tuple[int, torch.Tensor]] = []  # drafts fed after the last token, each with the logits after it
        valid = len(ids)  # cache positions that hold this sequence; drafts past them were not accepted
        room = self.config.max_context - len(ids)  # tokens the context holds after the prompt: healing's included
        try:
            for i in range(room):
                hist = torch.tensor(history, device=self.device) if need_history else None
                if self.unused_ids is not None:  # reserved and padding ids are never text: never pick them
                    logits = logits.index_fill(0, self.unused_ids, float("-inf"))
                if owed or after_space:
                    logits = self.heal_logits(logits, owed)
                tok = sampler(logits, hist)
                norm = torch.logsumexp(logits.float(), 0)
                res.logprobs.append((logits[tok].float() - norm).item())
                top: tuple[tuple[int, float], ...] = ()
                if top_logprobs:
                    values, top_ids = torch.topk(logits.float(), min(top_logprobs, logits.numel()))
                    top = tuple((t, v) for t, v in zip(top_ids.tolist(), (values - norm).tolist(), strict=True)
                                if v > -math.inf)  # not the tokens the masks rule out
                if tok in self.stop_ids:
                    res.finish_reason, res.stopped_by = "stop", "end"
                    break
                after_space = False
                healing = False
                if owed:
                    written = self.tokenizer.token_bytes[tok] or b""
                    healing = owed.startswith(written)  # healed text only: the prompt's, never streamed
                    owed, after_space = heal_step(owed, written)
                res.healing_tokens += healing
                res.completion_tokens += not healing
                res.tokens.append(tok)
                if need_history:
                    history.append(tok)
                piece, hit = text.step(tok)
                if not hit and "\n" in piece and late():  # past the deadline, a line end is where the text ends
                    piece, hit = piece[: piece.index("\n")], True
                    res.finish_reason = "deadline"
                res.text += piece
                if not healing:
                    if res.first_token_ms is None:
                        res.first_token_ms = (time.perf_counter() - t0) * 1000
                        if res.healing_tokens:  # they finished reading the prompt: its time, not the answer's
                            res.prefill_ms = res.first_token_ms
                    yield Piece(tok, piece, res.logprobs[-1], top)
                if hit:
                    if res.finish_reason != "deadline":
                        res.finish_reason = "stop"
                        res.stopped_by, res.stop_sequence = text.stopped_by, text.stop_sequence
                    break
                if floor is not None:
                    spent += res.logprobs[-1]
                    if spent < floor:  # the line being written is one the editor cuts, or hides the whole for
                        res.finish_reason, res.stopped_by = "stop", "unsure"
                        break
                left = min(max_tokens - res.completion_tokens, room - i - 1)  # tokens still to pick
                if left <= 0:
                    break
                if late():
                    res.finish_reason = "deadline"
                    break
                if lookup is not None:
                    lookup.append(tok)
                if ahead and ahead[0][0] == tok:  # a confirmed draft: its successor's logits are computed
                    logits = ahead.pop(0)[1]
                    valid += 1
                    res.accepted += 1
                    continue
                ahead = []
                del cache.tokens[valid:]  # rejected drafts: their positions are written again from here
                drafts: list[int] = []
                if lookup is not None and not (owed or after_space):  # no drafts while healing masks apply
                    drafts = self._drafts(lookup, lookahead, valid, left - 1)
                call = Decode(cache, tok, drafts)
                out = (yield call) if batched else self.run([call], [])[0][0]
                drafts = call.drafts  # run drops them where other streams share the round
                valid += 1
                res.decode_steps += 1
                res.drafted += len(drafts)
                logits, ahead = (out[0], list(zip(drafts, out[1:], strict=True))) if drafts else (out, [])
        finally:
            del cache.tokens[valid:]
        if not hit and (tail := text.flush()):
            if res.finish_reason == "deadline" and "\n" in tail:  # a line end held back (for a stop "\n...") ends it
                tail = tail[: tail.index("\n")]
            if tail:
                res.text += tail
                yield Piece(None, tail)
        res.total_ms = (time.perf_counter() - t0) * 1000

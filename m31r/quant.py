"""Inference-time linear layers: prepacked float weights, weight-only int8 and group-wise int4 (README "Speed").

The model (m31r.model) is written with plain nn.Linear for training; `prepare` turns a meta-device model plus a
bundle's tensors into an inference model whose matmuls run on the fastest CPU kernel for each precision:

  float   fp32/bf16 weights prepacked for oneDNN (`mkldnn._linear_pointwise`): the same numbers as F.linear for
          bf16, within fp32 rounding for fp32 (F.linear uses MKL there). On the medium model it makes a decode
          step ~1.55x faster in both dtypes and fp32 prefill ~2x (bf16 prefill ~1.05x). fp32 engines on the
          AVX2 (NEON) family keep the weights plain instead: rows below F32_GEMM_ROWS run the family's fp32
          matmul, which sums in one order at any row count, more rows oneDNN's GEMM on the plain weight. bf16
          engines on the AVX-512 family do the same with its bf16 matmul (m31r/kernels.c, vdpbf16ps) below
          BF16_GEMM_ROWS rows: a lone decode row ~1.3x faster than oneDNN's packed weight, no AMX for more rows.
  int8    int8 weights with one bf16 scale per output channel. Small row counts (decode, short chunks) run the
          native kernel (m31r/kernels.c: AVX512-BF16 dot products on the codes widened to bf16) where the engine
          sets it, else `aten._weight_int8pack_mm` with bf16 activations (its fp32-activation path is ~13x
          slower) where K is a multiple of 32 (`int8pack_ok`: it reads past other rows); larger chunks, and other K,
          run the bf16 GEMM on the codes cast to bf16 (exact: |q| <= 127) and scale its output columns, 2.5x faster
          than aten's int8 kernel at 256 rows. With fp32 activations and the AVX2
          kernel family (m31r/kernels_avx2.c: CPUs without native bf16; on Arm its NEON twin, m31r/kernels_neon.c),
          small row counts run its q16 kernel
          (activations quantized to int16 in blocks of 32, integer dot products on the codes widened to int16)
          and larger chunks the fp32 GEMM on the codes widened to fp32.
  int4    4-bit codes in groups of `group_size` along K, a bf16 scale and zero per group (asymmetric, gpt-fast
          style: w = (q - 8) * scale + zero). Decode runs `aten._weight_int4pack_mm_for_cpu`; its packed layout
          depends on the CPU's vector width, so bundles store plain nibbles and packing happens at load. With
          fp32 activations and the AVX2 (or NEON) family, decode runs its q8 int4 kernel on the plain nibbles.

In the quantized precisions the tied embedding is stored as int8 (one scale per vocabulary row): the lookup
dequantizes the rows it needs and the LM head is an int8 matmul on the same bytes. An untied head (`output`, imported
checkpoints) is int8 in both precisions too: its errors go straight into the logits. Biases (Qwen2's q/k/v) stay
float and are added to the product. The choice of kernel depends only on a call's row count, and the engine always
runs a given position in a chunk of the same shape, so every position always goes through the same kernel:
determinism and cache-hit equality hold within each precision.

Row independence (what batching decode steps relies on), measured with torch 2.13 on AVX-512, 1 and 2 threads,
M = 1..63: the bf16 oneDNN, int8 (aten's and the native one) and int4 kernels give a row the same bits whatever the
row count; oneDNN fp32 does for M >= 2 only (M = 1 takes a GEMV path that rounds differently, and on some CPUs
M = 2-3 round differently from 4 and up); MKL's fp32 F.linear differs for small M. The native fp32 matmul does at any
M (tested for 1-17).
"""

from __future__ import annotations

import platform

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from m31r.config import ModelConfig
from m31r.native import MAT_F32, MAT_INT4, MAT_INT8, Kernels, Mat

METHODS = ("int8", "int4")
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP = 64
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
INT8_ALWAYS = ("tok_embeddings.weight", "output.weight")  # int8 in int4 bundles too (one scale per vocabulary row)
# Row counts from which dequantize-then-bf16-GEMM beats the weight-only kernels (measured on AVX-512: the int8
# kernel is ~100-145 GFLOP/s at any M, the bf16 GEMM ~170 at M=32 and ~380 from M=128; int4 similar).
INT8_GEMM_ROWS = 64
INT4_GEMM_ROWS = 64
# fp32 layers on the AVX2 (NEON) family's fp32 matmul (fp32 engines) run it below this many rows: every row of a decode
# step or of a pass that short chunks share (engine.FUSE_ROWS) then goes through one kernel, whose bits do not depend
# on the row count. From 64 rows (prefill chunks of 64 and more) oneDNN's GEMM is faster (docs/speed.md "fp32 decode").
F32_GEMM_ROWS = 64
# bf16 layers on the AVX-512 family's bf16 matmul (bf16 engines) run it below this many rows: the decode passes of the
# daemon's default width (8). It reads a lone row's weights at the memory's pace (medium shape, Xeon with AMX: 29 ms
# for a decode step's matmuls against oneDNN's 38) but has no AMX tiles: from ~8 rows oneDNN is as fast, at 16 twice
# as fast (docs/speed.md "bf16 matmul"). A wider pass (chunks beside decode rows) then runs oneDNN, which the engine's
# probe sees: it keeps such chunks in passes of their own.
BF16_GEMM_ROWS = 9
_int8_mm = torch.ops.aten._weight_int8pack_mm
_int4_mm = torch.ops.aten._weight_int4pack_mm_for_cpu
_mkldnn_linear = getattr(torch.ops.mkldnn, "_linear_pointwise", None)  # absent from builds without oneDNN


def _aligned(t: Tensor) -> Tensor:
    """Codes and scales at a 64-byte boundary, as bundles store them (bundle.save_aligned), else copied into a fresh
    allocation (torch's are 64-byte aligned): torch's int8 kernel (`aten._weight_int8pack_mm`, torch 2.13) segfaults
    on codes that are not 16-byte aligned from 4 rows on. The native kernels (m31r/kernels*.c) load unaligned."""
    return t if t.data_ptr() % 64 == 0 else t.clone()


def int8pack_ok(in_features: int) -> bool:
    """Whether torch's `aten._weight_int8pack_mm` computes this K right. With torch 2.13 on AVX-512 (AMD Zen 5) it
    reads past the end of each row where K % 16 == 8: relative errors up to 1e26, NaN, or a segfault. Checked correct
    there for every K % 32 == 0 up to 1024 and 4096 (M 1-63, N 8-264); other K run the bf16 GEMM on the codes."""
    return in_features % 32 == 0


def _mkldnn_ok(weight: Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and _mkldnn_linear is not None)


_X86 = platform.machine().lower() in ("x86_64", "amd64")


def _gemm_f32(x: Tensor, w: Tensor) -> Tensor:
    """x [M, K] @ w [N, K].T in fp32 for a prefill chunk's rows, on oneDNN where torch has it on x86-64. F.linear's
    fp32 GEMM is MKL's, which runs AVX2 code on AMD CPUs: 214 GFLOP/s against oneDNN's 484 for a 256-row chunk of the
    mini shape's wqkv on 2 cores of an AMD EPYC (Zen 5; README "How much of the file above the cursor"). Arm keeps
    F.linear: not measured there."""
    if _X86 and _mkldnn_ok(w):
        return _mkldnn_linear(x.contiguous(), w, None, "none", [], "")
    return F.linear(x, w)


# ------------------------------------------------------------------------------------------------------------
# Quantizers and their exact inverses (tests and accuracy checks compare against the inverses)
# ------------------------------------------------------------------------------------------------------------


def quantize_int8(w: Tensor) -> tuple[Tensor, Tensor]:
    """Symmetric per-row int8: (codes [N, K] int8, scales [N] bf16) with w ~= codes * scales[:, None].

    The scale is rounded to bf16 first and the codes are computed against the rounded scale, so the kernel
    (which multiplies by the bf16 scale) computes exactly `dequantize_int8`.
    """
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127).clamp(min=1e-10).to(torch.bfloat16)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes.contiguous(), scales


def dequantize_int8(codes: Tensor, scales: Tensor) -> Tensor:
    return codes.float() * scales.float()[:, None]


def quantize_int4(w: Tensor, group_size: int = DEFAULT_INT4_GROUP) -> tuple[Tensor, Tensor]:
    """Asymmetric group-wise int4: (codes [N, K/2] uint8, scales_and_zeros [K/group, N, 2] bf16).

    Codes are stored two per byte, the even column in the low nibble: a plain layout that any machine reads.
    w ~= (q - 8) * scale + zero per group, with scale and zero rounded to bf16 before the codes are chosen.
    """
    n, k = w.shape
    if group_size not in INT4_GROUP_SIZES or k % group_size:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES} and divide K={k}; got {group_size}")
    wg = w.float().view(n, k // group_size, group_size)
    lo, hi = wg.amin(dim=-1), wg.amax(dim=-1)
    scale = ((hi - lo) / 15).clamp(min=1e-10).to(torch.bfloat16)
    zero = (lo + 8 * scale.float()).to(torch.bfloat16)
    base = zero.float() - 8 * scale.float()  # the value of code 0
    q = torch.round((wg - base[..., None]) / scale.float()[..., None]).clamp(0, 15).to(torch.uint8).view(n, k)
    codes = q[:, 0::2] | (q[:, 1::2] << 4)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()
    return codes.contiguous(), scales_and_zeros


def unpack_int4(codes: Tensor) -> Tensor:
    """[N, K/2] nibbles → [N, K] uint8 codes in 0..15."""
    return torch.stack([codes & 15, codes >> 4], dim=-1).view(codes.shape[0], -1)


def dequantize_int4(codes: Tensor, scales_and_zeros: Tensor, group_size: int) -> Tensor:
    q = unpack_int4(codes).float()
    n, k = q.shape
    sz = scales_and_zeros.float().transpose(0, 1)  # [N, K/group, 2]
    w = (q.view(n, k // group_size, group_size) - 8) * sz[..., :1] + sz[..., 1:]
    return w.view(n, k)


# ------------------------------------------------------------------------------------------------------------
# Modules
# ------------------------------------------------------------------------------------------------------------


class FloatLinear(nn.Module):
    """A linear layer on float weights: prepacked for oneDNN where the CPU supports it (F.linear else), or, where
    the engine hands it a family's float matmul (`use_native`: the AVX2 or NEON family's fp32 one, the AVX-512
    family's bf16 one), kept plain for that kernel below F32_GEMM_ROWS rows (bf16: BF16_GEMM_ROWS) and for oneDNN's
    GEMM from there (as fast on a plain weight as on a packed one). Either way one copy of the weight is kept.
    `pack=False` leaves the weight plain until `use_native` decides."""

    def __init__(self, weight: Tensor, bias: Tensor | None = None, pack: bool = True):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.weight: Tensor | None = weight
        self.bias = bias
        self.packed = None
        # A family's float matmul, where the engine sets it (use_native): rows below F32_GEMM_ROWS (bf16:
        # BF16_GEMM_ROWS) run it.
        self.native: Kernels | None = None
        if pack:
            self._pack()

    def _pack(self) -> None:
        if self.weight is not None and _mkldnn_ok(self.weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.contiguous(), 1)
                self.weight = None  # the packed copy is the only one kept
            except RuntimeError:  # e.g. a CPU without the ISA oneDNN needs for this dtype
                self.packed = None

    def use_native(self, kernels: Kernels | None) -> None:
        """Run `kernels`' float matmul below F32_GEMM_ROWS rows, bf16 below BF16_GEMM_ROWS (None: oneDNN's packed
        weight at every row count). The kernel reads the plain weight, which then replaces the packed copy, and the
        other way round."""
        self.native = kernels
        if kernels is not None and self.packed is not None:
            self.weight, self.packed = self.packed.to_dense(), None
        elif kernels is None and self.packed is None:
            self._pack()

    def forward(self, x: Tensor) -> Tensor:
        if self.native is not None and x.dtype == self.native.linear_dtype:
            x2 = x.reshape(-1, self.in_features)
            if x2.shape[0] < (F32_GEMM_ROWS if x.dtype == torch.float32 else BF16_GEMM_ROWS):
                y = self.native.float_mm(x2.contiguous(), self.weight)
                if self.bias is not None:
                    y = y.add_(self.bias)
                return y.view(*x.shape[:-1], self.out_features)
            if _mkldnn_ok(self.weight):
                return _mkldnn_linear(x, self.weight, self.bias, "none", [], "")
        if self.packed is not None:
            return _mkldnn_linear(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class Int8Linear(nn.Module):
    """Weight-only int8 with per-output-channel bf16 scales, and an optional bias; outputs in the input's dtype."""

    def __init__(self, codes: Tensor, scales: Tensor, bias: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.codes = _aligned(codes)
        self.scales = _aligned(scales.to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else bias.to(torch.bfloat16)  # added to the bf16 product
        # The native kernel (m31r.native) for small row counts, where the engine sets it: every row then runs it.
        self.native: Kernels | None = None
        # Whether chunks of INT8_GEMM_ROWS rows and more on fp32 activations (prefill) run a bf16 GEMM: the engine
        # sets it where bf16 matmuls are native (Engine's prefill_gemm).
        self.gemm_bf16 = False

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.native is not None and self.native.int8_dtype == torch.float32 and x.dtype == torch.float32:
            return self._forward_f32(x, x2)
        if x.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if self.native is not None and x2.shape[0] < INT8_GEMM_ROWS:
            y = self.native.int8_mm(x2.contiguous(), self.codes, self.scales)
        elif x2.shape[0] < INT8_GEMM_ROWS and int8pack_ok(self.in_features):
            y = _int8_mm(x2, self.codes, self.scales)
        else:  # chunks, and the K aten's kernel gets wrong (int8pack_ok): exact on the codes (|q| <= 127)
            y = F.linear(x2, self.codes.to(torch.bfloat16)).mul_(self.scales)
        if self.bias is not None:
            y = y.add_(self.bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)

    def _forward_f32(self, x: Tensor, x2: Tensor) -> Tensor:
        """fp32 activations with the AVX2 family: its q16 kernel below INT8_GEMM_ROWS, else a GEMM on the widened codes:
        fp32 (oneDNN's), or with gemm_bf16 bf16 inputs and a bf16 product (fp32 sums; cold prompts in 0.78x the time on
        AVX512-BF16, the same greedy agreement with fp32: docs/serving.md "bf16 GEMMs for int8 prefill")."""
        if x2.shape[0] < INT8_GEMM_ROWS:
            y = self.native.int8_mm(x2.contiguous(), self.codes, self.scales)
        elif self.gemm_bf16:
            y = F.linear(x2.to(torch.bfloat16), self.codes.to(torch.bfloat16)).float().mul_(self.scales.float())
        else:
            y = _gemm_f32(x2, self.codes.float()).mul_(self.scales.float())
        if self.bias is not None:
            y = y.add_(self.bias)
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """Group-wise int4 (see module docstring), and an optional bias; outputs in the input's dtype."""

    def __init__(self, codes: Tensor, scales_and_zeros: Tensor, group_size: int, bias: Tensor | None = None):
        super().__init__()
        self.bias = None if bias is None else bias.to(torch.bfloat16)  # added to the bf16 product
        self.out_features, self.in_features = codes.shape[0], codes.shape[1] * 2
        self.group_size = group_size
        self.codes = _aligned(codes)  # plain nibbles: kept (usually a memory map) for the dequantizing prefill path
        self.scales_and_zeros = _aligned(scales_and_zeros.to(torch.bfloat16).contiguous())
        # aten's CPU packing takes N in multiples of 16 only (a RuntimeError at load otherwise: an MQA model of head
        # dim 12 has wqkv N = 120): other N pack zero rows past the layer's own, whose outputs forward drops.
        self._pad = -self.out_features % 16
        q = F.pad(unpack_int4(codes).to(torch.int32), (0, 0, 0, self._pad))
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self._sz_packed = F.pad(self.scales_and_zeros, (0, 0, 0, self._pad)) if self._pad else self.scales_and_zeros
        sz = self.scales_and_zeros.transpose(0, 1)  # [N, K/group, 2]
        self._scale = sz[..., :1].contiguous()
        self._base = (sz[..., 1:].float() - 8 * sz[..., :1].float()).to(torch.bfloat16).contiguous()  # code 0
        # The AVX2 (NEON) family's kernel for fp32 activations below INT4_GEMM_ROWS, where the engine sets it.
        self.native: Kernels | None = None
        self._scale_f32: Tensor | None = None
        self._base_f32: Tensor | None = None

    def use_native(self, kernels: Kernels | None) -> None:
        """Run `kernels`' int4 matmul for fp32 activations: it reads each group's scale and the value of code 0 in
        fp32, [N, K/group] (base = zero - 8 * scale, exact in fp32 for bf16 scale and zero)."""
        self.native = kernels
        if kernels is not None and self._scale_f32 is None:
            sz = self.scales_and_zeros.float()  # [K/group, N, 2]
            self._scale_f32 = sz[..., 0].t().contiguous()
            self._base_f32 = (sz[..., 1] - 8 * sz[..., 0]).t().contiguous()

    def dequantized(self) -> Tensor:
        """The bf16 weight, for the GEMM path (addcmul is 4x slower than mul + add_ on bf16 here)."""
        n, k, g = self.out_features, self.in_features, self.group_size
        q = unpack_int4(self.codes).to(torch.bfloat16).view(n, k // g, g)
        return (q * self._scale).add_(self._base).view(n, k)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.native is not None and x.dtype == torch.float32:
            if x2.shape[0] >= INT4_GEMM_ROWS:  # the fp32 GEMM on the dequantized weight (bf16 is emulated here)
                n, k, g = self.out_features, self.in_features, self.group_size
                q = unpack_int4(self.codes).float().view(n, k // g, g)
                y = _gemm_f32(x2, (q * self._scale_f32[..., None]).add_(self._base_f32[..., None]).view(n, k))
            else:
                y = self.native.int4_mm(x2.contiguous(), self.codes, self._scale_f32, self._base_f32, self.group_size)
            if self.bias is not None:
                y = y.add_(self.bias)
            return y.view(*x.shape[:-1], self.out_features)
        if x.dtype != torch.bfloat16:
            x2 = x2.to(torch.bfloat16)
        if x2.shape[0] >= INT4_GEMM_ROWS:
            y = F.linear(x2, self.dequantized())
        else:
            y = _int4_mm(x2, self.packed, self.group_size, self._sz_packed)
            if self._pad:
                y = y[:, :self.out_features].contiguous()
        if self.bias is not None:
            y = y.add_(self.bias)
        y = y.view(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.bfloat16 else y.to(x.dtype)


def native_mat(module: nn.Module) -> Mat | None:
    """The layer as m31r_decode_layer_f32 reads it, where its forward would run the fp32 family's kernel on a
    decode row (fp32 activations, below the GEMM rows, no bias); None otherwise (the per-call path then runs)."""
    kern = getattr(module, "native", None)
    if kern is None or kern.float_dtype != torch.float32 or getattr(module, "bias", None) is not None:
        return None
    if isinstance(module, FloatLinear) and module.weight is not None and module.weight.dtype == torch.float32:
        w = module.weight
        return Mat(MAT_F32, module.out_features, module.in_features, 0, w.data_ptr(), 0, 0)
    if isinstance(module, Int8Linear) and kern.int8_dtype == torch.float32:
        return Mat(MAT_INT8[kern.int8_mode], module.out_features, module.in_features, 0, module.codes.data_ptr(),
                   module.scales.data_ptr(), 0)
    if isinstance(module, Int4Linear) and module._scale_f32 is not None:
        return Mat(MAT_INT4, module.out_features, module.in_features, module.group_size, module.codes.data_ptr(),
                   module._scale_f32.data_ptr(), module._base_f32.data_ptr())
    return None


class Int8Embedding(nn.Module):
    """The tied embedding stored as int8 rows: the lookup dequantizes only the rows it needs."""

    def __init__(self, codes: Tensor, scales: Tensor, dtype: torch.dtype):
        super().__init__()
        self.codes, self.scales, self.dtype = _aligned(codes), _aligned(scales.to(torch.bfloat16)), dtype

    def forward(self, tokens: Tensor) -> Tensor:
        return self.codes[tokens].to(self.dtype) * self.scales[tokens].to(self.dtype)[..., None]


# ------------------------------------------------------------------------------------------------------------
# Bundle layout of quantized weights
# ------------------------------------------------------------------------------------------------------------


def check_method(method: str | None, group_size: int = DEFAULT_INT4_GROUP) -> None:
    if method is not None and method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")


def quantized_tensor_specs(config: ModelConfig, method: str, group_size: int | None) -> dict[str, tuple[tuple, str]]:
    """Name → (shape, safetensors dtype) of every tensor in a quantized bundle's model.safetensors.

    Norm gains keep the bundle's float dtype (any of F32/BF16/F16: reported as "float").
    """
    from m31r.model import expected_shapes

    specs: dict[str, tuple[tuple, str]] = {}
    for name, shape in expected_shapes(config).items():
        base = name.removesuffix(".weight")
        if name in INT8_ALWAYS or (method == "int8" and base.endswith(LINEARS)):
            specs[base + ".weight_int8"] = (shape, "I8")
            specs[base + ".scales"] = ((shape[0],), "BF16")
        elif base.endswith(LINEARS):
            n, k = shape
            group_size = group_size or DEFAULT_INT4_GROUP
            if k % group_size:
                raise ValueError(f"{name}: K={k} is not a multiple of the int4 group size {group_size}")
            specs[base + ".weight_int4"] = ((n, k // 2), "U8")
            specs[base + ".scales_and_zeros"] = ((k // group_size, n, 2), "BF16")
        else:
            specs[name] = (shape, "float")
    return specs


def quantize_state_dict(config: ModelConfig, sd: dict[str, Tensor], method: str,
                        group_size: int = DEFAULT_INT4_GROUP) -> dict[str, Tensor]:
    """A float state dict → the tensors of a quantized bundle (see quantized_tensor_specs)."""
    check_method(method, group_size)
    out: dict[str, Tensor] = {}
    for name, w in sd.items():
        base = name.removesuffix(".weight")
        if name in INT8_ALWAYS or (method == "int8" and base.endswith(LINEARS)):
            out[base + ".weight_int8"], out[base + ".scales"] = quantize_int8(w)
        elif base.endswith(LINEARS):
            out[base + ".weight_int4"], out[base + ".scales_and_zeros"] = quantize_int4(w, group_size)
        else:
            out[name] = w
    return out


# ------------------------------------------------------------------------------------------------------------
# Building the inference model
# ------------------------------------------------------------------------------------------------------------


def release_free_memory() -> None:
    """Return freed heap pages to the OS (glibc): packing leaves large temporaries behind in the heap, ~200 MB for
    a medium int4 model, which would otherwise stay in the daemon's resident size."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, leaf = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def _check_int4_at_load(config: ModelConfig, group_size: int) -> None:
    """Refuse `--quant int4` on a model its groups do not tile, naming what does: the daemon has no group size option
    (quantize_int4's own message, "group size must ... divide K", named a choice it does not offer)."""
    def fault(g: int) -> str | None:
        try:
            quantized_tensor_specs(config, "int4", g)
        except ValueError as e:
            return str(e)
        return None

    if (why := fault(group_size)) is None:
        return
    fits = [g for g in INT4_GROUP_SIZES if fault(g) is None]
    way = (f"serve an int4 bundle written by `m31r bundle quantize --quant int4 --group-size {fits[0]}`, or use "
           "--quant int8" if fits else "no int4 group size does: use --quant int8")
    raise ValueError(f"--quant int4 quantizes at load in groups of {group_size}, which do not fit this model ({why}); "
                     f"{way}")


def prepare(model: nn.Module, tensors: dict[str, Tensor], *, dtype: torch.dtype, device: torch.device,
            method: str | None, group_size: int = DEFAULT_INT4_GROUP, pack: bool = True) -> nn.Module:
    """Fill a meta-device Transformer with inference modules built from `tensors`.

    `tensors` is a float state dict (quantized here when `method` is set) or a quantized bundle's tensors (then
    `method` must name its quantization). Norm gains and float weights are cast to `dtype` on `device`. `pack=False`
    keeps float weights plain (copies), for an engine that hands them the native fp32 matmul (FloatLinear).
    """
    check_method(method, group_size)
    quantized = any(k.endswith((".weight_int8", ".weight_int4")) for k in tensors)
    if method is not None and device.type != "cpu":
        # (the dtype is not what to change: it is the activations', and the quantized kernels are CPU-only)
        if quantized:
            raise ValueError(f"the bundle holds {method} weights, which run on the CPU kernels only: use --device cpu, "
                             "or serve the float bundle it was quantized from")
        raise ValueError(f"--quant {method} runs on the CPU kernels only: use --device cpu, or --quant none")
    if not quantized and method == "int4":
        _check_int4_at_load(model.config, group_size)
    if not quantized and method is not None:
        tensors = quantize_state_dict(model.config, tensors, method, group_size)

    def linear(base: str) -> nn.Module:
        bias = tensors.get(base + ".bias")
        if base + ".weight_int8" in tensors:
            return Int8Linear(tensors[base + ".weight_int8"], tensors[base + ".scales"], bias)
        if base + ".weight_int4" in tensors:
            return Int4Linear(tensors[base + ".weight_int4"], tensors[base + ".scales_and_zeros"], group_size, bias)
        bias = None if bias is None else bias.to(device, dtype, copy=True)
        if pack:
            return FloatLinear(tensors[base + ".weight"].to(device, dtype), bias)  # packed: a copy
        return FloatLinear(tensors[base + ".weight"].to(device, dtype, copy=True).contiguous(), bias, pack=False)

    for i in range(model.config.n_layers):
        for name in LINEARS:
            _set(model, f"layers.{i}.{name}", linear(f"layers.{i}.{name}"))
    if not model.config.tie_embeddings:
        model.output = linear("output")
    if "tok_embeddings.weight_int8" in tensors:
        codes, scales = tensors["tok_embeddings.weight_int8"], tensors["tok_embeddings.scales"]
        model.tok_embeddings = Int8Embedding(codes, scales, dtype)
        if model.config.tie_embeddings:  # the head reads the same bytes
            model.head = Int8Linear(codes, scales)
    else:
        # Copies, like the packed weights: the file's map is then released unless quantized codes still use it.
        emb = tensors["tok_embeddings.weight"].to(device, dtype, copy=True)
        model.tok_embeddings = nn.Embedding(*emb.shape, _weight=emb, _freeze=True)
    norms = {k: tensors[k].to(device, dtype, copy=True) for k in tensors if k.endswith("norm.weight")}
    missing, unexpected = model.load_state_dict(norms, strict=False, assign=True)
    left = [n for n, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta
            and not n.startswith("rope_")]
    if unexpected or left:
        raise ValueError(f"weights do not fill the model: unexpected {unexpected[:3]}, unset {left[:3]}")
    release_free_memory()
    return model

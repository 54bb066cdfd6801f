"""What `--dtype auto` and `--quant auto` resolve to on this machine, and why (the warm-up log says it).

The aim (issue 18): the fastest mode whose greedy output agrees with fp32's in at least 98% of FIM tasks
(benchmarks/eval_precision.py). On release 0.5.0 no quantized mode reaches it (docs/speed.md "Accuracy"); the defaults
take the closest of the fast ones.

auto dtype: the activation dtype of the kernel family M31R_KERNELS forces, where it names one this CPU runs (so
`M31R_KERNELS=avx2` on an AVX-512 machine serves as an AVX2 machine would). Else fp32 wherever an fp32 family
(avx2vnni, avx2, neon) loads, on AVX512-BF16 CPUs too: on release 0.5.0, int8 weights on fp32 activations give
fp32's greedy completion in 96.2% of eval_precision's FIM tasks against 93.8% on bf16 activations (bf16 weights
alone: 90.0%), and the fp32 kernels decode faster besides (fused per-token ops; on the AVX512-BF16 Xeon, int8: mini
3.8 against 6.2 ms/token, medium 26.8 against 35.4). bf16 prefills faster where it is native (AMX: a 300-token
medium prompt in 0.47 s against 0.82 s), which `--dtype bfloat16` still offers. Without fp32 kernels (no C
compiler, M31R_KERNELS=eager): bf16 where it is native (CUDA, or a CPU with AVX512-BF16/AMX: elsewhere torch
emulates bf16, slower than fp32), else fp32.

auto quant: a quantized bundle as stored. Else, on the CPU, int8 weights:
  - with fp32 activations, only where the AVX2 (on Arm: NEON) family's int8 kernel runs and passes its start-up
    self-check (native.Kernels.int8_check). That kernel quantizes activations to int16 per block of 32 (q16); its
    earlier q8 activations kept fp32's greedy choice in only 87.5% of FIM tasks (benchmarks/eval_precision.py),
    below the 98% bar. torch's int8 kernel needs bf16 activations to be fast, so fp32 engines without the native
    kernel (neither AVX2 nor NEON, no C compiler, M31R_KERNELS=eager) keep float weights;
  - with bf16 activations: decode reads half the bytes of bf16 at bf16's accuracy (validation perplexity of the
    release model: fp32 44.711, int8 44.710, bf16 44.718), on the AVX-512 kernel or torch's.
Never on CUDA: the int8/int4 kernels are CPU-only. Explicit choices always stand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from m31r import native


@dataclass(frozen=True)
class Precision:
    dtype: str
    quant: str | None
    why: str  # how the "auto" parts were resolved ("" when nothing was auto)


def fast_bf16(device: torch.device) -> bool:
    """Whether bf16 matmuls run natively here: CUDA, or a CPU with AVX512-BF16 / AMX (elsewhere torch emulates
    bf16 on the CPU, slower than fp32)."""
    if device.type == "cuda":
        return True
    cpu = torch.cpu
    probes = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    return any(p is not None and p() for p in probes)


def _dtype(device: torch.device) -> tuple[str, str]:
    if device.type != "cpu":
        return "bfloat16", f"dtype bfloat16 on {device.type}"
    forced = native.forced()
    if forced is not None:
        name = str(forced.dtype).removeprefix("torch.")
        return name, f"dtype {name}: the {forced.name} kernels M31R_KERNELS forces take it"
    kernels = native.load(torch.float32)
    if kernels is not None and kernels.float_dtype == torch.float32:
        return "float32", (f"dtype float32: the {kernels.name} kernels run it (closer to fp32's greedy output than "
                           "bf16 activations, and faster to decode)")
    if fast_bf16(device):
        return "bfloat16", "dtype bfloat16: native on this CPU, and no fp32 kernels run here"
    return "float32", "dtype float32: bf16 is emulated on this CPU"


def _quant(device: torch.device, dtype: str) -> tuple[str | None, str]:
    if device.type != "cpu":
        return None, "float weights: the int8/int4 kernels run on the CPU only"
    if dtype == "bfloat16":
        return "int8", "int8 weights: bf16 activations, bf16 accuracy"
    if dtype != "float32":
        return None, f"float weights: no int8 kernel for {dtype} activations"
    kernels = native.load(torch.float32)
    if kernels is None:
        return None, f"float weights: no native int8 kernel for float32 activations ({native.why_not(torch.float32)})"
    if kernels.int8_dtype != torch.float32:
        return None, f"float weights: the {kernels.name} kernels have no int8 matmul for float32 activations"
    ok, detail = kernels.int8_check()
    if not ok:
        return None, f"float weights: the {kernels.name} int8 kernel failed its check ({detail})"
    return "int8", f"int8 weights: the {kernels.name} int8 kernel (q16 activations) passed its self-check"


def resolve(device: torch.device, dtype: str, quant: str | None, stored: str | None) -> Precision:
    """Resolve "auto" in `dtype` and `quant` (the daemon's defaults); `stored` is a quantized bundle's method."""
    whys = []
    if dtype == "auto":
        dtype, why = _dtype(device)
        whys.append(why)
    if quant == "none":
        quant = None
    if quant == "auto":
        if stored:
            quant, why = stored, f"{stored} weights: as the bundle stores them"
        else:
            quant, why = _quant(device, dtype)
        whys.append(why)
    return Precision(dtype, quant, "; ".join(whys))


def auto_precision(device: torch.device, dtype: str, quant: str | None, stored: str | None) -> tuple[str, str | None]:
    """(dtype, quant) of `resolve`."""
    p = resolve(device, dtype, quant, stored)
    return p.dtype, p.quant

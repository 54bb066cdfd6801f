"""The CPU this runs on: its name and feature flags, for the figures and checks that must say which machine.

Figures are only comparable on one machine (README "Speed"), and kernels are chosen by features, so benchmarks,
training metadata and `m31r doctor` all report the same description from here. Standard library only.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

# Flags that decide which kernels run, in /proc/cpuinfo spelling, with the names people know them by.
X86_FEATURES = {"avx2": "AVX2", "fma": "FMA", "f16c": "F16C", "avx_vnni": "AVX-VNNI", "avx512f": "AVX-512F",
                "avx512_vnni": "AVX512-VNNI", "avx512_bf16": "AVX512-BF16", "amx_tile": "AMX"}
ARM_FEATURES = {"asimd": "NEON", "asimddp": "dotprod"}


def _sysctl(*names: str) -> str:
    try:
        out = subprocess.run(["sysctl", "-n", *names], capture_output=True, text=True, timeout=10,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def cpu_info() -> tuple[str, set[str], str]:
    """(model name, feature flags in /proc/cpuinfo spelling, architecture), best effort on Linux and macOS."""
    arch = platform.machine().lower()
    name, flags = platform.processor() or arch, set()
    if sys.platform == "linux":
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            text = ""
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key in ("model name", "cpu model") and value.strip():
                name = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = set(value.split())
    elif sys.platform == "darwin":
        name = _sysctl("machdep.cpu.brand_string") or name
        if arch == "arm64":
            flags = {"asimd"}  # every Apple arm64 CPU has NEON
            if _sysctl("hw.optional.arm.FEAT_DotProd") == "1":
                flags.add("asimddp")
        else:
            words = set(_sysctl("machdep.cpu.features", "machdep.cpu.leaf7_features").lower().split())
            flags = {f for f in X86_FEATURES if f in words or f.replace("_", "") in words}
    return name, flags, arch


def describe() -> str:
    """One line for a figure: the CPU's name, its core count and the features that decide the kernels."""
    name, flags, _ = cpu_info()
    known = [label for flag, label in {**X86_FEATURES, **ARM_FEATURES}.items() if flag in flags]
    return f"{name}, {os.cpu_count()} CPUs, {' '.join(known) or 'none of AVX2/AVX-512/NEON'}"

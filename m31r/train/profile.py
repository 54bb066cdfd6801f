"""A profile of a few training steps, written beside the run's log.

The lent GPU's runs since the fourth lease train at half the speed of the first three (~0.5M against ~1.15M tokens a
second) with the row builders ahead and the GPU idle most of each step (docs/training.md, "The fifth lease"): what the
one process feeding the GPU spends its time on can only be seen there, within the call. So the device script profiles
a few steps of every call, torch's view (operators, kernels, copies, synchronisations) beside Python's (cProfile),
at a cost of those steps' speed only.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path

import torch


def parse_steps(spec: str) -> tuple[int, int] | None:
    """'A-B' (steps A to B, both counted from 1, as the log numbers them) → (A, B); '' → None."""
    spec = spec.strip()
    if not spec:
        return None
    a, sep, b = spec.partition("-")
    try:
        first, last = int(a), int(b if sep else a)
    except ValueError:
        raise ValueError(f"steps to profile: {spec!r} is not A-B (e.g. 20-24)") from None
    if not 1 <= first <= last:
        raise ValueError(f"steps to profile: {spec!r} needs 1 <= A <= B")
    return first, last


class StepProfile:
    """Profiles the steps first..last (as logged, from 1) of a run; `before(step)` and `after(step)` wrap each step
    (the step's number once done), and the report goes to `out` after the last one. Never fails the run: a profiler
    that cannot start (no CUPTI) or cannot report leaves its error in the file instead."""

    def __init__(self, steps: tuple[int, int], out: Path, device: torch.device):
        self.first, self.last, self.out, self.device = *steps, out, device
        self.torch: torch.profiler.profile | None = None
        self.python: cProfile.Profile | None = None
        self.started = 0.0
        self.errors: list[str] = []

    def before(self, step: int) -> None:
        if step != self.first:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            self.torch = torch.profiler.profile(activities=activities)
            self.torch.__enter__()
        except Exception as e:  # noqa: BLE001 (a diagnostic: the run goes on without it)
            self.torch = None
            self.errors.append(f"torch.profiler did not start: {e!r}")
        self.python = cProfile.Profile()
        self.python.enable()
        self.started = time.perf_counter()

    def after(self, step: int) -> None:
        if step != self.last or self.python is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        wall = time.perf_counter() - self.started
        self.python.disable()
        parts = [f"steps {self.first} to {self.last} ({self.last - self.first + 1}): {wall:.3f} s of wall time, "
                 f"{wall / (self.last - self.first + 1):.3f} s a step (profiled: slower than the others)"]
        parts += self.errors
        if self.torch is not None:
            try:
                self.torch.__exit__(None, None, None)
                table = self.torch.key_averages()
                if self.device.type == "cuda":
                    parts += ["", "torch, by self device time:", table.table(sort_by="self_device_time_total",
                                                                            row_limit=30, max_name_column_width=60)]
                parts += ["", "torch, by self CPU time:", table.table(sort_by="self_cpu_time_total", row_limit=30,
                                                                     max_name_column_width=60)]
            except Exception as e:  # noqa: BLE001
                parts.append(f"torch.profiler did not report: {e!r}")
        for order in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(self.python, stream=text).sort_stats(order).print_stats(25)
            parts += ["", f"Python (cProfile), by {order}:", text.getvalue()]
        self.python = None
        self.out.write_text("\n".join(parts) + "\n")

"""The devices this machine can run the model on. Parity tests run on each: on a GPU machine the same tests
check the CUDA path (`make test` there covers it); on a CPU-only machine the CUDA cases are not generated."""

from __future__ import annotations

import torch

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]

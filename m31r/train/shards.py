"""Move a run's weights through narrow pipes: a checkpoint as bf16 safetensors shards under a size limit, and back.

A lent GPU machine returns files of at most 16 MiB and loses everything when it is given back, so each training
call there ends by writing its weights as shards (the optimizer state, three times larger, stays behind). Here the
shards become a checkpoint again (`import_shards`): `export` makes a bundle of it, and `train` continues it with
a fresh optimizer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

MAX_SHARD_BYTES = 15 * 2**20


def write_shards(ckpt: Path, out: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Split a checkpoint's weights (as bf16) into shards of at most max_bytes, plus its state as JSON."""
    saved = torch.load(ckpt, map_location="cpu", weights_only=False)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in saved["model"].items():
        t = t.detach().to(torch.bfloat16).contiguous()
        if t.nbytes > max_bytes:
            raise ValueError(f"{name} alone ({t.nbytes} bytes) is over the shard limit of {max_bytes}")
        if size + t.nbytes > max_bytes - 64 * 1024:  # room for the header
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    paths = []
    for i, part in enumerate(shards):
        paths.append(out / f"weights-{i:02d}-of-{len(shards):02d}.safetensors")
        save_file(part, str(paths[-1]))
    state = {k: v for k, v in saved["state"].items()}
    (out / "state.json").write_text(json.dumps(state))
    return [*paths, out / "state.json"]


def import_shards(folder: Path, run_dir: Path) -> dict:
    """A checkpoint in run_dir from shards (no optimizer state: the next `train` starts a fresh one)."""
    shards = sorted(Path(folder).glob("weights-*-of-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no weights-*-of-*.safetensors shards")
    expected = int(shards[0].stem.rsplit("-", 1)[1])
    if len(shards) != expected:
        raise ValueError(f"{folder}: {len(shards)} of {expected} shards present")
    model: dict[str, torch.Tensor] = {}
    for s in shards:
        model.update({k: v.float() for k, v in load_file(str(s)).items()})
    state = json.loads((Path(folder) / "state.json").read_text())
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "optimizer": None, "state": state}, run_dir / "ckpt.pt")
    return state

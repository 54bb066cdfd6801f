"""Move a run's weights through narrow pipes: a checkpoint as bf16 safetensors shards under a size limit, and back.

A lent GPU machine returns files of at most 16 MiB and loses everything when it is given back, so each training
call there ends by writing its weights as shards (the optimizer state, three times larger, stays behind). Here the
shards become a checkpoint again (`import_shards`): `export` makes a bundle of it, and `train` continues it with
a fresh optimizer, its learning rate warmed up again from the checkpoint's step (trainer.rewarm_factor).
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from m31r.config import ModelConfig
from m31r.train.trainer import hold_run, load_checkpoint, write_checkpoint

MAX_SHARD_BYTES = 15 * 2**20


def write_shards(ckpt: Path, out: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Pack a checkpoint's weights (as bf16) into as few shards of at most max_bytes as they fit, plus its state as
    JSON. A tensor that does not fit the room left is split by rows (parts named NAME@0, NAME@1, ...): mini's
    embedding alone is 16 MiB, and filling every shard keeps its 59 MB to four files."""
    saved = load_checkpoint(ckpt)
    out.mkdir(parents=True, exist_ok=True)
    room_per_shard = max_bytes - min(64 * 1024, max_bytes // 4)  # room for the header
    shards: list[dict[str, torch.Tensor]] = [{}]
    room = room_per_shard
    for name, t in saved["model"].items():
        t = t.detach().to(torch.bfloat16).contiguous()
        if t.nbytes <= room or t.dim() == 0:
            if t.nbytes > room:
                shards.append({})
                room = room_per_shard
            shards[-1][name] = t
            room -= t.nbytes
            continue
        row_bytes = t[0].nbytes
        if row_bytes > room_per_shard:
            raise ValueError(f"{name}: one row ({row_bytes} bytes) is over the shard limit of {max_bytes}")
        part = 0
        while len(t):
            rows = min(len(t), room // row_bytes)
            if rows == 0:
                shards.append({})
                room = room_per_shard
                continue
            shards[-1][f"{name}@{part}"] = t[:rows].clone()
            t, room, part = t[rows:], room - t[:rows].nbytes, part + 1
    shards = [s for s in shards if s]
    paths = []
    for i, part in enumerate(shards):
        paths.append(out / f"weights-{i:02d}-of-{len(shards):02d}.safetensors")
        save_file(part, str(paths[-1]))
    state = {k: v for k, v in saved["state"].items()}
    (out / "state.json").write_text(json.dumps(state))
    return [*paths, out / "state.json"]


def import_shards(folder: Path, run_dir: Path, *, force: bool = False) -> dict:
    """A checkpoint in run_dir from shards (no optimizer state: the next `train` starts a fresh one and warms the lr
    up again). The shards' state.json carries the run's state whole (its tokenizer's sha256 and dataset version
    included). An existing checkpoint is replaced only with `force` (it may be a run's only copy), and never
    half-written."""
    ckpt = Path(run_dir) / "ckpt.pt"
    if ckpt.exists() and not force:
        raise FileExistsError(f"{ckpt} exists: import into a new run folder, or pass --force to replace it")
    shards = sorted(Path(folder).glob("weights-*-of-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{folder}: no weights-*-of-*.safetensors shards")
    expected = int(shards[0].stem.rsplit("-", 1)[1])
    if len(shards) != expected:
        raise ValueError(f"{folder}: {len(shards)} of {expected} shards present")
    model: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for s in shards:
        for k, v in load_file(str(s)).items():
            if "@" in k:
                name, i = k.rsplit("@", 1)
                parts.setdefault(name, {})[int(i)] = v
            else:
                model[k] = v.float()
    for name, pieces in parts.items():
        if sorted(pieces) != list(range(len(pieces))):
            raise ValueError(f"{folder}: parts {sorted(pieces)} of {name} do not run 0..{len(pieces) - 1}")
        model[name] = torch.cat([pieces[i] for i in range(len(pieces))]).float()
    state = read_state(Path(folder) / "state.json")
    require_whole_model(model, state, folder)
    ckpt.parent.mkdir(parents=True, exist_ok=True)
    with hold_run(ckpt.parent):  # not while a trainer writes its own ckpt.tmp there
        write_checkpoint(ckpt, {"model": model, "optimizer": None, "state": state})
    return state


def read_state(path: Path) -> dict:
    """The run's state that travelled beside the shards, or a ValueError naming the file (json's own error names
    neither the file nor what it is)."""
    try:
        state = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not the JSON `m31r train shards` writes ({e}): copy it again") from None
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and "model_config" in state):
        raise ValueError(f"{path} is not a run's state (no step or model_config): copy the one written with the shards")
    return state


def require_whole_model(model: dict[str, torch.Tensor], state: dict, folder: Path) -> None:
    """The imported tensors must be exactly the run's model's (names and shapes): shards of two writes mixed in one
    folder, or one cut short, were imported and failed only at `train` or `export` with torch's list of mismatches
    (a missing last part of a split tensor made it short by its rows)."""
    from m31r.model import Transformer

    try:
        mc = msgspec.convert(state["model_config"], ModelConfig)
    except (msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"{folder / 'state.json'}: its model_config is not a model config ({e})") from None
    with torch.device("meta"):  # shapes only: nothing is allocated
        want = {k: tuple(v.shape) for k, v in Transformer(mc).state_dict().items()}
    problems = [f"{k} missing" for k in want if k not in model]
    problems += [f"{k} has shape {list(model[k].shape)}, not {list(s)}" for k, s in want.items()
                 if k in model and tuple(model[k].shape) != s]
    problems += [f"{k} is not a tensor of this model" for k in model if k not in want]
    if problems:
        more = f" and {len(problems) - 5} more" if len(problems) > 5 else ""
        raise ValueError(f"{folder}: the shards do not hold the run's model ({'; '.join(problems[:5])}{more}): they "
                         "are of another write, or cut short; copy all the shards of one `m31r train shards` again")

"""Move a run's weights through narrow pipes: a checkpoint as bf16 safetensors shards under a size limit, and back.

A lent GPU machine returns files of at most 16 MiB and loses everything when it is given back, so each training
call there ends by writing its weights as shards (the optimizer state, three times larger, stays behind). Here the
shards become a checkpoint again (`import_shards`): `export` makes a bundle of it, and `train` continues it with
a fresh optimizer, its learning rate warmed up again from the checkpoint's step (trainer.rewarm_factor).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save_file

from m31r.checksums import sha256_file
from m31r.config import ModelConfig
from m31r.train.trainer import hold_run, load_checkpoint, write_checkpoint

MAX_SHARD_BYTES = 15 * 2**20
SHARD_NAME = re.compile(r"weights-(\d+)-of-(\d+)\.safetensors")
SHARD_FILES = "shard_files"  # state.json's record of its shards' sha256, taken out again on import


def write_shards(ckpt: Path, out: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[Path]:
    """Pack a checkpoint's weights (as bf16) into as few shards of at most max_bytes as they fit, plus its state as
    JSON. A tensor that does not fit the room left is split by rows (parts named NAME@0, NAME@1, ...): mini's
    embedding alone is 16 MiB, and filling every shard keeps its 59 MB to four files.

    OUT ends up holding this write's shards and no other: those of an earlier write (more of them, or as many) were
    left beside the new ones. Each file is written under a temporary name first, so a write that fails leaves the
    earlier one whole; state.json records each shard's sha256 (SHARD_FILES), which import_shards checks."""
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
    names = [f"weights-{i:02d}-of-{len(shards):02d}.safetensors" for i in range(len(shards))]
    for leftover in out.glob(".*.tmp"):  # of a write that was killed while staging
        if leftover.name.startswith(".weights-") or leftover.name == ".state.json.tmp":
            leftover.unlink()
    staged: list[Path] = []
    try:
        hashes = {}
        for name, part in zip(names, shards, strict=True):
            staged.append(out / f".{name}.tmp")
            save_file(part, str(staged[-1]))
            hashes[name] = sha256_file(staged[-1])
        state = {**saved["state"], SHARD_FILES: hashes}
        staged.append(out / ".state.json.tmp")
        staged[-1].write_text(json.dumps(state))
    except BaseException:
        for p in staged:
            p.unlink(missing_ok=True)
        raise
    # The earlier write goes only now, state.json first: a kill among the renames below leaves shards without their
    # state.json, which import refuses, never a set that mixes two writes.
    (out / "state.json").unlink(missing_ok=True)
    for old in shard_files(out):
        if old.name not in hashes:
            old.unlink()
    for name, tmp in zip([*names, "state.json"], staged, strict=True):
        os.replace(tmp, out / name)
    return [*(out / n for n in names), out / "state.json"]


def shard_files(folder: Path) -> list[Path]:
    """The files in folder named as write_shards names shards."""
    return sorted(p for p in Path(folder).iterdir() if SHARD_NAME.fullmatch(p.name))


def read_shards(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """The float32 weights and the run's state that one write_shards left in folder, checked to be that: all of its
    shards, whole, no other write's beside them, and exactly the tensors of the model its state.json names.
    A ValueError (FileNotFoundError for what is missing) names the files and what to do otherwise."""
    folder = Path(folder)
    files = shard_files(folder)
    if not files:
        raise FileNotFoundError(f"{folder}: no weights-*-of-*.safetensors shards")
    if not (folder / "state.json").is_file():
        raise FileNotFoundError(f"{folder / 'state.json'} is missing: it travels with the shards (the run's step and "
                                "model); copy it from the same `m31r train shards` or device call")
    state = read_state(folder / "state.json")
    recorded = state.pop(SHARD_FILES, None)
    again = "copy all the shards and the state.json of one write again, into an empty folder"
    names = {f.name for f in files}
    if isinstance(recorded, dict):  # written since the shards' sha256 were recorded
        want = set(recorded)
        if others := sorted(names - want):
            raise ValueError(f"{folder} holds shards of more than one write: {', '.join(others)} "
                             f"{'is' if len(others) == 1 else 'are'} not of the write its state.json records "
                             f"({', '.join(sorted(want))}); delete {'it' if len(others) == 1 else 'them'}, or {again}")
    else:  # shards from before: their names alone must make one whole set
        totals = {int(SHARD_NAME.fullmatch(n)[2]) for n in names}
        if len(totals) > 1:
            raise ValueError(f"{folder} holds shards of more than one write ({', '.join(sorted(names))}): {again}")
        (total,) = totals
        want = {f"weights-{i:02d}-of-{total:02d}.safetensors" for i in range(total)}
        if others := sorted(names - want):
            raise ValueError(f"{folder}: {', '.join(others)} {'is' if len(others) == 1 else 'are'} not one of "
                             f"{total} shards of one write: {again}")
    if missing := sorted(want - names):
        raise ValueError(f"{folder}: {len(want) - len(missing)} of {len(want)} shards present ({', '.join(missing)} "
                         f"missing): copy {'it' if len(missing) == 1 else 'them'} again from the same write")
    model: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for s in files:
        try:
            tensors = load_file(str(s))
        except OSError:
            raise
        except Exception as e:  # safetensors' own error (a file cut short) names neither the file nor what to do
            raise ValueError(f"{s} cannot be read as a shard ({e}): it was cut short or replaced; {again}") from None
        for k, v in tensors.items():
            name, _, i = k.rpartition("@") if "@" in k else (k, "", "")
            if (i and int(i) in parts.get(name, {})) or (not i and name in model):
                raise ValueError(f"{folder}: {k} is in two shards: {again}")
            if i:
                parts.setdefault(name, {})[int(i)] = v
            else:
                model[k] = v.float()
    for name, pieces in parts.items():
        if sorted(pieces) != list(range(len(pieces))):
            raise ValueError(f"{folder}: parts {sorted(pieces)} of {name} do not run 0..{len(pieces) - 1}")
        model[name] = torch.cat([pieces[i] for i in range(len(pieces))]).float()
    require_whole_model(model, state, folder)
    # Last, as the one check left for shards of another write of the same model (a copy over an earlier lease's that
    # failed part-way), or a state.json of another write: both imported as a silent mix of two runs.
    if isinstance(recorded, dict) and (bad := [f.name for f in files if sha256_file(f) != recorded[f.name]]):
        raise ValueError(f"{folder}: {', '.join(bad)} {'is' if len(bad) == 1 else 'are'} not the file its state.json "
                         f"records (of another write, or changed since): {again}")
    return model, state


def import_shards(folder: Path, run_dir: Path, *, force: bool = False) -> dict:
    """A checkpoint in run_dir from shards (no optimizer state: the next `train` starts a fresh one and warms the lr
    up again). The shards' state.json carries the run's state whole (its tokenizer's sha256 and dataset version
    included). An existing checkpoint is replaced only with `force` (it may be a run's only copy), and never
    half-written."""
    ckpt = Path(run_dir) / "ckpt.pt"
    if ckpt.exists() and not force:
        raise FileExistsError(f"{ckpt} exists: import into a new run folder, or pass --force to replace it")
    model, state = read_shards(folder)
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

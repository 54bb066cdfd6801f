"""The forty-seventh session's audit of weights through a lease's narrow pipe: a write of shards leaves only its own
(an earlier, longer write's stayed beside them), a folder holding two writes, a shard cut short or a state.json of
another write is refused naming the files, a failed write leaves the earlier one whole, every tensor comes back as
its bf16 value, and device-train.sh checks the shards it continues (their shape against CONFIG's) before it unpacks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from test_train2_s46 import tiny_checkpoint
from test_training import MODEL_YAML, train_yaml

from m31r.cli import main
from m31r.train import shards as shards_mod
from m31r.train.shards import SHARD_FILES, import_shards, write_shards
from m31r.train.trainer import load_checkpoint, write_checkpoint

REPO = Path(__file__).resolve().parent.parent
SMALL = 20_000  # bytes a shard: the tiny model in 16 shards, its embedding split across several


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two checkpoints of the same model with different weights (two leases' runs)."""
    root = tmp_path_factory.mktemp("runs")
    a = tiny_checkpoint(root / "a")
    b = tiny_checkpoint(root / "b")
    saved = load_checkpoint(b)
    saved["model"] = {k: v + 0.5 for k, v in saved["model"].items()}
    saved["state"]["step"] = 9
    write_checkpoint(b, saved)
    return a, b


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(ckpt)["model"]


def import_error(folder: Path, run: Path) -> str:
    """import-shards' one line on stderr (and that it wrote nothing)."""
    r = CliRunner().invoke(main, ["train", "import-shards", str(folder), "--run", str(run)])
    assert r.exit_code == 1, r.output
    assert "Traceback" not in r.output and not (run / "ckpt.pt").exists()
    return r.stderr


def test_a_write_leaves_only_its_own_shards(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Shards written into a folder holding an earlier, longer write (weights-NN-of-16) left those beside the new
    ones (of-07 here); import then refused with `23 of 7 shards present`, and a copy of the folder carried both."""
    a, b = two_runs
    out = tmp_path / "out"
    assert len(write_shards(a, out, max_bytes=SMALL)) == 17
    files = write_shards(b, out)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in files)  # no hidden staging files either
    assert import_shards(out, tmp_path / "back")["step"] == 9
    got = weights(tmp_path / "back" / "ckpt.pt")
    assert all(torch.equal(got[k], v.to(torch.bfloat16).float()) for k, v in weights(b).items())


def test_a_folder_of_two_writes_is_refused_naming_the_files(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """A lease's shards copied over an earlier lease's (one copy failed, or a state.json left behind): with as many
    shards each, the folder imported as a mix of both runs' weights under one run's step, silently."""
    a, b = two_runs
    write_shards(a, tmp_path / "a", max_bytes=SMALL)
    write_shards(b, tmp_path / "b", max_bytes=SMALL)
    mixed = tmp_path / "mixed"
    shutil.copytree(tmp_path / "a", mixed)
    shutil.copy(tmp_path / "b" / "weights-03-of-16.safetensors", mixed)
    err = import_error(mixed, tmp_path / "r1")
    assert "weights-03-of-16.safetensors is not the file its state.json records (of another write" in err
    shutil.copy(tmp_path / "a" / "weights-03-of-16.safetensors", mixed)
    shutil.copy(tmp_path / "b" / "state.json", mixed)  # the shards of one run, the step of another
    assert "are not the file its state.json records" in import_error(mixed, tmp_path / "r2")

    write_shards(b, tmp_path / "b4")  # another write's count beside them: the extra files are named
    shutil.copy(tmp_path / "a" / "state.json", mixed)
    shutil.copy(tmp_path / "b4" / "weights-00-of-01.safetensors", mixed)
    err = import_error(mixed, tmp_path / "r3")
    assert "holds shards of more than one write: weights-00-of-01.safetensors is not of the write" in err

    # Shards from before state.json recorded them: their names alone must make one whole set.
    state = json.loads((mixed / "state.json").read_text())
    del state[SHARD_FILES]
    (mixed / "state.json").write_text(json.dumps(state))
    err = import_error(mixed, tmp_path / "r4")
    assert "holds shards of more than one write (weights-00-of-01.safetensors, weights-00-of-16.safetensors" in err
    (mixed / "weights-00-of-01.safetensors").unlink()
    (mixed / "weights-05-of-16.safetensors").unlink()
    assert "15 of 16 shards present (weights-05-of-16.safetensors missing)" in import_error(mixed, tmp_path / "r5")


def test_a_shard_cut_short_or_a_missing_state_is_refused_naming_it(two_runs: tuple[Path, Path],
                                                                   tmp_path: Path) -> None:
    """A partial fetch: a shard cut short came out as safetensors' own error and a traceback (`incomplete metadata,
    file not fully covered`, no file named), a missing state.json as `[Errno 2] No such file or directory`."""
    a, _ = two_runs
    files = write_shards(a, tmp_path / "s", max_bytes=SMALL)
    whole = files[2].read_bytes()
    files[2].write_bytes(whole[: len(whole) // 2])
    assert f"{files[2]} cannot be read as a shard (" in import_error(tmp_path / "s", tmp_path / "r1")
    files[2].write_bytes(whole)
    (tmp_path / "s" / "state.json").unlink()
    assert "state.json is missing: it travels with the shards" in import_error(tmp_path / "s", tmp_path / "r3")


def test_a_failed_write_leaves_the_earlier_shards_whole(two_runs: tuple[Path, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that failed part-way (a full disk) had replaced the earlier write's first shards in place: the folder
    then held a mix of two runs' weights that imported without a word."""
    a, b = two_runs
    write_shards(a, tmp_path / "out", max_bytes=SMALL)
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    real, calls = shards_mod.save_file, []

    def full_disk(tensors: dict, path: str) -> None:
        calls.append(path)
        if len(calls) == 3:
            Path(path).write_bytes(b"half")
            raise OSError(28, "No space left on device")
        real(tensors, path)

    monkeypatch.setattr(shards_mod, "save_file", full_disk)
    with pytest.raises(OSError, match="No space"):
        write_shards(b, tmp_path / "out", max_bytes=SMALL)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert import_shards(tmp_path / "out", tmp_path / "back")["step"] == 3


def test_every_tensor_comes_back_as_its_bf16_value(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """Split or whole, each tensor of the checkpoint returns in float32 holding exactly its bf16 rounding (what the
    bundle would hold), and a re-import over the run with --force replaces its checkpoint."""
    a, b = two_runs
    write_shards(a, tmp_path / "s", max_bytes=SMALL)
    run = tmp_path / "run"
    import_shards(tmp_path / "s", run)
    write_shards(b, tmp_path / "s", max_bytes=SMALL)
    assert import_shards(tmp_path / "s", run, force=True)["step"] == 9
    got, want = weights(run / "ckpt.pt"), weights(b)
    assert got.keys() == want.keys() and all(v.dtype == torch.float32 for v in got.values())
    assert all(torch.equal(got[k], v.to(torch.bfloat16).float()) for k, v in want.items())
    assert SHARD_FILES not in load_checkpoint(run / "ckpt.pt")["state"]


def device_call(tmp_path: Path, shards: Path, model_yaml: str) -> subprocess.CompletedProcess:
    """device-train.sh on a fresh machine whose PACKED folder holds only the shards (all it may read first)."""
    packed = tmp_path / "packed"
    shutil.copytree(shards, packed / "shards")
    (tmp_path / "model.yaml").write_text(model_yaml)
    (tmp_path / "device.yaml").write_text(train_yaml(model=str(tmp_path / "model.yaml")))
    (tmp_path / "out").mkdir()
    env = {**os.environ, "CONFIG": str(tmp_path / "device.yaml"), "DEVICE": "cpu", "PYTHON": sys.executable,
           "WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "PACKED": str(packed)}
    return subprocess.run(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)


def test_the_device_call_checks_the_shards_it_continues_before_unpacking(two_runs: tuple[Path, Path],
                                                                         tmp_path: Path) -> None:
    """Shards of another shape than CONFIG's model were imported, then the corpus unpacked and tokenised (a minute
    of the lease), and the trainer refused them twice (the retry without compile) with tracebacks."""
    a, _ = two_runs
    write_shards(a, tmp_path / "s")
    other = {**yaml.safe_load(MODEL_YAML), "d_model": 32}
    proc = device_call(tmp_path, tmp_path / "s", yaml.safe_dump(other))
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "is a run of another model than" in proc.stderr and "d_model 64 -> 32" in proc.stderr
    assert "nothing was unpacked or trained; train them with their own config" in proc.stderr
    assert not (tmp_path / "work" / "data").exists() and not (tmp_path / "work" / "run" / "ckpt.pt").exists()


def test_packing_refuses_shards_of_two_writes(two_runs: tuple[Path, Path], tmp_path: Path) -> None:
    """pack-device.sh carried whatever .device/shards held: a folder mixing two writes failed only on the lease."""
    a, b = two_runs
    shards = tmp_path / "dest" / ".device" / "shards"
    write_shards(a, shards, max_bytes=SMALL)
    write_shards(b, tmp_path / "b", max_bytes=SMALL)
    shutil.copy(tmp_path / "b" / "weights-07-of-16.safetensors", shards)  # one copy of b's over a's that worked
    env = {**os.environ, "DEST": str(tmp_path / "dest"), "DATA": str(tmp_path / "no-data"), "PY": sys.executable}
    proc = subprocess.run(["bash", "scripts/pack-device.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "weights-07-of-16.safetensors is not the file its state.json records" in proc.stderr
    assert proc.stderr.rstrip().endswith("nothing was packed")
    assert sorted(p.name for p in (tmp_path / "dest" / ".device").iterdir()) == ["shards"]

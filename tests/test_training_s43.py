"""What runs during a GPU lease, checked on the CPU (the forty-third session's audit): scripts/device-train.sh stops at
once where torch cannot reach the device, still sends the run's last checkpoint back when training fails, keeps a
config scheduled by steps inside BUDGET, and a run killed outright resumes bit-exact."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_training import data_dir, full_run, pack, train_yaml, wait_for  # noqa: F401 (fixtures)

from m31r.train.shards import import_shards
from m31r.train.trainer import export, train

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def packed(full_run, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:  # noqa: F811
    """What pack-device.sh makes of the tiny run's bundle: the folder device-train.sh reads (PACKED)."""
    dest = tmp_path_factory.mktemp("packed")
    bundle = export(full_run[0], data_dir, dest / "bundle", log=lambda s: None)
    proc = pack(data_dir, bundle.path, dest, part="16K")
    assert proc.returncode == 0, proc.stderr
    return dest / ".device"


def device_env(tmp_path: Path, packed: Path, data_dir: Path, **config) -> dict[str, str]:  # noqa: F811
    """device-train.sh's environment for a CPU call with a tiny config of its own."""
    cfg = tmp_path / "device.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=100_000, warmup_steps=2,
                              eval_interval=100_000, **config))
    out = tmp_path / "out"
    out.mkdir()
    return {**os.environ, "CONFIG": str(cfg), "DEVICE": "cpu", "PYTHON": sys.executable, "WORK": str(tmp_path / "work"),
            "OUT": str(out), "PACKED": str(packed)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch that cannot use CUDA")
def test_a_torch_without_the_device_stops_the_call_before_unpacking(packed: Path, data_dir: Path,  # noqa: F811
                                                                     tmp_path: Path):
    """A CPU-only torch on the lent machine: the trainer found it only after unpacking, tokenising and loading the
    corpus, and the retry without torch.compile did all that again, ending in an AssertionError's traceback twice."""
    env = {**device_env(tmp_path, packed, data_dir, minutes=1.0), "DEVICE": "cuda"}
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.startswith(f"torch {torch.__version__} cannot use the device cuda (")
    assert "Traceback" not in proc.stderr and not (tmp_path / "work" / "data").exists()


def test_a_failed_training_still_sends_the_last_checkpoint(packed: Path, data_dir: Path, tmp_path: Path):  # noqa: F811
    """Training that fails after a checkpoint (here the trainer alone is stopped) ended the call under `set -e` with
    nothing in OUT, though the checkpoint was whole: the machine, and it, are gone after the call. Now its shards and
    the log come back, and the call still fails."""
    env = {**device_env(tmp_path, packed, data_dir, minutes=2.0, ckpt_interval=5), "BUDGET": "300"}
    proc = subprocess.Popen(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    run = tmp_path / "work" / "run"
    try:
        wait_for(lambda: (run / "log.jsonl").exists() and len((run / "log.jsonl").read_text().splitlines()) >= 8,
                 timeout=120)
        os.kill(int((run / "lock").read_text()), signal.SIGTERM)  # the trainer's pid, from its run lock
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = torch.load(run / "ckpt.pt", weights_only=False)["state"]["step"]
    assert proc.returncode == 1 and saved >= 5
    assert err.splitlines()[-1] == f"training failed (status 1): sent the checkpoint of step {saved} instead"
    out = Path(env["OUT"])
    assert import_shards(out / "shards", tmp_path / "back")["step"] == saved
    assert (out / "log.jsonl").exists()


def test_a_config_scheduled_by_steps_trains_inside_budget(packed: Path, data_dir: Path, tmp_path: Path):  # noqa: F811
    """A config without `minutes` trained MINUTES (8 by default) whatever BUDGET said: a second call with a small
    BUDGET ran past the device's 10-minute limit, and such a call sends nothing back."""
    env = {**device_env(tmp_path, packed, data_dir), "BUDGET": "20", "MINUTES": "3"}
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = [line for line in proc.stdout.splitlines() if line.startswith("stopping at step ")]
    assert len(said) == 1, proc.stdout[-2000:]
    assert float(said[0].split("time budget of ")[1].split()[0]) < 1  # BUDGET's minutes, not MINUTES'
    assert (Path(env["OUT"]) / "shards" / "state.json").exists()


def test_a_run_killed_outright_resumes_bit_exact_with_row_builders(data_dir: Path, tmp_path: Path):  # noqa: F811
    """SIGKILL (the OOM killer, a lease's end) mid-run with forked row builders: the same command resumes from the
    last checkpoint, each step is logged once, and the run ends bit-exact with an uninterrupted one."""
    cfg = tmp_path / "k.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=2000, ckpt_interval=5,
                              eval_interval=100_000, data_workers=2))
    steps = 150
    whole = train(cfg, data_dir, tmp_path / "whole", max_steps=steps, log=lambda s: None)
    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "m31r.cli", "train", "model", str(cfg), "--data", str(data_dir), "--run", str(run),
           "--max-steps", str(steps)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: (run / "log.jsonl").exists() and len((run / "log.jsonl").read_text().splitlines()) >= 12)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    kept = torch.load(run / "ckpt.pt", weights_only=False)["state"]["step"]
    assert proc.returncode == -signal.SIGKILL and 10 <= kept < steps
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and f"resumed {run / 'ckpt.pt'} at step {kept}" in done.stderr
    a = torch.load(tmp_path / "whole" / "ckpt.pt", weights_only=False)
    b = torch.load(run / "ckpt.pt", weights_only=False)
    assert [h["train_next"] for h in b["state"]["history"]] == [h["train_next"] for h in whole["history"]]
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == list(
        range(1, steps + 1))

"""What a training step costs, as the lent GPU's calls report it since the fiftieth session: a profile of a few steps
(m31r/train/profile.py) and each step's row-building time in the log (the fifth lease trained at half the first
leases' speed with its row builders ahead, and nothing it sent back said where the time went)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_training import data_dir, full_run, train_yaml  # noqa: F401 (fixtures)
from test_training_s43 import REPO, device_env, packed  # noqa: F401 (fixture)

from m31r.train.profile import parse_steps
from m31r.train.trainer import train


def test_steps_to_profile_read_as_the_log_numbers_them():
    assert parse_steps("") is None and parse_steps("  ") is None
    assert parse_steps("20-24") == (20, 24) and parse_steps("3") == (3, 3)
    for bad in ("24-20", "0-2", "a-b", "20-"):
        with pytest.raises(ValueError, match="steps to profile"):
            parse_steps(bad)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_run_profiles_the_steps_asked_and_logs_each_steps_row_building(data_dir: Path, tmp_path: Path,  # noqa: F811
                                                                         workers: int):
    cfg = tmp_path / "train.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), data_workers=workers))
    run = tmp_path / "run"
    state = train(cfg, data_dir, run, max_steps=4, log=lambda s: None, profile=(2, 3))
    report = (run / "profile.txt").read_text()
    assert report.startswith("steps 2 to 3 (2): ")
    assert "torch, by self CPU time:" in report and "aten::" in report  # the operators of those steps
    assert "Python (cProfile), by tottime:" in report and "accumulate_step" in report
    # Each step's rows took time to build, in this process or a worker; with the step's tokens, a builder's rate.
    assert len(state["history"]) == 4 and all(r["rows_build_s"] > 0 for r in state["history"])


def test_a_run_without_a_profile_writes_none(data_dir: Path, tmp_path: Path):  # noqa: F811
    cfg = tmp_path / "train.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml")))
    train(cfg, data_dir, tmp_path / "run", max_steps=2, log=lambda s: None)
    assert not (tmp_path / "run" / "profile.txt").exists()


def test_a_bad_profile_stops_the_call_before_unpacking(packed: Path, data_dir: Path, tmp_path: Path):  # noqa: F811
    env = {**device_env(tmp_path, packed, data_dir, minutes=1.0), "PROFILE": "24-20"}
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("PROFILE: steps to profile: '24-20' needs 1 <= A <= B: nothing was unpacked")
    assert "Traceback" not in proc.stderr and not (tmp_path / "work" / "data").exists()

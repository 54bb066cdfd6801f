"""The GPU lease's call, checked on the CPU (the forty-fifth session's audit): scripts/device-train.sh refuses a CONFIG,
BUDGET or MINUTES it cannot use before it unpacks or tokenises anything, since each costs a minute of the lease."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from test_training import data_dir, full_run  # noqa: F401 (fixtures)
from test_training_s43 import REPO, device_env, packed  # noqa: F401 (fixture)


@pytest.mark.parametrize(("over", "message"), [
    # A copy of a lease's config outside configs/train: its `model:` path, relative to its folder, names nothing.
    ({"model": "model.yaml"}, "CONFIG={cfg} does not load (ConfigError: {cfg.parent}/model.yaml: file not found)"),
    ({"CONFIG": "configs/train/gpu-mini-blockfim2.yml"},  # a typo in the command line
     "CONFIG=configs/train/gpu-mini-blockfim2.yml does not load (FileNotFoundError: "),
    ({"BUDGET": "530s"}, "BUDGET='530s' is not a number of seconds: nothing was unpacked or trained"),
    ({"MINUTES": "eight"}, "MINUTES='eight' is not a number of minutes: nothing was unpacked or trained"),
], ids=["model-path", "config-typo", "budget", "minutes"])
def test_a_call_it_cannot_train_stops_before_unpacking(packed: Path, data_dir: Path, tmp_path: Path,  # noqa: F811
                                                       over: dict, message: str):
    """Each of these failed only after the corpus was unpacked and tokenised, the config in the trainer and a bad
    number in the training script's Python (a SyntaxError), and again in the retry without torch.compile."""
    env = device_env(tmp_path, packed, data_dir, minutes=1.0)
    cfg = tmp_path / "device.yaml"
    if "model" in over:
        cfg.write_text(cfg.read_text().replace(f"model: {data_dir.parent / 'model.yaml'}", "model: model.yaml"))
        assert "model: model.yaml" in cfg.read_text()
    env.update({k: v for k, v in over.items() if k != "model"})
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(message.format(cfg=cfg)), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "work" / "data").exists()
    assert not any((tmp_path / "out").iterdir())

"""The forty-fourth session's audit of resuming, before a GPU lease: weights resumed without their optimizer state (a
GPU call's shards) warm the learning rate up again instead of taking a fresh AdamW's first steps at the schedule's
peak, a checkpoint written during that warm-up resumes it bit-exact, and a finished run trains no more steps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from test_training import data_dir, train_yaml  # noqa: F401 (fixtures)

from m31r.train.shards import import_shards, write_shards
from m31r.train.trainer import export, load_train_config, lr_at, train

WARMUP = 4


def test_weights_resumed_without_optimizer_state_warm_up_again(data_dir: Path, tmp_path: Path):  # noqa: F811
    """Shards of step 10 imported (no optimizer state): the run went on at the schedule's lr with a fresh AdamW, whose
    first steps move every weight by about the lr. Now the lr climbs linearly to the schedule over warmup_steps, the
    state, the log and the bundle say so, and a checkpoint written mid-way (step 12) resumes the same warm-up: the run
    ends bit-exact with one that went through. A run resumed with its optimizer state warms nothing up."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=40, warmup_steps=WARMUP,
                              ckpt_interval=100_000, eval_interval=100_000))
    tc = load_train_config(cfg)[0]
    first = tmp_path / "first"
    train(cfg, data_dir, first, max_steps=10, log=lambda s: None)
    write_shards(first / "ckpt.pt", tmp_path / "shards")
    import_shards(tmp_path / "shards", tmp_path / "through")
    shutil.copytree(tmp_path / "through", tmp_path / "stopped")

    logs: list[str] = []
    through = train(cfg, data_dir, tmp_path / "through", max_steps=20, log=logs.append)
    assert through["rewarms"] == [{"step": 10, "steps": WARMUP}]
    assert any("no optimizer state" in m and f"warmed up again over steps 11 to {10 + WARMUP}" in m for m in logs)
    lrs = {h["step"]: h["lr"] for h in through["history"]}
    for step in range(10, 10 + WARMUP):  # 0-based, as lr_at counts: logged as step + 1
        assert lrs[step + 1] == pytest.approx(lr_at(step, tc) * (step - 9) / WARMUP, rel=1e-12), step
    assert [lrs[s + 1] for s in range(10 + WARMUP, 20)] == [lr_at(s, tc) for s in range(10 + WARMUP, 20)]
    assert export(tmp_path / "through", data_dir, tmp_path / "bundle", log=lambda s: None).metadata[
        "lr_rewarms"] == through["rewarms"]

    train(cfg, data_dir, tmp_path / "stopped", max_steps=12, log=lambda s: None)  # saved mid-way, with its AdamW
    logs.clear()
    stopped = train(cfg, data_dir, tmp_path / "stopped", max_steps=20, log=logs.append)
    assert not any("optimizer state" in m for m in logs)
    assert stopped["rewarms"] == through["rewarms"]
    assert [h["lr"] for h in stopped["history"]] == [h["lr"] for h in through["history"]]
    assert [h["train_next"] for h in stopped["history"]] == [h["train_next"] for h in through["history"]]
    a = torch.load(tmp_path / "through" / "ckpt.pt", weights_only=False)
    b = torch.load(tmp_path / "stopped" / "ckpt.pt", weights_only=False)
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())

    more = train(cfg, data_dir, first, max_steps=14, log=lambda s: None)  # its checkpoint kept its optimizer state
    assert "rewarms" not in more
    assert [h["lr"] for h in more["history"]] == [lr_at(s, tc) for s in range(14)]


def test_a_finished_run_trains_no_more_steps(data_dir: Path, tmp_path: Path):  # noqa: F811
    """A run scheduled by minutes checked them only after a step: the same command run again after it finished
    trained one step more (and saved it) each time. Now it says so in one line and leaves the run as it was; so does
    a run at its config's max_steps."""
    cfg = tmp_path / "m.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=100_000, minutes=0.01,
                              warmup_steps=2, ckpt_interval=100_000, eval_interval=100_000))
    run = tmp_path / "run"
    done = train(cfg, data_dir, run, log=lambda s: None)
    assert done["seconds"] >= 0.6
    ckpt, log = (run / "ckpt.pt").read_bytes(), (run / "log.jsonl").read_text()
    logs: list[str] = []
    again = train(cfg, data_dir, run, log=logs.append)
    assert again["step"] == done["step"] and again["seconds"] == done["seconds"]
    assert logs == [f"{run} is finished: its 0.01 minutes of training are spent, at step {done['step']} (raise "
                    "`minutes` in the config to train on); nothing to train"]
    assert (run / "ckpt.pt").read_bytes() == ckpt and (run / "log.jsonl").read_text() == log
    assert [json.loads(line)["step"] for line in log.splitlines()] == list(range(1, done["step"] + 1))

    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=done["step"]))
    logs.clear()
    assert train(cfg, data_dir, run, log=logs.append)["step"] == done["step"]
    assert logs == [f"{run} is finished at step {done['step']}, the config's max_steps (raise it to train on); "
                    "nothing to train"]

"""The forty-sixth session's audit of training: licence expressions keep their parentheses, a corpus build stopped
part-way is never trained on, and what used to fail only after some training (a split shorter than one row, config
values such as eval_interval 0) is refused before the first step."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_training import data_dir, train_yaml  # noqa: F401 (fixtures)

from m31r.train import corpus as corpus_mod
from m31r.train.corpus import build_corpus, is_permissive
from m31r.train.trainer import load_train_config, require_data, train


@pytest.mark.parametrize(("expression", "permissive"), [
    ("GPL-2.0 AND (MIT OR Apache-2.0)", False),  # the GPL binds whichever of the two is taken
    ("(MIT OR Apache-2.0) AND GPL-3.0-only", False),
    ("MPL-2.0 AND (MIT OR Apache-2.0)", False),
    ("(MIT OR Apache-2.0) AND Unicode-DFS-2016", True),
    ("MIT AND Apache-2.0 WITH LLVM-exception AND (MIT OR Apache-2.0)", True),
    ("GPL-3.0 OR MIT AND BSD-3-Clause", True),  # AND binds tighter than OR
    ("MIT AND GPL-3.0 OR Zlib", True),
    ("MIT/Apache-2.0", True),
    ("mit or apache-2.0", True),
    ("GPL-2.0+", False),
    ("MIT)", False),  # malformed: not taken as permissive
    ("MIT OR", False),
])
def test_licence_expressions_follow_spdx_precedence(expression: str, permissive: bool) -> None:
    """Parentheses were dropped before splitting on OR, so `GPL-2.0 AND (MIT OR Apache-2.0)` read as
    `GPL-2.0 AND MIT` or `Apache-2.0`: permissive, and the crate's GPL code was trained on."""
    assert is_permissive(expression) is permissive


def test_a_crate_that_obliges_a_copyleft_licence_is_dropped(tmp_path: Path) -> None:
    root = tmp_path / "registry"
    for name, lic in (("mixed", "GPL-2.0 AND (MIT OR Apache-2.0)"), ("free", "MIT OR Apache-2.0")):
        crate = root / f"{name}-1.0.0"
        (crate / "src").mkdir(parents=True)
        (crate / "Cargo.toml").write_text(f'[package]\nname = "{name}"\nlicense = "{lic}"\n')
        (crate / "src" / "lib.rs").write_text(f"pub fn {name}_value(x: u32) -> u32 {{\n    x + 7\n}}\n")
    manifest = build_corpus([root], tmp_path / "out", val_fraction=0.0, packages={}, workers=1)
    assert manifest["dropped"] == {"non_permissive_license": 1}
    kept = [json.loads(line)["crate"] for line in (tmp_path / "out" / "train.jsonl").read_text().splitlines()]
    assert kept == ["free"]


def test_a_corpus_build_stopped_part_way_is_refused(data_dir: Path, tmp_path: Path,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A rebuild that stopped after writing train.jsonl (a full disk at val.jsonl) left the new training files beside
    the old held-out ones and the old dataset_version: another --val-fraction put held-out crates in training, and
    nothing said so. Training, the tokenizer and textbook commands refuse the folder until it is built again."""
    from m31r.cli_train import train as train_group

    data = tmp_path / "data"
    shutil.copytree(data_dir / "corpus", data / "corpus")
    shutil.copy(data_dir / "tokenizer.json", data / "tokenizer.json")
    src = data_dir.parent / "src" / "crate"
    real = corpus_mod._write_jsonl

    def disk_full_at_val(path: Path, docs: list) -> dict:
        if path.name == "val.jsonl":
            raise OSError(28, "No space left on device")
        return real(path, docs)

    monkeypatch.setattr(corpus_mod, "_write_jsonl", disk_full_at_val)
    with pytest.raises(OSError, match="No space"):
        build_corpus([src], data / "corpus", val_fraction=0.6, packages={}, workers=1)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="stopped part-way"):
        require_data(data)
    for args in (["tokenizer", str(data), "--reuse", str(data / "tokenizer.json")],
                 ["textbook", str(data), "--out", str(tmp_path / "tb")]):
        result = CliRunner().invoke(train_group, args)
        assert result.exit_code == 1 and "stopped part-way" in result.output, result.output
    assert not list((data / "corpus").glob("*.tmp"))  # each file is whole, the old or the new one
    build_corpus([src], data / "corpus", val_fraction=0.6, packages={}, workers=1)
    require_data(data)  # built again: accepted


def test_a_split_shorter_than_one_row_is_refused_before_the_first_step(data_dir: Path, tmp_path: Path  # noqa: F811
                                                                       ) -> None:
    """With an empty validation split (--val-fraction 0), the run trained eval_interval steps and then failed at its
    first eval with `empty range for randrange()`, before that step's checkpoint."""
    data = tmp_path / "data"
    shutil.copytree(data_dir / "corpus", data / "corpus")
    shutil.copy(data_dir / "tokenizer.json", data / "tokenizer.json")
    (data / "corpus" / "val.jsonl").write_text("")
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=4, eval_interval=2, ckpt_interval=4, model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    with pytest.raises(ValueError, match=r"val\.jsonl holds 0 tokens, fewer than the 130 .*--val-fraction"):
        train(cfg, data, run, log=lambda s: None)
    assert not (run / "log.jsonl").exists() and not (run / "ckpt.pt").exists()  # refused before any step


@pytest.mark.parametrize(("line", "says"), [
    ("eval_interval: 0", "eval_interval must be >= 1, not 0"),  # ZeroDivisionError after the first step
    ("ckpt_interval: 0", "ckpt_interval must be >= 1"),
    ("micro_batch: 0", "micro_batch must be >= 1"),  # range() step 0 at the first eval
    ("grad_accum: 0", "grad_accum must be >= 1"),  # trained nothing, silently
    ("grad_clip: 0.0", "grad_clip must be > 0"),  # every gradient clipped to zero, silently
    ("lr: .nan", "lr must be > 0, not nan"),
    ("fim_rate: 1.5", "fim_rate must be a share in [0, 1]"),
    ("dtype: fp16", "dtype must be auto, bfloat16 or float32"),
    ("context_schedule: [[0.0, 64], [0.8, 4096]]", "context_schedule stage [0.8, 4096]"),  # failed at 80% of the run
    ("model: [model.yaml", "not valid YAML"),
])
def test_config_values_that_failed_later_are_refused_at_load(data_dir: Path, tmp_path: Path,  # noqa: F811
                                                            line: str, says: str) -> None:
    shutil.copy(data_dir.parent / "model.yaml", tmp_path / "model.yaml")
    cfg = tmp_path / "t.yaml"
    cfg.write_text(line + "\n" if line.startswith("model:") else f"model: model.yaml\n{line}\n")
    with pytest.raises(ValueError) as e:
        load_train_config(cfg)
    assert str(e.value).startswith(f"{cfg}: ") and says in str(e.value), str(e.value)


def test_an_exponent_without_a_dot_is_a_number(data_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """YAML 1.1 reads `3e-4` as a string: `lr: 3e-4` was refused as "Expected `float`, got `str`"."""
    shutil.copy(data_dir.parent / "model.yaml", tmp_path / "model.yaml")
    cfg = tmp_path / "t.yaml"
    cfg.write_text("model: model.yaml\nlr: 3e-4\nmin_lr: 3e-5\n")
    tc, _ = load_train_config(cfg)
    assert (tc.lr, tc.min_lr) == (3e-4, 3e-5)


def test_a_run_started_again_logs_each_step_once(data_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """A run killed before its first checkpoint (device-train's retry without torch.compile starts again in the same
    folder) left log.jsonl records of steps the new run trains again: each was logged twice."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=2, eval_interval=100, model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    run.mkdir()
    (run / "log.jsonl").write_text("".join(json.dumps({"step": s, "lr": 1.0}) + "\n" for s in (1, 2, 3)))
    state = train(cfg, data_dir, run, log=lambda s: None)
    logged = [json.loads(line) for line in (run / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2] == [h["step"] for h in state["history"]]
    assert all(r["lr"] != 1.0 for r in logged)

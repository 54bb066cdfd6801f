"""The forty-sixth session's second audit of training: shards that do not hold the run's model are refused on import
with the tensors named, a textbook build stopped part-way is never trained on, a resume keeps the count of
non-finite steps and follows a changed weight_decay, and a sample's context snippets never come from its own file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file
from test_training import MODEL_YAML, crate_labelled, data_dir, train_yaml  # noqa: F401 (fixtures)

from m31r.config import ModelConfig
from m31r.model import Transformer, init_weights
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer
from m31r.train import textbook as textbook_mod
from m31r.train.samples import Neighbours
from m31r.train.shards import import_shards, write_shards
from m31r.train.trainer import Data, TrainingDiverged, require_data, train, write_checkpoint


def tiny_checkpoint(run: Path) -> Path:
    import yaml

    mc = msgspec.convert(yaml.safe_load(MODEL_YAML), ModelConfig)
    model = Transformer(mc)
    init_weights(model, 1)
    run.mkdir(parents=True)
    state = {"step": 3, "tokens": 768, "seconds": 1.0, "history": [], "model_config": mc.to_dict(), "train_config": {}}
    write_checkpoint(run / "ckpt.pt", {"model": model.state_dict(), "optimizer": None, "state": state})
    return run / "ckpt.pt"


def drop(shard: Path, name: str) -> None:
    tensors = load_file(str(shard))
    del tensors[name]
    save_file(tensors, str(shard))


def test_shards_that_do_not_hold_the_model_are_refused_naming_the_tensors(tmp_path: Path) -> None:
    """A folder whose shards lacked a tensor, or the last part of a split one (shards of two writes mixed), was
    imported; `train` then failed with torch's RuntimeError traceback (`Missing key(s)`, `size mismatch`)."""
    from m31r.cli import main

    ckpt = tiny_checkpoint(tmp_path / "run")
    files = write_shards(ckpt, tmp_path / "split", max_bytes=48_000)  # the embedding travels in two parts
    last_part = next(f for f in files if f.suffix == ".safetensors" and "tok_embeddings.weight@1" in load_file(str(f)))
    drop(last_part, "tok_embeddings.weight@1")
    with pytest.raises(ValueError, match=r"tok_embeddings\.weight has shape \[\d+, 64\], not \[512, 64\]"):
        import_shards(tmp_path / "split", tmp_path / "a")
    assert not (tmp_path / "a" / "ckpt.pt").exists()

    files = write_shards(ckpt, tmp_path / "whole")
    drop(files[0], "norm.weight")
    result = CliRunner().invoke(main, ["train", "import-shards", str(tmp_path / "whole"), "--run", str(tmp_path / "b")])
    assert result.exit_code == 1, result.output
    assert "norm.weight missing" in result.stderr and "Traceback" not in result.output
    assert not (tmp_path / "b" / "ckpt.pt").exists()

    files = write_shards(ckpt, tmp_path / "state")
    (tmp_path / "state" / "state.json").write_text('{"step": 3, "tok')  # cut short on the way
    with pytest.raises(ValueError, match=r"state\.json is not the JSON `m31r train shards` writes"):
        import_shards(tmp_path / "state", tmp_path / "c")
    write_shards(ckpt, tmp_path / "state")
    assert import_shards(tmp_path / "state", tmp_path / "c")["step"] == 3  # whole: imported


def test_a_textbook_build_stopped_part_way_is_refused(data_dir: Path, tmp_path: Path,  # noqa: F811
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """build_textbook wrote its folder in place: a rebuild stopped at the tokenizer (a full disk) left the new pieces
    beside the previous build's manifest and dataset_version, and training took the folder without a word."""
    out = tmp_path / "tb"
    first = textbook_mod.build_textbook(data_dir, out, seed=1)
    real = shutil.copyfile

    def disk_full_at_tokenizer(src: Path, dst: Path) -> Path:
        if Path(dst).name.startswith("tokenizer.json"):
            Path(dst).write_text("{")
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(textbook_mod.shutil, "copyfile", disk_full_at_tokenizer)
    with pytest.raises(OSError, match="No space"):
        textbook_mod.build_textbook(data_dir, out, seed=2)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="stopped part-way"):
        require_data(out)
    assert not list(out.rglob("*.tmp"))  # each file whole: the old one or the new one
    assert json.loads((out / "corpus" / "manifest.json").read_text()) == first
    again = textbook_mod.build_textbook(data_dir, out, seed=2)
    require_data(out)  # built again: accepted
    assert again["dataset_version"] != first["dataset_version"]


def diverging_config(data_dir: Path, tmp_path: Path) -> Path:  # noqa: F811
    """An lr so large that the first step's update overflows the model: every later gradient is NaN."""
    cfg = tmp_path / "diverge.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), lr=1e30, min_lr=1e29, warmup_steps=0,
                              eval_interval=100_000, ckpt_interval=100_000))
    return cfg


def test_a_resumed_run_stops_on_divergence_where_an_uninterrupted_one_does(data_dir: Path,  # noqa: F811
                                                                           tmp_path: Path) -> None:
    """The count of steps in a row with a non-finite gradient was not in the checkpoint: a run resumed in such a
    streak trained SKIP_LIMIT more steps before it stopped, and reported other steps than an uninterrupted one."""
    cfg = diverging_config(data_dir, tmp_path)
    with pytest.raises(TrainingDiverged) as whole:
        train(cfg, data_dir, tmp_path / "whole", log=lambda s: None)
    assert "steps 2 to 9 all had a gradient that is not finite" in str(whole.value)
    logs: list[str] = []
    state = train(cfg, data_dir, tmp_path / "resumed", max_steps=5, log=logs.append)  # checkpoint at step 5
    assert state["skipped_in_a_row"] == 4 and sum("not finite" in m for m in logs) == 4
    with pytest.raises(TrainingDiverged) as resumed:
        train(cfg, data_dir, tmp_path / "resumed", log=lambda s: None)
    said = str(resumed.value)
    assert said.split(";")[0] == str(whole.value).split(";")[0] and said.endswith("ckpt.pt of step 5 is kept")


def test_a_resume_follows_a_changed_weight_decay(data_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """The optimizer's saved groups brought back the run's first weight_decay: the state recorded the config's new
    value from the resume on, and the run trained on with the old one (bit for bit an unchanged run)."""
    model = str(data_dir.parent / "model.yaml")
    before, after = tmp_path / "wd01.yaml", tmp_path / "wd05.yaml"
    before.write_text(train_yaml(model=model, weight_decay=0.1, eval_interval=100_000))
    after.write_text(train_yaml(model=model, weight_decay=0.5, eval_interval=100_000))
    train(before, data_dir, tmp_path / "changed", max_steps=2, log=lambda s: None)
    state = train(after, data_dir, tmp_path / "changed", max_steps=4, log=lambda s: None)
    assert state["config_changes"] == [{"step": 2, "changed": {"weight_decay": [0.1, 0.5]}}]
    train(before, data_dir, tmp_path / "kept", max_steps=4, log=lambda s: None)
    changed = torch.load(tmp_path / "changed" / "ckpt.pt", weights_only=False)
    kept = torch.load(tmp_path / "kept" / "ckpt.pt", weights_only=False)
    assert [g["weight_decay"] for g in changed["optimizer"]["param_groups"]] == [0.5, 0.0]
    decayed = [k for k, v in kept["model"].items() if v.dim() >= 2]
    assert all(not torch.equal(kept["model"][k], changed["model"][k]) for k in decayed)


def test_context_snippets_never_come_from_the_samples_own_file() -> None:
    """A textbook piece's path is its source file's (`src/a.rs#function1`, read as src/a.rs): the file itself, and
    its other pieces, were drawn as its neighbours, so the snippets held the piece's middle verbatim."""
    import random

    piece = "/// Doubles.\nfn double(x: u32) -> u32 {\n    x * 2\n}\n"
    texts = [piece, piece + "\nfn other() {}\n", "fn other() {}\n", "fn b() -> u8 {\n    1\n}\n"]
    a, b = "registry/c-1.0.0/src/a.rs", "registry/c-1.0.0/src/b.rs"
    nb = Neighbours([a, a, a, b], ["c"] * 4)
    for i in range(3):
        assert [p for p, _ in nb.of(i, texts, random.Random(0))] == ["src/b.rs"]
    assert sorted(p for p, _ in nb.of(3, texts, random.Random(0))) == ["src/a.rs"] * 3


def test_textbook_pieces_get_no_snippets_of_their_source_file(data_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    """End to end: a textbook folder of one crate (every whole file in it, plain_share large), read as training reads
    it with context_fim: no piece's snippets include a window found only in its own source file."""
    import random

    from m31r_protocol.context import windows

    labelled = crate_labelled(data_dir, tmp_path / "data")
    textbook_mod.build_textbook(labelled, tmp_path / "tb", plain_share=100.0)
    docs = [json.loads(line) for line in (tmp_path / "tb" / "corpus" / "train.jsonl").read_text().splitlines()]
    tok = Tokenizer.from_file(tmp_path / "tb" / "tokenizer.json", DEFAULT_SPECIAL)
    data = Data(tok, tmp_path / "tb", 128, 1.0, 0.0, 1.0)
    nb, texts = data.neighbours["train"], data.texts["train"]
    nb.files = len(texts)  # every other file of the crate, not a draw of 16
    whole = {d["path"]: d["text"] for d in docs if "#" not in d["path"]}
    seen_in = {}
    for path, text in whole.items():
        for w in windows(text):
            seen_in.setdefault(w.text, set()).add(path)
    checked = 0
    for i, d in enumerate(docs):
        source = d["path"].partition("#")[0]
        if "#" not in d["path"] or source not in whole:
            continue
        own = {w.text for w in windows(whole[source]) if seen_in[w.text] == {source}}
        drawn = {w.text for _, ws in nb.of(i, texts, random.Random(i)) for w in ws}
        assert own and not own & drawn, d["path"]
        checked += 1
    assert checked >= 10

"""import-hf / export-hf on checkpoints that used to convert silently into something else, or fail naming the wrong
file: non-finite or out-of-range weights, sharded checkpoints with a shard missing or a stale copy beside them,
quantized checkpoints, an end token named only by config.json, and a tokenizer misfit. Tiny exports of the session's
tiny bundle, damaged per test."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from m31r.bundle import Bundle, BundleError, load_weights, open_bundle, write_bundle
from m31r.cli import main
from m31r.hf_export import export_hf
from m31r.hf_import import import_hf

UP = "model.layers.0.mlp.up_proj.weight"


def _checkpoint(bundle: Bundle, tmp: Path, name: str = "hf") -> Path:
    return export_hf(bundle, tmp / name)


def _edit_config(hf: Path, **changes: object) -> None:
    f = hf / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))


def _edit_weights(f: Path, **tensors: torch.Tensor) -> None:
    save_file({**load_file(f), **tensors}, str(f), metadata={"format": "pt"})


def _cli_refuses(args: list[str], out: Path, *message: str) -> str:
    """`m31r bundle ARGS` fails with one `error:` line holding each of `message` and leaves no OUT."""
    result = CliRunner().invoke(main, ["bundle", *args])
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    for m in message:
        assert m in result.stderr, result.stderr
    assert not out.exists()
    return result.stderr


# -- weights that are not finite numbers, or not in the bundle's dtype's range ----------------------------------------


def test_import_refuses_nan_weights_naming_the_tensor(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A checkpoint holding a NaN imported 'ok', into a bundle every load then refused ("restore the bundle")."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    up = load_file(hf / "model.safetensors")[UP]
    up[3, 5] = float("nan")
    _edit_weights(hf / "model.safetensors", **{UP: up})
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, f"{hf / 'model.safetensors'}: tensor {UP} holds 1 NaN")


def test_import_refuses_weights_that_overflow_the_named_dtype(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """float32 weights past 65504 in a checkpoint whose config.json names float16 became infinities in the bundle."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    up = load_file(hf / "model.safetensors")[UP]
    up[0, 0] = 1e6
    _edit_weights(hf / "model.safetensors", **{UP: up})
    _edit_config(hf, dtype="float16", torch_dtype="float16")
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, f"tensor {UP} has values beyond float16's range")
    _edit_config(hf, dtype="float32", torch_dtype="float32")  # the way out the message gives
    assert load_weights(import_hf(hf, out))["layers.0.feed_forward.w13.weight"].max().item() == 1e6


def test_export_refuses_float16_overflow_and_writes_nothing(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """`export-hf --dtype float16` of a weight past float16's range wrote an infinity (NaN logits in transformers)."""
    sd = {k: v.clone() for k, v in load_weights(tiny_bundle).items()}
    sd["layers.1.feed_forward.w2.weight"][2, 7] = -(2.0**17)
    big = write_bundle(tmp_path / "big", tiny_bundle.config, sd, tiny_bundle.tokenizer, dtype=torch.float32,
                       seed=0, dataset_version="test")
    out = tmp_path / "hf"
    _cli_refuses(["export-hf", str(big.path), str(out), "--dtype", "float16"], out,
                 "tensor model.layers.1.mlp.down_proj.weight has values beyond float16's range")
    with pytest.raises(BundleError, match="beyond float16's range"):
        export_hf(big, out, dtype="float16")
    assert not out.exists()  # (the API too: nothing written before the check)
    hf = export_hf(big, out, dtype="bfloat16")
    assert load_file(hf / "model.safetensors")["model.layers.1.mlp.down_proj.weight"][2, 7].item() == -(2.0**17)


# -- sharded checkpoints ----------------------------------------------------------------------------------------------


def _shard(hf: Path, index: bool = True) -> list[Path]:
    """Split hf's model.safetensors into two shards (and their index, with `index`), as transformers names them."""
    sd = load_file(hf / "model.safetensors")
    (hf / "model.safetensors").unlink()
    names = sorted(sd)
    halves = {f"model-0000{i + 1}-of-00002.safetensors": part for i, part in enumerate((names[:9], names[9:]))}
    for file, part in halves.items():
        save_file({k: sd[k] for k in part}, str(hf / file), metadata={"format": "pt"})
    if index:
        weight_map = {k: file for file, part in halves.items() for k in part}
        (hf / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return [hf / f for f in halves]


def test_sharded_checkpoint_imports_the_same_weights(tiny_bundle: Bundle, tmp_path: Path) -> None:
    hf = _checkpoint(tiny_bundle, tmp_path)
    _shard(hf)
    back = import_hf(hf, tmp_path / "back")
    a, b = load_weights(tiny_bundle), load_weights(back)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_missing_shard_is_named(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """An interrupted download lacking a shard was told `tensor model.norm.weight is missing from the checkpoint`."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    second = _shard(hf)[1]
    second.unlink()
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out,
                 f"{second}: missing; model.safetensors.index.json lists it as the shard holding")


def test_stale_single_file_beside_shards_is_refused(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A model.safetensors left beside newer shards was read last (`model.` sorts after `model-`), and its tensors
    silently replaced the shards' ones."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    stale = load_file(hf / "model.safetensors")
    _shard(hf)
    save_file({**stale, "model.norm.weight": torch.full_like(stale["model.norm.weight"], 7.0)},
              str(hf / "model.safetensors"))
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, "holds both model.safetensors and the shards")


def test_one_tensor_in_two_files_is_refused(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """Without an index, a tensor two files hold was taken from whichever sorted last."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    norm = 2 * load_file(hf / "model.safetensors")["model.norm.weight"]
    shards = _shard(hf, index=False)
    other = next(f for f in shards if "model.norm.weight" not in load_file(f))  # a second, different copy
    save_file({**load_file(other), "model.norm.weight": norm}, str(other))
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, "holds tensor model.norm.weight, which", "holds too")


def test_shard_contradicting_its_index_is_refused(tiny_bundle: Bundle, tmp_path: Path) -> None:
    hf = _checkpoint(tiny_bundle, tmp_path)
    _shard(hf)
    index = hf / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    moved = next(k for k, v in data["weight_map"].items() if v.startswith("model-00001"))
    data["weight_map"][moved] = "model-00002-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(BundleError, match=f"holds tensor {moved}, which model.safetensors.index.json places in"):
        import_hf(hf, tmp_path / "out")


# -- quantized checkpoints ---------------------------------------------------------------------------------------------


def test_quantized_checkpoint_is_refused_by_name(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A config.json with quantization_config imported as if its weights were plain floats."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    _edit_config(hf, quantization_config={"quant_method": "fp8", "activation_scheme": "dynamic"})
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, "config.json: quantized weights (quantization_config, "
                 "quant_method 'fp8') are not supported")


def test_integer_codes_are_not_taken_for_weights(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """An int8 tensor of a weight's shape was cast to float: codes without their scales, silently a different model."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    up = load_file(hf / "model.safetensors")[UP]
    _edit_weights(hf / "model.safetensors", **{UP: (up * 100).to(torch.int8)})
    with pytest.raises(BundleError, match=f"tensor {UP} is I8, not float weights"):
        import_hf(hf, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# -- the tokenizer ----------------------------------------------------------------------------------------------------


def _rename_token(hf: Path, old: str, new: str) -> None:
    f = hf / "tokenizer.json"
    tok = json.loads(f.read_text())
    for added in tok["added_tokens"]:
        if added["content"] == old:
            added["content"] = new
    vocab = tok["model"]["vocab"]
    if isinstance(vocab, dict) and old in vocab:
        vocab[new] = vocab.pop(old)
    f.write_text(json.dumps(tok))


def test_end_token_from_config_json(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """Without tokenizer_config.json, the end token is config.json's eos_token_id (here `</s>`): it was always
    `<|endoftext|>`, refused (naming the half-written bundle's tokenizer.json) where the tokenizer has none."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    eos_id = json.loads((hf / "config.json").read_text())["eos_token_id"]
    (hf / "tokenizer_config.json").unlink()
    _rename_token(hf, "<|endoftext|>", "</s>")
    b = import_hf(hf, tmp_path / "back")
    assert b.config.eos_token == "</s>" and b.tokenizer.token_to_id("</s>") == eos_id
    _edit_config(hf, eos_token_id=None)  # none named anywhere: the checkpoint's tokenizer.json is named
    out = tmp_path / "none"
    _cli_refuses(["import-hf", str(hf), str(out)], out, f"{hf / 'tokenizer.json'}: no end-of-text token")


def test_tokenizer_misfit_names_the_checkpoints_file(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """A tokenizer without its decoder was refused as `OUT/tokenizer.json: ...`, a file the failed import removed."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    tok = json.loads((hf / "tokenizer.json").read_text())
    tok["decoder"] = None
    (hf / "tokenizer.json").write_text(json.dumps(tok))
    out = tmp_path / "out"
    _cli_refuses(["import-hf", str(hf), str(out)], out, f"error: {hf / 'tokenizer.json'}: decodes ")


def test_fim_tokens_keep_their_ids_both_ways(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """Export then import: each special token keeps its text and id, and the shipped tokenizer encodes the same."""
    hf = _checkpoint(tiny_bundle, tmp_path)
    back = import_hf(hf, tmp_path / "back")
    # Both as open_bundle gives them, fresh: the session's tiny_bundle.tokenizer is shared, and a Tokenizer built on it
    # elsewhere set its encode_special_tokens, which decides how the markers' text below encodes.
    a, b = open_bundle(tiny_bundle.path).tokenizer, open_bundle(back.path).tokenizer
    for role, text in tiny_bundle.config.special_tokens.items():
        assert getattr(back.config, role) == text and b.token_to_id(text) == a.token_to_id(text) is not None
    text = "<|fim_prefix|>fn a() {<|fim_suffix|>}\n<|fim_middle|>"
    for flag in (False, True):  # the markers matched, and (as a Tokenizer encodes user text) read as text
        a.encode_special_tokens = b.encode_special_tokens = flag
        assert b.encode(text).ids == a.encode(text).ids
    shutil.rmtree(hf)

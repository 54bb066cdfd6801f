"""The release bundle: every fault is refused with an error naming the file, and `bundle init` is reproducible."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from m31r.bundle import CHECKSUM_FILE, CONTENT_FILES, Bundle, BundleError, load_weights, open_bundle, sha256_file
from m31r.cli import main
from m31r.model import Transformer, init_weights
from m31r.tokenizer import build_byte_tokenizer

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "configs" / "model" / "tiny.yaml"


@pytest.fixture
def bundle_dir(tiny_bundle: Bundle, tmp_path: Path) -> Path:
    """A private copy of the session's tiny bundle, free to corrupt."""
    return Path(shutil.copytree(tiny_bundle.path, tmp_path / "bundle"))


def _rewrite_checksums(d: Path) -> None:
    """What a careless hand edit followed by a checksum refresh produces: checksums pass, content is wrong."""
    (d / CHECKSUM_FILE).write_text("".join(f"{sha256_file(d / n)}  {n}\n" for n in CONTENT_FILES))


def _flip(path: Path, offset: int, mask: int = 0x01) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


def _sha256sum_ok(d: Path) -> bool:
    return subprocess.run(["sha256sum", "--quiet", "-c", CHECKSUM_FILE], cwd=d, capture_output=True).returncode == 0


def test_good_bundle_opens_and_passes_coreutils(bundle_dir: Path) -> None:
    b = open_bundle(bundle_dir)
    assert b.config.name == "m31r-tiny" and b.model_id == "m31r-tiny@0.0.0-random"
    assert b.metadata["parameter_count"] == b.config.param_count() == 106_816
    assert b.metadata["config_hash"] == b.config.config_hash()
    assert b.metadata["tokenizer_hash"] == sha256_file(bundle_dir / "tokenizer.json")
    assert re.fullmatch(r"[0-9a-f]{16}", b.fingerprint)
    assert sorted(p.name for p in bundle_dir.iterdir()) == sorted((*CONTENT_FILES, CHECKSUM_FILE))
    assert _sha256sum_ok(bundle_dir)


@pytest.mark.parametrize("name", CONTENT_FILES)
def test_flipped_byte_in_a_content_file(bundle_dir: Path, name: str) -> None:
    f = bundle_dir / name
    _flip(f, f.stat().st_size // 2)
    with pytest.raises(BundleError, match=rf"{re.escape(str(f))}: checksum mismatch"):
        open_bundle(bundle_dir)
    assert not _sha256sum_ok(bundle_dir)  # coreutils agrees


def test_flipped_byte_in_checksum_file(bundle_dir: Path) -> None:
    f = bundle_dir / CHECKSUM_FILE
    _flip(f, 0, 0x40)  # a hex digit becomes a non-hex character (0x20 only changes its case)
    with pytest.raises(BundleError, match=rf"{re.escape(str(f))}: line 1 is not"):
        open_bundle(bundle_dir)
    _flip(f, 0, 0x40)
    _flip(f, f.read_text().index("config.yaml"))  # the file name itself
    with pytest.raises(BundleError, match=rf"{re.escape(str(f))}: must list exactly"):
        open_bundle(bundle_dir)


def test_checksum_digit_changed_names_the_listed_file(bundle_dir: Path) -> None:
    f = bundle_dir / CHECKSUM_FILE
    line = f.read_text().splitlines()[2]
    assert line.endswith("config.yaml")
    digit = line[5]
    f.write_text(f.read_text().replace(line, line[:5] + ("0" if digit != "0" else "1") + line[6:]))
    with pytest.raises(BundleError, match=r"config\.yaml: checksum mismatch"):
        open_bundle(bundle_dir)


@pytest.mark.parametrize("name", [*CONTENT_FILES, CHECKSUM_FILE])
def test_missing_file(bundle_dir: Path, name: str) -> None:
    (bundle_dir / name).unlink()
    with pytest.raises(BundleError, match=rf"{re.escape(name)}: missing"):
        open_bundle(bundle_dir)


def test_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not a bundle directory"):
        open_bundle(tmp_path / "nope")


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("n_layers: 2", "n_layers: 3", r"6 tensors missing for config\.yaml, e\.g\. layers\.2\."),
        ("n_layers: 2", "n_layers: 1", r"unexpected tensor layers\.1\."),
        ("ffn_hidden: 128", "ffn_hidden: 96",
         r"tensor layers\.0\.feed_forward\.w13\.weight has shape \[256, 64\], config\.yaml implies \[192, 64\]"),
    ],
)
def test_config_weights_mismatch_names_the_tensor(bundle_dir: Path, old: str, new: str, expected: str) -> None:
    cfg = bundle_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace(old, new))
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=rf"model\.safetensors: {expected}"):
        open_bundle(bundle_dir)


def test_invalid_config_names_the_field(bundle_dir: Path) -> None:
    cfg = bundle_dir / "config.yaml"
    cfg.write_text(cfg.read_text() + "dropout: 0.1\n")
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"config\.yaml.*dropout"):
        open_bundle(bundle_dir)


def test_tokenizer_size_differs_from_vocab_size(bundle_dir: Path) -> None:
    build_byte_tokenizer(400).save(str(bundle_dir / "tokenizer.json"))
    _rewrite_checksums(bundle_dir)
    expected = r"tokenizer\.json: tokenizer has 400 tokens but config\.yaml vocab_size is 384"
    with pytest.raises(BundleError, match=expected):
        open_bundle(bundle_dir)


def test_tokenizer_smaller_than_vocab_size_is_accepted(bundle_dir: Path) -> None:
    """Imported checkpoints pad the embedding beyond the tokenizer; an id the tokenizer has must still have a row."""
    build_byte_tokenizer(300).save(str(bundle_dir / "tokenizer.json"))
    meta = json.loads((bundle_dir / "metadata.json").read_text())
    meta["tokenizer_hash"] = sha256_file(bundle_dir / "tokenizer.json")
    (bundle_dir / "metadata.json").write_text(json.dumps(meta))
    _rewrite_checksums(bundle_dir)
    assert open_bundle(bundle_dir).config.vocab_size == 384
    f = bundle_dir / "tokenizer.json"
    data = json.loads(f.read_text())
    data["model"]["vocab"]["<|reserved_0|>"] = 384  # a gap at 261, an id past the embedding
    f.write_text(json.dumps(data))
    meta["tokenizer_hash"] = sha256_file(f)
    (bundle_dir / "metadata.json").write_text(json.dumps(meta))
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"tokenizer\.json: tokenizer id 384 is past config\.yaml vocab_size 384"):
        open_bundle(bundle_dir)


def test_tokenizer_missing_a_special_token(bundle_dir: Path) -> None:
    f = bundle_dir / "tokenizer.json"
    f.write_text(f.read_text().replace("<|fim_middle|>", "<|fim_mid|>"))  # same size, one special renamed
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"tokenizer\.json: special token '<\|fim_middle\|>' \(fim_middle_token"):
        open_bundle(bundle_dir)


def test_metadata_missing_keys(bundle_dir: Path) -> None:
    f = bundle_dir / "metadata.json"
    meta = json.loads(f.read_text())
    del meta["training_seed"], meta["config_hash"]
    f.write_text(json.dumps(meta))
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"metadata\.json: missing keys config_hash, training_seed"):
        open_bundle(bundle_dir)


def test_weights_round_trip_in_bf16(tiny_config, tmp_path: Path) -> None:
    """load_weights maps exactly what init wrote, in the storage dtype."""
    from m31r.bundle import init_bundle

    b = init_bundle(tiny_config, tmp_path / "b", seed=4, dtype=torch.bfloat16)
    model = Transformer(tiny_config)
    init_weights(model, 4)
    loaded = load_weights(b)
    assert set(loaded) == set(model.state_dict())
    for name, t in model.state_dict().items():
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], t.to(torch.bfloat16)), name


# -- the CLI --------------------------------------------------------------------------------------------------


def test_cli_verify_ok(tiny_bundle: Bundle) -> None:
    result = CliRunner().invoke(main, ["bundle", "verify", str(tiny_bundle.path)])
    assert result.exit_code == 0, result.output
    assert result.stdout.count("\n") == 1
    assert "m31r-tiny@0.0.0-random" in result.stdout and "float32" in result.stdout
    assert tiny_bundle.fingerprint in result.stdout


def test_cli_verify_failure_is_one_line_on_stderr(bundle_dir: Path) -> None:
    """A real process: exit status 1, one `error:` line on stderr, no traceback, nothing on stdout."""
    _flip(bundle_dir / "model.safetensors", 100)
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "bundle", "verify", str(bundle_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "model.safetensors: checksum mismatch" in proc.stderr


def test_cli_init_is_deterministic(tmp_path: Path) -> None:
    runner = CliRunner()
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        result = runner.invoke(main, ["bundle", "init", str(TINY), str(tmp_path / name), "--seed", str(seed),
                                      "--dtype", "float32"])
        assert result.exit_code == 0, result.output
    weights = {n: (tmp_path / n / "model.safetensors").read_bytes() for n in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]
    for f in ("tokenizer.json", "config.yaml"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "c" / f).read_bytes()
    meta = json.loads((tmp_path / "a" / "metadata.json").read_text())
    assert meta["dtype"] == "float32" and meta["training_seed"] == 7


def test_cli_init_defaults_to_bf16_and_takes_a_tokenizer(tmp_path: Path) -> None:
    tok = tmp_path / "tok.json"
    build_byte_tokenizer(384).save(str(tok))
    result = CliRunner().invoke(main, ["bundle", "init", str(TINY), str(tmp_path / "b"), "--seed", "0",
                                       "--tokenizer", str(tok)])
    assert result.exit_code == 0, result.output
    assert open_bundle(tmp_path / "b").metadata["dtype"] == "bfloat16"


def _init_fails(tmp_path: Path, *args: str) -> str:
    """Run `bundle init` expecting a one-line user error; return stderr."""
    result = CliRunner().invoke(main, ["bundle", "init", *args])
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    return result.stderr


def test_cli_init_refuses_wrong_size_tokenizer(tmp_path: Path) -> None:
    tok = tmp_path / "tok400.json"
    build_byte_tokenizer(400).save(str(tok))
    assert "tokenizer has 400 tokens" in _init_fails(tmp_path, str(TINY), str(tmp_path / "o"), "--seed", "0",
                                                     "--tokenizer", str(tok))
    assert not (tmp_path / "o").exists()  # no half-written bundle left behind
    (tmp_path / "empty").mkdir()
    _init_fails(tmp_path, str(TINY), str(tmp_path / "empty"), "--seed", "0", "--tokenizer", str(tok))
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_cli_init_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("not a bundle")
    assert "already exists" in _init_fails(tmp_path, str(TINY), str(tmp_path), "--seed", "0")
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_cli_init_bad_config_names_the_field(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(TINY.read_text().replace("n_heads: 4", "n_heads: 5"))
    err = _init_fails(tmp_path, str(cfg), str(tmp_path / "out"), "--seed", "0")
    assert "d_model" in err and "n_heads" in err
    assert not (tmp_path / "out").exists()


def test_cli_module_does_not_import_torch() -> None:
    """Daemon clients share this entry point and must start in milliseconds."""
    code = "import sys, m31r.cli; assert not {'torch', 'm31r.bundle', 'm31r.engine'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_config_edited_after_export_fails_the_traceability_check(bundle_dir: Path) -> None:
    """A valid edit (same shapes) with a re-signed checksum still contradicts metadata.json's config_hash."""
    cfg = bundle_dir / "config.yaml"
    cfg.write_text(cfg.read_text().replace("rope_theta: 10000.0", "rope_theta: 500000.0"))
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"config\.yaml: does not match config_hash"):
        open_bundle(bundle_dir)


# -- averaging (`m31r bundle average`) -------------------------------------------------------------------------


# 5e307 + 1.5e308 overflows to inf: divided by that sum, every weight was 0 and the model all zeros.
@pytest.mark.parametrize("weights", ["1,3", "5e307,1.5e308"])
def test_cli_average_is_the_weighted_mean_with_its_sources_named(tiny_config, tmp_path: Path, weights: str) -> None:
    from m31r.bundle import init_bundle

    a = init_bundle(tiny_config, tmp_path / "a", seed=1, dtype=torch.float32)
    b = init_bundle(tiny_config, tmp_path / "b", seed=2, dtype=torch.float32)
    out = tmp_path / "avg"
    result = CliRunner().invoke(main, ["bundle", "average", str(a.path), str(b.path), "--out", str(out),
                                       "--weights", weights, "--model-version", "0.2.0-avg"])
    assert result.exit_code == 0, result.output
    avg = open_bundle(out)
    wa, wb, wm = load_weights(a), load_weights(b), load_weights(avg)
    for name in wa:
        assert torch.allclose(wm[name], 0.25 * wa[name] + 0.75 * wb[name], atol=1e-6), name
    assert not torch.equal(wm["tok_embeddings.weight"], wa["tok_embeddings.weight"])
    meta = avg.metadata
    assert meta["model_version"] == "0.2.0-avg" and meta["dtype"] == "float32"
    assert [(p["fingerprint"], p["weight"]) for p in meta["averaged_from"]] == [(a.fingerprint, 0.25),
                                                                               (b.fingerprint, 0.75)]
    json.loads((out / "metadata.json").read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))


def test_cli_average_refuses_other_shapes_and_quantized_bundles(tiny_config, tmp_path: Path) -> None:
    import msgspec

    from m31r.bundle import init_bundle, quantize_bundle

    a = init_bundle(tiny_config, tmp_path / "a", seed=1, dtype=torch.float32)
    wide = msgspec.structs.replace(tiny_config, n_layers=tiny_config.n_layers + 1)
    b = init_bundle(wide, tmp_path / "b", seed=2, dtype=torch.float32)
    q = quantize_bundle(a.path, tmp_path / "q", "int8")
    runner = CliRunner()
    for other, expected in ((b, "its config differs"), (q, "quantized (int8)")):
        out = tmp_path / f"out-{other.path.name}"
        result = runner.invoke(main, ["bundle", "average", str(a.path), str(other.path), "--out", str(out),
                                      "--model-version", "x"])
        assert result.exit_code == 1, result.output
        assert expected in result.stderr and result.stderr.count("\n") == 1
        assert not out.exists()
    result = runner.invoke(main, ["bundle", "average", str(a.path), str(a.path), "--out", str(tmp_path / "w"),
                                  "--weights", "1,-1", "--model-version", "x"])
    assert result.exit_code == 2 and "non-negative" in result.stderr  # a usage error


# -- weights that cannot load, metadata of the wrong type ------------------------------------------------------


def _rewrite_weights(d: Path, edit) -> None:
    """Rewrite model.safetensors through `edit(header, data) -> (header, data)`, then re-sign the bundle: only the
    structural checks can catch what follows."""
    import struct

    f = d / "model.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header, data = edit(json.loads(raw[8:8 + n]), raw[8 + n:])
    head = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(head)) + head + data)
    _rewrite_checksums(d)


def _first(header: dict) -> str:
    return min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])


def _set(header: dict, name: str, key: str, value: object) -> dict:
    header[name][key] = value
    return header


WEIGHT_FAULTS = {
    "header is a list": (lambda h, d: ([1, 2], d), r"safetensors header must be a JSON object, not list"),
    "entry is a string": (lambda h, d: ({**h, _first(h): "x"}, d), r"header entry \S+ must be an object"),
    "no data_offsets": (lambda h, d: ({**h, _first(h): {k: v for k, v in h[_first(h)].items()
                                                          if k != "data_offsets"}}, d),
                        r"has data_offsets None, not \[begin, end\]"),
    "shape not a list": (lambda h, d: (_set(h, _first(h), "shape", "64x64"), d), r"has shape '64x64', not a list"),
    "unknown dtype": (lambda h, d: (_set(h, _first(h), "dtype", "F64"), d), r"unsupported dtype 'F64'"),
    "span too short": (lambda h, d: (_set(h, _first(h), "data_offsets", [0, 4]), d),
                       r"spans 4 bytes but its shape \[\d+(, \d+)*\] of F32 needs \d+"),
    "span past the end": (lambda h, d: (_set(h, _first(h), "data_offsets", [0, 4 * len(d)]), d),
                          r"spans \d+ bytes but its shape"),
    "truncated data": (lambda h, d: (h, d[: len(d) // 2]), r"the tensors cover \d+ bytes of data but the file holds "
                                                          r"\d+ after the header \(truncated\)"),
    "trailing bytes": (lambda h, d: (h, d + b"\0" * 64), r"\(trailing bytes\)"),
    "overlap": (lambda h, d: (_set(h, "norm.weight", "data_offsets", h["layers.0.ffn_norm.weight"]["data_offsets"]), d),
                r"overlaps the tensor before it|leaves a gap"),
}


@pytest.mark.parametrize("fault", list(WEIGHT_FAULTS))
def test_weights_that_cannot_load_are_refused(bundle_dir: Path, fault: str) -> None:
    """Checksums pass (the bundle was re-signed), shapes and names still match the config: only the header's own
    consistency shows that these weights would map wrong or not at all."""
    edit, message = WEIGHT_FAULTS[fault]
    _rewrite_weights(bundle_dir, edit)
    with pytest.raises(BundleError, match=r"model\.safetensors: .*(" + message + ")"):
        open_bundle(bundle_dir)


def test_weights_header_that_is_not_an_object_is_one_line_from_the_cli(bundle_dir: Path) -> None:
    _rewrite_weights(bundle_dir, WEIGHT_FAULTS["header is a list"][0])
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "bundle", "verify", str(bundle_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == (f"error: {bundle_dir / 'model.safetensors'}: the safetensors header must be a JSON object, "
                           f"not list\n")


def test_quantized_bundles_still_verify(tiny_bundle: Bundle, tmp_path: Path) -> None:
    """The header checks hold for what quantize writes (int8 codes, int4 packed codes, zero-padding-free layout)."""
    from m31r.bundle import quantize_bundle

    for method in ("int8", "int4"):
        q = quantize_bundle(tiny_bundle.path, tmp_path / method, method, 32)
        assert open_bundle(q.path).quantization["method"] == method
        assert load_weights(q).keys()


METADATA_FAULTS = {
    "parameter_count": ("many", r"parameter_count must be a non-negative integer, got 'many'"),
    "training_seed": (1.5, r"training_seed must be an integer, got 1\.5"),
    "format_version": (True, r"format_version must be a non-negative integer, got True"),
    "dtype": ("int8", r"dtype must be one of float32, float16, bfloat16 .*got 'int8'"),
    "model_name": (7, r"model_name must be a non-empty string, got 7"),
    "model_version": ("", r"model_version must be a non-empty string, got ''"),
    "created": (None, r"created must be a string, got None"),
}


@pytest.mark.parametrize("key", list(METADATA_FAULTS))
def test_metadata_of_the_wrong_type_names_the_field(bundle_dir: Path, key: str) -> None:
    value, message = METADATA_FAULTS[key]
    f = bundle_dir / "metadata.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), key: value}))
    _rewrite_checksums(bundle_dir)
    with pytest.raises(BundleError, match=r"metadata\.json: " + message):
        open_bundle(bundle_dir)


@pytest.mark.parametrize("content", ["5", "[1, 2]", '"text"'])
def test_metadata_that_is_not_an_object_is_one_line_from_the_cli(bundle_dir: Path, content: str) -> None:
    (bundle_dir / "metadata.json").write_text(content)
    _rewrite_checksums(bundle_dir)
    proc = subprocess.run([sys.executable, "-m", "m31r.cli", "bundle", "verify", str(bundle_dir)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stdout == ""
    kind = type(json.loads(content)).__name__
    assert proc.stderr == f"error: {bundle_dir / 'metadata.json'}: must be a JSON object, not {kind}\n"


def test_cli_average_refuses_weights_that_are_not_finite(tiny_config, tmp_path: Path) -> None:
    """inf/inf is NaN: `--weights inf,1` wrote an all-NaN model with NaN in metadata.json (not JSON)."""
    from m31r.bundle import init_bundle

    a = init_bundle(tiny_config, tmp_path / "a", seed=1, dtype=torch.float32)
    b = init_bundle(tiny_config, tmp_path / "b", seed=2, dtype=torch.float32)
    runner = CliRunner()
    for weights in ("inf,1", "nan,1", "1,-inf", "0,0"):
        out = tmp_path / f"out-{weights}"
        result = runner.invoke(main, ["bundle", "average", str(a.path), str(b.path), "--out", str(out),
                                      "--weights", weights, "--model-version", "x"])
        assert result.exit_code == 2, (weights, result.output)  # a usage error, before any bundle is read
        assert "Invalid value for '--weights'" in result.stderr, result.stderr
        assert "weights must be finite, non-negative numbers" in result.stderr
        assert not out.exists()


@pytest.mark.parametrize("fault", ["flipped byte", "missing file"])
def test_a_damaged_bundle_says_what_to_do(bundle_dir: Path, fault: str) -> None:
    """A flipped byte in model.safetensors or a missing tokenizer.json named the file and the fault but left the
    user to guess the way out (restore the bundle, or serve another); the daemon's refusal says the same."""
    if fault == "flipped byte":
        _flip(bundle_dir / "model.safetensors", 1000)
        want = f"{bundle_dir / 'model.safetensors'}: checksum mismatch"
    else:
        (bundle_dir / "tokenizer.json").unlink()
        want = f"{bundle_dir / 'tokenizer.json'}: missing from the bundle"
    how = "restore the bundle from where it came from (the bundled release/ comes with m31r: reinstall it)"
    verify = subprocess.run([sys.executable, "-m", "m31r.cli", "bundle", "verify", str(bundle_dir)],
                            capture_output=True, text=True, timeout=60)
    assert verify.returncode == 1 and verify.stderr.count("\n") == 1, verify.stderr
    assert want in verify.stderr and how in verify.stderr and "--bundle, or M31R_BUNDLE" in verify.stderr
    sock = bundle_dir.parent / "run" / "d.sock"
    daemon = subprocess.run([sys.executable, "-m", "m31r.cli", "daemon", "--bundle", str(bundle_dir), "--socket",
                             str(sock), "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert daemon.returncode == 1 and want in daemon.stderr and how in daemon.stderr, daemon.stderr
    assert not sock.exists()

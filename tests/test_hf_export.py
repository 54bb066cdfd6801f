"""`m31r bundle export-hf`: a bundle written as a Hugging Face checkpoint imports back (`import-hf`) to the same weights
and the same logits, for each shape the export spells (Llama tied/untied/GQA/RoPE scaling, Qwen2 with q/k/v biases),
and transformers runs the export as our model. Tiny random models: a few seconds."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner

from m31r.bundle import BundleError, init_bundle, load_weights, open_bundle, quantize_bundle
from m31r.cli import main
from m31r.config import RopeScaling, load_config
from m31r.hf_export import export_hf
from m31r.hf_import import import_hf
from m31r.model import Transformer

ROOT = Path(__file__).resolve().parents[1]
TINY = load_config(ROOT / "configs" / "model" / "tiny.yaml")
LLAMA3 = RopeScaling(type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=64)
VARIANTS = {
    "llama-tied": {},
    "llama-gqa-untied-llama3": {"n_kv_heads": 2, "tie_embeddings": False, "rope_theta": 5e5, "rope_scaling": LLAMA3},
    "llama-linear": {"rope_scaling": RopeScaling(type="linear", factor=4.0)},
    "qwen2-bias": {"n_kv_heads": 2, "qkv_bias": True, "tie_embeddings": False, "rope_theta": 1e6},
}


def _bundle(tmp: Path, **overrides) -> Path:
    config = msgspec.structs.replace(TINY, **overrides)
    init_bundle(config, tmp / "bundle", seed=3, dtype=torch.float32)
    if config.qkv_bias:  # init zeroes biases: give them values, so that losing one would show
        b = open_bundle(tmp / "bundle")
        sd = {k: v.clone() for k, v in load_weights(b).items()}
        gen = torch.Generator().manual_seed(5)
        for k in sd:
            if k.endswith(".bias"):
                sd[k] = 0.5 * torch.randn(sd[k].shape, generator=gen)
        from m31r.bundle import write_bundle
        from m31r.tokenizer import build_byte_tokenizer

        write_bundle(tmp / "biased", config, sd, build_byte_tokenizer(config.vocab_size), dtype=torch.float32, seed=3,
                     dataset_version="test")
        return tmp / "biased"
    return tmp / "bundle"


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    b = open_bundle(path)
    model = Transformer(b.config)
    model.load_state_dict(load_weights(b), strict=True)
    with torch.inference_mode():
        return model.eval()(torch.tensor([ids]))[0]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_export_then_import_gives_the_same_model(tmp_path: Path, variant: str) -> None:
    src = _bundle(tmp_path, **VARIANTS[variant])
    hf = export_hf(src, tmp_path / "hf")
    assert sorted(p.name for p in hf.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json",
                                                     "tokenizer_config.json"]
    cfg = json.loads((hf / "config.json").read_text())
    assert cfg["architectures"] == (["Qwen2ForCausalLM"] if "qwen2" in variant else ["LlamaForCausalLM"])
    back = import_hf(hf, tmp_path / "back")
    a, b = open_bundle(src), back
    same = {"name": a.config.name, "n_kv_heads": a.config.kv_heads}  # import spells out n_kv_heads
    assert msgspec.structs.replace(b.config, **same) == msgspec.structs.replace(a.config, **same)
    wa, wb = load_weights(a), load_weights(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    ids = list(range(10, 200, 7))
    assert torch.equal(_logits(src, ids), _logits(back.path, ids))


def test_transformers_runs_the_export_as_our_model(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    src = _bundle(tmp_path, **VARIANTS["llama-gqa-untied-llama3"])
    hf = export_hf(src, tmp_path / "hf")
    ref = transformers.LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager").eval()
    tok = transformers.AutoTokenizer.from_pretrained(hf)
    text = "fn main() { let x = 1; }\n" * 12  # past original_max_context: the llama3 bands matter
    ids = tok(text)["input_ids"]
    assert ids == _our_ids(src, text)  # no BOS added: the same tokens as ours
    with torch.inference_mode():
        expected = ref(torch.tensor([ids])).logits[0]
    assert (_logits(src, ids) - expected).abs().max().item() <= 1e-4


def _our_ids(path: Path, text: str) -> list[int]:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(path) / "tokenizer.json")).encode(text).ids


def test_cli_export_and_refusals(tmp_path: Path) -> None:
    src = _bundle(tmp_path)
    out = tmp_path / "hf-bf16"
    result = CliRunner().invoke(main, ["bundle", "export-hf", str(src), str(out), "--dtype", "bfloat16"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    again = CliRunner().invoke(main, ["bundle", "export-hf", str(src), str(out)])
    assert again.exit_code == 1 and "already exists" in again.output
    quantize_bundle(src, tmp_path / "int8", "int8")
    with pytest.raises(BundleError, match="quantized"):
        export_hf(tmp_path / "int8", tmp_path / "nope")


# -- import-hf on malformed checkpoints: one line naming the file, no traceback, no bundle left behind ----------------


def _hf_checkpoint(tmp: Path) -> Path:
    """A real checkpoint (export of the tiny bundle), free to damage."""
    return export_hf(_bundle(tmp), tmp / "hf")


def _edit_config(hf: Path, **changes) -> None:
    f = hf / "config.json"
    f.write_text(json.dumps({**json.loads(f.read_text()), **changes}))


def _truncate(f: Path) -> None:
    f.write_bytes(f.read_bytes()[:6])  # less than the 8-byte header length


MALFORMED = {
    "tokenizer not a tokenizer": (lambda hf: (hf / "tokenizer.json").write_text('{"version": oops'),
                                  "tokenizer.json: cannot be loaded as a tokenizer: "),
    "config a list": (lambda hf: (hf / "config.json").write_text("[1]"),
                      "config.json: must be a JSON object, not list"),
    "config not JSON": (lambda hf: (hf / "config.json").write_text("{"), "config.json: not valid JSON: "),
    "tokenizer_config a list": (lambda hf: (hf / "tokenizer_config.json").write_text("[]"),
                                "tokenizer_config.json: must be a JSON object, not list"),
    "weights truncated": (lambda hf: _truncate(hf / "model.safetensors"),
                          "model.safetensors: cannot be read as safetensors ("),
    "no heads": (lambda hf: _edit_config(hf, num_attention_heads=0),
                 "config.json: num_attention_heads must be a positive integer, got 0"),
    "hidden size a string": (lambda hf: _edit_config(hf, hidden_size="64"),
                             "config.json: hidden_size must be a positive integer, got '64'"),
    "ffn size contradicts the weights": (lambda hf: _edit_config(hf, intermediate_size=512),
                                         "model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape "
                                         "[128, 64], config.json implies [512, 64]"),
    "rope scaling not a mapping": (lambda hf: _edit_config(hf, rope_scaling="linear"),
                                   "config.json: rope_scaling must be an object or null, got 'linear'"),
}


@pytest.mark.parametrize("fault", list(MALFORMED))
def test_cli_import_malformed_checkpoint_is_one_line_naming_the_file(tmp_path: Path, fault: str) -> None:
    damage, message = MALFORMED[fault]
    hf = _hf_checkpoint(tmp_path)
    damage(hf)
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf), str(out)])
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.startswith(f"error: {hf}/") and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_import_without_a_config_dtype_keeps_the_weights_dtype(tmp_path: Path, dtype: str) -> None:
    """A config.json without `dtype`/`torch_dtype` (older or hand-written ones) imported as float32, doubling a
    bf16 checkpoint's size: the safetensors header says what the weights are."""
    hf = export_hf(_bundle(tmp_path), tmp_path / "hf", dtype=dtype)
    cfg = {k: v for k, v in json.loads((hf / "config.json").read_text()).items() if k not in ("dtype", "torch_dtype")}
    (hf / "config.json").write_text(json.dumps(cfg))
    b = import_hf(hf, tmp_path / "back")
    assert b.metadata["dtype"] == dtype
    assert {t.dtype for t in load_weights(b).values()} == {getattr(torch, dtype)}
    _edit_config(hf, torch_dtype="float32")  # a config that names one still decides
    assert import_hf(hf, tmp_path / "named").metadata["dtype"] == "float32"

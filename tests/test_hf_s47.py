"""import-hf on checkpoints that imported into a model other than the one transformers runs: RoPE fields of the two
transformers spellings that disagree, a config.json leaving out rms_norm_eps, and a tokenizer that puts a BOS in every
prompt. Tiny random transformers models, saved as transformers saves them, edited per test."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from tokenizers import processors

from m31r.bundle import load_weights
from m31r.cli import main
from m31r.hf_import import import_hf
from m31r.model import Transformer
from m31r.tokenizer import build_byte_tokenizer

transformers = pytest.importorskip("transformers")


def _checkpoint(tmp: Path, family: str, **overrides: object) -> Path:
    """A one-layer random `family` (Llama, Qwen2) checkpoint with weights large enough that logits spread out."""
    kw = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
              bos_token_id=None, eos_token_id=0, pad_token_id=4)
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**{**kw, **overrides})
    model = getattr(transformers, f"{family}ForCausalLM")(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.5 if name.endswith(("embed_tokens.weight", ".bias")) else p.shape[-1] ** -0.5
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(p.shape, generator=gen))
    out = tmp / family.lower()
    model.save_pretrained(out)
    build_byte_tokenizer(300).save(str(out / "tokenizer.json"))
    return out


def _edit_config(hf: Path, drop: tuple[str, ...] = (), **changes: object) -> dict:
    f = hf / "config.json"
    cfg = {k: v for k, v in json.loads(f.read_text()).items() if k not in drop} | changes
    f.write_text(json.dumps(cfg))
    return cfg


def _refused(hf: Path, out: Path, *message: str) -> None:
    """`m31r bundle import-hf` fails with one `error:` line holding each of `message`, and writes no OUT."""
    result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf), str(out)])
    assert result.exit_code == 1 and result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, \
        result.output
    for m in message:
        assert m in result.stderr, result.stderr
    assert not out.exists()


def test_rope_scaling_beside_rope_parameters_that_disagree_is_refused(tmp_path: Path) -> None:
    """A config saved by transformers 5 (rope_parameters: default, theta 1e6) with the model card's rope_scaling
    added imported unscaled at theta 1e6; transformers lets the rope_scaling replace rope_parameters (linear, theta
    10000). Where the two agree, as the export writes them, the scaling imports."""
    hf = _checkpoint(tmp_path, "Qwen2", rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    cfg = _edit_config(hf, rope_scaling={"type": "linear", "factor": 4.0})
    assert cfg["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6} and "rope_theta" not in cfg
    assert transformers.AutoConfig.from_pretrained(hf).rope_parameters["rope_type"] == "linear"
    _refused(hf, tmp_path / "out", f"{hf / 'config.json'}: rope_scaling and rope_theta", "rope_type 'linear'",
             "rope_parameters (transformers 5's) 'default'")
    _edit_config(hf, rope_theta=1e6)  # the type still differs
    _refused(hf, tmp_path / "out", "rope_type 'linear'")
    _edit_config(hf, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 5e5})
    _refused(hf, tmp_path / "out", "rope_theta 1000000.0, rope_parameters (transformers 5's) 500000.0")
    _edit_config(hf, rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6})
    config = import_hf(hf, tmp_path / "agreed").config
    assert config.rope_theta == 1e6 and config.rope_scaling.type == "linear" and config.rope_scaling.factor == 4.0


def test_omitted_rms_norm_eps_is_transformers_default(tmp_path: Path) -> None:
    """config.json without rms_norm_eps imported with 1e-5; transformers' Llama and Qwen2 take 1e-6 (logits then
    differed by ~1e-3). max_position_embeddings left out is Qwen2's 32768, as in transformers."""
    hf = _checkpoint(tmp_path, "Llama")
    _edit_config(hf, drop=("rms_norm_eps",))
    ref = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    bundle = import_hf(hf, tmp_path / "out")
    assert bundle.config.norm_eps == ref.config.rms_norm_eps == 1e-6
    model = Transformer(bundle.config)
    model.load_state_dict(load_weights(bundle), strict=True)
    ids = torch.tensor([bundle.tokenizer.encode("fn main() { let v = vec![1, 2]; }").ids])
    with torch.inference_mode():
        expected, ours = ref.eval()(ids).logits[0], model.eval()(ids)[0]
    assert expected.std() > 1.0 and (ours - expected).abs().max().item() <= 1e-4
    qwen = _checkpoint(tmp_path, "Qwen2")
    _edit_config(qwen, drop=("max_position_embeddings", "rms_norm_eps"))
    config = import_hf(qwen, tmp_path / "qwen").config
    assert (config.max_context, config.norm_eps) == (32768, 1e-6)


def test_tokenizer_that_adds_a_bos_to_every_text_is_refused(tmp_path: Path) -> None:
    """A tokenizer.json whose post_processor prepends a BOS imported silently: transformers' tokenizer puts it in
    every prompt (the model's first position), M31R never does, so greedy output differed from the first token."""
    hf = _checkpoint(tmp_path, "Llama")
    tok = build_byte_tokenizer(300)
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                       special_tokens=[("<|endoftext|>", 0)])
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast",
                                                          "eos_token": "<|endoftext|>"}))
    assert transformers.AutoTokenizer.from_pretrained(hf)("fn").input_ids[0] == 0  # the premise: transformers adds it
    _refused(hf, tmp_path / "out", f"{hf / 'tokenizer.json'}: its post_processor adds <|endoftext|> to every text")

"""Our transformer against transformers' LlamaForCausalLM on the same weights: an independent reference.

The HF model is built and saved in HF format, imported with `m31r bundle import-hf`, and both are run in fp32.
Weights are drawn larger than a training init so logits are well separated and greedy decoding is decisive.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from devices import DEVICES
from safetensors.torch import load_file, save_file

from m31r.bundle import BundleError, open_bundle
from m31r.cli import main
from m31r.engine import Engine
from m31r.hf_import import import_hf
from m31r.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer

transformers = pytest.importorskip("transformers")

VOCAB = 384
PROMPTS = [
    "fn main() {\n    println!(\"hello\");\n}\n",
    "impl<T: Clone> Stack<T> {\n    pub fn push(&mut self, x: T) {",
    "x",
    "use std::collections::HashMap;\n\n// café 🦀 中文\nstruct S { a: u8 }\n" * 4,
]


def _hf_kwargs(**overrides) -> dict:
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=10000.0, bos_token_id=None, eos_token_id=0, pad_token_id=4,
    )
    kw.update(overrides)
    return kw


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Large random weights, non-trivial norm gains, and zero special-token embeddings.

    With a tied head a zero embedding row gives a logit of exactly 0 while the best ordinary token scores
    well above it, so neither implementation ever stops early on a special token.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("embed_tokens.weight"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                p[: len(SPECIAL_TOKENS)] = 0.0
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _save_hf(model, path: Path) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(VOCAB).save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module", params=[(kind, dev) for dev in DEVICES for kind in ("mha", "gqa")],
                ids=lambda p: "-".join(p))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF reference model on the CPU, our Engine on each device) on identical weights; the GQA variant shares
    k/v over 2 heads."""
    kind, device = request.param
    kv_heads = 4 if kind == "mha" else 2
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**_hf_kwargs(num_key_value_heads=kv_heads)))
    _randomise(hf, seed=kv_heads)
    root = tmp_path_factory.mktemp(f"hf-{kind}-{device}")
    hf_dir = _save_hf(hf, root / "hf")
    out = root / "bundle"
    if kind == "mha":  # one variant through the console script, one through the function
        result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf_dir), str(out)])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("ok hf@imported")
    else:
        import_hf(hf_dir, out)
    bundle = open_bundle(out)
    assert bundle.config.kv_heads == kv_heads and bundle.metadata["dtype"] == "float32"
    ref = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    return ref.eval(), Engine(bundle, dtype="float32", device=device)


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_logits_match_transformers(pair, prompt: str) -> None:
    ref, engine = pair
    ids = engine.tokenizer.encode(prompt)
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        expected = ref(tokens).logits[0].float()
        ours = engine.model(tokens.to(engine.device))[0].cpu()
    assert expected.std() > 1.0  # the comparison is meaningful: logits are not all near zero
    assert (ours - expected).abs().max().item() <= 1e-4
    cache = engine.new_cache()
    last = [x for x in engine.prefill(cache, ids, 0) if x is not None][-1].cpu()
    assert (last - expected[-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("prompt", PROMPTS[:2], ids=range(2))
def test_greedy_generation_matches_transformers(pair, prompt: str) -> None:
    ref, engine = pair
    ids = engine.tokenizer.encode(prompt)
    with torch.inference_mode():
        # The engine never samples the byte tokenizer's unused `<|reserved_N|>` padding entries: suppress them in
        # the reference too, so both pick from the same vocabulary.
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           suppress_tokens=engine.tokenizer.unused_ids)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == 64 and not set(expected) & engine.tokenizer.special_ids
    result_tokens = [t.id for t in engine.generate(ids, max_tokens=64) if t is not None and t.id is not None]
    assert result_tokens == expected


# -- refusals -------------------------------------------------------------------------------------------------


def _tiny_hf(tmp_path: Path, cls_name: str = "LlamaForCausalLM", config_cls: str = "LlamaConfig", **kw) -> Path:
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**_hf_kwargs(num_hidden_layers=1, **kw))
    return _save_hf(getattr(transformers, cls_name)(cfg), tmp_path / "hf")


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_refuses_untied_head(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, tie_word_embeddings=False)
    with pytest.raises(BundleError, match="tie_word_embeddings is false"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_head_that_differs_from_embedding(tmp_path: Path) -> None:
    """A config that claims tied weights but ships a different lm_head tensor."""
    hf_dir = _tiny_hf(tmp_path)
    sd = load_file(hf_dir / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1.0
    save_file(sd, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BundleError, match="lm_head.weight differs"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_attention_bias(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, attention_bias=True)
    with pytest.raises(BundleError, match="bias"):
        import_hf(hf_dir, tmp_path / "out")
    _edit_json(hf_dir / "config.json", attention_bias=False)  # the tensors are still there
    with pytest.raises(BundleError, match="bias tensors"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_other_architectures(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, "MistralForCausalLM", "MistralConfig")
    with pytest.raises(BundleError, match="MistralForCausalLM.*is not LlamaForCausalLM"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_rope_scaling(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path)
    _edit_json(hf_dir / "config.json", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(BundleError, match="RoPE scaling"):
        import_hf(hf_dir, tmp_path / "out")


def test_missing_tensor_or_config_key_is_named(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path)
    sd = load_file(hf_dir / "model.safetensors")
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BundleError, match=r"tensor model\.layers\.0\.mlp\.up_proj\.weight is missing"):
        import_hf(hf_dir, tmp_path / "out")
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BundleError, match=r"config\.json: missing key 'hidden_size'"):
        import_hf(hf_dir, tmp_path / "out")


def test_cli_refusal_is_one_line(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, tie_word_embeddings=False)
    result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf_dir), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "tie_word_embeddings" in result.stderr and "Traceback" not in result.stderr

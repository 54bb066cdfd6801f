"""Our transformer against transformers' Llama and Qwen2 models on the same weights: an independent reference.

Each HF model is built and saved in HF format with a tokenizer smaller than its embedding (as published checkpoints
pad vocab_size to a round number), imported with `m31r bundle import-hf`, and both are run in fp32.
Weights are drawn larger than a training init so logits are well separated and greedy decoding is decisive.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from click.testing import CliRunner
from devices import DEVICES
from safetensors.torch import load_file, save_file

from m31r import quant
from m31r.bundle import BundleError, load_weights, open_bundle, quantize_bundle
from m31r.cli import main
from m31r.config import RopeScaling
from m31r.engine import Engine
from m31r.hf_import import import_hf
from m31r.model import Transformer, rope_frequencies
from m31r.quant import Int8Linear
from m31r.sampling import SamplingParams
from m31r.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer
from m31rd.scheduler import run_together

transformers = pytest.importorskip("transformers")
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5

VOCAB = 384  # rows of the embedding
TOKENS = 300  # entries of the (padded) tokenizers: ids 300..383 are no token at all
PROMPTS = [
    "fn main() {\n    println!(\"hello\");\n}\n",
    "impl<T: Clone> Stack<T> {\n    pub fn push(&mut self, x: T) {",
    "x",
    "use std::collections::HashMap;\n\n// café 🦀 中文\nstruct S { a: u8 }\n" * 4,  # ~350 tokens: scaled RoPE
]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # with head_dim 16, some frequencies in each of the three bands

# name: (HF class, config overrides, RoPE (theta, scaling), tokenizer entries)
VARIANTS = {
    "llama-mha": ("Llama", {}, (10000.0, None), VOCAB),  # the tokenizer fills the embedding exactly
    "llama-gqa": ("Llama", {"num_key_value_heads": 2}, (10000.0, None), TOKENS),
    "llama-untied-llama3": ("Llama", {"num_key_value_heads": 2, "tie_word_embeddings": False}, (5e5, LLAMA3),
                            TOKENS),
    "llama-linear": ("Llama", {}, (10000.0, {"rope_type": "linear", "factor": 4.0}), TOKENS),
    "qwen2-bias-untied": ("Qwen2", {"num_key_value_heads": 2, "tie_word_embeddings": False}, (1e6, None), TOKENS),
}


def _rope_kwargs(theta: float, scaling: dict | None) -> dict:
    """RoPE settings as this transformers takes them (5: `rope_parameters`; 4: `rope_theta` + `rope_scaling`)."""
    if TRANSFORMERS_5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta, **(scaling or {})}}
    return {"rope_theta": theta, "rope_scaling": scaling}


def _hf_model(family: str, rope: tuple[float, dict | None] = (10000.0, None), **overrides) -> torch.nn.Module:
    kw = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=0, pad_token_id=4, **_rope_kwargs(*rope),
    )
    kw.update(overrides)
    torch.manual_seed(0)
    return getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**kw))


def _randomise(model: torch.nn.Module, seed: int) -> None:
    """Large random weights and biases, non-trivial norm gains, and zero special-token rows in the embedding and
    head: a zero row gives a logit of exactly 0 while the best ordinary token scores well above it, so neither
    implementation ever stops early on a special token."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
                p[: len(SPECIAL_TOKENS)] = 0.0
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)


def _save_hf(model: torch.nn.Module, path: Path, tokens: int = TOKENS) -> Path:
    model.save_pretrained(path, safe_serialization=True)
    build_byte_tokenizer(tokens).save(str(path / "tokenizer.json"))
    return path


def _reference(hf_dir: Path, family: str) -> torch.nn.Module:
    cls = getattr(transformers, f"{family}ForCausalLM")
    return cls.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module", params=[(v, dev) for dev in DEVICES for v in VARIANTS], ids=lambda p: "-".join(p))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF reference model on the CPU, our Engine on each device) on identical weights."""
    variant, device = request.param
    family, overrides, rope, tokens = VARIANTS[variant]
    hf = _hf_model(family, rope, **overrides)
    _randomise(hf, seed=len(variant))
    root = tmp_path_factory.mktemp(f"hf-{variant}-{device}")
    hf_dir = _save_hf(hf, root / "hf", tokens)
    out = root / "bundle"
    if variant == "llama-mha":  # one variant through the console script, the others through the function
        result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf_dir), str(out)])
        assert result.exit_code == 0, result.output
        assert result.stdout.startswith("ok hf@imported")
    else:
        import_hf(hf_dir, out)
    bundle = open_bundle(out)
    c = bundle.config
    assert c.kv_heads == overrides.get("num_key_value_heads", 4) and bundle.metadata["dtype"] == "float32"
    assert c.tie_embeddings == overrides.get("tie_word_embeddings", True) and c.qkv_bias == (family == "Qwen2")
    assert c.rope_theta == rope[0] and (c.rope_scaling is None) == (rope[1] is None)
    engine = Engine(bundle, dtype="float32", device=device, kv_dtype="float32")  # parity to 1e-4: an fp32 cache
    assert len(engine.tokenizer.unused_ids) >= VOCAB - tokens
    return _reference(hf_dir, family), engine


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
    cache = engine.new_cache()  # chunked prefill into the KV cache
    last = [x for x in engine.prefill(cache, ids, 0) if x is not None][-1].cpu()
    assert (last - expected[-1]).abs().max().item() <= 1e-4


def test_greedy_generation_matches_transformers(pair) -> None:
    ref, engine = pair
    ids = engine.tokenizer.encode(PROMPTS[1])
    with torch.inference_mode():
        # The engine never emits the byte tokenizer's unused `<|reserved_N|>` entries nor the embedding's padding
        # rows past the tokenizer: suppress them in the reference too, so both pick from the same vocabulary.
        out = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=64, min_new_tokens=64,
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           suppress_tokens=engine.tokenizer.unused_ids)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == 64 and not set(expected) & engine.tokenizer.special_ids
    result_tokens = [t.id for t in engine.generate(ids, max_tokens=64) if t is not None and t.id is not None]
    assert result_tokens == expected


# -- RoPE scaling ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}], ids=["llama3", "linear"])
def test_rope_frequencies_are_transformers_bit_for_bit(tmp_path: Path, scaling: dict) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_dir = _save_hf(_hf_model("Llama", (5e5, scaling), num_hidden_layers=1), tmp_path / "hf")
    config = import_hf(hf_dir, tmp_path / "out").config
    expected, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](
        transformers.AutoConfig.from_pretrained(hf_dir), "cpu")
    assert attention_factor == 1.0 and config.rope_scaling.type == scaling["rope_type"]
    ours = rope_frequencies(config)
    assert torch.equal(ours, expected.float())
    plain = rope_frequencies(msgspec.structs.replace(config, rope_scaling=None))
    if scaling["rope_type"] == "llama3":  # the three bands: kept, blended, divided by the factor
        assert ours[0] == plain[0] and ours[-1] == plain[-1] / 8 and (ours / plain).unique().numel() >= 3
    else:
        assert torch.equal(ours, plain / 4)


def test_transformers_4_rope_fields_import(tmp_path: Path) -> None:
    """Most published config.json files predate transformers 5: a top-level rope_theta and a `rope_scaling` dict
    spelling its kind `type` or `rope_type`, llama3's original context possibly at the top level."""
    hf_dir = _save_hf(_hf_model("Llama", num_hidden_layers=1), tmp_path / "hf")
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    for scaling, top, expected in [
        ({"type": "linear", "factor": 2.0}, {}, RopeScaling(type="linear", factor=2.0)),
        ({**LLAMA3, "original_max_position_embeddings": 32}, {}, RopeScaling(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=32)),
        ({k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"},
         {"original_max_position_embeddings": 128}, RopeScaling(
            type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=128)),
        (None, {}, None),
    ]:
        (hf_dir / "config.json").write_text(json.dumps({**cfg, "rope_theta": 12345.0, "rope_scaling": scaling,
                                                        **top}))
        config = import_hf(hf_dir, tmp_path / "out").config
        assert config.rope_theta == 12345.0 and config.rope_scaling == expected


# -- padding ids past the tokenizer ---------------------------------------------------------------------------


@pytest.mark.parametrize("family,tied", [("Llama", True), ("Qwen2", False)], ids=["llama-tied", "qwen2-untied"])
def test_padding_ids_are_never_produced(tmp_path: Path, family: str, tied: bool) -> None:
    """The head's rows past the tokenizer are made to win: transformers, unmasked, picks one at every step; the
    engine never does, greedy or sampled, float or quantized, and otherwise decodes what transformers does."""
    hf = _hf_model(family, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=tied)
    _randomise(hf, seed=7)
    with torch.no_grad():
        head = hf.get_output_embeddings().weight
        head[TOKENS:] *= 40.0
    hf_dir = _save_hf(hf, tmp_path / "hf")
    bundle = import_hf(hf_dir, tmp_path / "b")
    ref = _reference(hf_dir, family)
    engine = Engine(bundle, dtype="float32")
    padding = set(range(TOKENS, VOCAB))
    assert padding <= set(engine.tokenizer.unused_ids)
    ids = engine.tokenizer.encode(PROMPTS[0])
    with torch.inference_mode():
        free = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                            attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        masked = ref.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16, min_new_tokens=16,
                              attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              suppress_tokens=engine.tokenizer.unused_ids)
    assert set(free[0, len(ids):].tolist()) <= padding  # unmasked, padding wins every step
    greedy = [t.id for t in engine.generate(ids, max_tokens=16) if t.id is not None]
    assert greedy == masked[0, len(ids):].tolist() and not set(greedy) & padding
    for seed in range(3):
        params = SamplingParams(temperature=3.0, seed=seed)
        sampled = [t.id for t in engine.generate(ids, max_tokens=24, sampling=params) if t.id is not None]
        assert sampled and not set(sampled) & padding
    for method in ("int8", "int4"):
        quantized = Engine(bundle, dtype="bfloat16", quant=method, group_size=32)
        out = [t.id for t in quantized.generate(ids, max_tokens=16) if t.id is not None]
        assert out and not set(out) & padding


# -- the fast paths on imported shapes ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_bundle(tmp_path_factory: pytest.TempPathFactory):
    """A Qwen2 checkpoint with everything at once: q/k/v biases, an untied head, GQA, a padded vocabulary."""
    hf = _hf_model("Qwen2", (1e6, None), num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=False)
    _randomise(hf, seed=3)
    root = tmp_path_factory.mktemp("qwen2")
    return import_hf(_save_hf(hf, root / "hf"), root / "bundle")


def _dequantized_model(bundle, method: str) -> Transformer:
    """The fp32 model on the weights `method` stores (m31r.quant's exact inverses): what a quantized engine computes
    up to bf16 rounding, whatever the quantization error of these large random weights."""
    sd = quant.quantize_state_dict(bundle.config, load_weights(bundle), method, 32)
    weights = {}
    for name, t in sd.items():
        base = name.rsplit(".", 1)[0]
        if name.endswith(".weight_int8"):
            weights[base + ".weight"] = quant.dequantize_int8(t, sd[base + ".scales"])
        elif name.endswith(".weight_int4"):
            weights[base + ".weight"] = quant.dequantize_int4(t, sd[base + ".scales_and_zeros"], 32)
        elif not name.endswith((".scales", ".scales_and_zeros")):
            weights[name] = t.float()
    model = Transformer(bundle.config)
    model.load_state_dict(weights)
    return model.eval()


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_untied_head_and_biases(qwen2_bundle, tmp_path: Path, method: str) -> None:
    """int8/int4 bundles of the shape verify, keep the biases in float and the untied head in int8, compute what
    quantizing at load computes and what the dequantized weights compute in fp32, and decode the same with a warm
    cache as with a cold one."""
    q = quantize_bundle(qwen2_bundle.path, tmp_path / method, method, 32)
    assert open_bundle(q.path).config == qwen2_bundle.config
    stored = Engine(q.path, dtype="bfloat16", chunk_size=8, max_chunk=32)
    at_load = Engine(qwen2_bundle.path, dtype="bfloat16", quant=method, group_size=32, chunk_size=8, max_chunk=32)
    assert isinstance(stored.model.output, Int8Linear) and stored.model.head is None
    assert all(layer.attention.wqkv.bias is not None for layer in stored.model.layers)
    ids = stored.tokenizer.encode(PROMPTS[3])[:150]
    cold = [x for x in stored.prefill(stored.new_cache(), ids, 0) if x is not None][-1]
    assert torch.equal(cold, [x for x in at_load.prefill(at_load.new_cache(), ids, 0) if x is not None][-1])
    with torch.inference_mode():
        expected = _dequantized_model(qwen2_bundle, method)(torch.tensor([ids]))[0, -1]
    assert (cold - expected).abs().max().item() < 0.03 * expected.abs().max().item()
    cache = stored.new_cache()
    [x for x in stored.prefill(cache, ids[:100], 0) if x is not None]
    start = stored.reusable(cache, ids)
    assert start == 96
    assert torch.equal([x for x in stored.prefill(cache, ids, start) if x is not None][-1], cold)


@pytest.mark.parametrize(("dtype", "method"), [("float32", None), ("bfloat16", None), ("bfloat16", "int8"),
                                               ("bfloat16", "int4")])
def test_streams_together_equal_streams_alone(qwen2_bundle, dtype: str, method: str | None) -> None:
    """Decode rows and prefill chunks sharing forward passes (the daemon's rounds) give each stream exactly what it
    gets alone, with biases and an untied head in every precision."""
    engine = Engine(qwen2_bundle, dtype=dtype, quant=method, group_size=32, chunk_size=8, max_chunk=64)
    prompts = [PROMPTS[0], PROMPTS[1], "x", PROMPTS[3][:90]]
    alone = [[t.id for t in engine.generate(p, max_tokens=10)] for p in prompts]
    together, sched = run_together(engine, prompts, 10)
    shared = sched.mixed_rounds
    assert together == alone and shared > 0


# -- refusals -------------------------------------------------------------------------------------------------


def _tiny_hf(tmp_path: Path, family: str = "Llama", rope: tuple[float, dict | None] = (10000.0, None),
             **kw) -> Path:
    return _save_hf(_hf_model(family, rope, num_hidden_layers=1, **kw), tmp_path / "hf")


def _edit_json(path: Path, **changes) -> None:
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def test_refuses_head_that_differs_from_embedding(tmp_path: Path) -> None:
    """A config that claims tied weights but ships a different lm_head tensor."""
    hf_dir = _tiny_hf(tmp_path)
    sd = load_file(hf_dir / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"] + 1.0
    save_file(sd, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BundleError, match="lm_head.weight differs"):
        import_hf(hf_dir, tmp_path / "out")


def test_untied_head_equal_to_the_embedding_is_imported_tied(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, tie_word_embeddings=False)
    sd = load_file(hf_dir / "model.safetensors")
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, hf_dir / "model.safetensors", metadata={"format": "pt"})
    assert import_hf(hf_dir, tmp_path / "out").config.tie_embeddings


def test_refuses_biases_it_has_no_place_for(tmp_path: Path) -> None:
    """Llama's attention_bias also biases o_proj; bias tensors a config does not announce are refused too."""
    hf_dir = _tiny_hf(tmp_path, attention_bias=True)
    with pytest.raises(BundleError, match="attention_bias puts a bias on o_proj"):
        import_hf(hf_dir, tmp_path / "out")
    _edit_json(hf_dir / "config.json", attention_bias=False)  # the tensors are still there
    with pytest.raises(BundleError, match="bias tensors"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_other_architectures(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, "Mistral")
    with pytest.raises(BundleError, match=r"architecture \['MistralForCausalLM'\] is not supported; M31R imports "
                                          r"LlamaForCausalLM and Qwen2ForCausalLM"):
        import_hf(hf_dir, tmp_path / "out")


@pytest.mark.parametrize("scaling", [
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "dynamic", "factor": 2.0},
], ids=["yarn", "dynamic"])
def test_refuses_other_rope_scalings_by_name(tmp_path: Path, scaling: dict) -> None:
    hf_dir = _tiny_hf(tmp_path, rope=(10000.0, scaling))
    with pytest.raises(BundleError, match=rf"RoPE scaling type '{scaling['rope_type']}' is not supported \(only "
                                          r"linear, llama3\)"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_sliding_window_attention(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, "Qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=0)
    with pytest.raises(BundleError, match="sliding-window attention"):
        import_hf(hf_dir, tmp_path / "out")


def test_refuses_a_tokenizer_larger_than_the_embedding(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path)
    build_byte_tokenizer(VOCAB + 16).save(str(hf_dir / "tokenizer.json"))
    with pytest.raises(BundleError, match=rf"tokenizer\.json: token id {VOCAB + 15} has no embedding row"):
        import_hf(hf_dir, tmp_path / "out")


def test_missing_tensor_or_config_key_is_named(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, "Qwen2")
    sd = load_file(hf_dir / "model.safetensors")
    del sd["model.layers.0.self_attn.k_proj.bias"]
    save_file(sd, hf_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BundleError, match=r"tensor model\.layers\.0\.self_attn\.k_proj\.bias is missing"):
        import_hf(hf_dir, tmp_path / "out")
    cfg = json.loads((hf_dir / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(BundleError, match=r"config\.json: missing key 'hidden_size'"):
        import_hf(hf_dir, tmp_path / "out")


def test_cli_refusal_is_one_line(tmp_path: Path) -> None:
    hf_dir = _tiny_hf(tmp_path, rope=(10000.0, {"rope_type": "yarn", "factor": 4.0}))
    result = CliRunner().invoke(main, ["bundle", "import-hf", str(hf_dir), str(tmp_path / "out")])
    assert result.exit_code == 1
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: ")
    assert "'yarn'" in result.stderr and "Traceback" not in result.stderr

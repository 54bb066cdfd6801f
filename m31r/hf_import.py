"""Convert a Hugging Face Llama-architecture checkpoint (tied embeddings) into an M31R bundle.

Llama's layout is ours up to naming and fusion: q/k/v become one `wqkv`, gate/up one `w13`. Anything the
M31R block cannot express (an untied head, biases, other activations, RoPE scaling) is refused by name
rather than converted into a model that silently computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from m31r.bundle import Bundle, BundleError, write_bundle
from m31r.config import ConfigError, ModelConfig, parse_config

_FIM_SPELLINGS = {
    "fim_prefix_token": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>"),
    "fim_suffix_token": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>"),
    "fim_middle_token": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _refuse(hf_dir: Path, what: str) -> BundleError:
    return BundleError(f"{hf_dir / 'config.json'}: {what}; M31R imports tied-embedding Llama checkpoints only")


def _hf_config(hf_dir: Path, hf: dict, tok: HFTokenizer) -> ModelConfig:
    arch = hf.get("architectures") or []
    if hf.get("model_type") != "llama" or (arch and arch != ["LlamaForCausalLM"]):
        raise _refuse(hf_dir, f"architecture {arch or hf.get('model_type')!r} is not LlamaForCausalLM")
    if not hf.get("tie_word_embeddings", False):
        raise _refuse(hf_dir, "the LM head is not tied to the embedding (tie_word_embeddings is false)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise _refuse(hf_dir, "the checkpoint uses biases")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(hf_dir, f"activation {hf['hidden_act']!r} is not SwiGLU (silu)")
    rope = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    if scaling:
        raise _refuse(hf_dir, f"RoPE scaling {scaling!r} is not supported")
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise _refuse(hf_dir, f"head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads")
    special = {}
    vocab = tok.get_vocab(with_added_tokens=True)
    for role, names in _FIM_SPELLINGS.items():
        found = next((n for n in names if n in vocab), None)
        if found is None:
            raise BundleError(f"{hf_dir / 'tokenizer.json'}: no {role.removesuffix('_token')} token "
                              f"(looked for {', '.join(names)}); M31R needs FIM tokens")
        special[role] = found
    tok_cfg = hf_dir / "tokenizer_config.json"
    eos = json.loads(tok_cfg.read_text()).get("eos_token") if tok_cfg.exists() else None
    special["eos_token"] = eos if isinstance(eos, str) and eos in vocab else "<|endoftext|>"
    special["pad_token"] = "<|pad|>" if "<|pad|>" in vocab else special["eos_token"]
    try:
        return parse_config({
            "name": hf_dir.name, "n_layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads", heads), "ffn_hidden": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_context": hf.get("max_position_embeddings", 2048),
            "rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            "norm_eps": float(hf.get("rms_norm_eps", 1e-5)), **special,
        }, str(hf_dir / "config.json"))
    except (ConfigError, KeyError) as e:
        raise BundleError(f"{hf_dir / 'config.json'}: {e}") from None


def _read_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(hf_dir.glob("model*.safetensors"))
    if not files:
        raise BundleError(f"{hf_dir}: no model*.safetensors weights (PyTorch .bin checkpoints are not read)")
    tensors = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                tensors[name] = sf.get_tensor(name)
    return tensors


def import_hf(hf_dir: str | Path, out: str | Path, *, dataset_version: str = "unknown (imported)") -> Bundle:
    hf_dir = Path(hf_dir)
    for name in ("config.json", "tokenizer.json"):
        if not (hf_dir / name).is_file():
            raise BundleError(f"{hf_dir / name}: missing; an HF checkpoint directory needs it")
    hf = json.loads((hf_dir / "config.json").read_text())
    tok = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    try:
        config = _hf_config(hf_dir, hf, tok)
    except KeyError as e:
        raise BundleError(f"{hf_dir / 'config.json'}: missing key {e}") from None
    src = _read_tensors(hf_dir)
    if any(k.endswith(".bias") for k in src):
        raise _refuse(hf_dir, "the checkpoint has bias tensors")

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise BundleError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        return src.pop(name)

    emb = take("model.embed_tokens.weight")
    head = src.pop("lm_head.weight", None)
    if head is not None and not torch.equal(head, emb):
        raise _refuse(hf_dir, "lm_head.weight differs from the embedding (untied head)")
    sd = {"tok_embeddings.weight": emb, "norm.weight": take("model.norm.weight")}
    for i in range(config.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        attn = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
        sd[q + "attention.wqkv.weight"] = torch.cat(attn, 0)
        sd[q + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[q + "feed_forward.w13.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
        sd[q + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        sd[q + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    if src:
        raise _refuse(hf_dir, f"unrecognised tensor {next(iter(src))}")
    dtype = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype") or "float32"), torch.float32)
    return write_bundle(out, config, sd, tok, dtype=dtype, seed=-1, dataset_version=dataset_version,
                        model_version="imported", extra={"source": "hf-import", "source_dir": hf_dir.name})

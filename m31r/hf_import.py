"""Convert a Hugging Face Llama or Qwen2 checkpoint into an M31R bundle.

Both layouts are ours up to naming and fusion: q/k/v become one `wqkv` (Qwen2's q/k/v biases one `wqkv.bias`),
gate/up one `w13`, a separate `lm_head` the `output` matrix. GQA, rope_theta and RoPE scaling of the `linear`
and `llama3` types carry over as config fields. An embedding padded beyond the tokenizer is kept as it is; the
engine never emits the padding ids. Anything the M31R block cannot express (other architectures, an o_proj or
MLP bias, other activations, sliding-window attention, other RoPE scalings) is refused by name rather than
converted into a model that silently computes something else.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from m31r.bundle import Bundle, BundleError, write_bundle
from m31r.checksums import unfinished
from m31r.config import ConfigError, ModelConfig, parse_config

_FIM_SPELLINGS = {
    "fim_prefix_token": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>"),
    "fim_suffix_token": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>"),
    "fim_middle_token": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# model_type -> the architecture class it must name, and whether its q/k/v projections carry biases.
FAMILIES = {"llama": ("LlamaForCausalLM", False), "qwen2": ("Qwen2ForCausalLM", True)}
ROPE_SCALINGS = ("linear", "llama3")


def _refuse(hf_dir: Path, what: str) -> BundleError:
    return BundleError(f"{hf_dir / 'config.json'}: {what}; M31R imports LlamaForCausalLM and Qwen2ForCausalLM "
                       f"checkpoints of the standard shape")


def _rope(hf_dir: Path, hf: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling, from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4)."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(hf.get(key) or {}, dict):
            raise BundleError(f"{hf_dir / 'config.json'}: {key} must be an object or null, got {hf[key]!r}")
    params = {**(hf.get("rope_scaling") or {}), **(hf.get("rope_parameters") or {})}
    if any(isinstance(v, dict) for v in params.values()):
        raise _refuse(hf_dir, "per-layer RoPE parameters are not supported")
    if float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))) != 1.0:
        raise _refuse(hf_dir, "partial rotary embeddings (partial_rotary_factor) are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_SCALINGS:
        raise _refuse(hf_dir, f"RoPE scaling type {kind!r} is not supported (only {', '.join(ROPE_SCALINGS)})")
    scaling = {"type": kind, "factor": float(params["factor"])}
    if kind == "llama3":
        # transformers takes a top-level original_max_position_embeddings first, then the parameters', then the
        # model's context.
        old = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        scaling.update(low_freq_factor=float(params["low_freq_factor"]),
                       high_freq_factor=float(params["high_freq_factor"]),
                       original_max_context=int(old or hf["max_position_embeddings"]))
    return theta, scaling


def _hf_config(hf_dir: Path, hf: dict, tok: HFTokenizer) -> ModelConfig:
    arch = hf.get("architectures") or []
    family = FAMILIES.get(hf.get("model_type"))
    if family is None or (arch and arch != [family[0]]):
        raise _refuse(hf_dir, f"architecture {arch or hf.get('model_type')!r} is not supported")
    qkv_bias = family[1]
    if hf.get("attention_bias"):
        raise _refuse(hf_dir, "attention_bias puts a bias on o_proj, which the M31R block does not have")
    if hf.get("mlp_bias"):
        raise _refuse(hf_dir, "the MLP uses biases (mlp_bias)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise _refuse(hf_dir, "sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(hf_dir, f"activation {hf['hidden_act']!r} is not SwiGLU (silu)")
    _check_sizes(hf_dir, hf)
    d, heads = hf["hidden_size"], hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, d // heads):
        raise _refuse(hf_dir, f"head_dim {hf['head_dim']} differs from hidden_size / num_attention_heads")
    theta, scaling = _rope(hf_dir, hf)
    vocab = tok.get_vocab(with_added_tokens=True)
    if max(vocab.values(), default=-1) >= hf["vocab_size"]:
        raise BundleError(f"{hf_dir / 'tokenizer.json'}: token id {max(vocab.values())} has no embedding row "
                          f"(vocab_size is {hf['vocab_size']})")
    special = {}
    for role, names in _FIM_SPELLINGS.items():
        found = next((n for n in names if n in vocab), None)
        if found is None:
            raise BundleError(f"{hf_dir / 'tokenizer.json'}: no {role.removesuffix('_token')} token "
                              f"(looked for {', '.join(names)}); M31R needs FIM tokens")
        special[role] = found
    tok_cfg = hf_dir / "tokenizer_config.json"
    eos = _json_object(tok_cfg).get("eos_token") if tok_cfg.exists() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos  # older files spell an AddedToken out
    special["eos_token"] = eos if isinstance(eos, str) and eos in vocab else "<|endoftext|>"
    special["pad_token"] = "<|pad|>" if "<|pad|>" in vocab else special["eos_token"]
    try:
        return parse_config({
            # (the folder's own name: `.`, a checkpoint imported from inside it, has none)
            "name": Path(os.path.abspath(hf_dir)).name,
            "n_layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads", heads), "ffn_hidden": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_context": hf.get("max_position_embeddings", 2048),
            "rope_theta": theta, "norm_eps": float(hf.get("rms_norm_eps", 1e-5)), **special,
            # Both families' transformers configs default to an untied head.
            "qkv_bias": qkv_bias, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": scaling,
        }, str(hf_dir / "config.json"))
    except ConfigError as e:  # (it names config.json: parse_config's source)
        raise BundleError(str(e)) from None
    except KeyError as e:
        raise BundleError(f"{hf_dir / 'config.json'}: {e}") from None


# Sizes _hf_config divides by and the tensor shapes follow from: checked first, so that a bad value is named instead
# of surfacing as a ZeroDivisionError or as a shape mismatch in the bundle written from it.
_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size")
_OPTIONAL_SIZES = ("num_key_value_heads", "max_position_embeddings", "head_dim")


def _json_object(f: Path) -> dict:
    """A JSON file that must hold an object (config.json, tokenizer_config.json)."""
    try:
        data = json.loads(f.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise BundleError(f"{f}: not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{f}: must be a JSON object, not {type(data).__name__}")
    return data


def _check_sizes(hf_dir: Path, hf: dict) -> None:
    for key in (*_SIZES, *_OPTIONAL_SIZES):
        value = hf.get(key)
        if value is None and key in _OPTIONAL_SIZES:
            continue
        if key not in hf:
            raise BundleError(f"{hf_dir / 'config.json'}: missing key {key!r}")
        if type(value) is not int or value <= 0:
            raise BundleError(f"{hf_dir / 'config.json'}: {key} must be a positive integer, got {value!r}")


def _read_tensors(hf_dir: Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Every tensor of the checkpoint, and the file each came from (for messages)."""
    files = sorted(hf_dir.glob("model*.safetensors"))
    if not files:
        raise BundleError(f"{hf_dir}: no model*.safetensors weights (PyTorch .bin checkpoints are not read)")
    tensors, origin = {}, {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():  # noqa: SIM118 - safe_open is not a mapping
                    if not name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved; recomputed
                        tensors[name], origin[name] = sf.get_tensor(name), f
        except Exception as e:  # safetensors raises SafetensorError (a bare Exception subclass) on a damaged file
            raise BundleError(f"{f}: cannot be read as safetensors ({e}): damaged or truncated?") from None
    return tensors, origin


def _hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape config.json implies for each checkpoint tensor, by its Hugging Face name."""
    d, hd, ffn = config.d_model, config.head_dim, config.ffn_hidden
    q, kv = config.n_heads * hd, config.kv_heads * hd
    shapes = {"model.embed_tokens.weight": (config.vocab_size, d), "lm_head.weight": (config.vocab_size, d),
              "model.norm.weight": (d,)}
    for i in range(config.n_layers):
        p = f"model.layers.{i}."
        for n, rows in (("q", q), ("k", kv), ("v", kv)):
            shapes[p + f"self_attn.{n}_proj.weight"] = (rows, d)
            shapes[p + f"self_attn.{n}_proj.bias"] = (rows,)
        shapes |= {p + "self_attn.o_proj.weight": (d, q), p + "mlp.gate_proj.weight": (ffn, d),
                   p + "mlp.up_proj.weight": (ffn, d), p + "mlp.down_proj.weight": (d, ffn),
                   p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,)}
    return shapes


def _dtype(hf: dict, emb: torch.Tensor) -> torch.dtype:
    """The checkpoint's dtype: config.json's (`dtype`, or transformers 4's `torch_dtype`), else that of the weights
    themselves (the embedding's); float32 only where neither is a float dtype a bundle stores."""
    named = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype")))
    if named is not None:
        return named
    return emb.dtype if emb.dtype in _DTYPES.values() else torch.float32


def import_hf(hf_dir: str | Path, out: str | Path, *, dataset_version: str = "unknown (imported)") -> Bundle:
    hf_dir = Path(hf_dir)
    if (hf_dir / "config.yaml").is_file() and not (hf_dir / "config.json").exists():
        raise BundleError(f"{hf_dir}: an m31r bundle (config.yaml), not a Hugging Face checkpoint: it needs no import "
                          "(`m31r bundle export-hf` goes the other way)")
    for name in ("config.json", "tokenizer.json"):
        if not (hf_dir / name).is_file():
            if why := unfinished(hf_dir):  # an export-hf that was killed
                raise BundleError(why)
            raise BundleError(f"{hf_dir / name}: missing; an HF checkpoint directory needs it")
    hf = _json_object(hf_dir / "config.json")
    try:
        tok = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    except Exception as e:  # tokenizers raises a bare Exception on a file it cannot read
        raise BundleError(f"{hf_dir / 'tokenizer.json'}: cannot be loaded as a tokenizer: {e}") from None
    try:
        config = _hf_config(hf_dir, hf, tok)
    except KeyError as e:
        raise BundleError(f"{hf_dir / 'config.json'}: missing key {e}") from None
    except (TypeError, ValueError) as e:  # a field of the wrong type where a number or a mapping belongs
        raise BundleError(f"{hf_dir / 'config.json'}: {e}") from None
    src, origin = _read_tensors(hf_dir)
    if not config.qkv_bias and any(k.endswith(".bias") for k in src):
        raise _refuse(hf_dir, "the checkpoint has bias tensors")
    shapes = _hf_shapes(config)

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise BundleError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        if tuple(src[name].shape) != shapes[name]:
            raise BundleError(f"{origin[name]}: tensor {name} has shape {list(src[name].shape)}, config.json implies "
                              f"{list(shapes[name])}")
        return src.pop(name)

    emb = take("model.embed_tokens.weight")
    sd = {"tok_embeddings.weight": emb, "norm.weight": take("model.norm.weight")}
    if config.tie_embeddings:
        head = take("lm_head.weight") if "lm_head.weight" in src else None
        if head is not None and not torch.equal(head, emb):
            raise _refuse(hf_dir, "lm_head.weight differs from the embedding, yet tie_word_embeddings is true")
    else:
        head = take("lm_head.weight")
        if torch.equal(head, emb):  # saved untied but the same matrix: keep one copy
            config = msgspec.structs.replace(config, tie_embeddings=True)
        else:
            sd["output.weight"] = head
    for i in range(config.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        sd[q + "attention.wqkv.weight"] = torch.cat([take(p + f"self_attn.{n}_proj.weight") for n in "qkv"], 0)
        if config.qkv_bias:
            sd[q + "attention.wqkv.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
        sd[q + "attention.wo.weight"] = take(p + "self_attn.o_proj.weight")
        sd[q + "feed_forward.w13.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")], 0)
        sd[q + "feed_forward.w2.weight"] = take(p + "mlp.down_proj.weight")
        sd[q + "attention_norm.weight"] = take(p + "input_layernorm.weight")
        sd[q + "ffn_norm.weight"] = take(p + "post_attention_layernorm.weight")
    if src:
        raise _refuse(hf_dir, f"unrecognised tensor {next(iter(src))}")
    return write_bundle(out, config, sd, tok, dtype=_dtype(hf, emb), seed=-1, dataset_version=dataset_version,
                        model_version="imported", extra={"source": "hf-import", "source_dir": hf_dir.name})

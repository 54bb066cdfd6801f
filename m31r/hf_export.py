"""Write an M31R bundle as a Hugging Face checkpoint: the inverse of m31r.hf_import.

Our block is Llama's up to naming and fusion, so the export only renames and splits: `wqkv` into q/k/v (and its bias
into q/k/v biases), `w13` into gate/up, `output` into `lm_head`. A plain bundle becomes a `LlamaForCausalLM`; one
with q/k/v biases a `Qwen2ForCausalLM` (Llama's `attention_bias` would bias o_proj too). RoPE stays in the
rotate-half layout both families use, and the config is written in both transformers 4 (`rope_theta`,
`rope_scaling`) and 5 (`rope_parameters`) spellings. Tools that read HF checkpoints (transformers, llama.cpp's
convert_hf_to_gguf.py) then run the same model; `import-hf` of the export gives back the same weights.
Quantized bundles are refused: int8/int4 codes have no Llama spelling, export the float bundle they came from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from m31r.bundle import Bundle, BundleError, finite, load_weights, open_bundle
from m31r.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def hf_config(config: ModelConfig, dtype: str, token_ids: dict[str, int | None]) -> dict:
    """config.json for transformers' LlamaForCausalLM (Qwen2ForCausalLM with q/k/v biases) computing `config`."""
    rope: dict = {"rope_type": "default"}
    if (s := config.rope_scaling) is not None:
        rope = {"rope_type": s.type, "factor": s.factor}
        if s.type == "llama3":
            rope |= {"low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                     "original_max_position_embeddings": s.original_max_context}
    family = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "use_sliding_window": False,
              "max_window_layers": config.n_layers} if config.qkv_bias else {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "attention_bias": False, "mlp_bias": False,
        "head_dim": config.head_dim, "pretraining_tp": 1}
    return {
        **family, "vocab_size": config.vocab_size, "hidden_size": config.d_model,
        "intermediate_size": config.ffn_hidden, "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads, "num_key_value_heads": config.kv_heads, "hidden_act": "silu",
        "max_position_embeddings": config.max_context, "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta, "rope_scaling": None if config.rope_scaling is None else rope,
        "rope_parameters": {**rope, "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": token_ids["eos"], "pad_token_id": token_ids["pad"],
        "dtype": dtype, "torch_dtype": dtype,
    }


def to_hf_state_dict(config: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensor names and fused matrices to HF's: wqkv splits into q/k/v, w13 into gate/up."""
    hd, ffn = config.head_dim, config.ffn_hidden
    qkv = [config.n_heads * hd, config.kv_heads * hd, config.kv_heads * hd]
    out = {"model.embed_tokens.weight": sd["tok_embeddings.weight"], "model.norm.weight": sd["norm.weight"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = sd["output.weight"]
    for i in range(config.n_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        for n, w in zip("qkv", sd[q + "attention.wqkv.weight"].split(qkv), strict=True):
            out[p + f"self_attn.{n}_proj.weight"] = w
        if config.qkv_bias:
            for n, b in zip("qkv", sd[q + "attention.wqkv.bias"].split(qkv), strict=True):
                out[p + f"self_attn.{n}_proj.bias"] = b
        gate, up = sd[q + "feed_forward.w13.weight"].split([ffn, ffn])
        out |= {
            p + "self_attn.o_proj.weight": sd[q + "attention.wo.weight"],
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": sd[q + "feed_forward.w2.weight"],
            p + "input_layernorm.weight": sd[q + "attention_norm.weight"],
            p + "post_attention_layernorm.weight": sd[q + "ffn_norm.weight"],
        }
    return out


def tokenizer_config(config: ModelConfig) -> dict:
    """tokenizer_config.json: tokenizer.json as it is (no BOS, nothing added), with the bundle's end and pad tokens."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": config.eos_token,
            "pad_token": config.pad_token, "unk_token": None, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": config.max_context}


def _converted(b: Bundle, name: str, t: torch.Tensor, dtype: str) -> torch.Tensor:
    """`t` (finite: load_weights checked) in `dtype`, refused where a value overflows it (float16 tops out at 65504):
    the export held infinities, which transformers turns into NaN logits, and import-hf refuses."""
    out = t.to(DTYPES[dtype]).contiguous()
    if not finite(out):
        raise BundleError(f"{b.path}: tensor {name} has values beyond {dtype}'s range (largest magnitude "
                          f"{t.abs().max().item():.4g}): export it as float32 or bfloat16 instead")
    return out


def export_hf(bundle: str | Path | Bundle, out: str | Path, *, dtype: str | None = None) -> Path:
    """Write `bundle` as an HF checkpoint directory `out`: config.json, model.safetensors, tokenizer.json and
    tokenizer_config.json. `dtype` (float32, bfloat16, float16) defaults to the bundle's."""
    b = bundle if isinstance(bundle, Bundle) else open_bundle(bundle)
    if b.quantization:
        raise BundleError(f"{b.path}: quantized ({b.quantization['method']}); a Hugging Face checkpoint holds float "
                          f"weights, so export the float bundle it came from")
    dtype = dtype or b.metadata["dtype"]
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out)
    config = b.config
    tensors = {k: _converted(b, k, v, dtype) for k, v in to_hf_state_dict(config, load_weights(b)).items()}
    out.mkdir(parents=True, exist_ok=True)
    try:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    except SafetensorError as e:  # a full disk, an I/O error: not an OSError
        raise OSError(f"{out / 'model.safetensors'}: cannot write: {e}") from None
    shutil.copyfile(b.tokenizer_path, out / "tokenizer.json")
    tok = HFTokenizer.from_file(str(b.tokenizer_path))
    token_ids = {"eos": tok.token_to_id(config.eos_token), "pad": tok.token_to_id(config.pad_token)}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(config), indent=2) + "\n")
    # Last: config.json is what makes a folder a checkpoint, so an export stopped before it never imports.
    (out / "config.json").write_text(json.dumps(hf_config(config, dtype, token_ids), indent=2) + "\n")
    return out

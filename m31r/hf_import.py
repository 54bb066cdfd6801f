"""Convert a Hugging Face Llama or Qwen2 checkpoint into an M31R bundle.

Both layouts are ours up to naming and fusion: q/k/v become one `wqkv` (Qwen2's q/k/v biases one `wqkv.bias`),
gate/up one `w13`, a separate `lm_head` the `output` matrix. GQA, rope_theta and RoPE scaling of the `linear`
and `llama3` types carry over as config fields. An embedding padded beyond the tokenizer is kept as it is; the
engine never emits the padding ids. Anything the M31R block cannot express (other architectures, an o_proj or
MLP bias, other activations, sliding-window attention, other RoPE scalings, quantized weights, RoPE fields whose two
transformers spellings disagree, a tokenizer that adds a BOS to every prompt) is refused by name rather than
converted into a model that silently computes something else; so are weights that are not finite, or not
in the bundle dtype's range, and sharded weights whose files disagree with their index or with each other.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import msgspec
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as HFTokenizer

from m31r.bundle import Bundle, BundleError, check_tokenizer, finite, write_bundle
from m31r.checksums import unfinished
from m31r.config import ConfigError, ModelConfig, parse_config

_FIM_SPELLINGS = {
    "fim_prefix_token": ("<|fim_prefix|>", "<fim_prefix>", "<fim-prefix>"),
    "fim_suffix_token": ("<|fim_suffix|>", "<fim_suffix>", "<fim-suffix>"),
    "fim_middle_token": ("<|fim_middle|>", "<fim_middle>", "<fim-middle>"),
}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# safetensors' names of the float dtypes a checkpoint's weights may be stored in (float64 is converted); integer and
# float8 tensors are codes that need scales this import does not apply.
_STORED = ("F32", "BF16", "F16", "F64")
INDEX = "model.safetensors.index.json"
# model_type -> the architecture class it must name, and whether its q/k/v projections carry biases.
FAMILIES = {"llama": ("LlamaForCausalLM", False), "qwen2": ("Qwen2ForCausalLM", True)}
ROPE_SCALINGS = ("linear", "llama3")
# What transformers' LlamaConfig and Qwen2Config (4.x and 5.x alike) take for a field config.json leaves out, so that
# a config written by hand or trimmed is read as transformers reads it. (Qwen2's num_key_value_heads default, 32, makes
# transformers itself refuse most such checkpoints: it is left as num_attention_heads.)
HF_DEFAULTS = {"llama": {"rms_norm_eps": 1e-6, "max_position_embeddings": 2048},
               "qwen2": {"rms_norm_eps": 1e-6, "max_position_embeddings": 32768}}


def _refuse(hf_dir: Path, what: str) -> BundleError:
    return BundleError(f"{hf_dir / 'config.json'}: {what}; M31R imports LlamaForCausalLM and Qwen2ForCausalLM "
                       f"checkpoints of the standard shape")


def _rope(hf_dir: Path, hf: dict) -> tuple[float, dict | None]:
    """rope_theta and the scaling, from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4)."""
    for key in ("rope_scaling", "rope_parameters"):
        if not isinstance(hf.get(key) or {}, dict):
            raise BundleError(f"{hf_dir / 'config.json'}: {key} must be an object or null, got {hf[key]!r}")
    _rope_agree(hf_dir, hf)
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


def _kind(params: dict) -> object:
    return params.get("rope_type", params.get("type", "default"))


def _rope_agree(hf_dir: Path, hf: dict) -> None:
    """Refuse a config.json whose transformers 4 RoPE fields (`rope_scaling`, `rope_theta`) and transformers 5 ones
    (`rope_parameters`) say different things: transformers reads a `rope_scaling` that is set with the top-level
    `rope_theta` (10000 when absent), ignoring `rope_parameters`, which 5 reads otherwise. A transformers 5 config with
    the model card's `rope_scaling` added was imported unscaled at rope_parameters' theta, which transformers scales at
    theta 10000: which RoPE the checkpoint was trained with cannot be told."""
    scaling, params = hf.get("rope_scaling") or {}, hf.get("rope_parameters") or {}
    if not params or not (scaling or "rope_theta" in hf) or any(isinstance(v, dict) for v in params.values()):
        return  # (per-layer parameters are refused by _rope)
    old = {**scaling, "rope_type": _kind(scaling), "rope_theta": hf.get("rope_theta", 10000.0)}
    new = {**params, "rope_type": _kind(params)}
    for key in ["rope_type", *sorted(old.keys() & new.keys() - {"type", "rope_type"})]:
        a, b = old[key], new[key]
        same = a == b or (isinstance(a, int | float) and isinstance(b, int | float) and float(a) == float(b))
        if not same:
            unset = " (unset: the default)" if key == "rope_theta" and "rope_theta" not in hf else ""
            raise BundleError(f"{hf_dir / 'config.json'}: rope_scaling and rope_theta (transformers 4's fields) give "
                              f"{key} {a!r}{unset}, rope_parameters (transformers 5's) {b!r}: transformers reads the "
                              "first where rope_scaling is set, the second otherwise; make them agree (or remove the "
                              "stale one) so that it is the RoPE the checkpoint was trained with")


def _hf_config(hf_dir: Path, hf: dict, tok: HFTokenizer) -> ModelConfig:
    arch = hf.get("architectures") or []
    family = FAMILIES.get(hf.get("model_type"))
    if family is None or (arch and arch != [family[0]]):
        raise _refuse(hf_dir, f"architecture {arch or hf.get('model_type')!r} is not supported")
    qkv_bias = family[1]
    if q := hf.get("quantization_config"):
        method = q.get("quant_method", "?") if isinstance(q, dict) else q
        raise _refuse(hf_dir, f"quantized weights (quantization_config, quant_method {method!r}) are not supported: "
                              "import the float checkpoint they were made from")
    if hf.get("attention_bias"):
        raise _refuse(hf_dir, "attention_bias puts a bias on o_proj, which the M31R block does not have")
    if hf.get("mlp_bias"):
        raise _refuse(hf_dir, "the MLP uses biases (mlp_bias)")
    if hf.get("use_sliding_window") or any(t != "full_attention" for t in hf.get("layer_types") or []):
        raise _refuse(hf_dir, "sliding-window attention is not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise _refuse(hf_dir, f"activation {hf['hidden_act']!r} is not SwiGLU (silu)")
    hf = {**hf, **{k: v for k, v in HF_DEFAULTS[hf["model_type"]].items() if hf.get(k) is None}}
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
    _check_no_added_tokens(hf_dir, tok)
    tok_cfg = hf_dir / "tokenizer_config.json"
    eos = _json_object(tok_cfg).get("eos_token") if tok_cfg.exists() else None
    eos = eos.get("content") if isinstance(eos, dict) else eos  # older files spell an AddedToken out
    special["eos_token"] = eos if isinstance(eos, str) and eos in vocab else _config_eos(hf_dir, hf, tok)
    special["pad_token"] = "<|pad|>" if "<|pad|>" in vocab else special["eos_token"]
    try:
        return parse_config({
            # (the folder's own name: `.`, a checkpoint imported from inside it, has none)
            "name": Path(os.path.abspath(hf_dir)).name,
            "n_layers": hf["num_hidden_layers"], "d_model": d, "n_heads": heads,
            "n_kv_heads": hf.get("num_key_value_heads", heads), "ffn_hidden": hf["intermediate_size"],
            "vocab_size": hf["vocab_size"], "max_context": hf["max_position_embeddings"],
            "rope_theta": theta, "norm_eps": float(hf["rms_norm_eps"]), **special,
            # Both families' transformers configs default to an untied head.
            "qkv_bias": qkv_bias, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling": scaling,
        }, str(hf_dir / "config.json"))
    except ConfigError as e:  # (it names config.json: parse_config's source)
        raise BundleError(str(e)) from None
    except KeyError as e:
        raise BundleError(f"{hf_dir / 'config.json'}: {e}") from None


def _check_no_added_tokens(hf_dir: Path, tok: HFTokenizer) -> None:
    """Refuse a tokenizer whose post_processor adds tokens to every text (a BOS such as Llama's `<s>`): transformers'
    tokenizer puts them in every prompt, as in training, while M31R's prompts are the text's tokens alone, so the
    bundle's completions differed from transformers' from the first token on."""
    if tok.num_special_tokens_to_add(False) == 0:
        return
    bare = HFTokenizer.from_str(tok.to_str())  # (without the file's padding and truncation, to name what is added)
    bare.no_padding()
    bare.no_truncation()
    enc = bare.encode("x")
    added = [t for t, special in zip(enc.tokens, enc.special_tokens_mask, strict=True) if special]
    raise BundleError(f"{hf_dir / 'tokenizer.json'}: its post_processor adds {', '.join(added)} to every text, as "
                      "transformers' tokenizer does to every prompt of this model; M31R's prompts are the text's "
                      "tokens alone, so the bundle would not compute what the checkpoint does")


def _config_eos(hf_dir: Path, hf: dict, tok: HFTokenizer) -> str:
    """The end token where tokenizer_config.json names none the tokenizer has: config.json's eos_token_id (the first
    of a list the tokenizer has), else `<|endoftext|>`; refused when the tokenizer has neither."""
    ids = hf.get("eos_token_id")
    for i in ids if isinstance(ids, list) else [ids]:
        if type(i) is int and i >= 0 and (text := tok.id_to_token(i)) is not None:
            return text
    if tok.token_to_id("<|endoftext|>") is not None:
        return "<|endoftext|>"
    raise BundleError(f"{hf_dir / 'tokenizer.json'}: no end-of-text token: neither tokenizer_config.json's eos_token "
                      f"nor config.json's eos_token_id ({ids!r}) names one of its tokens, and it has no <|endoftext|>")


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


def _weight_files(hf_dir: Path) -> tuple[list[Path], dict[str, Path] | None]:
    """The safetensors files of the checkpoint and, where it is sharded, the file its index places each tensor in.

    With model.safetensors.index.json, exactly the shards it lists: a shard missing (an interrupted download) is named,
    and a model.safetensors beside them refused, since which copy is current cannot be told (transformers would load
    that one, the index says the shards)."""
    index = hf_dir / INDEX
    if not index.is_file():
        files = sorted(hf_dir.glob("model*.safetensors"))
        if not files:
            raise BundleError(f"{hf_dir}: no model*.safetensors weights (PyTorch .bin checkpoints are not read)")
        return files, None
    weight_map = _json_object(index).get("weight_map")
    if not (isinstance(weight_map, dict) and weight_map and all(isinstance(v, str) for v in weight_map.values())):
        raise BundleError(f"{index}: weight_map must be an object naming each tensor's shard file, got "
                          f"{str(weight_map)[:80]!r}")
    places: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not shard or Path(shard).name != shard or shard in (".", ".."):
            raise BundleError(f"{index}: shard {shard!r} of tensor {name} is not a file name in {hf_dir}")
        places[name] = hf_dir / shard
    files = sorted(set(places.values()))
    for f in files:
        if not f.is_file():
            held = next(n for n, p in places.items() if p == f)
            raise BundleError(f"{f}: missing; {INDEX} lists it as the shard holding {held} (an incomplete download?)")
    single = hf_dir / "model.safetensors"
    if single.is_file() and single not in files:
        raise BundleError(f"{hf_dir}: holds both model.safetensors and the shards {INDEX} lists: two copies of the "
                          "weights, which may differ; remove the one that is not current")
    return files, places


def _open_tensors(hf_dir: Path, stack: contextlib.ExitStack) -> dict[str, tuple[object, Path]]:
    """Each tensor of the checkpoint: the open file that holds it (read one tensor at a time, when converted, so that
    the checkpoint is never in memory whole beside the bundle made of it), and that file's path (for messages)."""
    files, places = _weight_files(hf_dir)
    where: dict[str, tuple[object, Path]] = {}
    for f in files:
        try:
            sf = stack.enter_context(safe_open(str(f), framework="pt"))
            names = list(sf.keys())
        except Exception as e:  # safetensors raises SafetensorError (a bare Exception subclass) on a damaged file
            raise BundleError(f"{f}: cannot be read as safetensors ({e}): damaged or truncated?") from None
        for name in names:
            if name.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved; recomputed
                continue
            if name in where:  # the later file won, silently: a stale copy beside the current one
                raise BundleError(f"{f}: holds tensor {name}, which {where[name][1].name} holds too: two copies of the "
                                  "weights, which may differ; remove the one that is not current")
            if places is not None and places.get(name, f) != f:
                raise BundleError(f"{f}: holds tensor {name}, which {INDEX} places in {places[name].name}: shards of "
                                  "different checkpoints?")
            where[name] = (sf, f)
    for name, f in (places or {}).items():
        if name not in where and not name.endswith("rotary_emb.inv_freq"):
            raise BundleError(f"{f}: lacks tensor {name}, which {INDEX} places there: damaged, or a shard of another "
                              "checkpoint?")
    return where


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


def _dtype(hf: dict, stored: str) -> torch.dtype:
    """The checkpoint's dtype: config.json's (`dtype`, or transformers 4's `torch_dtype`), else that of the weights
    themselves (`stored`, the embedding's safetensors dtype); float32 only where neither is a float dtype a bundle
    stores."""
    named = _DTYPES.get(str(hf.get("dtype") or hf.get("torch_dtype")))
    if named is not None:
        return named
    return {"F16": torch.float16, "BF16": torch.bfloat16}.get(stored, torch.float32)


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
    # Checked before anything is written, so that a misfit names the checkpoint's file, not the half-written bundle's.
    check_tokenizer(hf_dir / "tokenizer.json", config, "config.json")
    with contextlib.ExitStack() as stack:
        src = _open_tensors(hf_dir, stack)
        return _convert(hf_dir, hf, config, tok, src, out, dataset_version)


def _convert(hf_dir: Path, hf: dict, config: ModelConfig, tok: HFTokenizer, src: dict[str, tuple[object, Path]],
             out: str | Path, dataset_version: str) -> Bundle:
    """Read, check, rename and fuse the checkpoint's tensors (`src`, from _open_tensors) and write the bundle."""
    if not config.qkv_bias and any(k.endswith(".bias") for k in src):
        raise _refuse(hf_dir, "the checkpoint has bias tensors")
    shapes = _hf_shapes(config)
    if "model.embed_tokens.weight" not in src:
        raise BundleError(f"{hf_dir}: tensor model.embed_tokens.weight is missing from the checkpoint")
    sf, _ = src["model.embed_tokens.weight"]
    dtype = _dtype(hf, sf.get_slice("model.embed_tokens.weight").get_dtype())
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)

    def take(name: str) -> torch.Tensor:
        """The tensor `name` in the bundle's dtype, once its shape, dtype and values are checked."""
        if name not in src:
            raise BundleError(f"{hf_dir}: tensor {name} is missing from the checkpoint")
        sf, f = src.pop(name)
        part = sf.get_slice(name)
        if tuple(part.get_shape()) != shapes[name]:
            raise BundleError(f"{f}: tensor {name} has shape {list(part.get_shape())}, config.json implies "
                              f"{list(shapes[name])}")
        if part.get_dtype() not in _STORED:  # int8/uint8/fp8 codes without their scales: not weights
            raise BundleError(f"{f}: tensor {name} is {part.get_dtype()}, not float weights (a quantized "
                              "checkpoint?): import the float checkpoint")
        try:
            t = sf.get_tensor(name)
        except Exception as e:  # SafetensorError: data the header describes but the file lacks
            raise BundleError(f"{f}: tensor {name} cannot be read ({e}): damaged or truncated?") from None
        # A bundle of NaN or infinite weights was written, and refused only when loaded ("restore the bundle").
        if not finite(t):
            raise BundleError(f"{f}: tensor {name} holds {torch.isnan(t).sum().item()} NaN and "
                              f"{torch.isinf(t).sum().item()} infinite values: a damaged or diverged checkpoint")
        converted = t.to(dtype)
        if not finite(converted):
            raise BundleError(f"{f}: tensor {name} has values beyond {dtype_name}'s range (largest magnitude "
                              f"{t.abs().max().item():.4g}), the dtype config.json names: set its dtype (and "
                              "torch_dtype) to float32 or bfloat16 to import it")
        return converted

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
    return write_bundle(out, config, sd, tok, dtype=dtype, seed=-1, dataset_version=dataset_version,
                        model_version="imported", extra={"source": "hf-import", "source_dir": hf_dir.name})

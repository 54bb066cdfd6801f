"""The release bundle (README "Layout": release/): write it, verify it, memory-map its weights.

A bundle is a directory of exactly five files. `checksum.txt` is in `sha256sum` format, so the bundle
can be checked with coreutils too. Every failure raises BundleError naming the file and the fault:
the daemon refuses to start on a bundle it cannot trust.

Weights are float (fp32/bf16/fp16) or quantized (metadata `quantization`: int8, or int4 with a group size;
see m31r.quant for the tensor layout). A quantized bundle stores plain, machine-independent codes, so
loading stays a memory map (int4 codes are packed for the CPU's kernel at load).
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from m31r.checksums import (
    CHECKSUM_FILE,
    CONTENT_FILES,
    BundleError,
    check_present,
    fingerprint,
    sha256_file,
    verify_checksums,
)
from m31r.config import ConfigError, ModelConfig, load_config
from m31r.model import expected_shapes
from m31r.quant import INT4_GROUP_SIZES, METHODS, quantize_state_dict, quantized_tensor_specs

FORMAT_VERSION = 1
METADATA_KEYS = (
    "format_version", "model_name", "model_version", "parameter_count", "dtype", "config_hash",
    "tokenizer_hash", "dataset_version", "training_seed", "created",
)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}
_FLOAT_ST = ("F32", "BF16", "F16")
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
ALIGN = 64  # tensor data offsets in model.safetensors; the int8 CPU kernel faults on weights below 16-byte alignment


@dataclass(frozen=True)
class Bundle:
    path: Path
    config: ModelConfig
    metadata: dict
    fingerprint: str  # identifies these exact bytes: cache entries and clients key on it

    @property
    def weights_path(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def tokenizer_path(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def model_id(self) -> str:
        return f"{self.metadata['model_name']}@{self.metadata['model_version']}"

    @property
    def quantization(self) -> dict | None:
        """{"method": "int8"} or {"method": "int4", "group_size": 64}; None for float weights."""
        return self.metadata.get("quantization")


def save_aligned(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """Write a safetensors file whose tensors start at multiples of ALIGN in the file, so the memory-mapped tensors
    are aligned too (mmap is page-aligned). The format allows trailing spaces in the header and no gaps between
    tensors, so tensors whose sizes are multiples of ALIGN (all of them, for real model shapes) go first; the
    loader copies any tensor that still ends up misaligned."""
    order = sorted(tensors, key=lambda k: (tensors[k].nbytes % ALIGN != 0, k))
    header: dict = {"__metadata__": metadata}
    offset = 0
    for name in order:
        t = tensors[name]
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % ALIGN)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name in order:
            t = tensors[name]
            if t.nbytes:
                f.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def write_bundle(
    out: str | Path,
    config: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    tokenizer: HFTokenizer,
    *,
    dtype: torch.dtype = torch.bfloat16,
    seed: int,
    dataset_version: str,
    model_version: str = "0.1.0",
    extra: dict | None = None,
    quantization: dict | None = None,
) -> Bundle:
    """Write the five files; the one writer behind `bundle init`, `import-hf`, `quantize` and training export.

    With `quantization`, `state_dict` holds the quantized tensors (m31r.quant.quantize_state_dict): codes and
    scales are written as they are, only the norm gains take `dtype`.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if quantization:
        _check_quantization(out / "metadata.json", quantization)
        specs = quantized_tensor_specs(config, quantization["method"], quantization.get("group_size"))
    else:
        specs = {k: (shape, "float") for k, shape in expected_shapes(config).items()}
    if set(state_dict) != set(specs):
        raise BundleError(f"state dict does not match the config: {sorted(set(state_dict) ^ set(specs))[:5]}")
    tensors = {k: v.detach().to("cpu", dtype if specs[k][1] == "float" else v.dtype).contiguous()
               for k, v in state_dict.items()}
    save_aligned(tensors, out / "model.safetensors", metadata={"format": "pt"})
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "config.yaml").write_text(config.to_yaml())
    metadata = {
        "format_version": FORMAT_VERSION,
        "model_name": config.name,
        "model_version": model_version,
        "parameter_count": config.param_count(),
        "dtype": _DTYPE_NAMES[dtype],
        "config_hash": config.config_hash(),
        "tokenizer_hash": sha256_file(out / "tokenizer.json"),
        "dataset_version": dataset_version,
        "training_seed": seed,
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
        **(extra or {}),
        **({"quantization": quantization} if quantization else {}),
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    lines = [f"{sha256_file(out / name)}  {name}\n" for name in CONTENT_FILES]
    (out / CHECKSUM_FILE).write_text("".join(lines))
    return open_bundle(out)


def safetensors_header(path: Path) -> tuple[dict, int]:
    """The tensor table of a safetensors file and the offset where tensor data starts."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise BundleError(f"{path}: truncated, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if n > size - 8:
            raise BundleError(f"{path}: header length {n} exceeds the file size {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise BundleError(f"{path}: unreadable safetensors header: {e}") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def open_bundle(path: str | Path, *, verify: bool = True) -> Bundle:
    """Check a bundle end to end without reading the weights into memory; abort on the first fault."""
    path = Path(path)
    check_present(path)
    if verify:
        verify_checksums(path)
    try:
        config = load_config(path / "config.yaml")
    except ConfigError as e:
        raise BundleError(str(e)) from None
    try:
        metadata = json.loads((path / "metadata.json").read_text())
    except ValueError as e:
        raise BundleError(f"{path / 'metadata.json'}: not valid JSON: {e}") from None
    missing = [k for k in METADATA_KEYS if k not in metadata]
    if missing:
        raise BundleError(f"{path / 'metadata.json'}: missing keys {', '.join(missing)}")
    quantization = metadata.get("quantization")
    if quantization is not None:
        _check_quantization(path / "metadata.json", quantization)
    _check_tokenizer(path / "tokenizer.json", config)
    _check_weights(path / "model.safetensors", config, quantization)
    # Traceability: the recorded hashes must describe the files actually shipped (metadata.json names them).
    if metadata["config_hash"] != config.config_hash():
        raise BundleError(f"{path / 'config.yaml'}: does not match config_hash in metadata.json (edited after export?)")
    if metadata["tokenizer_hash"] != sha256_file(path / "tokenizer.json"):
        raise BundleError(f"{path / 'tokenizer.json'}: does not match tokenizer_hash in metadata.json")
    return Bundle(path=path, config=config, metadata=metadata, fingerprint=fingerprint(path))


def _check_tokenizer(f: Path, config: ModelConfig) -> None:
    try:
        tok = HFTokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise BundleError(f"{f}: cannot be loaded as a tokenizer: {e}") from None
    # A tokenizer may be smaller than the embedding (imported checkpoints pad it to a round size; the engine never
    # emits the ids past it), never larger: every id it produces must have a row.
    size = tok.get_vocab_size(with_added_tokens=True)
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if size > config.vocab_size:
        raise BundleError(f"{f}: tokenizer has {size} tokens but config.yaml vocab_size is {config.vocab_size}")
    if top >= config.vocab_size:
        raise BundleError(f"{f}: tokenizer id {top} is past config.yaml vocab_size {config.vocab_size}")
    for role, text in config.special_tokens.items():
        if tok.token_to_id(text) is None:
            raise BundleError(f"{f}: special token {text!r} ({role} in config.yaml) is not in the tokenizer")


def _check_quantization(f: Path, q: object) -> None:
    if not isinstance(q, dict) or q.get("method") not in METHODS:
        raise BundleError(f"{f}: quantization must be {{\"method\": one of {', '.join(METHODS)}, ...}}, got {q!r}")
    if q["method"] == "int4" and q.get("group_size") not in INT4_GROUP_SIZES:
        raise BundleError(f"{f}: int4 quantization needs group_size in {INT4_GROUP_SIZES}, got {q.get('group_size')!r}")


def _check_weights(f: Path, config: ModelConfig, quantization: dict | None = None) -> None:
    header, _ = safetensors_header(f)
    if quantization:
        try:
            specs = quantized_tensor_specs(config, quantization["method"], quantization.get("group_size"))
        except ValueError as e:
            raise BundleError(f"{f}: {e}") from None
    else:
        specs = {k: (shape, "float") for k, shape in expected_shapes(config).items()}
    missing = sorted(set(specs) - set(header))
    if missing:
        kind = f"{quantization['method']} " if quantization else ""
        raise BundleError(f"{f}: {len(missing)} tensors missing for config.yaml, e.g. {kind}{missing[0]}")
    extra = sorted(set(header) - set(specs))
    if extra:
        raise BundleError(f"{f}: unexpected tensor {extra[0]} (not part of this config's model)")
    for name, (shape, st_dtype) in specs.items():
        got = tuple(header[name]["shape"])
        if got != shape:
            raise BundleError(f"{f}: tensor {name} has shape {list(got)}, config.yaml implies {list(shape)}")
        dtype = header[name]["dtype"]
        if dtype not in (_FLOAT_ST if st_dtype == "float" else (st_dtype,)):
            raise BundleError(f"{f}: tensor {name} has unsupported dtype {dtype}")


def load_weights(bundle: Bundle) -> dict[str, torch.Tensor]:
    """Memory-map the weights: tensors alias a private copy-on-write map, so loading copies nothing."""
    header, data_start = safetensors_header(bundle.weights_path)
    with open(bundle.weights_path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = {}
    for name, info in header.items():
        dtype = _ST_DTYPES[info["dtype"]]
        begin, end = info["data_offsets"]
        numel = (end - begin) // dtype.itemsize
        t = torch.frombuffer(mm, dtype=dtype, count=numel, offset=data_start + begin)
        tensors[name] = t.view(info["shape"])
    return tensors


def init_bundle(
    config: ModelConfig, out: str | Path, *, seed: int, tokenizer: HFTokenizer | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Bundle:
    """A random-weight bundle (tests, benchmarks): deterministic for a given seed."""
    from m31r.model import Transformer, init_weights
    from m31r.tokenizer import build_byte_tokenizer

    model = Transformer(config)
    init_weights(model, seed)
    tok = tokenizer or build_byte_tokenizer(config.vocab_size)
    return write_bundle(out, config, model.state_dict(), tok, dtype=dtype, seed=seed,
                        dataset_version="none (random init)", model_version="0.0.0-random")


def quantize_bundle(src: str | Path, out: str | Path, method: str, group_size: int = 64) -> Bundle:
    """Write a copy of the float bundle `src` with int8 or int4 weights (m31r.quant) into `out`."""
    source = open_bundle(src)
    if source.quantization:
        raise BundleError(f"{source.path}: already quantized ({source.quantization['method']}); quantize the float "
                          f"bundle it came from")
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; choose one of {', '.join(METHODS)}")
    if method == "int4" and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    q = {"method": method, **({"group_size": group_size} if method == "int4" else {})}
    tensors = quantize_state_dict(source.config, load_weights(source), method, group_size)
    meta = source.metadata
    dtype = _DTYPES_BY_NAME[meta["dtype"]]
    keep = {k: v for k, v in meta.items() if k not in METADATA_KEYS and k != "quantization"}
    return write_bundle(
        out, source.config, tensors, HFTokenizer.from_file(str(source.tokenizer_path)), dtype=dtype,
        seed=meta["training_seed"], dataset_version=meta["dataset_version"], model_version=meta["model_version"],
        extra={**keep, "quantized_from": source.fingerprint}, quantization=q,
    )


def average_bundles(sources: list[str | Path], weights: list[float], out: str | Path, *,
                    model_version: str) -> Bundle:
    """Write the weighted average of float bundles of one shape and tokenizer into `out` (a "model soup").

    Fine-tunes of one parent sit in one basin, so their average is a model too, often better than each: a phase
    that gained multi-line completions and lost single-line ones can be averaged back toward its parent. The
    first source's training record stays in the metadata, as the line the others branch from; `averaged_from`
    names every source with its weight.
    """
    if len(sources) < 2 or len(weights) != len(sources):
        raise ValueError(f"need two or more bundles and one weight each, got {len(sources)} and {len(weights)}")
    if any(not w >= 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {weights}")
    total = sum(weights)
    weights = [w / total for w in weights]
    bundles = [open_bundle(p) for p in sources]
    first = bundles[0]
    for b in bundles:
        if b.quantization:
            raise BundleError(f"{b.path}: quantized ({b.quantization['method']}); average the float bundles")
        for key in ("config_hash", "tokenizer_hash"):
            if b.metadata[key] != first.metadata[key]:
                raise BundleError(f"{b.path}: its {key.split('_')[0]} differs from {first.path}'s; only bundles of "
                                  f"one shape and tokenizer can be averaged")
    state: dict[str, torch.Tensor] = {}
    for b, w in zip(bundles, weights, strict=True):
        for name, t in load_weights(b).items():
            state[name] = state[name] + w * t.float() if name in state else w * t.float()
    meta = first.metadata
    keep = {k: v for k, v in meta.items() if k not in METADATA_KEYS}
    parents = [{"model": b.model_id, "fingerprint": b.fingerprint, "weight": round(w, 6),
                "tokens_seen": b.metadata.get("tokens_seen")} for b, w in zip(bundles, weights, strict=True)]
    dtype = _DTYPES_BY_NAME[meta["dtype"]]
    return write_bundle(
        out, first.config, state, HFTokenizer.from_file(str(first.tokenizer_path)), dtype=dtype,
        seed=meta["training_seed"], dataset_version=meta["dataset_version"], model_version=model_version,
        extra={**keep, "averaged_from": parents},
    )

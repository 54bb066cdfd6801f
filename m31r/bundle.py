"""The release bundle (17_SERVING §5–8, 06 §28–29): write it, verify it, memory-map its weights.

A bundle is a directory of exactly five files. `checksum.txt` is in `sha256sum` format, so the bundle
can be checked with coreutils too. Every failure raises BundleError naming the file and the fault:
the daemon refuses to start on a bundle it cannot trust.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer

from m31r.config import ConfigError, ModelConfig, load_config
from m31r.model import expected_shapes

FORMAT_VERSION = 1
CONTENT_FILES = ("model.safetensors", "tokenizer.json", "config.yaml", "metadata.json")
CHECKSUM_FILE = "checksum.txt"
METADATA_KEYS = (
    "format_version", "model_name", "model_version", "parameter_count", "dtype", "config_hash",
    "tokenizer_hash", "dataset_version", "training_seed", "created",
)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


class BundleError(RuntimeError):
    """A bundle that must not be loaded; the message names the file and what is wrong."""


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


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
) -> Bundle:
    """Write the five files; the one writer behind `bundle init`, `import-hf` and training export."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(config)
    if set(state_dict) != set(shapes):
        raise BundleError(f"state dict does not match the config: {sorted(set(state_dict) ^ set(shapes))[:5]}")
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state_dict.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
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
    }
    (out / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    lines = [f"{sha256_file(out / name)}  {name}\n" for name in CONTENT_FILES]
    (out / CHECKSUM_FILE).write_text("".join(lines))
    return open_bundle(out)


def _read_checksums(path: Path) -> dict[str, str]:
    f = path / CHECKSUM_FILE
    if not f.is_file():
        raise BundleError(f"{f}: missing; a bundle needs {CHECKSUM_FILE} beside {', '.join(CONTENT_FILES)}")
    sums: dict[str, str] = {}
    for n, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
        parts = line.split()
        if len(parts) != 2 or len(parts[0]) != 64 or any(c not in "0123456789abcdef" for c in parts[0]):
            raise BundleError(f"{f}: line {n} is not '<sha256>  <file>': {line[:80]!r}")
        sums[parts[1].lstrip("*")] = parts[0]
    if set(sums) != set(CONTENT_FILES):
        raise BundleError(f"{f}: must list exactly {', '.join(CONTENT_FILES)}; lists {', '.join(sorted(sums))}")
    return sums


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
    if not path.is_dir():
        raise BundleError(f"{path}: not a bundle directory")
    for name in (*CONTENT_FILES, CHECKSUM_FILE):
        if not (path / name).is_file():
            raise BundleError(f"{path / name}: missing from the bundle")
    if verify:
        for name, expected in _read_checksums(path).items():
            got = sha256_file(path / name)
            if got != expected:
                raise BundleError(
                    f"{path / name}: checksum mismatch (checksum.txt has {expected[:16]}…, the file hashes to "
                    f"{got[:16]}…): the file is corrupt or was modified"
                )
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
    _check_tokenizer(path / "tokenizer.json", config)
    _check_weights(path / "model.safetensors", config)
    # Traceability (06 §29): the recorded hashes must describe the files actually shipped.
    if metadata["config_hash"] != config.config_hash():
        raise BundleError(f"{path / 'config.yaml'}: does not match config_hash in metadata.json (edited after export?)")
    if metadata["tokenizer_hash"] != sha256_file(path / "tokenizer.json"):
        raise BundleError(f"{path / 'tokenizer.json'}: does not match tokenizer_hash in metadata.json")
    fingerprint = hashlib.sha256((path / CHECKSUM_FILE).read_bytes()).hexdigest()[:16]
    return Bundle(path=path, config=config, metadata=metadata, fingerprint=fingerprint)


def _check_tokenizer(f: Path, config: ModelConfig) -> None:
    try:
        tok = HFTokenizer.from_file(str(f))
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise BundleError(f"{f}: cannot be loaded as a tokenizer: {e}") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != config.vocab_size:
        raise BundleError(f"{f}: tokenizer has {size} tokens but config.yaml vocab_size is {config.vocab_size}")
    for role, text in config.special_tokens.items():
        if tok.token_to_id(text) is None:
            raise BundleError(f"{f}: special token {text!r} ({role} in config.yaml) is not in the tokenizer")


def _check_weights(f: Path, config: ModelConfig) -> None:
    header, _ = safetensors_header(f)
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(header))
    if missing:
        raise BundleError(f"{f}: {len(missing)} tensors missing for config.yaml, e.g. {missing[0]}")
    extra = sorted(set(header) - set(expected))
    if extra:
        raise BundleError(f"{f}: unexpected tensor {extra[0]} (not part of this config's model)")
    for name, shape in expected.items():
        got = tuple(header[name]["shape"])
        if got != shape:
            raise BundleError(f"{f}: tensor {name} has shape {list(got)}, config.yaml implies {list(shape)}")
        if header[name]["dtype"] not in _ST_DTYPES:
            raise BundleError(f"{f}: tensor {name} has unsupported dtype {header[name]['dtype']}")


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

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
import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer

from m31r.checksums import (
    CHECKSUM_FILE,
    CONTENT_FILES,
    RESTORE,
    BundleError,
    check_present,
    fingerprint,
    sha256_file,
    verify_checksums,
)
from m31r.config import ConfigError, ModelConfig, load_config
from m31r.model import expected_shapes
from m31r.quant import INT4_GROUP_SIZES, METHODS, quantize_state_dict, quantized_tensor_specs
from m31r.tokenizer import guard_user_text

FORMAT_VERSION = 1
METADATA_KEYS = (
    "format_version", "model_name", "model_version", "parameter_count", "dtype", "config_hash",
    "tokenizer_hash", "dataset_version", "training_seed", "created",
)
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_DTYPES_BY_NAME = {v: k for k, v in _DTYPE_NAMES.items()}
_METADATA_INTS = ("format_version", "parameter_count", "training_seed")  # the other METADATA_KEYS but dtype: strings
_FLOAT_ST = ("F32", "BF16", "F16")
_ST_NAMES = {v: k for k, v in _ST_DTYPES.items()}
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header
# metadata.json: the release's is 220 KB (its training record); one past this is no metadata, and is not parsed.
MAX_METADATA_BYTES = 16 << 20
# tokenizer.json: the release's is 1.1 MB, a 150k-entry Llama/Qwen one under 12 MB; one past this is not parsed.
MAX_TOKENIZER_BYTES = 64 << 20
ALIGN = 64  # tensor data offsets in model.safetensors; the int8 CPU kernel faults on weights below 16-byte alignment


@dataclass(frozen=True)
class Bundle:
    path: Path
    config: ModelConfig
    metadata: dict
    fingerprint: str  # identifies these exact bytes: cache entries and clients key on it
    # The tokenizer check_tokenizer parsed and checked (one capped read): what the engine serves, rather than a second,
    # unbounded read of a file that may have changed since it was checked.
    tokenizer: HFTokenizer = field(compare=False, repr=False)

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
    """The tensor table of a safetensors file and the offset where tensor data starts.

    Checked as the safetensors library checks it, so that a file that passes here also maps: every entry names a
    known dtype, a shape and offsets whose span is exactly the shape's bytes, and the tensors tile the data that
    follows the header from its first byte to the end of the file, without gaps or overlaps."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise BundleError(f"{path}: truncated, no safetensors header")
        (n,) = struct.unpack("<Q", head)
        size = path.stat().st_size
        if n > size - 8:
            raise BundleError(f"{path}: header length {n} exceeds the file size {size}")
        if n > MAX_HEADER_BYTES:
            raise BundleError(f"{path}: header length {n} is over the {MAX_HEADER_BYTES:,} bytes safetensors allows")
        try:
            header = json.loads(f.read(n), object_pairs_hook=_unique_keys)
        except ValueError as e:
            raise BundleError(f"{path}: unreadable safetensors header: {e}") from None
        except RecursionError:
            raise BundleError(f"{path}: unreadable safetensors header: nested too deeply") from None
    if not isinstance(header, dict):
        raise BundleError(f"{path}: the safetensors header must be a JSON object, not {type(header).__name__}")
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise BundleError(f"{path}: the header's __metadata__ must map names to strings, got {str(meta)[:80]}")
    spans = sorted((_tensor_span(path, name, info), name) for name, info in header.items())
    data = size - 8 - n
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            what = "overlaps the tensor before it" if begin < end else f"leaves a gap of {begin - end} bytes before it"
            raise BundleError(f"{path}: tensor {name} at data offset {begin} {what} (the data ends at {end} there)")
        end = stop
    if end != data:
        raise BundleError(f"{path}: the tensors cover {end} bytes of data but the file holds {data} after the header "
                          f"({'truncated' if end > data else 'trailing bytes'})")
    return header, 8 + n


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object whose keys are distinct: json keeps the last of a repeated key, so two entries for one tensor
    would name one of them silently."""
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"{dup!r} appears twice")
    return out


def _tensor_span(path: Path, name: str, info: object) -> tuple[int, int]:
    """One header entry's [begin, end) data offsets, once its dtype, shape and offsets agree with each other."""
    if not isinstance(info, dict):
        raise BundleError(f"{path}: header entry {name} must be an object with dtype, shape and data_offsets")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in _ST_DTYPES:
        raise BundleError(f"{path}: tensor {name} has unsupported dtype {dtype!r} (one of {', '.join(_ST_DTYPES)})")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise BundleError(f"{path}: tensor {name} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise BundleError(f"{path}: tensor {name} has data_offsets {offsets!r}, not [begin, end] with "
                          "0 <= begin <= end")
    nbytes = math.prod(shape) * _ST_DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise BundleError(f"{path}: tensor {name} spans {offsets[1] - offsets[0]} bytes but its shape {shape} of "
                          f"{dtype} needs {nbytes}")
    return offsets[0], offsets[1]


def open_bundle(path: str | Path, *, verify: bool = True) -> Bundle:
    """Check a bundle end to end without reading the weights into memory; abort on the first fault. Nothing here
    allocates more than a bounded read of the small files, so a hostile bundle is refused before torch allocates
    anything it describes (see _check_fits)."""
    path = Path(path)
    try:
        return _open_bundle(path, verify)
    except OSError as e:  # a file that cannot be read (permissions, an I/O error on a damaged stick)
        way = "check its permissions" if isinstance(e, PermissionError) else RESTORE
        raise BundleError(f"{e.filename or path}: cannot be read ({e.strerror or e}): {way}") from None


def _open_bundle(path: Path, verify: bool) -> Bundle:
    check_present(path)
    if verify:
        verify_checksums(path)
    try:
        config = load_config(path / "config.yaml")
    except ConfigError as e:
        raise BundleError(str(e)) from None
    metadata = _read_metadata(path / "metadata.json")
    _check_metadata(path / "metadata.json", metadata)
    quantization = metadata.get("quantization")
    if quantization is not None:
        _check_quantization(path / "metadata.json", quantization)
    tokenizer = check_tokenizer(path / "tokenizer.json", config)
    _check_weights(path / "model.safetensors", config, quantization)
    # Traceability: the recorded hashes must describe the files actually shipped (metadata.json names them).
    if metadata["config_hash"] != config.config_hash():
        raise BundleError(f"{path / 'config.yaml'}: does not match config_hash in metadata.json (edited after export?)")
    if metadata["tokenizer_hash"] != sha256_file(path / "tokenizer.json"):
        raise BundleError(f"{path / 'tokenizer.json'}: does not match tokenizer_hash in metadata.json")
    _check_fits(path / "config.yaml", config)
    return Bundle(path=path, config=config, metadata=metadata, fingerprint=fingerprint(path), tokenizer=tokenizer)


def _read_capped(f: Path, cap: int, what: str) -> bytes:
    """`f`'s bytes, refused past `cap` without reading the rest: a bundle's small files are parsed whole."""
    with open(f, "rb") as fh:
        raw = fh.read(cap + 1)
    if len(raw) > cap:
        raise BundleError(f"{f}: over {cap >> 20} MiB, not {what}: {RESTORE}")
    return raw


def _read_metadata(f: Path) -> object:
    raw = _read_capped(f, MAX_METADATA_BYTES, "a bundle's metadata")
    try:
        return json.loads(raw)
    except ValueError as e:
        raise BundleError(f"{f}: not valid JSON: {e}") from None
    except RecursionError:
        raise BundleError(f"{f}: not valid JSON: nested too deeply") from None


def load_bytes(config: ModelConfig) -> int:
    """What loading allocates beyond the memory-mapped weights and grows with max_context: the fp32 RoPE cos and
    sin tables (m31r.model.rope_tables), counted twice for the temporaries that build them. KV caches grow with the
    context they hold, so none is allocated at load."""
    return 2 * 2 * config.max_context * config.head_dim * 4


def physical_memory() -> int | None:
    """This machine's memory in bytes, where the OS says."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_fits(f: Path, config: ModelConfig) -> None:
    """Refuse, before torch allocates it, a context whose tables need more memory than the machine has: a
    max_context of 10^9 asked for 8 GB for the first position table alone and then hundreds more."""
    need, have = load_bytes(config), physical_memory()
    if have is not None and need > have:
        raise BundleError(f"{f}: max_context {config.max_context:,} needs {need / 2**30:,.1f} GiB at load for its "
                          f"position tables, more than this machine's {have / 2**30:,.1f} GiB of memory")


def _check_metadata(f: Path, metadata: object) -> None:
    """The keys every reader takes for granted (the CLI's summary, the daemon's status, quantize and average copy
    them), each of the type its writer gives it, so that a hand-edited file fails here rather than in a reader."""
    if not isinstance(metadata, dict):
        raise BundleError(f"{f}: must be a JSON object, not {type(metadata).__name__}")
    missing = [k for k in METADATA_KEYS if k not in metadata]
    if missing:
        raise BundleError(f"{f}: missing keys {', '.join(missing)}")
    for key in METADATA_KEYS:
        value = metadata[key]
        if key in _METADATA_INTS:
            if type(value) is not int or (key != "training_seed" and value < 0):
                kind = "an integer" if key == "training_seed" else "a non-negative integer"
                raise BundleError(f"{f}: {key} must be {kind}, got {value!r}")
            if key == "format_version" and value != FORMAT_VERSION:
                newer = "a newer m31r wrote it: upgrade m31r" if value > FORMAT_VERSION else "no m31r writes that"
                raise BundleError(f"{f}: format_version {value}, but this m31r reads bundles of format "
                                  f"{FORMAT_VERSION} ({newer})")
        elif key == "dtype":
            if value not in _DTYPES_BY_NAME:
                raise BundleError(f"{f}: dtype must be one of {', '.join(_DTYPES_BY_NAME)} (the float dtype of the "
                                  f"weights, or of a quantized bundle's norms), got {value!r}")
        elif not isinstance(value, str) or (key in ("model_name", "model_version") and not value):
            raise BundleError(f"{f}: {key} must be a {'non-empty ' if key in ('model_name', 'model_version') else ''}"
                              f"string, got {value!r}")
        elif key in ("model_name", "model_version") and not value.isprintable():
            # (printed as they are by `bundle verify`, the daemon's status and logs: a newline or a terminal escape
            # sequence would forge lines there)
            raise BundleError(f"{f}: {key} must be printable text, got {value[:80]!r}")


def check_tokenizer(f: Path, config: ModelConfig, config_name: str = "config.yaml") -> HFTokenizer:
    """The tokenizer in `f`, once it fits `config` (named `config_name` in messages); `bundle init --tokenizer` asks
    before it writes, so that a misfit is blamed on the user's files, not on the half-written bundle's."""
    tok = _read_tokenizer(f)
    # A tokenizer may be smaller than the embedding (imported checkpoints pad it to a round size; the engine never
    # emits the ids past it), never larger: every id it produces must have a row.
    size = tok.get_vocab_size(with_added_tokens=True)
    vocab = tok.get_vocab(with_added_tokens=True)
    top = max(vocab.values(), default=-1)
    if size > config.vocab_size:
        raise BundleError(f"{f}: tokenizer has {size} tokens but {config_name} vocab_size is {config.vocab_size}")
    if top >= config.vocab_size:
        raise BundleError(f"{f}: tokenizer id {top} is past {config_name} vocab_size {config.vocab_size}")
    ids: dict[int, str] = {}
    for role, text in config.special_tokens.items():
        if (i := tok.token_to_id(text)) is None:
            raise BundleError(f"{f}: special token {text!r} ({role} in {config_name}) is not in the tokenizer")
        # The FIM layout and the stop on eos tell these apart by id (pad may be eos: config.py checks the texts).
        if role != "pad_token" and i in ids:
            raise BundleError(f"{f}: special tokens {text!r} ({role}) and {ids[i]} have one id, {i}; the FIM format "
                              "needs them distinct")
        ids.setdefault(i, f"{text!r} ({role})")
    _check_ids_distinct(f, vocab)
    try:
        guard_user_text(tok, config.special_tokens)
    except ValueError as e:
        raise BundleError(f"{f}: {e}") from None
    _check_round_trip(f, tok)
    return tok


def _check_ids_distinct(f: Path, vocab: dict[str, int]) -> None:
    """Refuse two vocabulary entries of one id (a hand-merged vocab): text encodes to it by either, and decodes as
    one of them, so `ab` came back as `bb`, silently."""
    if len(set(vocab.values())) == len(vocab):
        return
    seen: dict[int, str] = {}
    for token, i in sorted(vocab.items(), key=lambda kv: (kv[1], kv[0])):
        if i in seen:
            raise BundleError(f"{f}: tokens {seen[i]!r} and {token!r} both have id {i}: text holding one would come "
                              "back as the other")
        seen[i] = token


ROUND_TRIP = "fn main() {\n    let N = 1;\n}\n"  # code any tokenizer for it spells back exactly


def _check_round_trip(f: Path, tok: HFTokenizer) -> None:
    """Refuse a tokenizer whose decoder does not undo its encoding: one with its "decoder" missing or wrong showed
    every completion as `fn Ġmain () Ġ{ Ċ`, silently."""
    back = tok.decode(tok.encode(ROUND_TRIP, add_special_tokens=False).ids, skip_special_tokens=True)
    if back != ROUND_TRIP:
        raise BundleError(f"{f}: decodes {ROUND_TRIP!r} back as {back[:60]!r}: its normalizer or decoder does not "
                          "give back the text it encodes (a missing or wrong \"decoder\"?)")


def _read_tokenizer(f: Path) -> HFTokenizer:
    """The tokenizer in `f`, read with a bound: the tokenizers library reads a file whole, however large."""
    raw = _read_capped(f, MAX_TOKENIZER_BYTES, "a tokenizer a bundle ships")
    try:
        return HFTokenizer.from_str(raw.decode())
    except UnicodeDecodeError as e:
        raise BundleError(f"{f}: cannot be loaded as a tokenizer: not UTF-8 ({e.reason} at byte {e.start})") from None
    except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
        raise BundleError(f"{f}: cannot be loaded as a tokenizer: {e}") from None


def _check_quantization(f: Path, q: object) -> None:
    if not isinstance(q, dict) or q.get("method") not in METHODS:
        raise BundleError(f"{f}: quantization must be {{\"method\": one of {', '.join(METHODS)}, ...}}, got {q!r}")
    # (an integer: 64.0 compares equal to 64, and was taken until a kernel refused the float deep in the engine)
    if q["method"] == "int4" and not (type(q.get("group_size")) is int and q["group_size"] in INT4_GROUP_SIZES):
        raise BundleError(f"{f}: int4 quantization needs group_size in {INT4_GROUP_SIZES}, got {q.get('group_size')!r}")


def _check_weights(f: Path, config: ModelConfig, quantization: dict | None = None) -> None:
    header, _ = safetensors_header(f)
    # Every layer has tensors of its own: a count the file cannot hold is refused before the expected names are
    # listed (n_layers: 10^9 listed them for minutes, then ran out of memory).
    if config.n_layers > len(header):
        raise BundleError(f"{f}: config.yaml has n_layers {config.n_layers:,} but the file holds {len(header)} "
                          "tensors")
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
    _check_finite(bundle.weights_path, tensors)
    return tensors


def finite(t: torch.Tensor) -> bool:
    """No NaN and no infinity in `t`. A tensor's min and max are non-finite exactly when one of its values is (both
    propagate NaN): ~5 ms for the release's 29M weights once mapped, where torch.isfinite takes ~0.5 s."""
    return not t.numel() or all(map(math.isfinite, torch.aminmax(t)))


def _check_finite(f: Path, tensors: dict[str, torch.Tensor]) -> None:
    """Refuse NaN and infinite weights, which the model would turn into garbage silently."""
    for name, t in tensors.items():
        if t.is_floating_point() and not finite(t):
            bad = torch.isnan(t).sum().item(), torch.isinf(t).sum().item()
            raise BundleError(f"{f}: tensor {name} holds {bad[0]} NaN and {bad[1]} infinite values (a diverged "
                              f"training run, or a damaged export): {RESTORE}")


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
    if method == "int4":
        _check_int4_groups(source, group_size)
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


def _check_int4_groups(source: Bundle, group_size: int) -> None:
    """Refuse, before any weight is read, a group size that does not tile every layer's input, naming the sizes that
    do (the shape is the model's, not the user's choice)."""
    def fault(g: int) -> str | None:
        try:
            quantized_tensor_specs(source.config, "int4", g)
        except ValueError as e:
            return str(e)
        return None

    if (why := fault(group_size)) is None:
        return
    fits = [str(g) for g in INT4_GROUP_SIZES if fault(g) is None]
    way = f"--group-size {' or '.join(fits)} does" if fits else "no int4 group size does: use --quant int8"
    raise BundleError(f"{source.path}: int4 groups of {group_size} do not fit this model ({why}); {way}")


WEIGHTS_RULE = "weights must be finite, non-negative numbers, at least one above 0"


def usable_weights(weights: list[float]) -> bool:
    """Whether `weights` can weigh an average (WEIGHTS_RULE): the CLI checks them before reading any bundle."""
    return bool(weights) and all(math.isfinite(w) and w >= 0 for w in weights) and max(weights) > 0


def average_bundles(sources: list[str | Path], weights: list[float], out: str | Path, *,
                    model_version: str) -> Bundle:
    """Write the weighted average of float bundles of one shape and tokenizer into `out` (a "model soup").

    Fine-tunes of one parent sit in one basin, so their average is a model too, often better than each: a phase
    that gained multi-line completions and lost single-line ones can be averaged back toward its parent. The
    first source's training record stays in the metadata, as the line the others branch from; `averaged_from`
    names every source with its weight. The average is stored in the sources' dtype, float32 where they differ.
    """
    if len(sources) < 2 or len(weights) != len(sources):
        raise ValueError(f"need two or more bundles and one weight each, got {len(sources)} and {len(weights)}")
    if not usable_weights(weights):
        raise ValueError(f"{WEIGHTS_RULE}, got {', '.join(map(str, weights))}")
    # Scaled by the largest first: the sum of weights near the float limit would overflow to inf (every weight
    # then 0), and weights too small to sum exactly stay in proportion.
    top = max(weights)
    scaled = [w / top for w in weights]
    weights = [w / sum(scaled) for w in scaled]
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
    stored: set[torch.dtype] = set()
    for b, w in zip(bundles, weights, strict=True):
        for name, t in load_weights(b).items():
            stored.add(t.dtype)
            state[name] = state[name] + w * t.float() if name in state else w * t.float()
    meta = first.metadata
    keep = {k: v for k, v in meta.items() if k not in METADATA_KEYS}
    parents = [{"model": b.model_id, "fingerprint": b.fingerprint, "weight": round(w, 6),
                "tokens_seen": b.metadata.get("tokens_seen")} for b, w in zip(bundles, weights, strict=True)]
    # The dtype the sources store, float32 where they store several: it holds each of them exactly. The first's
    # made `average A B` and `average B A` differ, and a float16 first turned a float32 source's weights past
    # 65504 into inf, written as a bundle that every load then refused.
    dtype = stored.pop() if len(stored) == 1 else torch.float32
    return write_bundle(
        out, first.config, state, HFTokenizer.from_file(str(first.tokenizer_path)), dtype=dtype,
        seed=meta["training_seed"], dataset_version=meta["dataset_version"], model_version=model_version,
        extra={**keep, "averaged_from": parents},
    )

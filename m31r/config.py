"""The model configuration: a typed, validated Struct read from YAML.

msgspec rejects unknown fields and wrong types with a message that names the field, which is the error
a user needs when a hand-edited config.yaml is wrong.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Literal

import msgspec
import yaml


class ConfigError(ValueError):
    """A config file that cannot describe a valid model."""


class RopeScaling(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, omit_defaults=True):
    """RoPE frequency scaling of an imported checkpoint, as transformers defines it.

    `linear` divides every frequency by `factor`; `llama3` (Llama 3.1) divides only the low frequencies, leaves
    the high ones and blends in between, using the three llama3 fields (which `linear` leaves unset).
    """

    type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_context: int | None = None

    def __post_init__(self) -> None:
        llama3 = (self.low_freq_factor, self.high_freq_factor, self.original_max_context)
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ValueError(f"rope_scaling `factor` must be a finite number above 0, got {self.factor}")
        if self.type == "linear" and any(v is not None for v in llama3):
            raise ValueError("rope_scaling type linear takes only `factor`")
        if self.type == "llama3":
            if any(v is None for v in llama3):
                raise ValueError("rope_scaling type llama3 needs `low_freq_factor`, `high_freq_factor` and "
                                 "`original_max_context`")
            if not 0 < self.low_freq_factor < self.high_freq_factor or self.original_max_context <= 0:
                raise ValueError("rope_scaling llama3 needs 0 < low_freq_factor < high_freq_factor and a positive "
                                 "original_max_context")


# Fields added for imported checkpoints. They are left out of to_dict (config.yaml, config_hash) while they hold
# their defaults, so configs and bundles written before they existed read, hash and verify as they always did.
_OPTIONAL_DEFAULTS = {"qkv_bias": False, "tie_embeddings": True, "rope_scaling": None}


class ModelConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    name: str = "m31r"
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int | None = None  # None = n_heads (plain multi-head attention)
    ffn_hidden: int
    vocab_size: int
    max_context: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    eos_token: str = "<|endoftext|>"
    fim_prefix_token: str = "<|fim_prefix|>"
    fim_suffix_token: str = "<|fim_suffix|>"
    fim_middle_token: str = "<|fim_middle|>"
    pad_token: str = "<|pad|>"
    qkv_bias: bool = False  # biases on the q/k/v projections (Qwen2)
    tie_embeddings: bool = True  # False: a separate LM head, `output.weight`
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for field in ("n_layers", "d_model", "n_heads", "ffn_hidden", "vocab_size", "max_context"):
            if getattr(self, field) <= 0:
                raise ValueError(f"`{field}` must be positive, got {getattr(self, field)}")
        if self.d_model % self.n_heads:
            raise ValueError(f"`d_model` ({self.d_model}) must be divisible by `n_heads` ({self.n_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head dim d_model/n_heads = {self.head_dim} must be even for RoPE")
        if self.n_kv_heads is not None and (self.n_kv_heads <= 0 or self.n_heads % self.n_kv_heads):
            raise ValueError(f"`n_kv_heads` ({self.n_kv_heads}) must divide `n_heads` ({self.n_heads})")
        for field in ("rope_theta", "norm_eps"):  # nan passes `<= 0`; nan or inf makes a model of nans or zeros
            if not (math.isfinite(getattr(self, field)) and getattr(self, field) > 0):
                raise ValueError(f"`{field}` must be a finite number above 0, got {getattr(self, field)}")
        if not self.name.strip():
            raise ValueError("`name` must not be empty (bundles are named by it)")
        # The FIM layout and the stop on eos tell these four apart by id: two roles on one token make every prompt
        # ambiguous (pad may be eos, as imported checkpoints without a pad token have it).
        roles = {"eos_token": self.eos_token, "fim_prefix_token": self.fim_prefix_token,
                 "fim_suffix_token": self.fim_suffix_token, "fim_middle_token": self.fim_middle_token}
        for role, text in {**roles, "pad_token": self.pad_token}.items():
            if not text:
                raise ValueError(f"`{role}` must not be empty")
        seen: dict[str, str] = {}
        for role, text in roles.items():
            if text in seen:
                raise ValueError(f"`{role}` and `{seen[text]}` are both {text!r}; the FIM format needs them distinct")
            seen[text] = role

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def special_tokens(self) -> dict[str, str]:
        return {
            "eos_token": self.eos_token,
            "fim_prefix_token": self.fim_prefix_token,
            "fim_suffix_token": self.fim_suffix_token,
            "fim_middle_token": self.fim_middle_token,
            "pad_token": self.pad_token,
        }

    def param_count(self) -> int:
        """Parameters, with a tied embedding counted once."""
        d, hd = self.d_model, self.head_dim
        attn = d * (self.n_heads + 2 * self.kv_heads) * hd + self.n_heads * hd * d
        if self.qkv_bias:
            attn += (self.n_heads + 2 * self.kv_heads) * hd
        ffn = 3 * d * self.ffn_hidden
        head = 0 if self.tie_embeddings else self.vocab_size * d
        return self.vocab_size * d + head + self.n_layers * (attn + ffn + 2 * d) + d

    def to_dict(self) -> dict:
        data = msgspec.to_builtins(self)
        return {k: v for k, v in data.items() if k not in _OPTIONAL_DEFAULTS or v != _OPTIONAL_DEFAULTS[k]}

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def config_hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


def parse_config(data: dict, source: str = "config") -> ModelConfig:
    try:
        return msgspec.convert(data, ModelConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {e}") from None


# A model config is a few hundred bytes; a file far past that is no config, and parsing it would take minutes.
MAX_CONFIG_BYTES = 1 << 20


class _StrictLoader(yaml.SafeLoader):
    """safe_load without aliases or repeated keys: a config needs neither, an alias bomb (`&a [*a, *a, ...]`) makes
    whatever walks the data exponential, and with a repeated key the last one silently wins."""

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.YAMLError(f"alias *{event.anchor} at line {event.start_mark.line + 1}: anchors and aliases "
                                 "are not supported in a model config")
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        keys: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in keys:
                    raise yaml.YAMLError(f"key `{key_node.value}` appears twice (line {key_node.start_mark.line + 1})")
                keys.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


# YAML 1.1 (PyYAML) reads an exponent without a dot or sign, `norm_eps: 1e-5` or `rope_theta: 1.0e4`, as a string,
# which the config's float fields then refused ("Expected `float`, got `str`"); YAML 1.2 reads a number.
_EXPONENT = re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$")
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT, list("-+0123456789"))


def _one_line(e: yaml.YAMLError) -> str:
    """PyYAML's message spans lines (it quotes the source with a caret); the daemon and doctor report one line."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        what = "; ".join(s for s in (e.context, e.problem) if s)
        return f"{what} (line {mark.line + 1}, column {mark.column + 1})"
    return " ".join(str(e).split())


def load_config(path: str | Path) -> ModelConfig:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: over {MAX_CONFIG_BYTES >> 20} MiB, not a model config")
        data = yaml.load(raw.decode("utf-8"), Loader=_StrictLoader)  # a SafeLoader: no Python tags
    except ConfigError:
        raise
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: a folder, not a file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {_one_line(e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.object[e.start]:#04x} at offset {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a model config") from None
    except ValueError as e:  # an integer of thousands of digits (int's own limit), a date out of range
        raise ConfigError(f"{path}: not a valid value: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config fields, got {type(data).__name__}")
    return parse_config(data, str(path))

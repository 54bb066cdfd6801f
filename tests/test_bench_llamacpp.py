"""benchmarks/bench_llamacpp.py's own logic, without building llama.cpp (`make bench-llamacpp` does that, outside
`make test`): where the build is cached, how our tokens are rendered for the comparison with llama.cpp's output, the
checkpoint handed to convert_hf_to_gguf.py, and how the medians become the table's ratio."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from m31r.bundle import init_bundle
from m31r.config import load_config
from m31r.tokenizer import SPECIAL_TOKENS, build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_llamacpp", ROOT / "benchmarks" / "bench_llamacpp.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_the_build_is_cached_per_version(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert bench.cache_root("1.2.3") == tmp_path / "m31r" / "llamacpp" / "1.2.3"


def test_tokens_render_as_llamacpp_prints_them() -> None:
    tok = build_byte_tokenizer(384)
    text = "fn é() {\n\t'x' 🦀 }"
    ids = tok.encode(text).ids
    assert b"".join(bench.rendered(tok, i) for i in ids) == text.encode()
    assert bench.rendered(tok, tok.token_to_id(SPECIAL_TOKENS[0])) == b""  # control tokens print nothing
    assert bench.rendered(tok, tok.token_to_id("<|reserved_7|>")) == b"<|reserved_7|>"


def test_checkpoint_for_the_converter_has_a_merge(tmp_path: Path) -> None:
    config = load_config(ROOT / "configs" / "model" / "tiny.yaml")
    init_bundle(config, tmp_path / "b", seed=0, dtype=torch.float32)
    hf = bench.export_for_llamacpp(tmp_path / "b", tmp_path / "hf")
    assert json.loads((hf / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # llama.cpp's BPE loader needs a merges list; the byte tokenizer has none, so one that can never apply is added
    assert (hf / "merges.txt").read_text().splitlines()[1] == "<|endoftext|> <|endoftext|>"


def test_summary_keeps_each_engines_best_variant() -> None:
    rows = bench.summarise({"int8": {"m31r": {"float32": [10.0, 12.0, 11.0]},
                                     "llama.cpp": {"fa-off": [30.0, 31.0], "fa-on": [22.0, 20.0, 21.0]}}})
    row = rows["int8"]
    assert row["m31r"]["ms"] == 11.0 and row["llama.cpp"]["best"] == "fa-on" and row["llama.cpp"]["ms"] == 21.0
    assert row["ratio"] == pytest.approx(21.0 / 11.0)
    assert "int8 / q8_0" in bench.table(rows, {"int8": "q8_0"})

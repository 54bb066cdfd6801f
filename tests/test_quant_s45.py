"""Quantization at the edges of the shapes and dtypes it takes: int4 layers whose output count aten cannot pack,
`--quant int4` on a model its groups do not tile, and averages of bundles stored in different float dtypes."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner

from m31r import quant
from m31r.bundle import init_bundle, load_weights, open_bundle, write_bundle
from m31r.cli import main
from m31r.engine import Engine

GEN = torch.Generator().manual_seed(45)


@pytest.mark.parametrize("n", [8, 24, 120])  # not multiples of 16: aten's CPU int4 packing refused them
@pytest.mark.parametrize("m", [1, 5, 70])  # aten's int4 kernel below INT4_GEMM_ROWS, the dequantized GEMM from it
@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16])
def test_an_int4_layer_of_any_output_count_computes_its_dequantized_product(n: int, m: int, act: torch.dtype) -> None:
    w, bias = torch.randn(n, 96, generator=GEN) * 0.05, torch.randn(n, generator=GEN)
    codes, sz = quant.quantize_int4(w, 32)
    layer = quant.Int4Linear(codes, sz, 32, bias)
    x = torch.randn(2, m, 96, generator=GEN).to(act)
    ref = F.linear(x.to(torch.bfloat16).float(), quant.dequantize_int4(codes, sz, 32), bias.to(torch.bfloat16).float())
    y = layer(x)
    assert y.dtype == act and y.shape == (2, m, n)
    torch.testing.assert_close(y.float(), ref, atol=0.05, rtol=0.02)


def _mqa_config(tiny_config):
    """Head dim 12 with one KV head: wqkv has (8 + 2) * 12 = 120 outputs, d_model 96 is no multiple of 64."""
    return msgspec.structs.replace(tiny_config, n_layers=1, d_model=96, n_heads=8, n_kv_heads=1, ffn_hidden=128,
                                   max_context=64)


def _logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    cache = engine.new_cache()
    return [x for x in engine.prefill(cache, ids, 0) if x is not None][-1].float()


def test_an_int4_bundle_whose_qkv_aten_cannot_pack_serves_its_dequantized_model(tiny_config, tmp_path: Path) -> None:
    """`bundle quantize --quant int4` wrote it and `bundle verify` passed it, then the engine's load failed with
    torch's "expect N to be dividable by 16"; it now serves the model its codes describe."""
    src = init_bundle(_mqa_config(tiny_config), tmp_path / "b", seed=3, dtype=torch.float32)
    out = tmp_path / "q"
    result = CliRunner().invoke(main, ["bundle", "quantize", str(src.path), str(out), "--quant", "int4",
                                       "--group-size", "32"])
    assert result.exit_code == 0, result.output
    q = open_bundle(out)
    # The float model of the same numbers: every quantized tensor replaced by its dequantized values.
    t = load_weights(q)
    sd = {}
    for name, v in t.items():
        if name.endswith(".weight_int4"):
            base = name.removesuffix(".weight_int4")
            sd[base + ".weight"] = quant.dequantize_int4(v, t[base + ".scales_and_zeros"], 32)
        elif name.endswith(".weight_int8"):
            base = name.removesuffix(".weight_int8")
            sd[base + ".weight"] = quant.dequantize_int8(v, t[base + ".scales"])
        elif not name.endswith((".scales", ".scales_and_zeros")):
            sd[name] = v
    ref = write_bundle(tmp_path / "ref", q.config, sd, q.tokenizer, dtype=torch.float32, seed=0,
                       dataset_version="test")
    ids = list(range(5, 45))
    got = _logits(Engine(out, dtype="bfloat16"), ids)
    want = _logits(Engine(ref.path, dtype="float32"), ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=0.03 * float(want.abs().max()), rtol=0)


def test_quant_int4_on_a_model_its_groups_do_not_tile_names_what_does(tiny_config, tmp_path: Path) -> None:
    """The daemon quantizes in groups of 64 and has no option for another size: the message names the bundle
    quantize command that fits (it said "group size must be one of (32, 64, 128) and divide K=96; got 64")."""
    src = init_bundle(_mqa_config(tiny_config), tmp_path / "b", seed=3, dtype=torch.float32)
    with pytest.raises(ValueError) as e:
        Engine(src.path, dtype="float32", quant="int4")
    assert "K=96" in str(e.value) and "bundle quantize --quant int4 --group-size 32" in str(e.value)
    assert "--quant int8" in str(e.value)


@pytest.mark.parametrize("order", ["float16 first", "float32 first"])
def test_an_average_of_two_float_dtypes_is_float32_whatever_the_order(tiny_config, tmp_path: Path,
                                                                        order: str) -> None:
    """It took the first source's dtype: `average A B` and `average B A` differed, and a float16 first turned a
    float32 source's weights past 65504 into inf, a bundle every load then refused."""
    half = init_bundle(tiny_config, tmp_path / "half", seed=1, dtype=torch.float16)
    full_dir = tmp_path / "full"
    sd = {k: v.float() for k, v in load_weights(half).items()}
    low = float(sd["layers.0.feed_forward.w2.weight"][0, 0])
    sd["layers.0.feed_forward.w2.weight"][0, 0] = 2e5
    write_bundle(full_dir, tiny_config, sd, half.tokenizer, dtype=torch.float32, seed=2, dataset_version="test")
    sources = [half.path, full_dir] if order == "float16 first" else [full_dir, half.path]
    out = tmp_path / "avg"
    result = CliRunner().invoke(main, ["bundle", "average", *map(str, sources), "--out", str(out),
                                       "--model-version", "0.1.0-avg"])
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(main, ["bundle", "verify", str(out)])
    assert result.exit_code == 0, result.output
    avg = open_bundle(out)
    assert avg.metadata["dtype"] == "float32"
    w = load_weights(avg)["layers.0.feed_forward.w2.weight"]
    assert w.dtype == torch.float32 and float(w[0, 0]) == pytest.approx(0.5 * 2e5 + 0.5 * low)


def test_an_average_of_one_dtype_keeps_it(tiny_config, tmp_path: Path) -> None:
    a = init_bundle(tiny_config, tmp_path / "a", seed=1, dtype=torch.float16)
    b = init_bundle(tiny_config, tmp_path / "b", seed=2, dtype=torch.float16)
    out = tmp_path / "avg"
    result = CliRunner().invoke(main, ["bundle", "average", str(a.path), str(b.path), "--out", str(out),
                                       "--model-version", "0.1.0-avg"])
    assert result.exit_code == 0, result.output
    avg = open_bundle(out)
    assert avg.metadata["dtype"] == "float16"
    assert all(t.dtype == torch.float16 for t in load_weights(avg).values())


def test_quantized_weights_on_cuda_name_the_option_to_change(tiny_bundle, tmp_path: Path) -> None:
    """It advised "use --device cpu or a float dtype": the dtype is the activations', and no dtype serves int8
    weights on CUDA (refused before any CUDA call, so this runs on any machine)."""
    with pytest.raises(ValueError, match=r"--quant int8 runs on the CPU kernels only: use --device cpu, or "
                                         r"--quant none$"):
        Engine(tiny_bundle.path, device="cuda", dtype="float32", quant="int8")
    from m31r.bundle import quantize_bundle

    q = quantize_bundle(tiny_bundle.path, tmp_path / "q", "int8")
    with pytest.raises(ValueError, match=r"the bundle holds int8 weights, which run on the CPU kernels only: use "
                                         r"--device cpu, or serve the float bundle it was quantized from$"):
        Engine(q.path, device="cuda", dtype="float32", quant="auto")

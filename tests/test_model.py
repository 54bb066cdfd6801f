"""The transformer: cached inference must compute what a full recomputation computes, for MHA and GQA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from devices import DEVICES

from m31r.bundle import init_bundle, open_bundle, write_bundle
from m31r.config import ConfigError, ModelConfig, RopeScaling, load_config, parse_config
from m31r.engine import Engine
from m31r.model import KVCache, Transformer, init_weights
from m31r.tokenizer import build_byte_tokenizer
from m31rd.scheduler import run_together

CONFIGS = Path(__file__).resolve().parent.parent / "configs" / "model"
ATOL = 1e-5


def _gqa(config: ModelConfig) -> ModelConfig:
    return msgspec.structs.replace(config, n_kv_heads=2, name="m31r-tiny-gqa")


@pytest.fixture(scope="module", params=[(kind, dev) for dev in DEVICES for kind in ("mha", "gqa")],
                ids=lambda p: "-".join(p))
def engine(request: pytest.FixtureRequest, tiny_config: ModelConfig, tmp_path_factory: pytest.TempPathFactory):
    kind, device = request.param
    config = tiny_config if kind == "mha" else _gqa(tiny_config)
    b = init_bundle(config, tmp_path_factory.mktemp(kind) / "b", seed=1, dtype=torch.float32)
    # fp32 caches: these tests hold the cache's bookkeeping to fp32 exactness (fp16 caches: tests/test_native.py)
    return Engine(b, dtype="float32", device=device, kv_dtype="float32")


def _ids(n: int, seed: int = 0, vocab: int = 384) -> list[int]:
    # Ids above the 5 special tokens: any id is a valid model input, but keep prompts realistic.
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _full_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return engine.model(torch.tensor([ids], device=engine.device))[0]


def _last(gen) -> torch.Tensor:
    return [x for x in gen if x is not None][-1]


def test_kv_cache_decode_equals_full_recomputation(engine: Engine) -> None:
    ids = _ids(60)
    full = _full_logits(engine, ids)
    cache = engine.new_cache()
    first = _last(engine.prefill(cache, ids[:20], 0))
    torch.testing.assert_close(first, full[19], atol=ATOL, rtol=0)
    for pos in range(20, 60):
        step = engine.decode_step(cache, ids[pos])
        torch.testing.assert_close(step, full[pos], atol=ATOL, rtol=0, msg=lambda m, p=pos: f"position {p}: {m}")
    assert cache.tokens == ids


@pytest.mark.parametrize("chunk", [1, 3, 8, 32])
def test_chunked_prefill_equals_one_shot(engine: Engine, chunk: int) -> None:
    ids = _ids(77, seed=chunk)
    one_shot = _full_logits(engine, ids)[-1]
    chunked = Engine(engine.bundle, dtype="float32", chunk_size=chunk, device=str(engine.device), kv_dtype="float32")
    cache = chunked.new_cache()
    logits = _last(chunked.prefill(cache, ids, 0))
    torch.testing.assert_close(logits, one_shot, atol=ATOL, rtol=0)
    assert cache.tokens == ids
    assert cache.chunks[-1] == len(ids) - len(ids) % chunk  # the positions full chunks computed
    # The cache holds the keys/values a single pass writes.
    ref = engine.new_cache()
    with torch.inference_mode():
        engine.model(torch.tensor([ids], device=engine.device), start=0, cache=ref)
    n = len(ids)
    for got, want in zip((*cache.k, *cache.v), (*ref.k, *ref.v), strict=True):
        torch.testing.assert_close(got[:, :, :n], want[:, :, :n], atol=ATOL, rtol=0)


def test_one_token_forward_over_a_cache_equals_one_shot(engine: Engine) -> None:
    """Transformer.forward with a cache and a single new token (engines decode in `step`; this is the plain path a
    direct caller gets) attends over every cached position."""
    ids = _ids(70, seed=11)
    cache = engine.new_cache()
    with torch.inference_mode():
        engine.model(torch.tensor([ids[:-1]], device=engine.device), start=0, cache=cache)
        last = engine.model(torch.tensor([ids[-1:]], device=engine.device), start=len(ids) - 1, cache=cache)[0, -1]
    torch.testing.assert_close(last, _full_logits(engine, ids)[-1], atol=ATOL, rtol=0)


def test_prefill_continues_from_a_cached_prefix(engine: Engine) -> None:
    """A second prefill that reuses aligned cached positions gives the logits of a cold one."""
    ids = _ids(90, seed=7)
    cache = engine.new_cache()
    _last(engine.prefill(cache, ids[:70], 0))
    start = engine.reusable(cache, ids)
    assert start == 64  # two full 32-token chunks of the shared prefix
    warm = _last(engine.prefill(cache, ids, start))
    torch.testing.assert_close(warm, _full_logits(engine, ids)[-1], atol=ATOL, rtol=0)


def test_gqa_equals_mha_with_repeated_kv_heads(tiny_config: ModelConfig) -> None:
    """GQA must share each k/v head across its group of query heads, exactly as repeated heads would."""
    gqa_cfg = _gqa(tiny_config)
    mha_cfg = msgspec.structs.replace(tiny_config, n_kv_heads=None)
    gqa, mha = Transformer(gqa_cfg), Transformer(mha_cfg)
    init_weights(gqa, seed=3)
    group, hd, d = gqa_cfg.n_heads // gqa_cfg.kv_heads, gqa_cfg.head_dim, gqa_cfg.d_model
    sd = gqa.state_dict()
    for name in [k for k in sd if k.endswith("wqkv.weight")]:
        q, k, v = sd[name].split([gqa_cfg.n_heads * hd, gqa_cfg.kv_heads * hd, gqa_cfg.kv_heads * hd])
        k, v = (t.view(gqa_cfg.kv_heads, hd, d).repeat_interleave(group, 0).reshape(-1, d) for t in (k, v))
        sd[name] = torch.cat([q, k, v])
    mha.load_state_dict(sd)
    tokens = torch.tensor([_ids(40, seed=5)])
    with torch.inference_mode():
        torch.testing.assert_close(gqa(tokens), mha(tokens), atol=ATOL, rtol=0)


def test_positions_past_max_context_are_refused(tiny_config: ModelConfig) -> None:
    model = Transformer(tiny_config)
    cache = KVCache(tiny_config, tiny_config.max_context, torch.float32, "cpu")
    with pytest.raises(ValueError, match="exceed max_context 512"), torch.inference_mode():
        model(torch.tensor([[5, 6]]), start=511, cache=cache)


# -- initialisation and parameter counts -----------------------------------------------------------------


def _init_state(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    model = Transformer(config)
    init_weights(model, seed)
    return model.state_dict()


def test_init_is_deterministic(tiny_config: ModelConfig) -> None:
    a, b, c = (_init_state(tiny_config, s) for s in (0, 0, 1))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["tok_embeddings.weight"], c["tok_embeddings.weight"])
    assert all(torch.equal(a[k], c[k]) for k in a if k.endswith("norm.weight"))  # norms start at 1
    assert all(not torch.equal(a[k], c[k]) for k in a if not k.endswith("norm.weight"))


def test_init_scales_residual_outputs(tiny_config: ModelConfig) -> None:
    sd = _init_state(tiny_config, 0)
    assert sd["tok_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)
    assert sd["layers.0.attention.wo.weight"].std().item() == pytest.approx(0.02 / 2, rel=0.1)  # 1/sqrt(2*2)
    assert torch.equal(sd["norm.weight"], torch.ones(tiny_config.d_model))


@pytest.mark.parametrize(("n_kv_heads", "imported"), [(None, False), (2, False), (2, True)])
def test_param_count_matches_the_allocated_model(tiny_config: ModelConfig, n_kv_heads: int | None,
                                                 imported: bool) -> None:
    config = msgspec.structs.replace(tiny_config, n_kv_heads=n_kv_heads)
    if imported:  # q/k/v biases and an untied head
        config = msgspec.structs.replace(config, qkv_bias=True, tie_embeddings=False)
    assert config.param_count() == sum(p.numel() for p in Transformer(config).parameters())


@pytest.mark.parametrize(("name", "millions"), [("small", 61.0), ("medium", 205.5), ("large", 461.0)])
def test_spec_param_counts(name: str, millions: float) -> None:
    config = load_config(CONFIGS / f"{name}.yaml")
    assert config.param_count() / 1e6 == pytest.approx(millions, rel=0.01)
    assert config.head_dim == 64 and config.max_context == 2048


# -- config validation -------------------------------------------------------------------------------------

BASE = {"n_layers": 2, "d_model": 64, "n_heads": 4, "ffn_hidden": 128, "vocab_size": 384}


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"n_layer": 2}, "n_layer"),  # typo: unknown field
        ({"n_layers": "two"}, "n_layers"),
        ({"rope_theta": "big"}, "rope_theta"),
        ({"d_model": 66}, "d_model"),
        ({"n_kv_heads": 3}, "n_kv_heads"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.type"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}, "linear takes only"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "llama3 needs"),
        ({"rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                           "original_max_context": 64}}, "low_freq_factor < high_freq_factor"),
        ({"qkv_bias": "yes"}, "qkv_bias"),
    ],
)
def test_config_errors_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        parse_config({**BASE, **change})


def test_config_file_errors_name_file_and_field(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("n_layers: 2\nd_model: 64\nn_heads: 4\nffn_hidden: 128\nvocab_size: 384\ncolour: red\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*colour"):
        load_config(f)
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "missing.yaml")


def test_config_round_trips_through_yaml(tiny_config: ModelConfig, tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(_gqa(tiny_config).to_yaml())
    again = load_config(f)
    assert again == _gqa(tiny_config) and again.config_hash() == _gqa(tiny_config).config_hash()
    assert again.config_hash() != tiny_config.config_hash()


def test_imported_fields_are_recorded_only_when_set(tiny_config: ModelConfig, tmp_path: Path) -> None:
    """The fields for imported checkpoints stay out of config.yaml and config_hash at their defaults, so configs and
    bundles written before they existed (release/ among them) read, hash and verify unchanged; set, they round-trip
    and change the hash."""
    assert not {"qkv_bias", "tie_embeddings", "rope_scaling"} & set(tiny_config.to_dict())
    release = open_bundle(Path(__file__).resolve().parent.parent / "release")
    assert release.metadata["config_hash"] == release.config.config_hash()
    assert release.config.tie_embeddings and not release.config.qkv_bias and release.config.rope_scaling is None
    imported = msgspec.structs.replace(tiny_config, qkv_bias=True, tie_embeddings=False, rope_scaling=RopeScaling(
        type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=64))
    f = tmp_path / "c.yaml"
    f.write_text(imported.to_yaml())
    assert "original_max_context: 64" in f.read_text()
    again = load_config(f)
    assert again == imported and again.config_hash() == imported.config_hash() != tiny_config.config_hash()
    linear = msgspec.structs.replace(tiny_config, rope_scaling=RopeScaling(type="linear", factor=2.0))
    assert linear.to_dict()["rope_scaling"] == {"type": "linear", "factor": 2.0}


def test_untied_head_and_biases_cache_like_a_full_recomputation(tiny_config: ModelConfig, tmp_path: Path) -> None:
    """An imported shape (q/k/v biases, untied head, GQA, llama3 RoPE scaling) through the engine's cached paths:
    chunked prefill and decode steps give the logits of one full forward pass."""
    config = msgspec.structs.replace(_gqa(tiny_config), qkv_bias=True, tie_embeddings=False, rope_scaling=RopeScaling(
        type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_context=32))
    model = Transformer(config)
    init_weights(model, 3)
    with torch.no_grad():
        for layer in model.layers:
            layer.attention.wqkv.bias.normal_(0, 0.5)
    b = write_bundle(tmp_path / "b", config, model.state_dict(), build_byte_tokenizer(config.vocab_size), seed=3,
                     dataset_version="test", dtype=torch.float32)
    engine = Engine(b, dtype="float32", chunk_size=8, max_chunk=32, kv_dtype="float32")
    ids = _ids(90, seed=5)
    with torch.inference_mode():
        full = model(torch.tensor([ids]))[0]
    cache = engine.new_cache()
    last = [x for x in engine.prefill(cache, ids[:70], 0) if x is not None][-1]
    assert (last - full[69]).abs().max().item() < ATOL
    for i in range(70, 90):
        step = engine.decode_step(cache, ids[i])
        if i + 1 < 90:
            assert (step - full[i]).abs().max().item() < ATOL, i


def test_engine_load_does_not_import_dynamo(tiny_bundle) -> None:
    """Building the model on the meta device must not run meta arithmetic: that imports torch._dynamo, ~2 s of
    daemon startup. (A fresh process: this test session may have imported it already.)"""
    code = ("import sys; from m31r.engine import Engine; Engine(sys.argv[1]); "
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'")
    subprocess.run([sys.executable, "-c", code, str(tiny_bundle.path)], check=True, timeout=120)


def test_batched_decode_equals_each_stream_alone(tiny_engine) -> None:
    """Streams run together (the daemon's rounds: decode rows and prefill chunks in shared passes) give exactly
    the tokens each gives alone: a row's arithmetic never depends on its neighbours."""
    prompts = ["fn main() {", "struct Foo { a: u32 }\nimpl Foo {", "let x = vec![1, 2, 3];", "use std::io;\n",
               "// a longer prompt, prefilled in several chunks while the others decode\n" * 3]
    alone = [[t.id for t in tiny_engine.generate(p, max_tokens=24)] for p in prompts]
    outs, sched = run_together(tiny_engine, prompts, 24)
    rounds, shared = sched.rounds, sched.mixed_rounds
    assert outs == alone
    assert tiny_engine.fuse and shared  # chunks really ran beside decode rows
    assert rounds < sum(len(o) for o in outs)  # streams really shared decode steps

"""The native kernels as most users get them: machines without AVX-512 (laptops, Macs), whose fp32 family
(avx2, or neon on Arm) runs, and the ways its build can go wrong on a machine unlike CI's.

Which family each common CPU gets from its flags (AVX2 without FMA or F16C, AVX-512F without BF16 or VNNI), and
that the builds a laptop runs hold no instruction it lacks. The build cache: a cache folder that cannot take the
build (the kernels still run), a new source or flags (a new file, never the stale one), two builds of one key at
once (one complete file). No C compiler: one log line, torch runs. Then arithmetic: more threads than cores, odd
model shapes and int4 group sizes, and the mini shape, each against the eager torch path."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import msgspec
import pytest
import torch

from m31r import native
from m31r.config import load_config

FP32 = "neon" if native.platform.machine().lower() in ("aarch64", "arm64") else "avx2"  # the fp32 family to test
CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "model"
PROMPT = "fn add(a: u32, b: u32) -> u32 {\n"


def _fp32_family() -> str:
    why = native.family_unsupported(FP32)
    if why is not None or native.compiler() is None:
        pytest.skip(f"the {FP32} kernels do not run here: {why or 'no C compiler'}")
    return FP32


@pytest.fixture
def fresh_load(monkeypatch):
    """`native.load` as a fresh process sees it under the test's environment (M31R_NATIVE unset), and forgotten
    after, so later tests load under theirs."""
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    native.load.cache_clear()
    yield
    native.load.cache_clear()


# -- which family a CPU gets -------------------------------------------------------------------------------------

BASE = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = {"avx512f", "avx512bw", "avx512vl"}
# name: (flags, torch's capability, (family for fp32 activations, for bf16, for neither))
CPUS = {
    "avx2 without fma": (BASE - {"fma"}, "AVX2", (None, None, None)),
    "avx2 without f16c": (BASE - {"f16c"}, "AVX2", (None, None, None)),
    "haswell laptop": (BASE, "AVX2", ("avx2", "avx2", "avx2")),
    "alder lake laptop": (BASE | {"avx_vnni"}, "AVX2", ("avx2vnni", "avx2vnni", "avx2vnni")),
    "skylake-x (avx512f, no bf16 or vnni)": (BASE | AVX512, "AVX512", ("avx2", "avx512", "avx512")),
    "cascade lake": (BASE | AVX512 | {"avx512_vnni"}, "AVX512", ("avx512vnni", "avx512", "avx512")),
    "zen 4": (BASE | AVX512 | {"avx512_vnni", "avx512_bf16"}, "AVX512", ("avx512vnni", "avx512", "avx512")),
    "avx-512 flags, torch held to avx2": (BASE | AVX512 | {"avx512_vnni", "avx_vnni"}, "AVX2",
                                          ("avx2vnni", "avx2vnni", "avx2vnni")),
}


@pytest.mark.parametrize("cpu", list(CPUS))
def test_each_common_cpu_gets_the_family_its_flags_run(cpu: str, monkeypatch) -> None:
    """`auto` takes the widest family whose every instruction the CPU has (FMA and F16C included), preferring one
    of the engine's activation dtype: an AVX-512 CPU without BF16 serves fp32 engines on avx2."""
    if sys.platform != "linux" or native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 families are built for x86-64 Linux")
    flags, cap, want = CPUS[cpu]
    monkeypatch.setattr(native, "cpu_info", lambda: ("a CPU", set(flags), "x86_64"))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cap)
    monkeypatch.setenv("M31R_KERNELS", "auto")
    monkeypatch.delenv("M31R_NATIVE", raising=False)
    got = tuple(getattr(native.choose(dtype)[0], "name", None) for dtype in (torch.float32, torch.bfloat16, None))
    assert got == want, native.choose()[1]
    if want[0] is None:
        missing = sorted({"fma", "f16c"} - flags)
        assert f"no avx2: the CPU lacks {', '.join(missing)}" in native.choose(torch.float32)[1]


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(function, instruction with operands) for every instruction of a shared library, from objdump."""
    text = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                          check=True).stdout
    out, fn = [], ""
    for line in text.splitlines():
        if m := re.match(r"^[0-9a-f]+ <(.+)>:$", line):
            fn = m.group(1)
        elif "\t" in line:
            out.append((fn, line.split("\t", 1)[1].strip()))
    return out


# Registers only EVEX (AVX-512) encodes: a laptop's CPU faults on any instruction naming one.
EVEX_ONLY = re.compile(r"%zmm|%k[0-7]|%[xy]mm(1[6-9]|2[0-9]|3[01])\b")


@pytest.mark.parametrize("name", ["avx2", "avx2vnni", "avx512"])
def test_the_builds_hold_no_instruction_their_cpus_lack(name: str) -> None:
    """avx2 and avx2vnni run on CPUs without AVX-512: no EVEX-only register anywhere in their builds (and plain
    avx2 no VNNI dot product). avx512 runs on AVX-512F CPUs without BF16 too (Skylake-X), so its BF16 instructions
    sit only in the matmuls `Kernels` calls where torch reports BF16, never in decode attention."""
    if sys.platform != "linux" or native.platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("the x86 families are built for x86-64 Linux")
    if native.compiler() is None or shutil.which("objdump") is None:
        pytest.skip("needs a C compiler and objdump")
    code = _instructions(native.build(family=name))
    assert len(code) > 1000
    if name == "avx512":
        bf16 = {fn.split(".")[0] for fn, ins in code if "bf16" in ins}
        assert bf16 and all(re.match(r"(i8_tile|bf_tile)_\d_\d$|m31r_bf16_mm(\._omp_fn)?", f) for f in bf16), bf16
        return
    assert not [ins for _, ins in code if EVEX_ONLY.search(ins) or "bf16" in ins]
    vnni = [ins for _, ins in code if ins.split()[-2 if ins.startswith("{") else 0].startswith("vpdp")]
    assert bool(vnni) == (name == "avx2vnni")
    if vnni:
        assert all(ins.startswith("{vex}") for ins in vnni)  # AVX-VNNI's VEX form, never AVX512-VNNI's EVEX


# -- the build and its cache -------------------------------------------------------------------------------------


def test_a_cache_that_cannot_take_the_build_costs_the_cache_not_the_kernels(tmp_path, monkeypatch, caplog,
                                                                           fresh_load) -> None:
    """A cache folder that cannot be written (here a file where a folder belongs, which root cannot write past
    either; a read-only or full disk fails the same way) used to turn the kernels off. The build now runs from a
    private temporary folder, one log line says why, and the cache is left as it was."""
    name = _fp32_family()
    blocker = tmp_path / "cache"
    blocker.write_text("not a folder")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    monkeypatch.setenv("M31R_KERNELS", name)
    caplog.set_level(logging.INFO, logger="m31r.native")
    kernels = native.load(torch.float32)
    assert kernels is not None, native.why_not(torch.float32)
    assert kernels.name == name and kernels.reason == f"forced by M31R_KERNELS={name}"
    assert not kernels.path.is_relative_to(blocker) and kernels.path.is_file()
    notes = [r.getMessage() for r in caplog.records if r.name == "m31r.native"]
    assert len(notes) == 1 and "not cached" in notes[0] and str(blocker) in notes[0], notes
    assert blocker.read_text() == "not a folder"
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 64, generator=gen), torch.randn(16, 64, generator=gen)
    torch.testing.assert_close(kernels.f32_mm(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def test_a_read_only_cache_folder_costs_the_cache_not_the_kernels(tmp_path) -> None:
    """The same with a real read-only folder (permissions do not stop root, so not as root)."""
    name = _fp32_family()
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    cache = tmp_path / "ro"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        path = native.build(cache, name)
        assert path.is_file() and not path.is_relative_to(cache) and not any(cache.iterdir())
        assert native.Kernels(path, name).name == name
    finally:
        cache.chmod(0o755)


def test_no_compiler_is_one_log_line_and_torch_runs(tmp_path, monkeypatch, caplog, fresh_load) -> None:
    """Without a C compiler a daemon asks for kernels of fp32 activations (the precision choice), then of the
    engine's dtype (bf16 on BF16 CPUs): each returns None and one line says why, not one per ask."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("M31R_KERNELS", "auto")
    caplog.set_level(logging.INFO, logger="m31r.native")
    assert native.compiler() is None
    assert [native.load(d) for d in (torch.float32, torch.bfloat16, None, torch.float32)] == [None] * 4
    notes = [r.getMessage() for r in caplog.records if r.name == "m31r.native"]
    assert len(notes) == 1 and notes[0].startswith("native kernels off: "), notes
    if native.choose()[0] is not None:
        assert native.why_not(torch.bfloat16) == "no C compiler found (set CC)"
        assert "no C compiler found (set CC)" in notes[0]


def test_a_new_source_or_new_flags_build_a_new_file_never_the_stale_one(tmp_path, monkeypatch) -> None:
    """The cache key covers the source, the headers it includes and the flags: an older build beside the new
    source (here a copy of the sources whose header changes) is never what `build` returns."""
    name = _fp32_family()
    family = native.FAMILIES[name]
    src = tmp_path / "src"
    src.mkdir()
    for p in [family.source, *family.source.parent.glob("kernels*.h")]:
        shutil.copy(p, src / p.name)
    monkeypatch.setitem(native.FAMILIES, name, dataclasses.replace(family, source=src / family.source.name))
    cache = tmp_path / "cache"
    old = native.build(cache, name)
    header = src / "kernels_layer.h"
    header.write_text(header.read_text() + "\n/* a newer header */\n")
    new = native.build(cache, name)
    assert new != old and new.is_file() and old.is_file()
    assert native.build(cache, name) == new
    flagged = dataclasses.replace(native.FAMILIES[name], flags=(*family.flags, "-DM31R_S44_FLAG"),
                                  variants=tuple((f, (*v, "-DM31R_S44_FLAG")) for f, v in family.variants))
    monkeypatch.setitem(native.FAMILIES, name, flagged)
    assert native.build(cache, name) not in (old, new)
    assert sorted(p.suffix for p in cache.iterdir()) == [".so"] * 3


def test_two_builds_of_one_key_at_once_leave_one_complete_file(tmp_path) -> None:
    """Two daemons building into one empty cache: both get the same file, complete, and nothing else is left."""
    name = _fp32_family()
    cache = tmp_path / "cache"
    start, got, errors = threading.Barrier(3), [], []

    def one() -> None:
        start.wait()
        try:
            got.append(native.build(cache, name))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(got)) == 1
    assert list(cache.iterdir()) == [got[0]]
    assert native.Kernels(got[0], name).name == name


# -- arithmetic: threads, shapes, the mini model -----------------------------------------------------------------


def test_more_threads_than_cores_give_the_same_bits() -> None:
    """A thread count above the core count (a user's --threads, or a VM that reports fewer cores) changes which
    thread sums a column, never its bits: every fp32-family kernel an engine runs, against one thread."""
    name = _fp32_family()
    kernels = native.Kernels(native.build(family=name), name)
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(5, 256, generator=gen), torch.randn(136, 256, generator=gen)
    codes = torch.randint(-127, 128, (136, 256), generator=gen, dtype=torch.int8)
    scales = (torch.rand(136, generator=gen) * 0.02 + 0.001).to(torch.bfloat16)
    q4 = torch.randint(0, 256, (136, 128), generator=gen, dtype=torch.uint8)
    s4, b4 = torch.rand(136, 4, generator=gen) * 0.01, torch.randn(136, 4, generator=gen) * 0.01
    gu = torch.randn(5, 2 * 264, generator=gen)
    norm_w = torch.randn(256, generator=gen)

    def run() -> list[torch.Tensor]:
        h = torch.empty_like(x)
        xs = x.clone()
        kernels.add_rmsnorm(xs, x, norm_w, 1e-5, h)
        return [kernels.f32_mm(x, w), kernels.int8_mm(x, codes, scales), kernels.int4_mm(x, q4, s4, b4, 64),
                kernels.swiglu(gu), xs, h]

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run()
        many = 2 * (os.cpu_count() or 1) + 1
        torch.set_num_threads(many)
        assert kernels.threads == (many if sys.platform == "linux" else kernels.threads)
        for a, b in zip(one, run(), strict=True):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(before)


def _forced_logits(engine, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The logits of prefill's last position and of decoding `tokens` one by one (teacher forcing)."""
    cache = engine.new_cache()
    out = [x for x in engine.prefill(cache, prompt, 0) if x is not None]
    return torch.stack(out + [engine.decode_step(cache, t) for t in tokens])


def _native_against_eager(bundle, kernels: native.Kernels, quant: str | None = None, group: int = 32):
    """(native logits, eager logits, engine) for one prompt and 15 forced tokens."""
    from m31r.engine import Engine

    engine = Engine(bundle, dtype="float32", quant=quant, group_size=group)
    prompt = engine.tokenizer.encode(PROMPT)
    tokens = torch.randint(5, 300, (15,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.use_kernels(kernels)
    report = dict(engine.kernel_report)
    native_logits = _forced_logits(engine, prompt, tokens)
    engine.use_kernels(None)
    return native_logits, _forced_logits(engine, prompt, tokens), report


def _agree(got: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    """Within `tolerance` of the reference's largest logit, and its greedy token wherever its top two are apart by
    more than twice that (most positions)."""
    scale = ref.abs().max()
    assert (got - ref).abs().max() <= tolerance * scale
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tolerance * scale
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])
    assert int(clear.sum()) >= len(ref) // 2


# (d_model, n_heads, n_kv_heads, ffn_hidden): what runs natively at each
SHAPES = {
    "d 40, head_dim 10: float matmuls, eager attention": (40, 4, None, 96),
    "d 36, K not a multiple of 8: all eager": (36, 2, None, 100),
    "d 96, head_dim 48, ffn 152": (96, 2, None, 152),
    "d 128, grouped kv heads": (128, 4, 2, 192),
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_an_fp32_engine_of_an_odd_shape_stays_with_eager(tiny_config, tmp_path, shape: str) -> None:
    """d_model and head_dim that are not multiples of the vector width: the fp32 family takes what it can (the
    rest stays on torch), and its logits and greedy tokens are eager fp32's."""
    from m31r.bundle import init_bundle

    kernels = native.Kernels(native.build(family=_fp32_family()), FP32)
    d, heads, kv, ffn = SHAPES[shape]
    config = msgspec.structs.replace(tiny_config, d_model=d, n_heads=heads, n_kv_heads=kv, ffn_hidden=ffn)
    bundle = init_bundle(config, tmp_path / "b", seed=4, dtype=torch.float32)
    got, ref, report = _native_against_eager(bundle, kernels)
    assert report["native_float"] == (d % 8 == 0)
    assert report["native_attention"] == (d // heads % 16 == 0)
    _agree(got, ref, 1e-3)


@pytest.mark.parametrize("group", [32, 64, 128])
def test_an_int4_engine_runs_every_group_size_close_to_eager(tiny_config, tmp_path, group: int) -> None:
    """int4 weights in each group size the bundle format takes, on the fp32 family's int4 matmul (q8
    activations) against torch's int4 path (bf16 activations): within both roundings, the same greedy tokens."""
    from m31r.bundle import init_bundle

    kernels = native.Kernels(native.build(family=_fp32_family()), FP32)
    config = msgspec.structs.replace(tiny_config, d_model=128, n_heads=2, ffn_hidden=384)
    bundle = init_bundle(config, tmp_path / "b", seed=5, dtype=torch.float32)
    got, ref, report = _native_against_eager(bundle, kernels, "int4", group)
    assert report["native_int4"] and report["native_attention"]
    _agree(got, ref, 0.05)


def test_the_mini_shape_on_the_fp32_family_picks_eager_fp32s_tokens(tmp_path) -> None:
    """The default model's shape (8 layers, d_model 512), random weights: the fp32 family (fp16 KV cache) against
    eager fp32 (fp32 cache)."""
    from m31r.bundle import init_bundle

    kernels = native.Kernels(native.build(family=_fp32_family()), FP32)
    bundle = init_bundle(load_config(CONFIGS / "mini.yaml"), tmp_path / "mini", seed=0, dtype=torch.float32)
    got, ref, report = _native_against_eager(bundle, kernels)
    assert report["native_float"] and report["native_attention"] and report["kv_cache"] == "float16"
    _agree(got, ref, 1e-3)

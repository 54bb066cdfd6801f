"""A tiny end-to-end training run: fixture corpus → tokenizer → model → resume → export → daemon → completion.

Everything is small enough to run in seconds on one CPU thread: a 2-layer d=64 model on a few dozen
generated Rust files, 128-token context, 40 steps.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from daemon_util import start_daemon, stop_daemon
from safetensors.torch import load_file

from m31r.bundle import load_weights, open_bundle
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer
from m31r.train import trainer as trainer_mod
from m31r.train.corpus import build_corpus
from m31r.train.tokenizer import train_tokenizer
from m31r.train.trainer import export, train

STEPS = 40
VOCAB = 512

# -- a small, varied Rust corpus --------------------------------------------------------------------------

NOUNS = ["point", "buffer", "token", "record", "node", "packet", "account", "sensor", "matrix", "queue",
         "span", "frame", "cursor", "symbol", "ticket", "reading", "vertex", "message", "entry", "shape"]
FIELDS = ["id", "len", "count", "weight", "offset", "name", "label", "value", "score", "depth", "width",
          "height", "limit", "index", "kind", "flags", "total", "start", "end", "size"]
TYPES = ["u32", "u64", "i64", "usize", "f64", "bool", "String", "Vec<u8>", "Option<u32>", "char"]


def camel(s: str) -> str:
    return "".join(p.capitalize() for p in s.split("_"))


def default_of(ty: str) -> str:
    return {"f64": "0.0", "bool": "false", "String": "String::new()", "Vec<u8>": "Vec::new()",
            "Option<u32>": "None", "char": "' '"}.get(ty, "0")


def rust_file(i: int, rng: random.Random) -> str:
    """A plausible module: a struct with an impl, free functions, a trait impl, comments and tests."""
    noun = NOUNS[i % len(NOUNS)] + ("" if i < len(NOUNS) else f"_{i // len(NOUNS)}")
    ty = camel(noun)
    fields = rng.sample(FIELDS, rng.randint(2, 5))
    types = [rng.choice(TYPES) for _ in fields]
    num = next((f for f, t in zip(fields, types, strict=True) if t in ("u32", "u64", "i64", "usize")), None)
    out = [f"//! The `{ty}` type and helpers for working with {noun.replace('_', ' ')}s.", ""]
    out += rng.sample(["use std::collections::HashMap;", "use std::fmt;", "use std::io::{self, Read};",
                       "use std::sync::Arc;", "use std::cmp::Ordering;"], rng.randint(1, 3))
    out += ["", f"/// A {noun.replace('_', ' ')} with {len(fields)} fields.",
            "#[derive(Debug, Clone, PartialEq)]", f"pub struct {ty} {{"]
    out += [f"    pub {f}: {t}," for f, t in zip(fields, types, strict=True)]
    out += ["}", "", f"impl {ty} {{", f"    /// Creates an empty `{ty}`.", "    pub fn new() -> Self {",
            "        Self {"]
    out += [f"            {f}: {default_of(t)}," for f, t in zip(fields, types, strict=True)]
    out += ["        }", "    }"]
    for f, t in zip(fields, types, strict=True):
        if rng.random() < 0.6:
            ref = "&" if t in ("String", "Vec<u8>") else ""
            out += ["", f"    pub fn {f}(&self) -> {ref}{t} {{", f"        {ref}self.{f}" + (
                ".clone()" if t == "Option<u32>" else ""), "    }"]
    if num:
        out += ["", f"    pub fn with_{num}(mut self, {num}: {types[fields.index(num)]}) -> Self {{",
                f"        self.{num} = {num};", "        self", "    }"]
    out += ["}", ""]
    pool = []
    if num:
        pool.append([
            f"pub fn total_{num}(items: &[{ty}]) -> u64 {{",
            "    // Add the values up in a u64 so that long slices cannot overflow.",
            "    let mut total = 0u64;",
            "    for item in items {",
            f"        total += item.{num} as u64;",
            "    }",
            "    total",
            "}",
        ])
        pool.append([
            f"pub fn largest(items: &[{ty}]) -> Option<&{ty}> {{",
            f"    items.iter().max_by_key(|item| item.{num})",
            "}",
        ])
        pool.append([
            f"pub fn sort_by_{num}(items: &mut Vec<{ty}>) {{",
            "    // Stable sort, so equal keys keep their input order.",
            f"    items.sort_by(|a, b| a.{num}.cmp(&b.{num}));",
            "}",
        ])
    pool.append([
        f"pub fn count_matching<F>(items: &[{ty}], pred: F) -> usize",
        "where",
        f"    F: Fn(&{ty}) -> bool,",
        "{",
        "    let mut n = 0;",
        "    for item in items {",
        "        if pred(item) {",
        "            n += 1;",
        "        }",
        "    }",
        "    n",
        "}",
    ])
    pool.append([
        f"impl fmt::Display for {ty} {{",
        "    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {",
        f"        write!(f, \"{ty}({{:?}})\", self.{fields[0]})",
        "    }",
        "}",
    ])
    pool.append([
        f"pub fn index_{noun}s(items: Vec<{ty}>) -> HashMap<usize, {ty}> {{",
        "    let mut map = HashMap::new();",
        "    for (i, item) in items.into_iter().enumerate() {",
        "        // Later entries never collide: the key is the position.",
        "        map.insert(i, item);",
        "    }",
        "    map",
        "}",
    ])
    pool.append([
        f"fn parse_{fields[0]}(text: &str) -> Result<u32, String> {{",
        "    let trimmed = text.trim();",
        "    if trimmed.is_empty() {",
        "        return Err(\"empty input\".to_string());",
        "    }",
        "    trimmed.parse::<u32>().map_err(|e| e.to_string())",
        "}",
    ])
    pool.append([
        f"pub fn clamp_{i}(x: i64, lo: i64, hi: i64) -> i64 {{",
        "    match x {",
        "        x if x < lo => lo,",
        "        x if x > hi => hi,",
        "        _ => x,",
        "    }",
        "}",
    ])
    for block in rng.sample(pool, rng.randint(2, len(pool))):
        out += block + [""]
    out += ["#[cfg(test)]", "mod tests {", "    use super::*;", "", "    #[test]", f"    fn new_{noun}_is_empty() {{",
            f"        let x = {ty}::new();", "        assert_eq!(x.clone(), x);", "    }", "}"]
    return "\n".join(out) + "\n"


MODEL_YAML = f"""\
name: m31r-test-tiny
n_layers: 2
d_model: 64
n_heads: 4
ffn_hidden: 128
vocab_size: {VOCAB}
max_context: 128
"""


def train_yaml(**over) -> str:
    cfg = {"model": "model.yaml", "micro_batch": 2, "grad_accum": 1, "max_steps": STEPS, "lr": 3e-3,
           "min_lr": 3e-4, "warmup_steps": 5, "eval_interval": STEPS, "ckpt_interval": 10,
           "seed": 7, "threads": 1, **over}
    return yaml.safe_dump(cfg)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    src = root / "src" / "crate"
    rng = random.Random(0)
    for i in range(40):
        path = src / f"mod_{i:02d}" / f"{NOUNS[i % len(NOUNS)]}.rs"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(rust_file(i, rng))
    data = root / "data"
    manifest = build_corpus([src], data / "corpus", val_fraction=0.2)
    assert manifest["files_kept"] >= 30, manifest
    assert manifest["splits"]["val"]["files"] >= 3, manifest
    train_tokenizer(data / "corpus" / "train.jsonl", data / "tokenizer.json", VOCAB)
    (root / "model.yaml").write_text(MODEL_YAML)
    (root / "train.yaml").write_text(train_yaml())
    return data


@pytest.fixture(scope="module")
def full_run(data_dir: Path) -> tuple[Path, dict]:
    """An uninterrupted run of STEPS steps."""
    run = data_dir.parent / "run-full"
    state = train(data_dir.parent / "train.yaml", data_dir, run, log=lambda s: None)
    return run, state


def test_loss_decreases(full_run):
    _, state = full_run
    hist = state["history"]
    assert state["step"] == STEPS and len(hist) == STEPS
    assert state["tokens"] == STEPS * 2 * 128
    first = sum(h["train_next"] for h in hist[:5]) / 5
    last = sum(h["train_next"] for h in hist[-5:]) / 5
    assert last < first - 0.75, (first, last)  # from ~ln(512) = 6.2 to about 4.7
    assert all(math.isfinite(h["gnorm"]) for h in hist)
    assert "val_next" in hist[-1] and hist[-1]["val_next"] < math.log(VOCAB)
    assert sum(h["train_fim"] > 0 for h in hist) > STEPS // 2  # most steps draw a FIM row (fim_rate 0.5)


def test_resume_matches_uninterrupted(full_run, data_dir: Path, monkeypatch):
    """Kill the run right after its checkpoint at STEPS/2, resume it: the weights equal the full run's."""
    full_dir, full_state = full_run
    run = data_dir.parent / "run-resumed"

    class Killed(Exception):
        pass

    real_save = trainer_mod.save_checkpoint

    def save_then_die(path, model, opt, state):
        real_save(path, model, opt, state)
        if state["step"] == STEPS // 2:
            raise Killed

    monkeypatch.setattr(trainer_mod, "save_checkpoint", save_then_die)
    with pytest.raises(Killed):
        train(data_dir.parent / "train.yaml", data_dir, run, log=lambda s: None)
    monkeypatch.setattr(trainer_mod, "save_checkpoint", real_save)
    logs: list[str] = []
    state = train(data_dir.parent / "train.yaml", data_dir, run, log=logs.append)
    assert any(f"at step {STEPS // 2}" in m for m in logs)
    assert state["step"] == STEPS and state["tokens"] == full_state["tokens"]
    assert "config_changes" not in state  # the same config: nothing to record
    assert [h["train_next"] for h in state["history"]] == [h["train_next"] for h in full_state["history"]]
    a = torch.load(full_dir / "ckpt.pt", weights_only=False)
    b = torch.load(run / "ckpt.pt", weights_only=False)
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k


def test_export_daemon_completes(full_run, data_dir: Path, tmp_path: Path):
    import asyncio

    from m31r_protocol.client import Client
    from m31r_protocol.messages import Done

    run, state = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    b = open_bundle(bundle.path)  # verifies checksums, config, tokenizer and weight shapes
    meta = b.metadata
    manifest = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    assert meta["dataset_version"] == manifest["dataset_version"]
    assert meta["tokenizer_hash"] == trainer_mod.sha256_file(data_dir / "tokenizer.json")
    assert meta["config_hash"] == b.config.config_hash()
    assert meta["training_seed"] == 7 and meta["dtype"] == "bfloat16"
    assert meta["steps"] == STEPS and meta["tokens_seen"] == state["tokens"]
    assert meta["val_loss_next"] == pytest.approx(state["history"][-1]["val_next"], abs=1e-4)
    assert meta["val_perplexity"] == pytest.approx(math.exp(meta["val_loss_next"]), rel=1e-3)
    weights = load_weights(b)
    assert all(t.dtype == torch.bfloat16 for t in weights.values())

    sock = tmp_path / "d.sock"
    proc = start_daemon(b.path, sock)
    try:
        async def fim() -> tuple[str, Done]:
            async with await Client.connect(sock) as client:
                stream = await client.fim("pub fn total(items: &[u32]) -> u64 {\n    let mut ", "\n}\n",
                                          max_tokens=16)
                return await stream.collect()

        text, done = asyncio.run(fim())
        assert isinstance(done, Done) and done.finish_reason in ("stop", "length")
        assert done.usage.completion_tokens <= 16
        assert isinstance(text, str)
    finally:
        stop_daemon(proc)


def test_cli_export(full_run, data_dir: Path, tmp_path: Path):
    from m31r.cli import main

    run, _ = full_run
    out = tmp_path / "cli-bundle"
    result = CliRunner().invoke(main, ["train", "export", "--run", str(run), "--data", str(data_dir),
                                       "--out", str(out), "--model-version", "9.9.9"])
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok m31r-test-tiny@9.9.9")
    assert open_bundle(out).metadata["steps"] == STEPS


def test_eval_fim_benchmark_runs(full_run, data_dir: Path, tmp_path: Path, monkeypatch):
    """benchmarks/eval_fim.py end to end on the exported tiny bundle (a smoke test: the figures are noise)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("eval_fim", Path(__file__).parent.parent / "benchmarks" /
                                                  "eval_fim.py")
    eval_fim = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "eval_fim", eval_fim)  # dataclasses look their module up there
    spec.loader.exec_module(eval_fim)
    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    out = tmp_path / "fim.json"
    assert eval_fim.main(["--bundle", str(bundle.path), "--data", str(data_dir), "--n-single", "6", "--n-multi", "3",
                          "--ppl-windows", "2", "--out", str(out), "--threads", "1"]) == 0
    report = json.loads(out.read_text())
    assert report["single_line"]["n"] == 6 and report["multi_line"]["n"] >= 1
    assert 0.0 <= report["single_line"]["edit_similarity"] <= 1.0
    assert 0 <= report["single_line"]["doubled_space"] <= 6
    assert report["token_healing"] is True and report["healing"] == "whole word"
    assert report["perplexity"]["windows"] == 2 and report["perplexity"]["perplexity"] < VOCAB
    for t in report["tasks"]:
        assert t["target"] and (t["kind"] == "multi" or "\n" not in t["target"] + t["prediction"])
    # Same seed, same tasks; a block body is found by its closing brace.
    tok = bundle_tokenizer(bundle)
    files = [(f"f{i}.rs", "fn a() {\n    b();\n}\n", "big" if i else "small") for i in range(9)]
    tasks = eval_fim.make_tasks(files, 2, 1, 0, tok, 16, 16)
    assert tasks == eval_fim.make_tasks(files, 2, 1, 0, tok, 16, 16)
    assert [t.kind for t in tasks] == ["single", "single", "multi"] and tasks[2].target == "    b();\n"
    # Crates are drawn first: the one-file crate gets about half the tasks, not a ninth.
    small = ("f0.rs", "".join(f"let x{i} = {i};\n" for i in range(100)), "small")
    many = eval_fim.make_tasks([small] + [(f"f{i}.rs", f"fn a{i}() {{\n    let x = {i};\n    b(x);\n}}\n", "big")
                                          for i in range(1, 40)], 60, 0, 1, tok, 16, 16)
    assert len(many) == 60 and 15 <= sum(t.path == "f0.rs" for t in many) <= 45
    assert eval_fim.edit_similarity("abc", "abd") == pytest.approx(2 / 3)
    assert eval_fim.edit_similarity("", "") == 1.0 and eval_fim.levenshtein("kitten", "sitting") == 3
    # `make eval` before `make train-data`: one line that says what to run, not a traceback.
    with pytest.raises(SystemExit) as e:
        eval_fim.main(["--bundle", str(bundle.path), "--data", str(tmp_path / "no-data")])
    assert str(e.value) == (f"error: {tmp_path / 'no-data' / 'corpus' / 'val.jsonl'} does not exist: build the corpus "
                            f"first, `make train-data` (`make train-data DATA={tmp_path / 'no-data'}` for this folder)")


def load_benchmarks(monkeypatch, *names: str) -> dict:
    """benchmarks/NAME.py modules, loaded as their scripts import each other (by bare name)."""
    import importlib.util

    bench = Path(__file__).parent.parent / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    mods = {}
    for name in names:
        spec = importlib.util.spec_from_file_location(name, bench / f"{name}.py")
        mods[name] = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, mods[name])
        spec.loader.exec_module(mods[name])
    return mods


def test_beam_search_benchmarks_run(full_run, data_dir: Path, tmp_path: Path, monkeypatch):
    """eval_fim.py --beams (single-line tasks by a beam search, multi-line ones greedy) and bench_beams.py end to end
    on the exported tiny bundle: smoke tests, the figures are noise."""
    mods = load_benchmarks(monkeypatch, "eval_fim", "bench_beams")
    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    reports = {}
    for beams in (1, 3):
        out = tmp_path / f"fim-{beams}.json"
        assert mods["eval_fim"].main(["--bundle", str(bundle.path), "--data", str(data_dir), "--n-single", "6",
                                      "--n-multi", "3", "--ppl-windows", "1", "--out", str(out), "--threads", "1",
                                      "--beams", str(beams)]) == 0
        reports[beams] = json.loads(out.read_text())
    assert reports[3]["beams"] == 3 and reports[1]["beams"] == 1
    assert reports[1]["single_line"]["alternatives"] == 0
    assert reports[3]["single_line"]["exact_any"] >= reports[3]["single_line"]["exact_match"]
    multi = [[t["prediction"] for t in r["tasks"] if t["kind"] == "multi"] for r in reports.values()]
    assert multi[0] == multi[1]  # multi-line tasks stay greedy
    assert all("\n" not in t["prediction"] for t in reports[3]["tasks"] if t["kind"] == "single")
    out = tmp_path / "beams.json"
    assert mods["bench_beams"].main(["--bundle", str(bundle.path), "--data", str(data_dir), "--tasks", "3",
                                     "--keystrokes", "2", "--widths", "2", "--quant", "none", "--threads", "1",
                                     "--unshared", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["width"], r["shared_prompt"]) for r in rows] == [(1, True), (2, True), (2, False)]
    assert all(r["keystrokes"] >= 3 and r["ms_p50"] > 0 for r in rows)
    assert rows[1]["completion_tokens"] == rows[2]["completion_tokens"]  # the same answers, read either way


def test_the_cold_prefill_benchmark_runs(full_run, data_dir: Path, tmp_path: Path, monkeypatch):
    """bench_prefill.py end to end on the exported tiny bundle: every task's prompt timed, the figures noise."""
    mods = load_benchmarks(monkeypatch, "bench_prefill")
    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    out = tmp_path / "prefill.json"
    assert mods["bench_prefill"].main(["--bundle", str(bundle.path), "--data", str(data_dir), "--tasks", "6",
                                       "--quant", "none", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())["cold_prefill"]
    assert report["tasks"] == 6 and report["prompt_tokens_mean"] > 0
    assert 0 < report["p50_ms"] <= report["p90_ms"] and report["tok_per_s"] > 0


def bundle_tokenizer(bundle):
    from m31r.tokenizer import Tokenizer

    return Tokenizer.from_file(bundle.tokenizer_path, bundle.config.special_tokens)


def first_steps(data_dir: Path, name: str, steps: int, **over) -> dict:
    cfg = data_dir.parent / f"train-{name}.yaml"
    cfg.write_text(train_yaml(**over))
    return train(cfg, data_dir, data_dir.parent / f"run-{name}", max_steps=steps, log=lambda s: None)


def test_rows_built_by_worker_processes_are_the_same_rows(full_run, data_dir: Path):
    _, full_state = full_run
    state = first_steps(data_dir, "workers", 4, data_workers=2)
    assert [h["train_next"] for h in state["history"]] == [h["train_next"] for h in full_state["history"][:4]]
    assert [h["train_fim"] for h in state["history"]] == [h["train_fim"] for h in full_state["history"][:4]]


def crate_labelled(data_dir: Path, out: Path) -> Path:
    """A copy of the data dir whose files all belong to one crate (the fixture's corpus has no Cargo.toml)."""
    import shutil

    shutil.copytree(data_dir, out)
    for split in ("train", "val"):
        f = out / "corpus" / f"{split}.jsonl"
        docs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        f.write_text("".join(json.dumps({**d, "crate": "demo"}) + "\n" for d in docs))
    return out


def test_context_fim_reaches_the_rows(data_dir: Path, tmp_path: Path):
    """context_fim leads FIM samples with snippets of other files of their crate (a comment naming the file, its code,
    <|endoftext|>, right before <|fim_suffix|>); rows stay a function of (seed, step); files of no crate get none."""
    from m31r.train.samples import crate_path

    tok = Tokenizer.from_file(data_dir / "tokenizer.json", DEFAULT_SPECIAL)
    tc = trainer_mod.TrainConfig(model="m", micro_batch=2, grad_accum=1, fim_rate=1.0, seed=3)
    labelled = crate_labelled(data_dir, tmp_path / "data")
    led = trainer_mod.Data(tok, labelled, 2048, tc.fim_rate, 0.0, 1.0)
    rows = trainer_mod.step_batches(led, tc, 2048, 0)[0][0]
    assert torch.equal(rows, trainer_mod.step_batches(led, tc, 2048, 0)[0][0])
    docs = [json.loads(line) for line in (labelled / "corpus" / "train.jsonl").read_text().splitlines()]
    heads = {f"// {crate_path(d['path'])}\n" for d in docs}

    def snippets_in(row: torch.Tensor) -> int:
        text = tok.hf.decode(row.tolist(), skip_special_tokens=False)
        return sum(text.count(h) for h in heads)

    assert all(snippets_in(r) > 0 for r in rows)
    loose = trainer_mod.Data(tok, data_dir, 2048, tc.fim_rate, 0.0, 1.0)  # each file its own crate: no neighbours
    plain = trainer_mod.Data(tok, data_dir, 2048, tc.fim_rate, 0.0, 0.0)
    assert snippets_in(trainer_mod.step_batches(loose, tc, 2048, 0)[0][0][0]) == 0
    assert torch.equal(trainer_mod.step_batches(plain, tc, 2048, 0)[0][0],
                       trainer_mod.step_batches(trainer_mod.Data(tok, labelled, 2048, tc.fim_rate, 0.0, 0.0), tc, 2048,
                                                0)[0][0])  # context_fim 0: the crates change nothing


def test_context_benchmarks_run(full_run, data_dir: Path, tmp_path: Path, monkeypatch):
    """eval_fim.py --context and bench_context.py end to end on the exported tiny bundle: smoke tests, the figures are
    noise; the context makes the prompts longer and changes nothing else about the tasks."""
    mods = load_benchmarks(monkeypatch, "eval_fim", "bench_context")
    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    labelled = crate_labelled(data_dir, tmp_path / "data")
    reports = {}
    for flag in ((), ("--context",)):
        out = tmp_path / f"fim{len(flag)}.json"
        assert mods["eval_fim"].main(["--bundle", str(bundle.path), "--data", str(labelled), "--n-single", "4",
                                      "--n-multi", "2", "--ppl-windows", "1", "--out", str(out), "--threads", "1",
                                      *flag]) == 0
        reports[bool(flag)] = json.loads(out.read_text())
    assert reports[True]["context"] and not reports[False]["context"]
    pairs = list(zip(reports[False]["tasks"], reports[True]["tasks"], strict=True))
    assert all((a["path"], a["line"], a["target"]) == (b["path"], b["line"], b["target"]) for a, b in pairs)
    # Snippets were offered; the tiny model's 128-token context leaves them at most 32 tokens, less than any window
    # of the fixture's files, so none is laid out and the prompts stay as they were.
    assert any(b["snippets"] > 0 for b in reports[True]["tasks"]) and all(a["snippets"] == 0 for a, _ in pairs)
    assert all(b["prompt_tokens"] == a["prompt_tokens"] + b["context_tokens"] for a, b in pairs)
    out = tmp_path / "context.json"
    assert mods["bench_context"].main(["--bundle", str(bundle.path), "--data", str(labelled), "--tasks", "2",
                                       "--max-chars", "6", "--quant", "none", "--threads", "1", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["way"]: r for r in report["rows"]}
    assert report["keystrokes"] >= 2 and all(r["keystrokes"] == report["keystrokes"] for r in rows.values())
    assert report["snippets_offered"] > 0
    assert rows["context"]["prompt_tokens"] >= rows["plain"]["prompt_tokens"]


def test_block_fim_reaches_the_rows(data_dir: Path):
    """block_fim changes which middles the FIM rows hold, and the rows stay a function of (seed, step)."""
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", DEFAULT_SPECIAL)
    tc = trainer_mod.TrainConfig(model="m", micro_batch=2, grad_accum=1, fim_rate=1.0, seed=3)
    data = trainer_mod.Data(tok, data_dir, 128, tc.fim_rate, 0.0)
    block = trainer_mod.Data(tok, data_dir, 128, tc.fim_rate, 1.0)
    plain = trainer_mod.step_batches(data, tc, 128, 0)[0][0]
    ours = trainer_mod.step_batches(block, tc, 128, 0)[0][0]
    assert not torch.equal(plain, ours)
    assert torch.equal(ours, trainer_mod.step_batches(block, tc, 128, 0)[0][0])
    # A block-body middle ends where its closing line starts: the suffix (right after <|fim_suffix|>) opens with
    # that `}` line in every whole sample of the row.
    ids = ours[0].tolist()
    starts = [i for i, t in enumerate(ids) if t == tok.fim_suffix_id]
    ends = [i for i, t in enumerate(ids) if t == tok.fim_prefix_id]
    suffixes = [tok.decode(ids[a + 1 : b]) for a, b in zip(starts, ends, strict=False)]
    assert suffixes and all(s.lstrip(" ").startswith("}") for s in suffixes), suffixes
    state = first_steps(data_dir, "block-fim", 2, block_fim=0.5)
    assert state["train_config"]["block_fim"] == 0.5 and len(state["history"]) == 2


def test_context_schedule_keeps_tokens_per_step(data_dir: Path):
    state = first_steps(data_dir, "schedule", 6, max_steps=8, context_schedule=[[0.0, 32], [0.5, 64], [0.75, 128]])
    assert [h["seq"] for h in state["history"]] == [32, 32, 32, 32, 64, 64]
    assert state["tokens"] == 6 * 2 * 128  # 8 rows of 32, 4 of 64, 2 of 128: the same tokens every step
    with pytest.raises(ValueError, match="outside"):
        first_steps(data_dir, "bad-schedule", 1, context_schedule=[[0.0, 256]])


def test_new_run_starts_from_a_bundle(full_run, data_dir: Path, tmp_path: Path):
    run, full_state = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    logs: list[str] = []
    cfg = data_dir.parent / "train-init.yaml"
    cfg.write_text(train_yaml())
    state = train(cfg, data_dir, tmp_path / "run-init", init_from=bundle.path, max_steps=2, log=logs.append)
    assert any("new run from the weights of" in m for m in logs)
    assert state["init_from"] == {"model": "m31r-test-tiny@0.1.0", "tokens_seen": full_state["tokens"],
                                  "dataset_version": bundle.metadata["dataset_version"]}
    # The trained weights predict the first batch far better than a fresh init does.
    assert state["history"][0]["train_next"] < full_state["history"][0]["train_next"] - 1.0
    # A bundle of another shape is refused with a clear message.
    other = tmp_path / "other.yaml"
    other.write_text(MODEL_YAML.replace("d_model: 64", "d_model: 32"))
    cfg.write_text(train_yaml(model="other.yaml"))
    cfg.with_name("other.yaml").write_text(other.read_text())
    with pytest.raises(ValueError, match="do not fit this model config"):
        train(cfg, data_dir, tmp_path / "run-other", init_from=bundle.path, max_steps=1, log=lambda s: None)


def test_a_run_continues_on_textbook_pieces(full_run, data_dir: Path, tmp_path: Path):
    """`m31r train textbook` makes a data folder that `train` and `export` take as they take the corpus, and the
    bundle says which data it saw."""
    from m31r.cli import main

    run, _ = full_run
    tb = tmp_path / "textbook"
    result = CliRunner().invoke(main, ["train", "textbook", str(data_dir), "--out", str(tb)])
    assert result.exit_code == 0, result.output
    assert "documented functions" in result.output
    texts = [json.loads(line)["text"] for line in (tb / "corpus" / "train.jsonl").read_text().splitlines()]
    assert any(t.startswith("/// Creates an empty `") for t in texts)  # the fixture's `new` with its doc comment
    bad = CliRunner().invoke(main, ["train", "textbook", str(data_dir), "--out", str(data_dir)])
    assert bad.exit_code != 0 and "other than DATA_DIR" in bad.output

    bundle = export(run, data_dir, tmp_path / "bundle")
    cfg = data_dir.parent / "train-textbook.yaml"
    cfg.write_text(train_yaml(fim_rate=0.7, block_fim=0.5))
    state = train(cfg, tb, tmp_path / "run-tb", init_from=bundle.path, max_steps=2, log=lambda s: None)
    assert state["step"] == 2 and all(math.isfinite(h["train_fim"]) for h in state["history"])
    out = export(tmp_path / "run-tb", tb, tmp_path / "tb-bundle")
    assert out.metadata["dataset_version"].startswith(bundle.metadata["dataset_version"] + "+textbook-")


def test_weights_travel_as_shards_and_training_continues(full_run, data_dir: Path, tmp_path: Path):
    from m31r.train.shards import import_shards, write_shards

    run, full_state = full_run
    # The embedding (512 x 64 bf16 = 64 KiB) is over the limit: it travels split by rows across shards.
    files = write_shards(run / "ckpt.pt", tmp_path / "shards", max_bytes=48_000)
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(shards) > 1 and all(f.stat().st_size <= 48_000 for f in shards)
    names = [k for f in shards for k in load_file(str(f))]
    assert sum(k.startswith("tok_embeddings.weight@") for k in names) >= 2, names
    state = import_shards(tmp_path / "shards", tmp_path / "run-back")
    assert state["step"] == full_state["step"] and state["tokens"] == full_state["tokens"]
    a = torch.load(run / "ckpt.pt", weights_only=False)["model"]
    b = torch.load(tmp_path / "run-back" / "ckpt.pt", weights_only=False)["model"]
    assert all(torch.equal(a[k].to(torch.bfloat16).float(), b[k]) for k in a)  # bf16 on the way
    shards[0].unlink()
    with pytest.raises(ValueError, match="shards present"):
        import_shards(tmp_path / "shards", tmp_path / "run-broken")
    # Training goes on from the imported weights, with a fresh optimizer.
    cfg = data_dir.parent / "train-more.yaml"
    cfg.write_text(train_yaml(max_steps=STEPS + 2))
    logs: list[str] = []
    more = train(cfg, data_dir, tmp_path / "run-back", log=logs.append)
    assert more["step"] == STEPS + 2 and any("no optimizer state" in m for m in logs)
    # The resumed run followed the edited config, and its state and the exported metadata say so.
    assert more["train_config"]["max_steps"] == STEPS + 2
    assert more["config_changes"] == [{"step": STEPS, "changed": {"max_steps": [STEPS, STEPS + 2]}}]
    meta = export(tmp_path / "run-back", data_dir, tmp_path / "bundle-more").metadata
    assert meta["train_config"]["max_steps"] == STEPS + 2
    assert meta["train_config_changes"] == more["config_changes"]


def test_a_run_starts_from_an_int8_bundle(full_run, data_dir: Path, tmp_path: Path):
    """An int8 bundle (half the bytes, for a narrow transfer) starts a run from its dequantized weights."""
    from m31r.bundle import quantize_bundle

    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    int8 = quantize_bundle(bundle.path, tmp_path / "bundle-int8", "int8")
    cfg = data_dir.parent / "train-int8.yaml"
    cfg.write_text(train_yaml())
    from_float = train(cfg, data_dir, tmp_path / "run-float", init_from=bundle.path, max_steps=1, log=lambda s: None)
    from_int8 = train(cfg, data_dir, tmp_path / "run-int8", init_from=int8.path, max_steps=1, log=lambda s: None)
    first = from_float["history"][0]["train_next"]
    assert from_int8["history"][0]["train_next"] == pytest.approx(first, abs=0.05)
    assert from_int8["history"][0]["train_next"] != first  # the weights did go through int8
    int4 = quantize_bundle(bundle.path, tmp_path / "bundle-int4", "int4", group_size=32)
    with pytest.raises(ValueError, match="int4 bundle"):
        train(cfg, data_dir, tmp_path / "run-int4", init_from=int4.path, max_steps=1, log=lambda s: None)


def pack(data_dir: Path, bundle: Path, dest: Path, limit: int | str = "1G", part: str = "8K", repo: Path | None = None,
         **env_over: str):
    """scripts/pack-device.sh into `dest` (the repository's tree, or `repo`'s, is measured as on a lease, nothing is
    written there), starting from `bundle`; the msgspec wheel is put there first, so nothing is downloaded.
    `env_over`: more of the script's environment."""
    import os
    import subprocess

    import msgspec

    whl = dest / ".whl"
    whl.mkdir(parents=True, exist_ok=True)
    (whl / f"msgspec-{msgspec.__version__}-cp312-cp312-manylinux_2_17_x86_64.whl").write_bytes(b"wheel")
    env = {**os.environ, "DATA": str(data_dir), "DEST": str(dest), "RELEASE": str(bundle), "PART": part,
           "LIMIT": str(limit), "PY": sys.executable, "M31R": str(Path(sys.executable).parent / "m31r"), **env_over}
    repo = repo or Path(__file__).resolve().parent.parent
    return subprocess.run(["bash", "scripts/pack-device.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)


def travelling_files(repo: Path) -> list[Path]:
    """What the device tool sends of a repository beside the carried folders: tracked files and untracked ones git
    does not ignore, as they are in the working tree (release weights out)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    return [repo / f for f in names if f != "release/model.safetensors" and (repo / f).is_file()]


def test_pack_device_splits_the_corpus_to_fit_one_call(full_run, data_dir: Path, tmp_path: Path):
    """pack-device.sh compresses the corpus in parts listed in order in parts.txt, keeps what fits the call's
    ceiling (the repository's travelling files counted, the release weights not) and moves the trailing parts out for
    the upload call; packed again with the same corpus, it moves them back and out again without recompressing."""
    import lzma

    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    dest = tmp_path / "dest"
    proc = pack(data_dir, bundle.path, dest)
    assert proc.returncode == 0, proc.stderr
    device, more = dest / ".device", dest / ".device-more"
    names = (device / "parts.txt").read_text().split()
    assert len(names) >= 4 and names == sorted(names) and not more.exists()
    whole = b"".join(lzma.decompress((device / n).read_bytes()) for n in names)
    assert whole == (data_dir / "corpus" / "train.jsonl").read_bytes()  # nothing lost or reordered
    init = device / "init"
    assert (init / "model.safetensors").exists() and "int8" in (init / "metadata.json").read_text()
    assert lzma.decompress((device / "val.jsonl.xz").read_bytes()) == (data_dir / "corpus" / "val.jsonl").read_bytes()

    # The ceiling two parts short of everything: exactly the last two go out, the list keeps all of them.
    tracked = sum(f.stat().st_size for f in travelling_files(Path(__file__).resolve().parent.parent))
    total = tracked + sum(f.stat().st_size for d in (device, dest / ".whl") for f in d.rglob("*") if f.is_file())
    mtimes = {n: (device / n).stat().st_mtime_ns for n in names}
    last_two = sum((device / n).stat().st_size for n in names[-2:])
    proc = pack(data_dir, bundle.path, dest, limit=total - last_two + 1024)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in more.iterdir()) == names[-2:] and "upload call first" in proc.stdout
    assert (device / "parts.txt").read_text().split() == names
    assert {n: ((device / n) if (device / n).exists() else (more / n)).stat().st_mtime_ns for n in names} == mtimes
    proc = pack(data_dir, bundle.path, dest, limit=1024)
    assert proc.returncode == 1 and "the init and one corpus part are over" in proc.stderr


def test_pack_device_measures_the_tree_the_device_tool_sends(full_run, data_dir: Path, tmp_path: Path):
    """The ceiling is checked against what the device tool sends: tracked files and untracked ones git does not
    ignore (they count towards its 64 MiB too), never ignored ones or the packed folders twice; a tracked file
    deleted in the working tree travels as nothing (du stopped the pack on it, with only its own message)."""
    import shutil
    import subprocess

    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(Path(__file__).resolve().parent.parent / "scripts" / "pack-device.sh", repo / "scripts")
    (repo / ".gitignore").write_text("/.device/\n/.device-more/\n.whl/\nignored.bin\n")
    (repo / "gone.txt").write_text("deleted since the last commit\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], cwd=repo, check=True)
    (repo / "gone.txt").unlink()
    (repo / "untracked.bin").write_bytes(bytes(3 * 2**20))  # travels: counted
    (repo / "ignored.bin").write_bytes(bytes(5 * 2**20))  # stays here: not counted
    proc = pack(data_dir, bundle.path, repo, repo=repo)
    assert proc.returncode == 0, proc.stderr
    assert "(code 3 MiB, release weights left out)" in proc.stdout
    assert sum(f.stat().st_size for f in travelling_files(repo)) < 3 * 2**20 + 2**20  # .device/, .whl/ not in it


def test_pack_device_packs_a_rebuilt_corpus_again_and_never_leaves_a_cut_file(full_run, data_dir: Path,
                                                                              tmp_path: Path):
    """A pack cut short while compressing leaves no .xz that a later pack would take as done, and a corpus built
    again (another split: both files change) is packed again, the validation split included."""
    import lzma
    import os
    import shutil

    run, _ = full_run
    bundle = export(run, data_dir, tmp_path / "bundle")
    data, dest = tmp_path / "data", tmp_path / "dest"
    shutil.copytree(data_dir, data, ignore=shutil.ignore_patterns("*.npz"))
    device = dest / ".device"
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "xz").write_text("#!/bin/sh\nprintf 'cut short'\nexit 1\n")  # an xz killed halfway through its output
    (fake / "xz").chmod(0o755)
    proc = pack(data, bundle.path, dest, PATH=f"{fake}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode != 0 and not (device / "val.jsonl.xz").exists()

    def packed_right() -> bool:
        names = (device / "parts.txt").read_text().split()
        train = b"".join(lzma.decompress((device / n).read_bytes()) for n in names)
        return (lzma.decompress((device / "val.jsonl.xz").read_bytes()) == (data / "corpus" / "val.jsonl").read_bytes()
                and train == (data / "corpus" / "train.jsonl").read_bytes())

    assert pack(data, bundle.path, dest).returncode == 0 and packed_right()
    train, val = data / "corpus" / "train.jsonl", data / "corpus" / "val.jsonl"
    moved = train.read_text().splitlines(keepends=True)
    train.write_text("".join(moved[3:]))  # the corpus built again with another split: three files change sides
    val.write_text(val.read_text() + "".join(moved[:3]))
    assert pack(data, bundle.path, dest).returncode == 0 and packed_right()
    assert not list(device.glob(".parts.*")) and not list(device.glob("*.tmp"))


def test_importing_shards_never_overwrites_a_checkpoint_unasked(full_run, tmp_path: Path, monkeypatch):
    """import-shards refuses a run folder that has a checkpoint (it may be the run's only copy) unless --force, and
    writes the checkpoint under another name first: a failure while writing leaves the old one whole. The state
    travels whole, the tokenizer and dataset the run trained with included."""
    from m31r.cli import main
    from m31r.train import shards

    run, state = full_run
    shards.write_shards(run / "ckpt.pt", tmp_path / "shards")
    target = tmp_path / "run"
    imported = shards.import_shards(tmp_path / "shards", target)
    assert imported["step"] == STEPS and imported["tokenizer_sha256"] == state["tokenizer_sha256"]
    assert imported["dataset_version"] == state["dataset_version"]
    before = (target / "ckpt.pt").read_bytes()
    args = ["train", "import-shards", str(tmp_path / "shards"), "--run", str(target)]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 1 and "exists" in r.stderr and "--force" in r.stderr
    assert (target / "ckpt.pt").read_bytes() == before

    def cut_short(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    monkeypatch.setattr(shards.torch, "save", cut_short)
    with pytest.raises(OSError, match="No space"):
        shards.import_shards(tmp_path / "shards", target, force=True)
    monkeypatch.undo()
    # (the lock file is the run folder's: import-shards holds it as a trainer does)
    assert (target / "ckpt.pt").read_bytes() == before and sorted(p.name for p in target.iterdir()) == [
        "ckpt.pt", "lock"]
    r = CliRunner().invoke(main, [*args, "--force"])
    assert r.exit_code == 0, r.output
    assert torch.load(target / "ckpt.pt", weights_only=False)["state"]["step"] == STEPS


def test_the_device_script_trains_and_sends_the_weights_back(full_run, data_dir: Path, tmp_path: Path):
    """scripts/device-train.sh as a lent GPU machine runs it, here on the CPU, on what pack-device.sh packed: it
    unpacks the corpus (a part of it from an upload call), starts from the int8 init bundle, trains for the minutes
    its call has left (a config scheduled by minutes) and leaves the weights as shards with the log in OUT; the
    shards import back into a run."""
    import os
    import shutil
    import subprocess
    import sysconfig

    from m31r.train.shards import import_shards

    run, _ = full_run
    out = tmp_path / "out"
    out.mkdir()
    bundle = export(run, data_dir, tmp_path / "bundle")
    dest = tmp_path / "dest"
    assert pack(data_dir, bundle.path, dest, part="16K").returncode == 0
    packed, more = dest / ".device", dest / ".device-more"
    names = (packed / "parts.txt").read_text().split()
    assert len(names) >= 2
    more.mkdir()  # the last part goes to the machine in an upload call first, as when the corpus is too large
    (packed / names[-1]).rename(more / names[-1])
    lines = (data_dir / "corpus" / "train.jsonl").read_bytes().splitlines(keepends=True)
    shutil.copy(data_dir.parent / "model.yaml", tmp_path / "model.yaml")
    cfg = tmp_path / "device.yaml"
    cfg.write_text(train_yaml(max_steps=100_000, minutes=1.0, warmup_steps=2, eval_interval=100_000,
                              ckpt_interval=100_000, data_workers=2))
    # The device's Python has torch and the rest but not this project installed: `-S` leaves out the editable
    # install's .pth, so the script must find every package of the repository by itself (as there).
    site_dirs = os.pathsep.join(sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}))
    python = tmp_path / "device-python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="$PYTHONPATH:{site_dirs}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    # An nvidia-smi of our own, so that the GPU sampler runs too: a sample every GPU_SAMPLE_S seconds, as the real
    # one prints them with -l.
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *" -l "*) ;; *) exit 0 ;; esac\n'
                                     'while :; do echo "2026/11/27 20:00:00.000, 97, 1500, 1980, 512.5, 61"; '
                                     'sleep 0.2; done\n')
    (fake / "nvidia-smi").chmod(0o755)
    env = {**os.environ, "CONFIG": str(cfg), "BUDGET": "30", "DEVICE": "cpu", "PYTHON": str(python),
           "WORK": str(tmp_path / "work"), "OUT": str(out), "PACKED": str(packed), "GPU_SAMPLE_S": "0.2",
           "PROFILE": "1-2",
           "PATH": f"{fake}{os.pathsep}{os.environ['PATH']}"}
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)  # without the upload call first: a clear stop before any training
    assert proc.returncode == 1 and f"{names[-1]} is missing: run the upload call" in proc.stderr
    assert not (tmp_path / "work" / "run").exists()
    proc = subprocess.run(["bash", "scripts/device-train.sh", "upload"], cwd=repo, env={**env, "MORE": str(more)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=repo, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert (tmp_path / "work" / "data" / "corpus" / "train.jsonl").read_bytes() == b"".join(lines)
    assert "new run from the weights of" in proc.stdout + proc.stderr and "tokenising" in proc.stderr
    assert (out / "log.jsonl").exists() and (out / "shards" / "state.json").exists()
    state = import_shards(out / "shards", tmp_path / "back")
    assert state["step"] >= 1 and state["init_from"]["model"] == bundle.model_id
    assert 0.1 <= state["train_config"]["minutes"] < 0.5  # what the call had left, not the config's 1.0
    assert state["history"][-1]["lr"] < 3e-4 * 1.2  # decayed to about min_lr by the end of those minutes
    # Which side limits the run: each step's wait on the row builders, summed in the call's last lines.
    waits = [r["rows_wait_s"] for r in state["history"]]
    assert all(w >= 0 for w in waits) and "blocked on the row builders:" in proc.stdout
    # What the GPU did meanwhile: its samples come back, summed up in one line, and the sampler is gone.
    assert proc.stdout.count("gpu sample: 2026/11/27 20:00:00.000, 97, 1500, 1980, 512.5, 61\n") >= 2
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == sorted(
        ["log.jsonl", "profile.txt", "state.json", *(p.name for p in (out / "shards").glob("weights-*"))])  # 8 at most
    assert "steps 1 to 2 (2):" in (out / "profile.txt").read_text()  # what feeding the device cost, profiled
    assert "GPU while training: utilisation median 97% (" in proc.stdout
    assert "SM clock median 1500 of 1980 MHz, power median 512 W" in proc.stdout
    assert subprocess.run(["pgrep", "-f", str(fake / "nvidia-smi")], capture_output=True).returncode == 1
    # A second candidate on the warm machine (RUN): the same start, not the first run's weights, and the corpus as the
    # first call left it (not unpacked or tokenised again).
    out2 = tmp_path / "out2"
    out2.mkdir()
    proc = subprocess.run(["bash", "scripts/device-train.sh"], cwd=repo, env={**env, "OUT": str(out2), "RUN": "b"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "new run from the weights of" in proc.stdout + proc.stderr and "tokenising" not in proc.stderr
    second = import_shards(out2 / "shards", tmp_path / "back2")
    assert second["init_from"]["model"] == bundle.model_id
    assert second["history"][0]["step"] == state["history"][0]["step"]  # counted from the start again
    assert (tmp_path / "work" / "run" / "ckpt.pt").exists() and (tmp_path / "work" / "b" / "ckpt.pt").exists()


def test_training_without_a_data_folder_says_how_to_make_one(tmp_path: Path):
    """`make train` or `make bench-train` before `make train-data`: one line naming what is missing and the command
    that makes it (the tokenizers library alone said "No such file or directory (os error 2)"), and no run folder."""
    import subprocess

    empty = tmp_path / "data"
    empty.mkdir()
    (empty / "tokenizer.json").write_text("{}")
    config = Path(__file__).resolve().parent.parent / "configs" / "train" / "mini-phase6.yaml"
    r = subprocess.run([sys.executable, "-m", "m31r.cli", "train", "model", str(config), "--data", str(empty),
                        "--run", str(tmp_path / "run"), "--max-steps", "1"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr == (f"error: {empty} is not a training data folder (corpus/train.jsonl, corpus/val.jsonl missing): "
                        f"build it with `make train-data` (`make train-data DATA={empty}` for this folder)\n")
    assert not (tmp_path / "run").exists()
    # Exporting a run folder that holds no checkpoint says where one comes from.
    (tmp_path / "empty-run").mkdir()
    r = subprocess.run([sys.executable, "-m", "m31r.cli", "train", "export", "--run", str(tmp_path / "empty-run"),
                        "--data", str(empty), "--out", str(tmp_path / "out"), "--model-version", "0.0.1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.startswith(f"error: {tmp_path / 'empty-run'} holds no checkpoint (ckpt.pt)")
    assert "m31r train import-shards" in r.stderr and not (tmp_path / "out").exists()


TRAIN_CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs" / "train").glob("*.yaml"))


@pytest.mark.parametrize("config", TRAIN_CONFIGS, ids=lambda p: p.stem)
def test_every_train_config_loads_with_its_model(config: Path):
    """A lease's minutes are too few to find a typo in its config there: each one here parses, names a model
    config that exists, and asks for shares and rates that make sense."""
    from m31r.train.trainer import load_train_config

    tc, model = load_train_config(config)
    assert model.n_layers > 0 and model.vocab_size > 0
    assert 0 <= tc.fim_rate <= 1 and 0 <= tc.block_fim <= 1 and 0 <= tc.context_fim <= 1
    assert 0 < tc.min_lr <= tc.lr and tc.micro_batch > 0 and tc.grad_accum > 0


def test_schedule_by_minutes(data_dir: Path, tmp_path: Path):
    """A run scheduled by minutes decays its lr over training time and ends when the minutes are spent."""
    from m31r.train.trainer import TrainConfig, lr_at

    tc = TrainConfig(model="m", lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=100, minutes=2.0)
    assert lr_at(5, tc, seconds=0.0) == pytest.approx(6e-4)  # warm-up still counts steps
    assert lr_at(50, tc, seconds=60.0) == pytest.approx(5.5e-4)  # half the minutes: half-way down the cosine
    assert lr_at(11, tc, seconds=120.0) == pytest.approx(1e-4) == lr_at(99, tc, seconds=500.0)
    cfg = data_dir.parent / "train-minutes.yaml"
    cfg.write_text(train_yaml(max_steps=100_000, minutes=0.02, warmup_steps=2, eval_interval=100_000,
                              ckpt_interval=100_000))
    state = train(cfg, data_dir, tmp_path / "run-minutes", log=lambda s: None)
    hist = state["history"]
    assert 2 < state["step"] < 100_000 and 1.2 <= state["seconds"] < 1.2 + 3.0  # ends at the step after
    lrs = [h["lr"] for h in hist[2:]]
    assert lrs == sorted(lrs, reverse=True) and lrs[-1] < 3e-4 * 1.2  # decayed to about min_lr
    assert "val_next" in hist[-1] and (tmp_path / "run-minutes" / "ckpt.pt").exists()  # the end evaluates and saves
    cfg.write_text(train_yaml(minutes=1.0, context_schedule=[[0.0, 64]]))
    with pytest.raises(ValueError, match="no context_schedule"):
        train(cfg, data_dir, tmp_path / "run-bad", log=lambda s: None)


def test_autocast_only_where_bf16_is_native():
    from m31r.engine import fast_bf16
    from m31r.train.trainer import autocast_dtype

    cpu = torch.device("cpu")
    assert autocast_dtype("auto", cpu) == (torch.bfloat16 if fast_bf16(cpu) else None)
    assert autocast_dtype("float32", cpu) is None and autocast_dtype("bfloat16", cpu) is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be"):
        autocast_dtype("fp8", cpu)


def test_a_pause_file_holds_the_run_between_steps(data_dir: Path, tmp_path: Path):
    """RUN/PAUSE holds training between steps, and the wait counts in neither the steps' time nor the minutes."""
    import threading
    import time

    from m31r.train.trainer import PAUSE_FILE

    run = tmp_path / "run-pause"
    run.mkdir()
    (run / PAUSE_FILE).touch()
    cfg = data_dir.parent / "train-pause.yaml"
    cfg.write_text(train_yaml(max_steps=4, eval_interval=100, ckpt_interval=100))
    messages: list[str] = []
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(state=train(cfg, data_dir, run, log=messages.append)))
    worker.start()
    deadline = time.time() + 60
    while not any(m.startswith("paused") for m in messages) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(3.0)
    assert not (run / "ckpt.pt").exists() and worker.is_alive()  # held before its first step
    (run / PAUSE_FILE).unlink()
    worker.join(120)
    state = result["state"]
    assert state["step"] == 4 and any(m.startswith("resumed after") for m in messages)
    assert state["seconds"] < 3.0  # the steps' own time, without the wait


def test_a_corpus_built_again_is_tokenised_again(data_dir: Path, tmp_path: Path):
    """Token streams are cached beside the corpus; a rebuilt corpus in the same folder must not reuse them."""
    import shutil

    from m31r.train.trainer import corpus_tokens

    data = tmp_path / "data"
    shutil.copytree(data_dir, data, ignore=shutil.ignore_patterns("*.npz"))
    before = corpus_tokens(data)
    assert len(list(data.glob("train-*.npz"))) == 1
    train = data / "corpus" / "train.jsonl"
    lines = train.read_text().splitlines(keepends=True)
    train.write_text("".join(lines + lines[:3]))  # the corpus grows
    after = corpus_tokens(data)
    assert after["train"] > before["train"] and after["val"] == before["val"]
    assert len(list(data.glob("train-*.npz"))) == 1  # the stale stream is gone


def test_the_token_stream_is_the_same_from_any_number_of_processes(data_dir: Path, tmp_path: Path, monkeypatch):
    """Forked processes tokenise ranges of files (trainer.token_stream); the stream, categories included, is each
    file's own tokenisation followed by <|endoftext|>, in corpus order, however many processes build it."""
    from m31r.train import trainer
    from m31r.train.samples import tokenize_document

    tok = Tokenizer.from_file(data_dir / "tokenizer.json", trainer.DEFAULT_SPECIAL)
    texts = [t for t in trainer.read_jsonl(data_dir / "corpus" / "train.jsonl") if t][:40]
    texts[5] = "fn f() {\n    // add one\n    x + 1\n}\n"  # a reasoning comment: COT tokens in the stream
    monkeypatch.setattr(trainer, "TOKENISE_CHUNK", 3)  # 14 ranges, so order across processes matters
    serial = trainer.token_stream(tok, texts, tmp_path / "one.npz", workers=1)
    forked = trainer.token_stream(tok, texts, tmp_path / "three.npz", workers=3)
    want_ids, want_cats = [], []
    for text in texts:
        ids, cats = tokenize_document(tok, text)
        want_ids += [*ids, tok.eos_id]
        want_cats += [*cats, trainer.NEXT]
    for ids, cats in (serial, forked):
        assert ids.tolist() == want_ids and cats.tolist() == want_cats
    assert trainer.COT in want_cats
    cached = trainer.token_stream(tok, [], tmp_path / "three.npz")  # read back from its cache, not tokenised again
    assert cached[0].tolist() == want_ids


def test_every_run_is_measured_on_the_same_validation_rows(data_dir: Path):
    """The losses a run logs come from rows of their own seed and shares (trainer.validation_rows), not the run's: two
    configs with other seeds, FIM shares and micro-batches give the same figures for the same weights."""
    from m31r.config import load_config
    from m31r.model import Transformer
    from m31r.train.samples import FIM, NEXT
    from m31r.train.trainer import VAL_ROWS, Data, TrainConfig, evaluate

    mc = load_config(data_dir.parent / "model.yaml")
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", mc.special_tokens)
    plain = Data(tok, data_dir, mc.max_context, fim_rate=0.0, block_fim=0.0)
    fim = Data(tok, data_dir, mc.max_context, fim_rate=0.9, block_fim=0.6)
    rows, cats = plain.validation_rows()
    assert rows.shape == (VAL_ROWS, mc.max_context + 1)
    assert torch.equal(rows, fim.validation_rows()[0]) and torch.equal(cats, fim.validation_rows()[1])
    assert (cats == FIM).any() and (cats == NEXT).any()  # plain and FIM rows both, whatever the run's shares
    torch.manual_seed(0)
    model = Transformer(mc)
    one = evaluate(model, plain, TrainConfig(model="m", micro_batch=1, seed=1), None)
    five = evaluate(model, fim, TrainConfig(model="m", micro_batch=5, seed=2), None)
    assert one == pytest.approx(five, rel=1e-5) and one["next"] > 0 and one["fim"] > 0
    assert model.training  # handed back in training mode


def test_a_steps_gradient_does_not_depend_on_its_micro_batches(data_dir: Path):
    """Each category's mean runs over the whole step (trainer.accumulate_step): four rows as one micro-batch or as four
    give the same loss terms and the same gradient. Per-micro-batch means did not: a lone row's FIM tokens were
    weighted by its own count of them (the CPU phases' one-row micro-batches)."""
    import random as rnd

    from m31r.config import load_config
    from m31r.model import Transformer
    from m31r.train.samples import FIM
    from m31r.train.trainer import Data, TrainConfig, accumulate_step, loss_terms

    mc = load_config(data_dir.parent / "model.yaml")
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", mc.special_tokens)
    data = Data(tok, data_dir, mc.max_context, fim_rate=0.5, block_fim=0.0)
    rows, cats = data.batch("train", rnd.Random(3), 4)
    assert len({int((c[1:] == FIM).sum()) for c in cats}) > 1  # rows with different counts of FIM tokens
    torch.manual_seed(0)
    model = Transformer(mc)
    tc = TrainConfig(model="m", alpha=0.3, beta=0.2)

    def grads(batches) -> tuple[dict[str, float], torch.Tensor]:
        model.zero_grad(set_to_none=True)
        parts = accumulate_step(model, batches, tc, None)
        return parts, torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    whole, g_whole = grads([(rows, cats)])
    split, g_split = grads([(rows[i : i + 1], cats[i : i + 1]) for i in range(4)])
    assert split == pytest.approx(whole, rel=1e-5)
    assert torch.allclose(g_split, g_whole, rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        one = loss_terms(model, rows, cats, None)  # one micro-batch: its own means, as before
        # The mean of per-row means (the old accumulation) is another figure whenever rows hold different counts.
        per_row = [loss_terms(model, rows[i : i + 1], cats[i : i + 1], None)["fim"] for i in range(4)]
    assert {k: float(v) for k, v in one.items()} == pytest.approx(whole, rel=1e-5)
    assert abs(float(sum(per_row)) / 4 - whole["fim"]) > 1e-3


def test_a_run_keeps_the_tokenizer_and_dataset_it_trained_with(full_run, data_dir: Path, tmp_path: Path):
    """A run records its tokenizer's sha256 and dataset version when it starts. Export and resume with a data folder
    of another tokenizer are refused (its ids would not be the ones the weights learned), naming both hashes, and
    before anything is written or tokenised; with the same tokenizer and another corpus the bundle names the run's
    dataset, and a resume records the change. A run from before they were recorded takes DATA's, and says so."""
    import shutil

    run, state = full_run
    manifest = json.loads((data_dir / "corpus" / "manifest.json").read_text())
    ours = trainer_mod.sha256_file(data_dir / "tokenizer.json")
    assert state["tokenizer_sha256"] == ours and state["dataset_version"] == manifest["dataset_version"]
    other = tmp_path / "other"  # the same files under another version, with a tokenizer trained on the other split
    shutil.copytree(data_dir / "corpus", other / "corpus")
    (other / "corpus" / "manifest.json").write_text(json.dumps({**manifest, "dataset_version": "elsewhere+1"}))
    train_tokenizer(other / "corpus" / "val.jsonl", other / "tokenizer.json", VOCAB)
    theirs = trainer_mod.sha256_file(other / "tokenizer.json")
    assert theirs != ours
    out = tmp_path / "bundle"
    with pytest.raises(ValueError, match=theirs) as refused:
        export(run, other, out, log=lambda s: None)
    assert ours in str(refused.value) and not out.exists()
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copy(run / "ckpt.pt", resumed / "ckpt.pt")
    cfg = tmp_path / "more.yaml"
    cfg.write_text(train_yaml(max_steps=STEPS + 1, model=str(data_dir.parent / "model.yaml")))
    with pytest.raises(ValueError, match=f"{theirs}.*{ours}"):
        train(cfg, other, resumed, log=lambda s: None)
    assert not list(other.glob("*.npz"))  # refused before the corpus was tokenised with the wrong tokenizer

    shutil.copy(data_dir / "tokenizer.json", other / "tokenizer.json")
    logs: list[str] = []
    meta = export(run, other, out, log=logs.append).metadata
    assert meta["dataset_version"] == manifest["dataset_version"] and meta["dataset_packages"] == {}
    assert any("not the run's" in m for m in logs)
    more = train(cfg, other, resumed, log=logs.append)
    assert more["dataset_version"] == manifest["dataset_version"]
    assert more["dataset_changes"] == [{"step": STEPS, "dataset_version": "elsewhere+1"}]
    assert export(resumed, other, out, log=lambda s: None).metadata["dataset_changes"] == more["dataset_changes"]

    old = tmp_path / "old-run"  # a checkpoint (or shards) from before the run recorded them
    old.mkdir()
    saved = torch.load(run / "ckpt.pt", weights_only=False)
    del saved["state"]["tokenizer_sha256"], saved["state"]["dataset_version"]
    torch.save(saved, old / "ckpt.pt")
    logs.clear()
    meta = export(old, data_dir, tmp_path / "old-bundle", log=logs.append).metadata
    assert meta["dataset_version"] == manifest["dataset_version"] and meta["tokenizer_hash"] == ours
    assert any("records no tokenizer" in m and ours in m for m in logs)


def test_export_replaces_the_bundle_only_once_the_new_one_is_whole(full_run, data_dir: Path, tmp_path: Path,
                                                                  monkeypatch):
    """`make export` writes into release/: a wrong run folder, or a failure while writing, leaves the bundle there as
    it was; a good export replaces it whole (a file kept beside it stays) and leaves no temporary folder behind."""
    from m31r.cli import main

    run, _ = full_run
    out = tmp_path / "release"
    export(run, data_dir, out, model_version="1.0.0")
    (out / "NOTES.md").write_text("kept")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    (tmp_path / "empty-run").mkdir()
    r = CliRunner().invoke(main, ["train", "export", "--run", str(tmp_path / "empty-run"), "--data", str(data_dir),
                                  "--out", str(out)])
    assert r.exit_code == 1 and "holds no checkpoint" in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before

    def half_written(path, *args, **kwargs):
        Path(path).mkdir(parents=True)
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(trainer_mod, "write_bundle", half_written)
    with pytest.raises(OSError, match="No space"):
        export(run, data_dir, out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    r = CliRunner().invoke(main, ["train", "export", "--run", str(run), "--data", str(data_dir), "--out", str(out),
                                  "--model-version", "2.0.0"])
    assert r.exit_code == 0, r.output
    assert open_bundle(out).metadata["model_version"] == "2.0.0" and (out / "NOTES.md").read_text() == "kept"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty-run", "release"]


def test_an_export_killed_outright_leaves_nothing_the_next_one_keeps(full_run, data_dir: Path, tmp_path: Path):
    """An export killed outright (SIGKILL, the OOM killer) leaves its half-written bundle beside OUT
    (`.release.new-PID`) or, between swap_in's renames, the old bundle moved aside (`.release.old-PID`) and OUT
    missing: hidden full-size folders that stayed for ever. The next export puts the old bundle back where OUT is
    missing and removes the rest, but not a folder of a process that still runs (another export)."""
    run, _ = full_run
    out = tmp_path / "release"
    export(run, data_dir, out, model_version="1.0.0")
    gone = subprocess.Popen(["true"])
    gone.wait()
    old, new = tmp_path / f".release.old-{gone.pid}", tmp_path / f".release.new-{gone.pid}"
    os.rename(out, old)
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"half")
    busy = tmp_path / f".release.new-{os.getppid()}"
    busy.mkdir()
    logs: list[str] = []
    trainer_mod.clear_leftovers(out, logs.append)
    assert open_bundle(out).metadata["model_version"] == "1.0.0"  # put back, whole
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, "release"])
    assert any("put back" in line for line in logs) and any(new.name in line for line in logs)
    new.mkdir()
    export(run, data_dir, out, model_version="2.0.0", log=logs.append)
    assert open_bundle(out).metadata["model_version"] == "2.0.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([busy.name, "release"])


def test_snippet_headers_show_the_crate_relative_path_the_corpus_recorded(data_dir: Path, tmp_path: Path):
    """Training's snippet headers show each file's crate_path from the corpus (the path the language server sends,
    relative to the crate's Cargo.toml folder), not one guessed from the corpus path's layout."""
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", DEFAULT_SPECIAL)
    tc = trainer_mod.TrainConfig(model="m", micro_batch=2, grad_accum=1, fim_rate=1.0, seed=3)
    labelled = crate_labelled(data_dir, tmp_path / "data")
    for split in ("train", "val"):
        f = labelled / "corpus" / f"{split}.jsonl"
        docs = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text("".join(json.dumps({**d, "path": f"trixie/registry/demo-1.0.0/{d['path']}",
                                         "crate_path": f"src/{d['path']}"}) + "\n" for d in docs))
    data = trainer_mod.Data(tok, labelled, 2048, tc.fim_rate, 0.0, 1.0)
    docs = [json.loads(line) for line in (labelled / "corpus" / "train.jsonl").read_text().splitlines()]
    assert data.neighbours["train"].paths == [d["crate_path"] for d in docs]
    text = tok.hf.decode(trainer_mod.step_batches(data, tc, 2048, 0)[0][0][0].tolist(), skip_special_tokens=False)
    assert "// src/crate/" in text and "// registry/" not in text and "// demo-1.0.0/" not in text


def test_a_resumed_run_logs_each_step_once(data_dir: Path, tmp_path: Path, monkeypatch):
    """A run that dies after its last checkpoint logged steps it trains again when resumed: the resume drops them
    from log.jsonl (and a line the crash cut short), so each step is logged once."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=8, ckpt_interval=3, eval_interval=100,
                              model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    steps = iter(range(100))

    class Killed(Exception):
        pass

    def die_at_step_five(run_dir, log, poll=0.5, stop=None):
        if next(steps) == 5:  # steps 1-5 logged, the checkpoint at 3
            with open(run_dir / "log.jsonl", "a") as f:
                f.write('{"step": 6, "lr"')  # a record the kill cut short
            raise Killed
        return 0.0

    monkeypatch.setattr(trainer_mod, "wait_while_paused", die_at_step_five)
    with pytest.raises(Killed):
        train(cfg, data_dir, run, log=lambda s: None)
    monkeypatch.undo()
    state = train(cfg, data_dir, run, log=lambda s: None)
    logged = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert logged == list(range(1, 9)) == [h["step"] for h in state["history"]]


def test_a_configs_init_from_is_recorded_as_written(full_run, data_dir: Path, tmp_path: Path):
    """A config's init_from (relative to its folder) starts the run from that bundle, and the run's state and the
    bundle's metadata keep it as written: no path of this machine reaches a released bundle."""
    import shutil

    run, _ = full_run
    export(run, data_dir, tmp_path / "bundles" / "start")
    shutil.copy(data_dir.parent / "model.yaml", tmp_path / "model.yaml")
    cfg = tmp_path / "init.yaml"
    cfg.write_text(train_yaml(init_from="bundles/start"))
    logs: list[str] = []
    state = train(cfg, data_dir, tmp_path / "run", max_steps=1, log=logs.append)
    assert any(f"new run from the weights of {tmp_path / 'bundles' / 'start'}" in m for m in logs)
    assert state["train_config"]["init_from"] == "bundles/start"
    meta = export(tmp_path / "run", data_dir, tmp_path / "out").metadata
    assert meta["train_config"]["init_from"] == "bundles/start"
    assert str(tmp_path) not in (tmp_path / "out" / "metadata.json").read_text()


# -- long runs that must never be lost: signals, kills, full disks, wrong folders ----------------------------------


def cli_train(cfg: Path, data_dir: Path, run: Path, **popen) -> subprocess.Popen:
    """`m31r train model` in a process of its own, Ctrl-C left to its default (a shell's background job ignores it)."""
    popen = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True,
             "preexec_fn": lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen}
    return subprocess.Popen([sys.executable, "-m", "m31r.cli", "train", "model", str(cfg), "--data", str(data_dir),
                             "--run", str(run)], **popen)


def wait_for(check, timeout: float = 60.0) -> None:
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, "timed out"
        time.sleep(0.005)


def logged_steps(run: Path) -> int:
    return len((run / "log.jsonl").read_text().splitlines()) if (run / "log.jsonl").exists() else 0


def messages(stderr: str) -> list[str]:
    """stderr's lines without the progress bar's."""
    return [line for line in stderr.replace("\r", "\n").splitlines() if line.strip() and not line.startswith("train:")]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_a_checkpoint_and_the_same_command_resumes_it(full_run, data_dir: Path, tmp_path: Path,
                                                                     sig: signal.Signals):
    """Ctrl-C or SIGTERM mid-run (no checkpoint due for 1000 steps): the step in progress finishes, a checkpoint is
    saved, one line says so, and the exit status is a signal's. The same command resumes from it, and the run ends
    bit-exact with an uninterrupted one. Before, Ctrl-C said "Aborted!" and SIGTERM killed the run on the spot: every
    step since the last checkpoint was lost."""
    full_dir, full_state = full_run
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(ckpt_interval=1000, model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    proc = cli_train(cfg, data_dir, run)
    wait_for(lambda: logged_steps(run) >= 3)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, err
    step = torch.load(run / "ckpt.pt", weights_only=False)["state"]["step"]
    assert 3 <= step < STEPS and "Traceback" not in err
    assert messages(err)[-1] == (f"stopped by {sig.name} at step {step}: {run / 'ckpt.pt'} is saved, and the same "
                                 "command resumes the run from it")
    proc = cli_train(cfg, data_dir, run)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and f"resumed {run / 'ckpt.pt'} at step {step}" in err
    assert out == f"trained to step {STEPS} ({full_state['tokens']:,} tokens) in {run}\n"
    a = torch.load(full_dir / "ckpt.pt", weights_only=False)
    b = torch.load(run / "ckpt.pt", weights_only=False)
    assert [h["train_next"] for h in b["state"]["history"]] == [h["train_next"] for h in full_state["history"]]
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == list(
        range(1, STEPS + 1))


def test_ctrl_c_with_row_building_workers_saves_and_exits(data_dir: Path, tmp_path: Path):
    """Ctrl-C in a terminal reaches its whole process group, the forked row builders too: one it ended never
    answered, and the trainer waited for its rows forever instead of saving a checkpoint and exiting."""
    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=100_000, data_workers=2, eval_interval=100_000,
                              model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    proc = cli_train(cfg, data_dir, run, start_new_session=True)
    try:
        wait_for(lambda: logged_steps(run) >= 3)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and messages(err)[-1].startswith("stopped by SIGINT at step "), err
    assert torch.load(run / "ckpt.pt", weights_only=False)["state"]["step"] >= 3


POOL_ROUNDS = """
import multiprocessing, os, signal, time
from m31r.train.trainer import TrainerPool

def square(x):
    return x * x

def meet(x):  # three tasks that wait for each other: three workers past their setup (a SIGTERM before it ends one)
    started.wait(timeout=30)
    return x

for _ in range(40):
    started = multiprocessing.get_context("fork").Barrier(3)
    pool = TrainerPool(3)
    assert pool.map(square, range(14)) == [x * x for x in range(14)]
    assert pool.map(meet, range(3), chunksize=1) == [0, 1, 2]
    workers = multiprocessing.active_children()
    assert len(workers) == 3
    for w in workers:  # as `timeout` or systemd would, to the whole group
        os.kill(w.pid, signal.SIGTERM)
    time.sleep(0.02)
    assert all(w.is_alive() for w in workers) and pool.map(square, [7]) == [49]
    pool.terminate()
    assert not multiprocessing.active_children()
print("ended")
"""


def test_trainer_pool_workers_outlive_a_group_sigterm_and_end_when_terminated():
    """The forked workers ignore a SIGTERM sent to the group (the trainer saves a checkpoint first, then ends them).
    Pool.terminate, and the process's exit, end workers with SIGTERM and wait: they waited forever about once in
    ten rounds (a CI run hung in the token-stream test until its 90 minutes ran out). Workers are now killed."""
    proc = subprocess.Popen([sys.executable, "-c", POOL_ROUNDS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # a hung round: its workers too, not only the script
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0 and out == "ended\n", err


def test_a_second_process_on_a_run_is_refused_and_sigterm_ends_a_pause(data_dir: Path, tmp_path: Path):
    """Two trainers on one run folder would write the same ckpt.tmp, and one could rename the other's half-written
    file over the checkpoint: the second is refused, naming the first's pid. SIGTERM stops a paused run too."""
    from m31r.train.trainer import PAUSE_FILE

    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=6, model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    train(cfg, data_dir, run, max_steps=2, log=lambda s: None)
    (run / PAUSE_FILE).touch()
    first = cli_train(cfg, data_dir, run, stderr=subprocess.STDOUT)
    try:
        lines: list[str] = []
        wait_for(lambda: lines.append(first.stdout.readline()) or "paused: " in lines[-1] or not lines[-1])
        assert "paused: " in lines[-1], lines
        second = subprocess.run([sys.executable, "-m", "m31r.cli", "train", "model", str(cfg), "--data",
                                 str(data_dir), "--run", str(run)], capture_output=True, text=True, timeout=60)
        assert second.returncode == 1 and second.stderr == (
            f"error: {run} is being trained by another process (pid {first.pid}): let it finish, or stop it first "
            f"(Ctrl-C, or kill -TERM {first.pid}: it saves a checkpoint and exits)\n")
        first.send_signal(signal.SIGTERM)
        out, _ = first.communicate(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 143 and messages(out)[-1].startswith("stopped by SIGTERM at step 2: "), out
    (run / PAUSE_FILE).unlink()
    assert train(cfg, data_dir, run, log=lambda s: None)["step"] == 6


def test_a_full_disk_at_checkpoint_time_keeps_the_last_checkpoint(data_dir: Path, tmp_path: Path):
    """A checkpoint that cannot be written (here a file size limit, EFBIG, as a full disk gives ENOSPC) stops the
    run with one line naming the file, the reason and the checkpoint kept, and leaves no partial file taking the
    space. Before: torch's "unexpected pos" RuntimeError as a traceback, and ckpt.tmp left behind."""
    import resource

    cfg = tmp_path / "t.yaml"
    cfg.write_text(train_yaml(max_steps=6, ckpt_interval=1, model=str(data_dir.parent / "model.yaml")))
    run = tmp_path / "run"
    train(cfg, data_dir, run, max_steps=3, log=lambda s: None)
    limit = (run / "ckpt.pt").stat().st_size  # the next checkpoint, one more step of history, is larger

    def small_files() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = cli_train(cfg, data_dir, run, preexec_fn=small_files)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert messages(err)[-1] == (
        f"error: cannot write {run / 'ckpt.tmp'} (File too large): training stopped at step 4; {run / 'ckpt.pt'} of "
        f"step 3 is kept. Free some space (or make {run} writable) and run the same command again to resume")
    assert torch.load(run / "ckpt.pt", weights_only=False)["state"]["step"] == 3 and not (run / "ckpt.tmp").exists()
    assert train(cfg, data_dir, run, log=lambda s: None)["step"] == 6


def test_a_checkpoint_cut_short_is_named_with_what_to_do(full_run, data_dir: Path, tmp_path: Path):
    """A checkpoint cut short (a copy or a transfer) or empty: resume, export and shards say which file and what to
    do, in one line. Before: torch's "failed finding central directory" traceback, or only "Aborted!" (an EOFError)."""
    from m31r.cli import main

    run = tmp_path / "run"
    run.mkdir()
    whole = (full_run[0] / "ckpt.pt").read_bytes()
    for cut in (whole[: len(whole) // 2], b""):
        (run / "ckpt.pt").write_bytes(cut)
        for args in (["model", str(data_dir.parent / "train.yaml"), "--data", str(data_dir), "--run", str(run)],
                     ["export", "--run", str(run), "--data", str(data_dir), "--out", str(tmp_path / "out")],
                     ["shards", "--run", str(run), "--out", str(tmp_path / "shards")]):
            r = CliRunner().invoke(main, ["train", *args])
            assert r.exit_code == 1 and r.stderr.count("\n") == 1, (args, r.output)
            assert r.stderr.startswith(f"error: {run / 'ckpt.pt'} cannot be read as a checkpoint (")
            assert r.stderr.endswith("put back a copy of it, or move it away to start the run again\n")
        assert (run / "ckpt.pt").read_bytes() == cut and not (tmp_path / "out").exists()


def test_a_run_resumed_with_another_model_config_is_refused(full_run, data_dir: Path, tmp_path: Path):
    """Another shape failed in torch with a list of mismatched tensors; another config of the same shapes (a longer
    context) trained on silently while the run's state, and so its bundle, kept the first config."""
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(full_run[0] / "ckpt.pt", run / "ckpt.pt")
    before = (run / "ckpt.pt").read_bytes()
    for change, said in (("d_model: 64", "d_model 64 -> 32"), ("max_context: 128", "max_context 128 -> 256")):
        other = change.replace("64", "32").replace("128", "256")
        (tmp_path / "model.yaml").write_text(MODEL_YAML.replace(change, other))
        cfg = tmp_path / "t.yaml"
        cfg.write_text(train_yaml(max_steps=STEPS + 2))
        with pytest.raises(ValueError, match=f"another model than {cfg}'s \\({said}\\)"):
            train(cfg, data_dir, run, log=lambda s: None)
        assert (run / "ckpt.pt").read_bytes() == before


def test_export_refuses_a_folder_that_is_not_a_bundle(full_run, data_dir: Path, tmp_path: Path):
    """`--out` given the data or run folder by mistake: the bundle's files were mixed into it (its tokenizer.json
    replaced); only a new folder or a bundle (to replace whole) is taken."""
    out = tmp_path / "data"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a bundle"):
        export(full_run[0], data_dir, out, log=lambda s: None)
    assert [p.name for p in out.iterdir()] == ["notes.txt"]


def test_sigterm_during_export_leaves_no_half_written_folder(full_run, data_dir: Path, tmp_path: Path):
    """SIGTERM (a `timeout`, a service manager) while `train export` wrote its new bundle ended the process on the
    spot and left the hidden `.OUT.new-PID` folder behind, for good. Now the clean-up runs: one line, exit 143, OUT as
    it was. The signal is sent the moment that folder appears, while the bundle is being written."""
    import signal
    import time

    run, _ = full_run
    out = tmp_path / "bundle"
    proc = subprocess.Popen([sys.executable, "-m", "m31r.cli", "train", "export", "--run", str(run), "--data",
                             str(data_dir), "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    new = tmp_path / f".bundle.new-{proc.pid}"
    deadline = time.monotonic() + 60
    while not new.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.0005)
    assert new.exists(), "the export finished (or failed) before its folder could be seen"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err, err
    assert not new.exists() and not out.exists()

"""The evaluation harness that decides releases (benchmarks/eval_fim.py, eval_exec.py): the same tasks for any model
on the same data, bits per byte counted on the text's own bytes, and each compiled program run apart from the others
and from the evaluator."""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

import pytest
from benchmark_util import REPO, RUSTC, load, needs_rustc


def rust_file(i: int) -> str:
    return "".join(f"fn f{i}_{k}(x: u32) -> u32 {{\n    let value_{k} = x * {k} + {i};\n    value_{k} + 1\n}}\n\n"
                   for k in range(6))


def test_two_models_of_different_tokenizers_draw_the_same_tasks(tiny_config, tiny_bundle, tmp_path: Path,
                                                                 monkeypatch):
    """A candidate with another tokenizer than the released model's is compared on the same tasks: make_tasks sizes
    the middles by the data's tokenizer, not the model's (by the model's, the byte-level tiny model kept only targets
    of a few characters, the BPE model longer ones, and compare_evals.py refused to pair the two)."""
    import msgspec
    import torch
    from tokenizers import Tokenizer as HFTokenizer

    from m31r.bundle import init_bundle

    eval_fim = load(monkeypatch, "eval_fim")
    data = tmp_path / "data"
    (data / "corpus").mkdir(parents=True)
    docs = [{"path": f"c{i}/src/lib.rs", "text": rust_file(i), "crate": f"c{i}"} for i in range(4)]
    (data / "corpus" / "val.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    shutil.copy(REPO / "release" / "tokenizer.json", data / "tokenizer.json")
    bpe = HFTokenizer.from_file(str(REPO / "release" / "tokenizer.json"))
    config = msgspec.structs.replace(tiny_config, vocab_size=bpe.get_vocab_size(with_added_tokens=True))
    bpe_bundle = init_bundle(config, tmp_path / "bpe", seed=0, tokenizer=bpe, dtype=torch.float32)
    opts = ["--data", str(data), "--n-single", "10", "--n-multi", "2", "--single-tokens", "6", "--multi-tokens", "32",
            "--ppl-windows", "1", "--ppl-context", "16", "--threads", "1"]
    drawn = {}
    for name, bundle in (("bytes", tiny_bundle.path), ("bpe", bpe_bundle.path)):
        out = tmp_path / f"{name}.json"
        assert eval_fim.main(["--bundle", str(bundle), *opts, "--out", str(out)]) == 0
        drawn[name] = [(t["kind"], t["path"], t["line"], t["target"]) for t in json.loads(out.read_text())["tasks"]]
    assert len(drawn["bytes"]) == 12 and drawn["bytes"] == drawn["bpe"]
    # The models' own tokenizers would have drawn different tasks: the test tells the two ways apart.
    from m31r.engine import Engine

    texts = eval_fim.val_texts(data)
    ident = [[(t.kind, t.path, t.line, t.target) for t in eval_fim.make_tasks(texts, 10, 2, 0, tok, 6, 32)]
             for tok in (Engine(tiny_bundle.path, dtype="float32").tokenizer,
                         Engine(bpe_bundle.path, dtype="float32").tokenizer)]
    assert ident[0] != ident[1] and ident[1] == drawn["bpe"]


def test_bits_per_byte_counts_a_character_cut_by_a_window_edge_once(tiny_engine, monkeypatch):
    """Windows of the token stream start and end inside two-byte characters (the tiny tokenizer spells `é` as two
    byte tokens): each window's 10 predicted tokens are 10 bytes of text. Decoded, the stray halves at both edges read
    as U+FFFD, 3 bytes each: 14 bytes a window, and bits per byte too low."""
    eval_fim = load(monkeypatch, "eval_fim")
    tok = tiny_engine.tokenizer
    assert len(tok.encode("é")) == 2
    ppl = eval_fim.perplexity(tiny_engine, ["é" * 300], 4, 10)
    assert (ppl["windows"], ppl["tokens"]) == (4, 40)
    assert ppl["bits_per_byte"] == pytest.approx(ppl["loss"] * 40 / math.log(2) / 40, rel=1e-3)
    assert ppl["bytes"] == 40


def run_program(monkeypatch, tmp_path: Path, name: str, body: str) -> tuple[bool, bool, str]:
    eval_exec = load(monkeypatch, "eval_exec")
    work = tmp_path / name
    work.mkdir()
    source = f"#[cfg(test)]\nmod tests {{\n    #[test]\n    fn {name}() {{\n{body}\n    }}\n}}\n"
    return eval_exec.run_program(source, work, RUSTC, timeout=30.0)


@needs_rustc
def test_a_program_does_not_see_the_files_another_wrote(tmp_path: Path, monkeypatch):
    """Each program runs in its own empty folder: a completion that writes a file leaves it neither in the
    evaluator's folder nor where the next program (in the evaluation, one running beside it) reads it. Run in the
    evaluator's folder, the second program found the first one's file and failed."""
    evaluator = tmp_path / "evaluator"
    evaluator.mkdir()
    monkeypatch.chdir(evaluator)
    assert run_program(monkeypatch, tmp_path, "writes", '        std::fs::write("answer.txt", "42").unwrap();') == (
        True, True, "")
    assert run_program(monkeypatch, tmp_path, "reads", '        assert!(std::fs::read("answer.txt").is_err());') == (
        True, True, "")
    assert list(evaluator.iterdir()) == []


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie waiting for its reaper does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


@needs_rustc
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_child_a_program_leaves_behind_is_ended_with_it(tmp_path: Path, monkeypatch):
    """A test that starts a process and returns passes, and the process ends with the program: left running, it held
    the output pipe open, so the passing program was reported "tests still running" after the timeout and the
    process outlived the evaluation."""
    pid_file = tmp_path / "child.pid"
    body = (f'        std::process::Command::new("sh").args(["-c", "echo $$ > {pid_file}.tmp && mv {pid_file}.tmp '
            f'{pid_file} && exec sleep 600"]).spawn().unwrap();\n'
            f'        while !std::path::Path::new("{pid_file}").exists() {{ '
            f"std::thread::sleep(std::time::Duration::from_millis(10)); }}")
    result = run_program(monkeypatch, tmp_path, "leaves_a_child", body)
    pid = int(pid_file.read_text())
    try:
        for _ in range(500):  # SIGKILL is sent; the process goes as soon as the kernel gets to it
            if not alive(pid):
                break
            time.sleep(0.02)
        assert not alive(pid)
        assert result == (True, True, "")
    finally:
        if alive(pid):
            os.kill(pid, 9)

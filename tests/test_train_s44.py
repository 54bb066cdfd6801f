"""The forty-fourth session's audit of training, before a GPU lease: FIM samples hold only what serving lets the model
write (token healing's masks included), a gradient that is not finite never reaches the weights or a checkpoint, and
an export of weights that are not finite leaves the bundle it would replace as it was."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_training import data_dir, full_run, train_yaml  # noqa: F401 (fixtures)

from m31r.bundle import load_weights, open_bundle
from m31r.config import load_config
from m31r.engine import heal_step
from m31r.fim import FimBudget, build_fim_prompt
from m31r.model import Transformer
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer
from m31r.train.samples import FIM, IGNORE, NEXT, choose_middle, fim_sample
from m31r.train.trainer import (
    SKIP_LIMIT,
    TrainConfig,
    TrainingDiverged,
    accumulate_step,
    export,
    load_checkpoint,
    make_optimizer,
    optimizer_step,
    read_jsonl,
    train,
    write_checkpoint,
)


def served_tokens_allowed(tok: Tokenizer, heal: str, middle: list[int]) -> bool:
    """Whether the engine's healing masks (Engine.generate: Tokenizer.heal_ids, heal_step) let a model write these
    tokens after the prompt."""
    owed, after_space = heal.encode(), False
    for t in middle:
        if t == tok.eos_id:
            return not owed
        if (owed or after_space) and t not in tok.heal_ids(owed):
            return False
        after_space = False
        if owed:
            owed, after_space = heal_step(owed, tok.token_bytes[t] or b"")
    return True


def test_fim_samples_are_the_served_prompt_and_a_middle_the_engine_lets_the_model_write(data_dir: Path):  # noqa: F811
    """A sample is build_fim_prompt's ids for its prefix and suffix, then the healed text and the middle, then
    <|endoftext|>; the control tokens are not learned, the middle's first token is. A middle that began inside a run of
    spaces (the cursor at a random character of an indentation) went on with more of them, which the engine's healing
    masks forbid: 35 of 3000 samples of this corpus taught a first token serving never lets the model write."""
    tok = Tokenizer.from_file(data_dir / "tokenizer.json", DEFAULT_SPECIAL)
    texts = [t for t in read_jsonl(data_dir / "corpus" / "train.jsonl") if t]
    budget = FimBudget.for_context(512)
    refused, healed = [], 0
    for seed in range(1500):
        text = texts[seed % len(texts)]
        a, b = choose_middle(text, random.Random(seed), 0.3)
        s = fim_sample(tok, text, random.Random(seed), budget, 0.3)
        p = build_fim_prompt(tok, text[:a], text[b:], budget)
        middle = tok.encode(p.heal + text[a:b])
        want = p.ids + (middle + [tok.eos_id] if len(middle) < budget.reserve else middle[: budget.reserve])
        assert s.ids == want, seed
        n = len(p.ids)
        assert [s.cats[0], s.cats[p.suffix_tokens + 1], s.cats[n - p.line_tokens - 1]] == [IGNORE] * 3
        assert set(s.cats[:n - p.line_tokens]) <= {NEXT, IGNORE} and set(s.cats[n - p.line_tokens:]) == {FIM}
        healed += bool(p.heal)
        if not served_tokens_allowed(tok, p.heal, s.ids[n:]):
            refused.append((seed, p.heal, text[a:b][:20]))
    assert healed > 100  # cursors inside a line: token healing is exercised
    assert not refused, refused[:5]


def test_a_gradient_that_is_not_finite_is_not_applied(data_dir: Path):  # noqa: F811
    """One NaN in a step's gradient made every weight NaN through AdamW (clip_grad_norm_ scales by a NaN norm)."""
    mc = load_config(data_dir.parent / "model.yaml")
    torch.manual_seed(0)
    model = Transformer(mc)
    opt = make_optimizer(model, TrainConfig(model="m"), fused=False)
    rows = torch.randint(0, mc.vocab_size, (2, 33))
    accumulate_step(model, [(rows, torch.zeros_like(rows))], TrainConfig(model="m"), None)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.norm.weight.grad[0] = float("nan")
    assert not torch.isfinite(torch.tensor(optimizer_step(model, opt, 1.0)))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert not opt.state and all(p.grad is None for p in model.parameters())  # nothing moved, nothing left over
    accumulate_step(model, [(rows, torch.zeros_like(rows))], TrainConfig(model="m"), None)
    assert optimizer_step(model, opt, 1.0) > 0 and not torch.equal(model.norm.weight, before["norm.weight"])


def test_a_diverging_run_stops_and_keeps_finite_weights(data_dir: Path, tmp_path: Path):  # noqa: F811
    """A learning rate far too high: the first step's weights overflow the next forward pass. The run went on to its
    last step with NaN weights, saving them over every checkpoint (a lease's run lost whole); now those steps are
    skipped, and after SKIP_LIMIT in a row it stops, its checkpoint finite."""
    cfg = tmp_path / "diverge.yaml"
    cfg.write_text(train_yaml(model=str(data_dir.parent / "model.yaml"), max_steps=SKIP_LIMIT + 6, lr=1e30,
                              min_lr=1e29, warmup_steps=1, ckpt_interval=4, eval_interval=1000, dtype="float32"))
    run = tmp_path / "run"
    with pytest.raises(TrainingDiverged, match=f"steps 2 to {SKIP_LIMIT + 1} all had a gradient that is not finite"):
        train(cfg, data_dir, run, log=lambda s: None)
    saved = load_checkpoint(run / "ckpt.pt")
    assert saved["state"]["step"] == SKIP_LIMIT
    assert all(bool(torch.isfinite(v).all()) for v in saved["model"].values())


def test_export_refuses_weights_that_are_not_finite(full_run, data_dir: Path, tmp_path: Path):  # noqa: F811
    """Shards of a run that diverged (or a checkpoint of one): export replaced the bundle with one whose weights the
    daemon refuses to load (open_bundle reads no weights, so export's own check passed)."""
    run, _ = full_run
    out = tmp_path / "release"
    good = export(run, data_dir, out, log=lambda s: None)
    saved = load_checkpoint(run / "ckpt.pt")
    saved["model"]["norm.weight"][3] = float("nan")
    bad = tmp_path / "diverged"
    bad.mkdir()
    write_checkpoint(bad / "ckpt.pt", saved)
    with pytest.raises(ValueError, match="not finite .*norm.weight"):
        export(bad, data_dir, out, log=lambda s: None)
    kept = open_bundle(out)
    assert kept.metadata == good.metadata
    load_weights(kept)  # the daemon can still load it

"""Session 46's audit of the decoding core: a control token the model writes ends the completion, whichever it is.

An imported tokenizer has control tokens beyond the five the config names (Qwen2.5-Coder's `<|file_sep|>`,
`<|im_end|>`, `<|repo_name|>`). They decode to no text, so a model that wrote one went on past it, unseen, to
max_tokens: into the next file of a repository-level prompt, or the next chat turn. On the tiny model with a tokenizer
that has such a token and weights that make greedy decoding write it first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken

from m31r.beams import beam_generate
from m31r.bundle import load_weights, write_bundle
from m31r.engine import Engine, Outcome
from m31r.sampling import SamplingParams
from m31r.tokenizer import build_byte_tokenizer

PROMPT = "fn main() {\n    let x = "
MARKER = "<|file_sep|>"  # unmarked in tokenizer.json, as Qwen2.5-Coder ships it: guard_user_text makes it control-only
TEXT_TOKEN = "<tool_call>"  # an added token that is text (not marker-shaped): it never ends a completion


@pytest.fixture(scope="module")
def marker_engine(tiny_bundle, tiny_engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """The tiny bundle's weights and byte tokenizer, with the last two ids the added tokens above. The marker's
    embedding row (the tied head's) is twice that of the token greedy decoding writes first, so greedy writes the
    marker instead: the tiny random model's logits are mostly the last token's row against each row."""
    config = tiny_bundle.config
    hf = build_byte_tokenizer(config.vocab_size - 2)
    hf.add_tokens([AddedToken(MARKER, special=False, normalized=False),
                   AddedToken(TEXT_TOKEN, special=False, normalized=False)])
    first = next(p.id for p in tiny_engine.generate(PROMPT, max_tokens=1))
    weights = {k: v.float() for k, v in load_weights(tiny_bundle).items()}
    weights["tok_embeddings.weight"][config.vocab_size - 2] = 2 * weights["tok_embeddings.weight"][first]
    out = tmp_path_factory.mktemp("marker") / "bundle"
    write_bundle(out, config, weights, hf, dtype=torch.float32, seed=0, dataset_version="none (test)")
    return Engine(Path(out), dtype="float32")


def test_every_control_token_ends_a_completion_and_text_tokens_do_not(marker_engine: Engine) -> None:
    tok = marker_engine.tokenizer
    marker, text = tok.hf.token_to_id(MARKER), tok.hf.token_to_id(TEXT_TOKEN)
    assert tok.decode([marker]) == "" and tok.decode([text]) == TEXT_TOKEN
    assert marker in tok.end_ids and text not in tok.end_ids and tok.special_ids <= tok.end_ids
    assert not set(tok.unused_ids) & tok.end_ids  # reserved padding is masked out, never an end


@pytest.mark.parametrize("lookahead", [0, 3])
def test_a_completion_ends_at_a_control_token_the_model_writes(marker_engine: Engine, lookahead: int) -> None:
    """Greedy decoding writes the marker first: the completion ends there, empty, as at the end token. It went on to
    max_tokens, every token the marker again (text ""), and a real model's next file followed."""
    res = Outcome(prompt_tokens=0)
    pieces = list(marker_engine.generate(PROMPT, max_tokens=16, result=res, lookahead=lookahead))
    assert (res.finish_reason, res.stopped_by) == ("stop", "end"), res
    assert pieces == [] and res.tokens == [] and res.text == "" and res.decode_steps == 0
    assert len(res.logprobs) == 1  # the marker's own, as the end token's is reported


def test_sampling_and_beam_search_end_at_a_control_token_too(marker_engine: Engine) -> None:
    marker = marker_engine.tokenizer.hf.token_to_id(MARKER)
    # A tiny temperature samples the argmax: the marker.
    res = Outcome(prompt_tokens=0)
    list(marker_engine.generate(PROMPT, max_tokens=16, result=res,
                                sampling=SamplingParams(temperature=1e-6, seed=1)))
    assert (res.finish_reason, res.stopped_by, res.tokens) == ("stop", "end", [])
    ids = marker_engine.tokenizer.encode(PROMPT)
    for width in (1, 3):
        res = Outcome(prompt_tokens=0)
        list(beam_generate(marker_engine, ids, width=width, max_tokens=8, result=res))
        assert marker not in res.tokens
        if width == 1:  # greedy: the marker first, so nothing
            assert (res.finish_reason, res.stopped_by, res.text) == ("stop", "end", "")

"""Project context and the serving tokenizer: control tokens an imported tokenizer.json leaves unmarked."""

from __future__ import annotations

from tokenizers import AddedToken

from m31r.context import context_ids
from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer, build_byte_tokenizer
from m31r_protocol.messages import Snippet


def test_unmarked_control_tokens_of_a_tokenizer_json_stay_text() -> None:
    """Qwen2.5-Coder ships `<|file_sep|>` and `<|repo_name|>` as added tokens not marked special: a file (or a
    project-context snippet) naming one gave the model the control token, a new file starting mid-prompt. An added
    token that is text keeps encoding to itself."""
    hf = build_byte_tokenizer(300)
    hf.add_tokens([AddedToken("<|file_sep|>", special=False, normalized=True),
                   AddedToken("<｜fim▁hole｜>", special=False, normalized=False),
                   AddedToken("fn main", special=False, normalized=False)])
    tok = Tokenizer(hf, DEFAULT_SPECIAL)
    control = {tok.hf.token_to_id("<|file_sep|>"), tok.hf.token_to_id("<｜fim▁hole｜>")}
    text = "let s = \"<|file_sep|>src/x.rs\\n<｜fim▁hole｜>\";\nfn main() {}\n"
    head = context_ids(tok, [Snippet(text, "src/<|file_sep|>.rs")], 999)
    for ids in (tok.encode(text), tok.encode(text * 400), head):  # over 4096 characters: encode_batch
        assert ids and not control & set(ids)
    assert tok.decode(tok.encode(text)) == text
    assert tok.hf.token_to_id("fn main") in tok.encode(text)  # a text token stays matched in text
    stream = tok.stream()
    assert "".join(stream.step(i) for i in tok.encode(text)) + stream.flush() == text

"""Tokenizer wrapper: user text never becomes control tokens, and decoding streams safely.

Special tokens are matched only when prompts are built from ids; `encode` runs with
`encode_special_tokens = True`, so source code containing `<|fim_prefix|>` stays plain text (whatever tokenizer.json
marks special: see guard_user_text).
"""

from __future__ import annotations

import bisect
import codecs
import functools
import re
from pathlib import Path

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|pad|>")
# Role → text, as a model config names them by default.
DEFAULT_SPECIAL = dict(zip(("eos_token", "fim_prefix_token", "fim_suffix_token", "fim_middle_token", "pad_token"),
                           SPECIAL_TOKENS, strict=True))


class Tokenizer:
    def __init__(self, hf: HFTokenizer, special: dict[str, str], model_vocab: int | None = None):
        """`model_vocab`: the rows of the model's embedding, when it has more than the tokenizer has entries (an
        imported checkpoint padded to a round size)."""
        self.hf = hf
        self.hf.encode_special_tokens = True
        self.vocab_size = hf.get_vocab_size(with_added_tokens=True)
        ids = {}
        for role, text in special.items():
            tid = hf.token_to_id(text)
            if tid is None:
                raise KeyError(f"special token {text!r} ({role}) is not in the tokenizer")
            ids[role] = tid
        guard_user_text(hf, special)
        self.eos_id = ids["eos_token"]
        self.fim_prefix_id = ids["fim_prefix_token"]
        self.fim_suffix_id = ids["fim_suffix_token"]
        self.fim_middle_id = ids["fim_middle_token"]
        self.pad_id = ids["pad_token"]
        self.special_ids = frozenset(ids.values())
        # Ids a model must never emit: padding entries (`<|reserved_N|>`) that no text encodes to, and the model's
        # rows that are no token at all (ids past the tokenizer, or gaps in its id range).
        vocab = hf.get_vocab(with_added_tokens=True)
        reserved = {i for t, i in vocab.items() if t.startswith("<|reserved_") and t.endswith("|>")}
        missing = set(range(model_vocab or 0)) - set(vocab.values())
        self.unused_ids = sorted(reserved | missing)
        # Ids that end a completion: the config's special tokens and every other control token (guard_user_text's).
        # Those decode to no text, so a model that wrote one (an imported Qwen2.5-Coder's `<|file_sep|>` or
        # `<|im_end|>`, an instruct checkpoint's `<|endoftext|>` beside its configured eos) went on unseen into the
        # next file or turn, to max_tokens, and the text after the marker reached the user's buffer.
        control = {i for i, t in hf.get_added_tokens_decoder().items() if t.special}
        self.end_ids = frozenset(self.special_ids | (control - reserved))

    @classmethod
    def from_file(cls, path: str | Path, special: dict[str, str], model_vocab: int | None = None) -> Tokenizer:
        if not Path(path).is_file():  # the tokenizers library says only "No such file or directory (os error 2)"
            raise FileNotFoundError(f"no tokenizer at {path}")
        return cls(HFTokenizer.from_file(str(path)), special, model_vocab)

    def encode(self, text: str) -> list[int]:
        if len(text) > 4096:
            # Same ids, but `encode_batch` lets go of the GIL while it works (`encode` holds it: ~1 s per MB), so a
            # long text tokenised on a worker thread does not stall the daemon's event loop and inference thread.
            return self.hf.encode_batch([text], add_special_tokens=False)[0].ids
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    @functools.cached_property
    def token_bytes(self) -> list[bytes | None]:
        """Each id's bytes (None for special and added tokens): what token healing matches against."""
        inverse = {c: b for b, c in _byte_to_unicode().items()}
        table: list[bytes | None] = [None] * self.vocab_size
        added = {t.content for t in self.hf.get_added_tokens_decoder().values()}
        for text, i in self.hf.get_vocab(with_added_tokens=True).items():
            if text not in added and all(c in inverse for c in text):
                table[i] = bytes(inverse[c] for c in text)
        return table

    def text_bytes(self, token_id: int) -> bytes:
        """The bytes a token adds to a stream's text (TextStream): its own, none for a special token (decode skips
        them), and an added token that is text (or an id that is no token) as decode gives it."""
        table = self.token_bytes
        b = table[token_id] if 0 <= token_id < len(table) else None
        if b is not None or token_id in self.special_ids:
            return b or b""
        return self.decode([token_id]).encode()

    @functools.cached_property
    def longest_token(self) -> int | None:
        """The most bytes one token spells (None where the tokens' bytes are not known): a text of n bytes is at
        least n / longest_token tokens, which tells a text too long for a budget without encoding it."""
        return max((len(b) for b in self.token_bytes if b), default=None) if self.byte_level else None

    @functools.cached_property
    def byte_level(self) -> bool:
        """Whether the text of any ids is the UTF-8 of their bytes (token_bytes): a byte-level BPE's decoder."""
        return isinstance(self.hf.decoder, decoders.ByteLevel)

    @functools.cached_property
    def _by_bytes(self) -> tuple[list[bytes], list[int], dict[bytes, list[int]]]:
        """The tokens' bytes sorted (with their ids) and by value: the tokens starting with some bytes are one run of
        the sorted list, so healing finds them by bisection instead of a pass over the vocabulary per keystroke."""
        pairs = sorted((b, i) for i, b in enumerate(self.token_bytes) if b)
        exact: dict[bytes, list[int]] = {}
        for b, i in pairs:
            exact.setdefault(b, []).append(i)
        return [b for b, _ in pairs], [i for _, i in pairs], exact

    def starts_a_token(self, head: bytes) -> bool:
        """Whether some token's bytes start with `head`: a text split there may yet be one token (healing)."""
        keys = self._by_bytes[0]
        j = bisect.bisect_left(keys, head)
        return j < len(keys) and keys[j].startswith(head)

    def heal_ids(self, rest: bytes) -> list[int]:
        """Ids a healed completion may continue with while `rest` (bytes already in the text) is still owed:
        tokens that start with all of it, or that are a prefix of it. Where it ends in a space or tab, a token
        may not go on with more of them: the cursor stands after that whitespace, and a completion that adds
        to it (a second space, deeper indentation) is the doubled space healing is there to prevent. An empty
        `rest` (the healed text just written, exactly) allows every token not opening with a space or tab."""
        if not rest:
            return [i for i, b in enumerate(self.token_bytes) if b and b[:1] not in (b" ", b"\t")]
        keys, ids, exact = self._by_bytes
        after_space = rest[-1:] in (b" ", b"\t")
        out = [i for k in range(1, len(rest)) for i in exact.get(rest[:k], ())]  # proper prefixes of it
        n = len(rest)
        j = bisect.bisect_left(keys, rest)
        while j < len(keys) and keys[j].startswith(rest):
            if not (after_space and keys[j][n : n + 1] in (b" ", b"\t")):
                out.append(ids[j])
            j += 1
        return sorted(out)

    def stream(self, context: list[int] | None = None) -> TextStream:
        return TextStream(self, context)


_CONTROL_TEXT = re.compile(r"<([|｜])\S+\1>")  # a control token's text: `<|file_sep|>`, `<｜fim▁hole｜>`
_CONTINUATION_TOKEN = re.compile(r"<0x[89AB][0-9A-F]>", re.IGNORECASE)  # a byte-fallback token inside a character


class TextStream:
    """Incremental detokenisation: partial UTF-8 characters are held back until they complete, and the context (the
    prompt's last ids) is never shown. For ids whose bytes are text, the pieces add up to the batch decode; with a
    byte-level tokenizer, bytes that can form no character are left out instead of shown as U+FFFD.

    tokenizers' DecodeStream was used before: primed with a context whose text ended in U+FFFD (a prompt ending in a
    genuine U+FFFD) it sent the whole context again with the first token, and a completion's last genuine U+FFFD
    never came out (it waited for a token that would tell it from half a character)."""

    WINDOW = 8  # ids of context a decoder gets (one that is not byte-level may decode an id by the ids before)

    def __init__(self, tokenizer: Tokenizer, context: list[int] | None = None):
        self._tok = tokenizer
        context = list(context[-self.WINDOW :]) if context else []
        if tokenizer.byte_level:
            # Byte-level BPE: every token is bytes, the text their UTF-8. The context's last bytes go in first, so
            # a character it began (a prompt cut inside one) comes out whole when the completion ends it.
            self._utf8 = codecs.getincrementaldecoder("utf-8")("ignore")
            self._utf8.decode(b"".join(self._tok.text_bytes(i) for i in context))
        else:
            self._utf8 = None
            # Started inside a character, a window's text changes as ids join it (a byte-fallback decoder decodes a
            # run of byte tokens all or nothing): it starts after any continuation bytes (`<0x80>` to `<0xBF>`).
            while context and _CONTINUATION_TOKEN.fullmatch(tokenizer.hf.id_to_token(context[0]) or ""):
                context = context[1:]
            self._ids, self._sent, self._pending = context, tokenizer.decode(context), 0

    def step(self, token_id: int) -> str:
        if self._utf8 is not None:
            return self._utf8.decode(self._tok.text_bytes(token_id))
        self._ids.append(token_id)
        self._pending += 1
        if self._tok.decode(self._ids).endswith("\ufffd"):  # perhaps half a character: wait for the next id
            return ""
        return self._take()

    def flush(self) -> str:
        """What is still held back once the ids end: for a decoder that is not byte-level, a text that ended in
        U+FFFD (genuine or not, it cannot tell); a byte-level one never holds back a whole character."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        return self._take() if self._pending else ""

    def _take(self) -> str:
        """The pending ids' text. The next window starts at their first id, where the text before was whole: a
        window slid by a fixed count could start inside a character, and its text then changes from step to step."""
        text = self._tok.decode(self._ids)
        same = len(self._sent)
        if not text.startswith(self._sent):  # the context ended inside a character these ids complete
            same = next((k for k, (a, b) in enumerate(zip(text, self._sent, strict=False)) if a != b), same)
        self._ids = self._ids[len(self._ids) - self._pending :]
        self._sent, self._pending = self._tok.decode(self._ids), 0
        return text[same:]


def guard_user_text(hf: HFTokenizer, special: dict[str, str]) -> None:
    """Make `hf` encode user text as text only, whatever tokenizer.json says.

    Its truncation or padding settings (an HF checkpoint's) would cut or pad the code around the cursor on every
    encode, silently: prompts are laid out by token budgets instead. The config's special tokens become control
    tokens only: an added token not marked special (Qwen2.5-Coder ships its FIM tokens so) or none at all is matched
    in text, so a file containing `<|fim_middle|>` would give the model the marker itself, a prompt injected by file
    content. Marked special, they are kept out of text by `encode_special_tokens`; ValueError where text still
    encodes to one (merges that build it), which no marking prevents."""
    hf.no_truncation()
    hf.no_padding()
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special.values()])
    # The model's other control tokens that tokenizer.json leaves unmarked (Qwen2.5-Coder's `<|file_sep|>`,
    # `<|repo_name|>`, `<|fim_pad|>`) were matched in text too: a file naming one told the model a new file began.
    # Only marker-shaped ones: an added token that is text (DeepSeek-Coder's `ø`) must still encode as it trained.
    hf.add_special_tokens([AddedToken(t.content, special=True, normalized=False)
                           for t in hf.get_added_tokens_decoder().values()
                           if not t.special and _CONTROL_TEXT.fullmatch(t.content)])
    flag, hf.encode_special_tokens = hf.encode_special_tokens, True
    try:
        ids = {hf.token_to_id(text) for text in special.values()}
        for role, text in special.items():
            if leaked := ids.intersection(hf.encode(text, add_special_tokens=False).ids):
                raise ValueError(f"the text of {role} {text!r} encodes to control token id {min(leaked)} (the "
                                 "vocabulary's merges build it), so a file containing it would be read as the marker")
    finally:
        hf.encode_special_tokens = flag


@functools.cache
def _byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_byte_tokenizer(vocab_size: int) -> HFTokenizer:
    """A byte-level tokenizer padded with unused reserved entries to exactly `vocab_size`.

    Used by `m31r bundle init` for random-weight bundles (tests, benchmarks): it can encode any text,
    and its size matches the config so the bundle validates like a trained one.
    """
    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    n_fixed = len(SPECIAL_TOKENS) + len(byte_chars)
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size {vocab_size} is below the {n_fixed} entries a byte tokenizer needs")
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in byte_chars:
        vocab[ch] = len(vocab)
    for i in range(vocab_size - n_fixed):
        vocab[f"<|reserved_{i}|>"] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok

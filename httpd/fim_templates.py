"""Fill-in-the-middle prompts that editor plugins lay out themselves, for the model they expect.

Plugins written for Ollama (llama-coder, Twinny, Continue without a `suffix`) often send one `prompt` with another
model family's FIM markers already in it: CodeLlama's `<PRE> … <SUF>… <MID>`, StarCoder's `<fim_prefix>…`,
DeepSeek's `<｜fim▁begin｜>…`, Qwen's and CodeGemma's `<|fim_prefix|>…`, Codestral's `[SUFFIX]…[PREFIX]…`,
GLM-4's `<|code_prefix|>…` (one of Zed's formats). To this model those markers are plain text, so a prompt that
is exactly one such layout is split back into the prefix and suffix it was built from, and served as a real
fill-in-the-middle request.
"""

from __future__ import annotations

import re

_DOTALL = re.DOTALL
# Each pattern matches a whole prompt. CodeLlama's layout puts one space after <PRE> and before <SUF> and <MID>
# (tokenizer artefacts of that family): those spaces belong to the layout, not to the code.
TEMPLATES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("codellama", re.compile(r"<PRE> ?(?P<prefix>.*?) ?<SUF>(?P<suffix>.*?) ?<MID>", _DOTALL)),
    ("starcoder", re.compile(r"<fim_prefix>(?P<prefix>.*?)<fim_suffix>(?P<suffix>.*?)<fim_middle>", _DOTALL)),
    ("qwen", re.compile(r"<\|fim_prefix\|>(?P<prefix>.*?)<\|fim_suffix\|>(?P<suffix>.*?)<\|fim_middle\|>", _DOTALL)),
    ("deepseek", re.compile(r"<｜fim▁begin｜>(?P<prefix>.*?)<｜fim▁hole｜>(?P<suffix>.*?)<｜fim▁end｜>", _DOTALL)),
    ("codestral", re.compile(r"\[SUFFIX\](?P<suffix>.*?)\[PREFIX\](?P<prefix>.*)", _DOTALL)),
    ("glm", re.compile(r"<\|code_prefix\|>(?P<prefix>.*?)<\|code_suffix\|>(?P<suffix>.*?)<\|code_middle\|>", _DOTALL)),
)


def split_fim(prompt: str) -> tuple[str, str, str] | None:
    """(template name, prefix, suffix) when `prompt` is exactly one known FIM layout, else None."""
    for name, pattern in TEMPLATES:
        if m := pattern.fullmatch(prompt):
            return name, m.group("prefix"), m.group("suffix")
    return None

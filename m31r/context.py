"""Snippets of other project files (`Fim.context`, chosen by m31r_protocol.context) as prompt tokens.

They go before the FIM prompt, each as a comment line naming its file, its text and <|endoftext|>, the way
files follow each other in training, so the model reads them as code that exists elsewhere in the crate.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from m31r.fim import FimBudget, FimPrompt
from m31r.tokenizer import Tokenizer


class Snippet(Protocol):
    """What m31r_protocol.messages.Snippet holds (the core does not import the protocol)."""

    text: str
    path: str


def context_budget(budget: FimBudget, prompt_tokens: int) -> int:
    """Tokens the snippets may take: what the FIM prompt leaves of the context, up to a quarter of it (a long
    file's own lines matter more than another file's)."""
    total = budget.suffix + budget.line + budget.above + budget.reserve + 3
    return max(0, min(total // 4, total - budget.reserve - prompt_tokens))


def context_room(budget: FimBudget, prompt: FimPrompt) -> int:
    """context_budget beside `prompt`, its cursor line (P_line) counted at its full budget, not its length: what
    serving and training give the snippets. Typing on a line grows only P_line (m31r.fim); counted as typed, each
    keystroke took a token of the room, and where the room fell below what the chosen snippets took, one was dropped,
    the head of the prompt changed and the daemon's prefix cache prefilled the whole prompt again. So the snippets
    change only where the prompt's head would anyway: Enter (P_above grows by a line) or a moved cut of S or P_above."""
    return context_budget(budget, len(prompt.ids) - prompt.line_tokens + budget.line)


def context_ids(tok: Tokenizer, snippets: Sequence[Snippet], budget: int) -> list[int]:
    """The snippets that fit `budget` tokens, taken best first and laid out best last (nearest the prompt). A snippet
    laid out already (the same path and text: Tabby's changed and recently opened files can name one twice) is not
    laid out again: it took the room of the next ones."""
    chosen: list[list[int]] = []
    used = 0
    longest = tok.longest_token
    seen: set[str] = set()
    for s in snippets:
        text = s.text if s.text.endswith("\n") else s.text + "\n"
        # The path is one comment line: a line break in it would put lines no file has before the snippet.
        text = f"// {' '.join(s.path.splitlines())}\n{text}" if s.path else text
        if text in seen:
            continue
        if longest and len(text.encode()) > (budget - used) * longest:  # more tokens than the room: skip the work
            continue
        ids = tok.encode(text) + [tok.eos_id]
        if used + len(ids) <= budget:
            chosen.append(ids)
            used += len(ids)
            seen.add(text)
    return [i for ids in reversed(chosen) for i in ids]

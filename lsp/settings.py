"""The server's settings: camelCase keys from `initializationOptions` and `workspace/didChangeConfiguration`.

Both may carry the keys directly or under an "m31r" section (`{"m31r": {...}}`); didChangeConfiguration's
`settings` usually holds the whole configuration tree, of which only "m31r" is read. A bad value is
reported and the previous value kept (Infinity and NaN too, which Python's JSON reader accepts); unknown keys are
reported and ignored, and so is an "m31r" section that is not an object. An empty or null `socket` or `bundle`
means the server's default (`m31r lsp --socket` / `--bundle`, else the built-in one), and a leading `~` in either is
the home folder.

A didChangeConfiguration section (pushed, or pulled with workspace/configuration) is the client's whole m31r
configuration, as VS Code, Neovim, Helix and Sublime send it: a key it leaves out goes back to the session's base
(the command line's settings with initializationOptions over them), not kept at the value an earlier payload set.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from m31r_protocol.limits import MAX_BEAMS
from m31r_protocol.policy import MIN_PROBABILITY, MULTILINE_MODES, Options

DEBOUNCE_MODES = ("adaptive", "fixed")


@dataclass(frozen=True)
class EditorSettings:
    enable: bool = True
    debounce_ms: int = 75
    debounce_mode: str = "adaptive"  # "adaptive": scales with recent daemon latency; "fixed": always debounce_ms
    multiline: str = "auto"  # "auto" | "always" | "never"
    deadline_ms: int = 800
    max_tokens: int = 64
    max_lines: int = 12
    socket: str | None = None  # None: the default socket ($M31R_SOCKET or the per-user runtime dir)
    bundle: str | None = None  # passed to an autostarted daemon as --bundle
    autostart: bool = True
    typed_through: bool = True  # answer at once when the user types what the shown suggestion predicted
    accept_ahead: bool = False  # after showing a suggestion, warm the daemon for its "accepted" state
    temperature: float = 0.0  # 0 = greedy (the daemon's typed-through works only then)
    seed: int | None = None
    beams: int | None = None  # a single-line suggestion's beam width; None: the daemon's --beams
    project_context: bool = False  # send snippets of the crate's other files with each request (lsp/context.py)
    # Show a suggestion only where the model gave its first line at least this probability (policy.confident), and of a
    # multi-line one the lines that together keep it (policy.confident_lines); 0 shows every suggestion whole.
    min_probability: float = MIN_PROBABILITY

    def shape(self) -> tuple:
        """The settings that decide what a completion is (all but those of when, and whether, to ask for one): a
        suggestion computed under another shape must not answer a request made under this one."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _NOT_SHAPING)

    def options(self) -> Options:
        return Options(multiline=self.multiline, max_tokens=self.max_tokens, deadline_ms=self.deadline_ms,
                       max_lines=self.max_lines)


# Fields that change when or whether a completion is asked for, not what it is (EditorSettings.shape).
_NOT_SHAPING = frozenset({"enable", "debounce_ms", "debounce_mode", "autostart", "typed_through", "accept_ahead"})


# camelCase key → (field, validator returning the value or raising ValueError)
def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    raise ValueError("expected true or false")


def _int_range(lo: int, hi: int):
    def check(v: Any) -> int:
        # (JSON as Python reads it may hold Infinity and NaN, which int() refuses with another error)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v != int(v):
            raise ValueError("expected an integer")
        if not lo <= int(v) <= hi:
            raise ValueError(f"expected {lo}..{hi}")
        return int(v)

    return check


def _choice(choices: tuple[str, ...]):
    def check(v: Any) -> str:
        if v not in choices:
            raise ValueError(f"expected one of {', '.join(choices)}")
        return v

    return check


def _opt_str(v: Any) -> str | None:
    if v is None or v == "":
        return None
    if isinstance(v, str):
        return v
    raise ValueError("expected a string")


def expand_path(v: str | None) -> str | None:
    """A socket or bundle path with a leading `~` expanded (os.path.expanduser): editors other than VS Code pass
    `~/x.sock` through as written, and taken literally it would name a folder `~` in the editor's working directory."""
    return None if v is None else os.path.expanduser(v)


def _opt_path(v: Any) -> str | None:
    return expand_path(_opt_str(v))


def _opt_int(v: Any) -> int | None:
    return None if v is None else _int_range(0, 2**63 - 1)(v)


def _opt_beams(v: Any) -> int | None:
    return None if v is None else _int_range(1, MAX_BEAMS)(v)


def _number_range(lo: float, hi: float):
    def check(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
            raise ValueError(f"expected a number in {lo:g}..{hi:g}")
        return float(v)

    return check


FIELDS: dict[str, tuple[str, Any]] = {
    "enable": ("enable", _bool),
    "debounceMs": ("debounce_ms", _int_range(0, 5000)),
    "debounceMode": ("debounce_mode", _choice(DEBOUNCE_MODES)),
    "multiline": ("multiline", _choice(MULTILINE_MODES)),
    "deadlineMs": ("deadline_ms", _int_range(1, 60000)),
    "maxTokens": ("max_tokens", _int_range(1, 4096)),
    "maxLines": ("max_lines", _int_range(1, 200)),
    "socket": ("socket", _opt_path),
    "bundle": ("bundle", _opt_path),
    "autostart": ("autostart", _bool),
    "typedThrough": ("typed_through", _bool),
    "acceptAhead": ("accept_ahead", _bool),
    "temperature": ("temperature", _number_range(0, 2)),
    "seed": ("seed", _opt_int),
    "beams": ("beams", _opt_beams),
    "projectContext": ("project_context", _bool),
    "minProbability": ("min_probability", _number_range(0, 1)),
}


def misshapen(raw: Any) -> list[str]:
    """A message for a payload whose "m31r" section is there but not an object of settings (`{"m31r": 75}`), which
    `section` passes over as it does a payload without ours; [] for any other payload."""
    inner = raw.get("m31r") if isinstance(raw, dict) else None
    if inner is None or isinstance(inner, dict):
        return []
    return [f"m31r: expected an object of settings such as {{\"debounceMs\": 75}} (got {inner!r}); "
            "keeping the current settings"]


def section(raw: Any) -> dict | None:
    """The m31r settings in an initializationOptions / didChangeConfiguration payload, or None if absent."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        # lsprotocol leaves LSPAny as plain JSON values; anything else is not ours
        return None
    inner = raw.get("m31r")
    if isinstance(inner, dict):
        return inner
    if any(k in FIELDS for k in raw):
        return raw
    return None


def apply(current: EditorSettings, raw: Any, defaults: EditorSettings | None = None,
          base: EditorSettings | None = None) -> tuple[EditorSettings, list[str]]:
    """Settings updated from `raw` (a payload as above), and one message per rejected or unknown key. `defaults` are
    the settings the server started with (its command line's `--socket`, `--bundle`): an empty or null `socket` or
    `bundle` goes back to them, not to the value a previous payload set. With `base` the payload is the client's whole
    configuration: a key it leaves out takes base's value (a key the user removed goes back to its default) where
    without it (initializationOptions) the key keeps `current`'s; a bad value keeps `current`'s either way."""
    defaults = defaults or EditorSettings()
    data = section(raw)
    if data is None:
        return current, misshapen(raw)
    start = current if base is None else base
    changes: dict[str, Any] = {}
    problems: list[str] = []
    for key, value in data.items():
        spec = FIELDS.get(key)
        if spec is None:
            problems.append(f"m31r.{key}: unknown setting, ignored")
            continue
        name, check = spec
        if key in ("socket", "bundle") and value in (None, ""):
            changes[name] = getattr(defaults, name)  # "the default": what the command line set, if anything
            continue
        try:
            changes[name] = check(value)
        except ValueError as e:
            changes[name] = getattr(current, name)
            problems.append(f"m31r.{key}: {e} (got {value!r}); keeping {getattr(current, name)!r}")
    return dataclasses.replace(start, **changes), problems

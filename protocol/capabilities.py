"""What a daemon can do, as its Welcome lists it, and what a client may therefore send it.

A daemon refuses a request field it does not know (the request Structs forbid unknown fields), and a daemon started
from an older install keeps running after an upgrade (a user service, or one autostarted days ago). So every
optional request field added after the first release is named by a capability, and a client sends it only to a
daemon that lists that name. Torch-free and msgspec-free: `m31r doctor` reads the list over a blocking socket.
"""

from __future__ import annotations

CAPABILITIES = ["generate", "fim", "cancel", "status", "shutdown", "prefix_cache", "typed_through", "deadline",
                "lookahead", "beams", "min_probability", "context", "logprobs"]

# Fields that daemons took before they were named: every daemon listing the key took the values too.
_IMPLIED = {"min_probability": ("context", "logprobs")}


def listed(capabilities: list[str]) -> set[str]:
    """What a daemon whose Welcome lists `capabilities` can do."""
    have = set(capabilities)
    for name, implied in _IMPLIED.items():
        if name in have:
            have.update(implied)
    return have


def missing(capabilities: list[str]) -> list[str]:
    """What this install can ask for that a daemon listing `capabilities` cannot do: it runs an older install."""
    have = listed(capabilities)
    return [c for c in CAPABILITIES if c not in have]


def restart_hint(missing_names: list[str]) -> str:
    """The one line that tells a user why, and how, to restart an outdated daemon."""
    return (f"the running daemon is older than this m31r (it lacks {', '.join(missing_names)}): `m31r stop` ends it, "
            "and the next request starts this install's (the systemd socket unit's service too; a launchd agent: "
            "`launchctl kickstart -k gui/$(id -u)/dev.m31r.m31rd`)")

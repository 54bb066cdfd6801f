"""The socket protocol's messages: msgspec tagged unions, one Struct per message kind.

Every frame carries exactly one message; the `type` tag picks the Struct. Requests carry a client-chosen
`id`, unique per connection, so many requests can be in flight on one connection and the events that
answer them can interleave. `schema.json` beside this file is generated from these Structs
(`python -m m31r_protocol.schema`).
"""

from __future__ import annotations

from typing import Literal

import msgspec
from msgspec import Struct

from m31r_protocol.capabilities import CAPABILITIES as CAPABILITIES  # re-exported
from m31r_protocol.limits import MAX_FRAME_BYTES as MAX_FRAME_BYTES  # re-exported
from m31r_protocol.limits import PROTOCOL_VERSION as PROTOCOL_VERSION

ErrorCode = Literal[
    "bad_request",  # the message is malformed or a field is out of range
    "forbidden",  # the connecting process belongs to another user
    "unsupported_version",  # the Hello's protocol version is not this daemon's
    "frame_too_large",  # the frame's length prefix exceeds MAX_FRAME_BYTES (the connection is closed)
    "busy",  # the request queue is full; retry later
    "context_overflow",  # prompt + max_tokens exceed the model's context and truncation was not asked for
    "cancelled",  # Cancel, client disconnect, or superseded by a newer Fim for the same document
    "shutting_down",  # the daemon is stopping and takes no new work (or its model failed to load: the message says)
    "internal",  # a bug: the daemon logs it and keeps serving
]
ERROR_CODES: tuple[str, ...] = ErrorCode.__args__  # type: ignore[attr-defined]
FinishReason = Literal["stop", "length", "deadline"]
# What a finish_reason "stop" was: the model's end of completion, a stop sequence, a line repeating the lines before
# the completion, or the Fim's confidence floor (min_probability).
StoppedBy = Literal["end", "sequence", "repeat", "unsure"]


class Sampling(Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    temperature: float = 0.0  # 0 = greedy, the default: same input, same output
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0


# -- client → daemon --------------------------------------------------------------------------------------


class Snippet(Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """Code from another file of the project, laid before a FIM prompt (m31r_protocol.context chooses it)."""

    text: str
    path: str = ""  # as the project names it (`src/de.rs`): the model sees it in a comment line


class Hello(Struct, tag="hello", forbid_unknown_fields=True):
    protocol: int
    client: str = ""


class Generate(Struct, tag="generate", forbid_unknown_fields=True, omit_defaults=True):
    id: int
    prompt: str
    max_tokens: int = 64
    sampling: Sampling = Sampling()
    stop: list[str] = []
    seed: int | None = None
    truncate: bool = False  # keep the prompt's end instead of failing with context_overflow
    deadline_ms: int | None = None  # a hard limit on queue + prefill + generation (see Fim)
    lookahead: int | None = None  # prompt-lookup drafts per decode step (see Fim)
    beams: int | None = None  # beam search width (see Fim)
    logprobs: int | None = None  # each token's log-probability, with this many alternatives (see Fim)


class Fim(Struct, tag="fim", forbid_unknown_fields=True, omit_defaults=True):
    id: int
    prefix: str
    suffix: str = ""
    document: str = ""  # a key per open document: newest request wins, and its cache slot is kept warm
    max_tokens: int = 64
    sampling: Sampling = Sampling()
    stop: list[str] = []
    seed: int | None = None
    # A hard limit on the request's time in the daemon (queued, prefilling, generating), from its arrival: once
    # spent, the answer ends within one scheduler round with what was produced so far (finish_reason "deadline"),
    # cut at a line end if the token that ended it holds one.
    deadline_ms: int | None = None
    # Prompt-lookup decoding: up to this many draft tokens, copied from the prompt, verified per decode step. Greedy
    # output is the same with any value (it changes only how fast it comes); 0 turns it off; None: the daemon's
    # --lookahead. Sampling ignores it. Values past the daemon's decode width are clamped to it.
    lookahead: int | None = None
    # Beam search of this width (1 to 8; greedy only): the likeliest completion as a whole rather than token by token,
    # streamed once the search ends. 1 is plain greedy decoding. None: the daemon's --beams for a greedy request whose
    # stop sequences include "\n" (a line completion, where it measured better), else 1.
    beams: int | None = None
    # Snippets of other files of the project, best first (m31r_protocol.context.rank): those that fit the room the
    # prompt leaves (up to a quarter of the model's context) are laid before it, the best nearest.
    context: list[Snippet] = []
    # Each Token frame carries its token's log-probability and this many (0 to 20) of the likeliest tokens at that
    # step, with theirs (a beam search's: those of its answer's steps). None: neither.
    logprobs: int | None = None
    # The editor's confidence floor (0 to 1; m31r_protocol.policy.confident and confident_lines): generation ends
    # (finish_reason "stop") at the token that takes the completion's probability so far under the floor. The line
    # it is in is then one the policy cuts, or (the first line) the whole suggestion one it hides, so the editor shows
    # what it would have shown of the whole completion, sooner. None or 0: off. A beam search (beams above 1) runs
    # to its end regardless. Only for a daemon whose Welcome lists the "min_probability" capability (one started
    # before it refuses the field); Client.fim leaves it out for others, as it changes only how soon the answer ends.
    min_probability: float | None = None


class Cancel(Struct, tag="cancel", forbid_unknown_fields=True):
    id: int


class Status(Struct, tag="status", forbid_unknown_fields=True):
    id: int


class Shutdown(Struct, tag="shutdown", forbid_unknown_fields=True):
    id: int


ClientMessage = Hello | Generate | Fim | Cancel | Status | Shutdown


# -- daemon → client --------------------------------------------------------------------------------------


class Welcome(Struct, tag="welcome"):
    protocol: int
    model: str
    fingerprint: str
    max_context: int
    capabilities: list[str]
    daemon_version: str


class TokenChoice(Struct, array_like=True):
    """A token the model could write at a step: its id, its text (a token may hold part of a character, shown as
    U+FFFD) and its natural-log probability."""

    token: int
    text: str
    logprob: float


class Token(Struct, tag="token", omit_defaults=True):
    id: int
    text: str
    token: int | None = None  # the token id; None for held-back text released at the end
    # With the request's `logprobs`: the token's natural-log probability under the model's own distribution at its
    # step (before temperature and any repetition penalty: a penalised pick may not be the likeliest listed) and the
    # likeliest tokens at its step, likeliest first.
    logprob: float | None = None
    top_logprobs: list[TokenChoice] = []


def scored_tokens(frames: list[Token]) -> list[Token]:
    """The frames of a request with `logprobs`, one a token. Text released at the end (held back while it might
    have begun a stop sequence) has no token of its own: it joins the token before it, so the tokens' texts still
    make up the answer."""
    out: list[Token] = []
    for f in frames:
        if f.logprob is None or f.token is None:
            if out:
                out[-1] = msgspec.structs.replace(out[-1], text=out[-1].text + f.text)
            continue
        out.append(f)
    return out


class Usage(Struct):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0  # what max_tokens bounds: the tokens written after the healed ones
    # The first tokens written where they only wrote the prompt's healed end again (a prompt or cursor inside a
    # word, docs/serving.md "Token healing"): they finish the prompt, and no Token frame carries them.
    healed_tokens: int = 0
    decode_steps: int = 0  # decode forward passes the request took part in
    draft_tokens: int = 0  # prompt-lookup drafts fed to them
    accepted_tokens: int = 0  # drafts greedy decoding confirmed: completion tokens without a step of their own


class Timings(Struct):
    """The daemon's timings for the request, in milliseconds."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    first_token_ms: float | None = None
    total_ms: float = 0.0


class Done(Struct, tag="done"):
    id: int
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    source: Literal["model", "typed_through"] = "model"
    # A beam search's runners-up (beams above 1): the next likeliest distinct completions, likeliest first, each as the
    # streamed text would have read. An editor offers them as further suggestions.
    alternatives: list[str] = []
    # How likely the model found what it wrote, as natural-log probabilities: the whole completion (its end token
    # included where the model ended it) and its first line (to the first token holding a line break). The first
    # line's predicts whether a suggestion is right (README "Confidence"); m31r_protocol.policy.confident gates on
    # it. A typed_through answer carries those of the completion it continues: lower bounds of the rest's. None
    # when nothing was generated.
    logprob: float | None = None
    line_logprob: float | None = None
    # Each line's of the streamed text, the first being line_logprob: the first k summed are how likely the model
    # finds the first k lines, and m31r_protocol.policy.confident_lines cuts a multi-line suggestion to the lines
    # that keep the editors' floor. A typed_through answer leaves out the lines typed. Empty when nothing was
    # generated (or from an older daemon).
    logprob_by_line: list[float] = []
    # What ended a finish_reason "stop" (None for the others), and for "sequence" the stop sequence that matched, as
    # the request gave it, or a Fim's own stop where the completion writes the code after the cursor again (the
    # suffix's next line, led by its line break unless the completion began with it). A line break there says that
    # the model ended the text's last line, which the streamed text leaves out: an editor inserting a line task's
    # answer before code keeps that code on a line of its own (m31r_protocol.policy.postprocess's ended_line).
    stopped_by: StoppedBy | None = None
    stop_sequence: str | None = None
    # Whether the prompt lost text of the request's to fit the model's context: a Fim's prefix or suffix beyond its
    # budget (lines far from the cursor, a long cursor line's start; m31r.fim), a Generate's start with `truncate`.
    # Context snippets left out for room are not counted (they are laid as room allows). False for a typed_through
    # answer (no prompt was built) and from an older daemon.
    truncated: bool = False


BusyScope = Literal[
    "connection",  # this connection's requests in flight, or waiting for the model to load (--max-per-connection)
    "daemon",  # every connection's requests in flight (--max-queue)
    "loading",  # every connection's requests waiting for the model to load (--max-queue)
]


class BusyDetail(Struct, frozen=True):
    """Which of the daemon's limits a `busy` request hit, so that a front end (the HTTP adapter) can say so in its
    own words without reading the message."""

    scope: BusyScope
    limit: int  # the limit reached: that many requests were counted against it


class OverflowDetail(Struct, frozen=True):
    """The figures of a `context_overflow`: prompt_tokens + max_tokens exceeded max_context."""

    prompt_tokens: int
    max_tokens: int
    max_context: int


class Error(Struct, tag="error", omit_defaults=True):
    id: int | None
    code: ErrorCode
    message: str  # for people: its wording may change, so a program reads `code` and the detail below
    # The detail of a `busy` and of a `context_overflow`; None for other codes and from an older daemon (a client
    # then shows `message` as it is). Error does not forbid unknown fields, so an older client ignores them; no
    # capability names them, since a client sends nothing for them and their absence tells the older daemon apart.
    busy: BusyDetail | None = None
    overflow: OverflowDetail | None = None


class StatusReply(Struct, tag="status_reply"):
    id: int
    model: str
    fingerprint: str
    bundle: str
    device: str
    dtype: str
    pid: int
    uptime_s: float
    queue: int
    active: int
    requests: int
    cache_slots: int
    cache_slots_used: int
    cache_mb: float
    cache_budget_mb: float
    cache_hit_rate: float  # share of prompt tokens served from the prefix cache
    rss_mb: float
    quant: str | None = None  # int8 | int4 weights, or None for float weights
    threads: int | None = None  # torch intra-op threads the inference thread runs with (--threads)
    # Still loading the model or warming up: requests are queued and answered once it ends. While the model loads,
    # dtype is the one asked for ("auto"), quant is None and the cache figures are 0.
    warming: bool = False


class ShutdownReply(Struct, tag="shutdown_reply"):
    id: int


ServerMessage = Welcome | Token | Done | Error | StatusReply | ShutdownReply



def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def client_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what a client sends: the daemon's side."""
    return msgspec.msgpack.Decoder(ClientMessage)


def server_decoder() -> msgspec.msgpack.Decoder:
    """Decodes what the daemon sends: a client's side."""
    return msgspec.msgpack.Decoder(ServerMessage)

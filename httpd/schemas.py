"""The HTTP API's wire format: msgspec Structs, and the OpenAPI document generated from them.

The Structs are the contract: requests are decoded (and validated) straight into them, responses are encoded
from them, and `/openapi.json` is `msgspec.json.schema_components` of them. Every request refuses unknown
fields (a typo is a 400 naming the field). The OpenAI-compatible request lists all of OpenAI's fields, and
those this server cannot honour accept only their no-op values (`n: 1`, `best_of: 1`, ...): a client
never gets an answer that quietly ignores what it asked for.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from m31r_protocol.limits import MAX_BEAMS, MAX_LOGPROBS, MAX_SNIPPETS, MAX_STOPS
from m31r_protocol.messages import Timings, Usage
from m31r_protocol.policy import MIN_PROBABILITY, MULTILINE_MODES, Options

_POLICY = Options()  # the completion policy's defaults (shared with the LSP server)

INT32 = 2**31 - 1
INT63 = 2**63 - 1
GREEDY_BELOW = 1e-3  # temperatures under this are greedy: the limit t → 0 is the argmax, and tiny t overflows
MIN_TOP_P = 1e-6  # smaller top_p is raised to this: the same single most likely token, no float32 underflow

MaxTokens = Annotated[int, Meta(ge=0, le=INT32, description=(
    "Most tokens to generate. The server refuses more than its --max-tokens-cap (this document's maximum)."))]
Temperature = Annotated[float, Meta(ge=0, le=2, description=(
    f"0 = greedy (deterministic, the default). Values below {GREEDY_BELOW} are treated as 0."))]
TopK = Annotated[int, Meta(ge=0, le=INT32, description="Keep only the k most likely tokens; 0 = off.")]
TopP = Annotated[float, Meta(gt=0, le=1, description="Nucleus sampling mass; 1 = off.")]
Seed = Annotated[int, Meta(ge=0, le=INT63, description="Makes sampling (temperature > 0) reproducible.")]
# An empty one would match before anything is written: the daemon refuses it (bad_request), the schema says so first.
StopText = Annotated[str, Meta(min_length=1, description="A stop sequence: at least one character.")]
Stop = Annotated[list[StopText], Meta(max_length=MAX_STOPS,
                                      description="Stop sequences; not included in the output.")]
Stream = Annotated[bool, Meta(description="Server-Sent Events: one `chunk` event per text chunk, then `done`.")]
DeadlineMs = Annotated[int, Meta(ge=0, le=600_000, description=(
    "A hard limit on the request's time in the daemon (queued, prefilling, generating): once spent, the answer ends "
    "with what was written so far (finish_reason `deadline`), at a line end if its last token holds one; "
    "0 = no deadline."))]
Beams = Annotated[int, Meta(ge=1, le=MAX_BEAMS, description=(
    "Beam search of this width (greedy only): the likeliest completion as a whole, streamed once the search ends; "
    "1 = greedy decoding. Absent: the daemon's --beams for a request stopped at a line end (`\\n` in `stop`), "
    "else 1."))]
Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS, description=(
    "Each token's natural-log probability, with this many of the likeliest tokens at its step: on each streamed "
    "`chunk` (one a token, then) and as `tokens` in the answer (of a beam search, its answer's steps)."))]
Document = Annotated[str, Meta(max_length=4096, description=(
    "A key for the file being edited (its path): the newest request for it cancels older ones (409) and its "
    "prefix-cache slot is kept warm."))]

FinishReason = Literal["stop", "length", "deadline"]


class ContextSnippet(Struct, forbid_unknown_fields=True, kw_only=True):
    """Code from another file of the project."""

    text: Annotated[str, Meta(description="The code.")]
    path: Annotated[str, Meta(max_length=4096, description=(
        "Its file as the project names it (`src/de.rs`); the model sees it in a comment line."))] = ""


Context = Annotated[list[ContextSnippet], Meta(max_length=MAX_SNIPPETS, description=(
    "Snippets of the project's other files, best first, as the language server chooses them (m31r_protocol.context: "
    "windows of 20 lines that share the most identifiers with the 20 whole lines above the cursor line's block of "
    "8): those that fit the room the prompt leaves, up to a quarter of the model's context, lead the prompt, the "
    "best nearest it."))]


# -- native requests ----------------------------------------------------------------------------------------


class _Sampled(Struct, forbid_unknown_fields=True, kw_only=True):
    """The generation options Generate and Fim share (one definition, one schema)."""

    max_tokens: MaxTokens = 64
    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    seed: Seed | None = None
    stop: Stop = []
    stream: Stream = False
    beams: Beams | None = None
    logprobs: Logprobs | None = None


class GenerateRequest(_Sampled, forbid_unknown_fields=True, kw_only=True):
    """Continue `prompt`."""

    prompt: Annotated[str, Meta(min_length=1, description="The text to continue.")]
    truncate: Annotated[bool, Meta(description=(
        "Keep the prompt's end when prompt + max_tokens exceed the model's context, instead of a 400."))] = False
    deadline_ms: DeadlineMs = 0


class FimRequest(_Sampled, forbid_unknown_fields=True, kw_only=True):
    """Raw fill-in-the-middle: what the model writes between `prefix` and `suffix`, no post-processing."""

    prefix: Annotated[str, Meta(description="The text before the cursor.")]
    suffix: Annotated[str, Meta(description="The text after the cursor.")] = ""
    path: Document | None = None
    deadline_ms: DeadlineMs = 0
    context: Context = []


class CompletionRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """Code completion at a cursor, with the editor policy the LSP server uses: single-line mid-line,
    multi-line at a line end, re-indentation, and no repeating of the text that follows the cursor."""

    prefix: Annotated[str, Meta(description="The document's text before the cursor.")]
    suffix: Annotated[str, Meta(description="The document's text after the cursor.")] = ""
    path: Document | None = None
    context: Context = []
    multiline: Annotated[Literal[MULTILINE_MODES], Meta(description=(  # type: ignore[valid-type]
        "`auto`: multi-line only at a line end (or before closing brackets); `always`; `never`."))] = (
        _POLICY.multiline)
    max_tokens: Annotated[int, Meta(ge=1, le=INT32, description=(
        "Most tokens to generate (at least 1); at most the server's --max-tokens-cap."))] = _POLICY.max_tokens
    max_lines: Annotated[int, Meta(ge=1, le=1000, description="A multi-line suggestion keeps at most this many "
                                                              "lines.")] = _POLICY.max_lines
    deadline_ms: DeadlineMs = _POLICY.deadline_ms or 0
    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    seed: Seed | None = None
    beams: Annotated[int, Meta(ge=1, le=MAX_BEAMS, description=(
        "Beam search of this width (greedy only). Absent: the daemon's --beams for a single-line suggestion, "
        "greedy decoding for a multi-line one."))] | None = None
    min_probability: Annotated[float, Meta(ge=0, le=1, description=(
        "Suggest nothing (`text` empty, `unsure` true) where the model gave the completion's first line less than "
        "this probability, and leave out the lines from the one at which its probability of the lines so far falls "
        "under it (`lines_cut`); 0 suggests whatever it wrote. The language server's default."))] = MIN_PROBABILITY
    stream: Annotated[bool, Meta(description=(
        "Server-Sent Events. Post-processing needs the whole completion, so the suggestion comes as one `chunk` "
        "event, then `done`."))] = False


# -- native responses ---------------------------------------------------------------------------------------


# Usage and Timings are the daemon's own (m31r_protocol.messages), passed through unchanged.


class TopToken(Struct):
    """A token the model could have written at a step."""

    token: int
    text: str
    logprob: float


class TokenLogprob(Struct):
    """A token of the answer (its streamed text: together they are the answer's text), its natural-log probability,
    and the likeliest tokens at its step."""

    text: str
    token: int
    logprob: float
    top_logprobs: list[TopToken] = []


class GenerateResponse(Struct):
    """The answer to /generate and /fim; also the data of the final `done` event of a stream. `alternatives`: a
    beam search's runners-up, likeliest first (empty unless it searched)."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    alternatives: list[str] = []
    logprob: float | None = None  # the daemon's Done.logprob: the completion's natural-log probability
    line_logprob: float | None = None  # Done.line_logprob: its first line's
    logprob_by_line: list[float] = []  # Done.logprob_by_line: each of its lines'
    tokens: list[TokenLogprob] | None = None  # with `logprobs`: each token's figures
    # Done.stopped_by and Done.stop_sequence: what a finish_reason "stop" was, and the stop sequence that matched
    stopped_by: Literal["end", "sequence", "repeat", "unsure"] | None = None
    stop_sequence: str | None = None
    truncated: bool = False  # Done.truncated: the prompt lost text to fit the context


class Alternative(Struct):
    """Another suggestion, post-processed as the first: replace [start, end) with `text`."""

    text: str
    start: int
    end: int


class CompletionResponse(Struct):
    """Replace the document's characters [start, end) (Unicode code points of prefix + suffix) with `text`.
    `text` is empty when there is nothing worth suggesting."""

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    start: int
    end: int
    multiline: bool
    alternatives: list[Alternative] = []  # a beam search's runners-up, for an editor to cycle through
    line_logprob: float | None = None  # the completion's first line's natural-log probability (Done.line_logprob)
    unsure: bool = False  # the model gave that line less than min_probability: nothing is suggested
    # lines of the completion left out because with them the model's probability of the suggestion fell under
    # min_probability (policy.confident_lines)
    lines_cut: int = 0


class StreamChunk(Struct, omit_defaults=True):
    """The data of one `chunk` event (with `logprobs`, one token's, its figures beside it)."""

    text: str
    logprob: float | None = None
    top_logprobs: list[TopToken] | None = None


class ErrorDetail(Struct):
    code: str  # bad_json, invalid, too_large, busy, unavailable, context_overflow, cancelled, timeout, ...
    message: str
    type: str  # OpenAI's error type: invalid_request_error, server_error, ...
    param: str | None = None  # the request field at fault, where one is


class ErrorResponse(Struct):
    error: ErrorDetail


class HealthResponse(Struct):
    status: Literal["ok"]
    model: str
    fingerprint: str
    max_context: int
    daemon_version: str
    device: str
    dtype: str
    queue: int
    active: int
    uptime_s: float
    warming: bool = False  # the daemon still warms up: a request sent now is answered once it ends (~1 s)


class HealthUnavailable(Struct):
    status: Literal["unavailable"]
    error: str


# -- OpenAI-compatible --------------------------------------------------------------------------------------


class StreamOptions(Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool = False
    # OpenAI pads its chunks with an `obfuscation` field (against network side channels) unless this is false; this
    # server never does: false is what it does, true is refused (app.py), never ignored.
    include_obfuscation: Annotated[bool, Meta(extra_json_schema={"enum": [False]}, description=(
        "Not supported: only false (the chunks carry no padding)."))] | None = None


# OpenAI's ranges where they are wider than the native endpoints' (its OpenAPI document's CreateCompletionRequest):
# top_p from 0 (the likeliest token alone: the sampler raises it to MIN_TOP_P), any int64 seed (the daemon takes a
# negative one as its 64 bits: -1 is the same seed as 2**64 - 1).
OpenAITopP = Annotated[float, Meta(ge=0, le=1, description="Nucleus sampling mass, 0 to 1 (0: the likeliest token "
                                                           "alone); 1 = off.")]
OpenAISeed = Annotated[int, Meta(ge=-(2**63), le=INT63, description=(
    "Makes sampling (temperature > 0) reproducible: any 64-bit signed integer, as OpenAI's."))]


class OpenAICompletionRequest(Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's legacy completions request, every field of it: honoured, or (where this server cannot honour
    it) accepted only at its no-op value. `suffix` makes it fill-in-the-middle; an empty (or null) prompt without one
    writes the start of a file. Differences from OpenAI: temperature defaults to 0 (greedy), not 1; `model` may
    be left out (there is one model)."""

    prompt: Annotated[str | Annotated[list[str], Meta(min_length=1, max_length=1)], Meta(
        description="One prompt: a string, or a list of one string (batches and token ids are not supported); null, "
                    "as OpenAI's, is the start of a new document.")] | None
    model: Annotated[str, Meta(description="The model's name or an alias (GET /v1/models lists them).")] | None = None
    suffix: Annotated[str, Meta(description="The text after the cursor: fill-in-the-middle.")] | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=INT32, description=(
        "Most tokens to generate (default 16, as OpenAI's); more than the server's --max-tokens-cap is capped to "
        "it, as llama.cpp's server caps n_predict."))] | None = None
    temperature: Temperature | None = None
    top_p: OpenAITopP | None = None
    n: Annotated[int, Meta(ge=1, le=1, description="Choices per prompt: only 1.")] | None = None
    best_of: Annotated[int, Meta(ge=1, le=1, description="Candidates to pick from: only 1.")] | None = None
    logprobs: Annotated[int, Meta(ge=0, le=5, description=(
        "Each token's log-probability, with this many (0 to 5) of the likeliest tokens at its step: the choice's "
        "`logprobs`. Not with `echo` (the prompt's tokens have none here)."))] | None = None
    echo: Annotated[bool, Meta(description="Start the completion's text with the prompt.")] | None = None
    presence_penalty: Annotated[float, Meta(ge=0, le=0, description="Not supported: only 0.")] | None = None
    frequency_penalty: Annotated[float, Meta(ge=0, le=0, description="Not supported: only 0.")] | None = None
    logit_bias: Annotated[dict[str, float], Meta(max_length=0, description="Not supported: only {}.")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: StopText | Stop | None = None
    seed: OpenAISeed | None = None
    user: Annotated[str, Meta(description="An end-user id; accepted and not used.")] | None = None


# Why a field of OpenAI's request was refused: prefixed to the validation error, which names the field.
OPENAI_REFUSALS = {
    "n": "this server returns one choice per request: n must be 1",
    "best_of": "this server returns the one completion it generates: best_of must be 1",
    "logprobs": "logprobs is how many of the likeliest tokens to list at each step, 0 to 5",
    "presence_penalty": "presence_penalty is not supported: it must be 0 or left out",
    "frequency_penalty": "frequency_penalty is not supported: it must be 0 or left out",
    "logit_bias": "logit_bias is not supported: it must be {} or left out",
    "prompt": "prompt must be one string (or a list of one string): batches and token ids are not supported",
}


OpenAIFinishReason = Literal["stop", "length"]


class OpenAILogprobs(Struct):
    """The tokens of a choice's text (the streamed pieces: together they are the text), each one's natural-log
    probability, the likeliest tokens at its step with theirs, and where each starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class OpenAIChoice(Struct):
    text: str
    index: int = 0
    finish_reason: OpenAIFinishReason | None = None
    logprobs: OpenAILogprobs | None = None


class OpenAIUsage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class OpenAICompletion(Struct):
    """A completion, or (streaming) one chunk of one: `data: {...}` lines, then `data: [DONE]`."""

    id: str
    created: int
    model: str
    choices: list[OpenAIChoice]
    usage: OpenAIUsage | None = None
    object: Literal["text_completion"] = "text_completion"


class OpenAIModel(Struct):
    id: str
    created: int
    owned_by: str = "m31r"
    object: Literal["model"] = "model"
    aliases: list[str] = []  # other names requests may use for this model (not an OpenAI field)


class OpenAIModelList(Struct):
    data: list[OpenAIModel]
    object: Literal["list"] = "list"


# -- llama.cpp's /infill (llamacpp.py) -------------------------------------------------------------------------


class InfillExtra(Struct, kw_only=True):
    """A chunk of another file, as llama.cpp's editor plugins send it (other keys, such as llama.vim's `time`, are
    ignored)."""

    text: Annotated[str, Meta(description="The code.")]
    filename: Annotated[str, Meta(max_length=4096, description="Its file; the model sees it in a comment line.")] = ""


class LlamaCppOptions(Struct, kw_only=True):
    """The options llama.cpp server's /infill and /completion share, as this server honours them."""

    n_predict: Annotated[int, Meta(ge=-(2**31), le=INT32, description=(
        "Most tokens to generate; negative (llama.cpp's -1): no limit of the request's own. Capped, as llama.cpp's "
        "server caps it, at the server's --max-tokens-cap and what the model's context holds (for a "
        "fill-in-the-middle, half of it); 0 only prefills (the plugins' requests that warm the cache)."))] | None = None
    max_tokens: Annotated[int, Meta(ge=-(2**31), le=INT32, description=(
        "`n_predict`'s other name (used when n_predict is absent)."))] | None = None
    temperature: Annotated[float, Meta(le=2, description="0 or less: greedy, the default.")] = 0.0
    top_k: Annotated[int, Meta(ge=-(2**31), le=INT32, description="0 or less: off.")] = 0
    top_p: Annotated[float, Meta(ge=0, le=1, description="1: off.")] = 1.0
    repeat_penalty: Annotated[float, Meta(gt=0, le=10, description="1: off, the default.")] = 1.0
    seed: Annotated[int, Meta(ge=-(2**63), le=INT63, description=(
        "Negative: a random seed (llama.cpp's -1)."))] | None = None
    stop: Stop = []
    stream: Annotated[bool, Meta(description=(
        "Server-Sent Events: `data: {...}` lines, one a chunk of text, the last the whole response's fields."))] = False
    n_indent: Annotated[int, Meta(ge=-(2**31), le=INT32, description=(
        "End the completion before a line (after its first) indented by fewer spaces or tabs than this, as "
        "llama.cpp does; 0 or less: off."))] = 0
    t_max_predict_ms: Annotated[int, Meta(ge=-(2**31), le=INT32, description=(
        "End the completion at the first line end written this long after its first token, as llama.cpp does; 0 "
        "or less: off."))] = 0
    response_fields: Annotated[list[str], Meta(description=(
        "Answer only these fields; `a/b` is field b of a, named `a/b` at the top level (llama.cpp's rule)."))] = []
    model: Annotated[str, Meta(description="Accepted and not used: there is one model.")] | None = None


class InfillRequest(LlamaCppOptions, kw_only=True):
    """llama.cpp server's `POST /infill`, as llama.vim and llama.vscode send it: the text before the cursor is
    `input_prefix` + `prompt` (the cursor line's text before the cursor), after it `input_suffix`. The fields listed
    are honoured; llama.cpp's other options are accepted and ignored (named in X-M31R-Ignored-Options), as llama.cpp
    ignores options it does not know. Greedy unless `temperature` is above 0 (llama.cpp samples by default)."""

    input_prefix: Annotated[str, Meta(description="The lines above the cursor line.")] = ""
    input_suffix: Annotated[str, Meta(description="The text after the cursor.")] = ""
    input_extra: Annotated[list[InfillExtra], Meta(description=(
        "Chunks of other files, oldest first (llama.cpp lays the last nearest the code): the last "
        f"{MAX_SNIPPETS} are the request's project context, the newest nearest the prompt."))] = []
    prompt: Annotated[str, Meta(description="The cursor line's text before the cursor.")] = ""


class LlamaCppCompletionRequest(LlamaCppOptions, kw_only=True):
    """llama.cpp server's own `POST /completion` (not this server's editor-policy request of that path, told apart
    by its `prompt` and no `prefix` or `suffix`), as clients written for llama.cpp send it (Continue's llama.cpp
    provider). A prompt that is exactly another model's fill-in-the-middle layout (StarCoder's `<fim_prefix>…`,
    Qwen's `<|fim_prefix|>…`, CodeLlama's `<PRE> …`, Codestral's `[SUFFIX]…`, DeepSeek's, GLM-4's) is served as the
    fill-in-the-middle it was built from; other text is continued. Unknown fields are ignored (named in
    X-M31R-Ignored-Options), as llama.cpp ignores them. Greedy unless `temperature` is above 0."""

    prompt: Annotated[str | Annotated[list[str], Meta(min_length=1, max_length=1)], Meta(description=(
        "The text: a string, or a list of one string (token ids, several prompts and multimodal objects are not "
        "supported)."))]


class InfillTimings(Struct):
    """llama.cpp's timings, in milliseconds: `prompt_*` the prefill of the tokens the prefix cache lacked (with the
    wait for the daemon, where an n_indent or t_max_predict_ms cut ended the request before the daemon reported),
    `predicted_*` the generation. A healed word's tokens count in prompt_n, as in tokens_evaluated; their time, spent
    decoding them, is in predicted_ms."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class InfillSettings(Struct):
    """The settings the completion ran with (llama.vscode shows n_ctx)."""

    n_ctx: int
    n_predict: int
    model: str
    temperature: float
    top_k: int
    top_p: float
    repeat_penalty: float
    seed: int
    stop: list[str]
    stream: bool
    n_indent: int
    t_max_predict_ms: int


class InfillResponse(Struct, kw_only=True):
    """llama.cpp's answer to /infill (and a stream's last event, `content` empty there), its fields in its order.
    `tokens_evaluated`, `tokens_cached` and the prompt's timings are 0 (and `truncated` false) where an n_indent or
    t_max_predict_ms cut ended the daemon's request before it reported them."""

    index: int = 0
    content: str
    tokens: list[int] = []
    id_slot: int = 0
    stop: bool = True
    model: str
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: InfillSettings
    has_new_line: bool
    truncated: bool = False  # the daemon's Done.truncated: the prompt lost text to fit the context
    stop_type: Literal["eos", "limit", "word"]
    stopping_word: str = ""
    tokens_cached: int
    timings: InfillTimings


class LlamaCppCompletionResponse(InfillResponse, kw_only=True):
    """llama.cpp's answer to /completion: /infill's fields, and the prompt as it was sent."""

    prompt: str


class InfillChunk(Struct, kw_only=True):
    """A stream's event: a piece of the completion."""

    index: int = 0
    content: str
    tokens: list[int]
    stop: bool = False
    id_slot: int = 0
    tokens_predicted: int


class LlamaCppErrorDetail(Struct):
    code: int  # the HTTP status
    message: str
    type: str  # invalid_request_error, authentication_error, permission_error, not_found_error, unavailable_error,
    # exceed_context_size_error, server_error


class LlamaCppError(Struct):
    """llama.cpp server's error shape (under /infill, and /completion for llama.cpp's request)."""

    error: LlamaCppErrorDetail


# -- Tabby's API (tabby.py) ------------------------------------------------------------------------------------

FilePath = Annotated[str, Meta(max_length=4096, description=(
    "Its file: relative to the workspace or repository, or a file URI; the model sees it in a comment line."))]


class TabbyDeclaration(Struct, kw_only=True):
    """A declaration of a symbol used near the cursor, as the editor's language server found it."""

    filepath: FilePath
    body: Annotated[str, Meta(description="The code.")]


class TabbySnippet(Struct, kw_only=True):
    """Code from a recently changed or opened file, best first."""

    filepath: FilePath
    body: Annotated[str, Meta(description="The code.")]
    score: Annotated[float, Meta(description="Tabby's relevance score; the list's order is what counts here.")] = 0.0


class TabbySegments(Struct, kw_only=True):
    """The text around the cursor and the editor's context (other keys, such as `edit_history`, are ignored)."""

    prefix: Annotated[str, Meta(description="The text before the cursor.")]
    suffix: Annotated[str, Meta(description="The text after the cursor.")] | None = None
    filepath: Annotated[str, Meta(description=(
        "The file being edited, relative to its repository's root: its requests are one document to the daemon, "
        "where a newer request supersedes an older one still running (409) and typing through a suggestion is "
        "answered from it."))] | None = None
    git_url: Annotated[str, Meta(description=(
        "The repository's remote: with `filepath`, tells two repositories' files of the same path apart; not used "
        "without it (this server searches no repository)."))] | None = None
    declarations: Annotated[list[TabbyDeclaration], Meta(description=(
        "Highest priority context: the first of these, then of the changed files' snippets, then of the opened "
        f"files', {MAX_SNIPPETS} in all, lead the prompt, the first nearest it."))] | None = None
    relevant_snippets_from_changed_files: list[TabbySnippet] | None = None
    relevant_snippets_from_recently_opened_files: list[TabbySnippet] | None = None
    clipboard: Annotated[str, Meta(description="Accepted and not used (as Tabby, which only logs it).")] | None = None


class TabbyCompletionRequest(Struct, kw_only=True):
    """Tabby's `POST /v1/completions`, as tabby-agent (Tabby's VS Code, IntelliJ and Vim plugins) sends it: told from
    an OpenAI request by `segments` (and no `prompt`). Unknown fields are ignored, as Tabby ignores them; those not
    honoured are named in X-M31R-Ignored-Options. Greedy unless `temperature` is above 0 (Tabby's default is 0.1);
    at most 64 tokens (Tabby's default), capped at --max-tokens-cap and half the model's context."""

    segments: TabbySegments
    language: Annotated[str, Meta(description=(
        "The editor's language id: `rust` ends the completion at Tabby's stop words for Rust (a blank line, a line "
        "comment or a top-level item at the line start); any other at a blank line only."))] | None = None
    temperature: Temperature | None = None
    seed: Seed | None = None
    mode: Annotated[Literal["standard"], Meta(description=(
        "Only `standard`: next edit suggestions need a model trained for them."))] = "standard"
    user: Annotated[str, Meta(description="An end-user id: accepted and not used.")] | None = None
    debug_options: Annotated[dict[str, Any], Meta(max_length=0, description=(
        "Not supported (the daemon builds the prompt): only {} or null."))] | None = None


TABBY_REFUSALS = {
    "mode": "next edit suggestions are not supported: mode must be \"standard\" or left out",
    "debug_options": "debug_options (raw_prompt, return_prompt, ...) are not supported: the daemon builds the prompt",
}


class TabbyChoice(Struct):
    index: int
    text: str


class TabbyCompletionResponse(Struct):
    """Tabby's answer: one choice, the text to insert at the cursor (tabby-agent reads `id` and the first choice)."""

    id: str
    choices: list[TabbyChoice]
    mode: Literal["standard"] = "standard"


class TabbyEvent(Struct, kw_only=True):
    """A completion's view, select or dismiss event, which tabby-agent posts: answered 200 and dropped, never kept."""

    type: Literal["view", "select", "dismiss"]
    completion_id: str
    choice_index: Annotated[int, Meta(ge=0, le=2**32 - 1)]
    view_id: str | None = None
    elapsed: Annotated[int, Meta(ge=0, le=2**32 - 1)] | None = None


class TabbyVersion(Struct):
    """`git_describe` is "v<Tabby release whose API this follows>-m31r-<m31r's version>": tabby-agent gates features
    on the Tabby release. This server has no build date or commit to report: those are empty."""

    build_date: str
    build_timestamp: str
    git_sha: str
    git_describe: str


class TabbyLocalModel(Struct):
    model_id: str
    device: str


class TabbyModelHealth(Struct):
    local: TabbyLocalModel


class TabbyModels(Struct):
    completion: TabbyModelHealth


class TabbyHealth(Struct):
    """Tabby's health state, with what is true here: the daemon's model and device (`cpu`, `cuda`, `metal`), no chat
    model (so tabby-agent offers no chat), no webserver, and this machine's CPU (the daemon runs on it)."""

    model: str
    device: str
    cuda_devices: list[str]
    models: TabbyModels
    arch: str
    cpu_info: str
    cpu_count: int
    version: TabbyVersion
    webserver: bool | None = None


class TabbyServerSetting(Struct):
    """Asks Tabby's clients not to send their own usage telemetry (tabby-agent otherwise reports to TabbyML)."""

    disable_client_side_telemetry: bool


# -- decoding -------------------------------------------------------------------------------------------------


class InvalidRequest(ValueError):
    """A request body that does not fit its schema: answered 400 with the field named."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid", status: int = 400):
        self.message, self.param, self.code, self.status = message, param, code, status
        super().__init__(message)


_AT = re.compile(r" - at `\$\.?([^`]*)`$")
_FIELD = re.compile(r"(?:required|unknown) field `([^`]*)`")

def _integral(obj: Any) -> Any:
    """JSON Schema counts 3.0 as an integer; msgspec does not. Integral floats become ints (float fields take
    ints, so nothing else changes)."""
    if isinstance(obj, float):
        return int(obj) if obj.is_integer() else obj
    if isinstance(obj, dict):
        return {k: _integral(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_integral(v) for v in obj]
    return obj


def _first_path(obj: Any, hit: Callable[[Any], bool], path: str = "") -> str | None:
    """The path (".options.temperature", ".stop[0]") of the first value, or key, in `obj` that `hit` holds for."""
    if hit(obj):
        return path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        sub = f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]"
        if hit(k):
            return sub
        if (found := _first_path(v, hit, sub)) is not None:
            return found
    return None


def _field_of(body: bytes | str, hit: Callable[[Any], bool]) -> str | None:
    """The field ("options.temperature", "stop[0]") of the first value or key in `body` that `hit` holds for, read by
    Python's json, which takes what msgspec refuses (a number past a float's range, a lone surrogate); None where
    there is none, or the body is no object (no field). A key's own lone surrogate is written as its escape."""
    try:
        path = _first_path(json.loads(body), hit) or ""
    except (ValueError, RecursionError):
        return None
    return path[1:].encode("utf-8", "backslashreplace").decode() if path.startswith(".") else None


def _out_of_range(body: bytes) -> InvalidRequest:
    """A number past a 64-bit float's range, named by its field: msgspec, reading JSON with no type, says only
    `$[...]`, which is no field. (Python's json reads such a number as ±inf.)"""
    param = _field_of(body, lambda v: isinstance(v, float) and math.isinf(v))
    return InvalidRequest(f"{param + ': ' if param else ''}the number is out of range (a JSON number here must fit a "
                          "64-bit float, up to about 1.8e308)", param)


# A JSON string's escapes, in order: a \\u escape's hex digits, else the escaped character (so an escaped backslash
# is one escape, and the `ud800` after it plain text).
_ESCAPE = re.compile(rb"\\(?:u([0-9a-fA-F]{4})|.)", re.DOTALL)
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def _lone_surrogate(body: bytes, skipped: int = 0) -> InvalidRequest | None:
    """A 400 naming the first \\ud800-\\udfff escape that is not half of a high-low pair, with its byte (counted in the
    body as sent, `skipped` bytes before `body`) and its field (where Python's json, which takes one, reads the body),
    or None when there is none. msgspec refuses one as "Input data was truncated" or "invalid utf-16 surrogate pair",
    which does not say what to fix."""
    lone = high = None  # the lone escape; a high half awaiting its low half
    for m in _ESCAPE.finditer(body):
        unit = int(m[1], 16) if m[1] else -1
        if high is not None:
            if m.start() == high.end() and 0xDC00 <= unit <= 0xDFFF:
                high = None
                continue
            lone = high
            break
        if 0xD800 <= unit <= 0xDBFF:
            high = m
        elif 0xDC00 <= unit <= 0xDFFF:
            lone = m
            break
    lone = lone or high
    if lone is None:
        return None
    param = _field_of(body, lambda v: isinstance(v, str) and _SURROGATE.search(v) is not None)
    where = f"{param}: " if param else ""
    return InvalidRequest(f"{where}a JSON string holds a lone UTF-16 surrogate ({lone[0].decode()} at byte "
                          f"{skipped + lone.start()}): an escape in \\ud800-\\udfff must be one half of a high-low "
                          "pair; send the character itself, or both halves of its pair", param, "bad_json")


_ESCAPED_BYTE = re.compile("[\\udc80-\\udcff]")  # a byte that is no UTF-8, as "surrogateescape" decodes it


def _not_utf8(body: bytes, skipped: int = 0) -> InvalidRequest | None:
    """A 400 saying that the body is not UTF-8, JSON's one encoding (RFC 8259), naming the first byte that is none (in
    the body as sent, `skipped` bytes before `body`) and its field; None when the body is UTF-8. msgspec's words for a
    Latin-1 body were "'utf-8' codec can't decode byte 0xe9 in position 3" (counted in the string, not the body), and
    "invalid character (byte 0)" for a UTF-16 one: neither says that the encoding is at fault. (Windows PowerShell
    5.1's Invoke-RestMethod sends a string body as ISO-8859-1 unless -ContentType names charset=utf-8.)"""
    if body.startswith((b"\xff\xfe", b"\xfe\xff")) or b"\x00" in body[:2]:  # a BOM, or an ASCII `{` in 2 or 4 bytes
        return InvalidRequest("the body is UTF-16 or UTF-32 (it has a byte order mark or zero bytes): JSON must be "
                              "UTF-8 (RFC 8259); send it encoded as UTF-8", None, "bad_json")
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        param = _field_of(body.decode("utf-8", "surrogateescape"),
                          lambda v: isinstance(v, str) and _ESCAPED_BYTE.search(v) is not None)
        return InvalidRequest(f"{param + ': ' if param else ''}the body is not UTF-8, which JSON must be (RFC 8259): "
                              f"byte 0x{body[e.start]:02x} at byte {skipped + e.start} is not UTF-8; send text in "
                              "Latin-1 or Windows-1252 encoded as UTF-8 (Windows PowerShell: -ContentType "
                              "'application/json; charset=utf-8')",
                              param, "bad_json")
    return None


TOO_DEEP = "the body's JSON is nested too deeply"  # msgspec (and _integral) recurse once per level: no request
# field nests more than three deep


BOM = b"\xef\xbb\xbf"


def parse(body: bytes) -> Any:
    """`body`'s JSON, untyped, or InvalidRequest. A leading UTF-8 byte order mark is skipped, as RFC 8259 lets a
    server do: Windows tools write one (a body saved by PowerShell's `Out-File -Encoding utf8`, sent with curl)."""
    sent, body = len(body), body.removeprefix(BOM)
    if not body.strip():  # (msgspec's word for it, "Input data was truncated", sent its client looking for a cut)
        raise InvalidRequest("the request has no body: send a JSON object (Content-Type: application/json)", None,
                             "bad_json")
    try:
        return msgspec.json.decode(body)
    except msgspec.ValidationError:  # (untyped, the only one: a number no float holds)
        raise _out_of_range(body) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise (_lone_surrogate(body, sent - len(body)) or _not_utf8(body, sent - len(body))
               or InvalidRequest(f"the body is not valid JSON: {e}", None, "bad_json")) from None
    except RecursionError:
        raise InvalidRequest(TOO_DEEP, None, "too_deep") from None


def decode(body: bytes, type_: type[Any], refusals: dict[str, str] | None = None) -> Any:
    """`body` as a `type_`, or InvalidRequest whose message and `param` name the offending field (`refusals`:
    why a field is refused, put before the validation error)."""
    return convert(parse(body), type_, refusals)


def convert(raw: Any, type_: type[Any], refusals: dict[str, str] | None = None) -> Any:
    """As `decode`, from a body already parsed (`parse`): endpoints that also read its untyped fields parse it once."""
    try:
        return msgspec.convert(_integral(raw), type_)
    except msgspec.ValidationError as e:
        text = str(e)
        m = _AT.search(text)
        param = m.group(1) if m else None
        if f := _FIELD.search(text):  # a field missing or unknown: named by its full path
            param = f"{param}.{f.group(1)}" if param else f.group(1)
        top = (param or "").split(".")[0].split("[")[0]
        if refusals and top in refusals:
            text = f"{refusals[top]} ({text})"
        raise InvalidRequest(text, param) from None
    except RecursionError:
        raise InvalidRequest(TOO_DEEP, None, "too_deep") from None


# -- OpenAPI ------------------------------------------------------------------------------------------------

REQUESTS = (GenerateRequest, CompletionRequest, FimRequest, OpenAICompletionRequest, InfillRequest,
            LlamaCppCompletionRequest, TabbyCompletionRequest, TabbyEvent)
RESPONSES = (GenerateResponse, CompletionResponse, StreamChunk, ErrorResponse, HealthResponse, HealthUnavailable,
             OpenAICompletion, OpenAIModelList, InfillResponse, LlamaCppCompletionResponse, InfillChunk, LlamaCppError,
             TabbyCompletionResponse, TabbyHealth, TabbyServerSetting)
# Their max_tokens maximum is the server's cap (/v1/completions caps a larger one instead: openai_completions).
CAPPED = ("GenerateRequest", "CompletionRequest", "FimRequest")


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(name: str) -> dict:
    return {"application/json": {"schema": _ref(name)}}


_ERRORS = {
    "400": "The body is not valid JSON, nests too deeply, or does not fit the schema (`error.param` names the "
           "field); or the prompt and max_tokens do not fit the model's context (code `context_overflow`).",
    "401": "A bearer token is configured and the request did not carry it.",
    "403": "The Host header is not a loopback name (DNS-rebinding defence), or the Origin is not allowed.",
    "409": "Cancelled by the daemon: superseded by a newer request for the same `path` (Tabby's: `filepath`).",
    "413": "The request body exceeds the server's limit.",
    "415": "The body has a Content-Encoding other than identity (gzip, ...): send it uncompressed.",
    "503": "The daemon is busy (its queue is full), starting, or unavailable, or this server's line of requests "
           "waiting for the daemon is full: retry after Retry-After seconds.",
    "504": "The request ran past the server's request timeout.",
}


def _error_responses(codes: tuple[str, ...]) -> dict:
    out = {}
    for code in codes:
        out[code] = {"description": _ERRORS[code], "content": _json("ErrorResponse")}
        if code == "503":
            out[code]["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                                    "description": "Seconds to wait before retrying."}}
    return out


def _event(event: str | None, schema: dict) -> dict:
    """One Server-Sent Event whose data is JSON fitting `schema` (OpenAPI 3.1: the media type's schema
    describes each event)."""
    data = {"type": "string", "contentMediaType": "application/json", "contentSchema": schema}
    props: dict = {"data": data}
    if event is not None:
        props["event"] = {"const": event}
    return {"type": "object", "properties": props, "required": list(props)}


def openapi(*, max_tokens_cap: int, version: str, token: bool = False) -> dict:
    """The OpenAPI 3.1 document for this server (schemas: JSON Schema 2020-12, generated from the Structs)."""
    _, components = msgspec.json.schema_components(REQUESTS + RESPONSES, ref_template="#/components/schemas/{name}")
    for name in CAPPED:
        prop = components[name]["properties"]["max_tokens"]
        for schema in prop.get("anyOf", [prop]):
            if schema.get("type") == "integer":
                schema["maximum"] = max_tokens_cap
    for name in ("GenerateRequest", "FimRequest", "CompletionRequest"):  # a beam search samples nothing
        components[name]["if"] = {"required": ["beams"], "properties": {"beams": {"type": "integer", "minimum": 2}}}
        components[name]["then"] = {"properties": {"temperature": {"exclusiveMaximum": GREEDY_BELOW}}}
    # As OpenAI: stream_options only with stream true.
    components["OpenAICompletionRequest"]["if"] = {"required": ["stream_options"],
                                                   "properties": {"stream_options": {"type": "object"}}}
    components["OpenAICompletionRequest"]["then"] = {"required": ["stream"], "properties": {"stream": {"const": True}}}
    gen_errors = ("400", "401", "403", "409", "413", "415", "503", "504")
    common = ("401", "403")

    def native_events(resp: str) -> dict:
        return {"anyOf": [_event("chunk", _ref("StreamChunk")), _event("done", _ref(resp)),
                          _event("error", _ref("ErrorResponse"))]}

    openai_events = {"type": "object", "required": ["data"], "properties": {"data": {
        "type": "string", "if": {"const": "[DONE]"}, "else": {
            "contentMediaType": "application/json",
            "contentSchema": {"anyOf": [_ref("OpenAICompletion"), _ref("ErrorResponse")]}}}}}

    def post(summary: str, req: str, resp: str, stream_doc: str, events: dict) -> dict:
        return {"post": {
            "summary": summary,
            "requestBody": {"required": True, "content": _json(req)},
            "responses": {
                "200": {"description": f"The result; with `stream: true`, {stream_doc}",
                        "content": {**_json(resp), "text/event-stream": {"schema": events}}},
                **_error_responses(gen_errors)}}}

    # A Tabby request is told from an OpenAI one by `segments` without `prompt` (OpenAI's refuses unknown fields).
    components["TabbyCompletionRequest"]["not"] = {"required": ["prompt"]}
    # llama.cpp's /completion request is told from this server's by `prompt` without `prefix` or `suffix` (this
    # server's refuses unknown fields, `prompt` among them; a body with both is a 400).
    components["LlamaCppCompletionRequest"]["not"] = {"anyOf": [{"required": ["prefix"]}, {"required": ["suffix"]}]}

    def tabby_completions(op: dict) -> dict:
        """/v1/completions taking Tabby's request too, answered with Tabby's response; a `model` not served is
        OpenAI's 404."""
        body, ok = op["post"]["requestBody"]["content"], op["post"]["responses"]["200"]["content"]
        op["post"]["responses"]["404"] = {"description": "`model` names no model served here (code "
                                                         "`model_not_found`, as OpenAI answers it)",
                                          "content": _json("ErrorResponse")}
        body["application/json"]["schema"] = {"anyOf": [_ref("OpenAICompletionRequest"),
                                                        _ref("TabbyCompletionRequest")]}
        ok["application/json"]["schema"] = {"anyOf": [_ref("OpenAICompletion"), _ref("TabbyCompletionResponse")]}
        return op

    picked = {"type": "object", "description": "The fields `response_fields` named (`a/b`: field b of a)."}

    def llamacpp_completion(op: dict) -> dict:
        """/completion taking llama.cpp's request too, answered in llama.cpp's shapes (its errors included)."""
        post_ = op["post"]
        post_["requestBody"]["content"]["application/json"]["schema"] = {
            "anyOf": [_ref("CompletionRequest"), _ref("LlamaCppCompletionRequest")]}
        ok = post_["responses"]["200"]
        ok["description"] += (" With llama.cpp's request (`prompt`), llama.cpp's answer: a LlamaCppCompletionResponse "
                              "(with `response_fields`, an object of those fields only); streamed, `data: {...}` "
                              "lines of InfillChunk, then the response (`content` empty), or an LlamaCppError.")
        ok["content"]["application/json"]["schema"] = {
            "anyOf": [_ref("CompletionResponse"), _ref("LlamaCppCompletionResponse"), picked]}
        llama_events = {"type": "object", "required": ["data"], "properties": {"data": {
            "type": "string", "contentMediaType": "application/json", "contentSchema": {
                "anyOf": [_ref("InfillChunk"), _ref("LlamaCppCompletionResponse"), _ref("LlamaCppError"), picked]}}}}
        events = ok["content"]["text/event-stream"]["schema"]
        ok["content"]["text/event-stream"]["schema"] = {"anyOf": [*events["anyOf"], llama_events]}
        for code, r in post_["responses"].items():
            if code != "200":
                r["content"]["application/json"]["schema"] = {"anyOf": [_ref("ErrorResponse"), _ref("LlamaCppError")]}
        return op

    native_stream = ("Server-Sent Events: `event: chunk` with a StreamChunk per text chunk, then `event: done` "
                     "with the full response (usage included), or `event: error` with an ErrorResponse.")
    paths = {
        "/generate": post("Continue a prompt", "GenerateRequest", "GenerateResponse", native_stream,
                          native_events("GenerateResponse")),
        "/completion": llamacpp_completion(post(
            "Code completion at a cursor (the editor policy); with `prompt` (and no `prefix` or `suffix`), llama.cpp "
            "server's /completion", "CompletionRequest", "CompletionResponse", native_stream,
            native_events("CompletionResponse"))),
        "/fim": post("Raw fill-in-the-middle", "FimRequest", "GenerateResponse", native_stream,
                     native_events("GenerateResponse")),
        "/v1/completions": tabby_completions(post(
            "OpenAI-compatible completions (`suffix`: fill-in-the-middle); with `segments`, Tabby's (tabby-agent)",
            "OpenAICompletionRequest", "OpenAICompletion",
            "`data: {...}` lines of OpenAICompletion chunks, then `data: [DONE]` (Tabby's requests never stream).",
            openai_events)),
        "/v1/health": {method: {
            "summary": "Tabby's health check (tabby-agent's GET, older clients' POST): the model, device and CPU",
            "responses": {
                "200": {"description": "The daemon answers", "content": _json("TabbyHealth")},
                **_error_responses((*common, "503"))}} for method in ("get", "post")},
        "/v1beta/server_setting": {"get": {
            "summary": "Tabby's server settings: clients are asked to send no usage telemetry of their own",
            "responses": {"200": {"description": "The settings", "content": _json("TabbyServerSetting")},
                          **_error_responses(common)}}},
        "/v1/events": {"post": {
            "summary": "Tabby's completion events (view, select, dismiss): accepted and dropped, never kept or sent",
            "parameters": [{"name": "select_kind", "in": "query", "required": False, "schema": {"type": "string"}}],
            "requestBody": {"required": True, "content": _json("TabbyEvent")},
            "responses": {"200": {"description": "Accepted (an empty body)"},
                          **_error_responses(("400", "401", "403", "413", "415"))}}},
        "/v1/models": {"get": {"summary": "OpenAI-compatible model list: the daemon's model and its aliases",
                               "responses": {
            "200": {"description": "The model", "content": _json("OpenAIModelList")},
            **_error_responses((*common, "503"))}}},
        "/v1/models/{model}": {"get": {
            "summary": "OpenAI-compatible: the model under any of the names a request may use for it",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string", "minLength": 1}}],
            "responses": {
                "200": {"description": "The model", "content": _json("OpenAIModel")},
                "404": {"description": "No model of that name is served here (code `model_not_found`)",
                        "content": _json("ErrorResponse")},
                **_error_responses((*common, "503"))}}},
        "/infill": {"post": {
            "summary": "llama.cpp server's fill-in-the-middle, for its editor plugins (llama.vim, llama.vscode)",
            "requestBody": {"required": True, "content": _json("InfillRequest")},
            "responses": {
                "200": {"description": "The result (with `response_fields`, an object of those fields only); with "
                                       "`stream: true`, `data: {...}` lines of InfillChunk, then the InfillResponse "
                                       "(`content` empty), or an LlamaCppError.",
                        "content": {"application/json": {"schema": {"anyOf": [_ref("InfillResponse"), picked]}},
                                    "text/event-stream": {"schema": {
                            "type": "object", "required": ["data"], "properties": {"data": {
                                "type": "string", "contentMediaType": "application/json", "contentSchema": {
                                    "anyOf": [_ref("InfillChunk"), _ref("InfillResponse"), _ref("LlamaCppError"),
                                              picked]}}}}}}},
                **{code: {**r, "content": _json("LlamaCppError")}
                   for code, r in _error_responses(("400", "401", "403", "413", "415", "503", "504")).items()}}}},
        "/v1/fim/completions": {"post": {
            "summary": "Mistral's Codestral fill-in-the-middle API, for Zed's edit predictions, Continue, minuet",
            "requestBody": {"required": True, "content": _json("CodestralRequest")},
            "responses": {
                "200": {"description": "The result; with `stream: true`, `data: {...}` lines of CodestralChunk "
                                       "(the first with the role, the last with finish_reason and usage), then "
                                       "`data: [DONE]`, or a CodestralError.",
                        "content": {**_json("CodestralResponse"), "text/event-stream": {"schema": {
                            "type": "object", "required": ["data"], "properties": {"data": {
                                "type": "string", "if": {"const": "[DONE]"}, "else": {
                                    "contentMediaType": "application/json", "contentSchema": {
                                        "anyOf": [_ref("CodestralChunk"), _ref("CodestralError")]}}}}}}}},
                **{code: {**r, "content": _json("CodestralError")}
                   for code, r in _error_responses(("401", "403", "409", "413", "415", "503", "504")).items()},
                "400": {"description": "The body is not valid JSON or does not fit the schema (`param` names the "
                                       "field), or the daemon refused the request.",
                        "content": _json("CodestralError")}}}},
        "/health": {"get": {"summary": "Ready (with model info) when the daemon answers", "responses": {
            "200": {"description": "The daemon answers", "content": _json("HealthResponse")},
            **_error_responses(common),
            "503": {"description": "The daemon is starting or unavailable", "content": _json("HealthUnavailable"),
                    "headers": {"Retry-After": {"schema": {"type": "integer"}}}}}}},
        "/metrics": {"get": {"summary": "Prometheus metrics (text exposition format)", "responses": {
            "200": {"description": "Metrics", "content": {"text/plain": {"schema": {"type": "string"}}}},
            **_error_responses(common)}}},
        "/openapi.json": {"get": {"summary": "This document", "responses": {
            "200": {"description": "OpenAPI 3.1", "content": {"application/json": {"schema": {"type": "object"}}}},
            **_error_responses(common)}}},
    }
    doc: dict = {
        "openapi": "3.1.0",
        "info": {"title": "m31r", "version": version,
                 "description": "Local, offline Rust code completion over HTTP: a thin adapter to the m31r daemon."},
        "paths": paths,
        "components": {"schemas": components},
    }
    if token:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def with_fim_limit(doc: dict, limit: int) -> dict:
    """`doc` with the fill-in-the-middle requests' max_tokens held to `limit`, the daemon's (half its model's context,
    known once it has answered): the native FIM endpoints', and /v1/completions' where it has a suffix."""
    doc = msgspec.json.decode(msgspec.json.encode(doc))  # a deep copy
    schemas = doc["components"]["schemas"]
    for name in ("FimRequest", "CompletionRequest"):
        prop = schemas[name]["properties"]["max_tokens"]
        for schema in prop.get("anyOf", [prop]):
            if schema.get("type") == "integer":
                schema["maximum"] = min(schema.get("maximum", limit), limit)
    openai = schemas["OpenAICompletionRequest"]
    capped = {"anyOf": [{"type": "integer", "maximum": limit}, {"type": "null"}]}
    rule = {"if": {"required": ["suffix"], "properties": {"suffix": {"type": "string"}}},
            "then": {"properties": {"max_tokens": capped}}}
    openai["allOf"] = [*openai.get("allOf", []), rule]
    return doc


def with_models(doc: dict, names: list[str]) -> dict:
    """`doc` with OpenAICompletionRequest.model limited to `names` (known once the daemon has answered)."""
    doc = msgspec.json.decode(msgspec.json.encode(doc))  # a deep copy
    prop = doc["components"]["schemas"]["OpenAICompletionRequest"]["properties"]["model"]
    for schema in prop.get("anyOf", [prop]):
        if schema.get("type") == "string":
            schema["enum"] = list(names)
    return doc


# -- Mistral's Codestral FIM API (codestral.py) -------------------------------------------------------------------


class CodestralRequest(Struct, kw_only=True):
    """Mistral's `POST /v1/fim/completions`, as Zed's edit predictions, Continue and minuet-ai.nvim send it: the text
    before the cursor is `prompt`, after it `suffix`. Unknown fields are ignored (Mistral refuses them), and those
    not honoured are named in X-M31R-Ignored-Options. Greedy unless `temperature` is above 0 (Mistral's default
    depends on the model; Zed sends 0.2, so its predictions are sampled)."""

    prompt: Annotated[str, Meta(description="The text before the cursor.")]
    suffix: Annotated[str, Meta(description=(
        "The text after the cursor; left out or null: empty (still fill-in-the-middle, as Zed means it when "
        "its excerpt ends at the cursor)."))] | None = None
    model: Annotated[str, Meta(description=(
        "Accepted and not checked: there is one model (the clients send `codestral-latest` by default); the "
        "answer names the one served."))] | None = None
    max_tokens: Annotated[int, Meta(ge=0, le=INT32, description=(
        "Most tokens to generate; capped (not refused) at the server's --max-tokens-cap and half the model's "
        "context, which is also the default."))] | None = None
    min_tokens: Annotated[int, Meta(ge=0, le=INT32, description=(
        "Accepted and not honoured (the daemon has no such rule); named in X-M31R-Ignored-Options."))] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2, description=(
        f"0 or left out: greedy (deterministic). Values below {GREEDY_BELOW} are treated as 0."))] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1, description=(
        "Nucleus sampling mass, with a temperature; 1 or left out: off."))] | None = None
    stream: Annotated[bool, Meta(description=(
        "Server-Sent Events: `data: {...}` chat-completion chunks (`choices[0].delta.content`), then "
        "`data: [DONE]`."))] | None = None
    stop: StopText | Stop | None = None
    random_seed: Seed | None = None


class CodestralMessage(Struct):
    """The completion, as the assistant's message (Mistral answers FIM as a chat completion)."""

    role: Literal["assistant"]
    content: Annotated[str, Meta(description="The text to insert at the cursor.")]
    tool_calls: None = None


class CodestralChoice(Struct):
    index: int
    message: CodestralMessage
    finish_reason: OpenAIFinishReason


class CodestralResponse(Struct, kw_only=True):
    """Mistral's answer to a FIM request: a chat completion with one choice (Zed reads every field of it)."""

    id: str
    object: Literal["chat.completion"]
    model: str
    usage: OpenAIUsage
    created: int
    choices: list[CodestralChoice]


class CodestralDelta(Struct, kw_only=True, omit_defaults=True):
    """A streamed piece of the completion; the stream's first chunk also carries the role (with no text). `content`
    is always there: Continue appends it as it is, and would write "undefined" for one left out."""

    role: Literal["assistant"] | None = None
    content: str


class CodestralStreamChoice(Struct):
    index: int
    delta: CodestralDelta
    finish_reason: OpenAIFinishReason | None


class CodestralChunk(Struct, kw_only=True, omit_defaults=True):
    """A stream's event: the last has `finish_reason` and `usage`, and is followed by `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[CodestralStreamChoice]
    usage: OpenAIUsage | None = None


class CodestralError(Struct):
    """Mistral's error shape (on /v1/fim/completions, the guard's refusals included)."""

    object: Literal["error"]
    message: str
    type: str  # invalid_request_error, server_error
    param: str | None  # the field at fault, when one is
    code: str | None  # this server's code: invalid, bad_json, busy, unavailable, timeout, ...


REQUESTS += (CodestralRequest,)
RESPONSES += (CodestralResponse, CodestralChunk, CodestralError)

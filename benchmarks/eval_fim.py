"""FIM quality evaluation on held-out Rust: the validation split, DATA/corpus/val.jsonl, whole crates the model
never saw in training (m31r.train.corpus splits by crate).

Greedy decoding through `m31r.engine.Engine` with the serving prompt layout (`build_fim_prompt` with
`FimBudget.for_context(max_context)`, the daemon's budget), stopping at `<|endoftext|>` and at the daemon's
serving stops: where the completion writes the suffix's next line again (`m31r.fim.suffix_stop`, and
`m31r.fim.start_stop` where that is its first line), and before a line that repeats the line above it
(`m31r.stops.RepeatedLine`). `--no-serving-stops` leaves those two out, for
comparison with figures from before them.

Tasks, drawn deterministically from a seeded RNG (same --seed and val split, same tasks):

  Each task draws a held-out crate, then one of its files.

  single-line  a random non-blank line of the file; the cursor sits at a random character
               after the line's indentation, leaving at least one character; the middle is the rest of that
               line, without its newline. Decoding also stops at a newline, and the prediction is cut at its
               first newline.
  multi-line   a block body: a line ending in `{`, and the lines after it up to its closing brace (the first
               later non-blank line indented no deeper than the opener that starts with `}`); 1-8 body
               lines, not all blank. The cursor is at the start of the first body line; the middle is the
               body lines with their newlines.

  Only middles that fit the completion budget are used (single-line: --single-tokens - 1 tokens, multi-line:
  --multi-tokens - 1, counted by the data's tokenizer, DATA/tokenizer.json, where it has one: the same tasks
  whatever the model's tokenizer), so every task is solvable. The budgets and the perplexity windows (--ppl-context) are
  fixed numbers, not the model's: models of different context lengths get the same tasks, and the same windows
  unless a model's context is shorter than --ppl-context (it is then said, and its perplexity not comparable).

Metrics, on prediction and target normalised the same way (trailing whitespace of each line and trailing
blank lines dropped):

  exact match      normalised prediction == normalised target
  edit similarity  1 - Levenshtein(prediction, target) / max(len(prediction), len(target)), by characters,
                   with an exact dynamic programme (difflib's ratio is not an edit distance); 1.0 when both
                   are empty
  as shown         exact match and edit similarity of what the editor shows at the task's cursor (`m31r lsp` with
                   its default settings and --min-probability; --no-as-shown skips it): the language server's request
                   for the document prefix + suffix (lsp/completion.py: policy.plan, fim_request), answered as the
                   daemon answers it (m31rd/server.py: build_prompt and its stops; greedy, as --beams says for a line
                   request), then hidden under the floor, cut to its confident lines and post-processed
                   (lsp/completion.py: shown_suggestion, the server's own). The shown text is compared with the
                   document's text over the range it replaces, with the middle in place, trailing whitespace of each
                   line dropped but its line breaks kept: accepting it must give the file's lines (a block body
                   that joins the `}` after it to its last line, `total    }`, is wrong); nothing shown scores as
                   an empty suggestion. At a single-line task's cursor the line's end is the document's, so the
                   editor asks for (and may show) several lines.
                   The raw figures above are the model's alone and stay comparable across sessions; this one says what
                   a user gets of them. Its request is answered from the task's own completion where the daemon would
                   run the same generation, else decoded again (not counted in ms/task).
  perplexity       exp(mean next-token loss) over non-overlapping windows of --ppl-context + 1 tokens spread
                   evenly over the validation stream (files tokenised and joined with <|endoftext|>, as in
                   training), with the engine's model and dtype; also bits per byte of the predicted text. A model
                   whose context is shorter gets windows of its context, with a warning; the report records the
                   window used (perplexity.context), and compare_evals.py says when two results' windows differ

    python benchmarks/eval_fim.py --bundle release/m31r-mini --data data --out bench-results/fim.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from m31r_protocol.policy import MIN_PROBABILITY, confident, confident_lines

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MAX_BODY_LINES = 8
MAX_LINE_CHARS = 200  # single-line tasks skip very long lines (data tables, long literals)


@dataclass
class Task:
    kind: str  # single | multi
    path: str
    line: int  # 0-based line index of the cursor
    prefix: str
    suffix: str
    target: str
    context: list = field(default_factory=list)  # snippets of other files of the crate (--context), best first


@dataclass
class Result:
    kind: str
    path: str
    line: int
    target: str
    prediction: str
    exact: bool
    edit_similarity: float
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    ms: float
    prefix_end: str = ""  # the prefix's last character: a stray space after indentation shows against it
    serving_stop: bool = False  # ended by a serving stop (suffix, repeated line), not by the model or the task
    alternatives: list[str] = field(default_factory=list)  # a beam search's runners-up, as the daemon sends them
    exact_any: bool = False  # the prediction or one of the alternatives matches
    snippets: int = 0  # project-context snippets offered (--context)
    context_tokens: int = 0  # of which laid before the prompt: the room it left allowed these tokens
    logprobs: list[float] = field(default_factory=list)  # of each token written, the end's last (Outcome.logprobs)
    line_logprob: float | None = None  # of the first line (logprob_by_line's first): what the editor's gate reads
    logprob_by_line: list[float] = field(default_factory=list)  # of each line (m31r.engine.line_logprobs)
    # What the editor shows for this cursor (run_tasks' `editor`; None where not scored so): the language server's
    # request for the document prefix + suffix, answered as the daemon answers it, then gated, cut and post-processed
    # as the server does. `shown` is the text it inserts ("" where it shows nothing), over the document's characters
    # `shown_range` (from, to), counted from the cursor; `shown_why` why nothing is shown: unsure (under the floor) or
    # empty (the policy left nothing).
    shown: str | None = None
    shown_range: list[int] = field(default_factory=lambda: [0, 0])
    shown_why: str = ""
    shown_exact: bool | None = None
    shown_edit_similarity: float | None = None
    shown_decoded: bool = False  # its request differs from the task's (prompt, stops or budget): decoded again


# -- task selection ---------------------------------------------------------------------------------------


def _line_offsets(lines: list[str]) -> list[int]:
    offs, pos = [], 0
    for line in lines:
        offs.append(pos)
        pos += len(line)
    return offs


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" \t"))


def single_line_candidates(lines: list[str]) -> list[int]:
    """Lines with at least one non-blank character (cursor positions exist after the indentation)."""
    return [i for i, ln in enumerate(lines) if ln.strip() and len(ln) <= MAX_LINE_CHARS]


def block_bodies(lines: list[str]) -> list[tuple[int, int]]:
    """(first body line, end) for `{`-ending lines whose closing `}` line is found by indentation (the trainer's
    block-body middles find them the same way, up to longer bodies)."""
    from m31r.train.samples import block_bodies as bodies

    return bodies(lines, MAX_BODY_LINES)


def make_tasks(texts: list[tuple[str, str, str]], n_single: int, n_multi: int, seed: int, tok, single_max: int,
               multi_max: int) -> list[Task]:
    """Tasks from (path, text, crate) files: a crate is drawn first, then one of its files, so a few large
    held-out crates do not make up most of the tasks."""
    rng = random.Random(seed)
    by_crate: dict[str, list[tuple[str, str, list[str]]]] = {}
    for path, text, crate in texts:
        by_crate.setdefault(crate, []).append((path, text, text.splitlines(keepends=True)))
    crates = sorted(by_crate)
    tasks: list[Task] = []
    seen: set[tuple[str, str, int]] = set()

    def draw(kind: str, want: int) -> None:
        got, tries = 0, 0
        while crates and got < want and tries < want * 50:  # no files: no tasks (callers say so), not a crash
            tries += 1
            files = by_crate[crates[rng.randrange(len(crates))]]
            path, text, lines = files[rng.randrange(len(files))]
            offs = _line_offsets(lines)
            if kind == "single":
                cands = single_line_candidates(lines)
                if not cands:
                    continue
                i = rng.choice(cands)
                body = lines[i].rstrip("\n")
                lo = _indent(body)
                cursor = offs[i] + rng.randrange(lo, len(body))
                end = offs[i] + len(body)
                prefix, target, suffix = text[:cursor], text[cursor:end], text[end:]
                limit = single_max
            else:
                cands = block_bodies(lines)
                if not cands:
                    continue
                i, j = rng.choice(cands)
                start, end = offs[i], offs[j]
                prefix, target, suffix = text[:start], text[start:end], text[end:]
                limit = multi_max
            if (kind, path, i) in seen or len(tok.encode(target)) > limit - 1:
                continue
            seen.add((kind, path, i))
            tasks.append(Task(kind, path, i, prefix, suffix, target))
            got += 1

    draw("single", n_single)
    draw("multi", n_multi)
    return tasks


def task_tokenizer(data: Path, tok, tok_hash: str):
    """The tokenizer that sizes the tasks' middles (make_tasks): the data's own (DATA/tokenizer.json) where it has one,
    so two models of different tokenizers draw the same tasks from the same data and seed (compare_evals.py pairs
    them); `tok`, the model's (its tokenizer.json's sha256 `tok_hash`), where the data has none or the same."""
    from m31r.bundle import sha256_file
    from m31r.tokenizer import DEFAULT_SPECIAL, Tokenizer

    path = data / "tokenizer.json"
    if not path.is_file() or sha256_file(path) == tok_hash:
        return tok
    return Tokenizer.from_file(path, DEFAULT_SPECIAL)


def val_texts(data: Path) -> list[tuple[str, str, str]]:
    """(path, text, crate) of the non-blank validation files in DATA/corpus/val.jsonl; files outside any crate (an
    older corpus) count as a crate each."""
    path = data / "corpus" / "val.jsonl"
    if not path.is_file():  # the usual first run of `make eval`: before `make train-data`
        raise SystemExit(f"error: {path} does not exist: build the corpus first, `make train-data` (`make "
                         f"train-data DATA={data}` for this folder)")
    with open(path) as f:
        docs = [d for d in map(json.loads, filter(str.strip, f)) if d["text"].strip()]
    return [(d["path"], d["text"], d.get("crate") or d["path"]) for d in docs]


def typing_options(p: argparse.ArgumentParser) -> None:
    """The options of the typing benchmarks on these tasks (bench_beams.py, bench_context.py): the engine as the
    daemon serves it by default."""
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quant", default="auto", help="as the daemon's --quant (auto: what the daemon takes here)")
    p.add_argument("--prefill-gemm", default="auto", help="as the daemon's --prefill-gemm")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)


def typing_engine(args: argparse.Namespace):
    from m31r.engine import Engine

    return Engine(args.bundle, dtype=args.dtype, quant=None if args.quant == "none" else args.quant,
                  threads=args.threads, prefill_gemm=args.prefill_gemm)


def engine_summary(engine) -> str:
    """The CPU and how the engine runs on it: the line every typing benchmark prints above its figures."""
    from m31r.cpu import describe

    return (f"CPU: {describe()}; engine {str(engine.dtype).removeprefix('torch.')} activations, "
            f"{engine.quant or 'float'} weights, {engine.kernel_report['kernels']} kernels"
            + (", bf16 prefill GEMMs" if engine.kernel_report.get("prefill_gemm") == "bfloat16" else ""))


def add_context(tasks: list[Task], texts: list[tuple[str, str, str]]) -> None:
    """Each task's snippets from the other files of its crate, as a project open in an editor offers them."""
    from m31r.train.samples import crate_path
    from m31r_protocol.context import query_words, rank, windows

    files = {path: (crate, windows(text)) for path, text, crate in texts}
    for t in tasks:
        crate = files[t.path][0]
        near = [(crate_path(p), w) for p, (c, w) in files.items() if c == crate and p != t.path]
        t.context = rank(query_words(t.prefix), near)


# -- metrics ----------------------------------------------------------------------------------------------


def normalize_lines(s: str) -> str:
    """Each line's trailing whitespace dropped, the line breaks kept: what the editor shows is text accepted into the
    document, where a break left out joins the line after it to the suggestion's last line."""
    return "\n".join(line.rstrip() for line in s.split("\n"))


def normalize(s: str) -> str:
    return normalize_lines(s).rstrip()


def levenshtein(a: str, b: str) -> int:
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def edit_similarity(pred: str, target: str) -> float:
    if not pred and not target:
        return 1.0
    return 1.0 - levenshtein(pred, target) / max(len(pred), len(target))


# -- what the editor shows ----------------------------------------------------------------------------------


def editor_settings(min_probability: float = MIN_PROBABILITY):
    """The language server's settings (m31r_lsp.settings' defaults) with this confidence floor: what `as shown`
    scores under."""
    from m31r_lsp.settings import EditorSettings

    return EditorSettings(min_probability=min_probability)


@dataclass
class EditorRequest:
    """The language server's Fim for a cursor (Completer._run), as the daemon turns it into a generation
    (m31rd.server._prepare): the prompt, its stops and budget, and the policy's plan for post-processing."""

    plan: object  # m31r_protocol.policy.Plan
    ids: list[int]
    heal: str
    max_tokens: int
    stop: list[str]
    start_stops: list[str]
    repeat_context: str
    width: int  # beam width (m31rd.server.request_beams, with the evaluation's --beams as the daemon's)
    min_probability: float | None


def editor_request(engine, budget, t: Task, settings, beams: int = 1) -> EditorRequest:
    """What the language server sends at the task's cursor in the document prefix + suffix, and what the daemon makes
    of it, through their own functions: policy.plan and fim_request (lsp/completion.py: Completer._run's), then
    as_trained, build_prompt, request_stops, request_start_stops and request_beams (m31rd/server.py)."""
    from m31r.fim import line_context
    from m31r.sampling import SamplingParams
    from m31r_lsp.completion import fim_request
    from m31r_protocol import messages as m
    from m31r_protocol import policy
    from m31rd.server import as_trained, build_prompt, request_beams, request_start_stops, request_stops

    plan = policy.plan(t.prefix + t.suffix, len(t.prefix), settings.options())
    fields, _, _ = fim_request(plan, settings, engine.config.max_context)
    req = as_trained(m.Fim(id=0, context=list(t.context), **fields))
    ids, max_tokens, heal, _ = build_prompt(engine, budget, req)
    return EditorRequest(plan, ids, heal, max_tokens, request_stops(req), request_start_stops(req),
                         line_context(req.prefix), request_beams(req, SamplingParams(), beams), req.min_probability)


def shown_regions(t: Task, suggestion) -> tuple[str, str]:
    """(shown, wanted): the suggestion's text, and the document's text over the range it replaces with the task's
    middle in place, so that accepting a right suggestion gives the original file. Nothing shown: ("", the middle)."""
    if suggestion is None:
        return "", t.target
    text, cursor = t.prefix + t.suffix, len(t.prefix)
    return suggestion.text, text[suggestion.start : cursor] + t.target + text[cursor : suggestion.end]


def score_shown(r: Result, t: Task, req: EditorRequest, raw: str, line_logprob: float | None, by_line: list[float],
                decoded: bool, stop_sequence: str | None = None, finish_reason: str | None = None) -> None:
    """Fill in r's `shown` fields from the editor's answer `raw` to `req`: what the language server shows of it at a
    request nobody invoked (lsp/completion.py: shown_suggestion, Completer._run's)."""
    from m31r_lsp.completion import shown_suggestion

    suggestion, why = shown_suggestion(req.plan, raw, line_logprob, by_line, req.min_probability or 0.0,
                                       stop_sequence=stop_sequence, finish_reason=finish_reason)
    shown, wanted = shown_regions(t, suggestion)
    p, g = normalize_lines(shown), normalize_lines(wanted)
    cursor = len(t.prefix)
    r.shown, r.shown_why, r.shown_decoded = shown, why, decoded
    r.shown_range = [suggestion.start - cursor, suggestion.end - cursor] if suggestion is not None else [0, 0]
    r.shown_exact, r.shown_edit_similarity = p == g, round(edit_similarity(p, g), 4)


# -- running ----------------------------------------------------------------------------------------------


def run_tasks(engine, tasks: list[Task], single_max: int, multi_max: int, log, heal: bool = True,
              serving_stops: bool = True, beams: int = 1, floor_stop: float | None = None,
              editor=None) -> list[Result]:
    """Each task's completion, scored. With `editor` (EditorSettings: editor_settings()) each is also scored as the
    editor shows it (Result.shown): the language server's request for that cursor is answered from this completion
    where the daemon would run the same generation, else decoded again (not counted in `ms`)."""
    from m31r.beams import beam_generate
    from m31r.context import context_ids, context_room
    from m31r.engine import Outcome, line_logprobs
    from m31r.fim import FimBudget, build_fim_prompt, line_context, start_stop, suffix_stop

    budget = FimBudget.for_context(engine.config.max_context)
    cache = engine.new_cache()
    spares: list = []
    results = []
    for k, t in enumerate(tasks):
        prompt = build_fim_prompt(engine.tokenizer, t.prefix, t.suffix, budget, heal=heal)
        head = context_ids(engine.tokenizer, t.context, context_room(budget, prompt))
        ids = head + prompt.ids
        single = t.kind == "single"
        res = Outcome(prompt_tokens=len(ids))
        at_suffix = suffix_stop(t.prefix, t.suffix) if serving_stops and not single else None
        at_start = start_stop(t.prefix, t.suffix) if serving_stops else None  # a line task's too, as the daemon's
        t0 = time.perf_counter()
        kw = dict(max_tokens=single_max if single else multi_max, cache=cache, result=res, heal=prompt.heal,
                  stop=["\n"] if single else [at_suffix] if at_suffix else [],
                  start_stops=[at_start] if at_start else [],
                  repeat_context=line_context(t.prefix) if serving_stops else None)
        if floor_stop and not (beams > 1 and single):
            kw["min_probability"] = floor_stop
        wide = beams > 1 and single  # the daemon searches only completions that end at a line end
        stream = beam_generate(engine, ids, width=beams, spares=spares, **kw) if wide else None
        for _ in stream or engine.generate(ids, **kw):
            pass
        ms = (time.perf_counter() - t0) * 1000
        pred = res.text.split("\n", 1)[0] if single else res.text
        by_line = line_logprobs(engine.tokenizer.token_bytes, res.tokens, res.logprobs, pred.count("\n") + 1)
        p, g = normalize(pred), normalize(t.target)
        alts = [a.split("\n", 1)[0] if single else a for a in res.alternatives]
        results.append(Result(t.kind, t.path, t.line, t.target, pred, p == g, round(edit_similarity(p, g), 4),
                              len(ids), res.completion_tokens, res.finish_reason or "", round(ms, 1),
                              t.prefix[-1:],
                              res.stopped_by == "repeat" or (not single and res.stopped_by == "sequence"), alts,
                              g in {p, *map(normalize, alts)}, len(t.context), len(head),
                              [round(x, 3) for x in res.logprobs], by_line[0] if by_line else None,
                              [round(x, 4) for x in by_line]))
        if editor is not None:
            req = editor_request(engine, budget, t, editor, beams)
            width = beams if wide else 1
            # The daemon's generation for the editor's request is this one where prompt, stops and width are the same
            # and the budget too, or (greedy) this one ended by itself before the editor's budget ran out. Its floor
            # (Fim.min_probability) ends the text where what is shown is decided, so it does not change what is shown.
            same = ((req.ids, req.heal, req.stop, req.start_stops, req.width)
                    == (ids, prompt.heal, kw["stop"], kw["start_stops"], width)
                    and req.repeat_context == kw["repeat_context"]
                    and (req.max_tokens == kw["max_tokens"] or width == 1 and res.finish_reason == "stop"
                         and res.completion_tokens < req.max_tokens))
            got = res
            if not same:
                got = Outcome(prompt_tokens=len(req.ids))
                again = dict(max_tokens=req.max_tokens, cache=cache, result=got, heal=req.heal, stop=req.stop,
                             start_stops=req.start_stops, repeat_context=req.repeat_context)
                if req.width > 1:
                    stream = beam_generate(engine, req.ids, width=req.width, spares=spares, **again)
                else:
                    stream = engine.generate(req.ids, min_probability=req.min_probability, **again)
                for _ in stream:
                    pass
            # As the daemon's scheduler figures the lines of its answer (m31rd.scheduler._finished).
            lines = line_logprobs(engine.tokenizer.token_bytes, got.tokens, got.logprobs, got.text.count("\n") + 1,
                                  req.heal.count("\n"))
            score_shown(results[-1], t, req, got.text, lines[0] if lines else None, lines, not same,
                        got.stop_sequence, got.finish_reason)
        if (k + 1) % 10 == 0:
            log(f"  {k + 1}/{len(tasks)} tasks")
    return results


def text_bytes(tok, ids: list[int]) -> int:
    """The UTF-8 bytes of the text these predicted ids spell, special tokens none. A window's edge can fall inside a
    character (its bytes in two tokens); decoded, each stray half becomes a 3-byte U+FFFD, so a byte-level tokenizer's
    ids are counted by their own bytes."""
    if tok.byte_level:
        return sum(len(tok.token_bytes[i] or b"") for i in ids)
    return len(tok.decode(ids).encode("utf-8"))


def perplexity(engine, texts: list[str], n_windows: int, context: int) -> dict:
    """Perplexity over `n_windows` windows of `context` tokens each predicted, or of the model's context where that is
    shorter: said on stderr and recorded (`context`, beside `requested_context`), as a perplexity over shorter windows
    (less to condition on) is higher and not comparable with one over longer windows (compare_evals says so)."""
    import torch
    import torch.nn.functional as F

    tok = engine.tokenizer
    stream: list[int] = []
    for ids in tok.encode_batch(texts):
        stream += ids + [tok.eos_id]
    used = min(context, engine.config.max_context)
    if used < context:
        print(f"warning: this model's context is {engine.config.max_context} tokens, shorter than --ppl-context "
              f"{context}: its perplexity is over {used}-token windows, not comparable with one over {context}-token "
              "windows", file=sys.stderr, flush=True)
    w = used + 1
    k = min(n_windows, len(stream) // w)
    if k == 0:
        return {"windows": 0, "context": used, "requested_context": context}
    stride = len(stream) // k
    nats, n_tok, n_bytes = 0.0, 0, 0
    for i in range(k):
        win = torch.tensor(stream[i * stride : i * stride + w], dtype=torch.long, device=engine.device)
        with torch.inference_mode():
            logits = engine.model(win[None, :-1])
        nats += float(F.cross_entropy(logits[0].float(), win[1:], reduction="sum"))
        n_tok += w - 1
        n_bytes += text_bytes(tok, stream[i * stride + 1 : i * stride + w])
    loss = nats / n_tok
    return {"windows": k, "context": used, "requested_context": context, "tokens": n_tok, "bytes": n_bytes,
            "stream_tokens": len(stream), "loss": round(loss, 4), "perplexity": round(math.exp(loss), 3),
            "bits_per_byte": round(nats / math.log(2) / max(n_bytes, 1), 4)}


def summarize(results: list[Result], kind: str) -> dict:
    rs = [r for r in results if r.kind == kind]
    if not rs:
        return {"n": 0}
    n = len(rs)
    return {"n": n, "exact_match": round(sum(r.exact for r in rs) / n, 4),
            # exact, or one of a beam search's runners-up is (what an editor cycling through its suggestions finds)
            "exact_any": round(sum(r.exact_any for r in rs) / n, 4),
            "alternatives": round(sum(len(r.alternatives) for r in rs) / n, 2),
            "edit_similarity": round(sum(r.edit_similarity for r in rs) / n, 4),
            "completion_tokens": round(sum(r.completion_tokens for r in rs) / n, 2),
            # ended by the model's end-of-middle or the task's own stop (a single line's newline): comparable with
            # figures from before the serving stops
            "stopped": round(sum(r.finish_reason == "stop" and not r.serving_stop for r in rs) / n, 4),
            "serving_stopped": round(sum(r.serving_stop for r in rs) / n, 4),
            # completions that open with whitespace right after a prefix ending in whitespace: the doubled space
            # of a cursor inside a token (what token healing prevents); the targets never do this
            "doubled_space": sum(r.prefix_end in (" ", "\t") and r.prediction[:1] in (" ", "\t") for r in rs),
            "ms_per_task": round(sum(r.ms for r in rs) / n, 1),
            # project context (--context): snippets offered, and tokens of them the prompt had room for, per task
            "snippets": round(sum(r.snippets for r in rs) / n, 2),
            "context_tokens": round(sum(r.context_tokens for r in rs) / n, 1),
            **({"as_shown": as_shown(rs)} if all(r.shown_exact is not None for r in rs) else {})}


def as_shown(rs: list[Result]) -> dict:
    """The tasks scored on what the editor shows (Result.shown; nothing shown scores as an empty suggestion): exact
    match and edit similarity as above, the share shown, and the share whose editor request was decoded again."""
    n = len(rs)
    return {"exact_match": round(sum(bool(r.shown_exact) for r in rs) / n, 4),
            "edit_similarity": round(sum(r.shown_edit_similarity or 0.0 for r in rs) / n, 4),
            "shown": round(sum(r.shown_why == "" for r in rs) / n, 4),
            "unsure": round(sum(r.shown_why == "unsure" for r in rs) / n, 4),
            "decoded_again": round(sum(r.shown_decoded for r in rs) / n, 4)}


def gate(results: list[Result], kind: str, floor: float) -> dict:
    """What the editors' confidence floor does to these tasks' suggestions: the share it shows, and how often the
    first line is right among them (the whole line, for single-line tasks) against all, with the right ones it hides."""
    rs = [r for r in results if r.kind == kind]
    if not rs:
        return {"n": 0}

    def right(r: Result) -> bool:
        return normalize(r.prediction.split("\n", 1)[0]) == normalize(r.target.split("\n", 1)[0])

    shown = [r for r in rs if confident(r.line_logprob, floor)]
    n_right, right_shown = sum(map(right, rs)), sum(map(right, shown))
    out = {"n": len(rs), "shown": round(len(shown) / len(rs), 4),
           "first_line_shown": round(right_shown / max(1, len(shown)), 4),
           "first_line_all": round(n_right / len(rs), 4), "right": n_right, "right_hidden": n_right - right_shown}
    if kind == "multi":
        # The shown suggestions' lines, whole and cut to their confident lines (policy.confident_lines): a line is
        # right when it and every line above it are the target's.
        def lines(text: str, r: Result) -> tuple[int, int]:
            got, want = normalize(text).split("\n"), normalize(r.target).split("\n")
            got = got if got != [""] else []
            k = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
            return len(got), k

        whole = [lines(r.prediction, r) for r in shown]
        cut = [lines(confident_lines(r.prediction, r.logprob_by_line, floor), r) for r in shown]
        out["lines"] = {"whole": sum(n for n, _ in whole), "whole_right": sum(k for _, k in whole),
                        "cut": sum(n for n, _ in cut), "cut_right": sum(k for _, k in cut)}
    return out


def editor_report(min_probability: float) -> dict:
    """The language server's settings that shape what `as_shown` scores (its beam width and project context are the
    evaluation's --beams and --context, reported beside)."""
    settings = editor_settings(min_probability)
    return {k: getattr(settings, k) for k in ("multiline", "max_tokens", "max_lines", "min_probability", "temperature")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, required=True)
    p.add_argument("--data", type=Path, required=True, help="data dir holding corpus/val.jsonl")
    p.add_argument("--n-single", type=int, default=100)
    p.add_argument("--n-multi", type=int, default=50)
    p.add_argument("--ppl-windows", type=int, default=32, help="windows of --ppl-context tokens for perplexity")
    p.add_argument("--ppl-context", type=int, default=1024, help="tokens per perplexity window")
    p.add_argument("--multi-tokens", type=int, default=128, help="max new tokens of a multi-line completion")
    p.add_argument("--single-tokens", type=int, default=48, help="max new tokens of a single-line completion")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", default="none", help="weights as the daemon's --quant (none: as stored; auto: what the "
                   "daemon serves on this machine)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-heal", action="store_true", help="prompts without token healing (for comparison)")
    p.add_argument("--beams", type=int, default=1, help="single-line tasks by a beam search of this width "
                   "(1: greedy)")
    p.add_argument("--context", action="store_true", help="each task's prompt led by snippets of the other files of "
                   "its crate, chosen as the language server chooses them (m31r_protocol.context)")
    p.add_argument("--no-serving-stops", action="store_true",
                   help="without the daemon's suffix and repeated-line stops (for comparison)")
    p.add_argument("--min-probability", type=float, default=MIN_PROBABILITY,
                   help="the editors' confidence floor (policy.confident): what it would hide is reported")
    p.add_argument("--floor-stop", action="store_true",
                   help="send the floor with each task, as the editors do (Fim.min_probability): generation ends "
                        "where it decided what is shown, so the shown suggestions and their cut lines stay the same "
                        "while tokens and time drop; exact match and edit similarity then count the cut answers "
                        "(for comparison, not for releases)")
    p.add_argument("--no-as-shown", action="store_true",
                   help="skip the 'as shown' scores (what the editor shows: the language server's request for each "
                        "cursor, post-processed), which decode again the tasks whose request differs")
    args = p.parse_args(argv)
    # Said before the model loads: a perplexity of no window or of windows of one token divided by zero after every
    # task had run, and the report, written last, was lost.
    if min(args.n_single, args.n_multi, args.ppl_windows) < 0 or args.ppl_context < 1 or args.beams < 1:
        p.error("--n-single, --n-multi and --ppl-windows must be at least 0, --ppl-context and --beams at least 1")
    if min(args.single_tokens, args.multi_tokens) < 2:
        p.error("--single-tokens and --multi-tokens must be at least 2 (a middle of one token, and the end)")

    from m31r.engine import Engine
    from m31r.fim import FimBudget

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    t_start = time.perf_counter()
    texts = val_texts(args.data)  # first: a missing corpus is said before the model loads
    if not texts:
        raise SystemExit(f"no validation files in {args.data / 'corpus' / 'val.jsonl'}")
    engine = Engine(args.bundle, dtype=args.dtype, threads=args.threads,
                    quant=None if args.quant == "none" else args.quant)
    meta = engine.bundle.metadata
    task_tok = task_tokenizer(args.data, engine.tokenizer, meta["tokenizer_hash"])
    if task_tok is not engine.tokenizer:
        log(f"warning: {args.data / 'tokenizer.json'} differs from the bundle's tokenizer; the bundle's tokenizes the "
            f"prompts, the data's sizes the tasks (the same tasks for any model on this data)")
    reserve = FimBudget.for_context(engine.config.max_context).reserve
    single_max, multi_max = min(args.single_tokens, reserve), min(args.multi_tokens, reserve)
    if (single_max, multi_max) != (args.single_tokens, args.multi_tokens):
        log(f"warning: this model's completion budget is {reserve} tokens: tasks are cut to it, and differ from "
            f"a larger model's")
    tasks = make_tasks(texts, args.n_single, args.n_multi, args.seed, task_tok, single_max, multi_max)
    if args.context:
        add_context(tasks, texts)
    log(f"{engine.bundle.model_id}: {sum(t.kind == 'single' for t in tasks)} single-line and "
        f"{sum(t.kind == 'multi' for t in tasks)} multi-line tasks from {len(texts)} validation files")
    results = run_tasks(engine, tasks, single_max, multi_max, log, heal=not args.no_heal,
                        serving_stops=not args.no_serving_stops, beams=args.beams,
                        floor_stop=args.min_probability if args.floor_stop else None,
                        editor=None if args.no_as_shown else editor_settings(args.min_probability))
    t_ppl = time.perf_counter()
    ppl = perplexity(engine, [t for _, t, _ in texts], args.ppl_windows, args.ppl_context)
    ppl["seconds"] = round(time.perf_counter() - t_ppl, 1)

    import torch

    report = {
        "model": engine.bundle.model_id,
        "bundle": str(args.bundle),
        "fingerprint": engine.bundle.fingerprint,
        "metadata": {k: meta.get(k) for k in ("parameter_count", "dataset_version", "tokenizer_hash", "steps",
                                               "tokens_seen", "val_loss_next", "val_perplexity")},
        "data": str(args.data),
        "val_files": len(texts),
        "val_crates": len({c for _, _, c in texts}),
        "token_healing": not args.no_heal,
        "healing": "whole word" if not args.no_heal else "none",  # one token only before the seventeenth session
        "serving_stops": not args.no_serving_stops,
        "beams": args.beams,
        "floor_stop": args.floor_stop,
        "context": args.context,
        # The language server's settings the `as_shown` figures are for (its defaults, with --min-probability).
        **({} if args.no_as_shown else {"editor": editor_report(args.min_probability)}),
        "seed": args.seed,
        "dtype": args.dtype,
        "quant": engine.quant,
        "threads": torch.get_num_threads(),
        "max_context": engine.config.max_context,
        "max_new_tokens": {"single": single_max, "multi": multi_max},
        "single_line": summarize(results, "single"),
        "multi_line": summarize(results, "multi"),
        "perplexity": ppl,
        "gate": {"min_probability": args.min_probability, "single_line": gate(results, "single", args.min_probability),
                 "multi_line": gate(results, "multi", args.min_probability)},
        "seconds": round(time.perf_counter() - t_start, 1),
        "tasks": [asdict(r) for r in results],
    }
    rows = [("single-line", report["single_line"]), ("multi-line", report["multi_line"])]
    print(f"\nFIM evaluation of {report['model']} ({args.dtype}, {report['threads']} threads, seed {args.seed})")
    shown = not args.no_as_shown
    print(f"{'task':<12} {'n':>5} {'exact':>8} {'edit-sim':>9} {'tokens':>7} {'stopped':>8} {'serving':>7} "
          f"{'ms/task':>8} {'2x space':>8}" + (f" {'shown':>6} {'exact':>8} {'edit-sim':>9}" if shown else ""))
    for name, s in rows:
        if s["n"]:
            a = s.get("as_shown", {})
            print(f"{name:<12} {s['n']:>5} {s['exact_match']:>8.1%} {s['edit_similarity']:>9.3f} "
                  f"{s['completion_tokens']:>7.1f} {s['stopped']:>8.0%} {s['serving_stopped']:>7.0%} "
                  f"{s['ms_per_task']:>8.0f} "
                  f"{s['doubled_space']:>8}"
                  + (f" {a['shown']:>6.0%} {a['exact_match']:>8.1%} {a['edit_similarity']:>9.3f}" if a else ""))
        else:
            print(f"{name:<12} {0:>5}")
    if shown:
        print(f"(the last three: as the editor shows it at minProbability {args.min_probability:g}, the language "
              "server's defaults otherwise: the share shown, and exact match and edit similarity of what is shown, "
              "nothing counting as an empty suggestion)")
    if args.beams > 1 and report["single_line"]["n"]:
        s = report["single_line"]
        print(f"single-line exact within the beam search's suggestions: {s['exact_any']:.1%} "
              f"({s['alternatives']:.2f} runners-up per task)")
    for name, g in (("single-line", report["gate"]["single_line"]), ("multi-line", report["gate"]["multi_line"])):
        if g["n"]:
            print(f"{name} suggestions the editors show at minProbability {args.min_probability:g}: {g['shown']:.1%}; "
                  f"first line right in {g['first_line_shown']:.1%} of them against {g['first_line_all']:.1%} of "
                  f"all; {g['right_hidden']} of {g['right']} right first lines hidden")
    if (lines := report["gate"]["multi_line"].get("lines")) and lines["whole"]:
        print(f"multi-line suggestions shown, cut to their confident lines: {lines['cut']} lines "
              f"({lines['cut_right']} right) against {lines['whole']} whole ({lines['whole_right']} right)")
    if ppl["windows"]:
        print(f"validation perplexity {ppl['perplexity']:.2f} (loss {ppl['loss']:.3f} nats/token, "
              f"{ppl['bits_per_byte']:.3f} bits/byte; {ppl['windows']} windows x "
              f"{ppl['tokens'] // ppl['windows']} tokens)")
    summary = {k: v for k, v in report.items() if k != "tasks"}
    print(json.dumps(summary, ensure_ascii=False))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

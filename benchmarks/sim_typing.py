"""What an editor user sees, keystroke by keystroke: a real `m31r lsp` session (over stdio, a pygls client playing the
editor) against a real daemon on a bundle (release/ by default), typing the held-out exec problems' solution code.

Each problem of benchmarks/data/exec/ (never trained on) is opened with its middle (the solution's lines between
`// @middle` and `// @end`) left out, as an empty line indented like its first line; the simulated user then types
the middle one character at a time as an editor sends it: a didChange per keystroke, Enter adding the next line's
indentation (auto-indent), an opening bracket or quote whose closer is on the same line auto-closed and that closer
overtyped when the user types it (VS Code's defaults; `--no-autoclose` turns it off). After each keystroke the editor
asks `textDocument/inlineCompletion` (Automatic). Where what is shown, once accepted, makes the document the solution
typed further (the rest of the line, or of the block for a multi-line suggestion, with only closers still to
overtype), the user presses Tab: the accept is sent as the editor's didChange and typing goes on after it.

Scores, as a user experiences them:
  accepted chars   characters of the solution the user did not type (each Tab counts one keystroke)
  wrong shows      suggestions shown that the user would not accept (noise on screen)
  flicker          a suggestion shown, the user typed its next character, and the next keystroke showed something
                   else (changed) or nothing (vanished) although the rest of it was still right for that text
  hidden-good      nothing shown (the confidence floor: `unsure`; or the policy dropped it) where the daemon's raw
                   answer (`m31r/stats` lastRaw), post-processed, would have been accepted
  raw-better       the raw answer covers more of what the user types next (an oracle: its lines compared with the
                   solution's, indentation aside) than what was shown: the policy cut, hid or spoilt a good answer

Deterministic: greedy decoding, debounce 0 (each keystroke waits for its answer), a deadline far above any answer's
time, one daemon started fresh for the run.

    python benchmarks/sim_typing.py                      # all 56 problems (about 8 minutes on 2 cores)
    python benchmarks/sim_typing.py --subset 12          # every 5th problem: a quick run
    python benchmarks/sim_typing.py --bundle B --out r.json --worst 20
    python benchmarks/sim_typing.py --data ~/.cache/m31r/data   # 40 block bodies of the held-out crates instead
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemon import Daemon  # noqa: E402
from bench_lsp import start_client  # noqa: E402
from eval_exec import PROBLEMS, load_problems  # noqa: E402

from m31r.cpu import cpu_info, describe  # noqa: E402
from m31r_protocol import policy  # noqa: E402

PAIRS = {"(": ")", "[": "]", "{": "}", '"': '"'}
CLOSING = frozenset(')]}"')


# -- the solution to type -------------------------------------------------------------------------------------


@dataclass
class Target:
    """One problem: the document is `head + typed + pending closers + tail`, the user types `body`."""

    name: str
    head: str  # the file above the middle
    body: str  # the middle without its last line break: what the user types
    tail: str  # the line break ending the middle, the rest of the file up to the tests
    autoclose: dict[int, str] = field(default_factory=dict)  # index in body of an opener → the closer an editor adds

    @property
    def start(self) -> int:
        """Where typing starts: the editor's auto-indent on the new line holds the first line's indentation."""
        return len(policy.leading_ws(self.body))


def autoclose_map(body: str) -> dict[int, str]:
    """Openers in code (not in a string, a char literal or a comment) whose closer is on the same line: those an
    editor auto-closes and the user then overtypes. (A block's `{` whose `}` is lines below is left alone: how an
    editor moves that `}` on Enter is not simulated.)"""
    out: dict[int, str] = {}
    for start, line in _lines_at(body):
        stack: list[tuple[int, str]] = []
        i = 0
        while i < len(line):
            c = line[i]
            if line.startswith("//", i):
                break
            if c == '"':
                j = i + 1
                while j < len(line) and line[j] != '"':
                    j += 2 if line[j] == "\\" else 1
                if j < len(line):
                    out[start + i] = '"'
                i = j + 1
                continue
            if c == "'" and (m := _char_literal(line, i)):
                i = m
                continue
            if c in "([{":
                stack.append((i, c))
            elif c in ")]}" and stack and PAIRS[stack[-1][1]] == c:
                out[start + stack.pop()[0]] = c
            i += 1
    return out


def _char_literal(line: str, i: int) -> int:
    """The end of a char literal starting at `line[i]` ("'"), or 0 for a lifetime."""
    if line[i + 1 : i + 2] == "\\":
        end = line.find("'", i + 3)
        return end + 1 if end > 0 else 0
    return i + 3 if line[i + 2 : i + 3] == "'" else 0


def _lines_at(text: str) -> list[tuple[int, str]]:
    out, pos = [], 0
    for ln in text.split("\n"):
        out.append((pos, ln))
        pos += len(ln) + 1
    return out


def targets(subset: int | None) -> list[Target]:
    probs = load_problems(PROBLEMS)
    if subset:
        step = max(1, len(probs) // subset)
        probs = probs[::step][:subset]
    out = []
    for p in probs:
        body = p.middle[:-1] if p.middle.endswith("\n") else p.middle
        out.append(Target(p.name, p.prefix, body, p.middle[len(body) :] + p.suffix, autoclose_map(body)))
    return out


HELD_OUT_CHARS = 400  # the longest block body typed from the held-out crates


def held_out_targets(data: Path, n: int, seed: int) -> list[Target]:
    """Block bodies from the held-out crates (DATA/corpus/val.jsonl), a crate drawn first, then one of its files and
    one of its `{` blocks of at most HELD_OUT_CHARS: real code typed between lines that exist, with the file's own
    rest below, where the exec problems are small functions typed to their end."""
    import random

    from eval_fim import block_bodies, val_texts

    rng = random.Random(seed)
    by_crate: dict[str, list[tuple[str, str]]] = {}
    for path, text, crate in val_texts(data):
        by_crate.setdefault(crate, []).append((path, text))
    crates, out, seen = sorted(by_crate), [], set()
    for _ in range(n * 50):
        if len(out) == n or not crates:
            break
        path, text = rng.choice(by_crate[rng.choice(crates)])
        lines = text.splitlines(keepends=True)
        blocks = [(i, j) for i, j in block_bodies(lines)
                  if len(body := "".join(lines[i:j])) <= HELD_OUT_CHARS and not {"\r", "\t"} & set(body)]
        if not blocks:
            continue
        i, j = rng.choice(blocks)
        if (path, i) in seen:
            continue
        seen.add((path, i))
        head, middle = "".join(lines[:i]), "".join(lines[i:j])
        body = middle.removesuffix("\n")
        out.append(Target(f"{path}:{i + 1}", head, body, middle[len(body) :] + "".join(lines[j:]),
                          autoclose_map(body)))
    return out


# -- the editor's state and what a user would accept ------------------------------------------------------------


@dataclass
class State:
    t: Target
    i: int  # characters of body typed
    pending: str = ""  # auto-inserted closers after the cursor

    def text(self) -> str:
        return self.t.head + self.t.body[: self.i] + self.pending + self.t.tail

    @property
    def cursor(self) -> int:
        return len(self.t.head) + self.i


def settles(t: Target, i: int, pending: str) -> bool:
    """Whether typing the rest of the cursor's line from `i` with `pending` closers after the cursor (each overtyped
    when the user types it) leaves the line as the solution's: no closer left over, none missing."""
    eol = t.body.find("\n", i)
    eol = len(t.body) if eol < 0 else eol
    stack = list(pending)
    for j in range(i, eol):
        c = t.body[j]
        if stack and stack[0] == c and c in CLOSING:
            stack.pop(0)
        elif j in t.autoclose:
            stack.insert(0, t.autoclose[j])
    return not stack


def accept(st: State, s: policy.Suggestion) -> State | None:
    """The state once the user pressed Tab on `s`, or None where the result is not the solution typed further."""
    text, head, tail = st.text(), st.t.head, st.t.tail
    new = text[: s.start] + s.text + text[s.end :]
    cur = s.start + len(s.text)
    i = cur - len(head)
    if i <= st.i or i > len(st.t.body) or new[:cur] != head + st.t.body[:i] or not new.endswith(tail):
        return None
    pending = new[cur : len(new) - len(tail)]
    if any(c not in CLOSING for c in pending) or not settles(st.t, i, pending):
        return None
    return State(st.t, i, pending)


def oracle_gain(t: Target, i: int, raw: str, multiline: bool, blank: bool) -> int:
    """Characters of what the user types next that the raw answer holds: its first line a prefix of the rest of the
    cursor's line (from column 0 on a blank line: the model wrote the indentation), then whole lines equal to the
    solution's (indentation aside), the last one possibly a prefix. The best a policy could show of it."""
    rest = t.body[i:]
    if not raw.strip():
        return 0
    lines = raw.replace("\r\n", "\n").rstrip().split("\n")
    if not multiline:
        lines = lines[:1]
    want = rest.split("\n")
    got = 0
    for k, ln in enumerate(lines):
        if k >= len(want):
            break
        w = want[k]
        a, b = (ln.strip(), w.strip()) if (k > 0 or blank) else (ln.rstrip(), w)
        if not a:
            if b:
                break
            got += len(w) + 1
            continue
        if not b.startswith(a):
            break
        got += len(w) - len(b) + len(a) if (k > 0 or blank) else len(a)
        if a != b:
            break
        if k + 1 < len(lines):
            got += 1  # the line break
    return got if got > 0 and raw.strip() else 0


# -- the session ----------------------------------------------------------------------------------------------


def _plain(x):
    if hasattr(x, "_asdict"):
        return {k: _plain(v) for k, v in x._asdict().items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


class Editor:
    """The pygls client playing the editor over stdio, one document per problem."""

    def __init__(self, client):
        self.client = client
        self.version = 0
        self.text = ""
        self.uri = ""

    def open(self, uri: str, text: str) -> None:
        from lsprotocol import types as t

        self.uri, self.text, self.version = uri, text, 1
        self.client.text_document_did_open(t.DidOpenTextDocumentParams(
            t.TextDocumentItem(uri=uri, language_id="rust", version=1, text=text)))

    def edit(self, start: int, end: int, new: str) -> None:
        from lsprotocol import types as t

        from m31r_lsp.documents import position_at

        (l0, c0), (l1, c1) = position_at(self.text, start), position_at(self.text, end)
        self.text = self.text[:start] + new + self.text[end:]
        self.version += 1
        self.client.text_document_did_change(t.DidChangeTextDocumentParams(
            text_document=t.VersionedTextDocumentIdentifier(uri=self.uri, version=self.version),
            content_changes=[t.TextDocumentContentChangePartial(
                range=t.Range(t.Position(l0, c0), t.Position(l1, c1)), text=new)]))

    async def inline(self, offset: int) -> list[policy.Suggestion]:
        from lsprotocol import types as t

        from m31r_lsp.documents import offset_at, position_at

        line, ch = position_at(self.text, offset)
        res = await self.client.text_document_inline_completion_async(t.InlineCompletionParams(
            context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic),
            text_document=t.TextDocumentIdentifier(self.uri), position=t.Position(line, ch)))
        items = res.items if isinstance(res, t.InlineCompletionList) else (res or [])
        out = []
        for it in items:
            r = it.range
            a = offset_at(self.text, r.start.line, r.start.character)
            b = offset_at(self.text, r.end.line, r.end.character)
            out.append(policy.Suggestion(it.insert_text if isinstance(it.insert_text, str) else it.insert_text.value,
                                         a, b))
        return out

    async def stats(self) -> dict:
        return _plain(await self.client.protocol.send_request_async("m31r/stats", {}))


async def type_all(sock: Path, tgts: list[Target], settings: dict, autoclose: bool, log) -> list[dict]:
    """Type every target; one event per inline request."""
    client = await start_client("sim-typing", sock, settings)
    ed = Editor(client)
    events: list[dict] = []
    opts = policy.Options(multiline=settings.get("multiline", "auto"), max_tokens=settings["maxTokens"])
    try:
        before = await ed.stats()
        for tg in tgts:
            t0 = time.perf_counter()
            n0 = len(events)
            st = State(tg, tg.start)
            ed.open(f"file:///sim/{tg.name}.rs", st.text())
            last: dict | None = None  # the last event, while its suggestion is still to be judged for flicker
            while True:
                assert ed.text == st.text(), "the simulated editor diverged from the typing script"
                t1 = time.perf_counter()
                items = await ed.inline(st.cursor)
                ms = (time.perf_counter() - t1) * 1000
                after = await ed.stats()
                asked = after.get("daemon_requests", 0) > before.get("daemon_requests", 0)
                ev = event(tg, st, items, before, after, asked, opts)
                ev["ms"] = round(ms, 1)  # (not a score: what the answer took here, for the run's own account)
                before = after
                if last is not None and last.get("expect") is not None:
                    shown_rest = ev["predicted"]
                    if shown_rest != last["expect"]:
                        ev["flicker"] = "vanished" if shown_rest is None else "changed"
                events.append(ev)
                last = ev
                if st.i >= len(tg.body):
                    break
                if ev["accepted"]:
                    s = items[0]
                    ed.edit(s.start, s.end, s.text)
                    st = accept(st, s)
                    last = None
                    continue
                st = keystroke(ed, st, autoclose, ev)
            n = len(events) - n0
            acc = sum(e["accepted"] for e in events[n0:])
            log(f"{tg.name}: {n} requests, {acc} characters accepted, {time.perf_counter() - t0:.1f} s")
    finally:
        await client.shutdown_async(None)
        client.exit(None)
        await client.stop()
    return events


def keystroke(ed: Editor, st: State, autoclose: bool, ev: dict) -> State:
    """Type the next character of the solution as an editor does (and note in `ev` what a shown suggestion that the
    character agrees with should show next: the rest of it, typed through)."""
    tg, i, c = st.t, st.i, st.t.body[st.i]
    cur = st.cursor
    pred = ev["predicted"]
    if c == "\n":
        j = i + 1
        while j < len(tg.body) and tg.body[j] in " \t":
            j += 1
        typed, pending = tg.body[i:j], st.pending
        ed.edit(cur, cur, typed)  # (pending is empty here: closers settle on their line)
        new = State(tg, j, pending)
    elif st.pending and st.pending[0] == c and c in CLOSING:
        ed.edit(cur, cur + 1, c)  # overtype the auto-inserted closer
        typed, new = c, State(tg, i + 1, st.pending[1:])
    elif autoclose and i in tg.autoclose:
        ed.edit(cur, cur, c + tg.autoclose[i])
        typed, new = c, State(tg, i + 1, tg.autoclose[i] + st.pending)
    else:
        ed.edit(cur, cur, c)
        typed, new = c, State(tg, i + 1, st.pending)
    rest = pred[len(typed) :] if pred and pred.startswith(typed) else ""
    if rest.rstrip() and not new.pending.startswith(rest.rstrip()):  # (only closers already there: nothing to show)
        ev["expect"] = rest
    return new


def event(tg: Target, st: State, items: list[policy.Suggestion], before: dict, after: dict, asked: bool,
          opts: policy.Options) -> dict:
    text, cur = st.text(), st.cursor
    p = policy.plan(text, cur, opts)
    ev: dict = {"problem": tg.name, "i": st.i, "line": text[p.cursor.line_start : cur] + "|" + p.cursor.after,
                "shown": None, "predicted": None, "accepted": 0, "asked": asked,
                "unsure": after.get("unsure", 0) > before.get("unsure", 0),
                "source": "typed_through" if after.get("typed_through", 0) > before.get("typed_through", 0) else
                ("model" if asked else None)}
    if items:
        s = items[0]
        ev["shown"] = {"text": s.text, "start": s.start - cur, "end": s.end - cur}
        ev["predicted"] = s.text[cur - s.start :] if s.start <= cur else None
        nxt = accept(st, s)
        ev["accepted"] = nxt.i - st.i if nxt is not None else 0
    if asked:
        raw = after.get("lastRaw") or ""
        ev["raw"] = raw
        blank = p.cursor.blank_line
        floor = (after.get("settings") or {}).get("min_probability", policy.MIN_PROBABILITY)
        sure = policy.confident_lines(raw, after.get("lastLogprobByLine") or [], floor)
        ev["oracle"] = oracle_gain(tg, st.i, sure, p.multiline, blank)  # what the floor lets a policy show
        ev["oracle_unfloored"] = oracle_gain(tg, st.i, raw, p.multiline, blank)
        post = policy.postprocess(p, raw)  # the policy on the raw answer, without the confidence floor
        nxt = accept(st, post) if post is not None else None
        ev["raw_accepted"] = nxt.i - st.i if nxt is not None else 0
    return ev


# -- scores ---------------------------------------------------------------------------------------------------


def score(events: list[dict], tgts: list[Target]) -> dict:
    typed_chars = sum(len(t.body) - t.start for t in tgts)
    shown = [e for e in events if e["shown"]]
    acc = [e for e in shown if e["accepted"]]
    hidden = [e for e in events if not e["shown"] and e.get("raw_accepted")]
    out = {
        "problems": len(tgts), "chars": typed_chars, "requests": len(events),
        "keystrokes": len(events) - 1 * len(tgts),  # every request but each problem's last follows a key or a Tab
        "shown": len(shown), "accepts": len(acc), "accepted_chars": sum(e["accepted"] for e in acc),
        "wrong_shows": len(shown) - len(acc),
        "flicker_changed": sum(e.get("flicker") == "changed" for e in events),
        "flicker_vanished": sum(e.get("flicker") == "vanished" for e in events),
        "hidden_good_floor": sum(1 for e in hidden if e["unsure"]),
        "hidden_good_floor_chars": sum(e["raw_accepted"] for e in hidden if e["unsure"]),
        "hidden_good_policy": sum(1 for e in hidden if not e["unsure"]),
        "floor_cut_lines_chars": sum(e["oracle_unfloored"] - e["oracle"] for e in events
                                     if e.get("oracle_unfloored", 0) > e.get("oracle", 0) and not e["unsure"]),
        "raw_better": sum(1 for e in events if e.get("oracle", 0) > e["accepted"]
                          and not e["unsure"] and (e["shown"] or e.get("oracle", 0) > 0)),
        "raw_better_chars": sum(e["oracle"] - e["accepted"] for e in events
                                if e.get("oracle", 0) > e["accepted"] and not e["unsure"]),
        "daemon_requests": sum(e["asked"] for e in events),
        "typed_through": sum(e["source"] == "typed_through" for e in events),
    }
    out["saved_share"] = round((out["accepted_chars"] - out["accepts"]) / max(1, typed_chars), 4)
    return out


def worst(events: list[dict], n: int) -> list[dict]:
    """The events where the policy or the server lost the most against the raw answer, for a look by hand."""
    bad = [e for e in events if e.get("oracle", 0) > e["accepted"] and not e["unsure"]]
    bad += [e for e in events if e.get("flicker")]
    bad.sort(key=lambda e: -(e.get("oracle", 0) - e["accepted"]))
    return bad[:n]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bundle", type=Path, default=REPO / "release")
    ap.add_argument("--subset", type=int, default=None, help="Type only N problems, spread over the set.")
    ap.add_argument("--max-tokens", type=int, default=64, help="maxTokens (the editors' default: 64).")
    ap.add_argument("--min-probability", type=float, default=None, help="minProbability (default: the server's).")
    ap.add_argument("--multiline", choices=policy.MULTILINE_MODES, default="auto")
    ap.add_argument("--threads", type=int, default=None, help="Daemon torch threads (default: the daemon's).")
    ap.add_argument("--no-autoclose", action="store_true", help="An editor that does not auto-close brackets.")
    ap.add_argument("--worst", type=int, default=10, help="Print the N worst events.")
    ap.add_argument("--out", type=Path, help="Write the results (with every event) as JSON.")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--data", type=Path, default=None,
                    help="Type block bodies of the held-out crates in DATA/corpus/val.jsonl instead of the exec "
                         "problems (--held-out of them, drawn by --seed).")
    ap.add_argument("--held-out", type=int, default=40, help="With --data: how many block bodies.")
    ap.add_argument("--seed", type=int, default=0, help="With --data: which block bodies.")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr)

    tgts = held_out_targets(args.data, args.held_out, args.seed) if args.data else targets(args.subset)
    settings = {"maxTokens": args.max_tokens, "multiline": args.multiline, "debounceMode": "fixed", "debounceMs": 0,
                "deadlineMs": 60000, "autostart": False, "temperature": 0}
    if args.min_probability is not None:
        settings["minProbability"] = args.min_probability
    meta = json.loads((args.bundle / "metadata.json").read_text())
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="m31r-sim-") as tmp:
        os.chmod(tmp, 0o700)
        sock, dlog = Path(tmp) / "m31rd.sock", Path(tmp) / "m31rd.log"
        d = Daemon(args.bundle.resolve(), sock, dlog, ["--threads", str(args.threads)] if args.threads else [])
        try:
            events = asyncio.run(type_all(sock, tgts, settings, not args.no_autoclose, log))
        except BaseException:
            print(dlog.read_text()[-3000:], file=sys.stderr)
            raise
        finally:
            d.stop()
    res = {"meta": {"model": f"{meta.get('model_name')}@{meta.get('model_version')}", "settings": settings,
                    "autoclose": not args.no_autoclose, "subset": args.subset, "cpus": os.cpu_count(),
                    "cpu": describe(), "cpu_flags": sorted(cpu_info()[1]), "platform": platform.platform(),
                    "python": platform.python_version(), "wall_s": round(time.perf_counter() - t0, 1)},
           "scores": score(events, tgts), "worst": worst(events, args.worst)}
    sc = res["scores"]
    print(f"\nsimulated typing: {res['meta']['model']}, {sc['problems']} problems, {sc['chars']} characters to type, "
          f"{res['meta']['wall_s']} s on {res['meta']['cpu']}")
    rows = [("requests (keystrokes + Tabs + ends)", sc["requests"]), ("suggestions shown", sc["shown"]),
            ("accepted (Tab)", sc["accepts"]), ("accepted characters", sc["accepted_chars"]),
            ("characters saved (minus Tabs), share", f"{sc['saved_share']:.1%}"), ("wrong shows", sc["wrong_shows"]),
            ("flicker: changed", sc["flicker_changed"]), ("flicker: vanished", sc["flicker_vanished"]),
            ("hidden-good by the floor (chars)", f"{sc['hidden_good_floor']} ({sc['hidden_good_floor_chars']})"),
            ("hidden-good by the policy", sc["hidden_good_policy"]),
            ("right lines cut by the floor (chars)", sc["floor_cut_lines_chars"]),
            ("raw answer better than shown (chars)", f"{sc['raw_better']} ({sc['raw_better_chars']})"),
            ("daemon requests", sc["daemon_requests"]), ("typed-through answers", sc["typed_through"])]
    w = max(len(r[0]) for r in rows)
    for name, v in rows:
        print(f"  {name:<{w}}  {v:>8}")
    if args.worst and res["worst"]:
        print("\nworst cases (raw answer better than what was shown, and flicker):")
        for e in res["worst"]:
            print(f"  {e['problem']}@{e['i']} {e['line']!r}: shown {e['shown'] and e['shown']['text']!r} "
                  f"raw {e.get('raw')!r} oracle {e.get('oracle')} got {e['accepted']} {e.get('flicker') or ''}")
    print(json.dumps({"meta": {k: v for k, v in res["meta"].items() if k != "cpu_flags"}, "scores": sc}))
    if args.out:
        res["events"] = events
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

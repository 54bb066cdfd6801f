"""LSP benchmark: keystroke → suggestion latency through `m31r lsp`, against the same keystrokes sent to the
daemon directly. Real processes throughout: an m31rd subprocess on a Unix socket, the language server as a
subprocess over stdio, and a pygls client playing the editor.

The typing session is the daemon benchmark's (bench_daemon.py): benchmarks/data/typing_session.rs with one
function body deleted and retyped keystroke by keystroke (characters, Enter with auto-indent, typos fixed
with backspace), each keystroke awaited before the next. Three runs, each on a freshly started daemon so
no run inherits another's prefix cache:

  daemon       each keystroke is one Fim sent with m31r_protocol.Client, built by m31r_protocol.policy exactly as the
               server builds it (prefix/suffix at the cursor, stop, max_tokens, deadline); latency is
               keystroke → Done. The daemon-only figure.
  lsp          each keystroke is a didChange (incremental) followed by textDocument/inlineCompletion (debounce
               0); latency is didChange sent → inlineCompletion answered. The difference to `daemon`,
               keystroke by keystroke, is the LSP layer's own overhead (JSON-RPC over stdio, the document
               update, position conversion, policy, post-processing).
  lsp-default  the same with the server's default debounce (adaptive, 75 ms base): what a user sees.

Random weights make the suggestions noise (often dropped by post-processing); the latency is the real one.

    python benchmarks/bench_lsp.py --out bench-results/lsp.json          # medium shape, like bench_daemon
    python benchmarks/bench_lsp.py --shape tiny --quick                  # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_daemon import Daemon, exit_on_sigterm, keystrokes, make_bundle, pct, session_document  # noqa: E402

from m31r_protocol import policy  # noqa: E402

DOCUMENT = "file:///bench/typing_session.rs"


def edits(before: str, after: str, strokes) -> list[tuple[int, int, str, str, int]]:
    """Per keystroke: (start, end, inserted text, the document after it, cursor offset after it)."""
    text, cursor, out = before + after, len(before), []
    for k in strokes:
        if k.key == "backspace":
            start, end, new = cursor - 1, cursor, ""
        else:
            start, end, new = cursor, cursor, k.text
        text = text[:start] + new + text[end:]
        cursor = start + len(new)
        out.append((start, end, new, text, cursor))
    return out


async def run_daemon(sock: Path, before: str, after: str, strokes, opts: policy.Options) -> dict:
    from m31r_protocol import Client

    samples = []
    async with await Client.connect(sock, client="bench-lsp", timeout=60) as c:
        for _, _, _, text, cursor in edits(before, after, strokes):
            t0 = time.perf_counter()
            plan = policy.plan(text, cursor, opts)
            raw, done = await (await c.fim(**plan.fim_kwargs(), document=DOCUMENT)).collect()
            shown = policy.postprocess(plan, raw) is not None
            samples.append({"ms": (time.perf_counter() - t0) * 1000, "shown": shown, "source": done.source})
    return {"samples": samples}


async def start_client(name: str, sock: Path, settings: dict):
    """A pygls client playing the editor: `m31r lsp` started over stdio on the daemon at `sock`, initialized with
    these m31r settings."""
    from lsprotocol import types as t
    from pygls.lsp.client import LanguageClient

    client = LanguageClient(name, "0")
    client.feature("m31r/status")(lambda ls, params: None)
    await client.start_io(sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(sock))
    await client.initialize_async(t.InitializeParams(capabilities=t.ClientCapabilities(),
                                                     initialization_options={"m31r": settings}))
    client.initialized(t.InitializedParams())
    return client


async def run_lsp(sock: Path, before: str, after: str, strokes, settings: dict) -> dict:
    from lsprotocol import types as t

    from m31r_lsp.documents import position_at

    t0 = time.perf_counter()
    client = await start_client("bench-lsp", sock, settings)
    startup_ms = (time.perf_counter() - t0) * 1000
    text = before + after
    client.text_document_did_open(t.DidOpenTextDocumentParams(
        t.TextDocumentItem(uri=DOCUMENT, language_id="rust", version=1, text=text)))
    samples = []
    asked_before = 0
    try:
        for version, (start, end, new, after_text, cursor) in enumerate(edits(before, after, strokes), start=2):
            (l0, c0), (l1, c1) = position_at(text, start), position_at(text, end)
            line, ch = position_at(after_text, cursor)
            t1 = time.perf_counter()
            client.text_document_did_change(t.DidChangeTextDocumentParams(
                text_document=t.VersionedTextDocumentIdentifier(uri=DOCUMENT, version=version),
                content_changes=[t.TextDocumentContentChangePartial(
                    range=t.Range(t.Position(l0, c0), t.Position(l1, c1)), text=new)]))
            res = await client.text_document_inline_completion_async(t.InlineCompletionParams(
                context=t.InlineCompletionContext(trigger_kind=t.InlineCompletionTriggerKind.Automatic),
                text_document=t.TextDocumentIdentifier(DOCUMENT), position=t.Position(line, ch)))
            ms = (time.perf_counter() - t1) * 1000
            # the server's own measure of its daemon round trip for this keystroke (not timed)
            st = await client.protocol.send_request_async("m31r/stats", {})
            asked = getattr(st, "daemon_requests", 0) > asked_before
            asked_before = getattr(st, "daemon_requests", 0)
            samples.append({"ms": ms, "shown": bool(res and res.items),
                            "daemon_ms": st.daemon.lastLatencyMs if asked else None})
            text = after_text
        stats = await client.protocol.send_request_async("m31r/stats", {})
        stats = {k: getattr(stats, k) for k in stats._fields if k not in ("lastRaw", "lastFim", "settings")}
        stats["daemon"] = dict(stats["daemon"]._asdict())
        # the server's copy of the document must be the editor's, or the figures mean nothing
        final_prefix = (await client.protocol.send_request_async("m31r/stats", {})).lastFim.prefix
        assert after_text.startswith(final_prefix), "the server's document diverged from the client's"
    finally:
        await client.shutdown_async(None)
        client.exit(None)
        await client.stop()
    return {"samples": samples, "startup_ms": startup_ms, "server_stats": stats}


def summarize(name: str, samples: list[dict]) -> dict:
    rest = samples[1:] or samples  # the first keystroke pays the whole prompt's prefill: reported apart
    ms = [s["ms"] for s in rest]
    out = {"run": name, "keystrokes": len(samples), "first_ms": samples[0]["ms"] if samples else None,
           "p50_ms": pct(ms, 50), "p90_ms": pct(ms, 90), "mean_ms": statistics.fmean(ms) if ms else None,
           "shown": sum(s["shown"] for s in samples)}
    own = [s["ms"] - s["daemon_ms"] for s in rest if s.get("daemon_ms") is not None]
    if own:  # keystroke → answer minus the server's own daemon round trip for it: the layer's overhead
        out["self_overhead_p50_ms"], out["self_overhead_p90_ms"] = pct(own, 50), pct(own, 90)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["tiny", "mini", "small", "medium", "large"], default="medium")
    ap.add_argument("--bundle", type=Path, help="Use this bundle instead of a random-init one of --shape.")
    ap.add_argument("--threads", type=int, default=None, help="Daemon torch threads (default: the daemon's).")
    ap.add_argument("--keystrokes", type=int, default=None, help="Limit the typing session to N keystrokes.")
    ap.add_argument("--max-tokens", type=int, default=16, help="maxTokens per suggestion (bench_daemon: 16).")
    ap.add_argument("--quick", action="store_true", help="Smoke test: 25 keystrokes.")
    ap.add_argument("--skip", nargs="*", default=[], choices=["daemon", "lsp", "lsp-default"])
    ap.add_argument("--out", type=Path, help="Write the results as JSON.")
    args = ap.parse_args()
    exit_on_sigterm()
    for name in ("keystrokes", "max_tokens", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")

    before, target, after = session_document()
    strokes = keystrokes(target)
    limit = args.keystrokes if args.keystrokes is not None else (25 if args.quick else None)
    strokes = strokes[:limit]
    opts = policy.Options(max_tokens=args.max_tokens)
    base = {"maxTokens": args.max_tokens, "deadlineMs": opts.deadline_ms, "multiline": "auto", "autostart": False}
    daemon_args = ["--threads", str(args.threads)] if args.threads else []
    from m31r.cpu import describe

    res: dict = {"meta": {"shape": args.shape, "cpus": os.cpu_count(), "cpu": describe(),
                          "platform": platform.platform(),
                          "python": platform.python_version(), "max_tokens": args.max_tokens,
                          "keystrokes": len(strokes), "loadavg_start": os.getloadavg()}, "runs": []}
    raw: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="m31r-bench-lsp-") as tmp:
        tmpd = Path(tmp)
        if args.bundle:
            bundle = args.bundle.resolve()
        else:
            bundle, _ = make_bundle(args.shape, tmpd / "bundle", None,
                                    "float32" if args.shape in ("tiny", "mini") else "bfloat16")
        meta = json.loads((bundle / "metadata.json").read_text())
        res["meta"]["model"] = f"{meta.get('model_name')}@{meta.get('model_version')}"
        res["meta"]["parameters"] = meta.get("parameter_count")
        if not args.bundle:  # random weights are unsure of every line: the server would hide all (README "Confidence")
            base["minProbability"] = 0
        runs = [("daemon", None), ("lsp", {**base, "debounceMode": "fixed", "debounceMs": 0}),
                ("lsp-default", {**base})]
        for name, settings in runs:
            if name in args.skip:
                continue
            sock, log = tmpd / f"{name}.sock", tmpd / f"{name}.log"
            d = Daemon(bundle, sock, log, daemon_args)
            print(f"{name}: daemon ready in {d.ready_s:.1f}s, {len(strokes)} keystrokes", file=sys.stderr)
            try:
                if settings is None:
                    out = asyncio.run(run_daemon(sock, before, after, strokes, opts))
                else:
                    out = asyncio.run(run_lsp(sock, before, after, strokes, settings))
            except BaseException:
                print(log.read_text()[-3000:], file=sys.stderr)
                raise
            finally:
                d.stop()
            raw[name] = out["samples"]
            summary = summarize(name, out["samples"])
            if "server_stats" in out:
                summary["server_startup_ms"] = out["startup_ms"]
                summary["server_stats"] = out["server_stats"]
            res["runs"].append(summary)
    if "daemon" in raw:
        for name in ("lsp", "lsp-default"):
            if name in raw:
                diffs = [b["ms"] - a["ms"] for a, b in zip(raw["daemon"][1:], raw[name][1:], strict=True)]
                res[f"overhead_{name}"] = {"p50_ms": pct(diffs, 50), "p90_ms": pct(diffs, 90)}
    res["meta"]["loadavg_end"] = os.getloadavg()
    res["samples"] = raw

    m = res["meta"]
    print(f"\nm31r lsp benchmark: {m['model']} ({m['parameters']:,} params), {m['keystrokes']} keystrokes, "
          f"maxTokens {m['max_tokens']}, load {m['loadavg_start'][0]:.1f}\nCPU: {m['cpu']}")
    hdr = f"{'run':<12} {'keys':>5} {'1st key':>8} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'shown':>6}"
    print(hdr)
    print("-" * len(hdr))
    f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    for r in res["runs"]:
        print(f"{r['run']:<12} {r['keystrokes']:>5} {f(r['first_ms']):>8} {f(r['p50_ms']):>8} {f(r['p90_ms']):>8} "
              f"{f(r['mean_ms']):>8} {r['shown']:>6}")
    for name in ("lsp", "lsp-default"):
        if f"overhead_{name}" in res:
            o = res[f"overhead_{name}"]
            print(f"overhead {name} vs the daemon-only run (paired per keystroke): p50 {f(o['p50_ms'])} ms, "
                  f"p90 {f(o['p90_ms'])} ms")
    for r in res["runs"]:
        if "self_overhead_p50_ms" in r:
            print(f"overhead {r['run']} vs the server's own daemon round trip (same keystroke): "
                  f"p50 {f(r['self_overhead_p50_ms'])} ms, p90 {f(r['self_overhead_p90_ms'])} ms")
    print("(keystroke → suggestion: daemon = Fim sent → Done; lsp = didChange sent → inlineCompletion answered. "
          "Percentiles exclude the first keystroke, which prefills the whole prompt.)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

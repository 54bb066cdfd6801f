"""`m31r lsp`: the language server editors talk to (pygls, stdio or TCP).

Features
- `textDocument/inlineCompletion` (LSP 3.18; ghost text) and `textDocument/completion` (one item carrying
  the same suggestion, for editors without inline completion).
- Incremental text sync; documents by URI; position encoding negotiated (UTF-16 unless the client offers
  UTF-8 or UTF-32 first).
- Settings from `initializationOptions` and `workspace/didChangeConfiguration` (see settings.py).
- `m31r/status` notifications {state, model, lastLatencyMs} on daemon state changes (and latency, at most
  once a second); a `m31r/stats` request answers counters for diagnostics and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import ipaddress
import json
import logging
import sys
import threading
from collections.abc import Callable
from typing import BinaryIO
from urllib.parse import unquote

from lsprotocol import types
from pygls.capabilities import get_capability
from pygls.io_ import run_async
from pygls.lsp.server import LanguageServer

from m31r_lsp import settings as settings_mod
from m31r_lsp.completion import Completer, Result
from m31r_lsp.context import ProjectContext
from m31r_lsp.daemon_link import EditorLink
from m31r_lsp.documents import UNITS, Lines, first_line
from m31r_lsp.rpc import M31rProtocol, moved_on
from m31r_lsp.settings import EditorSettings
from m31r_protocol import reconnect
from m31r_protocol.policy import Suggestion, word_before
from m31r_protocol.reconnect import LinkConfig
from m31r_protocol.version import VERSION

log = logging.getLogger("m31r_lsp")

STATUS_NOTIFICATION = "m31r/status"
STATS_REQUEST = "m31r/stats"
COMPLETION_TRIGGERS = [".", ":", "(", "{", "[", ",", "="]


def link_config(s: EditorSettings) -> LinkConfig:
    return reconnect.link_config(s.socket, autostart=s.autostart, bundle=s.bundle)


class M31rLanguageServer(LanguageServer):
    def __init__(self, defaults: EditorSettings | None = None):
        super().__init__("m31r-lsp", VERSION, text_document_sync_kind=types.TextDocumentSyncKind.Incremental,
                         protocol_cls=M31rProtocol)
        # The command line's settings (`--socket`, `--bundle`, `--no-autostart`): an empty `socket` or `bundle` in
        # the client's settings goes back to these.
        self.defaults = defaults or EditorSettings()
        self.config = self.defaults
        # What a key left out of a didChangeConfiguration section goes back to: the command line's settings with the
        # client's initializationOptions over them (set by `initialize`).
        self.base = self.defaults
        self.link = EditorLink(link_config(self.config), on_status=self.send_status, tell=self.tell)
        self.completer = Completer(self.link, lambda: self.config, self.document, tell=self.tell,
                                   project=ProjectContext(self.open_documents), lines=self.lines)
        self.initialized = False  # nothing but log/show messages may reach the client before `initialized`
        self._shown_problems: set[str] = set()  # settings problems shown to the user (log_problems)

    # -- helpers ----------------------------------------------------------------------------------------------

    def document(self, uri: str) -> tuple[str, int | None] | None:
        doc = self.workspace.text_documents.get(unquote(uri))
        return None if doc is None else (doc.source, doc.version)

    def lines(self, uri: str, text: str) -> Lines:
        """The line index of `text`: the document's own (its line starts known, kept through edits) while `text` is
        its current text, else a new one (an older snapshot: conversions scan from its start)."""
        doc = self.workspace.text_documents.get(unquote(uri))
        return self.protocol.lines(doc) if doc is not None and doc.source is text else Lines(text)

    def open_documents(self) -> list[tuple[str, str, str]]:
        """(uri, text, languageId) of the open documents."""
        # doc.uri as the editor sent it: pygls keys the documents by the URI unquoted once, and a second unquote (the
        # project context's uri_path) made `a%2520b.rs` (a file named a%20b.rs) `a b.rs`.
        return [(doc.uri, doc.source, doc.language_id or "") for doc in self.workspace.text_documents.values()]

    @property
    def encoding(self) -> str:
        enc = self.workspace.position_encoding
        return str(getattr(enc, "value", enc) or "utf-16")

    def send_status(self, status: dict) -> None:
        self.protocol.notify(STATUS_NOTIFICATION, status)

    def tell(self, message: str) -> None:
        self.window_show_message(types.ShowMessageParams(type=types.MessageType.Warning, message=message))

    def log_problems(self, problems: list[str], key: str | None = None) -> None:
        """Log each problem, and show it (window/showMessage) the first time this session has it (or `key`): Neovim and
        Helix users rarely read the log, and a bad value sent again with every configuration change is not news."""
        for p in problems:
            log.warning("%s", p)
            self.window_log_message(types.LogMessageParams(type=types.MessageType.Warning, message=p))
            # (for a setting: the setting and its bad value, not the value kept, which may change)
            shown = p.partition("; keeping ")[0] if key is None else key
            if shown not in self._shown_problems:
                self._shown_problems.add(shown)
                self.tell(p)

    async def apply_settings(self, raw: object, *, initial: bool = False) -> None:
        """Apply a settings payload: initializationOptions (`initial`: over the command line's settings, and the base
        of what follows) or a didChangeConfiguration section, the client's whole configuration (keys left out: the
        base)."""
        new, problems = settings_mod.apply(self.config, raw, self.defaults,
                                           None if initial else self.base)
        if initial:
            self.base = new
        self.log_problems(problems)
        old, self.config = self.config, new
        self.completer.reconfigured(old, new)
        if link_config(new) != link_config(old):
            await self.link.reconfigure(link_config(new))
            if new.enable and self.initialized:
                self.link.warm_up()
        elif new.enable and not old.enable and self.initialized:
            self.link.warm_up()

    def to_range(self, uri: str, result: Result, start: int, end: int) -> types.Range:
        lines = self.lines(uri, result.text)
        (l0, c0), (l1, c1) = lines.position_at(start, self.encoding), lines.position_at(end, self.encoding)
        return types.Range(types.Position(l0, c0), types.Position(l1, c1))

    async def suggest(self, uri: str, position: types.Position, *, invoked: bool,
                      selected: types.SelectedCompletionInfo | None = None) -> Result | None:
        enc = self.encoding
        doc = self.document(uri)
        if doc is not None and moved_on(uri, doc[1]):  # a didChange was applied before this handler first ran
            self.completer.stats["stale"] += 1
            return None

        def accepted(text: str) -> tuple[str, int, str]:
            """The text with the menu's selected item accepted, and the cursor after it."""
            assert selected is not None
            r = selected.range
            a, b = self.lines(uri, text).span((r.start.line, r.start.character), (r.end.line, r.end.character), enc)
            return text[:a] + selected.text + text[b:], a + len(selected.text), selected.text

        def offset_of(text: str) -> int:
            return self.lines(uri, text).offset_at(position.line, position.character, enc)

        return await self.completer.complete(uri, offset_of, invoked=invoked,
                                             selected=accepted if selected is not None else None)

    async def close(self) -> None:
        """End this server's session (its TCP editor left): cancel the handlers still running and the completion
        jobs, and close the daemon connection, so that nothing of it outlives the editor."""
        pending = [f for f in self.protocol._request_futures.values() if not f.done()]
        for f in pending:
            f.cancel()
        await asyncio.gather(*(f for f in pending if isinstance(f, asyncio.Future)), return_exceptions=True)
        await self.completer.close()
        await self.link.close()
        self.shutdown()  # pygls' own: its thread pool, if a handler started one


def lf(text: str) -> str:
    """An inline suggestion's text with "\n" line breaks whatever the document's: Neovim 0.12 splits the text it
    inserts at "\n" only (`vim.lsp.inline_completion.get`), so each line of a CRLF file's would end in a stray "\r",
    and VS Code writes an inserted text's line breaks as the document's. (Menu items keep the document's: Helix
    inserts a text edit as it is.)"""
    return text.replace("\r\n", "\n").replace("\r", "\n")


class TcpServer:
    """`--tcp`: one editor at a time, each with a server of its own.

    pygls' start_tcp runs every connection on its one server: a second editor took over the first one's transport
    (the first got no more answers), documents and pending requests, and the first connection to end stopped the
    process. Here a connection that comes while an editor is served is told why and closed, and the editor served
    keeps its session; once that editor leaves (`exit`, or the connection just closes), the next one gets a new
    server: no documents, settings or jobs of the last one. One editor per server, as on stdio: a second editor
    sent to a port in use is more likely a mistake than a plan, and each would need its own daemon link anyway.

    A connection whose first line is not LSP framing (`Content-Length:`, `Content-Type:`) is closed unanswered: a
    web page can make the browser POST to a port on 127.0.0.1, and that request must not be read as JSON-RPC."""

    REFUSE_WAIT_S = 5.0  # how long a refused editor gets to send its first message, and then to close
    MAX_FIRST_MESSAGE = 1 << 20  # a refused editor's first message is read (for its id) up to this size

    def __init__(self, host: str, port: int, new_server: Callable[[], M31rLanguageServer]):
        self.host, self.port, self.new_server = host, port, new_server
        self.serving: M31rLanguageServer | None = None

    def run(self) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            asyncio.run(self.serve())

    async def serve(self) -> None:
        try:
            listener = await asyncio.start_server(self.connection, self.host, self.port)
        except OSError as e:  # one line for the user, not asyncio's "[Errno 98] error while attempting to bind"
            why = ("the port is in use (another m31r lsp, or another program?): choose another with --tcp"
                   if e.errno == errno.EADDRINUSE else e.strerror or str(e))
            raise OSError(f"cannot listen on {self.host}:{self.port}: {why}") from None
        async with listener:
            await listener.serve_forever()

    async def connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.readline()
        except (ValueError, ConnectionError):  # a first line over the stream's limit, or a reset
            first = b""
        if not first.lower().startswith(b"content-"):
            log.warning("closed a TCP connection that does not speak LSP (first bytes %r)", first[:16])
            writer.close()
            return
        if self.serving is not None:
            await self.refuse(first, reader, writer)
            return
        self.serving = ls = self.new_server()
        peer = writer.get_extra_info("peername")
        log.info("serving the editor at %s", peer)
        ls.protocol.set_writer(writer)  # type: ignore[arg-type]
        ls.protocol.on_exit = writer.close  # the end of the stream ends the session below
        try:
            await run_async(stop_event=threading.Event(), reader=_Replay(first, reader, ls.protocol),
                            protocol=ls.protocol, logger=log, error_handler=ls.report_server_error)
        except (ConnectionError, EOFError, ValueError) as e:  # a reset, a message cut short, a header over the limit
            log.info("the connection of the editor at %s ended: %r", peer, e)
        finally:
            self.serving = None  # the editor has left: the next one need not wait for the cleanup
            ls.protocol.set_writer(_Gone())
            writer.close()
            await ls.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
            log.info("the editor at %s left (%d asyncio tasks running)", peer, len(asyncio.all_tasks()))

    async def refuse(self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Tell an editor that this server serves another one (window/showMessage, and an error answer to its first
        request, its `initialize`), then close its connection."""
        host, port = writer.get_extra_info("sockname")[:2]
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        why = (f"m31r lsp on {address} already serves another editor (one editor at a time): start another with "
               f"`m31r lsp --tcp {address.rpartition(':')[0]}:<another port>`, or let this editor run `m31r lsp` "
               "itself over stdio")
        log.warning("refused the editor at %s: %s", writer.get_extra_info("peername"), why)
        msg_id: int | str | None = None
        with contextlib.suppress(ValueError, OSError, EOFError, TimeoutError):
            async with asyncio.timeout(self.REFUSE_WAIT_S):
                msg_id = await self._request_id(first, reader)
        out = _frame({"jsonrpc": "2.0", "method": types.WINDOW_SHOW_MESSAGE,
                      "params": {"type": types.MessageType.Error.value, "message": why}})
        if msg_id is not None:
            out += _frame({"jsonrpc": "2.0", "id": msg_id, "error": {
                "code": types.LSPErrorCodes.RequestFailed.value, "message": why, "data": {"retry": False}}})
        try:
            writer.write(out)
            await writer.drain()
            writer.write_eof()
            # Read until the editor closes: closing with its bytes unread would reset the connection, and the
            # editor could lose the answer before reading it.
            async with asyncio.timeout(self.REFUSE_WAIT_S):
                while await reader.read(1 << 16):
                    pass
        except (OSError, TimeoutError):
            pass
        finally:
            writer.close()

    async def _request_id(self, first: bytes, reader: asyncio.StreamReader) -> int | str | None:
        """The id of the request that a connection opens with (`first`: its first header line, already read)."""
        length, line = 0, first
        while line.strip():
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
            line = await reader.readline()
        if not 0 < length <= self.MAX_FIRST_MESSAGE:
            return None
        msg = json.loads(await reader.readexactly(length))
        msg_id = msg.get("id") if isinstance(msg, dict) and "method" in msg else None
        return msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None


def _frame(body: dict) -> bytes:
    data = json.dumps(body).encode()
    return b"Content-Length: %d\r\n\r\n" % len(data) + data


class _Gone:
    """The writer of a session whose editor has left: what its cancelled requests answer goes nowhere."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


class _Replay:
    """A stream reader that gives back a line already read before the rest of the stream.

    Each read first lets the tasks that are ready run: messages that arrived in one read would otherwise all be
    handled before any handler task started, so a request followed by a didChange would read the changed text
    (stdin is read on a thread, which yields anyway)."""

    def __init__(self, line: bytes, reader: asyncio.StreamReader, protocol: M31rProtocol):
        self.line: bytes | None = line
        self.reader = reader
        self.protocol = protocol

    async def readline(self) -> bytes:
        await asyncio.sleep(0)
        if self.line is not None:
            line, self.line = self.line, None
            return line
        return await self.reader.readline()

    async def readexactly(self, n: int) -> bytes:
        await asyncio.sleep(0)
        return self.protocol.readable(await self.reader.readexactly(n))


class _Stdin:
    """stdin as pygls' reader reads it, each message body made readable by the protocol first (`readable`)."""

    def __init__(self, stdin: BinaryIO, protocol: M31rProtocol):
        self.stdin = stdin
        self.protocol = protocol

    def readline(self) -> bytes:
        return self.stdin.readline()

    def read(self, n: int) -> bytes:
        return self.protocol.readable(self.stdin.read(n))


def is_loopback(host: str) -> bool:
    """A loopback name or address (no DNS lookup)."""
    h = host.strip("[]").rstrip(".").lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def create_server(defaults: EditorSettings | None = None) -> M31rLanguageServer:
    server = M31rLanguageServer(defaults)

    @server.feature(types.INITIALIZE)
    async def initialize(ls: M31rLanguageServer, params: types.InitializeParams) -> None:
        await ls.apply_settings(params.initialization_options, initial=True)

    @server.feature(types.INITIALIZED)
    def initialized(ls: M31rLanguageServer, params: types.InitializedParams) -> None:
        ls.initialized = True
        if ls.config.enable:
            ls.link.warm_up()

    @server.feature(types.SHUTDOWN)
    async def shutdown(ls: M31rLanguageServer, params: None) -> None:
        for uri in list(ls.completer.docs):
            ls.completer.closed(uri)
        await ls.link.close()

    @server.feature(types.WORKSPACE_DID_CHANGE_CONFIGURATION)
    async def did_change_configuration(ls: M31rLanguageServer, params: types.DidChangeConfigurationParams) -> None:
        raw = params.settings
        if settings_mod.section(raw) is None and get_capability(ls.client_capabilities,
                                                                 "workspace.configuration", False):
            # A "something changed" notification without values (the pull model): ask for our section, after saying
            # what was wrong with a section that was there.
            misshapen = settings_mod.misshapen(raw)
            ls.log_problems(misshapen)
            try:
                async with asyncio.timeout(5):
                    values = await ls.workspace_configuration_async(
                        types.ConfigurationParams(items=[types.ConfigurationItem(section="m31r")]))
                # null: the client holds no m31r section now (the user removed it), which as a whole configuration
                # means every key back to its initializationOptions value or default, as a pushed {} does (unless
                # the notification carried a section of the wrong shape: a bad value keeps the current settings).
                if values and values[0] is None and not misshapen:
                    raw = {"m31r": {}}
                else:
                    raw = {"m31r": values[0]} if values and isinstance(values[0], dict) else None
            except Exception as e:  # a client that cannot answer keeps the current settings
                log.warning("workspace/configuration failed: %s", e)
                raw = None
        await ls.apply_settings(raw)

    @server.feature(types.TEXT_DOCUMENT_DID_OPEN)
    def did_open(ls: M31rLanguageServer, params: types.DidOpenTextDocumentParams) -> None:
        pass  # pygls stores the document; registering the handler advertises open/close sync

    @server.feature(types.TEXT_DOCUMENT_DID_CHANGE)
    def did_change(ls: M31rLanguageServer, params: types.DidChangeTextDocumentParams) -> None:
        ls.completer.changed(params.text_document.uri, params.text_document.version)

    @server.feature(types.TEXT_DOCUMENT_DID_CLOSE)
    def did_close(ls: M31rLanguageServer, params: types.DidCloseTextDocumentParams) -> None:
        ls.completer.closed(params.text_document.uri)

    @server.feature(types.TEXT_DOCUMENT_INLINE_COMPLETION, types.InlineCompletionOptions())
    async def inline_completion(ls: M31rLanguageServer,
                                params: types.InlineCompletionParams) -> types.InlineCompletionList:
        invoked = params.context.trigger_kind == types.InlineCompletionTriggerKind.Invoked
        selected = params.context.selected_completion_info
        result = await ls.suggest(params.text_document.uri, params.position, invoked=invoked, selected=selected)
        if result is None:
            return types.InlineCompletionList(items=[])
        suggestions = (result.suggestion, *result.alternatives)
        if selected is not None:
            return types.InlineCompletionList(items=after_selected(ls, result, selected, suggestions))
        # The suggestion, then the daemon's runners-up (a beam search's), for the editor to cycle through.
        return types.InlineCompletionList(items=[
            types.InlineCompletionItem(insert_text=lf(s.text),
                                       range=ls.to_range(params.text_document.uri, result, s.start, s.end))
            for s in suggestions])

    @server.feature(types.TEXT_DOCUMENT_COMPLETION, types.CompletionOptions(trigger_characters=COMPLETION_TRIGGERS))
    async def completion(ls: M31rLanguageServer, params: types.CompletionParams) -> types.CompletionList:
        # CompletionTriggerKind.Invoked also means "typing an identifier": always debounce here.
        result = await ls.suggest(params.text_document.uri, params.position, invoked=False)
        if result is None:
            return types.CompletionList(is_incomplete=True, items=[])
        return types.CompletionList(is_incomplete=True, items=[completion_item(ls, result, params)])

    @server.feature(STATS_REQUEST)
    def stats(ls: M31rLanguageServer, params: object) -> dict:
        return {**ls.completer.snapshot(), "daemon": ls.link.editor_status(), "connects": ls.link.connects,
                "positionEncoding": ls.encoding, "settings": dataclasses.asdict(ls.config)}

    return server


def after_selected(ls: M31rLanguageServer, result: Result, selected: types.SelectedCompletionInfo,
                   suggestions: tuple[Suggestion, ...]) -> list[types.InlineCompletionItem]:
    """Inline items while the menu's item is selected (`result` is for the text with it accepted). An editor shows
    beside its menu only items that start with the item's text and replace its range or more (VS Code's
    singleTextEditAugments: "can replace even more"), so each is the item's text and the suggestion, over the item's
    range and, past it, the text the suggestion replaces after the cursor (closers typed ahead: `v.le|)`, `len`
    selected). Such suggestions were dropped: no ghost text beside the menu where the same cursor without it had one."""
    a = result.offset - len(selected.text)  # where the item's text starts in the text it completed
    units = UNITS.get(ls.encoding, UNITS["utf-16"])
    end = selected.range.end
    items: list[types.InlineCompletionItem] = []
    for s in suggestions:
        if not a <= s.start <= result.offset <= s.end:
            continue
        # What it replaces after the cursor is on the cursor's line (policy: a suggestion ends at the cursor or at the
        # line's end), and is the text after the item's range in the document.
        past = units(result.text[result.offset : s.end])
        items.append(types.InlineCompletionItem(
            insert_text=lf(selected.text[: s.start - a] + s.text),
            range=types.Range(selected.range.start, types.Position(end.line, end.character + past))))
    return items


def completion_item(ls: M31rLanguageServer, result: Result, params: types.CompletionParams) -> types.CompletionItem:
    """One item carrying the suggestion. Its edit starts at the word the suggestion starts in (menus filter on the
    word before the cursor), so the item's text is that word's start followed by the suggestion. A suggestion typed
    through starts before the cursor, inside the word typed (`couY█` of "cou█" answered "YF"): an item of the
    suggestion alone ("YF" over "Y") did not match the word "couY" that Helix and Emacs filter by, and left the menu
    on the first keystroke that agreed with it."""
    s, text = result.suggestion, result.text
    start = word_before(text, s.start)  # s.start <= the cursor, text[s.start : cursor] a prefix of s.text
    new_text = text[start : s.start] + s.text
    first = first_line(new_text.strip())
    label = first if len(first) <= 80 else first[:79] + "…"
    doc = ls.workspace.text_documents.get(unquote(params.text_document.uri))
    lang = (doc.language_id if doc is not None else None) or ""
    formats = get_capability(ls.client_capabilities, "text_document.completion.completion_item.documentation_format",
                             []) or []
    documentation: types.MarkupContent | str = (
        types.MarkupContent(kind=types.MarkupKind.Markdown, value=f"```{lang}\n{new_text}\n```")
        if types.MarkupKind.Markdown in formats else new_text)
    return types.CompletionItem(
        label=label or new_text.strip()[:80],
        kind=types.CompletionItemKind.Snippet if first != new_text.strip() else types.CompletionItemKind.Text,
        detail="m31r",
        documentation=documentation,
        preselect=True,
        sort_text="0",
        filter_text=new_text,
        insert_text_format=types.InsertTextFormat.PlainText,
        text_edit=types.TextEdit(range=ls.to_range(params.text_document.uri, result, start, s.end), new_text=new_text),
    )


def tcp_address(tcp: str, allow_remote: bool) -> tuple[str, int]:
    """(host, port) of `--tcp HOST:PORT` (HOST defaults to 127.0.0.1). ValueError for a non-loopback HOST unless
    `allow_remote`: the server reads any open document it is sent and talks to this user's daemon."""
    host, sep, port = tcp.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--tcp expects HOST:PORT, not {tcp!r}")
    if not 0 <= int(port) <= 65535:  # else bind's OverflowError came out as a traceback
        raise ValueError(f"--tcp {tcp}: a port runs from 0 to 65535")
    host = host.strip("[]") or "127.0.0.1"
    if not is_loopback(host):
        if not allow_remote:
            raise ValueError(f"--tcp {tcp}: {host} is not a loopback address, so other machines could connect; "
                             "pass --allow-remote if that is what you want")
        print(f"warning: m31r lsp is listening on {host}:{port}, reachable from other machines: anyone who can "
              "connect gets completions from this user's daemon", file=sys.stderr)
    return host, int(port)


def run(socket: str | None = None, tcp: str | None = None, autostart: bool = True, *, bundle: str | None = None,
        log_level: str = "warning", allow_remote: bool = False) -> None:
    """Serve on stdio, or on TCP at "HOST:PORT" (loopback only unless `allow_remote`). `socket`, `autostart` and
    `bundle` are the defaults that the client's settings may override."""
    address = tcp_address(tcp, allow_remote) if tcp else None
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, log_level.upper(), logging.WARNING),
                        format="m31r-lsp %(levelname)s %(name)s: %(message)s")
    defaults = EditorSettings(socket=settings_mod.expand_path(socket), autostart=autostart,
                              bundle=settings_mod.expand_path(bundle))
    if address:
        TcpServer(*address, lambda: create_server(defaults)).run()
        return
    server = create_server(defaults)
    server.start_io(stdin=_Stdin(sys.stdin.buffer, server.protocol))  # type: ignore[arg-type]
    if server.protocol.exit_status:  # `exit` without `shutdown` first: 1, as LSP says (pygls returns either way)
        sys.exit(server.protocol.exit_status)


def _main() -> None:  # `python -m m31r_lsp [--tcp HOST:PORT] [--socket PATH] [--no-autostart]`
    import argparse

    ap = argparse.ArgumentParser(prog="m31r-lsp", description=__doc__.splitlines()[0])
    ap.add_argument("--socket", default=None)
    ap.add_argument("--tcp", default=None, metavar="HOST:PORT")
    ap.add_argument("--bundle", default=None)
    ap.add_argument("--allow-remote", action="store_true", help="allow --tcp on a non-loopback address")
    ap.add_argument("--no-autostart", action="store_true")
    ap.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    a = ap.parse_args()
    try:
        run(a.socket, a.tcp, not a.no_autostart, bundle=a.bundle, log_level=a.log_level, allow_remote=a.allow_remote)
    except ValueError as e:
        ap.error(str(e))
    except OSError as e:
        sys.exit(f"m31r-lsp: error: {e}")


if __name__ == "__main__":
    _main()

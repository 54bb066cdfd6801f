"""pygls' LanguageServerProtocol with the fixes this server needs.

- Incremental changes are applied on the text with documents.py's line rules. pygls splits lines with
  str.splitlines, which also breaks at form feeds, \\v, \\x1c-\\x1e, U+0085, U+2028 and U+2029, so an edit below
  one of them landed on the wrong line; and it placed an edit past the end of a last line one character early.
  Each document's `documents.Lines` (line starts it knows) is kept with it and carried through the edits (`lines`),
  so that a keystroke's conversions in a long document start near the cursor, not at the start of the text.
- Finished handler futures are dropped: pygls keeps the future of every notification (every keystroke's didChange)
  that a coroutine or generator handled, in `_request_futures`, and never removes it.
- A request notes, as it arrives, the version of the document it names: its position is for that version, and
  `moved_on` tells its handler whether the text it reads is another.
- `exit` over TCP ends that editor's session, not the process (`on_exit`): the server stays for the next editor. On
  stdio the process's status is 0 only after `shutdown`, as LSP says (pygls' start_io swallowed its status: always 0).
- A request after `shutdown` is answered InvalidRequest, and one before `initialize` ServerNotInitialized, as LSP
  says; notifications then are dropped. pygls left a request after `shutdown` unanswered (a client waiting on it
  hung until it gave up) and answered one before `initialize` with an internal error and a traceback. A second
  `initialize` (LSP: sent once) is answered InvalidRequest: pygls made a new workspace for it, and every open
  document was dropped without a word (no completions until each was reopened).
- A request whose params LSP's types refuse (a negative position, one over 2**31 - 1, null) is answered InvalidParams
  naming the field, and such a notification is logged and ignored: pygls failed before reading the message's id, so
  the request was never answered (the editor waited for ever) and the user was shown "Error in server: Invalid
  Params". A client's answer to the server's own request that does not fit its type (workspace/configuration answered
  null) is taken as its plain value, not an error shown to the user with the server's request left waiting.
- A didChange that does not parse leaves that document out of step with the editor's (its edit is lost, and every
  later incremental edit would land in the wrong text): the document is dropped, so it gets no completions rather
  than wrong ones, the user is told once to reopen it, and it is back when it is reopened or a change sends its whole
  text. Before, the edit was dropped and the server went on completing, and applying edits, on the stale text.
- An inlineCompletion's `context.triggerKind` outside LSP 3.18's (1 Invoked, 2 Automatic) is read, not refused: 0 as
  the 3.18 draft's Invoke, anything else as Automatic, logged once (`_known_trigger_kind`). lsprotocol refused it, and
  every request of such a client was answered InvalidParams.
- A `$/cancelRequest` for a request already answered (the answer and the cancel cross, routinely) is not logged as a
  warning, and after `exit` nothing more is written to the closed stdout (the requests still running at `exit`
  wrote a traceback each).
- A message whose body is not UTF-8 (an editor that sends a buffer's invalid bytes as they are) is read with each bad
  byte as U+FFFD (`readable`), where pygls failed in json.loads ("Error in server") and lost it: a request was never
  answered, a didChange's edit was lost silently. The text of a didOpen or didChange so read is not the editor's, so
  that document is dropped as above, and is back once it is reopened, or changed whole, with valid text.
"""

from __future__ import annotations

import contextvars
import json
import logging
import weakref
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote

from cattrs import ClassValidationError, transform_error
from cattrs.v import format_exception
from lsprotocol import types
from pygls.exceptions import JsonRpcException, JsonRpcInvalidParams, JsonRpcInvalidRequest, JsonRpcServerNotInitialized
from pygls.protocol import (
    JsonRPCNotification,
    JsonRPCRequestMessage,
    JsonRPCResponseMessage,
    LanguageServerProtocol,
    lsp_method,
)
from pygls.workspace import TextDocument

from m31r_lsp import documents
from m31r_lsp.context import uri_path

log = logging.getLogger("m31r_lsp.rpc")
INVOKED, AUTOMATIC = types.InlineCompletionTriggerKind.Invoked, types.InlineCompletionTriggerKind.Automatic

# (uri, version) of the document a request names, as the request arrived; the handler's task inherits it.
_received: contextvars.ContextVar[tuple[str, int | None] | None] = contextvars.ContextVar("m31r_received",
                                                                                         default=None)


def moved_on(uri: str, version: int | None) -> bool:
    """Whether document `uri` had another version than `version` when the running request arrived (False when that
    is unknown): its position would then be read in text it was not meant for."""
    got = _received.get()
    return got is not None and got[0] == uri and got[1] != version


@dataclass(frozen=True)
class _Malformed:
    """A request or notification whose params LSP's types refuse: answered (a request) or logged, never handled."""

    method: str
    id: Any  # None for a notification (named as a message's id: the lifecycle refusals answer it alike)
    why: str
    uri: str | None = None  # the document it names, if that much could be read


def _uri_of(data: dict) -> str | None:
    params = data.get("params")
    doc = params.get("textDocument") if isinstance(params, dict) else None
    uri = doc.get("uri") if isinstance(doc, dict) else None
    return uri if isinstance(uri, str) else None


def _why(e: Exception) -> str:
    """What was wrong with a message's params, for a person: each field's problem and where it is."""
    if isinstance(e, ClassValidationError):
        return "; ".join(transform_error(e, format_exception=_field_problem))
    return str(e) or type(e).__name__


def _field_problem(exc: BaseException, type_: Any) -> str:
    # lsprotocol's own checks (a position out of range) say more than cattrs' "invalid value"
    return str(exc).rstrip(".") if isinstance(exc, ValueError) and str(exc) else format_exception(exc, type_)


class M31rProtocol(LanguageServerProtocol):
    # Set for a TCP session: what `exit` does instead of ending the process (which serves the next editor too).
    on_exit: Callable[[], None] | None = None
    # The status the process exits with once `exit` came (None before): 0 after `shutdown`, else 1.
    exit_status: int | None = None
    _initialize_seen = False
    _exited = False  # `exit` came on stdio: stdout is closed, nothing more can be sent

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Each open document's line index; pygls makes a new TextDocument per version, and a closed one's goes with it.
        self._lines: weakref.WeakKeyDictionary[TextDocument, documents.Lines] = weakref.WeakKeyDictionary()
        # Documents dropped because a change to them could not be read: their language id, kept for when a change
        # brings their whole text (keyed as pygls keys documents, by the URI unquoted once).
        self._out_of_step: dict[str, str] = {}
        self._not_utf8 = False  # the message being read had bytes that are not UTF-8 (`readable`)
        self._odd_trigger_kinds: list[Any] = []  # the triggerKind values not LSP 3.18's that were logged (once each)

    def lines(self, doc: TextDocument) -> documents.Lines:
        """The line index of `doc`'s text (made if it has none yet: a didOpen, a full-text change)."""
        got = self._lines.get(doc)
        if got is None or got.text is not doc.source:
            got = self._lines[doc] = documents.Lines(doc.source)
        return got

    @lsp_method(types.EXIT)
    def lsp_exit(self, *args: Any) -> Generator[Any, Any, None]:
        """pygls' handler (sys.exit) on stdio; over TCP, `on_exit`: the editor leaves, the server stays."""
        self.exit_status = 0 if self._shutdown else 1
        if self.on_exit is None:
            self._exited = True  # the requests still running answer as asyncio.run cancels them: to nowhere
            yield from super().lsp_exit(*args)
            return
        if (user_handler := self.fm.features.get(types.EXIT)) is not None:
            yield user_handler, args, None
        self.on_exit()

    def readable(self, body: bytes) -> bytes:
        """A message's body as json.loads reads it: bytes that are not UTF-8 each become U+FFFD, and the message is
        marked (`handle_message` drops a document whose text they were in). Called by the readers for each body, in
        turn with its handling."""
        self._not_utf8 = False
        if body.isascii():
            return body
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            self._not_utf8 = True
            return body.decode("utf-8", "replace").encode("utf-8")
        return body

    def structure_message(self, data: Any) -> Any:
        """pygls' reading of a message, except that a request or notification whose params do not fit becomes a
        _Malformed (pygls raised before the id was read), and an answer to the server's request whose result does not
        fit is taken as its plain value (pygls raised, and the request went on waiting)."""
        if not isinstance(data, dict) or "jsonrpc" not in data or ("id" in data and "error" in data):
            return super().structure_message(data)
        if "method" in data:
            method = data["method"]
            if method == types.TEXT_DOCUMENT_INLINE_COMPLETION:
                data = self._known_trigger_kind(data)
            kind = self.get_message_type(method) or (JsonRPCRequestMessage if "id" in data else JsonRPCNotification)
            try:
                return self._converter.structure(data, kind)
            except Exception as e:
                return _Malformed(str(method), data.get("id"), _why(e), _uri_of(data))
        if "id" in data:
            kind = self._result_types.pop(data["id"], None) or JsonRPCResponseMessage
            try:
                return self._converter.structure(data, kind)
            except Exception as e:
                log.warning("the client's answer to request %s does not fit LSP's type (%s): taken as it is",
                            data["id"], _why(e))
                return self._converter.structure(data, JsonRPCResponseMessage)
        return super().structure_message(data)

    def _known_trigger_kind(self, data: dict) -> dict:
        """An inlineCompletion request with its context's triggerKind one that LSP 3.18 defines (Invoked 1, Automatic
        2). The 3.18 draft (and VS Code's API) numbered them Invoke 0, Automatic 1: 0 can only be that Invoke. Any other
        value (absent, null, 3, a name) is taken as Automatic, the cautious reading (debounced, under the confidence
        floor), and logged once: lsprotocol refused it, so such a client got InvalidParams on every keystroke."""
        params = data.get("params")
        context = params.get("context") if isinstance(params, dict) else None
        kind = context.get("triggerKind") if isinstance(context, dict) else None
        if not isinstance(context, dict) or (kind in (1, 2) and not isinstance(kind, bool)):
            return data
        known = INVOKED if kind == 0 and not isinstance(kind, bool) else AUTOMATIC
        if kind not in self._odd_trigger_kinds and len(self._odd_trigger_kinds) < 16:
            self._odd_trigger_kinds.append(kind)
            why = (f"textDocument/inlineCompletion: triggerKind {json.dumps(kind)} is not LSP 3.18's (1 Invoked, "
                   f"2 Automatic); taken as {known.name}")
            log.warning("%s", why)
            self.notify(types.WINDOW_LOG_MESSAGE, types.LogMessageParams(type=types.MessageType.Warning, message=why))
        return {**data, "params": {**params, "context": {**context, "triggerKind": known.value}}}

    def _send_data(self, data: Any) -> None:
        if not self._exited:
            super()._send_data(data)

    def _handle_cancel_notification(self, msg_id: Any) -> None:
        """pygls' handling, without its warning for a request already answered: editors cancel such requests
        routinely (the cancel crosses the answer), and a warning per keystroke buried the log's news."""
        future = self._request_futures.pop(msg_id, None)
        if future is None:
            log.debug("$/cancelRequest for %r: no such request running (answered already?)", msg_id)
            return
        future.cancel()

    def handle_message(self, msg: Any) -> None:
        """Drop the finished futures first (pygls would keep a notification's for ever), then handle `msg`, unless the
        session's state rules it out (`_refusal`) or its params did not fit (answered InvalidParams, or logged)."""
        for msg_id in [k for k, f in self._request_futures.items() if f.done()]:
            del self._request_futures[msg_id]  # finished: a request's answer is sent by a callback holding its future
        method = getattr(msg, "method", None)
        if isinstance(method, str) and (refusal := self._refusal(method)) is not None:
            if getattr(msg, "id", None) is not None:  # a request: answered with the error; a notification: dropped
                self._send_response(msg.id, None, refusal.to_response_error())
            return
        if isinstance(msg, _Malformed):
            why = f"{msg.method}: invalid params ({msg.why})"
            if msg.id is not None:
                self._send_response(msg.id, None, JsonRpcInvalidParams(why).to_response_error())
            elif not (msg.method == types.TEXT_DOCUMENT_DID_CHANGE and self._drop(msg.uri, why)):
                # nobody to answer: said in the log (the editor's output panel), not shown as the server's error
                log.warning("%s; ignored", why)
                self.notify(types.WINDOW_LOG_MESSAGE,
                            types.LogMessageParams(type=types.MessageType.Warning, message=f"{why}; ignored"))
            return
        if self._not_utf8 and method in (types.TEXT_DOCUMENT_DID_OPEN, types.TEXT_DOCUMENT_DID_CHANGE):
            self._not_in_utf8(msg)
            return
        self._initialize_seen |= method == types.INITIALIZE
        super().handle_message(msg)

    def _not_in_utf8(self, msg: Any) -> None:
        """A didOpen or didChange whose text held bytes that are not UTF-8: the text it gives is not the editor's, so
        the document is dropped (an open one) or left unopened, out of step either way, and the user told."""
        item = msg.params.text_document
        why = f"{msg.method}: its text is not valid UTF-8"
        if self._drop(item.uri, why) or msg.method != types.TEXT_DOCUMENT_DID_OPEN:
            return
        self._out_of_step[unquote(item.uri)] = item.language_id
        self._tell_out_of_step(item.uri, why)

    def _drop(self, uri: str | None, why: str) -> bool:
        """Drop open document `uri`, a change to which could not be read (`why`): it no longer matches the editor's
        text. Closed for the server's handlers too (its completion jobs end). False if no such document is open."""
        if uri is None:
            return False
        try:
            doc = self.workspace.text_documents.get(unquote(uri))
        except RuntimeError:  # not initialized
            return False
        if doc is None:
            return False
        language = doc.language_id or ""
        # Closed as the editor's didClose closes it (the server's handlers end its completion jobs), then marked.
        super().handle_message(types.DidCloseTextDocumentNotification(
            params=types.DidCloseTextDocumentParams(types.TextDocumentIdentifier(uri))))
        self._out_of_step[unquote(uri)] = language
        self._tell_out_of_step(uri, why)
        return True

    def _tell_out_of_step(self, uri: str, why: str) -> None:
        # Shown once a document (keyed by it): a client that sends such changes sends many.
        self._server.log_problems([f"{why}. {_shown_name(uri)} no longer matches the editor's text, so it gets no "
                                   "completions until it is reopened."], key=f"out of step: {unquote(uri)}")

    def _refusal(self, method: str) -> JsonRpcException | None:
        """The error for a message that the session's state rules out (LSP's lifecycle), None for one it takes."""
        if method == types.EXIT:
            return None
        if self._shutdown:
            return JsonRpcInvalidRequest(f"{method}: the server has been shut down; only exit may follow")
        if not self._initialize_seen and method != types.INITIALIZE:
            return JsonRpcServerNotInitialized(f"{method}: the server is not initialized; send initialize first")
        if self._initialize_seen and method == types.INITIALIZE:
            return JsonRpcInvalidRequest(f"{method}: the server is already initialized (initialize is sent once)")
        return None

    def _handle_request(self, msg_id: Any, method_name: str, params: Any) -> None:
        """Note the named document's version now, in message order: the handler runs later."""
        _received.set(self._version_of(params))
        super()._handle_request(msg_id, method_name, params)

    def _version_of(self, params: Any) -> tuple[str, int | None] | None:
        uri = getattr(getattr(params, "text_document", None), "uri", None)
        try:
            doc = self.workspace.text_documents.get(unquote(uri)) if isinstance(uri, str) else None
        except RuntimeError:  # not initialized yet
            return None
        return None if doc is None else (uri, doc.version)

    @lsp_method(types.TEXT_DOCUMENT_DID_OPEN)
    def lsp_text_document__did_open(self, params: types.DidOpenTextDocumentParams) -> Generator[Any, Any, None]:
        self._out_of_step.pop(unquote(params.text_document.uri), None)
        yield from super().lsp_text_document__did_open(params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CLOSE)
    def lsp_text_document__did_close(self, params: types.DidCloseTextDocumentParams) -> Generator[Any, Any, None]:
        self._out_of_step.pop(unquote(params.text_document.uri), None)
        yield from super().lsp_text_document__did_close(params)

    @lsp_method(types.TEXT_DOCUMENT_DID_CHANGE)
    def lsp_text_document__did_change(self, params: types.DidChangeTextDocumentParams) -> Generator[Any, Any, None]:
        """pygls' handler, with the changes applied by documents.edit (the editor's line rules); a document dropped
        out of step (`_drop`) is back from the last change that sends its whole text."""
        key = unquote(params.text_document.uri)
        doc = self.workspace.text_documents.get(key)
        changes = params.content_changes
        if doc is None and key in self._out_of_step:
            whole = [i for i, c in enumerate(changes) if not isinstance(c, types.TextDocumentContentChangePartial)]
            if whole:
                self.workspace.put_text_document(types.TextDocumentItem(
                    uri=params.text_document.uri, language_id=self._out_of_step.pop(key),
                    version=params.text_document.version, text=""))
                changes = changes[whole[-1]:]
                log.info("%s: its whole text came; in step again", _shown_name(params.text_document.uri))
                doc = self.workspace.text_documents.get(key)
        if doc is not None:
            lines, enc = self.lines(doc), self.workspace.position_encoding  # a PositionEncodingKind (a str) or None
            for change in changes:
                if isinstance(change, types.TextDocumentContentChangePartial):
                    r = change.range
                    lines = lines.edit((r.start.line, r.start.character), (r.end.line, r.end.character), change.text,
                                       enc)
                else:
                    lines = documents.Lines(change.text)
            self.workspace.put_text_document(types.TextDocumentItem(
                uri=doc.uri, language_id=doc.language_id or "", version=params.text_document.version, text=lines.text))
            if (new := self.workspace.text_documents.get(unquote(params.text_document.uri))) is not None:
                self._lines[new] = lines
        if (user_handler := self.fm.features.get(types.TEXT_DOCUMENT_DID_CHANGE)) is not None:
            yield user_handler, (params,), None


def _shown_name(uri: str) -> str:
    """A document's name as a user knows it: its path for a file: URI, else the URI."""
    return str(uri_path(uri) or uri)

"""The async client every front end (CLI, LSP, HTTP) uses. It never imports torch.

One connection multiplexes many requests: a reader task routes each event to its request's Stream by id.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

import msgspec

from m31r_protocol import capabilities
from m31r_protocol.connecting import QueueFull, open_unix
from m31r_protocol.framing import FrameTooLarge, pack, read_frame
from m31r_protocol.limits import MAX_FRAME_BYTES
from m31r_protocol.logs import LOG_FILE_BYTES
from m31r_protocol.messages import (
    PROTOCOL_VERSION,
    BusyDetail,
    Cancel,
    Done,
    Error,
    Fim,
    Generate,
    Hello,
    OverflowDetail,
    Sampling,
    ServerMessage,
    Shutdown,
    ShutdownReply,
    Snippet,
    Status,
    StatusReply,
    Token,
    Welcome,
    encoder,
    server_decoder,
)
from m31r_protocol.paths import default_socket_path, socket_path_problem, state_dir
from m31r_protocol.peer import ForeignPeer, check_daemon_owner

T = TypeVar("T")
R = TypeVar("R", bound=msgspec.Struct)


class DaemonError(Exception):
    """The daemon answered a request with an Error. `busy` and `overflow` are its detail (None from an older daemon,
    and for other codes): a front end words its own message from them rather than from `message`."""

    def __init__(self, code: str, message: str, *, busy: BusyDetail | None = None,
                 overflow: OverflowDetail | None = None):
        self.code, self.message, self.busy, self.overflow = code, message, busy, overflow
        super().__init__(f"{code}: {message}")

    @classmethod
    def of(cls, error: Error) -> DaemonError:
        """The exception an Error frame raises, its detail kept."""
        return cls(error.code, error.message, busy=error.busy, overflow=error.overflow)


class ForeignDaemon(DaemonError):
    """The process serving the socket runs as another user: nothing is sent to it (code `forbidden`)."""

    def __init__(self, message: str):
        super().__init__("forbidden", message)


class DaemonUnavailable(ConnectionError):
    """No daemon answers on the socket, or the connection was lost."""


class BadSocketPath(DaemonUnavailable):
    """The socket's path cannot be a Unix socket's (too long for one, or a folder): no daemon can answer there, nor
    be started."""


class SocketUnreachable(DaemonUnavailable):
    """The socket cannot be reached for a reason a started daemon would not mend (a file where a folder should be,
    another user's folder): said with the path, and never answered with an autostart."""


# The most a stream's unread events may hold (their _footprint): its consumer stopped reading without cancelling. A
# legitimate answer holds far less (2048 tokens with 20 alternatives each are about 3 MiB); past it the request is
# cancelled rather than the connection paused, which would stall every other request on it.
STREAM_BUFFER_BYTES = 32 * 1024 * 1024


class StreamOverflow(DaemonError):
    """A stream's unread events passed STREAM_BUFFER_BYTES: the request was cancelled (code `cancelled`), its
    unread events dropped."""

    def __init__(self, rid: int, limit: int):
        super().__init__("cancelled", f"request {rid} was cancelled by this client: its events went unread until they "
                                      f"held over {limit} bytes (read the stream, or cancel it)")


def _footprint(token: Token) -> int:
    """About what an unread Token holds in memory: its objects and its texts."""
    return 128 + len(token.text) + sum(64 + len(c.text) for c in token.top_logprobs)


class Stream:
    """One request's events: iterate for Token events; `done` is set when it ends normally.

    A read that is cancelled (its task cancelled, a timeout around `collect()`) cancels the request, and so does
    dropping the Stream before its end (breaking out of `async for`): the daemon would otherwise go on working for
    nobody. Once the stream has ended, iterating it again ends the same way at once instead of waiting. A stream left
    unread holds at most STREAM_BUFFER_BYTES of events: past that its request is cancelled, and reading it raises
    StreamOverflow."""

    def __init__(self, client: Client, rid: int):
        self.client, self.id = client, rid
        self.queue: asyncio.Queue[ServerMessage | BaseException] = asyncio.Queue()
        self.done: Done | None = None
        self.error: BaseException | None = None  # how it ended, if not with Done
        self.tokens: list[int] = []
        self.open = True  # the daemon may still send for it (its last event has not arrived)
        self.unread = 0  # the _footprint of the Tokens queued and not read yet

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Token:
        if self.done is not None:
            raise StopAsyncIteration
        if self.error is not None:
            raise self.error
        try:
            msg = await self.queue.get()
        except asyncio.CancelledError:
            if self._detach():
                self.client._cancel_nowait(self.id)
            raise
        if isinstance(msg, Token):
            self.unread -= _footprint(msg)
            if msg.token is not None:
                self.tokens.append(msg.token)
            return msg
        if isinstance(msg, Done):
            self.done = msg
            raise StopAsyncIteration
        if isinstance(msg, Error):
            self.error = DaemonError.of(msg)
        elif isinstance(msg, BaseException):
            self.error = msg
        else:
            self.error = DaemonError("internal", f"unexpected {type(msg).__name__} for request {self.id}")
        raise self.error

    async def collect(self) -> tuple[str, Done]:
        text = "".join([t.text async for t in self])
        assert self.done is not None
        return text, self.done

    async def cancel(self) -> None:
        """Ask the daemon to stop this request and detach from it: whatever it still sends, and the tokens it sent
        that were not read yet, are dropped, and iterating the stream further raises DaemonError("cancelled")."""
        if self._detach():
            self.client._cancel_nowait(self.id)

    def _detach(self, why: Error | BaseException | None = None) -> bool:
        """Stop routing the daemon's events here and end the stream with `why` (default: DaemonError("cancelled"));
        False if its last event had already arrived (nothing to cancel)."""
        if not self.open:
            return False
        self.client._forget(self)
        # Tokens that came before the cancel and were not read yet are dropped too (only tokens are queued while the
        # stream is open): a caller that cancelled must not be handed more of the answer it gave up on.
        while not self.queue.empty():
            self.queue.get_nowait()
        self.unread = 0
        self.queue.put_nowait(why or Error(id=self.id, code="cancelled", message="cancelled by this client"))
        return True

    def __del__(self) -> None:
        if getattr(self, "open", False):  # dropped unfinished: the client holds streams weakly, so this runs
            self.client._cancel_soon(self.id)


class Client:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, welcome: Welcome):
        self._reader, self._writer = reader, writer
        self.welcome = welcome
        self._enc = encoder()
        self._dec = server_decoder()
        self._ids = itertools.count(1)
        # Held weakly: a Stream nobody holds any more is dropped, and its __del__ cancels the request.
        self._streams: weakref.WeakValueDictionary[int, Stream] = weakref.WeakValueDictionary()
        self._lock = asyncio.Lock()
        self._can = capabilities.listed(welcome.capabilities)
        self._loop = asyncio.get_running_loop()
        self._closed_here = False  # close() was called: requests in flight end saying so, not blaming the daemon
        self.closed = asyncio.Event()
        # The read loop holds this client weakly, and the finalizer closes the connection: a client dropped without
        # close() is freed at once, and its socket with it. A loop that held it made a cycle with it: the client was
        # freed only by a collection of cycles, whenever one ran, the loop with it while pending ("Task was destroyed
        # but it is pending"), and its connection to the daemon stayed open until then.
        self._reader_task = asyncio.create_task(_read_loop(weakref.ref(self), reader, self._dec))
        _READERS.add(self._reader_task)
        self._reader_task.add_done_callback(_READERS.discard)
        self._finalizer = weakref.finalize(self, _abandon, self._loop, writer)
        self._finalizer.atexit = False

    @classmethod
    async def connect(cls, path: str | Path | None = None, *, client: str = "m31r", timeout: float = 5.0,
                      welcome_timeout: float = 60.0) -> Client:
        """Connect and shake hands. Once the socket accepts, the Welcome may take a while: a socket-activated
        daemon loads its model before it answers, so that wait has its own, longer limit."""
        path = Path(path or default_socket_path())
        if why := socket_path_problem(path):
            raise BadSocketPath(why)
        try:
            reader, writer = await open_unix(path, time.monotonic() + timeout)  # (its own deadline: a full queue)
            try:
                welcome = await _shake_hands(reader, writer, path, client, welcome_timeout)
            except BaseException:
                writer.close()  # whatever ended the handshake (a refusal, a timeout, a cancel), the socket is not kept
                raise
        except DaemonUnavailable:  # (the handshake's own, already worded)
            raise
        except QueueFull as e:  # a daemon holds the socket: none started there would get it
            raise SocketUnreachable(str(e)) from None
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, TimeoutError) as e:
            raise DaemonUnavailable(f"no daemon answers on {path}: {absent_why(e)}") from None
        except OSError as e:  # a connect's error names no file: name the socket, and what the error means here
            raise SocketUnreachable(unreachable(e, path)) from None
        return cls(reader, writer, welcome)

    def _ended(self, error: BaseException | None) -> None:
        """The connection is over (`error`: why, if the daemon or the link said): every request in flight ends."""
        if error is None or self._closed_here:
            error = DaemonUnavailable("this client was closed (Client.close) with the request in flight"
                                      if self._closed_here else "the daemon closed the connection")
        for stream in list(self._streams.values()):
            stream.open = False
            stream.queue.put_nowait(error)
        self._streams.clear()
        self.closed.set()
        self._writer.close()  # nothing more can be read: the daemon may drop this connection's work

    def _route(self, msg: ServerMessage) -> None:
        """Hand `msg` to its request's Stream (a method, so that no local variable keeps a dropped Stream alive)."""
        rid = getattr(msg, "id", None)
        stream = self._streams.get(rid) if rid is not None else None
        if stream is None:
            return  # a request cancelled or dropped here: what the daemon still sent for it is dropped
        if not isinstance(msg, Token):  # its last event: the daemon is done with it
            self._forget(stream)
        elif stream.unread + (cost := _footprint(msg)) > STREAM_BUFFER_BYTES:
            # Nobody reads it: cancelled, never waited for (the read loop serves every request on the connection).
            stream._detach(StreamOverflow(stream.id, STREAM_BUFFER_BYTES))
            self._cancel_nowait(stream.id)
            return
        else:
            stream.unread += cost
        stream.queue.put_nowait(msg)

    def _forget(self, stream: Stream) -> None:
        """Route no more events to `stream`: nothing it can be cancelled for is left (so dropping it sends nothing)."""
        stream.open = False
        self._streams.pop(stream.id, None)

    def _cancel_nowait(self, rid: int) -> None:
        """Send Cancel without awaiting (from a cancelled task): a frame is written whole, so it never splits
        another."""
        if not self._writer.is_closing():  # (the read loop closes it when the connection ends)
            self._writer.write(pack(self._enc.encode(Cancel(id=rid))))

    def _cancel_soon(self, rid: int) -> None:
        """_cancel_nowait from a finalizer, which may run in the middle of another write or on another thread."""
        with contextlib.suppress(RuntimeError):  # the event loop is closed, and so is the connection
            self._loop.call_soon_threadsafe(self._cancel_nowait, rid)

    async def _send(self, msg: msgspec.Struct, *, cancel_id: int | None = None) -> None:
        """Send `msg` whole. Cancelled once it is written (in drain(), a daemon slow to read), its bytes still go
        out: a request (`cancel_id`) is then followed by its Cancel, else the daemon would serve it for nobody."""
        if self.closed.is_set() or self._closed_here:
            raise DaemonUnavailable("this client is closed (Client.close)" if self._closed_here
                                    else "the connection to the daemon is closed")
        try:
            body = self._enc.encode(msg)
        except UnicodeEncodeError as e:  # a lone surrogate: str allows it, UTF-8 (and so MessagePack) does not
            raise DaemonError("bad_request", f"the request's text is not valid Unicode: a lone surrogate at "
                                             f"character {e.start} of one of its strings (bytes that were not "
                                             "UTF-8?)") from None
        if len(body) > MAX_FRAME_BYTES:  # the daemon would close the connection, ending every request on it
            raise DaemonError("frame_too_large", f"the request is {len(body)} bytes as sent, over the protocol's "
                                                 f"{MAX_FRAME_BYTES}-byte limit: send less text")
        async with self._lock:
            try:
                self._writer.write(pack(body))
                await self._writer.drain()
            except asyncio.CancelledError:
                if cancel_id is not None:
                    self._cancel_nowait(cancel_id)
                raise
            except ConnectionError as e:  # the daemon went away since the last read: as the read loop says it
                if not self._closed_here:
                    raise DaemonUnavailable(f"connection to the daemon lost: {e}") from None
            if self._closed_here:  # a drain() that close() ended (by returning, or with the connection's loss)
                raise DaemonUnavailable("this client was closed (Client.close) while sending the request")

    async def _request(self, make: Callable[[int], msgspec.Struct]) -> Stream:
        rid = next(self._ids)
        stream = Stream(self, rid)
        self._streams[rid] = stream
        try:
            await self._send(make(rid), cancel_id=rid)
        except BaseException:
            self._forget(stream)  # never sent, or cancelled by _send: nothing more to do for it
            raise
        return stream

    @property
    def missing(self) -> list[str]:
        """What this install can ask for and the daemon cannot do: it runs an older install (restart_hint)."""
        return capabilities.missing(self.welcome.capabilities)

    def _hint(self, name: str, value: T) -> T | None:
        """A field that changes only how good or how soon the answer is: left out for a daemon that would refuse it
        (m31r_protocol.capabilities), which then answers as it did before the field."""
        return value if name in self._can else None

    def _check_asked(self, name: str, value: object) -> None:
        """A field whose answer the caller asked for: refused here, with the way out, by a daemon that lacks it."""
        if value is not None and name not in self._can:
            raise DaemonError("bad_request", capabilities.restart_hint([name]))

    async def generate(
        self, prompt: str, *, max_tokens: int = 64, sampling: Sampling | None = None, stop: list[str] | None = None,
        seed: int | None = None, truncate: bool = False, deadline_ms: int | None = None,
        lookahead: int | None = None, beams: int | None = None, logprobs: int | None = None,
    ) -> Stream:
        self._check_asked("logprobs", logprobs)
        return await self._request(lambda rid: Generate(
            id=rid, prompt=prompt, max_tokens=max_tokens, sampling=sampling or Sampling(), stop=list(stop or []),
            seed=seed, truncate=truncate, deadline_ms=deadline_ms, lookahead=lookahead,
            beams=self._hint("beams", beams), logprobs=logprobs))

    async def fim(
        self, prefix: str, suffix: str = "", *, document: str = "", max_tokens: int = 64,
        sampling: Sampling | None = None, stop: list[str] | None = None, seed: int | None = None,
        deadline_ms: int | None = None, lookahead: int | None = None, beams: int | None = None,
        context: list[Snippet] | None = None, logprobs: int | None = None, min_probability: float | None = None,
    ) -> Stream:
        self._check_asked("logprobs", logprobs)
        return await self._request(lambda rid: Fim(
            id=rid, prefix=prefix, suffix=suffix, document=document, max_tokens=max_tokens,
            sampling=sampling or Sampling(), stop=list(stop or []), seed=seed, deadline_ms=deadline_ms,
            lookahead=lookahead, beams=self._hint("beams", beams),
            context=self._hint("context", list(context or [])) or [],
            logprobs=logprobs, min_probability=self._hint("min_probability", min_probability)))

    async def _single(self, make: Callable[[int], msgspec.Struct], reply: type[R]) -> R:
        """The one `reply` to a request; DaemonError for anything else the daemon answers (an assert said it before,
        and under `python -O` handed a Token on as a StatusReply)."""
        stream = await self._request(make)
        try:
            msg = await stream.queue.get()
        finally:
            self._forget(stream)  # nothing to cancel (a reply comes at once): dropped, it sends no Cancel
        if isinstance(msg, Error):
            raise DaemonError.of(msg)
        if isinstance(msg, BaseException):
            raise msg
        if not isinstance(msg, reply):
            raise DaemonError("internal", f"the daemon answered request {stream.id} with {type(msg).__name__}, "
                                          f"not {reply.__name__}")
        return msg

    async def status(self) -> StatusReply:
        return await self._single(lambda rid: Status(id=rid), StatusReply)

    async def shutdown(self) -> None:
        await self._single(lambda rid: Shutdown(id=rid), ShutdownReply)

    async def close(self) -> None:
        """Close the connection: every request on it ends, in the daemon too, and here with DaemonUnavailable.

        The socket is aborted, not closed gracefully: a graceful close waits until what is still unsent has been
        written, forever if the daemon reads nothing (stopped). Nothing unsent matters once the connection ends."""
        self._closed_here = True
        self._finalizer.detach()
        self._writer.transport.abort()
        with contextlib.suppress(ConnectionError, BrokenPipeError):
            await self._writer.wait_closed()
        self._reader_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader_task

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# The read loops still running: a loop whose client was dropped is held here until its connection has closed, so
# that it ends rather than being collected while pending.
_READERS: set[asyncio.Task] = set()


async def _read_loop(ref: weakref.ref[Client], reader: asyncio.StreamReader, dec: msgspec.msgpack.Decoder) -> None:
    """Route the daemon's frames to `ref`'s streams until the connection ends. It holds its client only while
    routing a frame: a loop that held it throughout kept a dropped client, and its connection, alive."""
    error: BaseException | None = None
    try:
        while (body := await read_frame(reader)) is not None:
            msg = dec.decode(body)
            if (client := ref()) is None:
                return  # dropped without close(): its finalizer has closed the connection
            if isinstance(msg, Error) and msg.id is None:
                # About the connection, not a request: which request it ended (if any) cannot be told, and a
                # daemon that keeps the connection open (a message it could not read the id of) would leave
                # that request waiting forever. The connection ends here, every request with this error.
                error = DaemonError.of(msg)
                break
            client._route(msg)
            del client
    except (asyncio.IncompleteReadError, OSError, FrameTooLarge, msgspec.DecodeError, UnicodeDecodeError) as e:
        error = DaemonUnavailable(f"connection to the daemon lost: {e}")
    finally:
        if (client := ref()) is not None:
            client._ended(error)


def _abandon(loop: asyncio.AbstractEventLoop, writer: asyncio.StreamWriter) -> None:
    """A Client's finalizer (it was dropped without close()): close its connection, on its loop (a finalizer may run
    on another thread, or in the middle of the loop's own work), so that the daemon drops its work and the read loop
    ends. The callback holds the writer until then: freed unclosed, it would close itself with a ResourceWarning."""
    with contextlib.suppress(RuntimeError):  # the event loop is closed, and so is the connection
        loop.call_soon_threadsafe(_abort, writer)


def _abort(writer: asyncio.StreamWriter) -> None:
    writer.transport.abort()


async def _shake_hands(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: Path, client: str,
                       welcome_timeout: float) -> Welcome:
    """The daemon's Welcome to our Hello, or the exception saying why there is none."""
    try:
        if (sock := writer.get_extra_info("socket")) is not None:
            check_daemon_owner(sock, path)  # before the Hello: a foreign daemon is sent nothing
    except ForeignPeer as e:
        raise ForeignDaemon(str(e)) from None
    try:  # (a reset or the greeting's timeout: worded by `connect`, as the connect's own)
        async with asyncio.timeout(welcome_timeout):
            writer.write(pack(encoder().encode(Hello(protocol=PROTOCOL_VERSION, client=client))))
            await writer.drain()
            body = await read_frame(reader)
    except asyncio.IncompleteReadError:
        body = None
    except FrameTooLarge as e:
        raise DaemonError("bad_request", f"the handshake reply from {path} is not the daemon's: {e}") from None
    if body is None:
        raise DaemonUnavailable(f"the daemon on {path} closed the connection during the handshake")
    try:
        msg = server_decoder().decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:  # e.g. another protocol version's Welcome
        raw = None
        with contextlib.suppress(msgspec.DecodeError, UnicodeDecodeError):
            raw = msgspec.msgpack.decode(body)
        version = raw.get("protocol") if isinstance(raw, dict) else None
        if isinstance(version, int) and version != PROTOCOL_VERSION:
            raise _other_version(path, version) from None
        raise DaemonError("bad_request", f"undecodable handshake reply from {path}: {e}") from None
    if isinstance(msg, Error):
        raise DaemonError.of(msg)
    if not isinstance(msg, Welcome):
        raise DaemonError("bad_request", f"expected Welcome, got {type(msg).__name__}")
    if msg.protocol != PROTOCOL_VERSION:
        raise _other_version(path, msg.protocol)
    return msg


def _other_version(path: Path, version: int) -> DaemonError:
    return DaemonError("unsupported_version", f"the daemon on {path} speaks protocol {version}, this client speaks "
                                              f"{PROTOCOL_VERSION}; upgrade the older side")


# How a client starts a daemon: this interpreter running `m31r daemon`. A command line, never an import: the
# protocol package sits below the daemon and the CLI (README "Layout"). `connect_or_start(daemon_command=...)`
# starts another.
DAEMON_COMMAND = ("-m", "m31r.cli", "daemon")


def unreachable(e: OSError, path: Path) -> str:
    """Why the socket at `path` cannot be connected to, with the way out."""
    why = e.strerror or str(e)
    if isinstance(e, PermissionError):
        why += " (the socket, or a folder on its path, is not yours to use: another user's daemon?)"
    elif isinstance(e, NotADirectoryError):
        why += " (a folder on its path is a file)"
    return f"cannot connect to the daemon on {path}: {why}; choose another socket path (--socket, or M31R_SOCKET)"


def absent_why(e: OSError) -> str:
    """Why no daemon answered, in words: the exception's class name meant nothing to a user."""
    if isinstance(e, FileNotFoundError):
        return "no socket there (no daemon is running)"
    if isinstance(e, ConnectionRefusedError):
        return "nothing listens on it (a daemon that ended left its socket file)"
    if isinstance(e, TimeoutError):  # (the connect's limit, or the greeting's)
        return "it did not answer in time"
    return "it closed the connection at once"


def daemon_log_path() -> Path:
    return state_dir() / "m31rd.log"


def rotate_log(log: Path) -> None:
    """Move `log` to LOG.1 (replacing an older one) once it has grown past LOG_FILE_BYTES. An autostarted daemon
    writes a line per request to it for as long as it runs, and the next one appends to the same file: this, at each
    start, keeps it bounded (a daemon with --log-file rotates its own file as it goes)."""
    with contextlib.suppress(FileNotFoundError):
        if log.stat().st_size > LOG_FILE_BYTES:
            os.replace(log, log.with_name(log.name + ".1"))


def _why_it_exited(own: BinaryIO) -> str:
    """What a daemon that exited at start-up wrote to the log from `own`'s position on: its `m31rd: ` line (the
    reason, said once: the JSON log line before it says the same), else its last 3 lines (a traceback's end)."""
    lines = own.read().decode(errors="replace").strip().splitlines()
    said = [line.removeprefix("m31rd: ") for line in lines if line.startswith("m31rd: ")]
    return said[-1] if said else " / ".join(lines[-3:]) or "(it wrote nothing to its log)"


async def connect_or_start(
    path: str | Path | None = None,
    *,
    autostart: bool = True,
    daemon_args: list[str] | None = None,
    daemon_command: list[str] | None = None,
    client: str = "m31r",
    progress: Callable[[str], None] | None = None,
    timeout: float = 120.0,
) -> Client:
    """Connect to the daemon, starting one in the background first if none answers (and autostart is on).

    `daemon_command` (default: DAEMON_COMMAND) is what starts it, given `--socket PATH` and `daemon_args`.
    `progress` is told once, in one line, that a daemon is being started: the wait is the model's load and warm-up
    (the daemon answers the handshake when warm-up is done, so the first request is served on a warm engine)."""
    path = Path(path or default_socket_path())
    try:
        return await Client.connect(path, client=client)
    except (BadSocketPath, SocketUnreachable):
        raise  # a daemon started there could not listen either
    except DaemonUnavailable:
        if not autostart:
            raise
    log = daemon_log_path()
    log.parent.mkdir(parents=True, exist_ok=True)
    rotate_log(log)
    if progress:
        progress(f"starting the m31r daemon… (socket {path}, log {log})")
    cmd = [*(daemon_command or [sys.executable, *DAEMON_COMMAND]), "--socket", str(path), *(daemon_args or [])]
    # `own` reads what this start writes, from the log's end now on: earlier daemons' lines are not its reasons, and
    # it reads the same file should another start move the log to LOG.1 meanwhile.
    with open(log, "ab") as logf, open(log, "rb") as own:
        own.seek(logf.tell())
        return await _await_start(_Started(cmd, logf), own, path, client, timeout, log)


# The daemon is started by a shell that exits at once, from a subshell it leaves in the background: so it is no
# descendant of this client, which is often an editor's language server, and editors kill a stopped server's whole
# process tree (VS Code's, by parent pid), which took the daemon every editor and CLI shares with it. The subshell
# (one small /bin/sh process while the daemon runs) writes the daemon's pid, then its exit status, to the pipe this
# client gave the shell as stdin (fd 3 from then on: dash redirects no fd above 9, and a client's pipe may be one).
_SPAWN = 'exec 3>&0 </dev/null; ("$@" 3>&- & echo $! >&3; wait $!; echo $? >&3) &'


class _Started:
    """A daemon started in the background, no child of this process: its pid, and its exit status once it ends,
    come from the pipe its waiting subshell writes (read without blocking)."""

    def __init__(self, cmd: list[str], logf: BinaryIO):
        r, w = os.pipe()
        try:
            self._shell = subprocess.Popen(["/bin/sh", "-c", _SPAWN, "sh", *cmd], stdin=w, stdout=logf, stderr=logf,
                                           start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)  # the subshell's copy is the only one left: its end is this pipe's EOF
        os.set_blocking(r, False)
        self._pipe: int | None = r
        self._said = b""
        self.pid: int | None = None
        self.status: int | None = None
        self.eof = False

    def poll(self) -> None:
        """Read what the subshell has written so far; reap the shell that started it (it exits at once)."""
        self._shell.poll()
        while self._pipe is not None:
            try:
                chunk = os.read(self._pipe, 256)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                self.close()
            self._said += chunk
        lines = self._said.split(b"\n")
        with contextlib.suppress(ValueError, IndexError):
            self.pid = int(lines[0]) if len(lines) > 1 else None
            self.status = int(lines[1]) if len(lines) > 2 else None

    def alive(self) -> bool:
        """Whether the daemon may still run: its status is not in, and its waiter did not end without it (killed),
        or did, but the daemon's pid still names a process."""
        self.poll()
        if self.status is not None:
            return False
        if not self.eof:
            return True
        if self.pid is None:
            return False
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):  # (PermissionError: the pid is another user's process now)
            return False
        # Its new parent (init, or a subreaper) may be slow to reap it, or never do: a zombie has ended.
        with contextlib.suppress(OSError, IndexError):
            return Path(f"/proc/{self.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
        return True  # (no /proc: macOS, whose launchd reaps at once)

    def why_ended(self) -> str:
        """How the daemon ended, in words: a shell says 128+N for a daemon killed by signal N."""
        if self.status is None:
            return ("the daemon did not start: the shell that starts it was killed" if self.pid is None else
                    "the daemon ended, its exit status unknown (the shell that waited for it was killed)")
        if self.status > 128:
            with contextlib.suppress(ValueError):
                return f"the daemon was killed by {signal.Signals(self.status - 128).name}"
        return f"the daemon exited with code {self.status}"

    def close(self) -> None:
        if self._pipe is not None:
            os.close(self._pipe)
            self._pipe = None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._shell.wait(1)  # (it exited long since: it only forks the subshell)


async def _await_start(started: _Started, own: BinaryIO, path: Path, client: str, timeout: float,
                       log: Path) -> Client:
    """The started daemon's client once it answers; if it exits first, DaemonUnavailable with what it wrote."""
    t0 = time.monotonic()
    try:
        while (left := timeout - (time.monotonic() - t0)) > 0:
            await asyncio.sleep(0.1)
            try:
                # Once the socket accepts, the Welcome comes when warm-up ends: wait for it as long as the budget
                # allows.
                return await Client.connect(path, client=client, welcome_timeout=max(1.0, left))
            except DaemonUnavailable:
                if not started.alive():
                    # Another client may have won the race to start it: its daemon is then the one to use.
                    with contextlib.suppress(DaemonUnavailable):
                        return await Client.connect(path, client=client)
                    why = _why_it_exited(own)
                    raise DaemonUnavailable(f"{started.why_ended()}: {why}") from None
        raise DaemonUnavailable(f"the daemon did not become ready within {timeout:.0f}s (log: {log})")
    finally:
        started.close()

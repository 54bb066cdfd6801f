"""`m31r lsp` as a process driven over stdio with raw JSON-RPC messages, for the tests that send what a client library
would not (requests out of the session's order, params outside LSP's types, answers that do not fit)."""

from __future__ import annotations

import asyncio
import json
import sys

URI = "file:///work/src/main.rs"


class Stdio:
    """A server process, the messages it sent (read as they come) and, with `stderr`, what it wrote there."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc
        self.got: list[dict] = []

    @classmethod
    async def spawn(cls, sock, stderr: bool = False) -> Stdio:
        """The server, not yet initialized. `stderr`: keep it for `end` (else it is dropped, never left to fill)."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "m31r_lsp", "--no-autostart", "--socket", str(sock), stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE if stderr else asyncio.subprocess.DEVNULL)
        return cls(proc)

    def send(self, method: str, params: object = None, msg_id: int | str | None = None) -> None:
        msg = {"jsonrpc": "2.0", "method": method, "params": params}
        if msg_id is not None:
            msg["id"] = msg_id
        self.write(msg)

    def write(self, msg: dict) -> None:
        body = json.dumps(msg).encode()
        self.proc.stdin.write(b"Content-Length: %d\r\n\r\n" % len(body) + body)

    async def read(self) -> dict:
        length = 0
        while (line := await self.proc.stdout.readline()).strip():
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        return json.loads(await self.proc.stdout.readexactly(length))

    async def answer(self, msg_id: int | str, timeout: float = 20) -> dict:
        """The response to request `msg_id` (the server's notifications and requests on the way are kept)."""
        async with asyncio.timeout(timeout):
            while not any(m.get("id") == msg_id and "method" not in m for m in self.got):
                self.got.append(await self.read())
        return next(m for m in self.got if m.get("id") == msg_id and "method" not in m)

    async def request(self, method: str, params: object, timeout: float = 20) -> dict:
        msg_id = f"r{len(self.got)}-{method}"
        self.send(method, params, msg_id)
        return await self.answer(msg_id, timeout)

    def shown(self) -> list[str]:
        return [m["params"]["message"] for m in self.got if m.get("method") == "window/showMessage"]

    def logged(self) -> list[str]:
        return [m["params"]["message"] for m in self.got if m.get("method") == "window/logMessage"]

    async def exit_status(self) -> int:
        """`exit` without `shutdown`: the status the server exits with."""
        return (await self.end(shutdown=False))[0]

    async def end(self, shutdown: bool = True) -> tuple[int, str]:
        """Shut down (or not) and exit: the exit status and everything the server wrote on stderr (with `spawn(stderr=
        True)`; else "")."""
        if shutdown:
            await self.request("shutdown", None)
        self.send("exit")
        self.proc.stdin.close()
        async with asyncio.timeout(20):
            err = await self.proc.stderr.read() if self.proc.stderr is not None else b""
            return await self.proc.wait(), err.decode()


def inline(line: object, character: object) -> dict:
    """inlineCompletion params at (line, character) of URI, invoked."""
    return {"textDocument": {"uri": URI}, "position": {"line": line, "character": character},
            "context": {"triggerKind": 1}}

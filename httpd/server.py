"""`m31r serve`: the HTTP adapter under uvicorn (on uvloop where installed), loopback unless told otherwise."""

from __future__ import annotations

import errno
import logging
import socket
import sys
from collections.abc import Iterable
from pathlib import Path

from m31r_protocol.logs import log_json  # the daemon's log format: one JSON object per line

log = logging.getLogger("m31r_http")

DEFAULT_PORT = 8731
DEFAULT_MAX_BODY = 1 << 20  # 1 MiB: a large source file; the daemon's own frame limit is 8 MiB
DEFAULT_MAX_TOKENS_CAP = 512
DEFAULT_REQUEST_TIMEOUT = 60.0  # from a request's body being in to its answer's end: the daemon's work (504 past it)
DEFAULT_BODY_TIMEOUT = 30.0  # from a request's headers to its body being in (408 past it)
DEFAULT_HEADER_TIMEOUT = 10.0  # from a connection's start, or its last answer's end, to a request's headers being in
MAX_CONNECTIONS = 512  # uvicorn answers 503 beyond this many concurrent connections


def setup_logging(level: str) -> None:
    log_json(["m31r_http", "uvicorn.error"], level)


def check_bind(host: str, allow_remote: bool) -> bool:
    """True when `host` is loopback; ValueError for another address unless `allow_remote`."""
    from m31r_http.security import is_loopback

    if is_loopback(host):
        return True
    if not allow_remote:
        raise ValueError(f"--host {host} is not a loopback address: the server would be reachable from other "
                         "machines; pass --allow-remote if that is what you want (and consider --token-file)")
    return False


def listen(host: str, port: int) -> list[socket.socket]:
    """The listening sockets, one per address `host` resolves to, as asyncio's create_server would bind them. Bound
    here, before the app starts: its start-up connects to the daemon and may start one, and a port in use must be one
    clear error, not a daemon started for nothing and a log line from deep in the server."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    socks: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # each family on its own socket, as asyncio binds them
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                why = ("the port is in use (another m31r serve, or another program?): choose another with --port"
                       if e.errno == errno.EADDRINUSE else e.strerror or str(e))
                raise OSError(f"cannot listen on {host}:{port}: {why}") from None
            sock.set_inheritable(True)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def run(host: str = "127.0.0.1", port: int = DEFAULT_PORT, socket: str | Path | None = None, *,
        autostart: bool = True, bundle: str | Path | None = None, allow_remote: bool = False,
        allowed_hosts: Iterable[str] = (),
        cors_origins: Iterable[str] = (), token_file: str | Path | None = None, max_body: int = DEFAULT_MAX_BODY,
        max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP, request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        body_timeout: float = DEFAULT_BODY_TIMEOUT, header_timeout: float = DEFAULT_HEADER_TIMEOUT,
        log_level: str = "info") -> int:
    """Serve until SIGINT/SIGTERM. ValueError (before binding) for a bad configuration."""
    from m31r_http.security import check_allowed_host, check_origin, load_token

    loopback = check_bind(host, allow_remote)
    token = load_token(token_file) if token_file is not None else None
    if max_body < 1 or max_tokens_cap < 1 or min(request_timeout, body_timeout, header_timeout) <= 0:
        raise ValueError("--max-body, --max-tokens-cap, --request-timeout, --body-timeout and --header-timeout must "
                         "be positive")
    hosts = [check_allowed_host(h) for h in allowed_hosts]
    cors_origins = [check_origin(o) for o in cors_origins]
    if not loopback and host not in ("0.0.0.0", "::", ""):
        hosts.append(host)  # a specific address: requests naming it are for us

    import uvicorn

    from m31r_http.app import ServeSettings, create_app
    from m31r_http.connection import with_header_timeout

    setup_logging(log_level)
    settings = ServeSettings(socket=socket, autostart=autostart, bundle=bundle, allowed_hosts=tuple(hosts),
                        cors_origins=tuple(cors_origins), token=token, max_body=max_body,
                        max_tokens_cap=max_tokens_cap, request_timeout=request_timeout, body_timeout=body_timeout)
    try:
        import uvloop  # noqa: F401

        loop = "uvloop"
    except ImportError:
        loop = "asyncio"
    # http: uvicorn's h11 protocol with a deadline for request headers (uvicorn has none; connection.py)
    config = uvicorn.Config(create_app(settings), host=host, port=port, loop=loop, lifespan="on",
                            http=with_header_timeout(header_timeout, settings.cors_origins),
                            log_level=log_level, log_config=None, access_log=False, server_header=False,
                            limit_concurrency=MAX_CONNECTIONS, timeout_graceful_shutdown=5)
    socks = listen(host, port)
    if not loopback:  # (once bound: an address that cannot be listened on is an error, not a warning)
        print(f"warning: m31r serve is listening on {host}:{port}, reachable from other machines"
              f"{'' if token else ' without a token (--token-file)'}; requests must name an allowed Host "
              f"({', '.join(hosts) or 'none yet: add --allowed-host'})", file=sys.stderr)
    log.info("serving", extra={"fields": {"url": f"http://{host}:{port}", "socket": str(socket or "default"),
                                          "autostart": autostart, "bundle": str(bundle or "default"),
                                          "token": token is not None,
                                          "cors_origins": list(cors_origins), "max_tokens_cap": max_tokens_cap}})
    server = uvicorn.Server(config)
    server.run(sockets=socks)
    return 0 if server.started else 1

"""Prometheus metrics of the HTTP adapter, plus the daemon's own state (from its Status reply) at scrape time.

One registry per app (never the global one), so tests and several apps in a process do not collide.
"""

from __future__ import annotations

import logging
import math
import time

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from m31r_protocol.messages import StatusReply

log = logging.getLogger("m31r_http")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# The classic text format: what generate_latest writes for plain metric names, and what every scraper reads.
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
STATUS_CLIENT_GONE = 499  # nginx's "client closed request": no response was sent


class Metrics:
    def __init__(self, endpoints: tuple[str, ...]):
        """`endpoints`: the paths counted under their own label when no route answered them (a refusal before
        routing); a routed request is counted under its route's path, `/v1/models/{model}` for any model asked."""
        self.endpoints = frozenset(endpoints)
        disable_created_metrics()  # no `*_created` series: they double the output and nobody here reads them
        r = self.registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=r)  # this server's own CPU and memory (process_*)
        self.requests = Counter("m31r_http_requests", "HTTP requests by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.in_flight = Gauge("m31r_http_requests_in_flight", "HTTP requests being answered.", registry=r)
        self.duration = Histogram("m31r_http_request_duration_seconds", "Time to the response's last byte.",
                                  ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.first_token = Histogram("m31r_http_first_token_seconds",
                                     "Time from the request's arrival to the daemon's first token.",
                                     ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("m31r_prompt_tokens", "Prompt tokens of finished requests (a healed word's "
                                     "included, as the answers' usage counts them).",
                                     ["endpoint"], registry=r)
        self.cached_tokens = Counter("m31r_cached_tokens", "Prompt tokens served from the daemon's prefix cache.",
                                     ["endpoint"], registry=r)
        self.completion_tokens = Counter("m31r_completion_tokens", "Generated tokens of finished requests.",
                                         ["endpoint"], registry=r)
        self.cancelled = Counter("m31r_http_cancelled", "Daemon requests cancelled by the HTTP server.",
                                 ["endpoint", "reason"], registry=r)  # reason: disconnect | timeout | shutdown | error
        self.cancel_outcomes = Counter(
            "m31r_http_cancel_outcomes", "How the daemon ended requests the server cancelled: `cancelled` (ended "
            "early) or `finished` (it had already completed).", ["outcome"], registry=r)
        self.daemon_up = Gauge("m31r_daemon_up", "1 when the daemon answered this scrape's status request.",
                               registry=r)
        self.queue_depth = Gauge("m31r_daemon_queue_depth", "Requests waiting in the daemon's queue.", registry=r)
        self.active = Gauge("m31r_daemon_active_requests", "Requests the daemon is advancing.", registry=r)
        self.cache_hit = Gauge("m31r_daemon_cache_hit_ratio", "Share of prompt tokens served from the prefix cache.",
                               registry=r)
        self.rss = Gauge("m31r_daemon_rss_bytes", "The daemon's resident memory.", registry=r)
        self.daemon_requests = Gauge("m31r_daemon_requests", "Requests the daemon accepted since it started.",
                                     registry=r)
        self.reconnects = Counter("m31r_daemon_connects", "Connections made to the daemon.", registry=r)

    def endpoint(self, scope: Scope) -> str:
        """A request's label: the path of the route Starlette matched (a template such as `/v1/models/{model}`, so
        the labels stay few whatever is asked), else the path if it is an endpoint, else `other` (404s)."""
        if (route := scope.get("route")) is not None and isinstance(getattr(route, "path", None), str):
            return route.path
        return scope["path"] if scope["path"] in self.endpoints else "other"

    def observe_daemon(self, status: StatusReply | None) -> None:
        if status is None:
            self.daemon_up.set(0)
            for g in (self.queue_depth, self.active, self.cache_hit, self.rss, self.daemon_requests):
                g.set(math.nan)
            return
        self.daemon_up.set(1)
        self.queue_depth.set(status.queue)
        self.active.set(status.active)
        self.cache_hit.set(status.cache_hit_rate)
        self.rss.set(status.rss_mb * 2**20)
        self.daemon_requests.set(status.requests)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE


class MetricsMiddleware:
    """Counts every response by endpoint and status (499 when the client left before one was sent), times it,
    and writes one structured log line per request (never its text)."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        m = self.metrics
        t0 = time.perf_counter()
        status = STATUS_CLIENT_GONE

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            await send(message)
            if message["type"] == "http.response.start":  # once sent: a start the server refused is no answer
                status = message["status"]

        m.in_flight.inc()
        try:
            await self.app(scope, receive, send_wrapper)
        except Exception:
            if status == STATUS_CLIENT_GONE:
                status = 500  # the server-error middleware outside answers it
            raise
        finally:
            m.in_flight.dec()
            elapsed = time.perf_counter() - t0
            endpoint = m.endpoint(scope)  # (after the call: the router has put its route in the scope)
            m.requests.labels(endpoint, str(status)).inc()
            m.duration.labels(endpoint).observe(elapsed)
            log.info("request", extra={"fields": {"method": scope["method"], "path": endpoint, "status": status,
                                                  "ms": round(elapsed * 1000, 2)}})

"""The endpoint's Prometheus metrics (`GET /metrics`, text exposition format).

Each `ServeMetrics` has its own registry, so two servers in one process (tests) never share
counts. Names and labels:

    routeweaver_requests_total{status}            finished requests by HTTP status
    routeweaver_request_latency_seconds           histogram of whole-request latency
    routeweaver_router_overhead_seconds           histogram of latency not spent on workers
    routeweaver_mode_total{mode,forced}           routed requests by mode
    routeweaver_worker_calls_total{worker,outcome}  ok | failed | refused (over budget)
    routeweaver_fallback_calls_total{worker}      calls a fallback worker took over
    routeweaver_cost_usd_total                    worker cost billed, USD (every request)
    routeweaver_error_cost_usd_total{kind}        of which by requests that ended in an error
    routeweaver_errors_total{kind}                failed requests by error code
    routeweaver_inflight_requests                 requests running now
    routeweaver_sampler_batch_rows                histogram of rows per sampler batch
    routeweaver_sampler_batch_seconds             histogram of seconds per sampler batch
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 1.5, 2, 3, 4, 6, 8, 12, 20, 30, 60, 120, 300)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128)


class ServeMetrics:
    """The counters of one server (module docstring)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("routeweaver_requests", "finished requests", ["status"],
                                registry=r)
        self.latency = Histogram("routeweaver_request_latency_seconds", "request latency",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.router = Histogram("routeweaver_router_overhead_seconds",
                                "latency not spent waiting for workers",
                                buckets=LATENCY_BUCKETS, registry=r)
        self.modes = Counter("routeweaver_mode", "routed requests by mode", ["mode", "forced"],
                             registry=r)
        self.calls = Counter("routeweaver_worker_calls", "worker calls by outcome",
                             ["worker", "outcome"], registry=r)
        self.fallbacks = Counter("routeweaver_fallback_calls",
                                 "calls a fallback worker took over", ["worker"], registry=r)
        self.cost = Counter("routeweaver_cost_usd", "worker cost billed, USD", registry=r)
        self.error_cost = Counter("routeweaver_error_cost_usd",
                                  "worker cost billed by requests that ended in an error, USD",
                                  ["kind"], registry=r)
        self.errors = Counter("routeweaver_errors", "failed requests by error code", ["kind"],
                              registry=r)
        self.inflight = Gauge("routeweaver_inflight_requests", "requests running now",
                              registry=r)
        self.batch_rows = Histogram("routeweaver_sampler_batch_rows", "rows per sampler batch",
                                    buckets=BATCH_BUCKETS, registry=r)
        self.batch_seconds = Histogram("routeweaver_sampler_batch_seconds",
                                       "seconds per sampler batch", buckets=LATENCY_BUCKETS,
                                       registry=r)

    def routed(self, record: dict[str, Any], error: str | None = None) -> None:
        """Count one routing record: a finished request, or one that ended in the error
        `error` (out of budget, a worker lost, a timeout, a client gone: its mode is None
        when the episode did not finish; its cost counts in both cost counters)."""
        if record["mode"] is not None:
            self.modes.labels(str(record["mode"]), str(record["forced"]).lower()).inc()
        for call in record["calls"]:
            outcome = "refused" if call["refused"] else "ok" if call["success"] else "failed"
            self.calls.labels(call["worker"], outcome).inc()
            if call["fallback_for"] is not None and not call["refused"]:
                self.fallbacks.labels(call["worker"]).inc()
        self.cost.inc(record["total_cost_usd"])
        if error is not None:
            self.error_cost.labels(error).inc(record["total_cost_usd"])
        self.router.observe(record["router_s"])

    def finished(self, status: int, seconds: float, error: str | None = None) -> None:
        self.requests.labels(str(status)).inc()
        self.latency.observe(seconds)
        if error is not None:
            self.errors.labels(error).inc()

    def sampled(self, rows: int, seconds: float) -> None:
        self.batch_rows.observe(rows)
        self.batch_seconds.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

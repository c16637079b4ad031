"""Router metrics. One registry per router instance, so tests can run several in one process.

Request counters are looked up once per (model, code) and kept: prometheus-client's `labels()`
takes a lock and builds a tuple each call, which on the hot path costs more than the counting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from router.client import EARLY_ENDS
from router.outliers import REASONS as EJECTION_REASONS

# Unknown model names come from clients; labelling them as given would let any client create
# series without bound.
UNKNOWN_MODEL = "_unknown"

REFUSAL_REASONS = ("parked", "unplaceable", "overloaded", "removed", "busy")

# From a stub's fraction of a millisecond to a long generation.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "llmgw_router_requests",
            "Requests answered by the router, by model and HTTP status code.",
            ["model", "code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "llmgw_router_request_duration_seconds",
            "Time from a request's arrival to the end of its answer, streams included.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.ttfb = Histogram(
            "llmgw_router_time_to_first_byte_seconds",
            "Time from a request's arrival to the first body byte sent back to the client.",
            ["model"],
            buckets=DURATION_BUCKETS,
            registry=self.registry,
        )
        self.activations = Counter(
            "llmgw_router_activations",
            "Activation attempts (a Nomad scale for a model with no ready replica), by result: "
            "placed, unplaceable, error.",
            ["model", "result"],
            registry=self.registry,
        )
        self.refusals = Counter(
            "llmgw_router_refusals",
            "Requests refused instead of served, by reason: parked, unplaceable, overloaded (too "
            "many already wait for the model), removed (its definition went away meanwhile), busy "
            "(every ready replica at its request limit past the pool wait).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.upstream_failures = Counter(
            "llmgw_router_upstream_failures",
            "Replica failures seen by the router, by phase: connect (retried elsewhere), "
            "closed (closed the connection after the request went out; not sent again), timeout "
            "(no first byte in time), stream (ended the answer with an error).",
            ["model", "phase"],
            registry=self.registry,
        )
        self.ejections = Counter(
            "llmgw_router_ejections",
            "Replicas this router took out of rotation, by reason: consecutive_5xx (5xx answers or "
            "timeouts in a row; out for a back-off that grows with each ejection), connection "
            "(refused or broken; out for a few seconds).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.early_ends = Counter(
            "llmgw_router_early_ends",
            "Requests whose client left before the answer ended, by how far they had come: "
            "waiting (for a replica), upstream (connecting, or waiting for the replica's answer "
            "to start), first_byte (a stream's first event), body (a whole answer being read), "
            "stream (mid-stream); stopped_reading is a client dropped at the write deadline. "
            "Each cancelled its replica's request.",
            ["model", "kind"],
            registry=self.registry,
        )
        self.waiting = Gauge(
            "llmgw_router_waiting_requests",
            "Requests waiting for a replica of the model right now (a cold start); at most "
            "the configured bound, past which requests get 429 model_overloaded.",
            ["model"],
            registry=self.registry,
        )
        self._request_children: dict[tuple[str, int], Any] = {}
        self._duration_children: dict[str, Any] = {}
        self._ttfb_children: dict[str, Any] = {}

    def count_request(self, model: str, code: int, duration_s: float) -> None:
        child = self._request_children.get((model, code))
        if child is None:
            child = self._request_children[(model, code)] = self.requests.labels(model, str(code))
        child.inc()
        hist = self._duration_children.get(model)
        if hist is None:
            hist = self._duration_children[model] = self.duration.labels(model)
        hist.observe(duration_s)

    def observe_ttfb(self, model: str, seconds: float) -> None:
        hist = self._ttfb_children.get(model)
        if hist is None:
            hist = self._ttfb_children[model] = self.ttfb.labels(model)
        hist.observe(seconds)

    def ensure_model(self, model: str) -> None:
        """Make a defined model's activation and refusal series exist at 0, so an alert on
        their rate works before the first event."""
        for result in ("placed", "unplaceable", "error"):
            self.activations.labels(model, result)
        for reason in REFUSAL_REASONS:
            self.refusals.labels(model, reason)
        for kind in EARLY_ENDS:
            self.early_ends.labels(model, kind)
        for why in EJECTION_REASONS:
            self.ejections.labels(model, why)
        self.waiting.labels(model)

    def early_end(self, model: str, kind: str) -> None:
        self.early_ends.labels(model, kind).inc()

    def add_collector(self, collector: Collector) -> None:
        self.registry.register(collector)


class DiscoveryCollector(Collector):
    """Replica counts and Consul freshness, read from the discovery snapshot at scrape time."""

    def __init__(
        self,
        replica_counts: Callable[[], Iterable[tuple[str, str, int]]],
        watch_ages: Callable[[], Iterable[tuple[str, float | None]]],
        consul_up: Callable[[], bool],
        watch_restarts: Callable[[], Iterable[tuple[str, int]]] = lambda: (),
    ) -> None:
        self._replica_counts = replica_counts
        self._watch_ages = watch_ages
        self._consul_up = consul_up
        self._watch_restarts = watch_restarts

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        replicas = GaugeMetricFamily(
            "llmgw_router_replicas",
            "Replicas the router knows from the Consul catalog, by model and state "
            "(ready: every check passing; unready: some check warning or critical; ejected: "
            "failed a request a moment ago).",
            labels=["model", "state"],
        )
        for model, state, count in self._replica_counts():
            replicas.add_metric([model, state], count)
        yield replicas

        age = GaugeMetricFamily(
            "llmgw_router_consul_watch_age_seconds",
            "Seconds since each Consul watch last read successfully; the router serves from "
            "what it read then.",
            labels=["watch"],
        )
        now = time.monotonic()
        for watch, last in self._watch_ages():
            age.add_metric([watch], now - last if last is not None else float("inf"))
        yield age

        up = GaugeMetricFamily(
            "llmgw_router_consul_up",
            "1 while every Consul watch's last attempt succeeded.",
        )
        up.add_metric([], 1.0 if self._consul_up() else 0.0)
        yield up

        restarts = CounterMetricFamily(
            "llmgw_router_watch_restarts",
            "Times a Consul watch died (an answer it could not apply) and was started again; "
            "llmgw_router_consul_up is 0 until it reads again.",
            labels=["watch"],
        )
        for watch, count in self._watch_restarts():
            restarts.add_metric([watch], count)
        yield restarts
